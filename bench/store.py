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
from storage import Store, encode_chunk, open_store
from storage.buffers import host_buffer
from storage.options import StoreURL

MiB = 1024 * 1024
# Longer than the file store's ctime settling time, so re-reads are steady-state reads.
SETTLE_S = 1.2
AFTER_GET_S = 0.5  # untimed pause after the `get` phase (see below)


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


async def stored_prefix(store: Any, chunks: int) -> list[str]:
    """The keys of a prefix of `chunks` 4-token chunks (64-byte payloads, a namespace of
    its own), once `store` holds them: what lookups are timed on."""
    ns = Namespace(model="bench/lookup", dtype="uint8", layout="raw", chunk_tokens=4,
                   salt=uuid.uuid4().hex)
    tokens = list(range(4 * chunks))
    keys = chunk_keys(tokens, ns)
    await asyncio.gather(*(store.put(k, encode_chunk(k, tokens[4 * i : 4 * i + 4], b"x" * 64))
                           for i, k in enumerate(keys)))
    return keys


async def _got(get: Awaitable[Any]) -> int | None:
    """The size of what `get` returned (None for a miss); the blob itself is dropped."""
    blob = await get
    return None if blob is None else len(blob)


async def _got_get(store: Store, key: str) -> int | None:
    """`_got` of `store.get(key)`."""
    return await _got(store.get(key))


async def _timed(concurrency: int, jobs: Sequence[Callable[[], Awaitable[Any]]]) -> tuple[float, list]:
    sem = asyncio.Semaphore(concurrency)

    async def one(job: Callable[[], Awaitable[Any]]) -> Any:
        async with sem:
            return await job()

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(j) for j in jobs))
    return time.perf_counter() - t0, results


async def _settle_disk() -> None:
    await asyncio.to_thread(os.sync)
    await asyncio.sleep(0.5)


