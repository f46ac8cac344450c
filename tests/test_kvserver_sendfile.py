"""GET bodies sent from chunk files with sendfile(2): a file-backed kvserver serves a chunk
it verified before straight from its file, byte for byte, ranged, to slow and vanishing
readers, never over TLS; and the protocol's zero-copy send cuts a connection whose file
ends early rather than send a short body. All against real uvicorn on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from kvserver.protocol import ZEROCOPY, BoundedHeadProtocol
from storage import open_store
from storage.base import BlobFile
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import backdate, make_chunks
from tests.test_http_store_client import self_signed_cert

OCTETS = {"content-type": "application/octet-stream"}
# The server's file store remembers a verification at once (`settle=0`), so the second
# GET of a chunk already goes out from its file; files that change after it was verified
# are backdated first (tests.store_helpers.backdate), so the change shows in their identity.
TRUST_AT_ONCE = "settle=0"


def sendfile_bytes(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(r"^kvstash_bytes_sendfile_total (\S+)$", text, re.M)
    assert m, "no sendfile counter in /metrics"
    return float(m.group(1))


def put_all(url: str, chunks) -> None:
    for key, _, blob in chunks:
        assert httpx.put(f"{url}/v1/chunks/{key}", content=blob, headers=OCTETS).status_code == 201


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_verified_chunk_file_is_sent_by_sendfile_exact_whole_and_ranged(tmp_path: Path, ns):
    chunks = make_chunks(ns, 4, payload_size=(2 << 20) + 123)
    with running_kvserver("--store", f"file://{tmp_path}?{TRUST_AT_ONCE}") as server:
        put_all(server.url, chunks)
        # First GETs read and hash the files (nothing vouched for them yet) ...
        for key, _, blob in chunks:
            assert httpx.get(f"{server.url}/v1/chunks/{key}").content == blob
        assert sendfile_bytes(server.url) == 0
        # ... later ones go out from the files themselves.
        total = 0
        for key, _, blob in chunks:
            r = httpx.get(f"{server.url}/v1/chunks/{key}")
            assert r.status_code == 200 and r.content == blob
            assert r.headers["content-length"] == str(len(blob))
            total += len(blob)
        key, _, blob = chunks[1]
        r = httpx.get(f"{server.url}/v1/chunks/{key}", headers={"Range": "bytes=4000-1049999"})
        assert r.status_code == 206 and r.content == blob[4000:1050000]
        assert r.headers["content-range"] == f"bytes 4000-1049999/{len(blob)}"
        r = httpx.get(f"{server.url}/v1/chunks/{key}", headers={"Range": f"bytes=-{len(blob) + 1}"})
        assert r.status_code == 206 and r.content == blob
        assert sendfile_bytes(server.url) == total + 1046000 + len(blob)
        r = httpx.head(f"{server.url}/v1/chunks/{key}")
        assert r.status_code == 200 and r.content == b""

        # The http:// store client, concurrently, into its own buffers.
        async def fetch() -> None:
            store = open_store(f"{server.url}?pool=4")
            try:
                bufs = [bytearray(len(b)) for _, _, b in chunks]
                headers = await asyncio.gather(*(store.get_into(k, buf)
                                                 for (k, _, _), buf in zip(chunks, bufs, strict=True)))
                for (_, _, b), h, buf in zip(chunks, headers, bufs, strict=True):
                    assert h is not None and bytes(buf[: h.payload_len]) == b[h.header_len :]
            finally:
                await store.close()
        asyncio.run(fetch())
        assert "Traceback" not in server.log()


def test_a_tenants_verified_chunk_file_is_sent_by_sendfile(tmp_path: Path, ns):
    """A tenant's scope of a file:// root sends files as the root does (its wrapper forwards
    the file store's `open_blob`), and each tenant gets only its own chunk."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-token-0123456789abcdef\nbob bob-token-0123456789abcdef\n")
    tokens.chmod(0o600)
    alice = {"Authorization": "Bearer alice-token-0123456789abcdef"}
    bob = {"Authorization": "Bearer bob-token-0123456789abcdef"}
    (key, _, blob), = make_chunks(ns, 1, payload_size=(1 << 20) + 7)
    with running_kvserver("--store", f"file://{tmp_path}/root?{TRUST_AT_ONCE}",
                          "--auth-tokens", str(tokens)) as server:
        url = f"{server.url}/v1/chunks/{key}"
        assert httpx.put(url, content=blob, headers={**OCTETS, **alice}).status_code == 201
        assert httpx.get(url, headers=alice).content == blob  # read and hashed
        assert sendfile_bytes(server.url) == 0
        r = httpx.get(url, headers=alice)
        assert r.status_code == 200 and r.content == blob
        assert sendfile_bytes(server.url) == len(blob)
        assert httpx.get(url, headers=bob).status_code == 404
        assert "Traceback" not in server.log()


