"""GET and PUT bodies in pooled buffers: the pool's lending rules, and a file-backed kvserver
whose concurrent, ranged and abandoned GETs all return the right bytes."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import httpx

from kvserver.bodies import BufferPool
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks

OCTETS = {"content-type": "application/octet-stream"}


def test_pool_lends_up_to_its_size_then_gives_unpooled_buffers():
    pool = BufferPool(max_buffers=2, max_bytes=8 << 20)
    a, give_a = pool.borrow(1000)
    b, give_b = pool.borrow(3 << 20)
    assert a.nbytes >= 1000 and b.nbytes >= 3 << 20
    c, give_c = pool.borrow(10)  # all lent: a buffer of its own, not counted
    assert pool.stats()["lent"] == 2
    give_c()
    give_a()
    give_a()  # a second give-back is ignored
    assert pool.stats() == {"lent": 1, "free": 1, "free_bytes": a.nbytes}
    grown, give = pool.borrow(5 << 20)  # the free buffer is too small: replaced, still pooled
    assert grown.nbytes >= 5 << 20 and pool.stats()["lent"] == 2
    give()
    give_b()
    pool.saw(64 << 20)
    assert pool.hint == 8 << 20  # never past max_bytes
    d, give_d = pool.borrow(10)
    give_d(reuse=False)  # maybe still read by a thread: dropped, never lent again
    assert pool.stats()["lent"] == 0 and all(f is not d for f in pool._free)


def test_file_backed_gets_return_exact_bytes_concurrently_ranged_and_after_aborts(tmp_path: Path, ns):
    chunks = make_chunks(ns, 12, payload_size=(3 << 20) + 777)
    with running_kvserver("--store", f"file://{tmp_path}") as server:
        for key, _, blob in chunks:
            assert httpx.put(f"{server.url}/v1/chunks/{key}", content=blob, headers=OCTETS).status_code == 201

        # Abandon a few GETs after their first bytes: their buffers must come back unharmed.
        host, port = server.url.removeprefix("http://").split(":")
        for key, _, _ in chunks[:3]:
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(f"GET /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert sock.recv(4096)

        async def fetch_all() -> list[bytes]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                got = await asyncio.gather(*(client.get(f"/v1/chunks/{k}") for k, _, _ in chunks))
            return [r.content for r in got]

        # More GETs in flight than the pool has buffers: none may see another's bytes.
        for _ in range(2):
            assert asyncio.run(fetch_all()) == [blob for _, _, blob in chunks]
        key, _, blob = chunks[5]
        r = httpx.get(f"{server.url}/v1/chunks/{key}", headers={"Range": "bytes=4000-2100000"})
        assert r.status_code == 206 and r.content == blob[4000:2100001]
        assert r.headers["content-length"] == str(2100001 - 4000)
        (absent, _, _), = make_chunks(ns, 1, seed=99)
        assert httpx.get(f"{server.url}/v1/chunks/{absent}").status_code == 404


def test_concurrent_puts_through_pooled_bodies_store_exact_bytes(tmp_path: Path, ns):
    """More PUTs in flight than the PUT pool has buffers, on a memory and a file backend:
    every stored chunk is its own body, byte for byte, after the buffers were reused."""
    chunks = make_chunks(ns, 12, payload_size=(2 << 20) + 333)
    for store in ("memory://", f"file://{tmp_path}"):
        with running_kvserver("--store", store) as server:

            async def put_all(batch) -> list[int]:
                async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                    got = await asyncio.gather(*(
                        client.put(f"/v1/chunks/{k}", content=blob, headers=OCTETS)
                        for k, _, blob in batch))
                return [r.status_code for r in got]

            assert asyncio.run(put_all(chunks[:10])) == [201] * 10
            assert asyncio.run(put_all(chunks[10:])) == [201] * 2  # reused buffers
            for key, _, blob in chunks:
                assert httpx.get(f"{server.url}/v1/chunks/{key}").content == blob


async def test_a_pooled_view_is_reusable_once_its_response_is_sent():
    """The transport may keep the memory of what it was handed until the socket takes it
    (uvloop does, up to the 64 KiB write high-water mark beyond the last piece). So a
    response from a pooled buffer hands over its last two pieces as copies: when the
    buffer goes back to the pool and is reused, nothing the transport may still send
    points into it."""
    from kvserver.bodies import PIECE, ViewResponse

    pooled = bytearray(os.urandom(3 * PIECE + 4096))
    original = bytes(pooled)
    handed: list = []  # what a zero-copy transport holds on to
    released = []

    async def send(message):
        if message["type"] == "http.response.body":
            handed.append(message["body"])

    response = ViewResponse(memoryview(pooled), 200, {}, "application/octet-stream",
                            lambda: released.append(True))
    await response(None, None, send)
    assert released == [True]
    pooled[:] = b"\0" * len(pooled)  # the pool lends the buffer to the next GET
    tail = handed[-2:]
    assert all(isinstance(piece, bytes) for piece in tail)
    assert sum(len(p) for p in tail) >= 64 * 1024 + len(handed[-1])
    assert b"".join(bytes(p) for p in tail) == original[-sum(len(p) for p in tail):]
