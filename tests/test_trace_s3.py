"""Trace replay through a real S3 server (moto on 127.0.0.1): same hits as everywhere else."""

from __future__ import annotations

from bench.policies import make_policy
from bench.trace import load_trace, replay
from storage import open_store
from tests.s3_fixtures import with_prefix
from tests.trace_fixtures import (
    generate_trace,
    reference_best_hits,
    reference_lru_hits,
    write_trace,
)

pytest_plugins = ("tests.s3_fixtures",)


async def test_replay_through_s3_hits_the_reference_counts_and_cleans_up(moto_s3_url, tmp_path):
    raw = generate_trace(seed=7, conversations=6, rounds=4, one_offs=10)
    requests = load_trace(write_trace(tmp_path / "trace.jsonl", raw))
    store = open_store(with_prefix(moto_s3_url))
    try:
        unlimited = await replay(requests, store, make_policy("unlimited", None), 512)
        lru = await replay(requests, store, make_policy("lru", 8), 512)
        leftover = [k async for k in store.list_keys()]
    finally:
        await store.close()
    assert unlimited.counts.hit_blocks == reference_best_hits(raw)[0] > 0
    assert lru.counts.hit_blocks == reference_lru_hits(raw, 8)
    assert unlimited.disagreements == lru.disagreements == 0
    assert leftover == []
