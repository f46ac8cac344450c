"""The http:// store ends every call by its deadline, in bounded memory, however a peer sends:
a listing that never ends, a body that keeps flowing at full speed, replies trickled so
that each request of a multi-request call arrives just in time. The servers are scripted
sockets on 127.0.0.1 (a kvserver never sends any of this)."""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
import time

import pytest
import xxhash

from storage import StoreUnavailable, open_store
from storage.codec import encode_header
from storage.http import LOOKUP_BATCH
from tests.store_helpers import make_chunks
from tests.test_http_store_client import ScriptedServer

MiB = 1 << 20


def vm_rss() -> int:
    """This process's resident set, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class EndlessListingServer(ScriptedServer):
    """Answers GET /v1/keys with `keys` over and over, one HTTP chunk of them at a time
    (`repeat` times `keys` a chunk), for as long as the client reads (up to 64 Ki chunks);
    `stall_after`: send that many keys, then nothing more (but keep the socket)."""

    def __init__(self, keys: list[str], repeat: int = 20, stall_after: int | None = None):
        self.lines = ("\n".join(keys) + "\n").encode()
        self.repeat = repeat
        self.stall_after = stall_after
        self.release = threading.Event()
        super().__init__(socket.create_server(("127.0.0.1", 0)))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def answer(self, conn: socket.socket) -> None:
        if not conn.recv(65536):
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        if self.stall_after is not None:
            body = self.lines[: self.stall_after * 50]
            conn.sendall(b"%x\r\n%s\r\n" % (len(body), body))
            self.release.wait(30)
            return
        body = self.lines * self.repeat
        piece = b"%x\r\n%s\r\n" % (len(body), body)
        for _ in range(64 * 1024):
            conn.sendall(piece)


def listing_keys(n: int) -> list[str]:
    return [f"{i:016x}/{i:032x}" for i in range(n)]


async def test_an_endless_key_listing_ends_by_its_deadline_in_bounded_memory():
    """Before: the listing never let the event loop run while bytes kept coming, so its
    1 s timeout fired only when the socket drained (20 s, 2.7 GiB); it was also read whole
    before the first key was handed on. The deadline may end it in any of three places
    (the socket read, the wait for a piece, the check after parsing one), each a TimeoutError."""
    server = EndlessListingServer(listing_keys(1000))
    store = open_store(f"{server.url}?timeout=1s")
    rss_before = vm_rss()
    grown = 0
    listed = 0
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable, match="TimeoutError"):
            async for _ in store.list_keys():
                listed += 1
                if listed % 65536 == 0:
                    grown = max(grown, vm_rss() - rss_before)
        elapsed = time.monotonic() - started
    finally:
        await store.close()
        server.close()
    grown = max(grown, vm_rss() - rss_before)
    assert listed > 0
    assert elapsed < 2 * 1.0
    assert grown < 64 * MiB


async def test_a_key_listing_past_max_listing_is_store_unavailable_after_max_listing_keys():
    server = EndlessListingServer(listing_keys(1000), repeat=1)
    store = open_store(f"{server.url}?max_listing=2500&timeout=30s")
    got: list[str] = []
    try:
        with pytest.raises(StoreUnavailable, match="max_listing=2500"):
            async for key in store.list_keys():
                got.append(key)
    finally:
        await store.close()
        server.close()
    assert got == (listing_keys(1000) * 3)[:2500]


async def test_a_key_listing_hands_on_keys_before_its_reply_ends():
    """Ten keys arrive, then the server goes quiet: the caller has the ten before the
    listing's deadline ends it with StoreUnavailable."""
    server = EndlessListingServer(listing_keys(10), stall_after=10)
    store = open_store(f"{server.url}?timeout=1s")
    got: list[str] = []
    try:
        with pytest.raises(StoreUnavailable):
            async for key in store.list_keys():
                got.append(key)
    finally:
        server.release.set()
        await store.close()
        server.close()
    assert got == listing_keys(10)


