"""A file:// root under attack by its own tenants and shared by several servers: chunks
verified whole at PUT, quarantine bounded, memory bounded by what a tenant stores, one
capacity across every process and tenant, and fair eviction on a full disk. Real
`kvstash serve` processes and real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from bench.faults import chunk_for, corrupt_file
from storage import codec
from storage.codec import encode_header
from storage.file import QUARANTINE, FileStore, _chunk_path
from storage.ledger import LEDGER
from tests.kvserver_fixtures import running_kvserver
from tests.reliability_fixtures import small_fs_fixture  # noqa: F401
from tests.store_helpers import forged_segment_chunk, make_chunks

SEED = 50


def _bytes_under(path: Path) -> int:
    """Sizes of the regular files under `path`, as `du --apparent-size` counts them, less
    the root's few bytes of usage count (storage.ledger)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            if name == LEDGER:
                continue
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


def test_kvserver_refuses_a_chunk_whose_segment_checksum_contradicts_its_payload(tmp_path, ns):
    key, _, forged = forged_segment_chunk(ns)
    with running_kvserver("--store", f"file://{tmp_path}/store?capacity=8MiB") as server:
        url = f"{server.url}/v1/chunks/{key}"
        put = httpx.put(url, content=forged, headers={"content-type": "application/octet-stream"})
        assert put.status_code == 400, put.text
        assert "segment 1" in put.json()["error"]
        assert httpx.get(url).status_code == 404
    assert not list((tmp_path / "store").glob("*/*/*/*.kv"))


async def test_quarantine_stays_within_its_bound_when_chunks_are_quarantined_again_and_again(
        tmp_path):
    """A reader that rejects a chunk on every read while its writer puts it again: each
    round moves one file to `.quarantine/`, which keeps only the newest up to its bound
    and counts against the capacity."""
    capacity = 8 << 20
    store = FileStore(tmp_path / "store", capacity)
    bound = store.quarantine_max
    rng = np.random.default_rng(SEED)
    assert bound == capacity // 16
    for i in range(40):
        key, blob = chunk_for(SEED, i % 4, size=200 * 1024)
        assert await store.put(key, blob) is True
        corrupt_file(_chunk_path(store.root, key), "flip_payload", rng, b"")
        assert await store.get(key) is None
        held = _bytes_under(store.root / QUARANTINE)
        assert held <= bound, f"round {i}: .quarantine holds {held} bytes, bound {bound}"
    stats = store.stats()
    assert stats["corrupt"] == 40
    assert stats["quarantine_bytes"] == _bytes_under(store.root / QUARANTINE) > 0
    assert stats["quarantined_files"] == len(os.listdir(store.root / QUARANTINE))
    assert stats["used_bytes"] == _bytes_under(store.root) <= capacity
    # A reopened store counts what is there.
    assert FileStore(tmp_path / "store", capacity).stats()["quarantine_bytes"] == stats["quarantine_bytes"]


def _chunk_with_meta(ns, i: int, meta: dict) -> tuple[str, bytes]:
    (key, tokens, _), = make_chunks(ns, 1, seed=1000 + i)
    payload = os.urandom(4096)
    return key, encode_header(key, tokens, payload, meta) + payload


def _settled_rss(server) -> int:
    """The server's RSS once two samples 0.2 s apart agree within 1 MiB (at most 5 s)."""
    last = server.rss_bytes()
    for _ in range(25):
        time.sleep(0.2)
        now = server.rss_bytes()
        if abs(now - last) < 1 << 20:
            return now
        last = now
    return last


