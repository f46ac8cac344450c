"""kvserver and the http:// store under faults and load: processes SIGKILLed mid-put, the
server lost and restarted under a live client, damaged chunks behind the server, and many
concurrent clients. The server runs as a real `kvstash serve` process on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.faults import (
    KvServerProcess,
    Writer,
    chunk_files,
    chunk_for,
    corrupt_file,
    fill_disk,
    free_port,
    percentiles,
    rss_bytes,
    verify_blob,
)
from connector import KVConnector
from connector.layout import ChunkLayout
from hashing import Namespace
from storage.errors import StoreError, StoreFull, StoreUnavailable
from storage.file import TMP_MARK, _chunk_path
from storage.http import HttpStore
from tests.reliability_fixtures import server_process_fixture, small_fs_fixture  # noqa: F401

SEED = 48
MiB = 1024 * 1024


def visible_chunks_verify(root: Path) -> int:
    """Assert every published chunk file under `root` verifies; return how many there are."""
    n = 0
    for path in chunk_files(root):
        if TMP_MARK in path.name or ".quarantine" in path.parts:
            continue
        key = f"{path.parent.parent.parent.name}/{path.stem}"
        assert verify_blob(key, path.read_bytes()), f"visible chunk {path} does not verify"
        n += 1
    return n


async def test_writer_or_kvserver_killed_mid_put_leaves_no_partial_chunk_and_loses_no_ack(
    tmp_path: Path, server_process
):
    """Rounds kill the uploading client, then the server itself (restarted on the same
    port and directory), then the client again."""
    root = tmp_path / "store"
    server = server_process(["--store", f"file://{root}"])
    rng = random.Random(SEED)
    acked: list[int] = []
    for round_, victim in enumerate(["writer", "server", "writer"]):
        writer = Writer(server.url, SEED, round_ * 1000, 1000, 4 * MiB)
        writer.wait_for_acks(2)
        time.sleep(rng.uniform(0.0, 0.03))
        if victim == "server":
            server.kill()
            acked += writer.kill()
            server.start()
        else:
            acked += writer.kill()

    assert visible_chunks_verify(root) >= len(acked)
    client = HttpStore(server.url)
    for i in acked:
        key, blob = chunk_for(SEED, i, 4 * MiB)
        assert await client.get(key) == blob, f"acknowledged put {i} was lost"
    await client.close()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory):
    """A server nobody kills, for the damage and load tests."""
    tmp = tmp_path_factory.mktemp("kvserver")
    server = KvServerProcess(["--store", f"file://{tmp / 'store'}"], free_port(),
                             tmp / "server.log")
    server.start()
    try:
        yield server, tmp / "store"
    finally:
        server.stop()


async def test_damage_behind_the_server_is_a_miss_for_the_client(shared_server):
    server, root = shared_server
    client = HttpStore(server.url)
    rng = np.random.default_rng(SEED)
    chunks = [chunk_for(SEED, i, 64 * 1024) for i in range(6)]
    for key, blob in chunks:
        await client.put(key, blob)
    for (key, _), how in zip(chunks, ["flip_header", "flip_payload", "truncate_payload",
                                      "replace", "zero", "empty"], strict=True):
        corrupt_file(_chunk_path(root, key), how, rng, chunk_for(SEED, 99, 64 * 1024)[1])
    for key, blob in chunks:
        assert await client.get(key) is None
        assert await client.get_into(key, bytearray(len(blob))) is None
    stats = (await asyncio.to_thread(_stats, server.url))
    assert stats["corrupt"] == len(chunks)
    for key, blob in chunks:  # healed by the next writer
        assert await client.put(key, blob) is True
        assert await client.get(key) == blob
    await client.close()


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=5).json()


LAYOUT = ChunkLayout(layers=2, kv_heads=2, head_dim=16, chunk_tokens=16, dtype="float16")
NS = Namespace(model="kvstash/soak", dtype="float16", layout=LAYOUT.name, chunk_tokens=16)


class Staging:
    """A load target for the connector: staging buffers, and what was placed."""

    def __init__(self, n: int):
        self.bufs = [bytearray(LAYOUT.payload_nbytes) for _ in range(n)]
        self.placed: list[int] = []

    def staging(self, i: int) -> bytearray:
        return self.bufs[i]

    def place(self, i: int) -> None:
        self.placed.append(i)


def payload_of(tokens: np.ndarray, i: int) -> bytes:
    return np.random.default_rng([int(tokens[0]), i]).bytes(LAYOUT.payload_nbytes)


def test_clients_see_misses_while_kvserver_is_down_and_hits_again_after_restart(
    tmp_path: Path, server_process
):
    """The engine's view (KVConnector over http://) and a bare http:// store through one
    outage: no exception into the engine, only typed StoreErrors from the store's put,
    misses meanwhile, and hits again after the restart without touching either client."""
    root = tmp_path / "store"
    server = server_process(["--store", f"file://{root}"])
    tokens = np.random.default_rng(SEED).integers(0, 32000, 8 * 16, dtype=np.uint32)
    conn = KVConnector(f"{server.url}?timeout=1s&breaker_cooldown=0.2s", NS, layout=LAYOUT,
                       lookup_timeout_s=1.0, breaker_cooldown=0.1, breaker_max_cooldown=0.5)
    client = HttpStore(server.url, timeout=1.0, breaker_cooldown=0.2)
    key, blob = chunk_for(SEED, 0)
    try:
        assert conn.save(tokens, lambda i: payload_of(tokens, i)) == 8
        assert conn.flush(timeout=10)
        assert conn.lookup(tokens) == len(tokens)
        assert conn.run(client.put(key, blob)) is True

        server.kill()
        for i in range(8):
            assert conn.lookup(tokens) == 0
            assert conn.load(tokens, len(tokens), Staging(8), deadline_s=0.5) == 0
            other = tokens[::-1].copy()
            conn.save(other, lambda i, t=other: payload_of(t, i))
            assert conn.run(client.get(key)) is None
            assert conn.run(client.exists([key])) == [False]
            assert conn.run(client.prefix_len([key])) == 0
            assert conn.run(client.get_into(key, bytearray(len(blob)))) is None
            try:
                conn.run(client.put(*chunk_for(SEED, 100 + i)))
            except StoreError as exc:
                assert isinstance(exc, StoreUnavailable)
            time.sleep(0.05)
        assert conn.flush(timeout=10)
        assert conn.stats()["save_errors"] + conn.stats()["save_drops"] > 0

        server.start()
        deadline = time.monotonic() + 15
        while conn.lookup(tokens) != len(tokens) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert conn.lookup(tokens) == len(tokens)
        target = Staging(8)
        assert conn.load(tokens, len(tokens), target) == len(tokens)
        assert [bytes(b) for b in target.bufs] == [payload_of(tokens, i) for i in range(8)]
        while conn.run(client.get(key)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert conn.run(client.get(key)) == blob
        assert conn.run(client.put(*chunk_for(SEED, 200))) is True
    finally:
        conn.run(client.close())
        conn.close()


async def test_many_concurrent_clients_get_no_errors_and_server_memory_stays_bounded(
    shared_server,
):
    server, _ = shared_server
    preload = [chunk_for(SEED + 2, i, 256 * 1024) for i in range(32)]
    seed_client = HttpStore(server.url)
    for key, blob in preload:
        await seed_client.put(key, blob)
    await seed_client.close()
    rss_before = rss_bytes(server.pid)

    latencies: list[float] = []
    failures: list[str] = []
    deadline = time.monotonic() + 6.0

    async def client(n: int) -> None:
        store = HttpStore(server.url, pool=1)
        r = random.Random(n)
        for op in range(40):
            if time.monotonic() > deadline:
                break
            started = time.perf_counter()
            try:
                if op % 4 == 3:
                    key, blob = chunk_for(SEED + 1, n * 1000 + op, 64 * 1024)
                    await store.put(key, blob)
                elif op % 4 == 2:
                    if await store.prefix_len([k for k, _ in preload]) != len(preload):
                        failures.append("lookup missed a stored key")
                else:
                    key, blob = r.choice(preload)
                    if await store.get(key) != blob:
                        failures.append(f"get {key} was not the stored bytes")
            except Exception as exc:  # noqa: BLE001 - every failure is counted, none expected
                failures.append(repr(exc))
            latencies.append(time.perf_counter() - started)
        await store.close()

    await asyncio.gather(*(client(n) for n in range(32)))
    growth = rss_bytes(server.pid) - rss_before
    summary = percentiles(latencies)
    print(f"kvserver load: {summary['n']} requests, p50 {summary['p50_ms']:.1f} ms, "
          f"p99 {summary['p99_ms']:.1f} ms, server RSS growth {growth / MiB:.0f} MiB")
    assert failures == []
    assert summary["n"] >= 32
    assert growth < 256 * MiB


async def test_full_disk_behind_the_server_is_507_with_a_log_line_and_metric(
    small_fs: Path, server_process
):
    server = server_process(["--store", f"file://{small_fs / 'store'}"])
    client = HttpStore(server.url)
    ballast = small_fs / "ballast"
    fill_disk(ballast)
    key, blob = chunk_for(SEED, 300, 1 * MiB)
    with pytest.raises(StoreFull):
        await client.put(key, blob)
    assert await client.get(key) is None
    assert _stats(server.url)["put_errors"] == 1
    assert 'status="507"' in httpx.get(f"{server.url}/metrics", timeout=5).text
    assert "disk full" in server.log_text()
    ballast.unlink()  # room again: the same client writes without a restart
    assert await client.put(key, blob) is True
    assert await client.get(key) == blob
    await client.close()


async def test_cancelled_requests_to_a_dead_server_leave_no_unretrieved_task_errors():
    """The connector cancels loads it gave up on. A cancelled request must not leave a
    task behind whose exception nobody retrieves (asyncio then logs it at ERROR in the
    engine's log, once per abandoned request)."""
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx.get("message", "")))
    store = HttpStore(f"http://127.0.0.1:{free_port()}", timeout=1.0,
                      breaker_failures=10**9)
    key, _ = chunk_for(SEED, 400)
    rng = random.Random(SEED)
    try:
        for _ in range(200):
            task = asyncio.create_task(store.get(key))
            for _ in range(rng.randint(0, 6)):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                assert await task is None
        gc.collect()
        await asyncio.sleep(0.05)
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
        await store.close()
    assert reported == []
