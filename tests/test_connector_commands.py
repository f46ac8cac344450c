"""`kvstash demo` and `kvstash bench ttft` run end to end on tiny presets (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parent.parent


def kvstash(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstash.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def test_demo_serves_a_warm_hit_from_kvserver_and_cleans_up(tmp_path):
    """The demo starts and stops its own kvserver on the default store under KVSTASH_HOME."""
    env = {**os.environ, "KVSTASH_HOME": str(tmp_path / "home")}
    out = tmp_path / "demo.json"
    proc = kvstash("demo", "--model", "llama-test", "--prompt-tokens", "256",
                   "--chunk-tokens", "32", "--json", str(out), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["cold_hit_tokens"] == 0
    assert result["saved_chunks"] == 8
    assert result["warm_hit_tokens"] == 224  # 7 whole chunks; the last token is computed
    assert result["loaded_bytes"] == 7 * 32 * 2048
    assert result["logits_identical"] is True
    assert "request 2 (warm)" in proc.stdout
    assert not list((tmp_path / "home" / "store").rglob("*.kv"))  # the demo's chunks deleted


def test_bench_ttft_reports_miss_hit_and_ideal_with_exact_logits(tmp_path):
    out = tmp_path / "ttft.json"
    proc = kvstash("bench", "ttft", "--model", "qwen2-test", "--prompt-tokens", "256",
                   "--cached-tokens", "192", "--chunk-tokens", "32", "--repeat", "1",
                   "--store", f"file://{tmp_path / 'kv'}", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["hit_tokens"] == 192 and result["exact"] is True
    assert result["load_bytes"] == 192 * 2048
    for name in ("full_prefill_s", "miss_s", "hit_s", "ideal_s", "load_overhead_vs_ideal",
                 "miss_cost_vs_full", "speedup_vs_full"):
        assert name in result
    assert "ideal (prefix KV already in memory)" in proc.stdout
