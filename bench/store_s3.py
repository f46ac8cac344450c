"""S3 baselines for `kvstash bench store --store s3://...`, and the `--shape` option.

Baselines: plain boto3 `put_object` / `get_object(...)["Body"].read()` of the same
number of same-sized objects on the same server and bucket, one at a time (what a
straightforward client does), once with boto3's defaults (CRC32 on put, validated on
get) and once with checksums off (`when_required`, as the store runs). And, at the
store's own concurrency, in the same rounds as the store's reads (`raw_get_round`): a
pool of N threads each doing `get_object(...)["Body"].read()` of the very objects the
store reads, plus the xxh3-64 of the payload that the store verifies on every get.

Extras: 16 lookups at once of one stored 8-chunk prefix (a burst of requests behind one
system prompt), against plain boto3 `head_object` of every lookup's keys from 16 threads
(each lookup asking on its own): HEADs sent and milliseconds, medians of `--rounds`. With
`--shape LATENCY,BANDWIDTH` both the store and the baselines go through a
latency + per-connection-bandwidth proxy (bench/s3shape.py) in its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from storage.options import StoreURL
from storage.s3 import S3Store
from storage.s3_client import S3Options

HEADER = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", metavar="LATENCY,BANDWIDTH",
                   help="s3:// only: measure through a proxy adding LATENCY to every request "
                        "and capping each connection at BANDWIDTH, e.g. 30ms,90MBps "
                        "(published S3 per-connection figures)")


def _through_shaper(url: str, endpoint: str) -> str:
    """`url` with the shaping proxy as its endpoint. The proxy listens on loopback but
    stands for a far bucket, so the store reads as it would from one: `split_reads=1`
    (a far endpoint's default) unless the URL sets it."""
    parts = urlsplit(url)
    pairs = [p for p in parts.query.split("&") if p and not p.startswith("endpoint=")]
    if not any(p.startswith("split_reads=") for p in pairs):
        pairs.append("split_reads=1")
    return parts._replace(query="&".join([f"endpoint={endpoint}", *pairs])).geturl()


async def setup(args: argparse.Namespace, url: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    async def nothing() -> None:
        return None

    if not getattr(args, "shape", None):
        return url, nothing
    opts = S3Options.from_url(StoreURL(url))
    if not opts.endpoint:
        raise SystemExit("--shape needs an s3:// URL with endpoint=http://host:port")
    upstream = urlsplit(opts.endpoint)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.s3shape", "--upstream",
         f"{upstream.hostname}:{upstream.port or 80}", "--shape", args.shape],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = await asyncio.to_thread(proc.stdout.readline)
    if not line.startswith("listening "):
        proc.kill()
        raise SystemExit(f"the shaping proxy did not start: {line!r}")
    port = int(line.split()[1])

    async def stop() -> None:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)

    return _through_shaper(url, f"http://127.0.0.1:{port}"), stop


def _client(opts: S3Options, checksums: str, pool: int = 10):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=opts.endpoint, region_name=opts.region,
        aws_access_key_id=opts.access_key, aws_secret_access_key=opts.secret_key,
        aws_session_token=opts.session_token,
        config=Config(s3={"addressing_style": opts.addressing}, max_pool_connections=pool,
                      request_checksum_calculation=checksums,
                      response_checksum_validation=checksums),
    )


RAW_GET_NAME = "boto3 get_object+read+xxh3, N threads"
_RAW_CLIENTS: dict[str, Any] = {}
_RAW_LOCK = threading.Lock()


def raw_get_round(url: str, keys: list[str], buffers: list[memoryview], concurrency: int) -> float:
    """Seconds for `concurrency` threads to read every object of `keys` with plain boto3
    (`get_object(...)["Body"].read()`, checksums as the store runs them) and hash each
    payload with xxh3-64, as the store verifies it. The buffers are unused: a plain client
    reads into the bytes boto3 returns."""
    import xxhash

    opts = S3Options.from_url(StoreURL(url))
    with _RAW_LOCK:  # made once, untimed: a client costs ~0.4 s to create
        client = _RAW_CLIENTS.get(url)
        fresh = client is None
        if client is None:
            client = _RAW_CLIENTS[url] = _client(opts, "when_required", pool=64)
    names = [opts.prefix + k for k in keys]

    def one(name: str) -> None:
        blob = client.get_object(Bucket=opts.bucket, Key=name)["Body"].read()
        xxhash.xxh3_64_intdigest(memoryview(blob)[HEADER:])

    with ThreadPoolExecutor(concurrency) as pool:
        # threads started and, for a new client, connections opened, untimed (as the
        # store's first reads are)
        list(pool.map(one if fresh else lambda _: None, names if fresh else range(concurrency)))
        t0 = time.perf_counter()
        list(pool.map(one, names))
        return time.perf_counter() - t0


