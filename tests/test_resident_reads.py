"""Chunks whose bytes are all in the page cache, read on the calling thread (real files).

`FileStore.read_resident_into` reads a chunk only where its residency oracle (the kernel's
`cachestat(2)` in production) says every page of its file is cached and the store's
directory is on a local filesystem; the core reads the leading such chunks of a load on
the engine's thread and hands the rest to the store's loop as before. Which chunks are
cached is declared through `DeclaredResidency` (tests.pagecache_fixtures), so each plan is
checked whatever the kernel keeps; the tests named `..._by_the_kernel` ask the kernel
itself and skip where it keeps or brings back a dropped file's pages.
"""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from connector import KVConnector
from storage.capabilities import NOT_RESIDENT, SupportsResidentReads
from storage.codec import HEADER_SIZE, encode_chunk
from storage.file import FileStore
from storage.pagecache import PAGE_CACHE
from tests.pagecache_fixtures import (
    DeclaredResidency,
    drop_from_page_cache,
    skip_brought_back,
    skip_unless_cached,
    skip_unless_dropped,
)
from tests.test_connector_core import LAYOUT, TOKENS, ListEngine, namespace, payload_of, saved
from tests.test_connector_direct import flip_payload_byte, keys_of

N = len(TOKENS) // LAYOUT.chunk_tokens
KEY = "0123456789abcdef/" + "ab" * 16


@pytest.fixture
def residency() -> DeclaredResidency:
    """The page cache as each test declares it: every file cached until it is dropped."""
    return DeclaredResidency()


@pytest.fixture
def cached_store(tmp_path, residency):
    """A file:// store holding KEY, its pages declared in the page cache."""
    store = FileStore(tmp_path / "kv", residency=residency)
    payload = np.arange(3000, dtype=np.uint8).tobytes()
    asyncio.run(store.put(KEY, encode_chunk(KEY, list(range(16)), payload)))
    return store, payload


def test_a_cached_chunk_is_read_with_its_exact_bytes_and_counted_as_a_hit(cached_store):
    store, payload = cached_store
    assert isinstance(store, SupportsResidentReads)
    out = bytearray(len(payload) + 10)
    header, why = store.read_resident_into(KEY, out)
    assert why is None and header.key == KEY and header.payload_len == len(payload)
    assert bytes(out[: len(payload)]) == payload
    assert store.stats()["hits"] == 1


@pytest.mark.parametrize("dropped", ["whole file", "last page"])
def test_a_chunk_not_all_in_the_page_cache_is_left_to_the_normal_path(cached_store, residency,
                                                                      dropped):
    store, payload = cached_store
    path = store.chunk_path(KEY)
    if dropped == "whole file":
        residency.drop(path)
    else:
        residency.drop(path, os.path.getsize(path) - 1, 1)
    out = bytearray(b"\xee" * len(payload))
    assert store.read_resident_into(KEY, out) is NOT_RESIDENT
    assert out == bytearray(b"\xee" * len(payload))  # nothing read
    assert store.stats()["gets"] == 0
    assert not store.is_resident(KEY)


def test_a_chunk_dropped_by_the_kernel_is_left_to_the_normal_path(tmp_path):
    """The kernel's own answer (cachestat(2)), the file's residency checked right before
    the read."""
    store = FileStore(tmp_path / "kv")
    assert store.residency is PAGE_CACHE
    payload = np.arange(3000, dtype=np.uint8).tobytes()
    asyncio.run(store.put(KEY, encode_chunk(KEY, list(range(16)), payload)))
    skip_unless_cached(store.chunk_path(KEY))
    out = bytearray(len(payload))
    header, why = store.read_resident_into(KEY, out)
    assert why is None and bytes(out) == payload
    drop_from_page_cache(store.chunk_path(KEY))
    skip_unless_dropped(store.chunk_path(KEY))
    out = bytearray(b"\xee" * len(payload))
    if store.read_resident_into(KEY, out) is not NOT_RESIDENT:  # cachestat said all cached
        skip_brought_back()
    assert store.stats()["gets"] == 1  # the first read only
    assert out == bytearray(b"\xee" * len(payload))  # nothing read


