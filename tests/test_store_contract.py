"""The Store protocol, run unchanged against every backend.

A backend that cannot run here (its fixtures or packages fail to import, or its server
binary is missing) is reported as a skip with the reason, never left out silently.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import secrets

import pytest

from storage import InvalidChunk, InvalidKey, open_store
from storage.codec import ChunkError, decode_chunk
from tests.store_helpers import forged_segment_chunk, make_chunks

# Backends whose test fixtures could not be imported, with the reason (reported as skips).
UNAVAILABLE: dict[str, str] = {}
try:
    from tests.s3_fixtures import moto_s3_url, seaweed_s3_url  # noqa: F401
except ImportError as exc:
    UNAVAILABLE["moto"] = UNAVAILABLE["seaweedfs"] = f"S3 test fixtures do not import: {exc}"
try:
    from tests.kvserver_fixtures import kvserver_unix_url, kvserver_url  # noqa: F401
except ImportError as exc:
    UNAVAILABLE["http"] = UNAVAILABLE["http-unix"] = f"kvserver test fixtures do not import: {exc}"

BACKENDS = ["memory", "file", "tiered", "fsspec-memory", "fsspec-file",
            "moto", "seaweedfs", "http", "http-unix"]
# The module each backend needs beyond the core (its optional packages come with it).
BACKEND_MODULES = {"fsspec-memory": "storage.fsspec_store", "fsspec-file": "storage.fsspec_store",
                   "moto": "storage.s3", "seaweedfs": "storage.s3",
                   "http": "storage.http", "http-unix": "storage.http"}


def _open(kind: str, request, tmp_path):
    if kind == "memory":
        return open_store("memory://?capacity=64MiB")
    if kind == "file":
        return open_store(f"file://{tmp_path}/store")
    if kind == "tiered":
        return open_store(["memory://?capacity=64MiB", f"file://{tmp_path}/tier2"])
    if kind == "fsspec-memory":
        return open_store(f"fsspec+memory://kv-{secrets.token_hex(6)}")
    if kind == "fsspec-file":
        return open_store(f"fsspec+file://{tmp_path}/fsspec?auto_mkdir=true")
    fixture = {"moto": "moto_s3_url", "seaweedfs": "seaweed_s3_url",
               "http": "kvserver_url", "http-unix": "kvserver_unix_url"}[kind]
    return open_store(request.getfixturevalue(fixture))


@pytest.fixture(params=BACKENDS)
async def store(request, tmp_path):
    kind = request.param
    if kind in UNAVAILABLE:
        pytest.skip(f"{kind}: {UNAVAILABLE[kind]}")
    try:
        importlib.import_module(BACKEND_MODULES.get(kind, "storage"))
    except ImportError as exc:  # a backend's optional package is missing or broken
        pytest.skip(f"{kind}: {BACKEND_MODULES[kind]} does not import: {exc}")
    s = _open(kind, request, tmp_path)
    yield s
    await s.close()


async def test_put_is_create_only(store, ns):
    (key, _, blob), = make_chunks(ns, 1)
    assert await store.put(key, blob) is True
    assert await store.put(key, blob) is False


async def test_get_returns_the_verified_blob_or_none(store, ns):
    (key, tokens, blob), (absent, _, _) = make_chunks(ns, 2)
    await store.put(key, blob)
    got = await store.get(key)
    assert bytes(got) == blob
    assert list(decode_chunk(got, key, tokens).token_ids) == tokens
    assert await store.get(absent) is None


async def test_get_into_fills_the_callers_buffer(store, ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=5000)
    await store.put(key, blob)
    buf = bytearray(6000)
    header = await store.get_into(key, buf)
    assert header is not None and header.key == key
    assert bytes(buf[: header.payload_len]) == blob[header.header_len :]
    assert await store.get_into(key, bytearray(10)) is None


async def test_get_into_many_fills_each_buffer_and_reports_each_read(store, ns):
    chunks = make_chunks(ns, 5, payload_size=3000)
    for key, _, blob in chunks[:4]:
        await store.put(key, blob)
    keys = [k for k, _, _ in chunks]
    keys[2], keys[4] = keys[4], keys[2]  # the missing key sits in the middle
    bufs = [bytearray(3000) for _ in keys]
    seen = []
    got = await store.get_into_many(keys, bufs, max_in_flight=2, on_done=lambda i, h: seen.append(i))
    assert [h is not None for h in got] == [True, True, False, True, True]
    assert sorted(seen) == [0, 1, 2, 3, 4]
    blobs = {k: b for k, _, b in chunks}
    for key, header, buf in zip(keys, got, bufs, strict=True):
        if header is not None:
            assert header.key == key and bytes(buf) == blobs[key][header.header_len :]
    with pytest.raises(ValueError, match="destination"):
        await store.get_into_many(keys, bufs[:2])


async def test_get_into_many_starts_no_read_after_on_done_says_stop(store, ns):
    chunks = make_chunks(ns, 6, payload_size=2000)
    for key, _, blob in chunks[:2] + chunks[3:]:
        await store.put(key, blob)  # chunk 2 is missing
    bufs = [bytearray(2000) for _ in chunks]
    got = await store.get_into_many(
        [k for k, _, _ in chunks], bufs, max_in_flight=1, on_done=lambda i, h: h is not None)
    assert [h is not None for h in got] == [True, True, False, False, False, False]
    assert bytes(bufs[3]) == bytes(2000)  # never read into


async def test_put_rejects_a_blob_that_is_not_a_chunk_for_that_key(store, ns):
    (k0, _, b0), (k1, _, _) = make_chunks(ns, 2)
    for bad in (b0[:-1], b"garbage" * 1000, b0[:100]):
        with pytest.raises(InvalidChunk):
            await store.put(k0, bad)
    with pytest.raises(InvalidChunk):
        await store.put(k1, b0)  # a valid chunk, but for another key
    assert await store.exists([k0, k1]) == [False, False]


async def test_put_rejects_a_chunk_whose_segment_checksum_contradicts_its_payload(store, ns):
    """The whole-payload checksum holds; one segment's does not. Stored, whole reads would
    hit while segment readers reject it for good (an honest re-put is `created: false`)."""
    key, _, forged = forged_segment_chunk(ns)
    with pytest.raises(ChunkError):
        decode_chunk(forged, key).header.verify_segment(1, forged[4096 + 2048 :])
    with pytest.raises(InvalidChunk, match="segment 1"):
        await store.put(key, forged)
    assert await store.exists([key]) == [False]


@pytest.mark.parametrize("bad_key", ["../../etc/passwd", "abc", "0" * 16 + "/" + "g" * 32,
                                     "0" * 16 + "/" + "0" * 31 + "\n", ""])
async def test_malformed_keys_are_refused(store, bad_key):
    with pytest.raises(InvalidKey):
        await store.get(bad_key)
    with pytest.raises(InvalidKey):
        await store.exists([bad_key])


@pytest.mark.parametrize("tail", ["\n", "\r\n", "\x00", "\t", " "])
async def test_a_key_with_a_trailing_control_character_is_refused_by_every_call(store, ns, tail):
    """A valid key plus a final newline once passed the key pattern (`$` matches before a
    final newline): a file store then wrote a chunk that no listing, gc or scan saw."""
    (key, tokens, blob), = make_chunks(ns, 1)
    bad = key + tail
    with pytest.raises(InvalidKey):
        await store.put(bad, blob)
    with pytest.raises(InvalidKey):
        await store.get(bad)
    with pytest.raises(InvalidKey):
        await store.exists([bad])
    with pytest.raises(InvalidKey):
        await store.delete(bad)
    assert [k async for k in store.list_keys() if k.startswith(ns.id)] == []
    assert await store.put(key, blob) is True


@pytest.mark.parametrize("tenant", ["alice\n", "alice\x00", "", "a" * 65, "../alice"])
async def test_a_tenant_name_with_anything_but_its_characters_is_refused(store, tenant):
    try:
        store.scoped("alice")
    except NotImplementedError:
        pytest.skip(f"{store} has no tenant scopes")
    with pytest.raises(ValueError, match="tenant"):
        store.scoped(tenant)


async def test_prefix_len_stops_at_first_gap(store, ns):
    chunks = make_chunks(ns, 5)
    for i in (0, 1, 3, 4):
        await store.put(chunks[i][0], chunks[i][2])
    keys = [k for k, _, _ in chunks]
    assert await store.prefix_len(keys) == 2
    assert await store.exists(keys) == [True, True, False, True, True]
    assert await store.prefix_len([]) == 0


async def test_delete_and_list_keys(store, ns):
    chunks = make_chunks(ns, 3)
    for k, _, b in chunks:
        await store.put(k, b)
    listed = {k async for k in store.list_keys() if k.startswith(ns.id)}
    assert listed == {k for k, _, _ in chunks}
    assert await store.delete(chunks[0][0]) is True
    assert await store.delete(chunks[0][0]) is False
    assert await store.get(chunks[0][0]) is None


async def test_concurrent_puts_of_one_key_write_exactly_once(store, ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=200_000)
    results = await asyncio.gather(*(store.put(key, blob) for _ in range(8)))
    if getattr(store, "publish", None) == "rename":
        # fsspec's publish=rename checks, then renames: racing writers may each report
        # a write of the same bytes (storage/fsspec_store.py); only never-partial holds.
        assert results.count(True) >= 1
    else:
        assert results.count(True) == 1
    assert bytes(await store.get(key)) == blob


async def test_tenant_scopes_do_not_see_each_other(store, ns):
    try:
        a, b = store.scoped("tenant-a"), store.scoped("tenant-b")
    except NotImplementedError:
        pytest.skip(f"{store} has no tenant scopes")
    (key, _, blob), = make_chunks(ns, 1)
    await a.put(key, blob)
    assert await b.exists([key]) == [False]
    assert await b.get(key) is None
    assert await store.exists([key]) == [False]
    assert key not in {k async for k in b.list_keys()}
    assert bytes(await a.get(key)) == blob


async def test_stats_count_hits_and_misses(store, ns):
    (key, _, blob), (absent, _, _) = make_chunks(ns, 2)
    await store.put(key, blob)
    before = dict(store.stats())
    await store.get(key)
    await store.get(absent)
    after = store.stats()
    assert after["hits"] - before["hits"] == 1
    assert after["misses"] - before["misses"] == 1
    assert str(store)


async def test_blob_files_give_the_verified_blob_for_sending(store, ns):
    """`SupportsBlobFiles` (what kvserver sends from): the blob itself, an open file of it
    or a view, and None for a miss."""
    from storage.base import BlobFile
    from storage.capabilities import SupportsBlobFiles

    if not isinstance(store, SupportsBlobFiles):
        pytest.skip(f"{store} does not declare SupportsBlobFiles (kvserver sends its `get`)")
    (key, _, blob), (absent, _, _) = make_chunks(ns, 2)
    await store.put(key, blob)
    buf = bytearray(len(blob))
    assert bytes(await store.get_blob_into(key, buf)) == blob
    got = await store.open_blob(key, buf)
    if isinstance(got, BlobFile):
        with got:
            assert got.size == len(blob) and os.pread(got.fileno(), got.size, 0) == blob
    else:
        assert bytes(got) == blob
    assert await store.get_blob_into(absent, buf) is None
    assert await store.open_blob(absent, buf) is None


def test_each_backend_declares_its_capabilities(tmp_path):
    from storage.capabilities import SupportsBlobFiles, SupportsDirectReads, SupportsGC

    def caps(url):
        s = open_store(url)
        return {c.__name__ for c in (SupportsBlobFiles, SupportsGC, SupportsDirectReads)
                if isinstance(s, c)}

    assert caps(f"file://{tmp_path}/f") == {"SupportsBlobFiles", "SupportsGC",
                                            "SupportsDirectReads"}
    assert caps("memory://") == {"SupportsBlobFiles"}
    assert caps(["memory://", f"file://{tmp_path}/t"]) == {"SupportsBlobFiles"}
    # a tier list reads directly where its first tier can; the tiers below fill in
    assert caps([f"file://{tmp_path}/u", "memory://"]) == {"SupportsBlobFiles",
                                                          "SupportsDirectReads"}
    assert caps("http://127.0.0.1:9") == set()


def test_wrappers_declare_a_capability_only_where_what_they_wrap_has_it(tmp_path):
    """Tenant scopes and tier lists are `SupportsBlobFiles` (what kvserver sends files
    from) only over a store that is; a tier list reads ranges only where every tier does.
    Opening an s3:// store makes no network call: nothing listens on the endpoint."""
    from storage.capabilities import SupportsBlobFiles, SupportsDirectReads, SupportsRangeReads
    from storage.tenancy import open_tenants

    s3 = "s3://bucket/p?endpoint=http://127.0.0.1:9&region=us-east-1"

    def caps(store):
        return {c.__name__ for c in (SupportsBlobFiles, SupportsRangeReads, SupportsDirectReads)
                if isinstance(store, c)}

    assert caps(open_tenants(open_store(s3), ["a"])["a"]) == set()
    assert caps(open_tenants(open_store(f"file://{tmp_path}/f"), ["a"])["a"]) == {
        "SupportsBlobFiles"}
    assert caps(open_tenants(open_store("memory://"), ["a"])["a"]) == {"SupportsBlobFiles"}
    assert caps(open_store([s3, f"file://{tmp_path}/t"])) == {"SupportsRangeReads"}
    assert caps(open_store([s3, f"file://{tmp_path}/t"]).scoped("a")) == {"SupportsRangeReads"}
    assert caps(open_tenants(open_store([s3, "memory://"]), ["a"])["a"]) == set()
    assert caps(open_store([f"file://{tmp_path}/u", s3])) == {
        "SupportsBlobFiles", "SupportsRangeReads", "SupportsDirectReads"}
    assert caps(open_tenants(open_store([f"file://{tmp_path}/v", s3]), ["a"])["a"]) == {
        "SupportsBlobFiles"}
    # fsspec reads no ranges: a tier list over it reads none either
    assert caps(open_store([f"file://{tmp_path}/w", f"fsspec+file://{tmp_path}/x"])) == {
        "SupportsBlobFiles", "SupportsDirectReads"}


