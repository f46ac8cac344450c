#!/usr/bin/env bash
# The checks that need a GPU, in one run: the CUDA tests of gds/ and the connectors, then
# `kvstash bench gds` (page-cached and cold), `kvstash bench ttft --device cuda` and
# `kvstash bench vllm-gpu-worker`.
#
#   scripts/gpu-check.sh [OUT_DIR]      # from the repository root, kvstash importable
#
# Needs a CUDA torch and kvstash's dependencies (`pip install -e '.[engine,test]'` beside
# the CUDA torch). KVSTASH_GPU_DIR (default ~/.kvstash-gpu-check) must be on the disk the
# store will use, not tmpfs: cuFile needs O_DIRECT. PYTHON picks the interpreter. Each step
# runs even if one before it failed; the exit status is 1 if any failed. JSON lands in
# OUT_DIR (default gpu-check/).
set -u
out=${1:-gpu-check}
dir=${KVSTASH_GPU_DIR:-$HOME/.kvstash-gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out" "$dir"
status=0

step() {
    echo "== $*"
    local started=$SECONDS
    "$@"
    local rc=$?
    echo "== exit $rc after $((SECONDS - started)) s"
    [ $rc -eq 0 ] || status=1
}

step nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
step df -T "$dir"
step "$py" - "$dir" <<'EOF'
import os
import sys

import torch
from gds import probe
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
print("cuFile driver (/dev/nvidia-fs*):", sorted(p for p in os.listdir("/dev") if p.startswith("nvidia-fs")))
print("probe:", probe(sys.argv[1]))
EOF
step "$py" -m pytest -q -p no:cacheprovider tests/test_gds_cuda.py tests/test_gds_selection.py \
    tests/test_gds_host_reads.py tests/test_gds_bounce.py tests/test_gds_bench.py \
    tests/test_connector_direct.py tests/test_hf_prefill.py tests/test_vllm_v1_cuda.py
if ! ls /dev/nvidia-fs* >/dev/null 2>&1; then
    # No GDS kernel driver: cuFile can still read in compatibility mode (POSIX reads into
    # its own bounce buffers) where its config allows it. Run the CUDA tests through it.
    printf '{"properties": {"allow_compat_mode": true}}\n' >"$dir/cufile-compat.json"
    CUFILE_ENV_PATH_JSON="$dir/cufile-compat.json" step "$py" -m pytest -q -p no:cacheprovider \
        tests/test_gds_cuda.py -rA
fi
step "$py" -m kvstash.cli bench gds --dir "$dir/gds" --json "$out/gds-gpu.json"
step "$py" -m kvstash.cli bench gds --dir "$dir/gds" --cold --rounds 5 --json "$out/gds-gpu-cold.json"
rm -rf "$dir/gds"
# The connector's load-vs-recompute policy first (what an engine gets), then every hit
# loaded (what a load costs against recomputing on this GPU).
step "$py" -m kvstash.cli bench ttft --device cuda --model llama-1.5b \
    --prompt-tokens 4096 --cached-tokens 3584 --repeat 7 --store "file://$dir/store" \
    --json "$out/ttft-gpu.json"
step "$py" -m kvstash.cli bench ttft --device cuda --model llama-1.5b --always-load \
    --prompt-tokens 4096 --cached-tokens 3584 --repeat 7 --store "file://$dir/store" \
    --json "$out/ttft-gpu-always-load.json"
rm -rf "$dir/store"
# The vLLM connector's worker on CUDA tensors (vLLM's base classes stood in where vLLM is
# not installed): loads against the store's read and a step's compute.
step "$py" -m kvstash.cli bench vllm-gpu-worker --dir "$dir/worker" --json "$out/vllm-gpu-worker.json"
rm -rf "$dir/worker"
exit $status
