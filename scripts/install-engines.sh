#!/usr/bin/env bash
# Install the inference engines the connector tests import (vLLM 0.33.0, SGLang 0.5.23)
# into the project venv, WITHOUT their dependency pins: both pin a CUDA torch (and vLLM
# also transformers/fastapi versions) that would replace the local CPU torch 2.13.
# Only the pure-Python packages their connector / storage modules import are added, from
# the `vllm` and `sglang` extras in pyproject.toml. Idempotent: when everything is there
# it only reads package metadata and exits in about a second.
#
#   scripts/install-engines.sh                        # vLLM and SGLang
#   KVSTASH_ENGINES=vllm scripts/install-engines.sh   # vLLM only (SGLang adds ~1 GB: triton)
#
# Env: VENV (default .venv), KVSTASH_ENGINES (default "vllm sglang").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt)
ENGINES=${KVSTASH_ENGINES:-vllm sglang}

# Installed = the engine at its pinned version plus every package of its extra, checked
# from metadata only (importing vLLM takes ~10 s).
CHECK='
import importlib.metadata as m, sys, tomllib
from packaging.requirements import Requirement
engine, version = sys.argv[1:]
assert m.version(engine) == version
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][engine]
for req in map(Requirement, extra):
    assert m.version(req.name) in req.specifier
'
installed() { "$PY" -c "$CHECK" "$1" "$2" >/dev/null 2>&1; }

for engine in $ENGINES; do
  case $engine in
    vllm)
      version=0.33.0
      # xgrammar would pull triton (1 GB) that the connector modules never import.
      nodeps=("vllm==$version" "xgrammar==0.2.8" apache-tvm-ffi)
      ;;
    sglang)
      version=0.5.23
      # sglang.srt.utils imports triton at module level (it imports fine without a GPU).
      nodeps=("sglang==$version" triton)
      ;;
    *) echo "unknown engine '$engine' (known: vllm sglang)" >&2; exit 2 ;;
  esac
  if installed "$engine" "$version"; then
    echo "$engine $version: already installed"
    continue
  fi
  "${PIP[@]}" -e ".[$engine]"
  # pip lists every ignored pin (torch, transformers, CUDA kernels, ...) as a "dependency
  # conflict" here; that is the point of --no-deps, so those lines are dropped and the
  # check below decides success (pipefail keeps pip's own exit status).
  "${PIP[@]}" --no-deps "${nodeps[@]}" 2>&1 \
    | { grep -vE "dependency resolver does not|requires .*(not installed|incompatible)" || true; }
  installed "$engine" "$version" || { echo "$engine $version: install incomplete" >&2; exit 1; }
  echo "$engine $version: installed"
done
