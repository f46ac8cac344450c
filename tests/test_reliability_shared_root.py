"""A file:// root under attack by its own tenants and shared by several servers: chunks
verified whole at PUT, quarantine bounded, memory bounded by what a tenant stores, one
capacity across every process and tenant, and fair eviction on a full disk. Real
`kvstash serve` processes and real files."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np

from bench.faults import chunk_for, corrupt_file
from storage.file import QUARANTINE, FileStore, _chunk_path
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import forged_segment_chunk

SEED = 50


def _bytes_under(path: Path) -> int:
    """Sizes of the regular files under `path`, as `du --apparent-size` counts them."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


def test_kvserver_refuses_a_chunk_whose_segment_checksum_contradicts_its_payload(tmp_path, ns):
    key, _, forged = forged_segment_chunk(ns)
    with running_kvserver("--store", f"file://{tmp_path}/store?capacity=8MiB") as server:
        url = f"{server.url}/v1/chunks/{key}"
        put = httpx.put(url, content=forged, headers={"content-type": "application/octet-stream"})
        assert put.status_code == 400, put.text
        assert "segment 1" in put.json()["error"]
        assert httpx.get(url).status_code == 404
    assert not list((tmp_path / "store").glob("*/*/*/*.kv"))


async def test_quarantine_stays_within_its_bound_when_chunks_are_quarantined_again_and_again(
        tmp_path):
    """A reader that rejects a chunk on every read while its writer puts it again: each
    round moves one file to `.quarantine/`, which keeps only the newest up to its bound
    and counts against the capacity."""
    capacity = 8 << 20
    store = FileStore(tmp_path / "store", capacity)
    bound = store.quarantine_max
    rng = np.random.default_rng(SEED)
    assert bound == capacity // 16
    for i in range(40):
        key, blob = chunk_for(SEED, i % 4, size=200 * 1024)
        assert await store.put(key, blob) is True
        corrupt_file(_chunk_path(store.root, key), "flip_payload", rng, b"")
        assert await store.get(key) is None
        held = _bytes_under(store.root / QUARANTINE)
        assert held <= bound, f"round {i}: .quarantine holds {held} bytes, bound {bound}"
    stats = store.stats()
    assert stats["corrupt"] == 40
    assert stats["quarantine_bytes"] == _bytes_under(store.root / QUARANTINE) > 0
    assert stats["quarantined_files"] == len(os.listdir(store.root / QUARANTINE))
    assert stats["used_bytes"] == _bytes_under(store.root) <= capacity
    # A reopened store counts what is there.
    assert FileStore(tmp_path / "store", capacity).stats()["quarantine_bytes"] == stats["quarantine_bytes"]
