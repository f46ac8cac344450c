"""GET /v1/keys: a listing streams as its client reads, and only so many run at once.

A real `kvstash serve` over a file store on 127.0.0.1; the listed chunks are empty files
named as chunks (a listing reads names only), on tmpfs where there is one (planting them
on a VM's disk takes ~0.25 ms a file), and the clients that hold a listing open are raw
sockets with a small receive buffer that never read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.kvserver_fixtures import running_kvserver
from tests.test_kvserver_stalls import metric, wait_for

TOKENS = {t: f"{t}-listing-token-0123456789" for t in ("alice", "carol")}
LINE_BYTES = 50  # "<16 hex>/<32 hex>\n"


def keys_past_the_socket_buffers() -> int:
    """Enough keys that a client that never reads stalls its listing: more lines than
    the server's largest TCP send buffer (tcp_wmem's maximum) holds, with room to spare."""
    try:
        wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        wmem_max = 4 << 20
    return wmem_max // LINE_BYTES + 20_000


@pytest.fixture
def fast_dir(tmp_path) -> Iterator[Path]:
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    where = Path(tempfile.mkdtemp(prefix="kvs-listings-", dir=shm))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def plant_chunk_names(scope: Path, n: int) -> set[str]:
    leaf = scope / "0123456789abcdef" / "00" / "00"
    leaf.mkdir(parents=True)
    keys = set()
    for i in range(n):
        digest = f"0000{i:028x}"
        os.close(os.open(leaf / f"{digest}.kv", os.O_CREAT | os.O_WRONLY, 0o600))
        keys.add(f"0123456789abcdef/{digest}")
    return keys


def held_listing(url: str, tenant: str) -> socket.socket:
    """A `GET /v1/keys` whose client never reads: its listing stalls on the full socket."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"GET /v1/keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS[tenant]}"
                 "\r\n\r\n".encode())
    return sock


def listing(url: str, tenant: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/keys", headers={"authorization": f"Bearer {TOKENS[tenant]}"},
                     timeout=60)


def test_listings_past_the_tenant_or_server_limit_get_429_until_one_ends(fast_dir, tmp_path):
    root = fast_dir / "store"
    alice_keys = plant_chunk_names(root / "tenants" / "alice", keys_past_the_socket_buffers())
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t} {tok}\n" for t, tok in TOKENS.items()))
    tokens.chmod(0o600)
    with running_kvserver("--store", f"file://{root}", "--auth-tokens", str(tokens),
                          "--max-tenant-listings", "2", "--max-listings", "2"
                          ) as server, contextlib.ExitStack() as held:
        first = held.enter_context(held_listing(server.url, "alice"))
        held.enter_context(held_listing(server.url, "alice"))
        wait_for(lambda: metric(server.url, "kvstash_listings") == 2, "the listings never ran")
        refused = listing(server.url, "alice")
        assert refused.status_code == 429 and "--max-tenant-listings" in refused.json()["error"]
        refused = listing(server.url, "carol")
        assert refused.status_code == 429 and "--max-listings" in refused.json()["error"]
        assert metric(server.url, "kvstash_listings") == 2  # both still held: no race above
        first.close()  # a client gone midway gives its listing's place back
        wait_for(lambda: metric(server.url, "kvstash_listings") == 1, "a place not returned")
        whole = listing(server.url, "alice")
        assert listing(server.url, "carol").text == ""
    assert whole.status_code == 200 and whole.text.count("\n") == len(alice_keys)
    assert set(whole.text.split()) == alice_keys