def _ranged(store):
    from storage.capabilities import SupportsRangeReads

    if not isinstance(store, SupportsRangeReads):
        pytest.skip(f"{store.url}: no ranged reads (SupportsRangeReads)")
    return store


def _segmented(ns, n: int, sizes=(1000, 3000, 192)):
    """Chunks saved with one checksum per segment (a version 2 header)."""
    from storage.codec import encode_chunk

    out = []
    for key, tokens, blob in make_chunks(ns, n, payload_size=sum(sizes)):
        payload = decode_chunk(blob).payload
        out.append((key, bytes(payload), encode_chunk(key, tokens, payload, {"s": 1},
                                                      segments=list(sizes))))
    return out


async def test_ranged_reads_give_the_header_then_each_segment_it_vouches_for(store, ns):
    store = _ranged(store)
    (key, payload, blob), (absent, _, _) = _segmented(ns, 2)
    await store.put(key, blob)
    header = await store.read_header(key)
    assert header is not None and header.key == key and header.payload_len == len(payload)
    assert [(o, n) for o, n, _ in header.segments] == [(0, 1000), (1000, 3000), (4000, 192)]
    for i, (offset, length, _) in enumerate(header.segments):
        buf = bytearray(length)
        assert await store.read_range_into(key, header, offset, buf) is True
        header.verify_segment(i, buf)
        assert bytes(buf) == payload[offset : offset + length]
    assert await store.read_header(absent) is None
    assert await store.read_range_into(absent, header, 0, bytearray(10)) is False
    # a range past the payload's end is refused, not read from the next object or padding
    assert await store.read_range_into(key, header, 4000, bytearray(500)) is False


async def test_a_chunk_without_segments_has_a_header_with_none(store, ns):
    store = _ranged(store)
    (key, _, blob), = make_chunks(ns, 1, payload_size=2000)
    await store.put(key, blob)
    header = await store.read_header(key)
    assert header is not None and header.segments == ()
    buf = bytearray(2000)
    assert await store.read_range_into(key, header, 0, buf) is True
    header.verify_payload(buf)
