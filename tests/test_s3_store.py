"""The S3 store against real S3 servers on 127.0.0.1: moto and SeaweedFS, same tests for both."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import threading
import time

import boto3
import pytest
from botocore.config import Config

from kvstash.cli import main as kvstash_main
from storage import ConfigError, open_store
from storage.s3 import S3Store
from storage.s3_gc import plan_eviction
from tests.s3_fixtures import ACCESS_KEY, BUCKET, SECRET_KEY, endpoint_of, s3_url, with_prefix
from tests.store_helpers import make_chunks

pytest_plugins = ("tests.s3_fixtures",)

MiB = 1024 * 1024


def raw_client(url: str):
    """A plain boto3 client on the same server, to look behind the store's back."""
    return boto3.client(
        "s3", endpoint_url=endpoint_of(url), region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}),
    )


def object_names(url: str, prefix: str) -> set[str]:
    pages = raw_client(url).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


@pytest.fixture
async def store(s3_server_url):
    s = open_store(s3_server_url)
    yield s
    await s.close()


async def test_put_is_create_only_and_get_verifies(store, ns):
    (key, _, blob), (absent, _, _) = make_chunks(ns, 2)
    assert await store.put(key, blob) is True
    assert await store.put(key, blob) is False
    assert await store.get(key) == blob
    assert await store.get(absent) is None
    stats = store.stats()
    assert (stats["puts"], stats["put_skipped"], stats["hits"], stats["misses"]) == (1, 1, 1, 1)
    assert stats["conditional_put"] == "header"  # both servers enforce If-None-Match


