"""Tensors become chunk files: the codec's format, published atomically and create-only."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from gds import WriteError, aligned_empty
from gds.errors import IO
from hashing import chunk_keys
from storage.codec import decode_chunk
from storage.file import FileStore, _chunk_path
from tests.gds_fixtures import PIECE, cpu_io, payload


def _chunk(ns, index=0):
    tokens = [index * ns.chunk_tokens + t for t in range(ns.chunk_tokens)]
    return chunk_keys(tokens, ns)[0], tokens


@pytest.mark.parametrize("direct", ["auto", "always"])
def test_a_written_tensor_decodes_as_the_same_chunk(tmp_path, ns, direct):
    key, tokens = _chunk(ns)
    data = payload(3 * PIECE + 11)
    src = aligned_empty(data.size)  # aligned, so direct=always really uses O_DIRECT on ext4
    src.copy_(torch.from_numpy(data))
    path = tmp_path / "a" / "b" / "c.kv"
    with cpu_io(direct=direct) as io:
        assert io.submit_write(path, key, tokens, src, meta={"dtype": "uint8"}).result() is True
        (fs,) = io.stats()["filesystems"].values() or [{"direct": None}]
    if direct == "always" and fs.get("fstype") == "ext4":
        assert fs["direct"] is True
    chunk = decode_chunk(path.read_bytes(), key, tokens)
    assert bytes(chunk.payload) == data.tobytes()
    assert chunk.meta == {"dtype": "uint8"}
    assert [p.name for p in path.parent.iterdir()] == ["c.kv"]  # no tmp left behind


def test_writes_are_create_only(tmp_path, ns):
    key, tokens = _chunk(ns)
    path = tmp_path / "c.kv"
    with cpu_io() as io:
        assert io.submit_write(path, key, tokens, payload(100)).result() is True
        assert io.submit_write(path, key, tokens, payload(100, seed=1)).result() is False
        assert io.stats()["counters"]["writes_skipped"] == 1
    assert bytes(decode_chunk(path.read_bytes(), key).payload) == payload(100).tobytes()


def test_racing_writers_of_one_key_publish_exactly_once(tmp_path, ns):
    key, tokens = _chunk(ns)
    path = tmp_path / "c.kv"
    data = payload(2 * PIECE)
    start = threading.Barrier(4)
    results = []

    def writer():
        with cpu_io() as io:
            start.wait()
            results.append(io.submit_write(path, key, tokens, data).result())

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1 and results.count(False) == 3
    assert bytes(decode_chunk(path.read_bytes(), key).payload) == data.tobytes()
    assert [p.name for p in tmp_path.iterdir()] == ["c.kv"]


def test_a_file_store_serves_what_chunk_io_wrote_and_chunk_io_reads_it_back(tmp_path, ns):
    store = FileStore(tmp_path)
    key, tokens = _chunk(ns)
    data = payload(PIECE + 3)
    with cpu_io() as io:
        asyncio.run(io.write(_chunk_path(store.root, key), key, tokens, torch.from_numpy(data)))
        dest = torch.empty(data.size, dtype=torch.uint8)
        header = io.submit_chunk(_chunk_path(store.root, key), dest, key=key, token_ids=tokens).result()
    blob = asyncio.run(store.get(key))
    assert blob is not None and bytes(decode_chunk(blob, key).payload) == data.tobytes()
    assert header.payload_len == data.size and np.array_equal(dest.numpy(), data)


def test_an_unusable_directory_is_a_write_error_and_leaves_nothing(tmp_path, ns):
    key, tokens = _chunk(ns)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with cpu_io() as io:
        with pytest.raises(WriteError) as err:
            io.submit_write(blocker / "c.kv", key, tokens, payload(10)).result()
        assert err.value.reason == IO
        assert io.stats()["counters"]["write_errors"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_malformed_key_is_a_programming_error(tmp_path):
    with cpu_io() as io, pytest.raises(ValueError, match="malformed key"):
        io.submit_write(tmp_path / "c.kv", "not-a-key", [1, 2], payload(10)).result()
