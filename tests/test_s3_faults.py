"""Faults between the S3 store and a real server (moto), injected by a proxy of our own.

503 SlowDown, connection resets and stalls are retried and then become misses, never
exceptions to the caller; a dead endpoint opens the circuit breaker, which answers
"miss" without touching the network until a probe succeeds.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from storage import StoreUnavailable, open_store
from tests.s3_fixtures import FaultProxy, s3_url
from tests.store_helpers import make_chunks

pytest_plugins = ("tests.s3_fixtures",)

# Small timeouts and few attempts keep each failing call well under a second or two
# (botocore's standard mode sleeps up to 1 s before its second attempt).
FAST_FAIL = {"retries": "2", "connect_timeout": "0.5s", "read_timeout": "0.5s", "timeout": "3s",
             "touch": "0"}


def through(proxy: FaultProxy, **extra: str) -> str:
    return s3_url(proxy.endpoint, f"faults-{time.monotonic_ns()}", **{**FAST_FAIL, **extra})


@pytest.fixture
async def stored(fault_proxy, ns, request):
    """A store behind the proxy holding one chunk; yields (store, key, blob)."""
    stall = "stall" in request.node.name  # only stalls wait out the read timeout
    store = open_store(through(fault_proxy, **({"read_timeout": "0.3s"} if stall else {})))
    (key, _, blob), = make_chunks(ns, 1, payload_size=20_000)
    assert await store.put(key, blob) is True
    yield store, key, blob
    await store.close()


async def test_a_get_is_one_request_with_no_head_before_it(stored, fault_proxy, ns):
    store, key, blob = stored
    (absent, _, _), = make_chunks(ns, 1, seed=9)
    before = fault_proxy.requests
    assert await store.get(key) == blob
    assert await store.get(absent) is None
    assert fault_proxy.requests - before == 2


@pytest.mark.parametrize("mode", ["slowdown", "reset"])
async def test_a_transient_fault_is_retried_and_the_get_succeeds(stored, fault_proxy, mode):
    store, key, blob = stored
    fault_proxy.fail_next(1, mode)
    assert await store.get(key) == blob
    assert store.stats()["errors"] == 0


@pytest.mark.parametrize("mode", ["slowdown", "reset", "stall"])
async def test_a_persistent_fault_becomes_a_miss_not_an_exception(stored, fault_proxy, mode, ns):
    store, key, blob = stored
    (other, _, other_blob), = make_chunks(ns, 1, seed=5)
    fault_proxy.set(mode)
    before = fault_proxy.requests
    assert await store.get(key) is None
    assert await store.get_into(key, bytearray(len(blob))) is None
    assert await store.exists([key]) == [False]
    assert await store.prefix_len([key]) == 0
    assert fault_proxy.requests - before >= 4  # every call was retried
    assert store.stats()["errors"] >= 4
    with pytest.raises(StoreUnavailable):
        await store.put(other, other_blob)


@pytest.mark.parametrize("mode", ["stall_body", "cut_body"])
async def test_a_body_that_stalls_or_breaks_midway_is_a_miss_not_corruption(fault_proxy, ns, mode):
    """The object is fine, the transfer is not: a miss, and the object is kept (whole
    reads, and the ranged reads of TP>1 ranks and lean loads)."""
    store = open_store(through(fault_proxy, read_timeout="0.3s"))
    (key, _, blob), = make_chunks(ns, 1, payload_size=2_000_000)
    assert await store.put(key, blob) is True
    header = await store.read_header(key)
    assert header is not None
    fault_proxy.set(mode)
    assert await store.get(key) is None
    assert await store.get_into(key, bytearray(len(blob))) is None
    out = bytearray(header.payload_len)
    assert await store.read_range_into(key, header, 0, out) is False
    assert (store.stats()["errors"], store.stats()["corrupt"]) == (3, 0)
    fault_proxy.set("pass")
    assert await store.get(key) == blob
    assert await store.read_range_into(key, header, 0, out) is True
    assert bytes(out) == blob[header.header_len :]
    await store.close()


async def test_a_deadline_ends_a_body_stalled_midway_without_waiting_out_the_read_timeout(
        fault_proxy, ns):
    """Chunk bodies stream on reader threads, and a thread cannot be cancelled: when the
    operation's deadline passes, the stalled socket's read side is shut, so the call
    returns a miss at once rather than after `read_timeout` (here far longer than the
    deadline). `wait_for` only bounds a hang; it is no timing assertion."""
    store = open_store(through(fault_proxy, read_timeout="30s", timeout="0.5s", retries="1"))
    (key, _, blob), = make_chunks(ns, 1, payload_size=2_000_000)
    assert await store.put(key, blob) is True
    fault_proxy.set("stall_body")
    assert await asyncio.wait_for(store.get(key), 15) is None
    assert await asyncio.wait_for(store.get_into(key, bytearray(len(blob))), 15) is None
    assert (store.stats()["errors"], store.stats()["corrupt"]) == (2, 0)
    fault_proxy.set("pass")
    assert await store.get(key) == blob
    await store.close()


async def test_a_failed_put_raises_store_unavailable(fault_proxy, ns):
    store = open_store(through(fault_proxy))
    (key, _, blob), = make_chunks(ns, 1)
    fault_proxy.set("slowdown")
    with pytest.raises(StoreUnavailable, match="503 SlowDown"):
        await store.put(key, blob)
    assert store.stats()["put_errors"] == 1
    fault_proxy.set("pass")
    assert await store.put(key, blob) is True
    await store.close()


async def test_a_409_conflict_from_a_racing_writer_is_retried(fault_proxy, ns):
    store = open_store(through(fault_proxy, conditional="header"))
    (key, _, blob), = make_chunks(ns, 1)
    fault_proxy.fail_next(2, "conflict")
    assert await store.put(key, blob) is True
    assert await store.get(key) == blob
    fault_proxy.set("conflict")
    (other, _, other_blob), = make_chunks(ns, 1, seed=3)
    with pytest.raises(StoreUnavailable, match="409"):
        await store.put(other, other_blob)
    await store.close()


async def test_breaker_opens_on_a_dead_endpoint_and_recovers(fault_proxy, ns):
    store = open_store(through(fault_proxy, breaker_failures="2", breaker_reset="0.5s"))
    (key, _, blob), = make_chunks(ns, 1)
    assert await store.put(key, blob) is True
    fault_proxy.set("reset")
    assert await store.get(key) is None
    assert await store.get(key) is None
    assert store.stats()["breaker"] == "open"

    before = fault_proxy.requests
    assert await asyncio.gather(*(store.get(key) for _ in range(50))) == [None] * 50
    assert fault_proxy.requests == before  # an open breaker costs no network call
    assert store.stats()["breaker_refused"] >= 50
    with pytest.raises(StoreUnavailable, match="breaker"):
        await store.put(key, blob)

    fault_proxy.set("pass")
    await asyncio.sleep(0.6)
    assert store.stats()["breaker"] == "half-open"
    assert await store.get(key) == blob  # the probe
    assert store.stats()["breaker"] == "closed"
    assert await store.get(key) == blob
    await store.close()


async def test_probe_says_a_failing_endpoint_failed_where_exists_answers_absent(stored, fault_proxy):
    """An endpoint that resets every connection: `exists` answers "absent" (the hot path's
    miss), `probe` says the check did not get through; once it passes again, nothing."""
    store, key, _ = stored
    assert await store.probe() is None
    fault_proxy.set("reset")
    assert await store.exists([key]) == [False]
    assert await store.probe() is not None
    fault_proxy.set("pass")
    assert await store.exists([key]) == [True]


async def test_a_failed_probe_reopens_the_breaker(fault_proxy, ns):
    store = open_store(through(fault_proxy, breaker_failures="1", breaker_cooldown="0.3s"))
    (key, _, blob), = make_chunks(ns, 1)
    await store.put(key, blob)
    fault_proxy.set("slowdown")
    assert await store.get(key) is None
    await asyncio.sleep(0.35)
    assert await store.get(key) is None  # the probe fails
    assert store.stats()["breaker"] == "open"
    assert store.stats()["breaker_opened"] == 2
    await store.close()


async def test_server_that_ignores_if_none_match_is_detected(fault_proxy, ns):
    """The proxy drops If-None-Match, like servers that do not implement conditional writes."""
    fault_proxy.strip_if_none_match = True
    store = open_store(through(fault_proxy))
    (key, _, blob), = make_chunks(ns, 1)
    assert await store.put(key, blob) is True
    assert await store.put(key, blob) is False
    assert store.stats()["conditional_put"] == "head"
    assert await store.get(key) == blob
    await store.close()
