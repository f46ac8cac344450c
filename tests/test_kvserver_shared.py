"""Stateless over the backend: two kvservers on one shared file:// directory serve each
other's chunks, as several replicas behind a load balancer would."""

from __future__ import annotations

from storage import open_store
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks


async def test_two_servers_on_one_directory_serve_each_others_chunks(tmp_path, ns):
    chunks = make_chunks(ns, 6, payload_size=50_000)
    root = f"file://{tmp_path}/shared"
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