def _measure(opts: S3Options, checksums: str, size: int, count: int, rounds: int) -> tuple[float, float]:
    """Sequential put then get of `count` objects; (put seconds, median get seconds)."""
    client = _client(opts, checksums)
    data = os.urandom(size + HEADER)
    names = [f"{opts.prefix}.bench-baseline-{uuid.uuid4().hex[:8]}/{i:04d}" for i in range(count)]
    try:
        t0 = time.perf_counter()
        for name in names:
            client.put_object(Bucket=opts.bucket, Key=name, Body=data)
        put_s = time.perf_counter() - t0
        get_times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for name in names:
                got = client.get_object(Bucket=opts.bucket, Key=name)["Body"].read()
                if len(got) != len(data):
                    raise RuntimeError(f"baseline read {len(got)} of {len(data)} bytes")
            get_times.append(time.perf_counter() - t0)
        return put_s, statistics.median(get_times)
    finally:
        for name in names:
            client.delete_object(Bucket=opts.bucket, Key=name)
        client.close()


async def baselines(args: argparse.Namespace, url: str, size: int, count: int,
                    concurrency: int) -> list[dict]:
    opts = S3Options.from_url(StoreURL(url))
    rounds = getattr(args, "rounds", 3)
    nbytes = (size + HEADER) * count
    out = []
    for name, checksums in (("boto3 sequential get/put_object", "when_supported"),
                            ("boto3 sequential, checksums off", "when_required")):
        put_s, get_s = await asyncio.to_thread(_measure, opts, checksums, size, count, rounds)
        out.append({"name": name, "put_gbps": nbytes / put_s / 1e9, "get_gbps": nbytes / get_s / 1e9})
    return out


LOOKUPS_AT_ONCE, LOOKUP_CHUNKS = 16, 8


class _CountedHeads(S3Store):
    """The s3:// store, counting the HEADs it sends while `counting` is set."""

    counting = False
    heads = 0

    async def _head(self, name: str) -> bool:
        if self.counting:
            self.heads += 1
        return await super()._head(name)


async def extras(args: argparse.Namespace, url: str) -> dict[str, Any]:
    from bench.store import stored_prefix

    u = StoreURL(url)
    opts = S3Options.from_url(u)
    store = _CountedHeads(opts, u.redacted())
    client = _client(opts, "when_required", pool=LOOKUPS_AT_ONCE)

    def plain_lookup() -> int:  # a client without sharing: its own HEAD a key
        for i, name in enumerate(names):
            try:
                client.head_object(Bucket=opts.bucket, Key=name)
            except client.exceptions.ClientError:
                return i
        return len(names)

    mine, plain = [], []
    try:
        keys = await stored_prefix(store, LOOKUP_CHUNKS)
        names = [store._name(k) for k in keys]
        store.counting = True
        with ThreadPoolExecutor(LOOKUPS_AT_ONCE) as pool:
            for _ in range(getattr(args, "rounds", 3)):
                t0 = time.perf_counter()
                got = await asyncio.gather(*(store.prefix_len(keys)
                                             for _ in range(LOOKUPS_AT_ONCE)))
                mine.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                seen = list(pool.map(lambda _: plain_lookup(), range(LOOKUPS_AT_ONCE)))
                plain.append(time.perf_counter() - t0)
                if set(got) != {LOOKUP_CHUNKS} or set(seen) != {LOOKUP_CHUNKS}:
                    raise RuntimeError(f"lookups saw {got} and {seen} of {LOOKUP_CHUNKS} chunks")
        store.counting = False
        for k in keys:
            await store.delete(k)
    finally:
        client.close()
        await store.close()
    rounds = len(mine)
    return {
        "lookups_at_once": LOOKUPS_AT_ONCE,
        "lookup_heads": store.heads / rounds,
        "plain_boto3_lookup_heads": LOOKUPS_AT_ONCE * LOOKUP_CHUNKS,
        "lookups_ms": statistics.median(mine) * 1e3,
        "plain_boto3_lookups_ms": statistics.median(plain) * 1e3,
        "lookups_vs_plain_boto3": statistics.median(mine) / statistics.median(plain),
    }
