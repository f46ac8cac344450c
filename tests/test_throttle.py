"""The test fixtures that slow or fail a store (tests/throttle.py) do what they say, and a
backend registered as an object opens stores from URLs like one named by module path."""

from __future__ import annotations

import numpy as np
import pytest

from gds import IOConfig
from storage import StoreUnavailable, open_store
from storage.capabilities import SupportsBlobFiles, SupportsResidentReads
from storage.file import FileStore
from storage.registry import BACKENDS
from tests.store_helpers import make_chunks
from tests.throttle import SlowChunkIO, ThrottledBackend, ThrottledStore


async def test_a_backend_registered_as_an_object_opens_the_stores_of_its_scheme(
        tmp_path, ns, monkeypatch):
    backend = ThrottledBackend(FileStore, fail=["get"])
    monkeypatch.setitem(BACKENDS, "file", backend)
    store = open_store(f"file://{tmp_path}/kv")
    assert isinstance(store, ThrottledStore) and backend.opened == [store]
    # a wrapper forwards no capability: the directory behind it is served as a far store's
    assert not isinstance(store, (SupportsBlobFiles, SupportsResidentReads))
    (key, _, blob), = make_chunks(ns, 1)
    assert await store.put(key, blob)
    assert await store.exists([key]) == [True]
    with pytest.raises(StoreUnavailable):
        await store.get(key)
    assert store.calls["get"] == 1
    await store.close()


def test_a_slow_chunk_read_cancelled_before_it_starts_never_reads(tmp_path, ns):
    store = FileStore(tmp_path / "kv")
    (key, _, blob), = make_chunks(ns, 1)
    with SlowChunkIO(30.0, IOConfig(), probe_dir=tmp_path) as io:
        dest = np.zeros(len(blob), np.uint8)
        late = io.submit_chunk(store.chunk_path(key), dest, key)
        assert late.cancel()
        assert io.stats()["counters"].get("chunk_reads", 0) == 0
