"""Request bodies under attack: refused before they are read, bounded in size and time,
charged as they arrive; hostile chunk headers are a 400. Real `kvstash serve` processes on
127.0.0.1, raw sockets for what a well-behaved client would never send."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import httpx
import pytest
import xxhash

from storage.codec import (
    _FIXED,
    _HCHECK_OFFSET,
    MAGIC,
    VERSION,
    ChunkError,
    decode_header,
    header_size_for,
)
from tests.kvserver_fixtures import KvServer, running_kvserver
from tests.store_helpers import make_chunks

OCTETS = {"content-type": "application/octet-stream"}
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef-xyz"
MiB = 1 << 20


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def tokens_file(tmp: Path) -> Path:
    path = tmp / "tokens"
    path.write_text(f"alice {ALICE}\nbob {BOB}\n")
    path.chmod(0o600)
    return path


def connect(server: KvServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=20)


def read_reply(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or a JSON body ends)."""
    reply = b""
    try:
        while not reply.endswith(b"}") and (part := sock.recv(65536)):
            reply += part
    except ConnectionError:
        pass
    return reply


def send_as_much_as_taken(sock: socket.socket, nbytes: int) -> int:
    """Send up to `nbytes` of body until the server stops taking them; the bytes sent."""
    piece = b"x" * MiB
    sent = 0
    try:
        while sent < nbytes:
            sent += sock.send(piece)
    except (ConnectionError, TimeoutError):
        pass
    return sent


def forged_chunk(key: str, meta: bytes, payload: bytes = b"p" * 64) -> bytes:
    """A chunk whose header checksum is valid over an arbitrary meta field."""
    kb = key.encode("ascii")
    hlen = header_size_for(0, len(meta), len(kb))
    head = bytearray(hlen)
    _FIXED.pack_into(head, 0, MAGIC, VERSION, 0, hlen, len(payload),
                     xxhash.xxh3_64_intdigest(payload), 0, len(kb), 0, 0, len(meta))
    head[_FIXED.size : _FIXED.size + len(kb) + len(meta)] = kb + meta
    struct.pack_into("<Q", head, _HCHECK_OFFSET, xxhash.xxh3_64_intdigest(bytes(head)))
    return bytes(head) + payload


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admission")
    flags = ["--store", "memory://?capacity=256MiB", "--auth-tokens", str(tokens_file(tmp)),
             "--body-stall-timeout", "1s", "--max-lookup-keys", "1024"]
    with running_kvserver(*flags) as server:
        yield server


@pytest.mark.parametrize("token", [None, "not-a-token-of-anyone-0123"])
def test_unauthenticated_bodies_are_refused_from_the_head_and_hold_no_memory(tenant_server, token):
    """Each request announces 512 MiB of lookup body and pushes up to 64 MiB of it: the
    answer comes from the head, the connection is closed, and the server's memory stays."""
    server = tenant_server
    before = server.rss_bytes()
    head = (f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {512 * MiB}\r\n"
            + (f"Authorization: Bearer {token}\r\n" if token else "") + "\r\n").encode()
    for _ in range(12):
        with connect(server) as sock:
            sock.sendall(head)
            send_as_much_as_taken(sock, 64 * MiB)
            reply = read_reply(sock)
        status = b"401" if token is None else b"403"
        assert reply.startswith(b"HTTP/1.1 " + status), reply[:200]
        assert b"connection: close" in reply.lower()
    assert server.rss_bytes() - before < 16 * MiB


def test_oversized_lookup_body_is_413_from_its_headers(tenant_server):
    with connect(tenant_server) as sock:
        sock.sendall((f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: {64 * MiB}\r\n"
                      f"Authorization: Bearer {ALICE}\r\n\r\n").encode())
        sent = send_as_much_as_taken(sock, 64 * MiB)
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 413") and b"lookup body of 67108864 bytes" in reply
    assert sent < 64 * MiB


