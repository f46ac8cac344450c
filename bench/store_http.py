"""Baselines for `kvstash bench store --store http://HOST:PORT` (a running kvserver).

1. The same backend used in-process: the server's own store URL (from GET /v1/stats),
   opened here and measured with the same chunk sizes, count and concurrency; its GET is
   `get_into` a preallocated buffer (a memory store's `get` hands out its own bytes object,
   which no transport can match).
2. A plain loopback socket stream: one thread per connection on each side, `sendall` of
   the same number of bytes per chunk and `recv_into` a preallocated buffer. No HTTP, no
   verification: the practical limit for any Python client and server on this machine.
   When the URL names a `unix_socket`, the same stream over a Unix socket too (with the
   send buffer kvserver asks for), the limit of that transport.

3. With `--lmcache HOST:PORT`: LMCache's legacy cache server (`python -m lmcache.v1.server
   HOST PORT cpu`), the same sizes, through a minimal client of its wire protocol (a
   186-byte request, a 36-byte reply, then the bytes) that receives into a preallocated
   buffer without verification. Two rows: one connection with requests serialized (what
   LMCache's own `lm://` connector does: one socket per connector, under a lock), and one
   connection and thread per request lane (the best case for that server).

Extras: `prefix_len` latency for 512 present keys (one batched lookup), p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from storage.codec import HEADER_SIZE
from storage.http import UNIX_SNDBUF
from storage.options import StoreURL

LOOKUP_KEYS = 512
# LMCache legacy server protocol (lmcache/v1/protocol.py): request = command, length, memory
# format, dtype, location, 4 shape dims (int32 each), then the key padded to 150 bytes;
# reply = code, length, format, dtype, 4 shape dims, location.
_LMC_REQUEST = struct.Struct("<9i150s")
_LMC_REPLY = struct.Struct("<9i")
_LMC_PUT, _LMC_GET, _LMC_EXIST = 1, 2, 3
_LMC_BINARY, _LMC_UINT8, _LMC_OK = 4, 6, 200


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup-rounds", type=int, default=200,
                   help="http://: timed 512-key lookups for the latency percentiles (default 200)")
    p.add_argument("--lmcache", metavar="HOST:PORT",
                   help="http://: also measure a running LMCache legacy server on the same sizes")


def _token(url: str) -> str | None:
    u = StoreURL(url)
    return u.take("token") or os.environ.get("KVSTASH_TOKEN")


async def backend_url(url: str) -> str:
    """The kvserver's store URL, as its stats report it (tenant fragment dropped)."""
    u = StoreURL(url)
    token = _token(url)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    unix = StoreURL(url).take("unix_socket")
    transport = httpx.AsyncHTTPTransport(uds=unix) if unix else None
    async with httpx.AsyncClient(timeout=10, transport=transport) as client:
        r = await client.get(f"{u.scheme}://{u.netloc}{u.path.rstrip('/')}/v1/stats", headers=headers)
        r.raise_for_status()
        stats = r.json()
    if "url" not in stats:  # a tenant is not told where the store lives
        raise SystemExit("bench store: with a token the server does not name its store, so "
                         "there is no in-process baseline: bench a server without --auth-tokens")
    return stats["url"].split("#", 1)[0]


def _timed_threads(fn, n: int) -> float:
    """Seconds for `fn(0) .. fn(n-1)` in n threads; the first failure is re-raised."""
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # re-raised in the caller's thread
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return time.perf_counter() - t0


