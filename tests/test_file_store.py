"""file:// specifics: layout, atomic publish under crashes and races, capacity, recovery."""

from __future__ import annotations

import errno
import fcntl
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import pytest

from hashing import Namespace
from storage import ConfigError, InvalidChunk, StoreFull, open_store
from storage.codec import decode_chunk, decode_header, encode_chunk
from storage.file import FileStore, VerifiedHeaders, _chunk_path
from storage.ledger import LEDGER, RootLedger
from tests.store_helpers import backdate, make_chunks


async def test_chunks_live_in_a_two_level_hashed_fanout(tmp_path, ns):
    store = FileStore(tmp_path)
    (key, _, blob), = make_chunks(ns, 1)
    await store.put(key, blob)
    ns_id, digest = key.split("/")
    path = tmp_path / ns_id / digest[:2] / digest[2:4] / f"{digest}.kv"
    assert path.read_bytes() == blob
    assert not [p for p in path.parent.iterdir() if p != path]  # no tmp left behind


def test_unwritable_or_bad_roots_fail_at_open_with_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="not a writable directory"):
        open_store(f"file://{blocker}/sub")
    with pytest.raises(ConfigError, match="capacity"):
        open_store(f"file://{tmp_path}?capacity=lots")
    with pytest.raises(ConfigError, match="unknown option"):
        open_store(f"file://{tmp_path}?capacty=1GiB")
    with pytest.raises(ConfigError, match="unknown store scheme"):
        open_store("ftp://host/x")


async def test_capacity_is_never_exceeded_and_survives_reopen(tmp_path):
    rng = random.Random(7)
    capacity = 60_000
    store = FileStore(tmp_path, capacity=capacity)
    ns = Namespace(model="m", dtype="d", layout="l", chunk_tokens=4, salt="cap")
    pool = make_chunks(ns, 40, payload_size=3000)
    for _ in range(300):
        key, _, blob = rng.choice(pool)
        if rng.random() < 0.6:
            await store.put(key, blob)
        else:
            await store.get(key)
        on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
        assert on_disk <= capacity
        assert store.stats()["used_bytes"] == on_disk
    assert store.stats()["evictions"] > 0
    reopened = FileStore(tmp_path, capacity=capacity)
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    assert reopened.stats()["used_bytes"] == on_disk <= capacity
    assert reopened.stats()["chunks"] == len(list(tmp_path.rglob("*.kv")))


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_bad_payload_is_refused_after_the_write_and_neither_lands_nor_evicts(
        tmp_path, ns, monkeypatch, overlap):
    # The payload hash runs after the write (for large chunks, while the tmp file syncs): a
    # mismatch must still publish nothing, leave no tmp file and evict nothing, also on a
    # full store and with fsync off.
    import storage.file as file_mod

    monkeypatch.setattr(file_mod, "OVERLAP_MIN", 0 if overlap else 1 << 40)
    chunks = make_chunks(ns, 4, payload_size=5000)
    size = len(chunks[0][2])
    for fsync in (True, False):
        root = tmp_path / f"fsync-{fsync}"
        store = FileStore(root, capacity=3 * size, fsync=fsync)
        for k, _, b in chunks[:3]:
            assert await store.put(k, b)
        key, _, blob = chunks[3]
        bad = bytearray(blob)
        bad[-1] ^= 0x40
        with pytest.raises(InvalidChunk, match="checksum"):
            await store.put(key, bytes(bad))
        assert await store.exists([c[0] for c in chunks]) == [True, True, True, False]
        assert sorted(p.name for p in root.rglob("*") if p.is_file() and p.name != LEDGER) == sorted(
            _chunk_path(root, k).name for k, _, _ in chunks[:3])
        assert store.stats()["evictions"] == 0
        bad0 = bytearray(chunks[0][2])
        bad0[-1] ^= 0x40
        with pytest.raises(InvalidChunk, match="checksum"):  # an existing key is still checked
            await store.put(chunks[0][0], bytes(bad0))
        assert await store.put(key, blob)  # the good one lands, evicting one
        assert store.stats()["evictions"] == 1


async def test_eviction_order_follows_use_across_a_restart(tmp_path, ns):
    chunks = make_chunks(ns, 3, payload_size=1000)
    size = len(chunks[0][2])
    store = FileStore(tmp_path, capacity=3 * size)
    for i, (k, _, b) in enumerate(chunks):
        await store.put(k, b)
        past = time.time() - 1000 + i * 100
        os.utime(_chunk_path(tmp_path, k), (past, past))
    # chunk 0 is the oldest on disk, but is used now: after a restart chunk 1 goes first
    await store.get(chunks[0][0])
    reopened = FileStore(tmp_path, capacity=3 * size)
    (k_new, _, b_new), = make_chunks(ns, 1, payload_size=1000, seed=99)
    await reopened.put(k_new, b_new)
    assert await reopened.exists([c[0] for c in chunks]) == [True, False, True]