def test_headers_that_parse_into_much_memory_leave_the_servers_memory_where_it_was(
        tmp_path, ns, monkeypatch):
    """A tenant PUTs 60 chunks whose 250 KiB header meta is ~80,000 empty JSON objects
    (~6 MiB each once parsed) and GETs each twice; then 60 chunks at the meta limits. The
    server's RSS once the attack stops stays within 10 % (or 32 MiB) of its baseline."""
    attack = {"pad": [{}] * 83_000}
    with monkeypatch.context() as m:  # as a forger would: the encoder refuses such a meta
        m.setattr(codec, "_check_meta_size", lambda raw: None, raising=False)
        hostile = [_chunk_with_meta(ns, i, attack) for i in range(60)]
    assert all(len(blob) < codec.MAX_HEADER_SIZE + 8192 for _, blob in hostile)
    widest = {"pad": [{"k": i} for i in range(1021)],  # 1,024 objects and arrays in all
              "text": ["ab"] * 5000}
    allowed = [_chunk_with_meta(ns, 100 + i, widest) for i in range(60)]
    headers = {"content-type": "application/octet-stream"}
    # settle=0: the store keeps each verified header from its first GET on, so the second
    # GET of each chunk below is served from what it keeps.
    with running_kvserver("--store", f"file://{tmp_path}/store?settle=0") as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        for i in range(20):  # warm the code paths up first
            key, _, blob = make_chunks(ns, 1, seed=i)[0]
            assert client.put(f"/v1/chunks/{key}", content=blob, headers=headers).status_code == 201
            assert client.get(f"/v1/chunks/{key}").status_code == 200
        baseline = _settled_rss(server)
        for chunks in (hostile, allowed):
            for key, blob in chunks:
                put = client.put(f"/v1/chunks/{key}", content=blob, headers=headers)
                assert put.status_code in ((201, 400) if chunks is hostile else (201,)), put.text
            for key, blob in chunks:
                for _ in range(2):
                    got = client.get(f"/v1/chunks/{key}")
                    if chunks is allowed:
                        assert got.status_code == 200 and got.content == blob
        after = _settled_rss(server)
    assert after <= max(baseline * 1.10, baseline + (32 << 20)), (
        f"RSS {baseline >> 20} MiB before the attack, {after >> 20} MiB after")


def _peak_rss(server) -> int:
    with open(f"/proc/{server.pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM line")


def test_concurrent_listings_of_a_large_file_store_do_not_raise_the_servers_peak_memory(tmp_path):
    """Four clients list 50,000 keys at once: the store streams each listing from the
    directory walk, so the server's peak RSS stays where opening the store put it."""
    leaf = tmp_path / "store" / "0123456789abcdef" / "00" / "00"
    leaf.mkdir(parents=True)
    for i in range(50_000):  # names only: a listing reads no chunk
        os.close(os.open(leaf / f"0000{i:028x}.kv", os.O_CREAT | os.O_WRONLY, 0o600))
    with running_kvserver("--store", f"file://{tmp_path}/store") as server:
        before = _peak_rss(server)
        counts: list[int] = []

        def list_all() -> None:
            with httpx.stream("GET", f"{server.url}/v1/keys", timeout=120) as resp:
                counts.append(sum(part.count(b"\n") for part in resp.iter_bytes()))

        listers = [threading.Thread(target=list_all) for _ in range(4)]
        for t in listers:
            t.start()
        for t in listers:
            t.join(timeout=120)
        after = _peak_rss(server)
    assert counts == [50_000] * 4
    assert after - before < 16 << 20, f"peak RSS {before >> 20} -> {after >> 20} MiB"


TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef-xyz"}
OCTETS = {"content-type": "application/octet-stream"}
MiB = 1 << 20


def _tokens_file(tmp: Path) -> Path:
    path = tmp / "tokens"
    path.write_text("".join(f"{t} {tok}\n" for t, tok in TOKENS.items()))
    path.chmod(0o600)
    return path


