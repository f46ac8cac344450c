"""Trace replay through real stores: hit counts against independent computations."""

from __future__ import annotations

import json

import pytest

from bench.policies import make_policy
from bench.trace import load_trace, replay, simulate
from kvstash.cli import main
from storage import open_store
from tests.trace_fixtures import (
    BLOCK,
    generate_trace,
    reference_best_hits,
    reference_lru_hits,
    write_trace,
)

PAYLOAD = 1024


@pytest.fixture
def trace_file(tmp_path):
    return write_trace(tmp_path / "trace.jsonl", generate_trace(seed=3))


async def test_unlimited_replay_hits_exactly_the_best_achievable_blocks(trace_file):
    requests = load_trace(trace_file)
    expected_hits, expected_blocks = reference_best_hits(
        [json.loads(line) for line in trace_file.read_text().splitlines()]
    )
    assert expected_hits > 0, "the generated trace must have reuse to be a meaningful test"
    store = open_store("memory://?capacity=1GiB")
    result = await replay(requests, store, make_policy("unlimited", None), PAYLOAD)
    assert result.counts.blocks == expected_blocks
    assert result.counts.hit_blocks == expected_hits
    assert result.disagreements == 0


@pytest.mark.parametrize("capacity", [4, 15, 40])
async def test_lru_replay_through_a_file_store_matches_a_naive_lru(trace_file, tmp_path, capacity):
    raw = [json.loads(line) for line in trace_file.read_text().splitlines()]
    store = open_store(f"file://{tmp_path}/kv?fsync=false")
    result = await replay(load_trace(trace_file), store, make_policy("lru", capacity), PAYLOAD)
    assert result.counts.hit_blocks == reference_lru_hits(raw, capacity)
    assert result.disagreements == 0
    assert result.counts.evictions > 0


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "fifo"])
async def test_the_store_holds_exactly_the_policys_resident_chunks(trace_file, policy):
    requests = load_trace(trace_file)
    store = open_store("memory://?capacity=1GiB")
    chosen = make_policy(policy, 20)
    result = await replay(requests, store, chosen, PAYLOAD, cleanup=False)
    stored = [k async for k in store.list_keys()]
    assert len(stored) == len(chosen) <= 20
    assert all(k in chosen for k in stored)
    assert result.disagreements == 0
    assert result.bytes_written == result.counts.writes * (4096 + PAYLOAD)


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
async def test_store_replay_and_storeless_simulation_agree(trace_file, policy):
    requests = load_trace(trace_file)
    store = open_store("memory://?capacity=1GiB")
    replayed = await replay(requests, store, make_policy(policy, 25), PAYLOAD)
    simulated = simulate(requests, make_policy(policy, 25))
    assert replayed.counts == simulated


async def test_replay_cleans_up_its_chunks(trace_file):
    store = open_store("memory://?capacity=1GiB")
    await replay(load_trace(trace_file), store, make_policy("lru", 10), PAYLOAD)
    assert [k async for k in store.list_keys()] == []


def test_hit_tokens_cap_at_the_prompt_length(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 2 * BLOCK - 7, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 2 * BLOCK - 7, "hash_ids": [1, 2]},
    ])
    counts = simulate(load_trace(path), make_policy("unlimited", None))
    assert counts.hit_blocks == 2
    assert counts.hit_tokens == 2 * BLOCK - 7


def test_requests_replay_in_arrival_order_not_file_order(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 20, "input_length": BLOCK, "hash_ids": [7]},
        {"timestamp": 5, "input_length": BLOCK, "hash_ids": [7]},
        {"timestamp": 5, "input_length": BLOCK, "hash_ids": [8]},
    ])
    assert [r.timestamp for r in load_trace(path)] == [5, 5, 20]
    assert [r.hash_ids for r in load_trace(path)][:2] == [(7,), (8,)]
    assert load_trace(path, limit=1)[0].hash_ids == (7,)


def test_a_malformed_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(path)


def test_bench_trace_command_writes_curve_json_and_png(trace_file, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "curve.png"
    rc = main([
        "bench", "trace", "--trace", str(trace_file), "--store", f"file://{tmp_path}/kv?fsync=0",
        "--model", "llama-3-8b", "--scale", "1/32768", "--fractions", "0.1,0.5",
        "--prefill-tps", "5000", "--json", str(out_json), "--plot", str(out_png),
    ])
    assert rc == 0
    result = json.loads(out_json.read_text())
    assert result["unlimited_matches_best"] is True
    assert result["payload_bytes"] == 128 * 1024 * 512 // 32768
    runs = {(r["policy"], r["capacity_fraction"]) for r in result["runs"]}
    assert {("unlimited", None), ("lru", 0.1), ("s3fifo", 0.5)} <= {
        (p, None if f is None else round(f, 1)) for p, f in runs
    }
    assert all(r["disagreements"] == 0 for r in result["runs"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "equal" in capsys.readouterr().out
