"""Tenants and secrets: with auth on, every tenant route refuses a missing or wrong token;
tenant B can neither read, list, look up, delete, count nor time-probe tenant A's chunks
(B's probes never reach A's scope at all); and no token or S3 secret key ever shows in a
log line, an error body, a stats answer or an exception message."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from bench.faults import KvServerProcess, chunk_for, free_port
from storage import StoreError, open_store
from storage.http import HttpStore

SEED = 77
ALICE = "alice-secret-token-a1b2c3d4e5f6"
BOB = "bob-secret-token-0f9e8d7c6b5a4"
NEAR_MISS = ALICE[:-1] + "X"
TOKENS = (ALICE, BOB, NEAR_MISS)
OCTETS = {"content-type": "application/octet-stream"}
OPEN_ROUTES = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/redoc",
               "/docs/oauth2-redirect"}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("isolation")
    tokens = tmp / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    tokens.chmod(0o600)
    server = KvServerProcess(["--store", f"file://{tmp / 'store'}", "--auth-tokens", str(tokens),
                            "--access-log"], free_port(), tmp / "server.log", verbose=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def tenant_requests(url: str, key: str, blob: bytes) -> list[tuple[str, str, dict]]:
    """One request per tenant route of the OpenAPI document, with valid parameters."""
    spec = httpx.get(f"{url}/openapi.json").json()
    ns_id, digest = key.split("/")
    out = []
    for path, methods in spec["paths"].items():
        if path in OPEN_ROUTES:
            continue
        target = url + path.replace("{ns_id}", ns_id).replace("{digest}", digest)
        for method in methods:
            kwargs: dict = {}
            if method == "put":
                kwargs = {"content": blob, "headers": dict(OCTETS)}
            elif method == "post":
                kwargs = {"json": {"keys": [key]}}
            out.append((method.upper(), target, kwargs))
    return out


def test_every_tenant_route_refuses_a_missing_or_wrong_token(tenant_server):
    key, blob = chunk_for(SEED, 0)
    requests = tenant_requests(tenant_server.url, key, blob)
    assert {m for m, _, _ in requests} >= {"GET", "PUT", "HEAD", "DELETE", "POST"}
    with httpx.Client() as c:
        for method, target, kwargs in requests:
            headers = kwargs.pop("headers", {})
            r = c.request(method, target, headers=headers, **kwargs)
            assert r.status_code == 401, (method, target)
            r = c.request(method, target, headers={**headers, **auth(NEAR_MISS)}, **kwargs)
            assert r.status_code == 403, (method, target)
            assert NEAR_MISS not in r.text
    assert httpx.get(f"{tenant_server.url}/v1/chunks/{key}", headers=auth(ALICE)).status_code == 404


def scope_stats(url: str, token: str) -> dict:
    return httpx.get(f"{url}/v1/stats", headers=auth(token)).json()


def test_tenant_cannot_reach_another_tenants_chunks_by_any_route(tenant_server):
    url = tenant_server.url
    chunks = [chunk_for(SEED, i) for i in range(1, 4)]
    keys = [k for k, _ in chunks]
    with httpx.Client() as c:
        for key, blob in chunks:
            assert c.put(f"{url}/v1/chunks/{key}", content=blob,
                         headers={**OCTETS, **auth(ALICE)}).status_code == 201
        bob = auth(BOB)
        assert c.get(f"{url}/v1/chunks/{keys[0]}", headers=bob).status_code == 404
        assert c.get(f"{url}/v1/chunks/{keys[0]}",
                     headers={**bob, "Range": "bytes=0-99"}).status_code == 404
        assert c.head(f"{url}/v1/chunks/{keys[0]}", headers=bob).status_code == 404
        assert c.delete(f"{url}/v1/chunks/{keys[0]}", headers=bob).status_code == 404
        lookup = c.post(f"{url}/v1/lookup", json={"keys": keys}, headers=bob).json()
        assert lookup["prefix_len"] == 0 and set(lookup["present"]) <= {"A", "="}
        assert not set(keys) & set(c.get(f"{url}/v1/keys", headers=bob).text.split())
        bob_stats = scope_stats(url, BOB)
        assert bob_stats["chunks"] == 0 and bob_stats["used_bytes"] == 0
        assert ALICE not in str(bob_stats) and "alice" not in str(bob_stats)

        # Bob writing the same key lands in Bob's scope; Alice's bytes are untouched.
        assert c.put(f"{url}/v1/chunks/{keys[1]}", content=chunks[1][1],
                     headers={**OCTETS, **bob}).status_code == 201
        assert c.delete(f"{url}/v1/chunks/{keys[1]}", headers=bob).status_code == 204
        for key, blob in chunks:
            assert c.get(f"{url}/v1/chunks/{key}", headers=auth(ALICE)).content == blob


def test_probing_another_tenants_key_never_reaches_that_tenant(tenant_server):
    """No timing channel: Bob's probe for Alice's key is answered from Bob's own scope,
    exactly like a probe for a key nobody wrote, and Alice's scope sees no access at all."""
    url = tenant_server.url
    key, blob = chunk_for(SEED, 10)
    absent, _ = chunk_for(SEED, 11)
    httpx.put(f"{url}/v1/chunks/{key}", content=blob, headers={**OCTETS, **auth(ALICE)})
    alice_before = scope_stats(url, ALICE)

    def answers(k: str) -> list[tuple[int, dict, bytes]]:
        out = []
        with httpx.Client(headers=auth(BOB)) as c:
            for r in (c.get(f"{url}/v1/chunks/{k}"), c.head(f"{url}/v1/chunks/{k}"),
                      c.post(f"{url}/v1/lookup", json={"keys": [k]}),
                      c.post(f"{url}/v1/lookup", json={"keys": [k], "stop_at_gap": True})):
                headers = {h: v for h, v in r.headers.items() if h != "date"}
                out.append((r.status_code, headers, r.content))
        return out

    for _ in range(5):
        assert answers(key) == answers(absent)
    alice_after = scope_stats(url, ALICE)
    for counter in ("gets", "hits", "misses", "bytes_read"):
        assert alice_after[counter] == alice_before[counter], counter


