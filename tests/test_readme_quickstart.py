"""The README's quickstart runs as written: its python blocks, in order, in a fresh interpreter.

Real parts throughout: a file:// store in a temporary directory and a transformers model with
random weights. The blocks are read from README.md on every run, so an edit that breaks them
fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def quickstart_blocks(readme: str) -> list[str]:
    """The ```python blocks of the README's "## Quickstart" section, in order."""
    section = re.search(r"^## Quickstart\n(.*?)(?=^## )", readme, re.M | re.S)
    assert section, "README.md has no '## Quickstart' section"
    return re.findall(r"^```python\n(.*?)^```", section.group(1), re.M | re.S)


def test_quickstart_has_the_store_and_the_model_example():
    blocks = quickstart_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 2
    assert "open_store" in blocks[0] and "CachedPrefill" in blocks[1]


def test_quickstart_runs_as_pasted_and_prints_what_its_comments_say(tmp_path):
    code = "\n".join(quickstart_blocks((ROOT / "README.md").read_text()))
    env = dict(os.environ, TMPDIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["4", "{'i': 0} 4096", "192"], proc.stdout
    # Everything it wrote lies in the temporary directory it was given: 4 + 6 chunk files.
    chunks = list(tmp_path.glob("kvstash-*/**/*.kv"))
    assert len(chunks) == 10, chunks
