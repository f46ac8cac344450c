"""`bench/vllm_standin.py` keeps the vLLM connector importable where vLLM is not installed
(the GPU hosts that run tests/test_vllm_v1_cuda.py and `kvstash bench vllm-gpu-worker`).
Here, in a fresh interpreter where `import vllm` fails, the connector imports against the
stand-ins, a worker saves two chunks from CPU tensors in vLLM's layout, and a second worker
loads them into other blocks bit for bit; the stand-ins leave `sys.modules` again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, time
from types import SimpleNamespace

class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("no vLLM here")

sys.meta_path.insert(0, NoVllm())
import numpy as np
import torch
from bench.vllm_standin import import_connector, worker_config

mod = import_connector()
assert not any(n == "vllm" or n.startswith("vllm.") for n in sys.modules), "stand-ins left"
store, BLOCK, CHUNK_BLOCKS = sys.argv[1], 16, 4

def worker():
    cfg = worker_config(store, BLOCK, model="test/standin", chunk_tokens=BLOCK * CHUNK_BLOCKS,
                        load_mode="async", adaptive=False)
    w = mod.KvstashConnector(cfg, mod.KVConnectorRole.WORKER, SimpleNamespace(num_blocks=32))
    kv = {f"layers.{i}.attn": torch.zeros(2, 32, BLOCK, 2, 8, dtype=torch.bfloat16)
          for i in range(3)}
    w.register_kv_caches(kv)
    return w, kv

def chunks(ids):
    return [mod.ChunkRef(block_hash=f"c{i}".encode().ljust(32, b"."),
                         token_bytes=(np.arange(BLOCK * CHUNK_BLOCKS, dtype="<u4") + 1000 * i).tobytes(),
                         block_ids=b) for i, b in enumerate(ids)]

src, dst = [[1, 2, 3, 4], [5, 6, 7, 8]], [[20, 21, 22, 23], [9, 30, 11, 12]]
a, kv_a = worker()
for t in kv_a.values():
    t[:, 1:9] = torch.randn(2, 8, BLOCK, 2, 8).to(t.dtype)
a.bind_connector_metadata(mod.KvstashMetadata(saves=[mod.ReqChunks("w", chunks(src))]))
for name, t in kv_a.items():
    a.save_kv_layer(name, t, None)
a.wait_for_save()
a.clear_connector_metadata()
assert a.flush(30)
a.shutdown()

b, kv_b = worker()
b.bind_connector_metadata(mod.KvstashMetadata(loads=[mod.ReqChunks("r", chunks(dst), 30.0)]))
b.start_load_kv(None)
b.wait_for_save()
deadline = time.monotonic() + 30
while True:
    _, done = b.get_finished(set())
    assert not b.get_block_ids_with_load_errors()
    b.clear_connector_metadata()
    if done and "r" in done:
        break
    assert time.monotonic() < deadline, "load never reported done"
    b.bind_connector_metadata(mod.KvstashMetadata())
    time.sleep(0.005)
for name in kv_a:
    for s, d in zip(src, dst):
        assert torch.equal(kv_a[name][:, s].view(torch.int16), kv_b[name][:, d].view(torch.int16))
b.shutdown()
print("ok", b.counters["loaded_chunks"])
"""


def test_the_connector_runs_against_the_stand_ins_where_vllm_cannot_be_imported(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, f"file://{tmp_path}/kv"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok 2"
