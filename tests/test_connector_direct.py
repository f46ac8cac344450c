"""KVConnector loading a file:// store through gds.ChunkIO (the direct path), on real files.

The destinations here are host memory (numpy arrays, CPU tensors): this machine has no GPU,
so the CUDA destinations of the same path (cuFile, bounce buffers) are covered by
tests/test_gds_cuda.py where a GPU is present and by `kvstash bench gds` on a GPU host.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from connector import KVConnector
from gds import ChunkIO, IOConfig
from storage.file import FileStore
from tests.store_helpers import backdate
from tests.test_connector_core import LAYOUT, TOKENS, ListEngine, namespace, payload_of, saved
from tests.throttle import SlowChunkIO

N = len(TOKENS) // LAYOUT.chunk_tokens


def file_connector(root, **kwargs) -> KVConnector:
    # These tests are about ChunkIO's reads: chunks just saved are in the page cache, where
    # the core would read them on the calling thread instead (test_resident_reads.py).
    kwargs.setdefault("resident_reads", False)
    return KVConnector(f"file://{root}", namespace(), layout=LAYOUT, **kwargs)


def flip_payload_byte(store: FileStore, key: str) -> None:
    path = store.chunk_path(key)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 7)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


def keys_of(conn: KVConnector) -> list[str]:
    from hashing import chunk_keys

    return chunk_keys(TOKENS, conn.ns)


def test_a_file_store_is_read_through_chunkio_with_the_exact_bytes(tmp_path):
    conn = saved(file_connector(tmp_path))
    assert conn.reads_direct
    engine = ListEngine(N)
    assert conn.load(TOKENS, N * 16, engine) == N * 16
    assert engine.placed == list(range(N))
    for i, buf in enumerate(engine.bufs):
        assert np.array_equal(buf, payload_of(i))
    stats = conn.stats()
    assert stats["chunk_io"]["counters"]["chunk_reads"] == N
    assert stats["chunk_io"]["backends"]["cpu"] == "host"
    store = conn.store.stats()
    assert store["hits"] == N and store["misses"] == 0  # the store is told of every read
    conn.close()


def test_cpu_tensor_staging_is_filled_in_place(tmp_path):
    torch = pytest.importorskip("torch")
    from gds import aligned_empty

    conn = saved(file_connector(tmp_path))

    class TensorEngine:
        def __init__(self):
            self.raw = aligned_empty((N, LAYOUT.payload_nbytes))
            self.placed = []

        def staging(self, i):
            return self.raw[i]

        def place(self, i):
            self.placed.append(i)

    engine = TensorEngine()
    assert conn.load(TOKENS, N * 16, engine) == N * 16
    for i in range(N):
        assert torch.equal(engine.raw[i], torch.from_numpy(payload_of(i)))
    conn.close()


def test_direct_io_false_and_other_stores_read_through_the_store(tmp_path):
    conn = saved(file_connector(tmp_path, direct_io=False))
    assert not conn.reads_direct and conn.stats()["chunk_io"] is None
    engine = ListEngine(N)
    assert conn.load(TOKENS, N * 16, engine) == N * 16
    assert all(np.array_equal(b, payload_of(i)) for i, b in enumerate(engine.bufs))
    conn.close()
    mem = KVConnector("memory://", namespace(), layout=LAYOUT)
    assert not mem.reads_direct
    mem.close()


def test_a_tier_list_starting_with_a_file_store_reads_that_tier_through_chunkio(tmp_path):
    # [file://, memory://]: the file tier's chunks come through ChunkIO; a chunk evicted
    # from it, or corrupt in it, is read through the tier list from memory:// and promoted.
    conn = KVConnector([f"file://{tmp_path}", "memory://?capacity=64MiB"], namespace(),
                       layout=LAYOUT)
    saved(conn)
    assert conn.reads_direct
    files = conn.store.tiers[0]
    keys = keys_of(conn)
    conn._call(conn.store.flush(), 10)  # the cascade to memory:// runs behind the put
    os.unlink(files.chunk_path(keys[1]))
    flip_payload_byte(files, keys[4])
    engine = ListEngine(N)
    assert conn.load(TOKENS, N * 16, engine) == N * 16
    for i, buf in enumerate(engine.bufs):
        assert np.array_equal(buf, payload_of(i))
    counters = conn.stats()["chunk_io"]["counters"]
    assert counters["chunk_reads"] == N - 2
    assert counters["read_missing"] == 1 and counters["read_corrupt"] == 1
    assert conn.stats()["verify_failures"] == 0 and conn.stats()["load_misses"] == 0
    conn._call(conn.store.flush(), 10)  # promotion back into the file tier
    assert files.chunk_path(keys[1]).exists() and files.chunk_path(keys[4]).exists()
    engine = ListEngine(N)
    assert conn.load(TOKENS, N * 16, engine) == N * 16
    assert conn.stats()["chunk_io"]["counters"]["chunk_reads"] == 2 * N - 2
    conn.close()


def test_a_tier_list_that_misses_everywhere_is_a_shorter_hit(tmp_path):
    conn = saved(KVConnector([f"file://{tmp_path}", "memory://?capacity=64MiB"], namespace(),
                             layout=LAYOUT))
    keys = keys_of(conn)
    conn._call(conn.store.flush(), 10)
    os.unlink(conn.store.tiers[0].chunk_path(keys[3]))
    conn._call(conn.store.tiers[1].delete(keys[3]), 10)
    engine = ListEngine(N)
    assert conn.load(TOKENS, N * 16, engine) == 3 * 16
    assert engine.placed == [0, 1, 2]
    assert conn.stats()["load_misses"] == 1
    conn.close()


def test_a_corrupt_chunk_ends_the_hit_is_quarantined_and_later_reads_are_not_started(tmp_path):
    io = ChunkIO(IOConfig(max_in_flight=1), probe_dir=tmp_path)
    conn = saved(file_connector(tmp_path, direct_io=io, max_in_flight=1))
    keys = keys_of(conn)
    flip_payload_byte(conn.store, keys[3])
    engine = ListEngine(N)
    assert conn.load(TOKENS, N * 16, engine) == 3 * 16
    assert engine.placed == [0, 1, 2]
    stats = conn.stats()
    assert stats["verify_failures"] == 1
    counters = io.stats()["counters"]
    # One request at a time: chunk 3 failed before chunk 4 was started, and 4.. never were.
    assert counters["chunk_reads"] == 3 and counters["read_corrupt"] == 1
    assert not conn.store.chunk_path(keys[3]).exists()  # quarantined, as a store read would
    assert conn.store.stats()["corrupt"] == 1
    assert conn.lookup(TOKENS) == 3 * 16
    conn.close()
    io.submit_read(__file__, 0, 1, bytearray(1)).result()  # a ChunkIO passed in stays open
    io.close()


def test_files_the_store_verified_are_trusted_until_they_change(tmp_path):
    # The store's verify=changed policy holds on the direct path too: a file verified whole
    # once, and unchanged since, is read without its header or payload hash; a write
    # through the filesystem changes its identity and brings the full check back.
    conn = saved(KVConnector(f"file://{tmp_path}?settle=0", namespace(), layout=LAYOUT,
                             resident_reads=False))  # verifications remembered at once
    keys = keys_of(conn)
    for key in keys:
        backdate(conn.store.chunk_path(key))  # so the write below shows in its identity
    for expect_known in (0, N):
        engine = ListEngine(N)
        assert conn.load(TOKENS, N * 16, engine) == N * 16
        for i, buf in enumerate(engine.bufs):
            assert np.array_equal(buf, payload_of(i))
        counters = conn.stats()["chunk_io"]["counters"]
        assert counters.get("chunks_known_verified", 0) == expect_known
    flip_payload_byte(conn.store, keys[2])
    engine = ListEngine(N)
    assert conn.load(TOKENS, N * 16, engine) == 2 * 16
    assert conn.stats()["verify_failures"] == 1
    assert not conn.store.chunk_path(keys[2]).exists()  # quarantined
    conn.close()
    strict = saved(KVConnector(f"file://{tmp_path / 'always'}?verify=always&settle=0", namespace(),
                               layout=LAYOUT))  # verify=always: every read checks everything
    for _ in range(2):
        assert strict.load(TOKENS, N * 16, ListEngine(N)) == N * 16
    assert strict.stats()["chunk_io"]["counters"].get("chunks_known_verified", 0) == 0
    strict.close()


def test_a_missing_chunk_is_a_miss_and_the_store_forgets_it(tmp_path):
    conn = saved(file_connector(tmp_path))
    keys = keys_of(conn)
    os.unlink(conn.store.chunk_path(keys[5]))  # a peer evicted it after the lookup
    engine = ListEngine(N)
    assert conn.load(TOKENS, N * 16, engine) == 5 * 16
    stats = conn.stats()
    assert stats["load_misses"] == 1 and stats["verify_failures"] == 0
    assert conn.store.stats()["misses"] == 1
    conn.close()


def test_a_chunk_of_other_tokens_or_another_layout_is_rejected(tmp_path):
    from connector import ChunkLayout
    from storage.codec import encode_chunk

    conn = file_connector(tmp_path)
    keys = keys_of(conn)
    # A forged chunk (or a key collision): the right key, other token ids in its header.
    forged = encode_chunk(keys[0], TOKENS[16:32], payload_of(0), LAYOUT.meta())
    assert conn.run(conn.store.put(keys[0], forged))
    assert conn.load(TOKENS, 16, ListEngine(1)) == 0
    assert conn.stats()["verify_failures"] == 1
    conn.close()
    # The right key and tokens, written for another KV layout.
    conn = file_connector(tmp_path / "b")
    key = keys_of(conn)[0]
    other = ChunkLayout(layers=2, kv_heads=2, head_dim=8, chunk_tokens=16, dtype="float16")
    wrong = encode_chunk(key, TOKENS[:16], np.zeros(other.payload_nbytes, np.uint8), other.meta())
    assert conn.run(conn.store.put(key, wrong))
    assert conn.load(TOKENS, 16, ListEngine(1)) == 0
    assert conn.stats()["verify_failures"] == 1
    conn.close()


def test_staging_that_cannot_hold_the_payload_is_a_miss_not_an_overflow(tmp_path):
    conn = saved(file_connector(tmp_path))

    class Small(ListEngine):
        def staging(self, i):
            return self.bufs[i][: LAYOUT.payload_nbytes // 2]

    assert conn.load(TOKENS, N * 16, Small(N)) == 0
    assert conn.stats()["load_misses"] >= 1  # those already in flight miss too
    conn.close()


def test_a_batch_of_direct_reads_ends_only_after_every_answer_has_been_handled(
        tmp_path, monkeypatch):
    """`read_chunks_into` returns once `on_done` has returned for every key (the connector
    places each chunk there and then reads its answer). A read that finished before the
    batch started waiting for it must not end the batch while its `on_done` still runs on
    the reading thread: here the reads end between the two, and `on_done` is slow."""
    import asyncio
    import threading

    # Each read lands 10 ms late: still reading when the batch registers its on_done callbacks.
    slow = SlowChunkIO(0.01, IOConfig(), probe_dir=tmp_path)
    conn = saved(file_connector(tmp_path, direct_io=slow))
    store, keys = conn.store, keys_of(conn)[:4]  # all read at once (8 in flight)
    dests = [np.empty(LAYOUT.payload_nbytes, dtype=np.uint8) for _ in keys]
    real_wrap = asyncio.wrap_future
    late = [True]

    def late_wrap(fut, **kwargs):
        if late.pop() if late else False:
            time.sleep(0.05)  # the reads finish meanwhile; their on_done calls start
        return real_wrap(fut, **kwargs)

    handled: list[int] = []
    lock = threading.Lock()

    def on_done(i, header, why):
        time.sleep(0.2)
        with lock:
            handled.append(i)

    async def batch():
        monkeypatch.setattr(asyncio, "wrap_future", late_wrap)
        try:
            return await store.read_chunks_into(keys, dests, on_done=on_done)
        finally:
            monkeypatch.setattr(asyncio, "wrap_future", real_wrap)

    headers = conn.run(batch(), timeout=30)
    with lock:
        answered = sorted(handled)
    assert answered == list(range(len(keys)))
    assert all(h is not None for h in headers)
    conn.close()
    slow.close()  # shared with the store: its owner closes it


def test_a_batch_given_up_on_while_a_chunk_is_handled_ends_without_a_callback_error(
        tmp_path, caplog):
    """A load's deadline cancels `read_chunks_into` while a read's `on_done` still runs on
    the reading thread (on a GPU the first load's set-up outlasts the 50 ms deadline): when
    that read's answer is the batch's last, nothing may be set on the cancelled batch (it
    was: concurrent.futures logged InvalidStateError from the callback)."""
    import asyncio
    import logging
    import threading

    conn = saved(file_connector(tmp_path))
    store, keys = conn.store, keys_of(conn)[:1]
    dests = [np.empty(LAYOUT.payload_nbytes, dtype=np.uint8)]
    entered, release = threading.Event(), threading.Event()

    def on_done(i, header, why):
        entered.set()
        release.wait(10)

    async def give_up() -> None:
        task = asyncio.ensure_future(store.read_chunks_into(keys, dests, on_done=on_done))
        await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    caplog.set_level(logging.ERROR, logger="concurrent.futures")
    conn.run(give_up(), timeout=30)
    release.set()
    conn.close()  # waits for the reading thread, so its callback has run
    assert not [r for r in caplog.records if r.name == "concurrent.futures"], caplog.text


@pytest.mark.parametrize(("caps", "on_gpu"), [
    (dict(cuda=True), "host"),  # bounce buffers only: pinned host staging, one H2D a chunk
    (dict(cuda=True, torch_gds=True), "device"),
    (dict(cuda=True, kvikio=True), "device"),
])
def test_gpu_staging_is_on_the_device_only_where_cufile_or_kvikio_fill_it(tmp_path, caps, on_gpu):
    # Capabilities stand in for a GPU host's probe (no GPU here). Bounce buffers into device
    # staging ran at about half the rate of pinned staging on an H100 host
    # (docs/benchmarks/2026-11-27-gpu.md).
    from gds import Capabilities

    io = ChunkIO(IOConfig(), caps=Capabilities(**caps))
    conn = file_connector(tmp_path, direct_io=io)
    assert conn.staging_kind(torch.device("cuda")) == on_gpu
    assert conn.staging_kind(torch.device("cpu")) == "direct"  # aligned host memory, O_DIRECT
    conn.close()
    io.close()
    plain = file_connector(tmp_path, direct_io=False)  # the store's reads: host memory
    assert plain.staging_kind(torch.device("cuda")) == plain.staging_kind("cpu") == "host"
    plain.close()
