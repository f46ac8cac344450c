"""`kvstash bench vllm-gpu-worker`: the vLLM connector's worker side on a GPU, against the
step's compute alone and the store's own read of the same chunks.

The bench plays vLLM's model runner around the connector's worker (bind the step's
metadata, each attention layer's hooks, `get_finished`) over a paged KV cache of CUDA
tensors in vLLM's FlashAttention layout; each layer's attention is a spin kernel of
`--layer-ms` on the engine's stream. It needs no vLLM: where none is installed (the GPU
hosts it ran on have no package registry, and vLLM's CUDA build is too large to carry
there), the connector is imported against `bench.vllm_standin`. A first worker saves
`--chunks` chunks to a `file://` store (page-cached); a second one loads them, every
round into other blocks, and every round's blocks are checked bit for bit.

Rows (medians over `--repeat` rounds):

- compute: a step of `--layers` layers with no load;
- read: the store's batched read of the chunks into host memory (`get_into_many`);
- ideal: max(read, compute), what a perfect overlap of the two would give;
- layerwise: a step whose load runs layer by layer beside it (the scheduler's `sync`
  loads): its time against the ideal;
- async, idle GPU: a load between steps, from `start_load_kv` until `get_finished` reports
  it, against the read;
- async, busy GPU: the same while the engine's stream runs a `--busy-ms` forward of other
  requests (queued just before the load starts, as vLLM does).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from bench.vllm_standin import worker_config

BLOCK = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--chunks", type=int, default=8, help="chunks loaded per round (default 8)")
    p.add_argument("--layer-ms", type=float, default=1.0,
                   help="each layer's compute in a step (spin kernel, default 1 ms)")
    p.add_argument("--busy-ms", type=float, default=100.0,
                   help="the other requests' forward running as an async load starts")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", help="store directory (default: a temporary one)")
    p.add_argument("--json", metavar="PATH", help="write the results here")


class _Bench:
    def __init__(self, args: argparse.Namespace, store: str):
        import torch

        from bench.vllm_standin import import_connector

        self.torch = torch
        self.mod = import_connector()
        self.args = args
        self.chunk_blocks = args.chunk_tokens // BLOCK
        self.num_blocks = 1 + 3 * args.chunks * self.chunk_blocks
        self.store = store
        self.salt = uuid.uuid4().hex  # this run's key space: a reused --dir holds no match
        self.cycles_per_ms = self._calibrate()

    def worker(self) -> tuple[Any, dict[str, Any]]:
        a, torch = self.args, self.torch
        cfg = worker_config(self.store, BLOCK, model="bench/gpu-worker", adaptive=False,
                            chunk_tokens=a.chunk_tokens, salt=self.salt)
        worker = self.mod.KvstashConnector(cfg, self.mod.KVConnectorRole.WORKER,
                                           SimpleNamespace(num_blocks=self.num_blocks))
        kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(
            2, self.num_blocks, BLOCK, a.kv_heads, a.head_dim, dtype=torch.bfloat16,
            device="cuda") for i in range(a.layers)}
        worker.register_kv_caches(kv)
        return worker, kv

    def chunks(self, block_ids: list[int]) -> list[Any]:
        n = self.chunk_blocks
        out = []
        for i in range(self.args.chunks):
            tokens = np.arange(self.args.chunk_tokens, dtype="<u4") + i * self.args.chunk_tokens
            out.append(self.mod.ChunkRef(block_hash=f"chunk {i}".encode().ljust(32, b"."),
                                         token_bytes=tokens.tobytes(),
                                         block_ids=block_ids[i * n:(i + 1) * n]))
        return out

    def blocks(self, n: int, kv: dict) -> list[int]:
        """The n-th load's blocks, zeroed first (on the engine's stream, so behind any
        forward queued before): one of two sets, the second in reverse order."""
        size = self.args.chunks * self.chunk_blocks
        ids = list(range(1 + size, 1 + 2 * size)) if n % 2 else list(range(1 + 2 * size, 1 + 3 * size))[::-1]
        idx = self.torch.tensor(ids, device="cuda")
        for t in kv.values():
            t.index_fill_(1, idx, 0)
        return ids

    def _calibrate(self) -> float:
        torch = self.torch
        torch.cuda._sleep(1_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        return 50_000_000 / start.elapsed_time(end)

    def spin(self, ms: float) -> None:
        self.torch.cuda._sleep(int(ms * self.cycles_per_ms))

    def save(self) -> tuple[list[str], list[Any]]:
        """The writer: a step whose forward writes the chunks' blocks, then saves them."""
        torch = self.torch
        worker, kv = self.worker()
        try:
            refs = self.chunks(list(range(1, 1 + self.args.chunks * self.chunk_blocks)))
            ids = torch.tensor([b for c in refs for b in c.block_ids], device="cuda")
            for t in kv.values():
                t[:, ids] = torch.randn(2, len(ids), *t.shape[2:], device="cuda").to(t.dtype)
            worker.bind_connector_metadata(self.mod.KvstashMetadata(
                saves=[self.mod.ReqChunks("writer", refs)]))
            for name, t in kv.items():
                worker.save_kv_layer(name, t, None)
            worker.wait_for_save()
            worker.clear_connector_metadata()
            if not worker.flush(120):
                raise RuntimeError("the writer's saves were not written within 120 s")
            keys = worker.connector_worker.keys(refs, 0)
            want = [t[:, ids].view(torch.int16).cpu() for t in kv.values()]
            return keys, want
        finally:
            worker.shutdown()

    def step(self, worker: Any, kv: dict, loads: list[Any], busy_ms: float) -> float:
        """One step of vLLM's model runner: bind, (sync loads) start, each layer's wait and
        compute, (async loads) start after the forward is queued, wait_for_save. Returns
        when `start_load_kv` was called (perf_counter)."""
        worker.bind_connector_metadata(self.mod.KvstashMetadata(loads=loads))
        sync = any(r.sync for r in loads)
        started = time.perf_counter()
        if sync:
            worker.start_load_kv(None)
        self.spin(busy_ms)
        for name in kv:
            worker.wait_for_layer_load(name)
            self.spin(self.args.layer_ms if sync or not loads else 0)
        if not sync:
            started = time.perf_counter()
            worker.start_load_kv(None)
        worker.wait_for_save()
        return started

    def finish(self, worker: Any, req_id: str | None) -> set[int]:
        """get_finished until `req_id` (an async load) is reported; the failed block ids."""
        errors: set[int] = set()
        while True:
            _, done = worker.get_finished(set())
            errors |= worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            if req_id is None or req_id in (done or set()):
                return errors
            worker.bind_connector_metadata(self.mod.KvstashMetadata())
            time.sleep(0.0002)

    def check(self, kv: dict, ids: list[int], want: list[Any]) -> bool:
        idx = self.torch.tensor(ids, device="cuda")
        return all(self.torch.equal(t[:, idx].view(self.torch.int16).cpu(), w)
                   for t, w in zip(kv.values(), want, strict=True))


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.vllm_layers import _load_seconds

    if not torch.cuda.is_available():
        raise RuntimeError("bench vllm-gpu-worker needs a CUDA GPU")
    if args.chunk_tokens % BLOCK:
        raise ValueError(f"--chunk-tokens must be a multiple of {BLOCK}")
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvstash-bench-gpu-worker-"))
    b = _Bench(args, f"file://{root}/kv")
    keys, want = b.save()
    nbytes = sum(w.numel() * 2 for w in want)
    worker, kv = b.worker()
    rows: list[dict[str, Any]] = []
    exact = True
    loads = 0
    try:
        for r in range(args.repeat + 1):  # round 0 warms up (staging buffers, streams)
            row: dict[str, Any] = {}
            t0 = time.perf_counter()
            b.step(worker, kv, [], 0.0)
            torch.cuda.synchronize()
            b.finish(worker, None)
            row["compute_s"] = time.perf_counter() - t0
            row["read_s"] = _load_seconds(b.store, keys, nbytes // len(keys), 8)
            for mode, busy in (("layerwise", 0.0), ("async_idle", 0.0), ("async_busy", args.busy_ms)):
                ids = b.blocks(loads, kv)
                loads += 1
                req = b.mod.ReqChunks(f"{mode}-{r}", b.chunks(ids), deadline_s=60.0,
                                      sync=mode == "layerwise")
                t0 = time.perf_counter()
                started = b.step(worker, kv, [req], busy)
                if mode == "layerwise":
                    torch.cuda.synchronize()
                    failed = b.finish(worker, None)
                    row[f"{mode}_s"] = time.perf_counter() - t0
                else:
                    failed = b.finish(worker, req.req_id)
                    row[f"{mode}_s"] = time.perf_counter() - started
                    torch.cuda.synchronize()
                ok = not failed and b.check(kv, ids, want)
                exact &= ok
                row[f"{mode}_exact"] = ok
            if r:
                rows.append(row)
    finally:
        worker.shutdown()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0] if k.endswith("_s")}
    ideal = max(med["compute_s"], med["read_s"])
    ms = {k: v * 1000 for k, v in med.items()}
    print(f"{args.chunks} chunks of {args.chunk_tokens} tokens, {args.layers} layers "
          f"({nbytes / 2**20:.0f} MiB), {torch.cuda.get_device_name()}, "
          f"{args.repeat} rounds (medians)")
    print(f"  compute (no load)      {ms['compute_s']:8.1f} ms")
    print(f"  read (store, batched)  {ms['read_s']:8.1f} ms   {nbytes / med['read_s'] / 1e9:.2f} GB/s")
    print(f"  ideal max(read, comp.) {ideal * 1000:8.1f} ms")
    print(f"  layerwise step         {ms['layerwise_s']:8.1f} ms   {med['layerwise_s'] / ideal:.2f}x ideal")
    print(f"  async load, idle GPU   {ms['async_idle_s']:8.1f} ms   {med['async_idle_s'] / med['read_s']:.2f}x read")
    print(f"  async load, busy GPU   {ms['async_busy_s']:8.1f} ms   {med['async_busy_s'] / med['read_s']:.2f}x read "
          f"({args.busy_ms:.0f} ms forward queued)")
    print(f"  every round's blocks bit-identical: {exact}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "bench vllm-gpu-worker", "args": {k: v for k, v in vars(args).items()
                                                      if not k.startswith("_")},
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "bytes": nbytes, "medians_s": med, "ideal_s": ideal, "exact": exact, "rounds": rows,
        }, indent=1))
    return 0 if exact else 1
