"""The kvserver HTTP API on a real uvicorn: chunk routes, lookup, limits, errors, health."""

from __future__ import annotations

import base64
import socket
import time
from pathlib import Path

import httpx
import pytest

from hashing import chunk_keys
from storage.codec import encode_chunk
from tests import kvserver_fixtures
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks

kvserver_url = kvserver_fixtures.kvserver_url

OCTETS = {"content-type": "application/octet-stream"}


def chunk_url(base: str, key: str) -> str:
    return f"{base}/v1/chunks/{key}"


def assert_json_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"} and body["error"]
    return body["error"]


def test_put_get_head_delete_round_trip(kvserver_url, ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=10_000)
    with httpx.Client() as c:
        r = c.put(chunk_url(kvserver_url, key), content=blob, headers=OCTETS)
        assert (r.status_code, r.json()) == (201, {"created": True})
        r = c.put(chunk_url(kvserver_url, key), content=blob, headers=OCTETS)
        assert (r.status_code, r.json()) == (200, {"created": False})
        r = c.get(chunk_url(kvserver_url, key))
        assert r.status_code == 200 and r.content == blob
        assert r.headers["content-type"] == "application/octet-stream"
        assert c.head(chunk_url(kvserver_url, key)).status_code == 200
        assert c.delete(chunk_url(kvserver_url, key)).status_code == 204
        assert_json_error(c.get(chunk_url(kvserver_url, key)), 404)
        assert c.head(chunk_url(kvserver_url, key)).status_code == 404
        assert_json_error(c.delete(chunk_url(kvserver_url, key)), 404)


def test_range_get_returns_the_requested_slice(kvserver_url, ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=5000)
    with httpx.Client() as c:
        c.put(chunk_url(kvserver_url, key), content=blob, headers=OCTETS)
        r = c.get(chunk_url(kvserver_url, key), headers={"Range": "bytes=4096-4105"})
        assert r.status_code == 206 and r.content == blob[4096:4106]
        assert r.headers["content-range"] == f"bytes 4096-4105/{len(blob)}"
        r = c.get(chunk_url(kvserver_url, key), headers={"Range": "bytes=-10"})
        assert r.content == blob[-10:]
        r = c.get(chunk_url(kvserver_url, key), headers={"Range": "bytes=9000-"})
        assert r.content == blob[9000:]
        assert_json_error(c.get(chunk_url(kvserver_url, key), headers={"Range": "bytes=99999-"}), 416)
        assert_json_error(c.get(chunk_url(kvserver_url, key), headers={"Range": "lines=1-2"}), 400)
        assert_json_error(c.get(chunk_url(kvserver_url, key), headers={"Range": "bytes=9-3"}), 400)


