"""An S3 endpoint that lies about an object's size: the store answers a miss and
allocates nothing of the claimed size.

The endpoint here is a socket of our own that answers each connection's first request
with one scripted reply and closes it, as no real S3 server would answer (moto and
SeaweedFS only ever report true sizes). The store's real botocore client parses it.
"""

from __future__ import annotations

import tracemalloc

import pytest

from storage import open_store
from tests.s3_fixtures import s3_url, with_prefix
from tests.store_helpers import make_chunks
from tests.test_http_store_client import OneReplyServer

pytest_plugins = ("tests.s3_fixtures",)

TiB = 1 << 40


def partial_reply(body: bytes, claimed_total: int) -> bytes:
    """A 206 carrying `body` as the first bytes of an object of `claimed_total` bytes."""
    return (b"HTTP/1.1 206 Partial Content\r\n"
            b"Content-Range: bytes 0-%d/%d\r\n"
            b"Content-Length: %d\r\nContent-Type: binary/octet-stream\r\n"
            b"Connection: close\r\n\r\n" % (len(body) - 1, claimed_total, len(body))) + body


def store_at(server: OneReplyServer, **extra: str):
    return open_store(s3_url(server.url, "hostile", retries="1", timeout="3s",
                             touch="0", **extra))


@pytest.mark.parametrize("split_reads", ["1", "0"])  # the first GET ranged, or whole
async def test_an_object_claiming_a_terabyte_is_a_miss_not_memory_error(ns, split_reads):
    """Over `max_chunk` (1 GiB by default) an object is refused before its body is read:
    a miss for `get` and `get_into`, never a MemoryError into the caller."""
    (key, _, blob), = make_chunks(ns, 1, payload_size=64 * 1024)
    server = OneReplyServer(partial_reply(blob, TiB))
    store = store_at(server, split_reads=split_reads)
    try:
        assert await store.get(key) is None
        assert await store.get_into(key, bytearray(len(blob))) is None
        assert store.counters["errors"] == 2 and store.counters["corrupt"] == 0
    finally:
        await store.close()
        server.close()


async def test_a_size_the_header_contradicts_allocates_nothing_of_that_size(ns):
    """Under `max_chunk`, a claimed 512 MiB object whose first bytes are a 64 KiB chunk:
    the header is read before any buffer the object's size exists, so the claim costs
    no allocation; the object is corrupt, a miss."""
    (key, _, blob), = make_chunks(ns, 1, payload_size=64 * 1024)
    server = OneReplyServer(partial_reply(blob, 512 << 20))
    store = store_at(server)
    tracemalloc.start()
    try:
        assert await store.get(key) is None
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 64 << 20
        assert store.counters["corrupt"] == 1
    finally:
        tracemalloc.stop()
        await store.close()
        server.close()


async def test_max_chunk_bounds_the_objects_a_get_accepts(s3_server_url, ns):
    """A real chunk over `max_chunk` is a miss left in place; a store allowing it reads it."""
    (key, _, blob), = make_chunks(ns, 1, payload_size=2 << 20)
    prefix = f"maxchunk-{id(blob)}"
    small = open_store(with_prefix(s3_server_url, prefix, touch="0", max_chunk="1MiB"))
    large = open_store(with_prefix(s3_server_url, prefix, touch="0"))
    try:
        assert await large.put(key, blob) is True
        assert await small.get(key) is None
        assert await small.get_into(key, bytearray(len(blob))) is None
        assert small.counters["corrupt"] == 0
        assert await large.get(key) == blob
    finally:
        await small.close()
        await large.close()

