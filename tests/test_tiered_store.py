"""Tiers: reads promote, writes cascade, prefix_len spans tiers."""

from __future__ import annotations

from storage import open_store
from storage.tiered import TieredStore
from tests.s3_fixtures import s3_url
from tests.store_helpers import make_chunks

pytest_plugins = ("tests.s3_fixtures",)


def _tiers(tmp_path) -> TieredStore:
    return open_store(["memory://?capacity=16MiB", f"file://{tmp_path}/disk"])


async def test_writes_land_in_the_first_tier_and_cascade_down(tmp_path, ns):
    store = _tiers(tmp_path)
    (key, _, blob), = make_chunks(ns, 1)
    assert await store.put(key, blob)
    assert await store.tiers[0].exists([key]) == [True]
    await store.flush()
    assert await store.tiers[1].exists([key]) == [True]


async def test_a_hit_in_a_lower_tier_is_promoted(tmp_path, ns):
    store = _tiers(tmp_path)
    (key, _, blob), = make_chunks(ns, 1)
    await store.tiers[1].put(key, blob)
    assert bytes(await store.get(key)) == blob
    await store.flush()
    assert await store.tiers[0].exists([key]) == [True]


async def test_get_into_promotes_too(tmp_path, ns):
    store = _tiers(tmp_path)
    (key, _, blob), = make_chunks(ns, 1)
    await store.tiers[1].put(key, blob)
    assert await store.get_into(key, bytearray(len(blob))) is not None
    await store.flush()
    assert await store.tiers[0].exists([key]) == [True]


async def test_prefix_len_counts_a_prefix_split_across_tiers(tmp_path, ns):
    store = _tiers(tmp_path)
    chunks = make_chunks(ns, 4)
    await store.tiers[0].put(chunks[0][0], chunks[0][2])
    await store.tiers[1].put(chunks[1][0], chunks[1][2])
    await store.tiers[0].put(chunks[3][0], chunks[3][2])
    assert await store.prefix_len([k for k, _, _ in chunks]) == 2


async def test_memory_eviction_falls_back_to_the_disk_tier(tmp_path, ns):
    chunks = make_chunks(ns, 6, payload_size=4000)
    store = open_store([f"memory://?capacity={2 * len(chunks[0][2])}", f"file://{tmp_path}/d"])
    for k, _, b in chunks:
        await store.put(k, b)
    await store.flush()
    assert store.tiers[0].stats()["chunks"] == 2
    assert await store.prefix_len([k for k, _, _ in chunks]) == 6
    assert bytes(await store.get(chunks[0][0])) == chunks[0][2]


async def test_the_caller_may_reuse_its_buffer_as_soon_as_put_returns(tmp_path, ns):
    """The cascade to lower tiers runs later: it must not read the caller's buffer then."""
    store = _tiers(tmp_path)
    (key, _, blob), = make_chunks(ns, 1)
    buf = bytearray(blob)
    assert await store.put(key, memoryview(buf))
    buf[:] = bytes(len(buf))  # the caller reuses its buffer (kvserver's pooled PUT bodies do)
    await store.flush()
    assert await store.tiers[0].get(key) == blob
    assert await store.tiers[1].get(key) == blob


async def test_a_tier_listing_names_each_key_once_and_holds_no_set_of_them(tmp_path, ns):
    """Keys in both tiers are listed once; the listing asks the tier above about a lower
    tier's keys a batch at a time instead of remembering every key it has listed."""
    store = open_store(["memory://?capacity=64MiB", f"file://{tmp_path}/lower"])
    chunks = make_chunks(ns, 3000, payload_size=16)
    upper, lower = store.tiers
    for key, _, blob in chunks[:1500]:
        await upper.put(key, blob)
    for key, _, blob in chunks[1000:]:
        await lower.put(key, blob)
    listed = [k async for k in store.list_keys()]
    assert sorted(listed) == sorted(k for k, _, _ in chunks)
    asked = []
    real_exists = upper.exists

    async def counting_exists(keys):
        asked.append(len(keys))
        return await real_exists(keys)

    upper.exists = counting_exists
    assert len([k async for k in store.list_keys()]) == 3000
    assert asked and max(asked) <= 1024


# -- a local directory in front of a bucket ------------------------------------------------


def _local_over_bucket(tmp_path, proxy) -> TieredStore:
    return open_store([f"file://{tmp_path}/nvme?capacity=64MiB",
                       s3_url(proxy.endpoint, "tiers", timeout="2s")])


async def test_a_second_client_on_the_host_hits_the_local_tier_without_asking_the_bucket(
        tmp_path, ns, fault_proxy):
    chunks = make_chunks(ns, 3)
    writer = _local_over_bucket(tmp_path, fault_proxy)
    for key, _, blob in chunks:
        await writer.put(key, blob)
    await writer.close()  # the cascade to the bucket has landed
    keys = [key for key, _, _ in chunks]
    assert await writer.tiers[1].exists(keys) == [True] * 3
    asked = fault_proxy.requests
    reader = _local_over_bucket(tmp_path, fault_proxy)  # e.g. another engine process
    assert await reader.prefix_len(keys) == 3
    assert [bytes(await reader.get(k)) for k in keys] == [blob for _, _, blob in chunks]
    assert fault_proxy.requests == asked  # no HEAD, no GET
    await reader.close()


async def test_an_unreachable_bucket_leaves_local_hits_unaffected(tmp_path, ns, fault_proxy):
    chunks = make_chunks(ns, 3)
    store = _local_over_bucket(tmp_path, fault_proxy)
    for key, _, blob in chunks[:2]:
        await store.tiers[0].put(key, blob)
    fault_proxy.set("reset")  # every request to the bucket: connection reset
    keys = [key for key, _, _ in chunks]
    # The third chunk is nowhere local and the bucket cannot be asked: the local prefix.
    assert await store.prefix_len(keys) == 2
    assert await store.exists(keys) == [True, True, False]
    assert bytes(await store.get(keys[0])) == chunks[0][2]
    await store.tiers[0].close()


async def test_a_lower_tier_that_fails_a_lookup_is_a_miss_below_the_local_prefix(tmp_path, ns):
    from storage.errors import StoreUnavailable

    class Down(TieredStore):
        """Stands in for a bucket whose client raises (the S3 store answers False)."""

        async def exists(self, keys):
            raise StoreUnavailable("bucket down")

        async def prefix_len(self, keys):
            raise StoreUnavailable("bucket down")

    chunks = make_chunks(ns, 2)
    local = open_store(f"file://{tmp_path}/nvme")
    await local.put(chunks[0][0], chunks[0][2])
    store = TieredStore([local, Down([open_store("memory://")])])
    keys = [key for key, _, _ in chunks]
    assert await store.prefix_len(keys) == 1
    assert await store.exists(keys) == [True, False]
    assert store.stats()["errors"] == 2
