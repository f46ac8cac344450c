"""S3 servers as users run them: strict about headers, without conditional writes, path or
virtual-host addressing. Each setting either works or fails with one line naming the URL
option to change.

The strict servers are `FaultProxy` (tests/s3_fixtures.py) in front of moto, answering
400 or 501 to requests that carry a given header: it stands in for MinIO, Dell ECS and
other S3-compatible servers that refuse newer SDKs' checksum headers or If-None-Match
(which cannot run here).
"""

from __future__ import annotations

import pytest

from storage import ConfigError, StoreUnavailable, open_store
from tests.s3_fixtures import FaultProxy, s3_url
from tests.store_helpers import make_chunks

pytest_plugins = ("tests.s3_fixtures",)

SDK_CHECKSUM_HEADERS = ("x-amz-checksum-", "x-amz-sdk-checksum-", "x-amz-trailer")


def through(proxy: FaultProxy, name: str, **extra: str) -> str:
    return s3_url(proxy.endpoint, name, touch="0", retries="1", **extra)


async def round_trip(store, ns, seed: int = 0) -> None:
    (key, _, blob), = make_chunks(ns, 1, payload_size=50_000, seed=seed)
    assert await store.put(key, blob) is True
    assert await store.put(key, blob) is False  # create-only
    assert await store.get(key) == blob
    out = bytearray(60_000)
    assert await store.get_into(key, out) is not None
    assert await store.exists([key]) == [True]
    assert [k async for k in store.list_keys()] == [key]


@pytest.mark.parametrize("status", [400, 501])
async def test_default_settings_send_no_sdk_checksum_headers_so_strict_servers_work(
        fault_proxy, ns, status):
    for prefix in SDK_CHECKSUM_HEADERS:
        fault_proxy.refuse[prefix] = status
    store = open_store(through(fault_proxy, f"strict-{status}"))
    await round_trip(store, ns)
    assert not [h for h in fault_proxy.headers_seen if h.startswith(SDK_CHECKSUM_HEADERS)]
    assert await store.health() is None
    await store.close()


@pytest.mark.parametrize("status", [400, 501])
async def test_checksum_headers_a_server_refuses_fail_the_first_put_naming_the_option(
        fault_proxy, ns, status):
    """checksum=when_supported (botocore's default since 1.36) against a server that
    refuses CRC32 headers: one line naming checksum=when_required, from the put and from
    `health()` (what kvserver's readiness probe reports)."""
    for prefix in SDK_CHECKSUM_HEADERS:
        fault_proxy.refuse[prefix] = status
    store = open_store(through(fault_proxy, f"crc-{status}", checksum="when_supported"))
    (key, _, blob), = make_chunks(ns, 1, payload_size=50_000)
    with pytest.raises(StoreUnavailable, match=f"answers {status} .*set checksum=when_required"):
        await store.put(key, blob)
    assert "checksum=when_required" in (await store.health() or "")
    with pytest.raises(StoreUnavailable, match="checksum=when_required"):
        await store.put(key, blob)
    await store.close()


async def test_checksum_mode_on_gets_a_server_refuses_is_a_miss_naming_the_option(fault_proxy, ns):
    """Puts go through, but the server refuses the x-amz-checksum-mode header botocore
    adds to GETs with checksum=when_supported: the probe finds it at the first put."""
    fault_proxy.refuse["x-amz-checksum-mode"] = 400
    store = open_store(through(fault_proxy, "crc-get", checksum="when_supported"))
    (key, _, blob), = make_chunks(ns, 1, payload_size=50_000)
    with pytest.raises(StoreUnavailable, match="answers 400 to a plain get.*checksum=when_required"):
        await store.put(key, blob)
    assert await store.get(key) is None
    assert "checksum=when_required" in (await store.health() or "")
    await store.close()


@pytest.mark.parametrize("status", [400, 501])
async def test_a_server_refusing_if_none_match_gets_head_before_put(fault_proxy, ns, status):
    fault_proxy.refuse["if-none-match"] = status
    store = open_store(through(fault_proxy, f"inm-{status}"))
    await round_trip(store, ns)
    assert store.stats()["conditional_put"] == "head"
    await store.close()


async def test_forced_conditional_writes_a_server_refuses_name_the_option(fault_proxy, ns):
    fault_proxy.refuse["if-none-match"] = 501
    store = open_store(through(fault_proxy, "inm-forced", conditional="header"))
    (key, _, blob), = make_chunks(ns, 1, payload_size=50_000)
    with pytest.raises(StoreUnavailable, match="set conditional=auto or conditional=head"):
        await store.put(key, blob)
    await store.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_virtual_addressing_to_an_ip_or_localhost_endpoint_fails_at_open(host):
    with pytest.raises(ConfigError, match="set addressing=path") as err:
        open_store(f"s3://b/p?endpoint=http://{host}:9000&addressing=virtual")
    assert "\n" not in str(err.value)


async def test_path_addressing_is_the_default_with_an_endpoint_and_works(fault_proxy, ns):
    store = open_store(through(fault_proxy, "path", addressing="path"))
    await round_trip(store, ns)
    assert store.opts.addressing == open_store(through(fault_proxy, "x")).opts.addressing == "path"
    await store.close()