def test_a_chunk_file_changed_after_verification_is_read_again_and_quarantined(tmp_path: Path, ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=1 << 20)
    with running_kvserver("--store", f"file://{tmp_path}?{TRUST_AT_ONCE}") as server:
        put_all(server.url, [(key, None, blob)])
        path = open_store(f"file://{tmp_path}").chunk_path(key)
        backdate(path)
        assert httpx.get(f"{server.url}/v1/chunks/{key}").content == blob
        with open(path, "r+b") as f:  # same size, one payload byte flipped
            f.seek(len(blob) - 10)
            f.write(bytes([blob[-10] ^ 0xFF]))
        assert httpx.get(f"{server.url}/v1/chunks/{key}").status_code == 404
        assert sendfile_bytes(server.url) == 0


def test_slow_and_vanishing_readers_hold_no_threads_and_leak_no_descriptors(tmp_path: Path, ns):
    chunks = make_chunks(ns, 3, payload_size=16 << 20)
    with running_kvserver("--store", f"file://{tmp_path}?{TRUST_AT_ONCE}") as server:
        put_all(server.url, chunks)
        for key, _, blob in chunks:
            assert httpx.get(f"{server.url}/v1/chunks/{key}").content == blob
        host, port = server.url.removeprefix("http://").split(":")
        before = open_fds(server.pid)

        def request(key: str) -> socket.socket:
            sock = socket.create_connection((host, int(port)))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.sendall(f"GET /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            return sock

        # More stalled readers than the server has worker threads: every one of them is
        # waited on by the event loop, so a normal GET still gets through at once.
        stalled = [request(chunks[0][0]) for _ in range(12)]
        for sock in stalled:
            assert sock.recv(4096)
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/v1/chunks/{chunks[1][0]}", timeout=20).content == chunks[1][2]
        assert time.monotonic() - t0 < 15

        # A slow reader still gets every byte.
        key, _, blob = chunks[2]
        sock = request(key)
        got = bytearray()
        while True:
            part = sock.recv(1 << 20)
            if not part:
                break
            got += part
            head, sep, body = bytes(got).partition(b"\r\n\r\n")
            if sep and len(body) >= len(blob):
                break
            time.sleep(0.002)
        assert body == blob
        sock.close()

        # Readers that vanish mid-body.
        for sock in stalled:
            sock.close()
        for _ in range(5):
            request(chunks[0][0]).close()
        deadline = time.monotonic() + 10
        while open_fds(server.pid) > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert open_fds(server.pid) <= before
        assert httpx.get(f"{server.url}/v1/chunks/{key}").content == blob
        assert "Traceback" not in server.log()


def test_tls_connections_are_not_offered_sendfile_and_still_get_exact_bytes(tmp_path: Path, ns):
    cert, tls_key = self_signed_cert(tmp_path)
    store_dir = tmp_path / "store"
    chunks = make_chunks(ns, 2, payload_size=1 << 20)
    with running_kvserver("--store", f"file://{store_dir}?{TRUST_AT_ONCE}", "--tls-cert", cert,
                          "--tls-key", tls_key) as server:
        with httpx.Client(base_url=server.url, verify=ssl.create_default_context(cafile=cert)) as client:
            for key, _, blob in chunks:
                assert client.put(f"/v1/chunks/{key}", content=blob, headers=OCTETS).status_code == 201
            for _ in range(2):
                for key, _, blob in chunks:
                    assert client.get(f"/v1/chunks/{key}").content == blob
            metrics = client.get("/metrics").text
        assert re.search(r"^kvstash_bytes_sendfile_total 0\.0$", metrics, re.M)


# -- the protocol's zero-copy send, under a bare ASGI app -----------------------------


@contextlib.contextmanager
def serving(app, **config: Any) -> Iterator[str]:
    """uvicorn with kvserver's protocol on a free loopback port, in a thread (`config`:
    more of uvicorn's settings)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=BoundedHeadProtocol, log_level="warning",
                                           lifespan="off", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.write_bytes(os.urandom(3 << 20))
    return path


def test_zerocopysend_sends_file_parts_and_cuts_a_body_the_file_cannot_fill(data_file: Path):
    data = data_file.read_bytes()
    seen_extension = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen_extension.append(ZEROCOPY in scope.get("extensions", {}))
        promised = {"/parts": 1000 + 5000 + len(data) - 2000 + 3, "/short": len(data) + 4096}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(promised[scope["path"]]).encode())]})
        with BlobFile(os.open(data_file, os.O_RDONLY), len(data)) as f:
            if scope["path"] == "/parts":
                await send({"type": ZEROCOPY, "file": f, "count": 1000, "more_body": True})
                await send({"type": ZEROCOPY, "file": f, "offset": 10, "count": 5000,
                            "more_body": True})
                os.lseek(f.fileno(), 2000, os.SEEK_SET)  # no offset: from the file position
                await send({"type": ZEROCOPY, "file": f, "more_body": True})
                await send({"type": "http.response.body", "body": b"end"})
            else:  # the file is 4 KiB shorter than the body promised
                await send({"type": ZEROCOPY, "file": f})

    with serving(app) as url:
        r = httpx.get(f"{url}/parts")
        assert r.content == data[:1000] + data[10:5010] + data[2000:] + b"end"
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(f"{url}/short")
        assert httpx.get(f"{url}/parts").status_code == 200  # the server goes on
    assert seen_extension == [True, True, True]


def test_a_filesystem_without_sendfile_gets_the_bytes_sent_and_an_io_error_cuts_the_body(
        data_file: Path, monkeypatch):
    """sendfile(2) refusing a file (EINVAL, as from a filesystem without it) and failing
    mid-body (EIO) cannot be produced on this machine's filesystems: os.sendfile is
    replaced for this test."""
    import errno

    import kvserver.sendfile as sf

    data = data_file.read_bytes()
    real_sendfile = os.sendfile
    mode = {"now": "refuse"}

    def sendfile(out_fd, in_fd, offset, count):
        if mode["now"] == "refuse":
            raise OSError(errno.EINVAL, "Invalid argument")
        if offset >= 1 << 20:
            raise OSError(errno.EIO, "Input/output error")
        return real_sendfile(out_fd, in_fd, offset, min(count, 256 << 10))
    monkeypatch.setattr(sf.os, "sendfile", sendfile)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(data) - 100).encode())]})
        with BlobFile(os.open(data_file, os.O_RDONLY), len(data)) as f:
            await send({"type": ZEROCOPY, "file": f, "offset": 100})

    with serving(app) as url:
        assert httpx.get(url).content == data[100:]
        mode["now"] = "fail mid-body"
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(url)
        mode["now"] = "refuse"
        assert httpx.get(url).content == data[100:]


def test_a_uvicorn_with_other_request_state_gets_zerocopysend_done_by_reads(data_file: Path,
                                                                          monkeypatch):
    """The zero-copy send relies on uvicorn's per-request state; where that looks
    different (a state name this uvicorn lacks stands in for a future one), the same
    messages are carried out by reading the file."""
    import kvserver.protocol as protocol

    monkeypatch.setattr(protocol, "_CYCLE_STATE", (*protocol._CYCLE_STATE, "no_such_state"))
    data = data_file.read_bytes()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(1000 + len(data) - 5000).encode())]})
        with BlobFile(os.open(data_file, os.O_RDONLY), len(data)) as f:
            await send({"type": ZEROCOPY, "file": f, "count": 1000, "more_body": True})
            os.lseek(f.fileno(), 5000, os.SEEK_SET)
            await send({"type": ZEROCOPY, "file": f})

    with serving(app) as url:
        assert httpx.get(url).content == data[:1000] + data[5000:]