async def test_stale_tmp_files_are_cleaned_at_open_but_fresh_ones_kept(tmp_path, ns):
    store = FileStore(tmp_path)
    (key, _, blob), = make_chunks(ns, 1)
    await store.put(key, blob)
    d = _chunk_path(tmp_path, key).parent
    tmp = f".{key.split('/')[1]}.kv.tmp.another-host"
    stale, fresh = d / f"{tmp}.1.aa", d / f"{tmp}.2.bb"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    FileStore(tmp_path)
    assert not stale.exists() and fresh.exists()
    assert [k async for k in store.list_keys()] == [key]


async def test_a_file_evicted_by_a_peer_mid_read_is_a_miss(tmp_path, ns, monkeypatch):
    """ESTALE is what an NFS client returns when another host removed the file; no NFS
    client runs here, so the error is injected at os.open."""
    store = FileStore(tmp_path)
    (key, _, blob), = make_chunks(ns, 1)
    await store.put(key, blob)
    _chunk_path(tmp_path, key).unlink()
    assert await store.get(key) is None
    await store.put(key, blob)
    real_open = os.open

    def stale_open(path, flags, *a):
        if str(path).endswith(".kv") and not flags & os.O_WRONLY:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", stale_open)
    assert await store.get(key) is None
    assert await store.get_into(key, bytearray(5000)) is None
    assert store.stats()["errors"] == 0


async def test_corrupt_files_are_misses_and_quarantined(tmp_path, ns):
    store = FileStore(tmp_path)
    chunks = make_chunks(ns, 3)
    for k, _, b in chunks:
        await store.put(k, b)
    paths = [_chunk_path(tmp_path, k) for k, _, _ in chunks]
    data = bytearray(paths[0].read_bytes())
    data[-1] ^= 0xFF
    paths[0].write_bytes(data)
    paths[1].write_bytes(paths[1].read_bytes()[:5000])
    paths[2].write_bytes(chunks[0][2])  # a valid chunk, for another key
    for k, _, _ in chunks:
        assert await store.get(k) is None
    assert store.stats()["corrupt"] == 3
    assert not any(p.exists() for p in paths)
    assert len(list((tmp_path / ".quarantine").iterdir())) == 3


async def test_full_disk_is_a_typed_error_with_nothing_half_written(tmp_path, ns, monkeypatch):
    """ENOSPC is injected at os.write (a real full filesystem is exercised by the
    reliability suite, which mounts a small tmpfs)."""
    store = FileStore(tmp_path)
    (key, _, blob), = make_chunks(ns, 1)
    real_write = os.write

    def full_write(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_write)
    with pytest.raises(StoreFull):
        await store.put(key, blob)
    monkeypatch.setattr(os, "write", real_write)
    assert await store.exists([key]) == [False]
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    assert store.stats()["put_errors"] == 1


