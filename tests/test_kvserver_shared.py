"""Stateless over the backend: two kvservers on one shared file:// directory or s3://
prefix (a real moto server on loopback) serve each other's chunks, as several replicas
behind a load balancer would."""

from __future__ import annotations

import pytest

from storage import open_store
from tests import s3_fixtures
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks

moto_endpoint = s3_fixtures.moto_endpoint
moto_s3_url = s3_fixtures.moto_s3_url


@pytest.fixture(params=["file", "s3"])
def shared_backend(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/shared"
    return s3_fixtures.with_prefix(request.getfixturevalue("moto_s3_url"))


async def test_two_servers_on_one_backend_serve_each_others_chunks(shared_backend, ns):
    chunks = make_chunks(ns, 6, payload_size=50_000)
    root = shared_backend
    with running_kvserver("--store", root) as one, running_kvserver("--store", root) as two:
        a, b = open_store(one.url), open_store(two.url)
        try:
            for i, (key, _, blob) in enumerate(chunks):
                writer = a if i % 2 == 0 else b
                assert await writer.put(key, blob) is True
            keys = [k for k, _, _ in chunks]
            for reader in (a, b):
                assert await reader.prefix_len(keys) == len(chunks)
                for key, _, blob in chunks:
                    assert await reader.get(key) == blob
            # Create-only across servers: the second writer of a key is told it existed.
            key, _, blob = chunks[0]
            assert await b.put(key, blob) is False
            # A delete through one server is a miss through the other.
            assert await b.delete(key) is True
            assert await a.get(key) is None
        finally:
            await a.close()
            await b.close()


def worker_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


async def each_connection_sees_every_chunk(url: str, chunks, gets: int) -> None:
    """Puts spread over 4 one-connection stores (which land on either worker), then every
    store sees every chunk and gets the first `gets` of them."""
    stores = [open_store(url) for _ in range(4)]
    try:
        for i, (key, _, blob) in enumerate(chunks):
            assert await stores[i % 4].put(key, blob) is True
        keys = [k for k, _, _ in chunks]
        for store in stores:
            assert await store.prefix_len(keys) == len(chunks)
            for key, _, blob in chunks[:gets]:
                assert await store.get(key) == blob
    finally:
        for store in stores:
            await store.close()


async def test_worker_processes_share_one_port_and_one_backend(tmp_path, ns):
    chunks = make_chunks(ns, 16, payload_size=20_000)
    with running_kvserver("--store", f"file://{tmp_path}/store", "--workers", "2") as server:
        assert len(worker_pids(server.pid)) >= 2
        await each_connection_sees_every_chunk(f"{server.url}?pool=1", chunks, gets=4)


def test_workers_refuse_a_memory_tier():
    with pytest.raises(RuntimeError, match="needs shared stores"):
        with running_kvserver("--store", "memory://", "--workers", "2"):
            pass
