"""The S3 benchmark's pieces: boto3 baselines and the latency/bandwidth shaping proxy, on moto."""

from __future__ import annotations

import argparse
import functools

import pytest

from bench.s3shape import parse_shape
from bench.store import measure_store
from bench.store_s3 import (
    LOOKUP_CHUNKS,
    LOOKUPS_AT_ONCE,
    RAW_GET_NAME,
    baselines,
    extras,
    raw_get_round,
    setup,
)
from storage import open_store
from tests.s3_fixtures import with_prefix
from tests.store_helpers import make_chunks

pytest_plugins = ("tests.s3_fixtures",)


def test_shape_parses_latency_and_bandwidth():
    assert parse_shape("30ms,90MBps") == (0.03, 90e6)
    assert parse_shape("0.1s,1GiB") == (0.1, float(2**30))
    with pytest.raises(ValueError, match="LATENCY,BANDWIDTH"):
        parse_shape("fast")


async def test_baselines_report_put_and_get_rates(moto_s3_url):
    args = argparse.Namespace(rounds=1, shape=None)
    rows = await baselines(args, with_prefix(moto_s3_url), 64 * 1024, 2, 1)
    assert [r["name"] for r in rows] == ["boto3 sequential get/put_object",
                                         "boto3 sequential, checksums off"]
    assert all(r["get_gbps"] > 0 and r["put_gbps"] > 0 for r in rows)


async def test_plain_boto3_at_the_stores_concurrency_reads_in_the_same_rounds(moto_s3_url):
    """`bench store` times plain boto3 on N threads (get_object+read+xxh3) on the very
    objects the store reads, round by round, and reports paired ratios for get and
    get_into_many beside the sequential baselines."""
    url = with_prefix(moto_s3_url, touch="0")
    got = await measure_store(url, 64 * 1024, 3, 2, 2, functools.partial(raw_get_round, url))
    assert got["raw_same_objects_get_gbps"] > 0
    assert got["get_ratio_paired"] > 0 and got["get_into_many_ratio_paired"] > 0
    assert len(got["rounds_gbps"]["raw"]) == len(got["rounds_gbps"]["get"]) == 2
    assert "N threads" in RAW_GET_NAME


async def test_the_clients_cpu_per_gb_is_reported_for_the_store_and_plain_boto3(moto_s3_url):
    """Beside the rates, `bench store` reports this process's CPU seconds per GB read (all
    threads) for each of the store's reads and for plain boto3 in the same rounds: what a
    read costs the client whatever the server (another process) spends."""
    url = with_prefix(moto_s3_url, touch="0")
    got = await measure_store(url, 256 * 1024, 3, 2, 2, functools.partial(raw_get_round, url))
    cpu = got["client_cpu_s_per_gb"]
    assert set(cpu) == {"raw", "get", "get_into", "get_into_many"}
    assert all(v > 0 for v in cpu.values())


async def test_lookups_at_once_are_timed_beside_plain_boto3_heads(moto_s3_url):
    """The extras: the store's lookups at once share their HEADs (one a key a round),
    where plain boto3 HEADs every lookup's keys."""
    got = await extras(argparse.Namespace(rounds=2), with_prefix(moto_s3_url))
    assert got["lookup_heads"] == LOOKUP_CHUNKS
    assert got["plain_boto3_lookup_heads"] == LOOKUPS_AT_ONCE * LOOKUP_CHUNKS
    assert got["lookups_ms"] > 0 and got["plain_boto3_lookups_ms"] > 0


async def test_the_shaping_proxy_carries_the_store(moto_s3_url, ns):
    """Store traffic through the shaping proxy process arrives intact, and it stops. The
    proxy is on loopback but stands for a far bucket: the store splits as it would there
    (`split_reads=1`, a loopback endpoint's default being 0)."""
    args = argparse.Namespace(shape="20ms,50MBps")
    url, stop = await setup(args, with_prefix(moto_s3_url, touch="0"))
    try:
        assert "endpoint=http://127.0.0.1:" in url and url != moto_s3_url
        store = open_store(url)
        assert store.opts.split_reads == 1
        (key, _, blob), = make_chunks(ns, 1, payload_size=100_000)
        assert await store.put(key, blob) is True
        assert await store.get(key) == blob
        await store.close()
    finally:
        await stop()