WRITER = textwrap.dedent("""
    import asyncio, os, sys
    from hashing import Namespace, chunk_keys
    from storage.codec import encode_chunk
    from storage.file import FileStore

    async def main(root, mode):
        store = FileStore(root)
        ns = Namespace(model="crash", dtype="u8", layout="l", chunk_tokens=4)
        if mode == "same":
            tokens = [1, 2, 3, 4]
            key = chunk_keys(tokens, ns)[0]
            blob = encode_chunk(key, tokens, bytes(range(256)) * 40000)
            print(await store.put(key, blob), flush=True)
            return
        payload = os.urandom(64 << 20)
        i = 0
        while True:
            tokens = [i, i, i, i]
            key = chunk_keys(tokens, ns)[0]
            await store.put(key, encode_chunk(key, tokens, payload))
            i += 1

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


def _spawn(root, mode):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), mode],
                            stdout=subprocess.PIPE, text=True)


async def test_a_writer_killed_mid_put_leaves_no_visible_partial_chunk(tmp_path):
    for delay in (0.3, 0.8, 1.5):
        proc = _spawn(tmp_path, "loop")
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = FileStore(tmp_path, tmp_grace_s=0)  # reopen, as after a crash
    keys = [k async for k in store.list_keys()]
    for key in keys:
        blob = _chunk_path(tmp_path, key).read_bytes()
        assert decode_chunk(blob, key).key == key  # every visible chunk verifies
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".kv")]
    assert leftovers == []


def test_eight_concurrent_writers_of_one_key_leave_one_valid_chunk(tmp_path):
    procs = [_spawn(tmp_path, "same") for _ in range(8)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs.count("True") == 1 and outs.count("False") == 7
    files = list(tmp_path.rglob("*.kv"))
    assert len(files) == 1
    assert not [p for p in tmp_path.rglob(".*tmp*")]
    key = f"{files[0].parent.parent.parent.name}/{files[0].stem}"
    decode_chunk(files[0].read_bytes(), key)


async def test_a_chunk_changed_after_it_was_verified_is_checked_again(tmp_path, ns):
    """Re-reads of an unchanged file skip the payload hash; any rewrite must not."""
    store = FileStore(tmp_path, settle_s=0)  # verifications remembered at once
    (key, _, blob), = make_chunks(ns, 1, payload_size=4096)
    await store.put(key, blob)
    path = _chunk_path(tmp_path, key)
    backdate(path)  # so the write below shows in the file's identity
    assert bytes(await store.get(key)) == blob
    assert store.known_header(key, os.stat(path)) is not None
    with open(path, "r+b") as f:  # flip one payload byte in place: same inode, same size
        f.seek(len(blob) - 10)
        f.write(bytes([blob[-10] ^ 0x40]))
    assert await store.get_into(key, bytearray(4096)) is None
    assert store.stats()["corrupt"] == 1


@pytest.mark.parametrize("settle", ["3600s", "0"])
async def test_a_verification_is_remembered_only_once_the_file_has_settled(tmp_path, ns, settle):
    """A file changed within `settle` of its verification could keep its ctime on a
    filesystem with coarse timestamps: its verification is not remembered until then."""
    store = open_store(f"file://{tmp_path}?settle={settle}")
    assert store.settle_s == (3600.0 if settle == "3600s" else 0.0)
    (key, _, blob), = make_chunks(ns, 1, payload_size=4096)
    await store.put(key, blob)
    assert bytes(await store.get(key)) == blob
    known = store.known_header(key, os.stat(store.chunk_path(key)))
    assert (known is not None) == (settle == "0")
    assert store.scoped("t").settle_s == store.settle_s


async def test_verify_always_hashes_every_read(tmp_path, ns):
    store = open_store(f"file://{tmp_path}?verify=always")
    (key, _, blob), = make_chunks(ns, 1)
    await store.put(key, blob)
    assert bytes(await store.get(key)) == blob
    assert len(store._verified) == 0
    with pytest.raises(ConfigError, match="verify"):
        open_store(f"file://{tmp_path}?verify=sometimes")


async def test_cancelled_batch_read_writes_no_further_buffer(tmp_path, ns):
    """Once get_into_many is cancelled (a load's deadline passed) no new read starts, so
    staging buffers the engine takes back are not written into later."""
    import asyncio
    import threading

    store = FileStore(tmp_path)
    chunks = make_chunks(ns, 4, payload_size=4096)
    for key, _, blob in chunks:
        await store.put(key, blob)
    bufs = [bytearray(4096) for _ in chunks]
    first_landed, release = threading.Event(), threading.Event()

    def on_done(i, header):
        first_landed.set()
        release.wait(5)

    task = asyncio.create_task(store.get_into_many(
        [k for k, _, _ in chunks], bufs, max_in_flight=1, on_done=on_done))
    await asyncio.to_thread(first_landed.wait, 5)
    task.cancel()
    await asyncio.sleep(0.05)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    assert bytes(bufs[0]) == chunks[0][2][-4096:]
    assert all(bytes(b) == bytes(4096) for b in bufs[1:])
    assert store.stats()["gets"] == 1


@pytest.mark.parametrize("verify", ["changed", "header", "always"])
async def test_open_blob_hands_over_a_file_only_when_it_needs_no_reading(tmp_path, ns, verify):
    from storage.base import BlobFile
    from storage.tiered import TieredStore
    store = FileStore(tmp_path, verify=verify, settle_s=0)  # trust a verified file at once
    (key, _, blob), (absent, _, _) = make_chunks(ns, 2, payload_size=10_000)
    await store.put(key, blob)
    buf = bytearray(len(blob))
    got = await store.open_blob(key, buf)
    if verify == "header":  # the header is all this policy ever checks
        assert isinstance(got, BlobFile)
    else:  # read (and under `changed`, verified and remembered) like get_blob_into
        assert bytes(got) == blob
        got = await store.open_blob(key, buf)
        assert isinstance(got, BlobFile) == (verify == "changed")
    if isinstance(got, BlobFile):
        with got:
            assert got.size == len(blob) and os.pread(got.fileno(), got.size + 1, 0) == blob
        assert got.fileno() == -1
    assert await store.open_blob(absent, buf) is None
    assert store.counters["hits"] == (2 if verify != "header" else 1)
    assert store.counters["misses"] == 1

    # A tier list hands over its first tier's file and reads lower tiers as get() does.
    lower = FileStore(tmp_path / "lower", verify=verify, settle_s=0)
    (low_key, _, low_blob), = make_chunks(ns, 1, payload_size=5000, seed=3)
    await lower.put(low_key, low_blob)
    tiers = TieredStore([store, lower])
    first = await tiers.open_blob(key, buf)
    assert isinstance(first, BlobFile) if verify != "always" else bytes(first) == blob
    if isinstance(first, BlobFile):
        first.close()
    assert bytes(await tiers.open_blob(low_key, buf)) == low_blob
    assert await tiers.open_blob(absent, buf) is None
    assert (tiers.counters["hits"], tiers.counters["misses"]) == (2, 1)


def test_verified_headers_are_bounded_in_bytes_not_entries(ns):
    """Each header is charged its cost (`ChunkHeader.cost`): many small ones or a few
    expensive ones, the cache holds at most its bound; one too dear is not kept."""
    cache = VerifiedHeaders(max_bytes=1 << 20)
    heavy = {"text": ["ab"] * 300}  # ~50 KiB charged: a twentieth of the bound
    for i, (key, _, _) in enumerate(make_chunks(ns, 200)):
        header = decode_header(encode_chunk(key, list(range(16)), b"0", heavy if i % 2 else None))
        cache.put("root", key, (i, 0, 0, 0), header)
        assert cache.bytes <= cache.max_bytes
        assert cache.get("root", key, (i, 0, 0, 0)) is (header if header.cost <= (1 << 16) else None)
    assert 0 < len(cache) < 200


def _plant_chunk_names(root, ns_id: str, n: int) -> set[str]:
    """`n` empty files named as chunks of one fan-out directory (a listing reads names only)."""
    leaf = root / ns_id / "00" / "00"
    leaf.mkdir(parents=True)
    keys = set()
    for i in range(n):
        digest = f"0000{i:028x}"
        (leaf / f"{digest}.kv").touch()
        keys.add(f"{ns_id}/{digest}")
    return keys


async def test_a_listing_streams_from_the_directory_walk_in_memory_independent_of_its_length(
        tmp_path):
    """`list_keys` of 40,000 keys holds one batch at a time, not the listing (~150 bytes a
    key): the peak memory of consuming it is far below what the keys themselves take."""
    store = FileStore(tmp_path / "store")
    expected = _plant_chunk_names(store.root, "0123456789abcdef", 40_000)
    tracemalloc.start()
    try:
        seen = 0
        async for key in store.list_keys():
            assert key in expected
            seen += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == len(expected)
    assert peak < 1 << 20, f"a listing of {seen} keys peaked at {peak} bytes"


async def test_a_listing_abandoned_midway_closes_its_directories(tmp_path):
    store = FileStore(tmp_path / "store")
    _plant_chunk_names(store.root, "0123456789abcdef", 3000)
    before = len(os.listdir("/proc/self/fd"))
    listing = store.list_keys()
    async for _ in listing:
        break
    await listing.aclose()
    assert len(os.listdir("/proc/self/fd")) == before


async def test_a_torn_or_stale_usage_count_is_counted_anew_from_the_root(tmp_path, ns):
    """The root's shared byte count (`.usage`) may be torn by a crash or left wrong by a
    writer that died mid-put: a store opened there counts the root again, tenants too."""
    chunks = make_chunks(ns, 4, payload_size=5000)
    size = len(chunks[0][2])
    store = FileStore(tmp_path, capacity=10 * size)
    await store.put(*chunks[0][::2])
    await store.scoped("alice").put(*chunks[1][::2])
    for junk in (b'{"": 9999999', b'{"": 123456789}'):
        (tmp_path / LEDGER).write_bytes(junk)
        reopened = FileStore(tmp_path, capacity=10 * size)
        assert reopened.stats()["root_used_bytes"] == 2 * size
    alice = reopened.scoped("alice")
    for key, _, blob in chunks[2:]:
        assert await alice.put(key, blob)
    assert reopened.root_usage()["used_bytes"] == 4 * size == reopened.stats()["root_used_bytes"]


def _hold_the_usage_lock(ledger, held, release) -> None:
    with ledger.locked():
        held.set()
        release.wait(30)


def test_a_forked_child_takes_the_usage_lock_for_itself(tmp_path):
    """flock belongs to an open file, which a forked child shares with its parent: the
    child reopens the usage file, so its lock excludes the parent's too."""
    ledger = RootLedger(tmp_path)
    ctx = multiprocessing.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_the_usage_lock, args=(ledger, held, release))
    child.start()
    try:
        assert held.wait(30)
        with pytest.raises(BlockingIOError):
            fcntl.flock(ledger._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        release.set()
        child.join(30)
    fcntl.flock(ledger._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(ledger._fd, fcntl.LOCK_UN)