def test_chunked_lookup_body_past_its_limit_is_413_while_streaming(tenant_server):
    limit = 1024 + 64 * 1024  # --max-lookup-keys 1024
    def pieces():
        yield b'{"keys": ['
        for _ in range(limit // 1000 + 1):
            yield b" " * 1000
    r = httpx.post(f"{tenant_server.url}/v1/lookup", content=pieces(),
                   headers={**auth(ALICE), "content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]


def test_lookup_body_that_stalls_gets_408(tenant_server):
    with connect(tenant_server) as sock:
        sock.sendall((f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                      f"Authorization: Bearer {ALICE}\r\n\r\n" + '{"keys": [').encode())
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b"no bytes for 1s" in reply


def test_put_whose_first_byte_never_comes_gets_408(tenant_server, ns):
    (key, _, blob), = make_chunks(ns, 1)
    with connect(tenant_server) as sock:
        sock.sendall((f"PUT /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      f"application/octet-stream\r\nContent-Length: {len(blob)}\r\n"
                      f"Authorization: Bearer {ALICE}\r\nExpect: 100-continue\r\n\r\n").encode())
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 408")
    assert b"connection: close" in reply.lower()


def test_lookup_still_answers_after_the_refusals(tenant_server, ns):
    keys = [k for k, _, _ in make_chunks(ns, 3)]
    r = httpx.post(f"{tenant_server.url}/v1/lookup", json={"keys": keys}, headers=auth(BOB))
    assert r.status_code == 200 and r.json()["prefix_len"] == 0
    r = httpx.post(f"{tenant_server.url}/v1/lookup", json={"keys": ["nope"]}, headers=auth(BOB))
    assert r.status_code == 400 and r.json()["error"].startswith("body.keys.0:")


def test_deeply_nested_meta_is_a_400_not_a_500(tenant_server, ns):
    (key, _, _), = make_chunks(ns, 1)
    blob = forged_chunk(key, b"[" * 50_000 + b"]" * 50_000)
    with pytest.raises(ChunkError, match="meta"):  # refused before it is parsed
        decode_header(blob, key)
    for _ in range(3):
        r = httpx.put(f"{tenant_server.url}/v1/chunks/{key}", content=blob,
                      headers={**OCTETS, **auth(ALICE)})
        assert r.status_code == 400 and "meta" in r.json()["error"]
    assert "Traceback" not in tenant_server.log()


def test_dripping_uploads_of_one_tenant_do_not_lock_out_another(tmp_path: Path, ns):
    """Tenant A opens 4 connections that declare a large chunk and send one byte each, then
    one that really sends almost half of the budget and stalls: every PUT of tenant B still
    gets 201, while A's next upload that would pass its half is refused."""
    flags = ["--store", "memory://", "--auth-tokens", str(tokens_file(tmp_path)),
             "--max-chunk-bytes", "1MiB", "--max-in-flight-bytes", "2MiB",
             "--body-stall-timeout", "30s"]
    chunks = make_chunks(ns, 6, payload_size=900_000)
    with running_kvserver(*flags) as server:
        stalled = []
        for key, _, blob in chunks[:4]:
            sock = connect(server)
            sock.sendall((f"PUT /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          f"application/octet-stream\r\nContent-Length: {len(blob)}\r\n"
                          f"Authorization: Bearer {ALICE}\r\n\r\n").encode() + b"K")
            stalled.append(sock)
        key, _, blob = chunks[4]
        sock = connect(server)
        sock.sendall((f"PUT /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      f"application/octet-stream\r\nContent-Length: {len(blob)}\r\n"
                      f"Authorization: Bearer {ALICE}\r\n\r\n").encode() + blob[:-1])
        stalled.append(sock)
        try:
            with httpx.Client(base_url=server.url) as c:
                deadline = time.monotonic() + 30
                while float(_metric(c, "kvstash_body_bytes_held")) < len(blob) - 1 + 4:
                    assert time.monotonic() < deadline, "the stalled bodies never arrived"
                    time.sleep(0.01)
                for key, _, blob in make_chunks(ns, 8, payload_size=900_000, seed=1):
                    r = c.put(f"/v1/chunks/{key}", content=blob, headers={**OCTETS, **auth(BOB)})
                    assert r.status_code == 201, r.text
                key, _, blob = chunks[5]
                r = c.put(f"/v1/chunks/{key}", content=blob, headers={**OCTETS, **auth(ALICE)})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
        finally:
            for sock in stalled:
                sock.close()


def _metric(client: httpx.Client, name: str) -> str:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return line.split()[1]
    raise AssertionError(f"no {name} in /metrics")


def test_an_upload_budget_below_one_chunk_per_tenant_is_a_start_error(tmp_path: Path):
    flags = ["--store", "memory://", "--auth-tokens", str(tokens_file(tmp_path)),
             "--max-chunk-bytes", "1MiB", "--max-in-flight-bytes", "1MiB"]
    with pytest.raises(RuntimeError, match="exit code 2") as info:
        with running_kvserver(*flags):
            pass
    assert "raise it to at least twice --max-chunk-bytes" in str(info.value)