async def measure_store(url: str | list[str], size: int, count: int, concurrency: int, rounds: int,
                        raw_get_round: Callable[..., float] | None = None,
                        raw_put_round: Callable[..., tuple[float, Callable[[], None]]] | None = None,
                        ) -> dict[str, Any]:
    """Time puts, then gets of the same chunks, `rounds` times each (median reported).

    A scheme's raw baselines run in the same rounds, interleaved with the store's, so both
    see the same page-cache, disk and server state: `raw_get_round(keys, buffers,
    concurrency)` reads the very same stored objects into the very same destination buffers
    (one per chunk, as the connector stages a prefix); `raw_put_round(blobs, concurrency)`
    writes the same chunk bytes as plain objects. raw_get_round returns seconds;
    raw_put_round returns (seconds, a call that removes what it wrote).
    """
    store = open_store(url)
    tag = uuid.uuid4().hex
    chunks = make_chunks(size, count, tag)
    nbytes = sum(len(b) for _, b in chunks)
    keys = [k for k, _ in chunks]
    put_times: list[float] = []
    raw_put_times: list[float] = []

    async def put_all(batch: list[tuple[str, bytes]]) -> float:
        t, wrote = await _timed(concurrency, [functools.partial(store.put, k, b) for k, b in batch])
        if not all(wrote):
            raise RuntimeError(f"{store}: {wrote.count(False)} puts reported an existing key")
        return t

    async def put_round(r: int, batch: list[tuple[str, bytes]]) -> None:
        """One round of puts. With a raw baseline, the store and the baseline take turns on
        slices of the batch (2x concurrency chunks; who goes first alternates), so both see
        the same page-cache, memory and disk state: on a VM, freshly handed-out page-cache
        memory or a disk still absorbing earlier writes slowed whole rounds by up to 5x,
        which round-level alternation left in the ratio."""
        if raw_put_round is None:
            put_times.append(await put_all(batch))
            return
        step = 2 * concurrency
        store_s = raw_s = 0.0
        cleanups = []
        for j in range(0, len(batch), step):
            part = batch[j : j + step]
            for turn in ((0, 1) if (r + j // step) % 2 == 0 else (1, 0)):
                if turn == 0:
                    store_s += await put_all(part)
                else:
                    t, cleanup = await asyncio.to_thread(raw_put_round, [b for _, b in part],
                                                         concurrency)
                    raw_s += t
                    cleanups.append(cleanup)
        put_times.append(store_s)
        raw_put_times.append(raw_s)
        for cleanup in cleanups:
            await asyncio.to_thread(cleanup)

    try:
        # Every round starts settled: what the last round wrote is deleted and flushed
        # before the clock starts. Round 0's chunks stay for the reads; later rounds put one
        # other set of chunks again and again (deleted in between), so from round 2 on their
        # fan-out directories exist, as in a store that has been running a while, and the
        # store is timed in the steady state (the baseline writes into one directory).
        again = make_chunks(size, count, f"{tag}-again") if rounds > 1 else []
        for r in range(rounds):
            batch = again if r else chunks
            await _settle_disk()
            await put_round(r, batch)
            if r:
                for k, _ in batch:
                    await store.delete(k)
        del again
        # Destination memory decides copy speed (4 KiB vs huge pages: 2-3x on a VM), so the
        # store and the raw baseline fill the very same buffers: one per chunk.
        buffers = [host_buffer(size) for _ in chunks]
        zeros = bytes(size)
        for b in buffers:  # faulted in now, untimed: the first reads below time the store
            b[:] = zeros
        del zeros
        times: dict[str, list[float]] = {"get": [], "get_into": [], "get_into_many": [], "raw": []}

        async def check(label: str, got: list) -> None:
            if any(g is None for g in got):
                raise RuntimeError(f"{store}: {sum(g is None for g in got)} {label} missed")

        # Steady state of a cache: chunks are read well after they were written. The first
        # read verifies each payload (timed on its own); later reads of unchanged objects
        # may skip the hash (see the file store's `verify=`).
        await asyncio.sleep(SETTLE_S)
        first_s, got = await _timed(concurrency, [functools.partial(store.get_into, keys[i], buffers[i])
                                                  for i in range(count)])
        await check("first reads", got)
        # This process's CPU time (every thread, user and system) per phase: the client's
        # cost of a read, which a server on the same cores also competes for.
        cpu: dict[str, list[float]] = {name: [] for name in times}
        for _ in range(rounds):
            if raw_get_round is not None:
                c0 = time.process_time()
                times["raw"].append(await asyncio.to_thread(raw_get_round, keys, buffers, concurrency))
                cpu["raw"].append(time.process_time() - c0)
            # Each blob is used and dropped, as a caller's loop (and the baselines) would:
            # keeping all of them alive would time the first touch of fresh memory instead.
            c0 = time.process_time()
            t, got = await _timed(concurrency, [functools.partial(_got_get, store, k) for k in keys])
            cpu["get"].append(time.process_time() - c0)
            await check("gets", got)
            times["get"].append(t)
            await asyncio.sleep(AFTER_GET_S)
            c0 = time.process_time()
            t, got = await _timed(concurrency, [functools.partial(store.get_into, keys[i], buffers[i])
                                                for i in range(count)])
            cpu["get_into"].append(time.process_time() - c0)
            await check("get_into", got)
            times["get_into"].append(t)
            t0, c0 = time.perf_counter(), time.process_time()
            got = await store.get_into_many(keys, buffers, max_in_flight=concurrency)
            times["get_into_many"].append(time.perf_counter() - t0)
            cpu["get_into_many"].append(time.process_time() - c0)
            await check("get_into_many", got)
        for k in keys:
            await store.delete(k)
    finally:
        await store.close()
    out: dict[str, Any] = {
        "put_gbps": nbytes / statistics.median(put_times) / 1e9,
        "first_get_into_gbps": nbytes / first_s / 1e9,
        **{f"{name}_gbps": nbytes / statistics.median(ts) / 1e9
           for name, ts in times.items() if name != "raw"},
    }
    out["client_cpu_s_per_gb"] = {name: statistics.median(cs) / nbytes * 1e9
                                  for name, cs in cpu.items() if cs}
    if times["raw"]:
        out["raw_same_objects_get_gbps"] = nbytes / statistics.median(times["raw"]) / 1e9
        # The raw reads run in the same rounds, just before the store's: the median of the
        # per-round ratios cancels what swings whole rounds on a shared machine.
        for name in ("get", "get_into_many"):
            out[f"{name}_ratio_paired"] = statistics.median(
                raw / ours for raw, ours in zip(times["raw"], times[name], strict=True))
    if raw_put_times:
        out["raw_put_gbps"] = nbytes / statistics.median(raw_put_times) / 1e9
        # Rounds are paired (same slices, same moment), so the ratio is the median of the
        # per-round ratios: whole rounds on this VM swing 4x together, both sides alike.
        out["put_ratio_paired"] = statistics.median(
            raw / ours for raw, ours in zip(raw_put_times, put_times, strict=True))
    # Every round's figure too, for judging the spread (disk flushes are noisy on a VM).
    out["rounds_gbps"] = {name: [round(nbytes / t / 1e9, 3) for t in ts] for name, ts in
                          {**times, "put": put_times, "raw_put": raw_put_times}.items() if ts}
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
                raw_get = raw_put = None
                if mod is not None and hasattr(mod, "raw_get_round"):
                    raw_get = functools.partial(mod.raw_get_round, url)
                if mod is not None and hasattr(mod, "raw_put_round"):
                    raw_put = functools.partial(mod.raw_put_round, url)
                got = await measure_store(url, size_mib * MiB, args.count, conc, args.rounds,
                                          raw_get, raw_put)
                base = []
                if mod is not None:
                    base = await mod.baselines(args, url, size_mib * MiB, args.count, conc)
                raw = got.pop("raw_same_objects_get_gbps", None)
                if mod is not None and raw is not None:
                    base = [{"name": mod.RAW_GET_NAME, "put_gbps": None, "get_gbps": raw,
                             "get_ratio_paired": got.pop("get_ratio_paired"),
                             "get_into_many_ratio_paired": got.pop("get_into_many_ratio_paired")},
                            *base]
                    cpu = got["client_cpu_s_per_gb"]
                    print(f"    vs {mod.RAW_GET_NAME} (N={conc}, same rounds): get "
                          f"{base[0]['get_ratio_paired']:.2f}x, get_into_many "
                          f"{base[0]['get_into_many_ratio_paired']:.2f}x; client CPU s/GB: "
                          f"get {cpu['get']:.2f}, get_into_many {cpu['get_into_many']:.2f}, "
                          f"boto3 {cpu['raw']:.2f}", flush=True)
                raw = got.pop("raw_put_gbps", None)
                if mod is not None and raw is not None:
                    base = [*base, {"name": mod.RAW_PUT_NAME, "put_gbps": raw, "get_gbps": None,
                                    "put_ratio_paired": got.pop("put_ratio_paired")}]
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
          f"get_into {r['get_into_gbps']:.2f}, get_into_many {r['get_into_many_gbps']:.2f}",
          flush=True)


def _summary(rows: list[dict[str, Any]]) -> str:
    # "plain get ratio": the simple API (`await store.get(key)`, a new blob per chunk)
    # against the baseline; "best get ratio": the best of get/get_into/get_into_many.
    # A baseline read in the same rounds gives paired ratios (median of per-round ratios).
    headers = ["MiB", "conc", "put GB/s", "1st get_into", "get GB/s", "get_into GB/s",
               "get_into_many", "baseline", "base put", "base get", "put ratio",
               "plain get ratio", "best get ratio", "get_into ratio", "get_into_many ratio"]
    out = []
    for r in rows:
        best_get = max(r["get_gbps"], r["get_into_gbps"], r["get_into_many_gbps"])
        for b in r["baselines"] or [{"name": "-", "put_gbps": None, "get_gbps": None}]:
            out.append([r["size_mib"], r["concurrency"], r["put_gbps"], r["first_get_into_gbps"],
                        r["get_gbps"], r["get_into_gbps"], r["get_into_many_gbps"], b["name"],
                        b.get("put_gbps"), b.get("get_gbps"),
                        b.get("put_ratio_paired") or _ratio(r["put_gbps"], b.get("put_gbps")),
                        b.get("get_ratio_paired") or _ratio(r["get_gbps"], b.get("get_gbps")),
                        _ratio(best_get, b.get("get_gbps")),
                        _ratio(r["get_into_gbps"], b.get("get_gbps")),
                        b.get("get_into_many_ratio_paired")
                        or _ratio(r["get_into_many_gbps"], b.get("get_gbps"))])
    return table(headers, out)