def header_claiming(key: str, tokens: list[int], payload_len: int) -> bytes:
    """A chunk header for `key` that announces a payload of `payload_len` bytes (its own
    checksum valid, the payload's never matching what follows)."""
    buf = bytearray(encode_header(key, tokens, b"\0"))
    struct.pack_into("<Q", buf, 16, payload_len)
    struct.pack_into("<Q", buf, 32, 0)
    struct.pack_into("<Q", buf, 32, xxhash.xxh3_64_intdigest(bytes(buf), seed=0))
    return bytes(buf)


class FloodingChunkServer(ScriptedServer):
    """Answers a GET with a valid header for the key announcing a payload of nearly 1 GiB,
    then sends 0xFF bytes as fast as the client takes them."""

    def __init__(self, header: bytes, payload_len: int):
        self.head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (
            len(header) + payload_len, header)
        super().__init__(socket.create_server(("127.0.0.1", 0)))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def answer(self, conn: socket.socket) -> None:
        if not conn.recv(65536):
            return
        conn.sendall(self.head)
        flood = b"\xff" * MiB
        for _ in range(1024):
            conn.sendall(flood)


async def test_a_chunk_body_that_keeps_flowing_is_a_miss_by_its_deadline(ns):
    """Before: a body arriving as fast as it was read never let the loop run, so the
    timeout fired only once the whole announced body was in, and the whole announced size
    was allocated and zeroed before the first byte was read."""
    (key, tokens, _), = make_chunks(ns, 1)
    payload_len = (1 << 30) - 8192
    server = FloodingChunkServer(header_claiming(key, tokens, payload_len), payload_len)
    store = open_store(f"{server.url}?timeout=500ms&breaker_failures=1000")
    try:
        started = time.monotonic()
        assert await store.get(key) is None
        elapsed = time.monotonic() - started
        assert store.counters["errors"] == 1 and store.counters["corrupt"] == 0
    finally:
        await store.close()
        server.close()
    assert elapsed < 2 * 0.5


class TricklingLookupServer(ScriptedServer):
    """Answers every lookup on a keep-alive connection with a valid "nothing here" reply,
    trickled out over `spread_s` (each alone well within the client's timeout); counts the
    lookups it was asked."""

    def __init__(self, spread_s: float):
        self.spread_s = spread_s
        self.asked = 0
        super().__init__(socket.create_server(("127.0.0.1", 0)))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def answer(self, conn: socket.socket) -> None:
        pending = b""
        for _ in range(1000):
            while b"\r\n\r\n" not in pending:
                got = conn.recv(65536)
                if not got:
                    return
                pending += got
            head, _, pending = pending.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(pending) < length:
                got = conn.recv(1 << 20)
                if not got:
                    return
                pending += got
            count = len(json.loads(pending[:length])["keys"])
            pending = pending[length:]
            self.asked += 1
            body = json.dumps({"prefix_len": 0, "count": count, "present": base64.b64encode(
                bytes((count + 7) // 8)).decode()}).encode()
            reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            step = len(reply) // 10 + 1
            for i in range(0, len(reply), step):
                conn.sendall(reply[i : i + step])
                time.sleep(self.spread_s / 10)


async def test_a_lookup_of_many_batches_ends_by_one_deadline():
    """Before: each batch of a lookup had a timeout of its own, so a server trickling each
    reply in just under the timeout held `exists` for one timeout per batch."""
    keys = [f"{0:016x}/{i:032x}" for i in range(4 * LOOKUP_BATCH)]
    server = TricklingLookupServer(spread_s=0.7)
    store = open_store(f"{server.url}?timeout=1s&breaker_failures=1000")
    try:
        started = time.monotonic()
        assert await store.exists(keys) == [False] * len(keys)
        elapsed = time.monotonic() - started
    finally:
        await store.close()
        server.close()
    assert elapsed < 2 * 1.0
    assert server.asked < 4
