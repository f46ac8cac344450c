"""Path 4: chunk payloads and file ranges land in CPU tensors in place, byte for byte."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest
import torch

from gds import aligned_empty, enable_direct_reads
from gds.buffers import ALIGN, address, host_view
from gds.errors import CORRUPT, TOO_SMALL, ReadError
from gds.hostio import OpenFile
from hashing import Namespace
from storage.file import FileStore
from storage.pagecache import PAGE_CACHE
from tests.gds_fixtures import PIECE, cpu_io, payload, shm_directory, write_chunk
from tests.pagecache_fixtures import (
    DeclaredResidency,
    drop_from_page_cache,
    skip_brought_back,
    skip_unless_dropped,
)

KiB = 1024


@pytest.fixture
def io():
    with cpu_io() as chunk_io:
        yield chunk_io


@pytest.fixture
def shm_dir():
    yield from shm_directory()


def test_chunk_payload_lands_in_a_bfloat16_tensor_byte_for_byte(tmp_path, ns, io):
    data = payload(5 * PIECE + 123)  # several pieces, so several threads
    path, key, tokens = write_chunk(tmp_path, ns, 0, data)
    dest = torch.empty(data.size // 2 + 1, dtype=torch.bfloat16)
    header = io.submit_chunk(path, dest, key=key, token_ids=tokens).result()
    assert header.key == key and header.payload_len == data.size
    assert np.array_equal(host_view(dest)[: data.size], data)
    assert io.stats()["backends"] == {"cpu": "host", "cuda": None}
    assert io.stats()["counters"]["chunk_reads"] == 1


@pytest.mark.parametrize("length", [1, ALIGN - 1, ALIGN + 1, PIECE - 1, PIECE + 1, 3 * PIECE + 7])
def test_lengths_that_are_not_multiples_of_4k(tmp_path, ns, io, length):
    data = payload(length, seed=length)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    dest = np.zeros(length, dtype=np.uint8)
    io.submit_chunk(path, dest, key=key).result()
    assert np.array_equal(dest, data)


@pytest.mark.parametrize("direct", ["auto", "always", "never"])
@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 4097, 3 * PIECE + 5])
def test_ranges_at_odd_offsets_into_odd_addresses(tmp_path, offset, direct):
    data = payload(4 * PIECE + 999, seed=7)
    path = tmp_path / "raw.bin"
    path.write_bytes(data.tobytes())
    length = data.size - offset - 3
    backing = aligned_empty(length + 1)
    dest = backing[1:]  # one byte past a 4 KiB boundary: never O_DIRECT-able
    with cpu_io(direct=direct) as chunk_io:
        assert chunk_io.submit_read(path, offset, length, dest).result() == length
    assert np.array_equal(dest.numpy(), data[offset : offset + length])


def test_aligned_destination_on_ext4_is_read_with_o_direct(tmp_path, ns):
    """direct=always and an aligned tensor: the filesystem is recorded as taking O_DIRECT
    (tmp_path lives on this machine's ext4 root; the test skips elsewhere)."""
    data = payload(3 * PIECE + 100)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    dest = aligned_empty(data.size)
    assert address(host_view(dest)) % ALIGN == 0
    with cpu_io(direct="always") as chunk_io:
        chunk_io.submit_chunk(path, dest, key=key).result()
        fs = chunk_io.stats()["filesystems"]
    assert np.array_equal(dest.numpy(), data)
    (info,) = fs.values()
    if info["fstype"] not in ("ext4", "xfs"):
        pytest.skip(f"tmp_path is on {info['fstype']}, not ext4/xfs")
    assert info["direct"] is True


def test_o_direct_reads_the_file_whose_header_was_checked_even_after_its_name_moved(tmp_path):
    """The O_DIRECT descriptor is opened on first need, after the header read; by then the
    name may point to another file (the chunk evicted and its name reused). It is opened
    through /proc/self/fd, so it reads the same inode as the buffered descriptor."""
    from gds.fsprobe import DirectIOSupport
    from gds.hostio import read_range

    data, other = payload(4 * PIECE, seed=1), payload(4 * PIECE, seed=2)
    path, moved = tmp_path / "chunk.bin", tmp_path / "other.bin"
    path.write_bytes(data.tobytes())
    moved.write_bytes(other.tobytes())
    dest = aligned_empty(2 * PIECE)
    with OpenFile.for_read(str(path), DirectIOSupport()) as f:
        os.replace(moved, path)
        direct = read_range(f, host_view(dest), PIECE, "always")
        fstype = f.support.filesystem(f.dev).fstype
    assert np.array_equal(dest.numpy(), data[PIECE : 3 * PIECE])
    if fstype not in ("ext4", "xfs"):
        pytest.skip(f"tmp_path is on {fstype}, not ext4/xfs: no O_DIRECT read happened")
    assert direct == 2 * PIECE


def test_tmpfs_falls_back_to_buffered_reads_silently(shm_dir, ns):
    data = payload(3 * PIECE + 100)
    path, key, _ = write_chunk(shm_dir, ns, 0, data)
    dest = aligned_empty(data.size)
    with cpu_io(direct="always") as chunk_io:
        chunk_io.submit_chunk(path, dest, key=key).result()
        (info,) = chunk_io.stats()["filesystems"].values()
    assert np.array_equal(dest.numpy(), data)
    assert info["fstype"] == "tmpfs" and info["direct"] is False


def test_direct_never_opens_nothing_with_o_direct(tmp_path, ns):
    data = payload(PIECE)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    with cpu_io(direct="never") as chunk_io:
        f = OpenFile.for_read(str(path), chunk_io.support)
        with f:
            assert f.direct_fd() is None


def test_a_larger_destination_gets_only_the_payload(tmp_path, ns, io):
    data = payload(10 * KiB)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    dest = np.full(data.size + 500, 0xAB, dtype=np.uint8)
    io.submit_chunk(path, dest, key=key).result()
    assert np.array_equal(dest[: data.size], data)
    assert (dest[data.size :] == 0xAB).all()


def test_a_too_small_destination_is_a_typed_error(tmp_path, ns, io):
    path, key, _ = write_chunk(tmp_path, ns, 0, payload(10 * KiB))
    with pytest.raises(ReadError) as err:
        io.submit_chunk(path, np.zeros(10 * KiB - 1, np.uint8), key=key).result()
    assert err.value.reason == TOO_SMALL


def test_bytearray_and_numpy_destinations_work_without_torch_tensors(tmp_path, ns, io):
    data = payload(2 * PIECE)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    for dest in (bytearray(data.size), np.empty(data.size, np.uint8)):
        io.submit_chunk(path, dest, key=key).result()
        assert bytes(dest) == data.tobytes()


def test_checksum_mode_rejects_a_flipped_payload_byte(tmp_path, ns, io):
    data = payload(3 * PIECE)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    blob = bytearray(path.read_bytes())
    blob[-PIECE] ^= 0x01
    path.write_bytes(bytes(blob))
    with pytest.raises(ReadError) as err:
        io.submit_chunk(path, np.empty(data.size, np.uint8), key=key).result()
    assert err.value.reason == CORRUPT
    assert io.stats()["counters"]["read_corrupt"] == 1


def test_header_mode_trusts_the_filesystem_for_payload_bytes(tmp_path, ns):
    """verify=header checks the header and the length only: a flipped payload byte passes.
    This is the documented trade-off of skipping the payload hash."""
    data = payload(PIECE)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01
    path.write_bytes(bytes(blob))
    dest = np.empty(data.size, np.uint8)
    with cpu_io(verify="header") as chunk_io:
        chunk_io.submit_chunk(path, dest, key=key).result()
    assert (dest != data).sum() == 1


def test_wrong_key_or_tokens_are_corrupt(tmp_path, ns, io):
    path, key, tokens = write_chunk(tmp_path, ns, 0, payload(KiB))
    _, other_key, _ = write_chunk(tmp_path, ns, 1, payload(KiB))
    dest = np.empty(KiB, np.uint8)
    for kwargs in ({"key": other_key}, {"key": key, "token_ids": [t + 1 for t in tokens]}):
        with pytest.raises(ReadError) as err:
            io.submit_chunk(path, dest, **kwargs).result()
        assert err.value.reason == CORRUPT


def test_headers_longer_than_4k_are_read_whole(tmp_path, io):
    """2,048 token ids take 8 KiB: the payload starts at 12 KiB, still 4 KiB-aligned."""
    wide = Namespace(model="test/model", dtype="float32", layout="test", chunk_tokens=2048)
    data = payload(PIECE + 1)
    path, key, tokens = write_chunk(tmp_path, wide, 0, data)
    dest = np.empty(data.size, np.uint8)
    header = io.submit_chunk(path, dest, key=key, token_ids=tokens).result()
    assert header.header_len == 12 * KiB
    assert np.array_equal(dest, data)


async def test_reads_are_awaitable_from_an_event_loop(tmp_path, ns, io):
    chunks = [write_chunk(tmp_path, ns, i, payload(PIECE + i, seed=i)) for i in range(6)]
    dests = [np.empty(PIECE + i, np.uint8) for i in range(6)]
    headers = await asyncio.gather(*(io.read_chunk(p, d, key=k) for (p, k, _), d in zip(chunks, dests, strict=True)))
    assert [h.key for h in headers] == [k for _, k, _ in chunks]
    for i, d in enumerate(dests):
        assert np.array_equal(d, payload(PIECE + i, seed=i))
    assert await io.read(chunks[0][0], 0, 16, bytearray(16)) == 16


def test_no_more_than_max_inflight_requests_run_at_once(tmp_path, ns, monkeypatch):
    """Opening a file is gated, so requests pile up inside it: never more than max_in_flight."""
    chunks = [write_chunk(tmp_path, ns, i, payload(KiB)) for i in range(6)]
    gate, lock = threading.Event(), threading.Lock()
    active = peak = 0
    real_open = OpenFile.for_read.__func__

    def gated_open(cls, path, support):
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        gate.wait(10)
        with lock:
            active -= 1
        return real_open(cls, path, support)

    monkeypatch.setattr(OpenFile, "for_read", classmethod(gated_open))
    with cpu_io(max_in_flight=2) as chunk_io:
        futures = [chunk_io.submit_chunk(p, np.empty(KiB, np.uint8), key=k) for p, k, _ in chunks]
        assert not any(f.done() for f in futures)  # submitting never blocked on the I/O
        gate.set()
        assert all(f.result().payload_len == KiB for f in futures)
    assert peak == 2


def test_host_reads_take_one_piece_per_thread_share_up_to_a_cap():
    with cpu_io(io_threads=2, piece_bytes=4 << 20) as chunk_io:
        assert chunk_io.host.piece_for(16 << 20) == 8 << 20  # two pieces, one per thread
        assert chunk_io.host.piece_for(6 << 20) == 3 << 20
        assert chunk_io.host.piece_for(256 << 20) == 16 << 20  # capped: 16 pieces
        assert chunk_io.host.piece_for(1 << 20) == 1 << 20  # one piece: not worth a split
    with cpu_io(io_threads=4, piece_bytes=4 << 20) as chunk_io:
        # Threads are shared among the reads running at once; past one read per thread
        # each is read whole on its own request thread.
        assert chunk_io.host.piece_for(16 << 20, active=2) == 8 << 20
        assert chunk_io.host.piece_for(16 << 20, active=4) == 16 << 20
        assert chunk_io.host.piece_for(256 << 20, active=8) == 256 << 20


def test_auto_serves_cached_chunks_from_the_cache_and_cold_ones_with_o_direct(tmp_path, ns):
    """On ext4: a chunk in the page cache never opens an O_DIRECT descriptor; one not in
    it is read with O_DIRECT into an aligned tensor. Residency is declared to ChunkIO's
    oracle (as a FileStore hands it its own), not asked of the kernel."""
    data = payload(4 * PIECE)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    dest = aligned_empty(data.size)
    residency = DeclaredResidency()
    with cpu_io(residency, direct="auto") as chunk_io:
        chunk_io.submit_chunk(path, dest, key=key).result()
        (cached,) = chunk_io.stats()["filesystems"].values()
    assert np.array_equal(dest.numpy(), data)
    if cached["fstype"] != "ext4":
        pytest.skip(f"tmp_path is on {cached['fstype']}, not ext4")
    assert cached["direct"] is None and cached["cachestat"] is True
    residency.drop(path)
    dest.zero_()
    with cpu_io(residency, direct="auto") as chunk_io:
        chunk_io.submit_chunk(path, dest, key=key).result()
        (cold,) = chunk_io.stats()["filesystems"].values()
    assert np.array_equal(dest.numpy(), data)
    assert cold["direct"] is True


def test_a_chunk_dropped_by_the_kernel_is_read_with_o_direct(tmp_path, ns):
    """The kernel's own answer (cachestat(2)), its residency checked right before the read."""
    data = payload(4 * PIECE)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())  # clean pages, which DONTNEED may drop
    drop_from_page_cache(path)
    dest = aligned_empty(data.size)
    with cpu_io(direct="auto") as chunk_io:
        skip_unless_dropped(path)
        chunk_io.submit_chunk(path, dest, key=key).result()
        (cold,) = chunk_io.stats()["filesystems"].values()
    assert np.array_equal(dest.numpy(), data)
    if cold["fstype"] != "ext4":
        pytest.skip(f"tmp_path is on {cold['fstype']}, not ext4")
    if cold["direct"] is None:  # never opened O_DIRECT: cachestat(2) said all cached
        skip_brought_back()
    assert cold["direct"] is True


