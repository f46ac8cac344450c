"""Path traversal: no request, however encoded, reads or writes a file outside the store root."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from storage.file import _chunk_path
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks


def snapshot(tree: Path, skip: Path) -> dict[str, tuple[int, int]]:
    """Every file under `tree` but outside `skip`: path -> (size, mtime_ns)."""
    out = {}
    for dirpath, _, files in os.walk(tree):
        if Path(dirpath).is_relative_to(skip):
            continue
        for name in files:
            st = os.stat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return out


def raw(url: str, request: bytes) -> tuple[int, bytes]:
    """Send `request` as is; (status, body) of the answer (a HEAD's has no body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        reply = b""
        while b"\r\n\r\n" not in reply:
            part = s.recv(65536)
            if not part:
                break
            reply += part
        head, _, body = reply.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        if request.startswith(b"HEAD "):
            length = 0
        while len(body) < length and (part := s.recv(65536)):
            body += part
    return int(head.split(b" ")[1]), body


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    """A store root, and beside it a valid chunk file that a traversal would aim at."""
    tmp = tmp_path_factory.mktemp("traversal")
    root = tmp / "root"
    outside = tmp / "outside"
    from hashing import Namespace

    ns = Namespace(model="m", dtype="f", layout="l", chunk_tokens=16, salt="traversal")
    (key, _, blob), = make_chunks(ns, 1)
    target = _chunk_path(outside, key)
    target.parent.mkdir(parents=True)
    target.write_bytes(blob)
    (tmp / "secret.txt").write_text("secret")
    with running_kvserver("--store", f"file://{root}") as server:
        yield server.url, tmp, root, key, blob


def attack_paths(key: str) -> list[str]:
    ns_id, digest = key.split("/")
    return [
        f"/v1/chunks/../outside/{ns_id}/{digest}",
        f"/v1/chunks/..%2Foutside%2F{ns_id}/{digest}",
        f"/v1/chunks/%2e%2e%2foutside%2f{ns_id}/{digest}",
        f"/v1/chunks/{ns_id}/..%2F..%2F..%2Fsecret.txt",
        f"/v1/chunks/{ns_id}/%2e%2e",
        f"/v1/chunks/{ns_id}/{digest[:-2]}%00a",
        f"/v1/chunks/{ns_id}%5C..%5C../{digest}",
        f"/v1/chunks//{digest}",
        f"/v1/chunks/{ns_id}/{digest}/..",
        f"/v1/chunks/{ns_id}/{digest}%2F..%2F..%2F..%2Fsecret.txt",
        "/v1/chunks/..%252F..%252Fsecret.txt/0",
        f"/v1/chunks/{ns_id}/{digest[:31]}\u2024".encode().decode("latin-1"),
        "//etc/passwd",
        "/v1/../../../../etc/passwd",
    ]


def test_traversal_gets_never_read_outside_the_root(victim):
    url, _, _, key, blob = victim
    for path in attack_paths(key):
        status, body = raw(url, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode("latin-1"))
        assert status in (400, 404, 405), (path, status)
        assert blob[:64] not in body and b"secret" not in body


def test_traversal_puts_never_write_outside_the_root(victim):
    url, tmp, root, key, blob = victim
    before = snapshot(tmp, skip=root)
    for path in attack_paths(key):
        head = (f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {len(blob)}\r\n\r\n").encode("latin-1")
        status, _ = raw(url, head + blob)
        assert status in (400, 404, 405), (path, status)
        status, _ = raw(url, f"DELETE {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode("latin-1"))
        assert status in (400, 404, 405), (path, status)
    assert snapshot(tmp, skip=root) == before


def test_traversal_keys_in_a_lookup_are_rejected(victim):
    url, _, _, key, _ = victim
    ns_id, digest = key.split("/")
    for bad in [f"../outside/{ns_id}/{digest}", f"{ns_id}/../{digest[3:]}", f"{ns_id}/{digest}\n"]:
        body = json.dumps({"keys": [bad]}).encode()
        head = (f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        status, reply = raw(url, head + body)
        assert status == 400 and b'"error"' in reply


def encoded_separator_paths(key: str) -> list[str]:
    """Paths that name `key` once percent-decoded, through an encoded separator or with
    a control character a route's `$` would let through."""
    ns_id, digest = key.split("/")
    return [
        f"/v1/chunks/{ns_id}%2F{digest}",
        f"/v1/chunks/{ns_id}%2f{digest}",
        f"/v1/chunks%2F{ns_id}/{digest}",
        f"/v1%2Fchunks/{ns_id}/{digest}",
        f"/v1/chunks/{ns_id}%5C{digest}",
        f"/v1/chunks/{ns_id}/{digest}%0A",
        f"/v1/chunks/{ns_id}/{digest}%00",
        f"/v1/chunks/{ns_id}/{digest}%7F",
        "/v1/keys%0A",
        "/v1/stats%0a",
        "/v1/lookup%0D",
    ]


def test_an_encoded_slash_or_control_character_in_a_path_is_a_400(tmp_path, ns):
    """docs/kvserver.md: `%2F` and control characters in a path are a 400 before any store
    code runs; routing matches the decoded path, so they reached the routes before."""
    (key, _, blob), = make_chunks(ns, 1)
    with running_kvserver("--store", f"file://{tmp_path}/s") as server:
        put = (f"PUT /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\nContent-Type: "
               f"application/octet-stream\r\nContent-Length: {len(blob)}\r\n\r\n").encode()
        assert raw(server.url, put + blob)[0] == 201
        assert raw(server.url, f"GET /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\n\r\n".encode()) == (200, blob)
        for path in encoded_separator_paths(key):
            for method in ("GET", "HEAD", "DELETE", "POST"):
                status, body = raw(server.url, f"{method} {path} HTTP/1.1\r\nHost: x\r\n"
                                               "Content-Length: 0\r\n\r\n".encode())
                assert status == 400, (method, path, status)
                if method != "HEAD":
                    assert "request path holds" in json.loads(body)["error"], (method, path, body)
        assert raw(server.url, f"GET /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\n\r\n".encode()) == (200, blob)