async def test_large_chunks_come_back_through_parallel_ranges(s3_server_url, ns):
    """3.5 MiB with 1 MiB ranges: the first GET plus parallel ranged GETs, reassembled;
    and with `split_reads=0`, one open-ended GET (`bytes=0-`) for the whole object."""
    store = open_store(with_prefix(s3_server_url, range_size="1MiB", split_reads="1"))
    (key, _, blob), = make_chunks(ns, 1, payload_size=3 * MiB + MiB // 2 + 123)
    await store.put(key, blob)
    whole = open_store(with_prefix(s3_server_url, store.prefix.rstrip("/"), range_size="1MiB",
                                   split_reads="0"))
    for s in (store, whole):
        assert await s.get(key) == blob
        out = bytearray(4 * MiB)
        header = await s.get_into(key, out)
        assert header is not None and bytes(out[: header.payload_len]) == blob[header.header_len :]
        assert await s.get_into(key, bytearray(MiB)) is None  # buffer too small: a miss
        await s.close()


async def test_a_chunk_whose_header_is_longer_than_4_kib_reads_into_a_buffer(s3_server_url, ns):
    """A chunk with one checksum per (layer, head) of a large model (256 segments: an
    8 KiB header), 3 MiB in 1 MiB ranges: its header is read past the first 4 KiB, then
    every byte lands in place."""
    from hashing import chunk_keys
    from storage.codec import encode_chunk

    store = open_store(with_prefix(s3_server_url, range_size="1MiB", split_reads="1"))
    tokens = list(range(ns.chunk_tokens))
    key = chunk_keys(tokens, ns)[0]
    payload = os.urandom(3 * MiB)
    blob = encode_chunk(key, tokens, payload, {"i": 0}, segments=[3 * MiB // 256] * 256)
    assert len(blob) - len(payload) == 8192
    await store.put(key, blob)
    out = bytearray(4 * MiB)
    header = await store.get_into(key, out)
    assert header is not None and len(header.segments) == 256
    assert bytes(out[: header.payload_len]) == payload
    await store.close()


@pytest.mark.parametrize("header_kib", [4, 8])
async def test_a_one_request_chunk_is_checked_as_it_streams_and_a_flipped_byte_is_a_miss(
        s3_server_url, ns, header_kib):
    """A chunk read in one request (its payload hashed slice by slice as it lands, not
    again afterwards), with a 4 or an 8 KiB header and a payload of no round size: `get`
    returns it whole and `get_into` puts its payload in place; the same chunk with one
    payload byte flipped, first or last, is a miss for both and is deleted."""
    from hashing import chunk_keys
    from storage.codec import encode_chunk

    store = open_store(with_prefix(s3_server_url, range_size="4MiB"))
    tokens = list(range(ns.chunk_tokens))
    key = chunk_keys(tokens, ns)[0]
    payload = os.urandom(3 * MiB + 123)
    segments = [len(payload)] if header_kib == 4 else [len(payload) // 256] * 255 + [
        len(payload) - 255 * (len(payload) // 256)]
    blob = encode_chunk(key, tokens, payload, {"i": 0}, segments=segments)
    assert len(blob) - len(payload) == header_kib * 1024
    await store.put(key, blob)
    assert await store.get(key) == blob
    out = bytearray(4 * MiB)
    header = await store.get_into(key, out)
    assert header is not None and bytes(out[: header.payload_len]) == payload
    for at in (header_kib * 1024, len(blob) - 1):
        damaged = bytearray(blob)
        damaged[at] ^= 0x01
        for read in (store.get(key), store.get_into(key, out)):
            raw_client(s3_server_url).put_object(Bucket=BUCKET, Key=store.prefix + key,
                                                 Body=bytes(damaged))
            assert await read is None
            await store.flush()  # the corrupt object's deletion, before the next put
    assert store.stats()["corrupt"] == 4
    await store.close()


async def test_ranged_reads_never_deadlock_the_inflight_limit(s3_server_url, ns):
    """One request in flight: a first GET gives its slot back before awaiting its ranges."""
    store = open_store(with_prefix(s3_server_url, range_size="1MiB", max_in_flight="1",
                                   split_reads="3", timeout="20s"))
    chunks = make_chunks(ns, 3, payload_size=3 * MiB)
    for key, _, blob in chunks:
        await store.put(key, blob)
    assert await asyncio.gather(*(store.get(k) for k, _, _ in chunks)) == [b for _, _, b in chunks]
    out = [bytearray(3 * MiB) for _ in chunks]
    headers = await asyncio.gather(*(store.get_into(k, o) for (k, _, _), o in zip(chunks, out, strict=True)))
    assert all(h is not None for h in headers)
    await store.close()


async def test_multipart_put_above_the_threshold_is_create_only(s3_server_url, ns):
    store = open_store(with_prefix(s3_server_url, multipart_threshold="6MiB", part_size="5MiB"))
    (key, _, blob), = make_chunks(ns, 1, payload_size=11 * MiB)
    assert await store.put(key, blob) is True
    assert await store.put(key, blob) is False
    assert await store.get(key) == blob
    await store.close()


async def test_corrupt_object_is_a_miss_and_is_deleted(store, s3_server_url, ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=50_000)
    name = store.prefix + key
    damaged = bytearray(blob)
    damaged[-7] ^= 0xFF
    raw_client(s3_server_url).put_object(Bucket=BUCKET, Key=name, Body=bytes(damaged))
    assert await store.get(key) is None
    await store.flush()
    assert store.stats()["corrupt"] == 1
    assert name not in object_names(s3_server_url, store.prefix)
    assert await store.put(key, blob) is True  # the slot is free again for a good copy


async def test_truncated_object_is_a_miss(store, s3_server_url, ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=50_000)
    raw_client(s3_server_url).put_object(Bucket=BUCKET, Key=store.prefix + key, Body=blob[:-10])
    assert await store.get_into(key, bytearray(60_000)) is None
    assert store.stats()["corrupt"] == 1


async def test_tenants_live_under_their_own_prefix(store, s3_server_url, ns):
    (key, _, blob), = make_chunks(ns, 1)
    acme = store.scoped("acme")
    await acme.put(key, blob)
    assert store.prefix + "tenants/acme/" + key in object_names(s3_server_url, store.prefix)
    assert [k async for k in store.list_keys()] == []
    assert [k async for k in acme.list_keys()] == [key]


def test_one_store_serves_several_event_loops(s3_server_url, ns):
    """One client per loop: a store opened once keeps working across asyncio.run calls."""
    store = open_store(s3_server_url)
    (key, _, blob), = make_chunks(ns, 1)
    assert asyncio.run(store.put(key, blob)) is True
    assert asyncio.run(store.get(key)) == blob

    async def read_and_close():
        try:
            return await store.get(key)
        finally:
            await store.close()

    assert asyncio.run(read_and_close()) == blob


async def test_hits_refresh_the_access_marker(store, s3_server_url, ns):
    (key, _, blob), = make_chunks(ns, 1)
    await store.put(key, blob)
    marker = f"{store.prefix}.atime/{key}"
    assert marker not in object_names(s3_server_url, store.prefix)
    await store.get(key)
    await store.flush()
    assert marker in object_names(s3_server_url, store.prefix)


async def test_gc_evicts_the_least_recently_used_down_to_capacity(store, ns):
    (a, _, blob_a), (b, _, blob_b), (c, _, blob_c) = make_chunks(ns, 3, payload_size=100_000)
    await store.put(a, blob_a)
    await store.put(b, blob_b)
    await asyncio.sleep(1.1)  # S3 LastModified has one-second resolution
    await store.get(a)  # a is now more recently used than b
    await store.put(c, blob_c)
    await store.flush()
    result = await store.gc(2 * len(blob_a) + 10)
    assert result["evicted"] == 1 and result["chunks"] == 2
    assert await store.exists([a, b, c]) == [True, False, True]
    assert (await store.gc(10 * MiB))["evicted"] == 0


def test_kvstash_gc_command_trims_a_bucket(s3_server_url, ns, capsys):
    url = with_prefix(s3_server_url)
    store = open_store(url)
    chunks = make_chunks(ns, 4, payload_size=10_000)

    async def fill():
        for k, _, b in chunks:
            await store.put(k, b)
        await store.close()

    asyncio.run(fill())
    assert kvstash_main(["gc", "--store", url, "--capacity", "30KiB"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["evicted"] == 2 and result["chunks"] == 2


def test_eviction_plan_orders_by_last_use_and_drops_orphan_markers():
    k = [f"{'a' * 16}/{i:032x}" for i in range(3)]
    objects = [
        (k[0], 100, 10.0), (k[1], 100, 20.0), (k[2], 100, 30.0),
        (f".atime/{k[0]}", 0, 40.0),                # k0 was read last
        (f"tenants/t1/.atime/{'b' * 16}/{0:032x}", 0, 5.0),  # its chunk is gone
        (".kvstash/probe-1", 5, 1.0),                # never touched
    ]
    plan = plan_eviction(objects, capacity=150)
    assert plan.evicted == 2 and plan.used_bytes == 100
    assert set(plan.delete) == {k[1], k[2], f"tenants/t1/.atime/{'b' * 16}/{0:032x}"}


@pytest.mark.parametrize("query, complaint", [
    ("endpoint=127.0.0.1:9000", "endpoint"),
    ("access_key=AKIA", "secret_key"),
    ("retry_mode=fast", "retry_mode"),
    ("range_size=4KiB", "range_size"),
    ("colour=blue", "colour"),
])
def test_bad_options_fail_at_open_naming_the_setting(query, complaint):
    with pytest.raises(ConfigError, match=complaint):
        open_store(f"s3://bucket/prefix?{query}")


async def test_secrets_never_reach_logs_or_errors(caplog, moto_s3_url, ns):
    url = with_prefix(moto_s3_url) + "&session_token=TOPSECRETTOKEN"
    caplog.set_level(logging.DEBUG, logger="kvstash")
    with pytest.raises(ConfigError) as err:
        open_store(url + "&colour=blue")
    store = open_store(url)
    (key, _, blob), = make_chunks(ns, 1)
    await store.put(key, blob)
    await store.get(key)
    await store.close()
    shown = " ".join([str(err.value), str(store), repr(store), json.dumps(store.stats()),
                      *(r.getMessage() for r in caplog.records if r.name.startswith("kvstash"))])
    for secret in (SECRET_KEY, "TOPSECRETTOKEN"):
        assert secret not in shown
    assert isinstance(store, S3Store)


def test_in_flight_limit_is_max_in_flight_and_the_former_inflight_still_reads():
    from storage import ConfigError

    base = "s3://bucket/kv?endpoint=http://127.0.0.1:9&region=us-east-1"
    assert open_store(f"{base}&max_in_flight=5").opts.max_in_flight == 5
    assert open_store(f"{base}&inflight=3").opts.max_in_flight == 3
    with pytest.raises(ConfigError, match="contradicts max_in_flight"):
        open_store(f"{base}&max_in_flight=5&inflight=2")


@pytest.mark.parametrize("endpoint, split", [
    ("http://127.0.0.1:9", 0), ("http://localhost:9", 0), ("http://[::1]:9", 0),
    ("http://10.1.2.3:9", 1), ("https://s3.example.com", 1), (None, 1),
])
def test_a_server_on_this_host_reads_each_chunk_in_one_request_by_default(endpoint, split):
    """`split_reads` defaults to 0 for a loopback endpoint (no network to spread over, the
    server shares the client's cores) and to 1 elsewhere; the URL still decides."""
    base = "s3://bucket/kv?region=us-east-1" + (f"&endpoint={endpoint}" if endpoint else "")
    assert open_store(base).opts.split_reads == split
    assert open_store(f"{base}&split_reads=2").opts.split_reads == 2


@pytest.fixture
async def proxied(fault_proxy):
    """A store whose requests go through a FaultProxy (moto behind it), which counts them."""
    s = open_store(s3_url(fault_proxy.endpoint, f"lookups-{time.monotonic_ns()}", touch="0"))
    yield s
    await s.close()


@pytest.mark.parametrize("split_reads", ["1", "4"])
async def test_a_large_object_is_read_as_parallel_ranges_only_while_reads_leave_room(
        fault_proxy, ns, split_reads):
    """3.5 MiB chunks with 1 MiB ranges. Read alone, a chunk is four GETs: the first, then
    the rest as three parallel ranges. Four read at once: the first to start splits, the
    other three are one GET each for the whole object (the connections are busy already,
    and a whole object is hashed as it lands), unless `split_reads` lets all four split.
    (`split_reads=1` is the default for a far endpoint; the proxy here is on loopback.)"""
    extra = {"range_size": "1MiB", "touch": "0", "split_reads": split_reads}
    store = open_store(s3_url(fault_proxy.endpoint, f"split-{time.monotonic_ns()}", **extra))
    size = 3 * MiB + MiB // 2 + 123
    chunks = make_chunks(ns, 4, payload_size=size)
    for key, _, blob in chunks:
        await store.put(key, blob)
    payloads = [blob[len(blob) - size :] for _, _, blob in chunks]

    async def payload_of(key: str) -> bytes | None:
        out = bytearray(4 * MiB)
        header = await store.get_into(key, out)
        return None if header is None else bytes(out[: header.payload_len])

    for one, expected in ((store.get, [b for _, _, b in chunks]), (payload_of, payloads)):
        before = fault_proxy.methods["GET"]
        assert await one(chunks[0][0]) == expected[0]
        assert fault_proxy.methods["GET"] - before == 4
        before = fault_proxy.methods["GET"]
        assert await asyncio.gather(*(one(k) for k, _, _ in chunks)) == expected
        assert fault_proxy.methods["GET"] - before == (4 + 3 if split_reads == "1" else 16)
    assert store.stats()["hits"] == 10
    await store.close()


async def test_a_lookup_asks_about_the_first_chunk_alone(proxied, fault_proxy, ns):
    """A prompt never seen costs one HEAD; a stored prefix is then asked in windows."""
    chunks = make_chunks(ns, 6)
    for key, _, blob in chunks[:4]:
        assert await proxied.put(key, blob)
    keys = [key for key, _, _ in chunks]
    before = fault_proxy.methods["HEAD"]
    assert await proxied.prefix_len(keys[4:]) == 0
    assert fault_proxy.methods["HEAD"] - before == 1
    before = fault_proxy.methods["HEAD"]
    assert await proxied.prefix_len(keys) == 4
    assert fault_proxy.methods["HEAD"] - before == 6  # the first alone, then the other five


async def test_lookups_at_once_share_one_head_a_key(proxied, fault_proxy, ns):
    """Requests of one prompt (or one system prompt) looked up at once: one HEAD a key,
    whatever the number of lookups; a lookup cancelled by its timeout leaves the HEAD to
    the others, and a later lookup asks again."""
    chunks = make_chunks(ns, 4)
    for key, _, blob in chunks[:3]:
        assert await proxied.put(key, blob)
    keys = [key for key, _, _ in chunks]
    before = fault_proxy.methods["HEAD"]
    fault_proxy.hold["HEAD"] = held = threading.Event()
    try:
        lookups = [asyncio.ensure_future(proxied.prefix_len(keys[: 2 + i % 3]))
                   for i in range(8)]
        timed_out = asyncio.ensure_future(proxied.prefix_len(keys))
        for _ in range(1000):  # until the first key's HEAD is held at the proxy (<= 10 s)
            if fault_proxy.methods["HEAD"] > before:
                break
            await asyncio.sleep(0.01)
        timed_out.cancel()
    finally:
        held.set()
    assert [await f for f in lookups] == [2, 3, 3] * 2 + [2, 3]
    assert fault_proxy.methods["HEAD"] - before == len(keys)
    before = fault_proxy.methods["HEAD"]
    assert await proxied.prefix_len(keys) == 3
    assert fault_proxy.methods["HEAD"] - before == 4


def _read_in_child(store: S3Store, key: str, blob: bytes) -> None:
    async def read() -> bool:
        return await asyncio.wait_for(store.get(key), 30) == blob

    os._exit(0 if asyncio.run(read()) else 1)


def test_a_forked_child_reads_through_reader_threads_of_its_own(moto_s3_url, ns):
    """Chunk bodies stream on reader threads, which a forked child does not inherit: a
    store used before the fork reads in the child too (it would wait forever on its
    parent's threads)."""
    store = open_store(with_prefix(moto_s3_url, touch="0"))
    (key, _, blob), = make_chunks(ns, 1, payload_size=10_000)

    async def parent() -> None:
        assert await store.put(key, blob) is True
        assert await store.get(key) == blob

    asyncio.run(parent())
    child = multiprocessing.get_context("fork").Process(target=_read_in_child,
                                                         args=(store, key, blob))
    child.start()
    child.join(60)
    assert child.exitcode == 0
