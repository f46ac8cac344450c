"""Every read failure is one typed error (ReadError, with a reason) that the connector turns
into a miss; the FileStore helper turns it into None."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from gds import ReadError, aread_store_chunks, read_store_chunks
from gds.errors import CORRUPT, IO, MISSING, SHORT
from gds.fsprobe import DirectIOSupport
from gds.hostio import OpenFile, read_range
from hashing import chunk_keys
from storage import encode_chunk
from storage.file import FileStore, _chunk_path
from tests.gds_fixtures import PIECE, cpu_io, payload, write_chunk

KiB = 1024


@pytest.fixture
def io():
    with cpu_io() as chunk_io:
        yield chunk_io


def _reason(future) -> str:
    with pytest.raises(ReadError) as err:
        future.result()
    return err.value.reason


def test_a_missing_file_is_missing(tmp_path, io):
    assert _reason(io.submit_chunk(tmp_path / "gone.kv", bytearray(KiB))) == MISSING
    assert _reason(io.submit_read(tmp_path / "gone.kv", 0, 10, bytearray(KiB))) == MISSING
    assert io.stats()["counters"]["read_missing"] == 2


def test_a_truncated_chunk_is_corrupt_and_a_range_past_the_end_is_short(tmp_path, ns, io):
    data = payload(2 * PIECE)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    size = path.stat().st_size
    os.truncate(path, size - 1)
    assert _reason(io.submit_chunk(path, np.empty(data.size, np.uint8), key=key)) == CORRUPT
    assert _reason(io.submit_read(path, 4096, data.size, np.empty(data.size, np.uint8))) == SHORT


def test_a_file_shorter_than_its_header_is_corrupt(tmp_path, ns, io):
    path, key, _ = write_chunk(tmp_path, ns, 0, payload(KiB))
    os.truncate(path, 100)
    assert _reason(io.submit_chunk(path, bytearray(KiB), key=key)) == CORRUPT
    path.write_bytes(b"")
    assert _reason(io.submit_chunk(path, bytearray(KiB), key=key)) == CORRUPT


def test_a_file_that_shrinks_under_the_reader_is_short(tmp_path):
    """The size check happens at open; the piece reader itself still notices EOF."""
    path = tmp_path / "raw.bin"
    path.write_bytes(payload(3 * KiB).tobytes())
    with OpenFile.for_read(str(path), DirectIOSupport()) as f:
        with pytest.raises(ReadError) as err:
            read_range(f, memoryview(bytearray(8 * KiB)), 0)
    assert err.value.reason == SHORT


def test_an_eio_from_the_kernel_is_an_io_error():
    """Reading unmapped addresses of /proc/self/mem makes the kernel answer EIO: a real one."""
    with OpenFile.for_read("/proc/self/mem", DirectIOSupport()) as f:
        with pytest.raises(ReadError) as err:
            read_range(f, memoryview(bytearray(KiB)), 0, "never")
    assert err.value.reason == IO
    assert "Input/output error" in str(err.value)


def test_reading_a_directory_is_an_io_error(tmp_path, io):
    assert _reason(io.submit_chunk(tmp_path, bytearray(KiB))) == IO


def test_a_non_chunk_file_is_corrupt(tmp_path, io):
    path = tmp_path / "junk.kv"
    path.write_bytes(os.urandom(3 * KiB))
    assert _reason(io.submit_chunk(path, bytearray(KiB))) == CORRUPT


def test_bad_arguments_are_programming_errors_raised_at_submit(tmp_path, io):
    with pytest.raises(ValueError):
        io.submit_read(tmp_path / "x", 0, 10, bytearray(5))
    with pytest.raises(ValueError):
        io.submit_read(tmp_path / "x", -1, 1, bytearray(5))


def _filled_store(tmp_path, ns, n):
    store = FileStore(tmp_path / "store")
    tokens = list(range(n * ns.chunk_tokens))
    keys = chunk_keys(tokens, ns)
    datas = [payload(PIECE + 17 * i, seed=i) for i in range(n)]
    for i, (key, data) in enumerate(zip(keys, datas, strict=True)):
        chunk_tokens = tokens[i * ns.chunk_tokens : (i + 1) * ns.chunk_tokens]
        asyncio.run(store.put(key, encode_chunk(key, chunk_tokens, data)))
    return store, keys, datas


def test_file_store_helper_answers_per_key_header_or_none(tmp_path, ns, io):
    store, keys, datas = _filled_store(tmp_path, ns, 4)
    _chunk_path(store.root, keys[1]).unlink()  # evicted by a peer
    bad = _chunk_path(store.root, keys[2])
    blob = bytearray(bad.read_bytes())
    blob[-1] ^= 0xFF  # bit rot in the payload
    bad.write_bytes(bytes(blob))
    dests = [np.empty(d.size, np.uint8) for d in datas]
    got = read_store_chunks(io, store, keys, dests)
    assert [h is not None for h in got] == [True, False, False, True]
    assert got[0].key == keys[0]
    assert np.array_equal(dests[0], datas[0]) and np.array_equal(dests[3], datas[3])
    counters = io.stats()["counters"]
    assert counters["read_missing"] == 1 and counters["read_corrupt"] == 1


async def test_file_store_helper_is_awaitable(tmp_path, ns, io):
    store = FileStore(tmp_path / "store")
    tokens = list(range(3 * ns.chunk_tokens))
    keys = chunk_keys(tokens, ns)
    datas = [payload(KiB * (i + 1), seed=i) for i in range(3)]
    for i, (key, data) in enumerate(zip(keys, datas, strict=True)):
        await store.put(key, encode_chunk(key, tokens[i * ns.chunk_tokens : (i + 1) * ns.chunk_tokens], data))
    dests = [np.empty(d.size, np.uint8) for d in datas]
    token_ids = [tokens[i * ns.chunk_tokens : (i + 1) * ns.chunk_tokens] for i in range(3)]
    token_ids[2] = [t + 1 for t in token_ids[2]]  # a request whose tokens differ: no false hit
    got = await aread_store_chunks(io, store, keys, dests, token_ids)
    assert [h is not None for h in got] == [True, True, False]
    assert all(np.array_equal(d, x) for d, x in zip(dests[:2], datas[:2], strict=True))
