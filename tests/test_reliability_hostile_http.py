"""Hostile clients against a real kvserver: uploads that never end (slow drip), bodies
that grow past the limit without a Content-Length, oversized request heads. Each is cut off,
nothing is stored, and the server keeps serving everyone else. (Path traversal and the
OpenAPI fuzzing live in the kvserver suite: test_kvserver_traversal, test_kvserver_schema.)"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from bench.faults import KvServerProcess, chunk_files, chunk_for, free_port, rss_bytes

SEED = 66
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory):
    """One server for the module: 1 MiB chunk limit, 1 s to deliver a body."""
    tmp = tmp_path_factory.mktemp("hostile")
    root = tmp / "store"
    server = KvServerProcess(["--store", f"file://{root}", "--max-chunk-bytes", "1MiB",
                            "--body-timeout", "1s"], free_port(), tmp / "server.log")
    server.start()
    try:
        yield server, root
    finally:
        server.stop()


def stored_chunks(root: Path) -> list[Path]:
    return [p for p in chunk_files(root) if p.suffix == ".kv" and not p.name.startswith(".")]


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_status(sock: socket.socket) -> int | None:
    """The response's status code, or None if the server closed without answering."""
    reply = b""
    try:
        while b"\r\n" not in reply:
            part = sock.recv(4096)
            if not part:
                return None
            reply += part
    except (ConnectionError, TimeoutError):
        return None
    return int(reply.split(b" ")[1])


def put_head(key: str, extra: str) -> bytes:
    return (f"PUT /v1/chunks/{key} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/octet-stream\r\n{extra}\r\n").encode()


def test_slow_drip_upload_is_cut_off_and_nothing_is_stored(guarded_server):
    server, root = guarded_server
    key, blob = chunk_for(SEED, 0, 64 * 1024)
    sock = connect(server.url)
    sock.sendall(put_head(key, f"Content-Length: {len(blob)}\r\n"))
    started = time.monotonic()
    cut = False
    for pos in range(0, len(blob), 16):  # 16 bytes every 50 ms: ~3 minutes for the body
        try:
            sock.sendall(blob[pos : pos + 16])
        except (BrokenPipeError, ConnectionResetError):
            cut = True
            break
        sock.settimeout(0.05)
        try:
            if sock.recv(4096, socket.MSG_PEEK):
                cut = True
                break
        except TimeoutError:
            pass
        if time.monotonic() - started > 20:
            break
    sock.settimeout(5)
    status = read_status(sock)
    sock.close()
    assert cut, "the server kept reading a slow-drip upload for 20 s"
    assert status in (408, None)
    assert key.split("/")[1] not in {p.stem for p in stored_chunks(root)}
    assert httpx.get(f"{server.url}/v1/chunks/{key}").status_code == 404


def test_chunked_upload_past_the_limit_is_refused_without_buffering_it(guarded_server):
    server, root = guarded_server
    rss_before = rss_bytes(server.pid)
    key, _ = chunk_for(SEED, 1)
    sock = connect(server.url)
    sock.sendall(put_head(key, "Transfer-Encoding: chunked\r\n"))
    piece = b"%x\r\n" % (256 * 1024) + bytes(256 * 1024) + b"\r\n"
    sent = 0
    try:
        for _ in range(64):  # up to 16 MiB, 16x the limit
            sock.sendall(piece)
            sent += 256 * 1024
    except (BrokenPipeError, ConnectionResetError):
        pass
    status = read_status(sock)
    sock.close()
    assert status in (413, None)
    assert sent < 16 * MiB or status == 413
    assert rss_bytes(server.pid) - rss_before < 64 * MiB
    assert key.split("/")[1] not in {p.stem for p in stored_chunks(root)}


def test_oversized_request_head_is_refused_with_431(guarded_server):
    server, _ = guarded_server
    key, _ = chunk_for(SEED, 2)
    sock = connect(server.url)
    sock.settimeout(3)
    try:
        sock.sendall(f"GET /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\n".encode())
        for i in range(1024):  # 1 MiB of headers, never finished
            sock.sendall(b"X-Flood-%d: " % i + b"a" * 1000 + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    status = read_status(sock)
    sock.close()
    assert status == 431


def test_server_keeps_serving_after_hostile_connections(guarded_server):
    server, _ = guarded_server
    key, blob = chunk_for(SEED, 4)
    r = httpx.put(f"{server.url}/v1/chunks/{key}", content=blob,
                  headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201
    assert httpx.get(f"{server.url}/v1/chunks/{key}").content == blob


def test_many_stalled_uploads_do_not_lock_out_a_real_client(guarded_server):
    server, _ = guarded_server
    key, blob = chunk_for(SEED, 3)
    idle = []
    for i in range(200):
        sock = connect(server.url)
        sock.sendall(put_head(chunk_for(SEED, 100 + i)[0], "Content-Length: 100000\r\n"))
        idle.append(sock)
    try:
        r = httpx.put(f"{server.url}/v1/chunks/{key}", content=blob,
                      headers={"content-type": "application/octet-stream"}, timeout=10)
        assert r.status_code == 201
        assert httpx.get(f"{server.url}/v1/chunks/{key}", timeout=10).content == blob
    finally:
        for sock in idle:
            sock.close()
