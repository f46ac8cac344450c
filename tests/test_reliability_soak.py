"""`kvstash bench soak` end to end, short: the scenarios that need no extra servers run,
print their summary, write JSON, and report zero data lost and zero violations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_short_soak_reports_faults_survived_and_nothing_lost(tmp_path: Path):
    out = tmp_path / "soak.json"
    only = ["crash-file", "corrupt-file", "full-disk", "load-file", "fuzz"]
    done = subprocess.run(
        [sys.executable, "-m", "kvstash.cli", "bench", "soak", "--duration", "4",
         "--workdir", str(tmp_path / "work"), "--json", str(out),
         *(arg for name in only for arg in ("--only", name))],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "data lost 0" in done.stdout
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["data_lost"] == 0 and summary["wrong_reads"] == 0
    assert summary["violations"] == 0
    assert summary["faults_injected"] > 0
    assert summary["faults_survived"] == summary["faults_injected"]
    assert summary["inputs_tried"] > 0
    assert [s["name"].split(":")[0] for s in result["scenarios"]] == [
        "crash", "corruption", "full disk", "load", "hostile input"]
