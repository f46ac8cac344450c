"""`kvstash bench vllm-layers`: a hit's TTFT with whole-prefix loads against layer-pipelined loads.

Through the real engine (vLLM, random-weight preset), on a store whose load time is
comparable to the hit's compute: a kvserver behind `bench.s3shape` (per-connection
latency and bandwidth, like a remote server). Side by side in one run, every engine in
its own process:

- compute: the same connector engine reading X from the unshaped kvserver on loopback,
  where the load (tens of ms) is small beside the forward: the hit's compute in the same
  engine configuration (vLLM's own prefix-cache engine answers each prompt first, for the
  first token every reader must give);
- load: the bench reading X's chunks through the shaped store with the connector's
  concurrency, no compute at all: whole chunks (`get_into_many`) and by layer ranges (as
  a layerwise load reads them); the faster of the two counts;
- ideal: max(load, compute) per round — what perfect overlap of the two would give;
- whole-prefix: the V1 connector, `load_mode=async`: every chunk is loaded
  before the request's forward starts;
- layer-pipelined: the V1 connector, `load_mode=layerwise`: the forward starts at once
  and layer i computes as soon as layer i of every chunk is read, verified and placed.

A writer engine saves X (sent as X plus one token) through the unshaped kvserver first. Each reader gets its own
suffix, so no reader's saves lengthen another's hit. Unless `--shape` is given, the
bandwidth is calibrated in a first round so that the load takes about as long as the
compute. TTFT is the wall time of `generate` with `max_tokens=1` in the engine process
(vLLM's own first-token latency is kept in the JSON beside it). Ratios are medians over
rounds of the ratio within a round. Every reader's first
token must equal vLLM's own prefix cache's for the same prompt (a hit continues exactly
like the engine's own cache), and the exit status says whether it did.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.vllm import FIRST_TOKEN_ID, REPO, Engine, _build_model

TARGET = 1.15  # layer-pipelined TTFT within 15 % of max(load, compute)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-250m", help="model preset (default llama-250m)")
    p.add_argument("--model-dir", metavar="DIR", help="a local Hugging Face model directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--cached-tokens", type=int, default=2048, help="prefix loaded (default 2048)")
    p.add_argument("--suffix-tokens", type=int, default=512,
                   help="tokens computed after the prefix (default 512)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=0, help="vLLM block size (0: vLLM's)")
    p.add_argument("--max-in-flight", type=int, default=4, help="connector reads at once")
    p.add_argument("--shape", metavar="LAT,BW",
                   help="per-connection latency and bandwidth of the store, e.g. 1ms,20MBps "
                        "(default: calibrated so that the load takes about the compute time)")
    p.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", metavar="DIR", type=Path)
    p.add_argument("--json", metavar="PATH")


class Proxy:
    """`python -m bench.s3shape` in front of a kvserver (it shapes any TCP)."""

    def __init__(self, upstream: str, shape: str):
        host_port = upstream.removeprefix("http://").split("/")[0]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.s3shape", "--upstream", host_port, "--shape", shape],
            stdout=subprocess.PIPE, text=True, cwd=REPO,
        )
        assert self.proc.stdout is not None  # stdout=PIPE
        line = self.proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "listening":
            self.stop()
            raise RuntimeError(f"bench.s3shape did not start: {line}")
        self.url = f"http://127.0.0.1:{line[1]}"

    def stop(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def _load_seconds(url: str, keys: list[str], nbytes: int, in_flight: int) -> float:
    """Read `keys` through the store at `url` as the connector would: all at once, at most
    `in_flight` in flight, into host buffers. Seconds."""
    from storage import open_store

    async def read() -> float:
        store = open_store(url)
        bufs = [np.empty(nbytes, dtype=np.uint8) for _ in keys]
        try:
            started = time.perf_counter()
            got = await store.get_into_many(keys, bufs, max_in_flight=in_flight)
            took = time.perf_counter() - started
            if any(h is None for h in got):
                raise RuntimeError(f"{sum(h is None for h in got)} of {len(keys)} chunks "
                                   "missing from the store")
            return took
        finally:
            await store.close()

    return asyncio.run(read())


def _ranged_load_seconds(url: str, keys: list[str], in_flight: int) -> float:
    """Read `keys` as a layerwise load of a reader of every head does: every header, then
    every layer part's range, layer-major, at most `in_flight` at once, each checked
    against the segments it covers. Seconds."""
    from connector.layout import CanonLayout
    from storage import open_store
    from storage.capabilities import SupportsRangeReads

    async def read() -> float:
        store = open_store(url)
        if not isinstance(store, SupportsRangeReads):
            raise RuntimeError(f"{store}: no ranged reads (SupportsRangeReads)")
        gate = asyncio.Semaphore(in_flight)

        async def bounded(coro: Any) -> Any:
            async with gate:
                return await coro

        try:
            started = time.perf_counter()
            headers = await asyncio.gather(*(bounded(store.read_header(k)) for k in keys))
            if any(h is None or not h.segments for h in headers):
                raise RuntimeError("a chunk without segment checksums or missing")
            bufs = [np.empty(h.payload_len, dtype=np.uint8) for h in headers]
            meta = headers[0].meta
            spans = CanonLayout(tuple(tuple(x) for x in meta["layers"]), meta["tokens"],
                                meta["dtype"]).reader().read_spans

            async def one(i: int, s: int) -> None:
                offset, length = spans[s]
                view = bufs[i].data[offset : offset + length]
                if not await bounded(store.read_range_into(keys[i], headers[i], offset, view)):
                    raise RuntimeError(f"range {s} of {keys[i]} missing")
                headers[i].verify_span(offset, view)

            await asyncio.gather(*(one(i, s) for s in range(len(spans))
                                   for i in range(len(keys))))
            return time.perf_counter() - started
        finally:
            await store.close()

    return asyncio.run(read())


async def _stored(url: str) -> list[str]:
    from storage import open_store

    store = open_store(url)
    try:
        return [k async for k in store.list_keys()]
    finally:
        await store.close()


def run(args: argparse.Namespace) -> int:
    from bench.demo import DemoServer
    from bench.report import machine, table, write_json

    scratch = Path(tempfile.mkdtemp(prefix="kvstash-bench-vllm-layers-"))
    logs = args.keep_logs or scratch / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    engines: list[Engine] = []
    server = proxy = None
    try:
        model_dir, vocab, model_desc = _build_model(args, scratch)
        prompt_len = args.cached_tokens + args.suffix_tokens
        spec = dict(model_dir=str(model_dir), dtype=args.dtype, max_model_len=prompt_len + 8,
                    block_size=args.block_size, chunk_tokens=args.chunk_tokens)
        server = DemoServer([f"file://{scratch / 'store'}"])
        server.wait_ready()

        def engine(name: str, **extra: Any) -> Engine:
            e = Engine(name, {**spec, **extra}, logs / f"engine-{name}.log")
            engines.append(e)
            e.start()
            return e

        def prompt(prefix: np.ndarray) -> np.ndarray:
            suffix = rng.integers(FIRST_TOKEN_ID, vocab, args.suffix_tokens)
            return np.concatenate([prefix, suffix])

        print(f"starting the writer and the prefix-cache engine ({model_desc}) ...", flush=True)
        writer = engine("writer", prefix_caching=False, store=server.url,
                        connector={"save_all": True})
        ideal = engine("prefix-cache", prefix_caching=True, store=None)
        writer.wait_ready()
        ideal.wait_ready()

        def round_() -> dict[str, Any]:
            prefix = rng.integers(FIRST_TOKEN_ID, vocab, args.cached_tokens)
            before = set(asyncio.run(_stored(server.url)))
            # X plus one token: the writer saves exactly X's chunks
            writer.generate([np.concatenate([prefix, prompt(prefix)[-1:]])])
            ideal.generate([prompt(prefix)])
            # one prompt per reader; vLLM's own prefix cache answers each first: the
            # first token every reader must give (a hit continues exactly like it)
            prompts = [prompt(prefix) for _ in range(3)]
            refs = [ideal.generate([q])["requests"][0] for q in prompts]
            for _ in range(600):
                keys = sorted(set(asyncio.run(_stored(server.url))) - before)
                if len(keys) >= args.cached_tokens // args.chunk_tokens:
                    break
                time.sleep(0.05)
            return {"prefix": prefix, "keys": keys, "prompts": prompts,
                    "first_tokens": [r["first_token"] for r in refs]}

        consumer = {"load_mode": "layerwise", "max_in_flight": args.max_in_flight,
                    "adaptive": False}
        fast = engine("compute", prefix_caching=False, store=server.url, kv_role="kv_consumer",
                      connector=consumer)
        fast.wait_ready()
        first = round_()
        nbytes = _chunk_nbytes(scratch / "store")
        total = nbytes * len(first["keys"])
        shape = args.shape
        if not shape:  # load about as long as compute: bandwidth shared by the readers
            fast.generate([first["prompts"][2]])  # warm-up
            compute_s = fast.generate([first["prompts"][2]])["wall_s"]
            per_conn = total / compute_s / min(args.max_in_flight, len(first["keys"]))
            shape = f"1ms,{max(per_conn, 1e5):.0f}Bps"
        proxy = Proxy(server.url, shape)
        readers = {
            # kv_consumer: readers only load, so no reader's saves land in a later round
            "whole-prefix": engine("whole", prefix_caching=False, store=proxy.url,
                                   kv_role="kv_consumer",
                                   connector={"load_mode": "async",
                                              "max_in_flight": args.max_in_flight,
                                              "adaptive": False}),
            "layer-pipelined": engine("layers", prefix_caching=False, store=proxy.url,
                                      kv_role="kv_consumer",
                                      connector={"load_mode": "layerwise",
                                                 "max_in_flight": args.max_in_flight,
                                                 "adaptive": False}),
        }
        for e in readers.values():
            e.wait_ready()
        print(f"store shaped to {shape} per connection; {len(first['keys'])} chunks of "
              f"{nbytes / 2**20:.1f} MiB per prefix", flush=True)
        rows: list[dict[str, Any]] = []
        for r in range(args.repeat + 1):  # the first round warms the readers up
            rnd = first if r == 0 else round_()
            reply = fast.generate([rnd["prompts"][2]])
            compute = reply["wall_s"]
            exact_compute = reply["requests"][0]["first_token"] == rnd["first_tokens"][2]
            whole = _load_seconds(proxy.url, rnd["keys"], nbytes, args.max_in_flight)
            ranged = _ranged_load_seconds(proxy.url, rnd["keys"], args.max_in_flight)
            load = min(whole, ranged)  # the faster way to read the prefix: the stricter ideal
            row = {"compute_s": compute, "load_s": load, "load_whole_s": whole,
                   "load_ranged_s": ranged, "ideal_s": max(load, compute),
                   "compute exact": exact_compute}
            for j, (name, e) in enumerate(readers.items()):
                reply = e.generate([rnd["prompts"][j]])
                answer = reply["requests"][0]
                row[name] = reply["wall_s"]
                row[f"{name} vllm_ttft"] = answer["ttft_s"]
                row[f"{name} cached"] = answer["cached_tokens"]
                row[f"{name} exact"] = answer["first_token"] == rnd["first_tokens"][j]
            if r:
                rows.append(row)
                print(f"round {r}: compute {row['compute_s'] * 1e3:.0f} ms, load "
                      f"{whole * 1e3:.0f} ms whole / {ranged * 1e3:.0f} ms by layer ranges, "
                      f"whole-prefix {row['whole-prefix'] * 1e3:.0f} ms, "
                      f"layer-pipelined {row['layer-pipelined'] * 1e3:.0f} ms", flush=True)
        result = _summary(args, rows, shape, model_desc, nbytes, len(first["keys"]))
        result["machine"] = machine()
        body = [[name, f"{result[name]['ttft_ms']:.0f}", f"{result[name]['vs_ideal']:.2f}x",
                 result[name].get("note", "")]
                for name in ("compute", "load", "ideal", "whole-prefix", "layer-pipelined")]
        print(result["title"])
        print(table(["path", "TTFT ms (median)", "vs max(load, compute)", "target"], body))
        if args.json:
            write_json(args.json, result)
        hits_ok = all(r[f"{n} cached"] >= args.cached_tokens for r in rows for n in readers)
        exact = all(r[f"{n} exact"] and r["compute exact"] for r in rows for n in readers)
        print(f"every hit loaded the whole prefix: {'yes' if hits_ok else 'NO'}; every first "
              f"token equal to vLLM's own prefix cache's: {'yes' if exact else 'NO'}")
        return 0 if hits_ok and exact else 1
    finally:
        for e in engines:
            e.stop()
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()
        if args.keep_logs is None:
            shutil.rmtree(scratch, ignore_errors=True)


def _chunk_nbytes(root: Path) -> int:
    from storage.codec import decode_header

    path = next(root.rglob("*.kv"))
    with open(path, "rb") as f:
        return decode_header(f.read(65536)).payload_len


def _summary(args: argparse.Namespace, rows: list[dict[str, Any]], shape: str, model: str,
             nbytes: int, chunks: int) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def vs_ideal(key: str) -> float:
        return statistics.median(r[key] / r["ideal_s"] for r in rows)

    out: dict[str, Any] = {
        "command": "bench vllm-layers", "model": model, "dtype": args.dtype,
        "cached_tokens": args.cached_tokens, "suffix_tokens": args.suffix_tokens,
        "chunk_tokens": args.chunk_tokens, "chunks": chunks, "chunk_bytes": nbytes,
        "max_in_flight": args.max_in_flight, "shape": shape, "repeat": args.repeat,
        "target_vs_ideal": TARGET, "rounds": rows,
        "title": (f"vLLM hit TTFT, {model}, {args.dtype}: {args.cached_tokens} tokens loaded "
                  f"({chunks} chunks of {nbytes / 2**20:.1f} MiB) + {args.suffix_tokens} "
                  f"computed; kvserver shaped to {shape} per connection; median of "
                  f"{args.repeat} rounds"),
    }
    for name, key in (("compute", "compute_s"), ("load", "load_s"), ("ideal", "ideal_s"),
                      ("whole-prefix", "whole-prefix"), ("layer-pipelined", "layer-pipelined")):
        out[name] = {"ttft_ms": 1e3 * med(key), "vs_ideal": vs_ideal(key)}
    x = out["layer-pipelined"]["vs_ideal"]
    out["layer-pipelined"]["note"] = f"{'meets' if x <= TARGET else 'MISSES'} <= {TARGET}x"
    out["whole-prefix"]["note"] = "the whole prefix loads before the forward"
    return out