def test_tokens_never_appear_in_server_logs_or_error_bodies(tenant_server):
    url = tenant_server.url
    key, blob = chunk_for(SEED, 20)
    bodies = []
    with httpx.Client() as c:
        for token in TOKENS:
            for r in (c.put(f"{url}/v1/chunks/{key}", content=blob,
                            headers={**OCTETS, **auth(token)}),
                      c.get(f"{url}/v1/chunks/{key}", headers=auth(token)),
                      c.get(f"{url}/v1/chunks/{key[:-1]}", headers=auth(token)),
                      c.post(f"{url}/v1/lookup", json={"keys": ["../x"]}, headers=auth(token)),
                      c.get(f"{url}/v1/stats", headers=auth(token))):
                bodies.append(r.text)
        bodies.append(c.get(f"{url}/metrics").text)
    log = tenant_server.log_text()
    assert "GET /v1/chunks/" in log, "the access log is on, so requests are logged"
    for token in TOKENS:
        assert token not in log
        assert not [b for b in bodies if token in b]


async def test_http_store_never_shows_its_token(tenant_server, caplog: pytest.LogCaptureFixture):
    key, blob = chunk_for(SEED, 30)
    dead = f"http://127.0.0.1:{free_port()}"
    seen: list[str] = []
    with caplog.at_level(logging.DEBUG):
        for base in (tenant_server.url, dead):
            store = open_store(f"{base}?token={NEAR_MISS}&timeout=1s")
            seen += [str(store), repr(store), str(store.stats())]
            assert await store.get(key) is None
            assert await store.prefix_len([key]) == 0
            try:
                await store.put(key, blob)
            except StoreError as exc:
                seen.append(str(exc))
            await store.close()
        direct = HttpStore(dead, token=NEAR_MISS, timeout=1.0)
        seen += [str(direct), str(direct.stats())]
        await direct.close()
    seen.append(caplog.text)
    assert not [s for s in seen if NEAR_MISS in s]


async def test_s3_secret_key_never_appears_in_logs_errors_or_stats(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    secret = "s3-secret-key-do-not-print-42"
    url = (f"s3://bucket/p?endpoint=http://127.0.0.1:{free_port()}&region=us-east-1"
           f"&access_key=AKIDEXAMPLE&secret_key={secret}&retries=1&timeout=2s")
    key, blob = chunk_for(SEED, 40)
    seen: list[str] = []
    with caplog.at_level(logging.DEBUG):
        store = open_store(url)
        seen += [str(store), repr(store), str(store.stats())]
        assert await store.get(key) is None
        try:
            await store.put(key, blob)
        except StoreError as exc:
            seen.append(str(exc))
        await store.close()
    seen.append(caplog.text)
    assert not [s for s in seen if secret in s]

    server = KvServerProcess(["--store", url], free_port(), tmp_path / "server.log", verbose=True)
    server.start()
    try:
        with httpx.Client() as c:
            seen = [c.get(f"{server.url}/v1/chunks/{key}").text,
                    c.put(f"{server.url}/v1/chunks/{key}", content=blob, headers=OCTETS).text,
                    c.get(f"{server.url}/v1/stats").text, c.get(f"{server.url}/readyz").text,
                    c.get(f"{server.url}/metrics").text]
    finally:
        server.stop()
    seen.append(server.log_text())
    assert "kvstash serve:" in seen[-1]
    assert not [s for s in seen if secret in s]
