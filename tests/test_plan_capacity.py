"""`kvstash plan`: capacity -> hit rate -> TTFT saved, and the break-even bandwidth."""

from __future__ import annotations

import json

import pytest

from bench.trace import break_even_bandwidth, kv_bytes_per_token, ttft_saved_s
from kvstash.cli import main
from tests.trace_fixtures import generate_trace, reference_best_hits, write_trace


@pytest.fixture
def trace(tmp_path):
    requests = generate_trace(seed=5)
    return requests, write_trace(tmp_path / "trace.jsonl", requests)


def plan(tmp_path, trace_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "plan.json"
    rc = main(["plan", "--trace", str(trace_path), "--model", "llama-3-8b",
               "--json", str(out), *extra])
    return rc, json.loads(out.read_text()) if out.exists() else {}


def test_break_even_is_where_loading_a_token_costs_its_recompute():
    bpt = kv_bytes_per_token("llama-3-8b")
    assert bpt == 128 * 1024  # DESIGN.md: Llama-3-8B bf16 is 128 KiB/token
    be = break_even_bandwidth(bpt, 10_000)
    assert be == bpt * 10_000
    assert ttft_saved_s(1000, bpt, 10_000, be) == pytest.approx(0.0, abs=1e-12)
    assert ttft_saved_s(1000, bpt, 10_000, 2 * be) > 0 > ttft_saved_s(1000, bpt, 10_000, be / 2)


def test_full_capacity_reaches_the_best_achievable_hit_rate(trace, tmp_path):
    requests, path = trace
    rc, result = plan(tmp_path, path, "--bandwidth", "10", "--prefill-tps", "10000",
                      "--plot", str(tmp_path / "plan.png"))
    assert rc == 0
    hits, blocks = reference_best_hits(requests)
    assert result["best_achievable_block_hit_rate"] == pytest.approx(hits / blocks)
    for name in ("lru", "s3fifo"):
        rows = [r for r in result["rows"] if r["policy"] == name]
        full = max(rows, key=lambda r: r["capacity_chunks"])
        assert full["capacity_chunks"] == result["working_set_chunks"]
        assert full["block_hit_rate"] == pytest.approx(hits / blocks)
        assert all(r["ttft_saved_ms_per_request"] > 0 for r in rows)
    assert result["recommendation"]["block_hit_rate"] >= 0.9 * hits / blocks
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_below_break_even_every_hit_costs_time(trace, tmp_path, capsys):
    _, path = trace
    # 128 KiB/token x 10k tokens/s = 1.31 GB/s break-even; plan for 0.5 GB/s.
    rc, result = plan(tmp_path, path, "--bandwidth", "0.5", "--prefill-tps", "10000")
    assert rc == 0
    assert result["break_even_gbps"] == pytest.approx(1.31072)
    assert all(r["ttft_saved_ms_per_request"] <= 0 for r in result["rows"])
    assert result["recommendation"] is None
    assert "recompute" in capsys.readouterr().out


def test_prefill_speed_can_come_from_a_bench_ttft_result(trace, tmp_path):
    _, path = trace
    ttft = tmp_path / "ttft.json"
    ttft.write_text(json.dumps({"results": [{"prefill_tokens_per_s": 2500.0}]}))
    rc, result = plan(tmp_path, path, "--bandwidth", "5", "--ttft-json", str(ttft),
                      "--capacities", "1GiB,64GiB")
    assert rc == 0
    assert result["prefill_tokens_per_s"] == 2500.0
    assert sorted({r["capacity_chunks"] for r in result["rows"]}) == [16, 1024]


def test_prefill_speed_of_a_single_bench_ttft_run(trace, tmp_path):
    _, path = trace
    ttft = tmp_path / "ttft.json"
    ttft.write_text(json.dumps({"prompt_tokens": 4096, "full_prefill_s": 2.048}))
    rc, result = plan(tmp_path, path, "--bandwidth", "5", "--ttft-json", str(ttft))
    assert rc == 0
    assert result["prefill_tokens_per_s"] == 2000.0


def test_plan_without_a_prefill_speed_fails_with_one_line(trace, tmp_path, capsys):
    _, path = trace
    rc, _ = plan(tmp_path, path, "--bandwidth", "5")
    assert rc == 2
    assert "--prefill-tps" in capsys.readouterr().err
