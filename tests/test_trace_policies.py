"""Eviction policies: capacity bounds, LRU order, and S3-FIFO's scan resistance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.policies import POLICIES, make_policy


def access(policy, key) -> list:
    if key in policy:
        policy.hit(key)
        return []
    return policy.insert(key)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["lru", "s3fifo", "fifo"]),
    capacity=st.integers(1, 12),
    keys=st.lists(st.integers(0, 30), max_size=300),
)
def test_residency_never_exceeds_capacity_and_victims_leave(name, capacity, keys):
    policy = make_policy(name, capacity)
    resident: set[int] = set()
    for k in keys:
        was_resident = k in policy
        victims = access(policy, k)
        if not was_resident:
            resident.add(k)
        assert len(set(victims)) == len(victims)
        for v in victims:
            assert v in resident and v not in policy
            resident.discard(v)
        assert len(policy) == len(resident) <= capacity
        assert all(r in policy for r in resident)


def test_lru_evicts_the_least_recently_used():
    lru = make_policy("lru", 3)
    for k in "abc":
        access(lru, k)
    access(lru, "a")
    assert access(lru, "d") == ["b"]
    assert access(lru, "e") == ["c"]


def test_fifo_ignores_hits():
    fifo = make_policy("fifo", 3)
    for k in "abc":
        access(fifo, k)
    access(fifo, "a")
    assert access(fifo, "d") == ["a"]


def hot_keys_surviving_a_scan(name: str) -> int:
    """Ten hot keys used repeatedly, then a one-pass scan twice the cache size."""
    policy = make_policy(name, 40)
    hot = [f"hot{i}" for i in range(10)]
    for _ in range(3):
        for k in hot:
            access(policy, k)
    for i in range(80):
        access(policy, f"scan{i}")
    return sum(k in policy for k in hot)


def test_s3fifo_keeps_hot_keys_through_a_scan_that_flushes_lru():
    assert hot_keys_surviving_a_scan("lru") == 0
    assert hot_keys_surviving_a_scan("s3fifo") == 10


def test_s3fifo_readmits_a_recent_ghost_straight_to_main():
    policy = make_policy("s3fifo", 10)  # the small queue's share is 1
    for k in ["once", *"abcdefghi"]:
        access(policy, k)
    access(policy, "j")  # full: "once", never hit, leaves the small queue as a ghost
    assert "once" not in policy
    access(policy, "once")  # back within the ghost window: goes to main
    for i in range(20):  # a scan churns only the small queue
        access(policy, f"scan{i}")
    assert "once" in policy


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="s3fifo"):
        make_policy("arc", 10)
    assert set(POLICIES) >= {"lru", "s3fifo"}


def test_capacity_none_means_unlimited():
    policy = make_policy("lru", None)
    for i in range(10_000):
        assert access(policy, i) == []
    assert len(policy) == 10_000
