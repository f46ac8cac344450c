"""`kvstash bench store --store URL`: put/get GB/s of real chunks beside the scheme's baselines.

For each chunk size and concurrency the store under test gets fresh keys (puts are
create-only), then reads them back with `get` (a new bytes object per chunk) and with
`get_into` (into preallocated buffers, as the connector does). Baselines come from
`bench/store_<scheme>.py` (see `baselines()` there) and run on the same machine, server
and sizes in the same run, so every ratio compares like with like.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from bench.report import machine, table, write_json
from hashing import Namespace, chunk_keys
from storage import encode_chunk, open_store
from storage.options import StoreURL

MiB = 1024 * 1024
# Longer than the file store's ctime settling time, so re-reads are steady-state reads.
SETTLE_S = 1.2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, metavar="URL", help="store URL to measure")
    p.add_argument("--sizes", default="4,16,32", help="payload sizes in MiB (default 4,16,32)")
    p.add_argument("--concurrency", default="1,4", help="requests in flight (default 1,4)")
    p.add_argument("--count", type=int, default=16, help="chunks per size and concurrency")
    p.add_argument("--rounds", type=int, default=3, help="timed get rounds (median reported)")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    for mod in _scheme_modules():
        add = getattr(mod, "add_arguments", None)
        if add is not None:
            add(p)


def _scheme_modules() -> list[Any]:
    mods = []
    for scheme in ("file", "s3", "http"):
        try:
            mods.append(importlib.import_module(f"bench.store_{scheme}"))
        except ModuleNotFoundError as exc:
            if exc.name != f"bench.store_{scheme}":
                raise
    return mods


def _scheme_module(url: str) -> Any | None:
    scheme = StoreURL(url).scheme
    scheme = "http" if scheme == "https" else scheme
    try:
        return importlib.import_module(f"bench.store_{scheme}")
    except ModuleNotFoundError:
        return None


def make_chunks(size: int, count: int, tag: str) -> list[tuple[str, bytes]]:
    """`count` distinct valid chunks with `size`-byte payloads (random bytes, distinct keys)."""
    ns = Namespace(model="bench/store", dtype="uint8", layout="raw", chunk_tokens=16, salt=tag)
    base = bytearray(os.urandom(size))
    out = []
    for i in range(count):
        tokens = [i, *range(1, 16)]
        base[:8] = i.to_bytes(8, "little")
        out.append((chunk_keys(tokens, ns)[0], encode_chunk(chunk_keys(tokens, ns)[0], tokens, base)))
    return out


async def _timed(concurrency: int, jobs: Sequence[Callable[[], Awaitable[Any]]]) -> tuple[float, list]:
    sem = asyncio.Semaphore(concurrency)

    async def one(job: Callable[[], Awaitable[Any]]) -> Any:
        async with sem:
            return await job()

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(j) for j in jobs))
    return time.perf_counter() - t0, results


async def measure_store(url: str, size: int, count: int, concurrency: int, rounds: int,
                        raw_get_round: Callable[[list[str], int], float] | None = None) -> dict:
    """Time puts, then gets of the same chunks; `raw_get_round(keys, concurrency)` (a
    scheme's raw read of the very same stored objects, returning seconds) is timed in the
    same rounds, interleaved, so both see the same page-cache and server state."""
    store = open_store(url)
    chunks = make_chunks(size, count, uuid.uuid4().hex)
    nbytes = sum(len(b) for _, b in chunks)
    try:
        put_s, wrote = await _timed(concurrency, [lambda k=k, b=b: store.put(k, b) for k, b in chunks])
        if not all(wrote):
            raise RuntimeError(f"{store}: {wrote.count(False)} puts reported an existing key")
        get_times, into_times = [], []
        buffers = [bytearray(size) for _ in range(concurrency)]
        free = asyncio.Queue()
        for b in buffers:
            free.put_nowait(b)

        async def get_into(key: str) -> Any:
            buf = await free.get()
            try:
                return await store.get_into(key, buf)
            finally:
                free.put_nowait(buf)

        # Steady state of a cache: chunks are read well after they were written. The first
        # read verifies each payload (timed on its own); later reads of unchanged objects
        # may skip the hash (see the file store's `verify=`).
        await asyncio.sleep(SETTLE_S)
        first_s, got = await _timed(concurrency, [lambda k=k: get_into(k) for k, _ in chunks])
        if any(g is None for g in got):
            raise RuntimeError(f"{store}: {sum(g is None for g in got)} first reads missed")
        keys = [k for k, _ in chunks]
        raw_times = []
        for _ in range(rounds):
            if raw_get_round is not None:
                raw_times.append(await asyncio.to_thread(raw_get_round, keys, concurrency))
            t, got = await _timed(concurrency, [lambda k=k: store.get(k) for k, _ in chunks])
            if any(g is None for g in got):
                raise RuntimeError(f"{store}: {sum(g is None for g in got)} gets missed")
            get_times.append(t)
            del got
            t, got = await _timed(concurrency, [lambda k=k: get_into(k) for k, _ in chunks])
            if any(g is None for g in got):
                raise RuntimeError(f"{store}: {sum(g is None for g in got)} get_into missed")
            into_times.append(t)
        for k, _ in chunks:
            await store.delete(k)
    finally:
        await store.close()
    out = {
        "put_gbps": nbytes / put_s / 1e9,
        "first_get_into_gbps": nbytes / first_s / 1e9,
        "get_gbps": nbytes / statistics.median(get_times) / 1e9,
        "get_into_gbps": nbytes / statistics.median(into_times) / 1e9,
    }
    if raw_times:
        out["raw_same_objects_get_gbps"] = nbytes / statistics.median(raw_times) / 1e9
    return out


async def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    url = args.store
    mod = _scheme_module(url)
    cleanup = None
    if mod is not None and hasattr(mod, "setup"):
        url, cleanup = await mod.setup(args, url)
    rows: list[dict[str, Any]] = []
    try:
        for size_mib in sizes:
            for conc in concs:
                raw_round = None
                if mod is not None and hasattr(mod, "raw_get_round"):
                    raw_round = functools.partial(mod.raw_get_round, url)
                got = await measure_store(url, size_mib * MiB, args.count, conc, args.rounds,
                                          raw_round)
                base = []
                if mod is not None:
                    base = await mod.baselines(args, url, size_mib * MiB, args.count, conc)
                raw = got.pop("raw_same_objects_get_gbps", None)
                if raw is not None:
                    base = [{"name": mod.RAW_GET_NAME, "put_gbps": None, "get_gbps": raw}, *base]
                rows.append({"size_mib": size_mib, "concurrency": conc, **got, "baselines": base})
                _print_row(rows[-1])
        extras = await mod.extras(args, url) if mod is not None and hasattr(mod, "extras") else {}
    finally:
        if cleanup is not None:
            await cleanup()
    print()
    print(f"store: {StoreURL(args.store).redacted()}   machine: {machine()['cpu']}, {machine()['cores']} cores")
    print(_summary(rows))
    for k, v in extras.items():
        print(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}")
    write_json(args.json, {"command": "bench store", "store": StoreURL(args.store).redacted(),
                           "rows": rows, "extras": extras})
    return 0


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _print_row(r: dict[str, Any]) -> None:
    print(f"{r['size_mib']:>3} MiB x{r['concurrency']}: put {r['put_gbps']:.2f} GB/s, "
          f"first get_into {r['first_get_into_gbps']:.2f}, get {r['get_gbps']:.2f}, "
          f"get_into {r['get_into_gbps']:.2f}", flush=True)


def _summary(rows: list[dict[str, Any]]) -> str:
    headers = ["MiB", "conc", "put GB/s", "1st get_into", "get GB/s", "get_into GB/s",
               "baseline", "base put", "base get", "put ratio", "get ratio"]
    out = []
    for r in rows:
        best_get = max(r["get_gbps"], r["get_into_gbps"])
        for b in r["baselines"] or [{"name": "-", "put_gbps": None, "get_gbps": None}]:
            out.append([r["size_mib"], r["concurrency"], r["put_gbps"], r["first_get_into_gbps"],
                        r["get_gbps"], r["get_into_gbps"], b["name"], b.get("put_gbps"), b.get("get_gbps"),
                        _ratio(r["put_gbps"], b.get("put_gbps")), _ratio(best_get, b.get("get_gbps"))])
    return table(headers, out)
