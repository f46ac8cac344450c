"""One capacity for the whole backend, shared by tenants; per-tenant quotas; readiness of a
backend that cannot serve. Real `kvstash serve` processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from kvserver.app import create_app
from kvserver.config import ServerConfig
from storage.errors import StoreFull
from storage.file import FileStore
from storage.memory import MemoryStore
from storage.tenancy import open_tenants
from tests.kvserver_fixtures import running_kvserver
from tests.reliability_fixtures import small_fs_fixture  # noqa: F401
from tests.store_helpers import make_chunks

OCTETS = {"content-type": "application/octet-stream"}
TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef-xyz",
          "carol": "carol-token-0123456789abcdef"}
MiB = 1 << 20


def tokens_file(tmp: Path) -> Path:
    path = tmp / "tokens"
    path.write_text("".join(f"{t} {tok}\n" for t, tok in TOKENS.items()))
    path.chmod(0o600)
    return path


def put(c: httpx.Client, tenant: str, key: str, blob: bytes) -> int:
    return c.put(f"/v1/chunks/{key}", content=blob,
                 headers={**OCTETS, "Authorization": f"Bearer {TOKENS[tenant]}"}).status_code


def tenant_stats(c: httpx.Client, tenant: str) -> dict:
    return c.get("/v1/stats", headers={"Authorization": f"Bearer {TOKENS[tenant]}"}).json()


def used_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kv"))


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_tenants_share_one_capacity(tmp_path: Path, ns, backend: str):
    """Three tenants each write the whole capacity: together they hold at most it, and
    each keeps its most recent chunks."""
    url = ("memory://?capacity=8MiB" if backend == "memory"
           else f"file://{tmp_path / 'store'}?capacity=8MiB")
    with running_kvserver("--store", url, "--auth-tokens", str(tokens_file(tmp_path))) as server:
        with httpx.Client(base_url=server.url) as c:
            latest = {}
            for seed, tenant in enumerate(TOKENS):
                chunks = make_chunks(ns, 8, payload_size=MiB - 4096, seed=seed)
                for key, _, blob in chunks:
                    assert put(c, tenant, key, blob) == 201
                latest[tenant] = chunks[-1]
            held = {t: tenant_stats(c, t)["used_bytes"] for t in TOKENS}
            assert sum(held.values()) <= 8 * MiB and all(held.values()), held
            assert all(tenant_stats(c, t)["capacity_bytes"] == 8 * MiB for t in TOKENS)
            for tenant, (key, _, blob) in latest.items():
                r = c.get(f"/v1/chunks/{key}",
                          headers={"Authorization": f"Bearer {TOKENS[tenant]}"})
                assert r.status_code == 200 and r.content == blob
            metrics = c.get("/metrics").text
            used = next(float(line.split()[1]) for line in metrics.splitlines()
                        if line.startswith("kvstash_store_used_bytes "))
            assert used <= 8 * MiB
    if backend == "file":
        assert used_on_disk(tmp_path / "store") <= 8 * MiB
        assert (tmp_path / "store" / "tenants" / "alice").is_dir()  # the layout stays


def test_tenant_quota_bounds_one_tenant_and_spares_the_others(tmp_path: Path, ns):
    flags = ["--store", f"file://{tmp_path / 'store'}?capacity=64MiB",
             "--auth-tokens", str(tokens_file(tmp_path)), "--tenant-quota", "2MiB"]
    with running_kvserver(*flags) as server, httpx.Client(base_url=server.url) as c:
        bob = make_chunks(ns, 2, payload_size=MiB - 4096, seed=9)
        for key, _, blob in bob:
            assert put(c, "bob", key, blob) == 201
        for key, _, blob in make_chunks(ns, 6, payload_size=MiB - 4096, seed=1):
            assert put(c, "alice", key, blob) == 201
        assert tenant_stats(c, "alice")["used_bytes"] <= 2 * MiB
        assert tenant_stats(c, "alice")["quota_bytes"] == 2 * MiB
        assert tenant_stats(c, "bob")["used_bytes"] == 2 * MiB
        (key, _, big), = make_chunks(ns, 1, payload_size=3 * MiB, seed=2)
        r = c.put(f"/v1/chunks/{key}", content=big,
                  headers={**OCTETS, "Authorization": f"Bearer {TOKENS['carol']}"})
        assert r.status_code == 507 and "tenant quota" in r.json()["error"]


def test_tenant_quota_without_tokens_is_a_start_error():
    with pytest.raises(RuntimeError, match="exit code 2") as info:
        with running_kvserver("--store", "memory://", "--tenant-quota", "1GiB"):
            pass
    assert "--tenant-quota needs --auth-tokens" in str(info.value)


def test_readyz_reports_a_missing_store_root(tmp_path: Path):
    root = tmp_path / "store"
    with running_kvserver("--store", f"file://{root}") as server:
        assert httpx.get(f"{server.url}/readyz").status_code == 200
        shutil.rmtree(root)
        r = httpx.get(f"{server.url}/readyz")
        assert r.status_code == 503 and "missing" in r.json()["error"]
        root.mkdir()
        assert httpx.get(f"{server.url}/readyz").status_code == 200


async def test_eviction_takes_from_the_largest_holder_first(ns):
    root = MemoryStore(capacity=6 * MiB)
    tenants = open_tenants(root, ["heavy", "light"])
    light = make_chunks(ns, 1, payload_size=MiB - 4096, seed=5)
    for key, _, blob in light:
        assert await tenants["light"].put(key, blob)
    for key, _, blob in make_chunks(ns, 12, payload_size=MiB - 4096, seed=6):
        assert await tenants["heavy"].put(key, blob)
    assert await tenants["light"].exists([light[0][0]]) == [True]
    assert tenants["heavy"].used_bytes() + tenants["light"].used_bytes() <= 6 * MiB
    before = tenants["heavy"].used_bytes()
    (key, _, huge), = make_chunks(ns, 1, payload_size=7 * MiB, seed=7)
    with pytest.raises(StoreFull, match="exceeds capacity"):
        await tenants["light"].put(key, huge)
    assert tenants["heavy"].used_bytes() == before  # nobody evicted for a chunk that cannot fit


async def test_full_disk_frees_room_from_the_other_tenants(small_fs: Path, ns):
    """An 8 MiB tmpfs (root only): alice fills the disk, then bob's put still lands, as
    alice's oldest chunks make room; a disk left full is reported by `health`."""
    root = FileStore(small_fs / "store")
    tenants = open_tenants(root, ["alice", "bob"])
    for key, _, blob in make_chunks(ns, 12, payload_size=MiB - 4096, seed=1):
        assert await tenants["alice"].put(key, blob)
    (key, _, blob), = make_chunks(ns, 1, payload_size=MiB - 4096, seed=2)
    assert await tenants["bob"].put(key, blob)
    assert await tenants["bob"].get(key) == blob
    assert await root.health() is None
    with open(small_fs / "ballast", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    assert "is full" in (await root.health() or "")


def test_readyz_reports_an_open_circuit_breaker():
    """A kvserver in front of an http:// backend nobody listens on: once the backend's
    breaker opens, readiness says so instead of answering ready from a quick miss."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    backend = f"http://127.0.0.1:{port}?breaker_failures=1&breaker_cooldown=60s&timeout=1s"
    with running_kvserver("--store", backend) as server:
        first, then = (httpx.get(f"{server.url}/readyz") for _ in range(2))
        assert first.status_code == 503 and "presence check failed" in first.json()["error"]
        assert then.status_code == 503 and "circuit breaker open" in then.json()["error"]


async def test_health_reports_a_read_only_store_root(small_fs: Path):
    """The 8 MiB tmpfs remounted read-only (root only): `health`, hence /readyz, says so."""
    root = FileStore(small_fs / "store")
    assert await root.health() is None
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        assert "read-only" in (await root.health() or "")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    assert await root.health() is None


async def test_readyz_is_decided_by_its_own_probe_not_by_other_requests_failing():
    """Readiness in front of an http:// backend (a raw asyncio server on 127.0.0.1 that
    answers readiness's presence check only once another request through the same store
    has failed): the check got through, so the server is ready; the other request's
    failure, counted in the store's stats meanwhile, is that request's own. The kvserver
    app runs in-process (httpx's ASGI transport) so that the two requests interleave in
    one fixed order."""
    probe_arrived, other_failed = asyncio.Event(), asyncio.Event()

    async def backend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length: *(\d+)", head)
        await reader.readexactly(int(length.group(1)) if length else 0)
        if head.startswith(b"POST /v1/lookup "):
            probe_arrived.set()
            await other_failed.wait()
            status, body = b"200 OK", b'{"prefix_len": 0, "count": 1, "present": "AA=="}'
        else:
            status, body = b"500 Internal Server Error", b'{"error": "backend fault"}'
        writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                     b"connection: close\r\n\r\n%s" % (status, len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(backend, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    app = create_app(ServerConfig(store_urls=(f"http://127.0.0.1:{port}?timeout=30s",)))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://kvserver") as c:
            ready = asyncio.create_task(c.get("/readyz"))
            await asyncio.wait_for(probe_arrived.wait(), 30)
            other = await c.get(f"/v1/chunks/{'0123456789abcdef'}/{'ab' * 16}")
            other_failed.set()
            answer = await asyncio.wait_for(ready, 30)
        assert other.status_code == 404  # a backend failure is a miss
        assert app.state.tenancy.root.stats()["errors"] == 1
        assert answer.status_code == 200, answer.text
    finally:
        await app.state.tenancy.root.close()
        server.close()
        await server.wait_closed()