@pytest.mark.parametrize("verify", ["changed", "header", "always"])
def test_a_corrupt_cached_chunk_is_a_miss_and_quarantined_whatever_verify(tmp_path, residency,
                                                                          verify):
    store = FileStore(tmp_path / "kv", verify=verify, residency=residency)
    payload = bytes(range(256)) * 8
    asyncio.run(store.put(KEY, encode_chunk(KEY, list(range(16)), payload)))
    flip_payload_byte(store, KEY)
    assert store.read_resident_into(KEY, bytearray(len(payload))) == (None, "corrupt")
    assert not store.chunk_path(KEY).exists()
    assert store.stats()["corrupt"] == 1


def test_a_missing_chunk_is_a_miss(tmp_path):
    store = FileStore(tmp_path / "kv")
    assert store.read_resident_into(KEY, bytearray(64)) == (None, "missing")
    assert store.stats()["misses"] == 1


def test_a_chunk_read_in_one_go_with_its_header_is_exact_and_a_longer_header_is_read_again(
        tmp_path, residency):
    """Where `out` is exactly the payload of a file under a 4 KiB header, header and payload
    come in one read. A file of that size whose header is longer (many token ids) is read
    again from its real payload offset into one buffer, and refused, not quarantined, by
    parts that must hold exactly its payload."""
    store = FileStore(tmp_path / "kv", residency=residency)
    payload = bytes(range(256)) * 16
    asyncio.run(store.put(KEY, encode_chunk(KEY, list(range(16)), payload)))
    out = bytearray(len(payload))
    header, why = store.read_resident_into(KEY, out)
    assert why is None and header.header_len == HEADER_SIZE and bytes(out) == payload

    long_key = "0123456789abcdef/" + "cd" * 16
    blob = encode_chunk(long_key, list(range(1500)), payload)
    asyncio.run(store.put(long_key, blob))
    assert len(blob) - len(payload) > HEADER_SIZE
    room = len(blob) - HEADER_SIZE  # the file is as long as a 4 KiB header and `room`
    out = bytearray(b"\xee" * room)
    header, why = store.read_resident_into(long_key, out)
    assert why is None and header.header_len == len(blob) - len(payload)
    assert bytes(out[: len(payload)]) == payload
    halves = [memoryview(bytearray(room // 2)), memoryview(bytearray(room - room // 2))]
    assert store.read_resident_into(long_key, halves) == (None, "corrupt")
    assert store.chunk_path(long_key).exists()


def test_a_corrupt_header_read_with_its_payload_is_a_miss_and_quarantined(tmp_path, residency):
    store = FileStore(tmp_path / "kv", residency=residency)
    payload = bytes(range(256)) * 16
    asyncio.run(store.put(KEY, encode_chunk(KEY, list(range(16)), payload)))
    path = store.chunk_path(KEY)
    with open(path, "r+b") as f:
        f.seek(120)  # a token id: under the header's checksum
        b = f.read(1)
        f.seek(120)
        f.write(bytes([b[0] ^ 0x01]))
    assert store.read_resident_into(KEY, bytearray(len(payload))) == (None, "corrupt")
    assert not path.exists()
    assert store.stats()["corrupt"] == 1


def test_a_store_on_a_network_filesystem_never_reads_on_the_callers_thread(tmp_path, monkeypatch):
    """Even `open` of a cached file may wait on an NFS server. There is no NFS client here:
    the filesystem check is told the directory is not local."""
    monkeypatch.setattr("storage.file.is_local", lambda dev: False)
    store = FileStore(tmp_path / "kv")
    asyncio.run(store.put(KEY, encode_chunk(KEY, list(range(16)), b"x" * 100)))
    assert store.read_resident_into(KEY, bytearray(100)) is NOT_RESIDENT


def test_a_local_directory_answers_a_lookup_on_the_calling_thread(tmp_path):
    store = FileStore(tmp_path / "kv")
    asyncio.run(store.put(KEY, encode_chunk(KEY, list(range(16)), b"x" * 100)))
    other = "0123456789abcdef/" + "cd" * 16
    assert store.prefix_len_now([KEY, other, KEY]) == 1  # the first gap ends the prefix
    assert store.prefix_len_now([other, KEY]) == 0
    with pytest.raises(ValueError):
        store.prefix_len_now(["../../etc/passwd"])


def test_a_local_directory_says_which_chunks_of_a_prefix_are_in_the_page_cache(cached_store,
                                                                              residency):
    store, _ = cached_store
    other = "0123456789abcdef/" + "cd" * 16
    asyncio.run(store.put(other, encode_chunk(other, list(range(16)), b"y" * 100)))
    missing = "0123456789abcdef/" + "ef" * 16
    assert store.cached_prefix_now([KEY, other, missing, KEY]) == [True, True]
    residency.drop(store.chunk_path(other))
    assert store.cached_prefix_now([KEY, other]) == [True, False]
    assert store.cached_prefix_now([missing, KEY]) == []
    link = store.chunk_path(missing)  # a symlink is never opened: there, but not cached
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(store.chunk_path(KEY), link)
    assert store.cached_prefix_now([missing, KEY]) == [False, True]
    with pytest.raises(ValueError):
        store.cached_prefix_now([KEY, "../../etc/passwd"])


def test_a_network_filesystem_is_never_looked_up_on_the_callers_thread(tmp_path, monkeypatch):
    """No NFS client here: the filesystem check is told the directory is not local."""
    monkeypatch.setattr("storage.file.is_local", lambda dev: False)
    store = FileStore(tmp_path / "kv")
    assert store.prefix_len_now([KEY]) is None
    assert store.cached_prefix_now([KEY]) is None


def connector_counting_loop_lookups(root, monkeypatch, residency: DeclaredResidency | None = None,
                                    ) -> tuple[KVConnector, list[int]]:
    """A connector over a saved file:// store, and the key counts of the lookups its store
    answered on the loop (`prefix_len`), as they come."""
    conn = saved(KVConnector(FileStore(root, residency=residency), namespace(), layout=LAYOUT))
    hops: list[int] = []
    real = conn.store.prefix_len

    async def counted(keys):
        hops.append(len(keys))
        return await real(keys)

    monkeypatch.setattr(conn.store, "prefix_len", counted)
    return conn, hops


def test_the_core_looks_up_a_local_directory_without_its_loop(tmp_path, monkeypatch):
    conn, hops = connector_counting_loop_lookups(tmp_path, monkeypatch)
    answer = conn.lookup_async(keys_of(conn))
    assert answer.done() and answer.result() == N
    assert hops == []
    conn.resident_reads = False  # the switch for reads on the engine's thread covers lookups
    assert conn.lookup_async(keys_of(conn)).result(10) == N
    assert hops == [N]
    stats = conn.stats()
    assert stats["lookups"] == 2 and stats["lookup_tokens"] == 2 * N * LAYOUT.chunk_tokens
    conn.close()


def test_a_long_lookup_goes_to_the_loop_even_for_a_local_directory(tmp_path, monkeypatch):
    """Thousands of access(2) calls would hold an engine's scheduler for milliseconds."""
    conn, hops = connector_counting_loop_lookups(tmp_path, monkeypatch)
    monkeypatch.setattr("connector.core.LOCAL_LOOKUP_MAX_KEYS", N - 1)
    assert conn.lookup_async(keys_of(conn)).result(10) == N
    assert hops == [N]
    monkeypatch.setattr("connector.core.LOCAL_LOOKUP_MAX_KEYS", N)
    assert conn.lookup_async(keys_of(conn)).result(0) == N
    assert hops == [N]
    conn.close()


def test_a_lookup_with_the_page_cache_is_answered_here_for_every_rank(tmp_path, monkeypatch,
                                                                     residency):
    """`lookup_cached`: the chunks held for every key list, each with whether its files
    are all cached, in one pass on this thread, counted as a lookup; None (ask the loop)
    for a store that is not a local directory."""
    conn, hops = connector_counting_loop_lookups(tmp_path, monkeypatch, residency)
    keys = keys_of(conn)
    residency.drop(conn.store.chunk_path(keys[2]))
    assert conn.lookup_cached([keys]) == (N, [i != 2 for i in range(N)])
    assert conn.lookup_cached([keys, keys[:3]]) == (3, [True, True, False])  # two ranks
    assert hops == []
    stats = conn.stats()
    assert stats["lookups"] == 2 and stats["lookup_tokens"] == (N + 3) * LAYOUT.chunk_tokens
    conn.resident_reads = False
    assert conn.lookup_cached([keys]) is None
    conn.close()
    memory = KVConnector("memory://", namespace(), layout=LAYOUT)
    assert memory.lookup_cached([keys]) is None
    memory.close()


@pytest.mark.parametrize("with_cache", [False, True])
def test_a_failing_local_lookup_is_no_hit_and_tells_the_breaker(tmp_path, monkeypatch,
                                                                with_cache):
    conn = saved(KVConnector(f"file://{tmp_path}", namespace(), layout=LAYOUT))

    def broken(keys):
        raise OSError("EIO")

    def lookup() -> int:
        if with_cache:
            return conn.lookup_cached([keys_of(conn)])[0]
        return conn.lookup_async(keys_of(conn)).result(0)

    monkeypatch.setattr(conn.store, "cached_prefix_now" if with_cache else "prefix_len_now",
                        broken)
    assert lookup() == 0
    stats = conn.stats()
    assert stats["lookup_errors"] == 1
    assert lookup() == 0  # the breaker is open now
    assert conn.stats()["bypassed"] == 1
    conn.close()


class ThreadEngine(ListEngine):
    """A ListEngine that records which thread placed each chunk."""

    def __init__(self, n: int):
        super().__init__(n)
        self.threads: list[int] = []

    def place(self, i: int) -> None:
        super().place(i)
        self.threads.append(threading.get_ident())


def resident_connector(root, residency: DeclaredResidency | None = None) -> KVConnector:
    """A connector over a saved file:// store whose chunks are all declared cached."""
    store = FileStore(root, residency=DeclaredResidency() if residency is None else residency)
    return saved(KVConnector(store, namespace(), layout=LAYOUT))


def load_all(conn: KVConnector, engine: ListEngine):
    n = LAYOUT.chunk_tokens
    tokens = [TOKENS[i * n : (i + 1) * n] for i in range(N)]
    return conn.load_async(keys_of(conn), tokens, engine, deadline_s=10)


def test_a_cached_load_is_read_and_placed_before_load_async_returns(tmp_path):
    conn = resident_connector(tmp_path)
    engine = ThreadEngine(N)
    handle = load_all(conn, engine)
    assert handle.done() and handle.result(0) == [True] * N  # no hop through the loop
    assert engine.placed == list(range(N))
    assert set(engine.threads) == {threading.get_ident()}
    for i, buf in enumerate(engine.bufs):
        assert np.array_equal(buf, payload_of(i))
    stats = conn.stats()
    assert stats["resident_chunks"] == N and stats["loaded_chunks"] == N
    assert stats["chunk_io"]["counters"].get("chunk_reads", 0) == 0
    conn.close()


def test_chunks_no_longer_cached_are_read_through_chunkio_after_the_cached_ones(tmp_path,
                                                                              residency):
    conn = resident_connector(tmp_path, residency)
    for key in keys_of(conn)[3:]:
        residency.drop(conn.store.chunk_path(key))
    engine = ListEngine(N)
    handle = load_all(conn, engine)
    assert handle.result(10) == [True] * N
    for i, buf in enumerate(engine.bufs):
        assert np.array_equal(buf, payload_of(i))
    stats = conn.stats()
    assert stats["resident_chunks"] == 3
    assert stats["chunk_io"]["counters"]["chunk_reads"] == N - 3
    conn.close()


def test_a_corrupt_cached_chunk_ends_the_hit_and_nothing_after_it_is_read(tmp_path):
    conn = resident_connector(tmp_path)
    flip_payload_byte(conn.store, keys_of(conn)[2])
    engine = ListEngine(N)
    handle = load_all(conn, engine)
    assert handle.result(10) == [True, True] + [False] * (N - 2)
    assert engine.placed == [0, 1]
    stats = conn.stats()
    assert stats["verify_failures"] == 1 and stats["failed_chunks"] == N - 2
    assert stats["resident_chunks"] == 3
    assert stats["chunk_io"]["counters"].get("chunk_reads", 0) == 0
    conn.close()


class SegmentEngine(ListEngine):
    def __init__(self, n: int):
        super().__init__(n)
        self.segments: list[tuple[int, int]] = []

    def place_segment(self, i: int, s: int) -> None:
        self.segments.append((i, s))


def test_a_local_layerwise_load_reads_layer_after_layer_off_the_callers_thread(tmp_path):
    conn = resident_connector(tmp_path)
    engine = SegmentEngine(N)
    n = LAYOUT.chunk_tokens
    tokens = [TOKENS[i * n : (i + 1) * n] for i in range(N)]
    handle = conn.load_segments_async(keys_of(conn), tokens, engine, deadline_s=10)
    assert all(handle.wait_segment(s, 10) for s in range(LAYOUT.layers))
    assert handle.result(10) == [True] * N
    # Segment-major: layer 0 of every chunk before layer 1 of any.
    assert engine.segments == [(i, s) for s in range(LAYOUT.layers) for i in range(N)]
    for i, buf in enumerate(engine.bufs):
        assert np.array_equal(buf, payload_of(i))
    stats = conn.stats()
    assert stats["layered_chunks"] == N and stats["resident_chunks"] == 0
    assert stats["loaded_chunks"] == N
    conn.close()


class PinnedEngine(ListEngine):
    """A GPU engine's staging: host memory that says it is pinned (a stand-in: this CPU-only
    torch cannot pin memory)."""

    def __init__(self, n: int):
        import torch

        class Pinned(torch.Tensor):
            def is_pinned(self, *args, **kwargs) -> bool:
                return True

        super().__init__(n)
        self.bufs = [torch.from_numpy(b).as_subclass(Pinned) for b in self.bufs]


def test_a_gpu_engines_pinned_staging_is_read_by_chunkio_threads_not_on_the_callers(
        tmp_path, monkeypatch):
    # A GPU host reads a large hit faster in parallel: on an H100 host 13-15 GB/s through
    # ChunkIO against 2.8 GB/s on the engine's thread (docs/benchmarks/2026-11-27-gpu.md).
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # as on a GPU host
    conn = resident_connector(tmp_path)
    engine = PinnedEngine(N)
    assert engine.bufs[0].is_pinned()
    handle = load_all(conn, engine)
    assert handle.result(10) == [True] * N
    for i, buf in enumerate(engine.bufs):
        assert np.array_equal(buf.numpy(), payload_of(i))
    stats = conn.stats()
    assert stats["resident_chunks"] == 0 and stats["loaded_chunks"] == N
    assert stats["chunk_io"]["counters"]["chunk_reads"] == N
    conn.close()


def test_staging_is_not_asked_whether_it_is_pinned_before_cuda_is_up(tmp_path, monkeypatch):
    # Nothing is pinned before CUDA is initialized, and `is_pinned()` could initialize it
    # (a CUDA context for a CPU-only engine on a GPU host): the load must not ask.
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    conn = resident_connector(tmp_path)
    engine = PinnedEngine(N)
    asked = []
    for buf in engine.bufs:
        buf.is_pinned = lambda *a, **k: asked.append(1) or True
    assert load_all(conn, engine).result(10) == [True] * N
    assert asked == [] and conn.stats()["resident_chunks"] == N
    conn.close()
