"""The status page (GET /status, /status.json) of a real kvserver: authenticated like the
API, an admin token sees every tenant, a tenant's token only its own figures; loaded in
headless Chromium (Debian's package) when it is installed, else skipped with the reason.
Also the tier-health gauges it adds to /metrics, and that an admin token opens no chunks."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from kvserver.status import redact
from tests.kvserver_fixtures import KvServer, running_kvserver
from tests.store_helpers import make_chunks

ALICE, BOB, ADMIN = "alice-token-0123456789", "bob-token-01234567890", "admin-token-0123456789"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FIGURES = ("version", "store", "hit_rate", "read_gbps", "write_gbps", "subscribers", "errors",
           "tenant", "chunks", "used", "capacity", "quota", "tenant_hit_rate", "breaker",
           "tier_url")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[KvServer]:
    """Two tenants: alice stores 3 chunks and reads them (and one miss), bob stores 5."""
    where = tmp_path_factory.mktemp("status")
    tokens = where / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n* {ADMIN}\n")
    tokens.chmod(0o600)
    with running_kvserver("--store", f"file://{where}/kv?capacity=64MiB",
                          "--auth-tokens", str(tokens), "--tenant-quota", "16MiB") as srv:
        from hashing import Namespace

        for token, n, seed in ((ALICE, 3, 1), (BOB, 5, 2)):
            ns = Namespace(model="m", dtype="f", layout="l", chunk_tokens=16, salt=str(seed))
            with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {token}"}) as c:
                for key, _, blob in make_chunks(ns, n, 4096, seed):
                    assert c.put(f"/v1/chunks/{key}", content=blob, headers={
                        "content-type": "application/octet-stream"}).status_code == 201
                    if token == ALICE:
                        assert c.get(f"/v1/chunks/{key}").status_code == 200
                if token == ALICE:
                    assert c.get(f"/v1/chunks/{'0' * 16}/{'1' * 32}").status_code == 404
        yield srv


def status_json(server: KvServer, token: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{server.url}/status.json", headers=headers)


def test_status_needs_a_token(server):
    page = httpx.get(f"{server.url}/status")
    assert page.status_code == 401 and '<form method="get"' in page.text
    assert status_json(server, None).status_code == 401
    assert status_json(server, "not-a-token-at-all-123").status_code == 403


def test_admin_token_sees_every_tenant(server):
    report = status_json(server, ADMIN).json()
    tenants = {t["tenant"]: t for t in report["tenants"]}
    assert set(tenants) == {"alice", "bob"}
    assert tenants["alice"]["chunks"] == 3 and tenants["bob"]["chunks"] == 5
    assert tenants["alice"]["quota_bytes"] == 16 * 1024**2
    assert tenants["alice"]["capacity_bytes"] == 64 * 1024**2
    assert tenants["alice"]["hit_rate"] == pytest.approx(3 / 4)
    assert report["tiers"][0]["chunks"] == 8 and report["tiers"][0]["breaker"] == "none"
    assert report["viewer"] == "admin" and report["auth"] is True


def test_tenant_token_sees_only_its_own_figures(server):
    report = status_json(server, ALICE).json()
    assert [t["tenant"] for t in report["tenants"]] == ["alice"]
    assert report["tiers"][0]["chunks"] is None  # the tier's total would reveal bob's
    assert report["viewer"] == "alice"
    assert "bob" not in status_json(server, ALICE).text


def test_store_url_secrets_are_redacted():
    shown = redact("file:///kv?capacity=1GiB -> s3://b/p?access_key=AK&secret_key=hunter2")
    assert shown == "file:///kv?capacity=1GiB -> s3://b/p?access_key=***&secret_key=***"


def test_query_token_sets_a_cookie_for_the_browser(server):
    with httpx.Client(base_url=server.url) as c:
        first = c.get("/status", params={"token": BOB})
        assert first.status_code == 200 and "kvstash_token" in first.headers["set-cookie"]
        again = c.get("/status")  # the cookie alone
        assert again.status_code == 200 and 'data-figure="tenant">bob<' in again.text


def test_admin_token_opens_no_chunks(server):
    r = httpx.get(f"{server.url}/v1/stats", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 403 and "admin token" in r.json()["error"]


def test_metrics_export_tier_health(server):
    text = httpx.get(f"{server.url}/metrics").text
    assert 'kvstash_tier_breaker_open{backend="file",tier="0"} 0.0' in text
    assert re.search(r'kvstash_tier_errors_total\{backend="file",tier="0"\} \d', text)


class Figures(HTMLParser):
    """data-figure name -> text, from a DOM Chromium rendered."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: dict[str, list[str]] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag, attrs):
        self._open.append(dict(attrs).get("data-figure"))

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        if self._open and self._open[-1]:
            self.figures.setdefault(self._open[-1], []).append(data.strip())