def test_a_file_stores_direct_reads_ask_its_residency_oracle(tmp_path):
    residency = DeclaredResidency()
    store = FileStore(tmp_path, residency=residency)
    assert enable_direct_reads(store).support.residency is residency
    asyncio.run(store.close())
    kernel = FileStore(tmp_path)
    assert enable_direct_reads(kernel).support.residency is PAGE_CACHE
    asyncio.run(kernel.close())


def test_concurrent_submitters_share_one_chunk_io_safely(tmp_path, ns):
    chunks = [write_chunk(tmp_path, ns, i, payload(2 * PIECE + i, seed=i)) for i in range(4)]
    errors = []

    def reader(chunk_io):
        try:
            for _ in range(5):
                for i, (path, key, _) in enumerate(chunks):
                    dest = np.empty(2 * PIECE + i, np.uint8)
                    chunk_io.submit_chunk(path, dest, key=key).result()
                    assert np.array_equal(dest, payload(2 * PIECE + i, seed=i))
        except Exception as exc:  # collected and re-raised on the test thread
            errors.append(exc)

    with cpu_io(max_in_flight=3) as chunk_io:
        threads = [threading.Thread(target=reader, args=(chunk_io,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert chunk_io.stats()["counters"]["chunk_reads"] == 4 * 5 * 4
    assert errors == []


async def test_many_ranges_in_one_call_report_each_miss_on_its_own(tmp_path, io):
    data = payload(3 * PIECE)
    path = tmp_path / "raw.bin"
    path.write_bytes(data.tobytes())
    dests = [np.empty(PIECE, np.uint8) for _ in range(3)]
    ranges = [(path, i * PIECE, PIECE, d) for i, d in enumerate(dests)]
    ranges.append((tmp_path / "gone.bin", 0, 10, bytearray(10)))
    got = await io.read_many(ranges)
    assert got[:3] == [PIECE] * 3 and isinstance(got[3], ReadError)
    assert all(np.array_equal(d, data[i * PIECE : (i + 1) * PIECE]) for i, d in enumerate(dests))
    futures = io.submit_reads(ranges[:3])
    assert [f.result() for f in futures] == [PIECE] * 3


def test_pieces_no_pool_thread_started_are_read_by_the_request_thread():
    """With every I/O thread busy elsewhere, a range still completes: its pieces are taken
    back and read in order by the thread that asked for them."""
    from concurrent.futures import ThreadPoolExecutor

    from gds.backends import run_pieces

    gate = threading.Event()
    done = []
    with ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(gate.wait, 10)  # the only pool thread is stuck
        run_pieces(pool, lambda a, b: (a, b), 10 * KiB, 3 * KiB,
                   lambda a, b, result: done.append(result))
        # It returned while the pool thread was still stuck (it waited for that thread to
        # dequeue the pieces it had taken back, 10 s here, before).
        assert not stuck.done()
        gate.set()
    assert done == [(0, 3 * KiB), (3 * KiB, 6 * KiB), (6 * KiB, 9 * KiB), (9 * KiB, 10 * KiB)]


def test_a_blocking_read_runs_on_the_callers_thread_and_fails_the_same_way(tmp_path, ns, io):
    data = payload(3 * PIECE + 1)
    path, key, tokens = write_chunk(tmp_path, ns, 0, data)
    dest = np.empty(data.size, np.uint8)
    assert io.read_chunk_blocking(path, dest, key=key, token_ids=tokens).payload_len == data.size
    assert np.array_equal(dest, data)
    with pytest.raises(ReadError):
        io.read_chunk_blocking(tmp_path / "gone.kv", dest)
