"""Lean loads: a target that needs only some layers of some chunks (`LeanTarget.wanted`: a
sliding-window layer outside the window at the hit's end) has only those byte ranges read,
each verified against its own segments, through every store's ranged reads.

Real stores on loopback: memory://, file:// on a temporary directory, s3:// (moto: ranged
GETs) and http:// (a kvserver subprocess: Range requests). The vLLM side (which layers a
hit needs, and a hybrid engine's blocks): tests/test_vllm_hybrid.py.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from connector import KVConnector
from connector.layout import CanonLayout
from hashing import Namespace, chunk_keys
from storage.codec import HEADER_SIZE, decode_header
from storage.file import FileStore
from tests.pagecache_fixtures import DeclaredResidency

LAYERS, HEADS, DIM, CHUNK = 3, 2, 8, 32
CANONICAL = CanonLayout(((HEADS, 2, DIM),) * LAYERS, CHUNK, "bfloat16")
PART = CANONICAL.layer_nbytes(0)
TOKENS = np.arange(700, 700 + 3 * CHUNK)
SENTINEL = 0xA5  # staging bytes no read wrote
# Chunk 0 needs layer 2 alone (layers 0 and 1 slide out of the window), chunk 1 layers 1
# and 2, chunk 2 every layer.
WANTED = [[2], [1, 2], None]

pytest_plugins = ("tests.ranged_store_fixtures",)  # store_url: memory, file, s3, http


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, CANONICAL.payload_nbytes, dtype=np.uint8)


class LeanStaging:
    """Host staging per chunk, filled with SENTINEL; needs `wanted[i]` of chunk i."""

    def __init__(self, wanted: list[list[int] | None]):
        self.want = wanted
        self.bufs = [np.full(CANONICAL.payload_nbytes, SENTINEL, dtype=np.uint8)
                     for _ in wanted]
        self.placed: list[int] = []
        self.threads: set[int] = set()

    def staging(self, i: int) -> np.ndarray:
        return self.bufs[i]

    def place(self, i: int) -> None:
        self.placed.append(i)
        self.threads.add(threading.get_ident())

    def wanted(self, i: int) -> list[int] | None:
        return self.want[i]


def layer(buf: np.ndarray, s: int) -> bytes:
    return buf[s * PART : (s + 1) * PART].tobytes()


@contextlib.contextmanager
def saved(url: str, **reader: Any) -> Iterator[tuple[KVConnector, list[str], list[Any]]]:
    """A reader (`reader`: its options) of TOKENS' 3 chunks, which a writer saved."""
    ns = Namespace(model="test/lean", dtype="bfloat16", layout=CANONICAL.name,
                   chunk_tokens=CHUNK, salt=uuid.uuid4().hex)
    keys = chunk_keys(TOKENS, ns)
    with (KVConnector(url, ns, layout=CANONICAL.reader()) as writer,
          KVConnector(url, ns, layout=CANONICAL.reader(), **reader) as loader):
        writer.save(TOKENS, payload)
        assert writer.flush(10)
        yield loader, keys, [TOKENS[i * CHUNK : (i + 1) * CHUNK] for i in range(len(keys))]


def assert_only_wanted_layers_landed(target: LeanStaging) -> None:
    """Each chunk's wanted layers are the writer's bytes; the others were never written."""
    for i, want in enumerate(WANTED):
        for s in range(LAYERS):
            if want is None or s in want:
                assert layer(target.bufs[i], s) == layer(payload(i), s)
            else:
                assert set(layer(target.bufs[i], s)) == {SENTINEL}


def test_a_lean_load_reads_the_layers_each_chunk_needs_and_nothing_else(store_url):
    """With ranged reads on, each chunk's wanted layers land bit-identical in their places
    in staging, the others are not written, and the hit counts only the bytes read."""
    with saved(store_url, partial_reads="ranges") as (reader, keys, tokens):
        target = LeanStaging(WANTED)
        assert reader.load_async(keys, tokens, target).result(10) == [True] * 3
        counters = reader.counters()
    assert sorted(target.placed) == [0, 1, 2]
    assert_only_wanted_layers_landed(target)
    assert counters["hit_bytes"] == (1 + 2 + 3) * PART
    assert counters["verify_failures"] == 0