def chromium(*args: str) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={profile}", *args],
            capture_output=True, text=True, timeout=120)


def rendered(server: KvServer, token: str) -> dict[str, list[str]]:
    proc = chromium("--dump-dom", f"{server.url}/status?token={token}")
    assert "<html" in proc.stdout, proc.stderr[-2000:]
    parser = Figures()
    parser.feed(proc.stdout)
    return parser.figures


def test_browser_shows_every_figure_to_the_admin(server):
    figures = rendered(server, ADMIN)
    for name in FIGURES:
        assert figures.get(name), f"{name} missing from the page"
    assert figures["tenant"] == ["alice", "bob"]
    assert figures["chunks"] == ["3", "5"]
    assert figures["tenant_hit_rate"][0] == "75.0%"
    assert figures["quota"] == ["16.0 MiB", "16.0 MiB"]
    assert figures["store"][0].startswith("file://")


def test_browser_shows_a_tenant_only_its_own(server):
    figures = rendered(server, ALICE)
    for name in FIGURES:
        assert figures.get(name), f"{name} missing from the page"
    assert figures["tenant"] == ["alice"] and figures["chunks"] == ["3"]
    assert "bob" not in str(figures) and figures["tier_chunks"] == ["—"]


def test_browser_screenshot(server, tmp_path):
    shot = tmp_path / "status.png"
    chromium(f"--screenshot={shot}", "--window-size=1200,900",
             f"{server.url}/status?token={ADMIN}")
    assert shot.stat().st_size > 10_000 and Path(shot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_open_breaker_shows_on_the_page_in_metrics_and_to_the_doctor(tmp_path):
    """An S3 tier whose endpoint refuses connections: after a few failed lookups its
    breaker opens, and the page, /metrics (the alert's gauge) and `kvstash doctor` say so."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    s3 = (f"s3://b/p?endpoint=http://127.0.0.1:{dead}&region=us-east-1&access_key=k"
          "&secret_key=s&retries=1&connect_timeout=0.2&breaker_failures=2&breaker_cooldown=60s")
    with running_kvserver("--store", f"file://{tmp_path}/kv", "--store", s3) as srv:
        for i in range(4):
            httpx.get(f"{srv.url}/v1/chunks/{'0' * 16}/{i:032x}", timeout=10)
        tiers = httpx.get(f"{srv.url}/status.json").json()["tiers"]
        metrics = httpx.get(f"{srv.url}/metrics").text
        page = httpx.get(f"{srv.url}/status").text
        doctor = subprocess.run([sys.executable, "-m", "kvstash.cli", "doctor", "--json",
                                 "--server", srv.url], capture_output=True, text=True,
                                timeout=120)
    assert [t["breaker"] for t in tiers] == ["none", "open"]
    assert 'kvstash_tier_breaker_open{backend="s3",tier="1"} 1.0' in metrics
    assert 'class="open">open<' in page
    assert doctor.returncode == 1
    assert any(f["check"] == "server.breaker" and f["level"] == "unsafe"
               for f in json.loads(doctor.stdout))
