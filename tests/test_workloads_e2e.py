"""The workload runner end to end: a real random-weight model, the connector, a real file store."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.presets import bytes_per_token
from bench.workloads import add_workload_arguments, run_workload

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TINY = [
    "--model", "llama-test", "--chunk-tokens", "32", "--always-load",
    "--users", "2", "--rounds", "2", "--system-tokens", "64", "--answer-tokens", "16",
    "--question-tokens", "16", "--docs", "2", "--questions", "2", "--doc-tokens", "96",
    "--rag-questions", "4", "--passages", "4", "--top-k", "2", "--passage-tokens", "32",
    "--instruction-tokens", "32",
]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_workload_hits_exactly_its_reusable_prefix_within_rounding(tmp_path):
    out_json, out_png = tmp_path / "wl.json", tmp_path / "wl.png"
    store_dir = tmp_path / "kv"
    args = parse("--workload", "multi-turn,long-doc,rag", "--store", f"file://{store_dir}",
                 "--json", str(out_json), "--plot", str(out_png), *TINY)
    assert run_workload(args) == 0
    result = json.loads(out_json.read_text())
    by_name = {r["workload"]: r for r in result["results"]}
    assert set(by_name) == {"multi-turn", "long-doc", "rag"}
    bpt = bytes_per_token("llama-test")
    for r in by_name.values():
        assert r["token_hit_rate"] == pytest.approx(r["ideal_hit_rate"])
        # Logits equal to the cold full pass up to the kernels' rounding (a suffix-only pass
        # may block its matmuls differently from a full pass; the first token can then
        # differ only where the top two logits are closer than that rounding).
        assert r["within_rounding"]
        assert all(p["max_abs_logit_diff"] <= p["recompute_tolerance"] for p in r["per_prompt"])
        assert r["bytes_loaded"] == r["hit_tokens"] * bpt
        assert r["bytes_saved"] > 0 and r["load_failures"] == 0
        assert r["prompts"] == len(r["per_prompt"])
        assert r["cold_p50_s"] > 0 and r["warm_p50_s"] > 0
    assert by_name["multi-turn"]["hit_tokens"] > 0 and by_name["long-doc"]["hit_tokens"] > 0
    assert result["prefill_tokens_per_s"] > 0
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    # The run removes its own chunks: a second run starts cold.
    assert not list(store_dir.rglob("*.kv"))


def test_an_unknown_workload_is_named():
    with pytest.raises(ValueError, match="known: multi-turn"):
        run_workload(parse("--workload", "chat", "--store", "memory://", *TINY))
