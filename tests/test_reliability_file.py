"""file:// under faults: writers killed mid-put, damaged chunk files, a full disk, and
concurrent readers, writers and gc. A read is a miss or the exact bytes written, never
anything else; nothing acknowledged is lost unless it was evicted or damaged."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest

from bench.faults import (
    CORRUPTIONS,
    chunk_files,
    chunk_for,
    corrupt_file,
    crash_writer,
    fill_disk,
    verify_blob,
)
from storage.errors import StoreError, StoreFull
from storage.file import QUARANTINE, TMP_MARK, FileStore, _chunk_path
from storage.ledger import LEDGER
from tests.reliability_fixtures import file_store_fixture, small_fs_fixture  # noqa: F401
from tests.store_helpers import backdate

SEED = 8


async def test_writer_killed_mid_put_leaves_no_partial_chunk_and_loses_no_ack(tmp_path: Path):
    root = tmp_path / "store"
    url = f"file://{root}"
    rng = random.Random(SEED)
    acked: list[int] = []
    for round_ in range(4):
        acked += crash_writer(url, SEED, start=round_ * 1000, size=2 * 1024 * 1024,
                              after_acks=2, delay_s=rng.uniform(0.0, 0.02))

    store = FileStore(root)
    listed = {k async for k in store.list_keys()}
    for path in chunk_files(root):
        if TMP_MARK in path.name:
            continue
        key = f"{path.parent.parent.parent.name}/{path.stem}"
        assert key in listed
        assert verify_blob(key, path.read_bytes()), f"visible chunk {path} does not verify"
    for i in acked:
        key, blob = chunk_for(SEED, i, 2 * 1024 * 1024)
        assert await store.get(key) == blob, f"acknowledged put {i} was lost"
    assert len(acked) >= 8

    # A restarted store sweeps the torn writers' tmp files once they are past the grace.
    FileStore(root, tmp_grace_s=0.0)
    assert not [p for p in chunk_files(root) if TMP_MARK in p.name]


@pytest.mark.parametrize("how", CORRUPTIONS)
async def test_damaged_chunk_reads_as_miss_and_is_quarantined(file_store: FileStore, how: str):
    rng = np.random.default_rng(SEED)
    _, other = chunk_for(SEED, 999)
    key, blob = chunk_for(SEED, 0)
    await file_store.put(key, blob)
    path = _chunk_path(file_store.root, key)
    corrupt_file(path, how, rng, other)

    assert await file_store.get(key) is None
    assert file_store.stats()["corrupt"] == 1
    assert not path.exists()
    assert len(list((file_store.root / QUARANTINE).iterdir())) == 1
    assert await file_store.prefix_len([key]) == 0
    # The key heals: the next writer publishes it again.
    assert await file_store.put(key, blob) is True
    assert await file_store.get(key) == blob


@pytest.mark.parametrize("how", CORRUPTIONS)
async def test_damaged_chunk_is_a_miss_for_get_into(file_store: FileStore, how: str):
    rng = np.random.default_rng(SEED + 1)
    _, other = chunk_for(SEED, 998)
    key, blob = chunk_for(SEED, 1)
    await file_store.put(key, blob)
    corrupt_file(_chunk_path(file_store.root, key), how, rng, other)
    out = bytearray(len(blob))
    assert await file_store.get_into(key, out) is None
    assert file_store.stats()["corrupt"] == 1


async def test_random_damage_never_returns_wrong_bytes(file_store: FileStore):
    rng = np.random.default_rng(SEED + 2)
    chunks = [chunk_for(SEED, i, 16 * 1024) for i in range(48)]
    for key, blob in chunks:
        await file_store.put(key, blob)
    damaged = set()
    for n, (key, _blob) in enumerate(chunks[::2]):
        how = CORRUPTIONS[n % len(CORRUPTIONS)]
        corrupt_file(_chunk_path(file_store.root, key), how, rng, chunks[-1 - n][1])
        damaged.add(key)
    for key, blob in chunks:
        got = await file_store.get(key)
        if key in damaged:
            assert got is None
        else:
            assert got == blob
    assert file_store.stats()["corrupt"] == len(damaged)


async def test_full_disk_put_fails_soft_with_log_and_metric_then_gc_frees_room(
    small_fs: Path, caplog: pytest.LogCaptureFixture
):
    existing = FileStore(small_fs / "existing")
    old = [chunk_for(SEED, i, 1024 * 1024) for i in range(3)]
    for key, blob in old:
        await existing.put(key, blob)
    fill_disk(small_fs / "ballast")

    writer = FileStore(small_fs / "writer")
    key, blob = chunk_for(SEED, 100, 1024 * 1024)
    with caplog.at_level(logging.WARNING, logger="kvstash.storage.file"):
        with pytest.raises(StoreFull):
            await writer.put(key, blob)
    assert "disk full" in caplog.text
    assert writer.stats()["put_errors"] == 1
    assert await writer.get(key) is None
    assert not [p for p in chunk_files(small_fs / "writer") if TMP_MARK in p.name]
    for k, b in old:
        assert await existing.get(k) == b, "a full disk made an existing chunk unreadable"

    result = await existing.gc(capacity=1024 * 1024 + 8192)
    assert result["evicted"] == 2
    assert await writer.put(key, blob) is True
    assert await writer.get(key) == blob


async def test_writer_on_full_disk_evicts_its_own_oldest_chunks_and_keeps_going(small_fs: Path):
    store = FileStore(small_fs / "store")
    chunks = [chunk_for(SEED, i, 1024 * 1024) for i in range(20)]
    for key, blob in chunks:
        try:
            await store.put(key, blob)
        except StoreFull:
            pass
    assert store.stats()["evictions"] > 0
    assert await store.get(chunks[-1][0]) == chunks[-1][1]
    for key, blob in chunks:
        got = await store.get(key)
        assert got is None or got == blob


async def test_capacity_option_keeps_the_store_under_its_limit(tmp_path: Path):
    capacity = 4 * (1024 * 1024 + 4096)
    store = FileStore(tmp_path / "store", capacity=capacity)
    for i in range(12):
        await store.put(*chunk_for(SEED, i, 1024 * 1024))
    on_disk = sum(p.stat().st_size for p in chunk_files(tmp_path / "store") if p.name != LEDGER)
    assert on_disk <= capacity
    assert store.stats()["evictions"] == 8


async def test_concurrent_readers_writers_and_gc_see_only_misses_or_exact_bytes(tmp_path: Path):
    """Two store instances on one directory (as two engine hosts on one NFS export would
    be): one writes and reads, the other runs gc down to a small capacity meanwhile."""
    root = tmp_path / "store"
    engine = FileStore(root)
    janitor = FileStore(root)
    chunks = [chunk_for(SEED, i, 32 * 1024) for i in range(64)]
    wrong: list[str] = []
    errors: list[BaseException] = []
    stop = asyncio.Event()

    async def writer(offset: int) -> None:
        for key, blob in chunks[offset::2]:
            try:
                await engine.put(key, blob)
            except StoreError as exc:
                errors.append(exc)

    async def reader() -> None:
        r = random.Random(SEED)
        while not stop.is_set():
            key, blob = r.choice(chunks)
            got = await engine.get(key)
            if got is not None and got != blob:
                wrong.append(key)
            await engine.prefix_len([k for k, _ in chunks[:8]])

    async def collector() -> None:
        while not stop.is_set():
            await janitor.gc(capacity=10 * 32 * 1024)
            await asyncio.sleep(0)

    readers = [asyncio.create_task(reader()) for _ in range(4)]
    gc_task = asyncio.create_task(collector())
    for _ in range(3):
        await asyncio.gather(writer(0), writer(1))
    stop.set()
    await asyncio.gather(*readers, gc_task)

    assert wrong == []
    assert errors == []
    assert engine.stats()["corrupt"] == 0
    assert engine.stats()["hits"] > 0


async def test_damage_after_a_verified_read_is_still_caught(file_store: FileStore):
    """The store skips re-hashing a file it verified while its identity (inode, size,
    mtime, ctime) is unchanged; an in-place write through the filesystem changes it."""
    rng = np.random.default_rng(SEED)
    ways = ["flip_payload", "zero", "replace", "flip_header"]
    chunks = [chunk_for(SEED, 10 + i) for i in range(len(ways))]
    file_store.settle_s = 0  # verifications remembered at once ...
    for key, blob in chunks:
        await file_store.put(key, blob)
        backdate(_chunk_path(file_store.root, key))  # ... and each write below shows
    for key, blob in chunks:
        assert await file_store.get(key) == blob
    assert all(file_store.known_header(key, os.stat(_chunk_path(file_store.root, key)))
               for key, _ in chunks)  # re-reads skip the hash
    for (key, _), how in zip(chunks, ways, strict=True):
        corrupt_file(_chunk_path(file_store.root, key), how, rng, chunk_for(SEED, 99)[1])
    for key, _ in chunks:
        assert await file_store.get(key) is None
    assert file_store.stats()["corrupt"] == len(ways)