def raw_stream_gbps(size: int, count: int, concurrency: int, rounds: int,
                    unix_dir: str | None = None, fresh: bool = False) -> float:
    """Median GB/s of `count` transfers of `size` bytes over `concurrency` loopback TCP
    sockets, or Unix sockets in `unix_dir`; each into one preallocated buffer per socket,
    or (`fresh`) into a new bytearray per transfer, dropped after it, as a `get` returns
    a new blob."""
    data = os.urandom(size)
    if unix_dir is None:
        listener = socket.create_server(("127.0.0.1", 0))
        address: Any = ("127.0.0.1", listener.getsockname()[1])
    else:
        address = os.path.join(unix_dir, "raw.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(concurrency)

    def sender(conn: socket.socket) -> None:
        with conn:
            if unix_dir is not None:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
            while conn.recv(1):
                conn.sendall(data)

    def accept() -> None:
        for _ in range(concurrency):
            conn, _ = listener.accept()
            threading.Thread(target=sender, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    clients = []
    for _ in range(concurrency):
        clients.append(socket.socket(listener.family, socket.SOCK_STREAM))
        clients[-1].connect(address)
    acceptor.join()
    buffers = [memoryview(bytearray(size)) for _ in range(concurrency)]
    shares = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]

    def receive(i: int) -> None:
        sock, view = clients[i], buffers[i]
        for _ in range(shares[i]):
            if fresh:
                view = memoryview(bytearray(size))
            sock.sendall(b"g")
            got = 0
            while got < size:
                got += sock.recv_into(view[got:])

    try:
        times = [_timed_threads(receive, concurrency) for _ in range(rounds)]
    finally:
        for c in clients:
            c.close()
        listener.close()
    return size * count / statistics.median(times) / 1e9


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("LMCache server closed the connection")
        got += n


def lmcache_gbps(addr: str, size: int, count: int, concurrency: int,
                 rounds: int) -> tuple[float, float]:
    """(put GB/s, median get GB/s) of `count` objects of `size` bytes on an LMCache server."""
    host, port = addr.rsplit(":", 1)
    data = os.urandom(size)
    tag = uuid.uuid4().hex[:12]
    # The server strips spaces, not NULs, from the padded key.
    keys = [f"kvstash-bench@1@0@{tag}{i:04x}@uint8".encode().ljust(150) for i in range(count)]
    socks = [socket.create_connection((host, int(port))) for _ in range(concurrency)]
    lanes = [keys[i::concurrency] for i in range(concurrency)]

    def request(command: int, key: bytes, length: int = 0) -> bytes:
        return _LMC_REQUEST.pack(command, length, _LMC_BINARY, _LMC_UINT8, 0, length, 0, 0, 0, key)

    def put_lane(i: int) -> None:
        for key in lanes[i]:
            socks[i].sendall(request(_LMC_PUT, key, size))
            socks[i].sendall(data)
        # The server handles one connection in order: this reply means every put landed.
        socks[i].sendall(request(_LMC_EXIST, lanes[i][-1] if lanes[i] else keys[0]))
        _recv_exact(socks[i], memoryview(bytearray(_LMC_REPLY.size)))

    buffers = [memoryview(bytearray(size)) for _ in range(concurrency)]
    reply = [memoryview(bytearray(_LMC_REPLY.size)) for _ in range(concurrency)]

    def get_lane(i: int) -> None:
        for key in lanes[i]:
            socks[i].sendall(request(_LMC_GET, key))
            _recv_exact(socks[i], reply[i])
            code, length = _LMC_REPLY.unpack(reply[i])[:2]
            if code != _LMC_OK or length != size:
                raise RuntimeError(f"LMCache GET answered {code} with {length} bytes")
            _recv_exact(socks[i], buffers[i])

    try:
        put_s = _timed_threads(put_lane, concurrency)
        get_s = statistics.median(_timed_threads(get_lane, concurrency) for _ in range(rounds))
    finally:
        for s in socks:
            s.close()
    return size * count / put_s / 1e9, size * count / get_s / 1e9


async def setup(args: argparse.Namespace, url: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Refuse a remote server before anything is measured."""
    host = urlsplit(url).hostname or ""
    if host not in ("127.0.0.1", "::1", "localhost") and not StoreURL(url).take("unix_socket"):
        # Both baselines are loopback measurements of this host; opening a remote server's
        # backend URL here would touch a local path of the same name instead.
        raise SystemExit(f"bench store: {host} is not loopback; run the bench on the server's host")

    async def nothing() -> None:
        return None

    return url, nothing


async def baselines(args: argparse.Namespace, url: str, size: int, count: int,
                    concurrency: int) -> list[dict[str, Any]]:
    from bench.store import measure_store

    rounds = getattr(args, "rounds", 3)
    backend = await backend_url(url)
    tiers = backend.split(" -> ")  # a tiered server reports "fast -> slow"
    local = await measure_store(tiers if len(tiers) > 1 else backend, size, count, concurrency, rounds)
    raw = await asyncio.to_thread(raw_stream_gbps, size + HEADER_SIZE, count, concurrency, rounds)
    rows = [
        {"name": f"same backend in-process ({StoreURL(backend).redacted()})",
         "put_gbps": local["put_gbps"], "get_gbps": local["get_into_gbps"]},
        {"name": "raw loopback socket stream into a preallocated buffer",
         "put_gbps": None, "get_gbps": raw},
        {"name": "raw loopback socket stream, a new buffer per chunk (as get returns)",
         "put_gbps": None,
         "get_gbps": await asyncio.to_thread(raw_stream_gbps, size + HEADER_SIZE, count,
                                             concurrency, rounds, None, True)},
    ]
    if not StoreURL(url).take("unix_socket"):
        rows.append({"name": "httpx sequential GET, .content (a new bytes per chunk)",
                     "put_gbps": None,
                     "get_gbps": await httpx_get_gbps(url, size, count, rounds)})
    if StoreURL(url).take("unix_socket"):
        with tempfile.TemporaryDirectory(prefix="kvstash-raw-") as where:
            raw_unix = await asyncio.to_thread(raw_stream_gbps, size + HEADER_SIZE, count,
                                               concurrency, rounds, where)
        rows.append({"name": "raw Unix socket stream into a preallocated buffer",
                     "put_gbps": None, "get_gbps": raw_unix})
    if getattr(args, "lmcache", None):
        # LMCache's own `lm://` connector holds one socket per connector and serializes
        # requests on it; the best case gives each request lane its own socket and thread.
        lanes = [("one connection, serialized, as its lm:// connector", 1)]
        if concurrency > 1:
            lanes.append((f"{concurrency} connections, one thread each (best case)", concurrency))
        for label, n in lanes:
            put, get = await asyncio.to_thread(
                lmcache_gbps, args.lmcache, size + HEADER_SIZE, count, n, rounds)
            rows.append({"name": f"LMCache legacy server, {label}", "put_gbps": put,
                         "get_gbps": get})
    return rows


async def httpx_get_gbps(url: str, size: int, count: int, rounds: int) -> float:
    """What a user writes without kvstash: one plain HTTP GET after another with httpx,
    each chunk a new bytes object, of `count` chunks of `size` payload bytes (stored first
    through the kvstash client). Median GB/s over `rounds`."""

    from hashing import Namespace, chunk_keys
    from storage import encode_chunk, open_store

    u = StoreURL(url)
    token = u.take("token")
    base = url.split("?")[0].rstrip("/")
    ns = Namespace(model="bench/httpx", dtype="uint8", layout="raw", chunk_tokens=4,
                   salt=uuid.uuid4().hex)
    tokens = list(range(4 * count))
    keys = chunk_keys(tokens, ns)
    store = open_store(url)
    try:
        payload = os.urandom(size)
        for i, key in enumerate(keys):
            await store.put(key, encode_chunk(key, tokens[4 * i : 4 * i + 4], payload))
    finally:
        await store.close()
    headers = {"authorization": f"Bearer {token}"} if token else {}

    def timed() -> float:
        with httpx.Client(headers=headers, timeout=60) as client:
            client.get(f"{base}/v1/chunks/{keys[0]}").read()  # connect outside the timing
            started = time.perf_counter()
            nbytes = sum(len(client.get(f"{base}/v1/chunks/{k}").content) for k in keys)
            return nbytes / (time.perf_counter() - started) / 1e9

    return statistics.median([await asyncio.to_thread(timed) for _ in range(rounds)])
async def extras(args: argparse.Namespace, url: str) -> dict[str, Any]:
    from bench.store import stored_prefix
    from storage import open_store

    store = open_store(url)
    try:
        keys = await stored_prefix(store, LOOKUP_KEYS)
        times = []
        for _ in range(getattr(args, "lookup_rounds", 200)):
            t0 = time.perf_counter()
            n = await store.prefix_len(keys)
            times.append(time.perf_counter() - t0)
            if n != LOOKUP_KEYS:
                raise RuntimeError(f"{store}: lookup saw {n} of {LOOKUP_KEYS} keys")
        for k in keys:
            await store.delete(k)
    finally:
        await store.close()
    times.sort()
    return {
        "lookup_512_p50_ms": times[len(times) // 2] * 1e3,
        "lookup_512_p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3,
    }
