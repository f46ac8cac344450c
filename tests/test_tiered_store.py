"""Tiers: reads promote, writes cascade, prefix_len spans tiers."""

from __future__ import annotations

from storage import open_store
from storage.tiered import TieredStore
from tests.store_helpers import make_chunks


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
