"""Auth and tenancy: tokens map to tenants, and tenants cannot see each other's chunks."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvserver.auth import TokenTable
from storage import ConfigError, open_store
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks

OCTETS = {"content-type": "application/octet-stream"}
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef-xyz"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenancy")
    tokens = tmp / "tokens"
    tokens.write_text(f"# tenant token\nalice {ALICE}\nbob {BOB}  # second tenant\n")
    tokens.chmod(0o600)
    root = tmp / "store"
    with running_kvserver("--store", f"file://{root}", "--auth-tokens", str(tokens)) as server:
        yield server.url, root


def test_missing_token_is_401_and_wrong_token_is_403(tenant_server, ns):
    url, _ = tenant_server
    (key, _, blob), = make_chunks(ns, 1)
    r = httpx.get(f"{url}/v1/chunks/{key}")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {"error": "missing bearer token (Authorization: Bearer <token>)"}
    r = httpx.put(f"{url}/v1/chunks/{key}", content=blob, headers={**OCTETS, **auth("x" * 20)})
    assert r.status_code == 403 and r.json()["error"]
    assert httpx.post(f"{url}/v1/lookup", json={"keys": [key]}).status_code == 401
    assert httpx.get(f"{url}/v1/keys", headers=auth(ALICE[:-1])).status_code == 403
    # Health, readiness and metrics stay open for load balancers and scrapers.
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_tenants_cannot_read_list_or_look_up_each_others_chunks(tenant_server, ns):
    url, root = tenant_server
    chunks = make_chunks(ns, 3)
    keys = [k for k, _, _ in chunks]
    with httpx.Client() as c:
        for key, _, blob in chunks:
            assert c.put(f"{url}/v1/chunks/{key}", content=blob, headers={**OCTETS, **auth(ALICE)}).status_code == 201
        assert c.get(f"{url}/v1/chunks/{keys[0]}", headers=auth(ALICE)).status_code == 200
        assert c.get(f"{url}/v1/chunks/{keys[0]}", headers=auth(BOB)).status_code == 404
        assert c.head(f"{url}/v1/chunks/{keys[0]}", headers=auth(BOB)).status_code == 404
        r = c.post(f"{url}/v1/lookup", json={"keys": keys}, headers=auth(BOB))
        assert r.json()["prefix_len"] == 0
        assert c.post(f"{url}/v1/lookup", json={"keys": keys}, headers=auth(ALICE)).json()["prefix_len"] == 3
        assert set(keys) <= set(c.get(f"{url}/v1/keys", headers=auth(ALICE)).text.split())
        assert not set(keys) & set(c.get(f"{url}/v1/keys", headers=auth(BOB)).text.split())
        assert c.delete(f"{url}/v1/chunks/{keys[0]}", headers=auth(BOB)).status_code == 404
        assert c.get(f"{url}/v1/chunks/{keys[0]}", headers=auth(ALICE)).status_code == 200
        # Bob storing the same key gets his own copy, not a "created: false" that would
        # reveal that Alice has it.
        key, _, blob = chunks[1]
        r = c.put(f"{url}/v1/chunks/{key}", content=blob, headers={**OCTETS, **auth(BOB)})
        assert r.status_code == 201


def test_each_tenant_lives_in_its_own_directory(tenant_server, ns):
    """Separate directories are what keep lookups from time-probing another tenant: Bob's
    presence checks only ever touch paths under tenants/bob."""
    url, root = tenant_server
    (key, _, blob), = make_chunks(ns, 1)
    httpx.put(f"{url}/v1/chunks/{key}", content=blob, headers={**OCTETS, **auth(ALICE)})
    ns_id, digest = key.split("/")
    assert list((root / "tenants" / "alice").rglob(f"{digest}.kv"))
    assert not list((root / "tenants" / "bob").rglob(f"{digest}.kv"))
    assert not list(root.glob(f"{ns_id}/**/{digest}.kv"))


async def test_http_store_with_a_token_sees_only_its_tenant(tenant_server, ns):
    url, _ = tenant_server
    (key, _, blob), = make_chunks(ns, 1)
    alice = open_store(f"{url}?token={ALICE}")
    bob = open_store(f"{url}?token={BOB}")
    try:
        assert await alice.put(key, blob) is True
        assert await alice.get(key) == blob
        assert await bob.get(key) is None
        assert await bob.prefix_len([key]) == 0
        assert ALICE not in str(alice) and "***" in str(alice)
    finally:
        await alice.close()
        await bob.close()


def test_tokens_file_is_validated_at_start(tmp_path: Path):
    cases = {
        "": "no `TENANT TOKEN`",
        "alice short\n": "shorter than",
        "alice\n": "expected `TENANT TOKEN`",
        f"../etc {ALICE}\n": "bad tenant name",
        f"alice {ALICE}\nbob {ALICE}\n": "listed twice",
    }
    for text, message in cases.items():
        path = tmp_path / "tokens"
        path.write_text(text)
        path.chmod(0o600)
        with pytest.raises(ConfigError, match=message):
            TokenTable.from_file(path)
    with pytest.raises(ConfigError, match="cannot read tokens file"):
        TokenTable.from_file(tmp_path / "missing")


def test_several_tokens_may_share_a_tenant(tmp_path: Path):
    table = TokenTable([("alice", ALICE), ("alice", ALICE + "-rotated"), ("bob", BOB)])
    assert table.tenant_for(ALICE) == "alice"
    assert table.tenant_for(ALICE + "-rotated") == "alice"
    assert table.tenant_for(BOB) == "bob"
    assert table.tenant_for("") is None
    assert table.tenants == ["alice", "bob"]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_tokens_file_open_to_group_or_others_is_refused(tmp_path: Path, mode: int):
    path = tmp_path / "tokens"
    path.write_text(f"alice {ALICE}\n")
    path.chmod(mode)
    with pytest.raises(ConfigError, match=rf"open to group or others \(mode 0{mode:o}\): run `chmod 600"):
        TokenTable.from_file(path)


def test_world_readable_tokens_file_stops_the_server_with_one_line(tmp_path: Path):
    path = tmp_path / "tokens"
    path.write_text(f"alice {ALICE}\n")
    path.chmod(0o644)
    with pytest.raises(RuntimeError, match="exit code 2") as info:
        with running_kvserver("--store", "memory://", "--auth-tokens", str(path)):
            pass
    log = str(info.value).split("its log ends with:\n", 1)[1]
    assert log.count("\n") == 1 and "open to group or others (mode 0644)" in log


def test_hash_inside_a_token_is_part_of_the_token(tmp_path: Path):
    path = tmp_path / "tokens"
    path.write_text(f"# comment line\n  # indented comment\nalice {ALICE}#tail\n"
                    f"bob {BOB} # trailing comment, a separate word\n")
    path.chmod(0o600)
    table = TokenTable.from_file(path)
    assert table.tenant_for(ALICE + "#tail") == "alice"
    assert table.tenant_for(ALICE) is None
    assert table.tenant_for(BOB) == "bob"


def test_extra_words_on_a_token_line_are_an_error_naming_the_line(tmp_path: Path):
    path = tmp_path / "tokens"
    path.write_text(f"alice {ALICE} extra\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match=r"tokens:1: expected `TENANT TOKEN`"):
        TokenTable.from_file(path)


def test_a_tenant_sees_its_own_stats_and_not_where_the_store_lives(tmp_path: Path, ns):
    """/v1/stats of a tenant: its own counters and sizes, tier by tier, and no URL, path,
    bucket or endpoint of the store (without tokens the operator sees them all)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    tokens.chmod(0o600)
    root = tmp_path / "store"
    with running_kvserver("--store", "memory://?capacity=64MiB", "--store", f"file://{root}",
                          "--auth-tokens", str(tokens)) as server, httpx.Client() as c:
        for key, _, blob in make_chunks(ns, 2):
            assert c.put(f"{server.url}/v1/chunks/{key}", content=blob,
                         headers={**OCTETS, **auth(ALICE)}).status_code == 201
        alice = c.get(f"{server.url}/v1/stats", headers=auth(ALICE)).json()
        bob = c.get(f"{server.url}/v1/stats", headers=auth(BOB)).json()
    assert (alice["puts"], bob["puts"]) == (2, 0)
    assert [t["backend"] for t in alice["tiers"]] == ["memory", "file"]
    assert alice["tiers"][0]["chunks"] == 2 and bob["tiers"][0]["chunks"] == 0
    for seen in (alice, bob):
        text = str(seen)
        assert str(tmp_path) not in text and "file://" not in text and "memory://" not in text
        assert not {"url", "root"} & {k for s in (seen, *seen["tiers"]) for k in s}


def test_a_tenant_is_never_told_where_the_store_lives(tmp_path: Path, ns):
    """Errors that reach a client behind --auth-tokens (a 507 from the store, /readyz's
    reason) name the store as `the store`, not by its URL or directory."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {ALICE}\n")
    tokens.chmod(0o600)
    root = tmp_path / "store"
    (key, _, blob), = make_chunks(ns, 1, payload_size=2 << 20)
    with running_kvserver("--store", f"file://{root}?capacity=1MiB",
                          "--auth-tokens", str(tokens)) as server:
        full = httpx.put(f"{server.url}/v1/chunks/{key}", content=blob,
                         headers={**OCTETS, **auth(ALICE)})
        root.rename(tmp_path / "gone")
        try:
            unready = httpx.get(f"{server.url}/readyz")
        finally:
            (tmp_path / "gone").rename(root)
    assert full.status_code == 507 and "exceeds capacity" in full.json()["error"]
    assert unready.status_code == 503 and "missing" in unready.json()["error"]
    for said in (full.text, unready.text):
        assert str(tmp_path) not in said and "file://" not in said and "the store" in said
