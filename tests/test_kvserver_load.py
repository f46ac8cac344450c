"""Load: 32 concurrent http:// clients against one kvserver, bounded in time and count,
end with zero errors, every read verified, and the server's memory bounded. A second
phase re-reads every chunk, verified by then (the store remembers a verification at once:
`settle=0`), so those GETs go out by sendfile(2) under the same load."""

from __future__ import annotations

import asyncio
import os
import re
import time

import httpx

from hashing import Namespace, chunk_keys
from storage import open_store
from storage.codec import encode_chunk
from tests.kvserver_fixtures import running_kvserver

CLIENTS = 32
ROUNDS = 12  # per client: put, get_into, get, lookup, miss
PAYLOAD = 256 * 1024
TIME_LIMIT_S = 60.0
MiB = 1024 * 1024
# Python + FastAPI + uvicorn idle at ~60-90 MiB; 32 connections with a 256 KiB body each in
# flight need a few MiB. Anything near the 100 MiB of chunk data written would mean the
# server holds on to bodies (the backend is a directory, so nothing should stay in RAM).
RSS_GROWTH_LIMIT = 64 * MiB


async def client(url: str, i: int, deadline: float,
                 written: dict[str, bytes]) -> tuple[int, list[str]]:
    ns = Namespace(model="load", dtype="u8", layout="raw", chunk_tokens=8, salt=f"client-{i}")
    tokens = [i * 100_000 + t for t in range(8 * ROUNDS)]
    keys = chunk_keys(tokens, ns)
    absent = chunk_keys([7, 7, 7, 7, 7, 7, 7, 7], ns)[0]
    store = open_store(f"{url}?pool=2&timeout=30s")
    buf = bytearray(PAYLOAD)
    problems: list[str] = []
    ops = 0
    try:
        for r, key in enumerate(keys):
            if time.monotonic() > deadline:
                break
            payload = os.urandom(PAYLOAD)
            blob = encode_chunk(key, tokens[8 * r : 8 * r + 8], payload)
            if not await store.put(key, blob):
                problems.append(f"put {key} reported an existing key")
            written[key] = payload
            header = await store.get_into(key, buf)
            if header is None or buf != payload:
                problems.append(f"get_into {key} returned wrong bytes")
            if await store.get(key) != blob:
                problems.append(f"get {key} returned wrong bytes")
            if await store.prefix_len(keys) != r + 1:
                problems.append(f"prefix_len after {r + 1} puts is wrong")
            if await store.get(absent) is not None:
                problems.append("an absent key was found")
            ops += 5
        if store.counters["errors"] or store.counters["corrupt"]:
            problems.append(f"client counters show failures: {store.stats()}")
    finally:
        await store.close()
    return ops, problems


async def reread(url: str, written: dict[str, bytes], passes: int = 2) -> tuple[int, list[str]]:
    store = open_store(f"{url}?pool=2&timeout=30s")
    buf = bytearray(PAYLOAD)
    problems: list[str] = []
    try:
        for _ in range(passes):
            for key, payload in written.items():
                header = await store.get_into(key, buf)
                if header is None or buf != payload:
                    problems.append(f"re-read of {key} returned wrong bytes")
        if store.counters["errors"] or store.counters["corrupt"]:
            problems.append(f"client counters show failures: {store.stats()}")
    finally:
        await store.close()
    return passes * len(written), problems


async def test_32_concurrent_clients_end_with_zero_errors_and_bounded_memory(tmp_path):
    # settle=0: the server remembers a verification at once (nothing rewrites a chunk here).
    with running_kvserver("--store", f"file://{tmp_path}/store?fsync=false&settle=0") as server:
        rss_before = server.rss_bytes()
        peak = rss_before
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, server.rss_bytes())
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        deadline = time.monotonic() + TIME_LIMIT_S
        written: list[dict[str, bytes]] = [{} for _ in range(CLIENTS)]
        results = await asyncio.gather(*(client(server.url, i, deadline, written[i])
                                         for i in range(CLIENTS)))
        results += await asyncio.gather(*(reread(server.url, w) for w in written))
        done.set()
        await sampler
        ops = sum(n for n, _ in results)
        problems = [p for _, ps in results for p in ps]
        assert problems == []
        assert ops >= CLIENTS * 5, "the time limit cut the run before every client finished one round"
        assert peak - rss_before < RSS_GROWTH_LIMIT, (rss_before, peak)
        assert "Traceback" not in server.log()
        sent = httpx.get(f"{server.url}/metrics").text
        assert re.search(r"^kvstash_bytes_sendfile_total [1-9]", sent, re.M), "no GET used sendfile"