def test_lookup_gives_prefix_len_and_presence_bitmap(kvserver_url, ns):
    chunks = make_chunks(ns, 20, payload_size=100)
    stored = [0, 1, 2, 5, 19]
    with httpx.Client() as c:
        for i in stored:
            key, _, blob = chunks[i]
            c.put(chunk_url(kvserver_url, key), content=blob, headers=OCTETS)
        keys = [k for k, _, _ in chunks]
        r = c.post(f"{kvserver_url}/v1/lookup", json={"keys": keys})
        assert r.status_code == 200
        body = r.json()
        assert body["prefix_len"] == 3 and body["count"] == 20
        bits = base64.b64decode(body["present"])
        assert [i for i in range(20) if bits[i // 8] >> (i % 8) & 1] == stored
        r = c.post(f"{kvserver_url}/v1/lookup", json={"keys": keys, "stop_at_gap": True})
        assert r.json()["prefix_len"] == 3
        assert base64.b64decode(r.json()["present"]) == b"\x07\x00\x00"


def test_lookup_handles_thousands_of_keys_in_one_request(kvserver_url, ns):
    keys = chunk_keys(list(range(16 * 4000)), ns)
    r = httpx.post(f"{kvserver_url}/v1/lookup", json={"keys": keys}, timeout=30)
    assert r.status_code == 200 and r.json()["count"] == 4000 and r.json()["prefix_len"] == 0


@pytest.mark.parametrize("body", [
    {"keys": ["../../etc/passwd"]},
    {"keys": ["0123456789abcdef/0123456789ABCDEF0123456789abcdef"]},
    {"keys": "not a list"},
    {},
    {"keys": [], "stop_at_gap": 0},  # a boolean, not a number that reads as one
    {"keys": [], "stop_at_gap": "true"},
])
def test_lookup_rejects_malformed_requests_with_400(kvserver_url, body):
    assert_json_error(httpx.post(f"{kvserver_url}/v1/lookup", json=body), 400)


def test_put_body_must_be_a_valid_chunk_for_the_url_key(kvserver_url, ns):
    (k1, _, b1), (k2, _, _) = make_chunks(ns, 2)
    with httpx.Client() as c:
        msg = assert_json_error(c.put(chunk_url(kvserver_url, k2), content=b1, headers=OCTETS), 400)
        assert "expected" in msg  # the header holds k1, the URL says k2
        corrupt = bytearray(b1)
        corrupt[-1] ^= 1
        assert_json_error(c.put(chunk_url(kvserver_url, k1), content=bytes(corrupt), headers=OCTETS), 400)
        assert_json_error(c.put(chunk_url(kvserver_url, k1), content=b"", headers=OCTETS), 400)
        assert_json_error(
            c.put(chunk_url(kvserver_url, k1), content=b1, headers={"content-type": "text/plain"}), 415
        )
        assert c.head(chunk_url(kvserver_url, k1)).status_code == 404


@pytest.mark.parametrize("path", [
    "/v1/chunks/0123456789abcdeg/0123456789abcdef0123456789abcdef",
    "/v1/chunks/0123456789abcdef/0123456789abcdef0123456789abcdef0",
    "/v1/chunks/0123456789abcdef/0123456789abcdef0123456789ABCDEF",
    "/v1/chunks/0123456789abcdef/%00123456789abcdef0123456789abcde",
])
def test_malformed_keys_are_rejected_with_400(kvserver_url, path):
    assert_json_error(httpx.get(kvserver_url + path), 400)


def _raw_request(url: str, request: bytes) -> bytes:
    """Send raw bytes; the reply up to the end of its (JSON) body or the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        out = b""
        while not out.endswith(b"}") and (chunk := s.recv(65536)):
            out += chunk
    return out


def test_oversized_body_gets_413_before_it_is_sent(ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=64 * 1024)
    with running_kvserver("--store", "memory://", "--max-chunk-bytes", "32KiB") as server:
        # Declared too large: refused from the headers alone, without a byte of body sent.
        head = (f"PUT /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {10**12}\r\nExpect: 100-continue\r\n\r\n").encode()
        reply = _raw_request(server.url, head)
        assert reply.startswith(b"HTTP/1.1 413") and b'{"error":' in reply
        # Chunked (no length known up front): counted while streaming and refused past the limit.
        def pieces():
            for i in range(0, len(blob), 8192):
                yield blob[i : i + 8192]
        r = httpx.put(chunk_url(server.url, key), content=pieces(), headers=OCTETS)
        assert_json_error(r, 413)
        assert httpx.get(f"{server.url}/readyz").status_code == 200


def test_every_error_is_one_json_message(kvserver_url):
    with httpx.Client() as c:
        assert_json_error(c.get(f"{kvserver_url}/no/such/route"), 404)
        assert_json_error(c.post(f"{kvserver_url}/healthz"), 405)
        assert_json_error(
            c.post(f"{kvserver_url}/v1/lookup", content=b"{not json", headers={"content-type": "application/json"}),
            400,
        )


def test_keys_stats_metrics_and_health(kvserver_url, ns):
    (key, _, blob), = make_chunks(ns, 1)
    with httpx.Client() as c:
        c.put(chunk_url(kvserver_url, key), content=blob, headers=OCTETS)
        c.get(chunk_url(kvserver_url, key))
        c.get(chunk_url(kvserver_url, key[:-1] + ("0" if key[-1] != "0" else "1")))
        assert key in c.get(f"{kvserver_url}/v1/keys").text.split()
        stats = c.get(f"{kvserver_url}/v1/stats").json()
        assert stats["backend"] == "memory" and stats["hits"] >= 1
        metrics = c.get(f"{kvserver_url}/metrics").text
        for name in ("kvstash_chunk_hits_total", "kvstash_chunk_misses_total",
                     "kvstash_bytes_served_total", "kvstash_store_used_bytes",
                     "kvstash_store_capacity_bytes", "kvstash_http_request_seconds_bucket"):
            assert name in metrics
        assert c.get(f"{kvserver_url}/healthz").json() == {"status": "ok"}
        assert c.get(f"{kvserver_url}/readyz").json() == {"status": "ready"}
        assert "/v1/lookup" in c.get(f"{kvserver_url}/openapi.json").json()["paths"]


def test_default_store_is_a_local_directory_and_is_printed(tmp_path: Path):
    with running_kvserver(env={"KVSTASH_HOME": str(tmp_path)}) as server:
        assert server.banner_store == f"file://{tmp_path / 'store'}?capacity=8GiB"
        assert httpx.get(f"{server.url}/v1/stats").json()["root"] == str(tmp_path / "store")


def test_tiers_from_repeated_store_flags(tmp_path: Path, ns):
    (key, _, blob), = make_chunks(ns, 1)
    with running_kvserver("--store", "memory://", "--store", f"file://{tmp_path}") as server:
        httpx.put(chunk_url(server.url, key), content=blob, headers=OCTETS)
        assert httpx.get(chunk_url(server.url, key)).content == blob
        assert httpx.get(f"{server.url}/v1/stats").json()["backend"] == "tiered"


def test_chunk_with_tokens_survives_the_round_trip(kvserver_url, ns):
    tokens = list(range(16))
    key = chunk_keys(tokens, ns)[0]
    blob = encode_chunk(key, tokens, bytes(range(256)) * 64, {"layers": 2})
    httpx.put(chunk_url(kvserver_url, key), content=blob, headers=OCTETS)
    assert httpx.get(chunk_url(kvserver_url, key)).content == blob


def test_a_body_slower_than_the_body_timeout_gets_408(ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=10_000)
    with running_kvserver("--store", "memory://", "--body-timeout", "1s") as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall((f"PUT /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       f"application/octet-stream\r\nContent-Length: {len(blob)}\r\n\r\n").encode()
                      + blob[:100])  # ...and then nothing more
            reply = b""
            while not reply.endswith(b"}") and (part := s.recv(65536)):
                reply += part
        assert reply.startswith(b"HTTP/1.1 408") and b'"error"' in reply
        assert httpx.get(f"{server.url}/v1/chunks/{key}").status_code == 404


def body_bytes_held(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("kvstash_body_bytes_held "):
            return float(line.split()[1])
    raise AssertionError("no kvstash_body_bytes_held in /metrics")


def test_uploads_past_the_bytes_held_get_503_until_one_finishes(ns):
    """The budget counts bytes received, not declared: a PUT is refused only when its size
    does not fit beside bytes other bodies really hold."""
    (k1, _, b1), (k2, _, b2), (k3, _, b3) = make_chunks(ns, 3, payload_size=40_000)
    flags = ["--store", "memory://", "--max-chunk-bytes", "64KiB", "--max-in-flight-bytes", "64KiB"]
    with running_kvserver(*flags) as server:
        host, port = server.url.removeprefix("http://").split(":")
        slow = socket.create_connection((host, int(port)), timeout=10)
        slow.sendall((f"PUT /v1/chunks/{k1} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      f"application/octet-stream\r\nContent-Length: {len(b1)}\r\n"
                      "Expect: 100-continue\r\n\r\n").encode())
        assert slow.recv(65536).startswith(b"HTTP/1.1 100")
        # Declared but not sent: holds nothing, so another upload goes through.
        assert body_bytes_held(server.url) == 0
        assert httpx.put(chunk_url(server.url, k3), content=b3, headers=OCTETS).status_code == 201
        slow.sendall(b1[:30_000])
        deadline = time.monotonic() + 30
        while body_bytes_held(server.url) < 30_000:
            assert time.monotonic() < deadline, "the body never arrived"
            time.sleep(0.01)
        r = httpx.put(chunk_url(server.url, k2), content=b2, headers=OCTETS)
        assert_json_error(r, 503)
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        slow.sendall(b1[30_000:])
        reply = b""
        while not reply.endswith(b"}") and (part := slow.recv(65536)):
            reply += part
        slow.close()
        assert reply.startswith(b"HTTP/1.1 201")
        assert body_bytes_held(server.url) == 0
        assert httpx.put(chunk_url(server.url, k2), content=b2, headers=OCTETS).status_code == 201