def cached_reader(root: Any, residency: DeclaredResidency
                  ) -> tuple[KVConnector, list[str], list[Any]]:
    """A ranged reader of TOKENS' 3 chunks in a file:// store, saved by a writer; the
    reader's page cache is as `residency` declares it."""
    ns = Namespace(model="test/lean", dtype="bfloat16", layout=CANONICAL.name,
                   chunk_tokens=CHUNK, salt=uuid.uuid4().hex)
    keys = chunk_keys(TOKENS, ns)
    with KVConnector(f"file://{root}", ns, layout=CANONICAL.reader()) as writer:
        writer.save(TOKENS, payload)
        assert writer.flush(10)
    reader = KVConnector(FileStore(root, residency=residency), ns, layout=CANONICAL.reader(),
                         partial_reads="ranges")
    return reader, keys, [TOKENS[i * CHUNK : (i + 1) * CHUNK] for i in range(len(keys))]


def test_a_lean_load_of_page_cached_chunks_reads_only_their_wanted_ranges_on_the_callers_thread(
        tmp_path):
    """Chunks of a local directory in the page cache: a lean load reads each chunk's
    header and wanted ranges on the thread that starts it (the page-cache plan, counted in
    `resident_chunks`), places them before `load_async` returns, and never needs the
    ranges it does not want: those are declared out of the page cache (a read of them
    would have to wait on the disk) and left unread."""
    residency = DeclaredResidency()
    reader, keys, tokens = cached_reader(tmp_path / "kv", residency)
    with reader:
        for i, want in enumerate(WANTED):
            for s in range(LAYERS):
                if want is not None and s not in want:
                    residency.drop(reader.store.chunk_path(keys[i]), HEADER_SIZE + s * PART,
                                   PART)
        target = LeanStaging(WANTED)
        handle = reader.load_async(keys, tokens, target)
        assert handle.done() and handle.result(0) == [True] * 3  # no hop through the loop
        counters = reader.counters()
    assert target.placed == [0, 1, 2] and target.threads == {threading.get_ident()}
    assert_only_wanted_layers_landed(target)
    assert counters["resident_chunks"] == 3
    assert counters["hit_bytes"] == (1 + 2 + 3) * PART


def test_a_page_cached_range_a_lean_load_needs_that_is_damaged_is_a_miss_and_quarantined(
        tmp_path):
    """A flipped byte in a wanted range of chunk 1, read from the page cache on the
    caller's thread: chunk 1 and those after it are a miss, the file is quarantined (the
    next engine that computes the chunk writes it again), and chunk 0 is placed."""
    reader, keys, tokens = cached_reader(tmp_path / "kv", DeclaredResidency())
    with reader:
        path = reader.store.chunk_path(keys[1])
        data = bytearray(path.read_bytes())
        data[decode_header(bytes(data), keys[1]).header_len + PART + 5] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        target = LeanStaging(WANTED)
        assert reader.load_async(keys, tokens, target).result(10) == [True, False, False]
        counters = reader.counters()
        assert not path.exists()
    assert target.placed == [0]
    assert counters["verify_failures"] == 1 and counters["resident_chunks"] == 2


def test_a_range_no_chunk_needs_is_never_read_and_one_it_needs_is_verified(tmp_path):
    """One byte of layer 0 of chunk 0 flipped in its file: a load that does not need that
    layer of chunk 0 reads around it (the hit is whole and exact); a load that needs it
    rejects chunk 0 by its segment checksum, and the chunks after it are a miss too."""
    url = f"file://{tmp_path}/kv"
    with saved(url) as (reader, keys, tokens):
        path = next(p for p in (tmp_path / "kv").rglob("*.kv")
                    if keys[0].split("/")[1] in p.name)
        data = bytearray(path.read_bytes())
        data[decode_header(bytes(data), keys[0]).header_len + PART // 2] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        lean = LeanStaging(WANTED)
        assert reader.load_async(keys, tokens, lean).result(10) == [True] * 3
        assert layer(lean.bufs[0], 2) == layer(payload(0), 2)
        assert reader.counters()["verify_failures"] == 0
        every = LeanStaging([[0, 2], None, None])
        assert reader.load_async(keys, tokens, every).result(10)[0] is False
        assert reader.counters()["verify_failures"] == 1


@pytest.mark.parametrize("partial_reads", ["whole", "auto"])
def test_without_ranged_reads_a_lean_target_gets_whole_chunks(moto_s3_url, partial_reads):
    """`partial_reads="whole"`, or "auto" on a network store (one request per range costs
    more than its bytes): every chunk is read whole, as before, and counted so."""
    from tests.s3_fixtures import with_prefix

    url = with_prefix(moto_s3_url)
    with saved(url, partial_reads=partial_reads) as (reader, keys, tokens):
        target = LeanStaging(WANTED)
        assert reader.load_async(keys, tokens, target).result(10) == [True] * 3
        counters = reader.counters()
    for i in range(3):
        assert target.bufs[i].tobytes() == payload(i).tobytes()
    assert counters["hit_bytes"] == 3 * CANONICAL.payload_nbytes