def _du(path: Path) -> int:
    """Bytes of the regular files under `path` as `du --apparent-size` counts them: a file
    linked twice (a chunk being published) once; the usage count itself not at all."""
    seen, total = set(), 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            if name == LEDGER:
                continue
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _kvstash(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kvstash.cli", *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_two_servers_with_tenants_on_one_root_hold_one_capacity_under_concurrent_writers(
        tmp_path, ns):
    """Two `kvstash serve` processes with tenants on one file:// root with capacity=4MiB;
    alice and bob write through both at once. The root's bytes, sampled all along, never
    pass the capacity plus one chunk; then `kvstash stat` and `kvstash gc` see every
    tenant's directory and agree with a du of the root."""
    root = tmp_path / "store"
    capacity, chunk = 4 * MiB, 256 * 1024
    url = f"file://{root}?capacity=4MiB"
    tokens = str(_tokens_file(tmp_path))
    with running_kvserver("--store", url, "--auth-tokens", tokens) as one, \
            running_kvserver("--store", url, "--auth-tokens", tokens) as two:
        done = threading.Event()
        samples: list[int] = []
        statuses: list[int] = []

        def sample() -> None:
            while not done.is_set() and len(samples) < 100_000:
                samples.append(_du(root))

        def write(server, tenant: str, seed: int) -> None:
            headers = {**OCTETS, "Authorization": f"Bearer {TOKENS[tenant]}"}
            with httpx.Client(base_url=server.url, timeout=60) as client:
                for key, _, blob in make_chunks(ns, 24, payload_size=chunk - 4096, seed=seed):
                    statuses.append(client.put(f"/v1/chunks/{key}", content=blob,
                                               headers=headers).status_code)

        sampler = threading.Thread(target=sample)
        writers = [threading.Thread(target=write, args=(server, tenant, seed))
                   for seed, (server, tenant) in enumerate(
                       [(one, "alice"), (two, "alice"), (one, "bob"), (two, "bob")])]
        sampler.start()
        for t in writers:
            t.start()
        for t in writers:
            t.join(timeout=300)
        done.set()
        sampler.join(timeout=60)
        assert statuses == [201] * 96
        samples.append(_du(root))
        assert max(samples) <= capacity + chunk, (
            f"the root held {max(samples)} bytes at most, capacity {capacity}")

    stat = json.loads(_kvstash("stat", "--store", f"file://{root}", "--json"))
    whole = stat["whole_root"]
    assert whole["used_bytes"] == _du(root)
    assert set(whole["tenants"]) == {"alice", "bob"}
    assert whole["chunks"] == len(list(root.glob("tenants/*/*/*/*/*.kv"))) > 0
    result = json.loads(_kvstash("gc", "--store", f"file://{root}", "--capacity", "2MiB"))
    assert result["evicted"] > 0 and result["used_bytes"] == _du(root) <= 2 * MiB
    assert result["chunks"] == len(list(root.glob("tenants/*/*/*/*/*.kv")))


def test_a_full_disk_takes_room_from_the_largest_tenant_not_the_writer(small_fs: Path, ns):
    """No capacity= and an 8 MiB disk (tmpfs, root only): alice fills it, then bob writes.
    Every PUT of bob's that answered 201 is readable afterwards, and alice shrank: room
    came from the tenant holding the most bytes, not from the writer's own chunks."""
    chunk = 512 * 1024
    with running_kvserver("--store", f"file://{small_fs}/store",
                          "--auth-tokens", str(_tokens_file(small_fs.parent))) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        def put(tenant: str, key: str, blob: bytes) -> int:
            return client.put(f"/v1/chunks/{key}", content=blob, headers={
                **OCTETS, "Authorization": f"Bearer {TOKENS[tenant]}"}).status_code

        def held(tenant: str) -> int:
            return client.get("/v1/stats", headers={
                "Authorization": f"Bearer {TOKENS[tenant]}"}).json()["used_bytes"]

        alice = [put("alice", key, blob)
                 for key, _, blob in make_chunks(ns, 16, payload_size=chunk - 4096, seed=1)]
        assert alice.count(201) >= 10 and set(alice) <= {201, 507}
        alice_before = held("alice")
        bob = make_chunks(ns, 6, payload_size=chunk - 4096, seed=2)
        stored = [(key, blob) for key, _, blob in bob if put("bob", key, blob) == 201]
        assert len(stored) == len(bob)
        for key, blob in stored:
            got = client.get(f"/v1/chunks/{key}",
                             headers={"Authorization": f"Bearer {TOKENS['bob']}"})
            assert got.status_code == 200 and got.content == blob, f"bob's {key} was lost"
        assert held("bob") == len(bob) * chunk
        assert held("alice") < alice_before


def test_a_tenants_stats_show_nothing_of_the_other_tenants_bytes(tmp_path, ns):
    """The root's shared count is the operator's: a tenant's /v1/stats carries its own
    bytes and the capacity, not what the root holds in all (which would show how much the
    others store)."""
    url = f"file://{tmp_path}/store?capacity=64MiB"
    with running_kvserver("--store", url, "--auth-tokens", str(_tokens_file(tmp_path))) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        stored = {}
        for seed, tenant in enumerate(TOKENS):
            for key, _, blob in make_chunks(ns, 2 + 3 * seed, payload_size=60_000, seed=seed):
                assert client.put(f"/v1/chunks/{key}", content=blob, headers={
                    **OCTETS, "Authorization": f"Bearer {TOKENS[tenant]}"}).status_code == 201
                stored[tenant] = stored.get(tenant, 0) + len(blob)
        alice = client.get("/v1/stats", headers={"Authorization": f"Bearer {TOKENS['alice']}"}).json()
    assert alice["used_bytes"] == stored["alice"]
    assert "root_used_bytes" not in alice and sum(stored.values()) not in alice.values()
