"""The declared Python floor (`requires-python`) is true: ruff checks against it, the code
uses nothing newer than it among the version-marked names below, and this interpreter meets it.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["hashing", "storage", "gds", "kvserver", "connector", "bench", "kvstash", "tests"]

# Standard-library names and the Python version that added them.
NEWER_NAMES = {
    r"\basyncio\.timeout\(": (3, 11),
    r"\basyncio\.TaskGroup\b": (3, 11),
    r"^\s*import tomllib\b": (3, 11),
    r"\bdatetime\.UTC\b|\bfrom datetime import .*\bUTC\b": (3, 11),
    r"\bexcept\*": (3, 11),
    r"\bitertools\.batched\b": (3, 12),
    r"^\s*type \w+(\[.*\])? = ": (3, 12),
    r"\bwarnings\.deprecated\b": (3, 13),
}


def floor() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    assert m, f"requires-python {spec!r}: expected '>=X.Y'"
    return int(m[1]), int(m[2])


def test_ruff_checks_against_the_declared_floor():
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    major, minor = floor()
    assert ruff["target-version"] == f"py{major}{minor}"


def test_the_code_uses_nothing_newer_than_the_floor_and_the_floor_is_needed():
    newest: dict[tuple[int, int], list[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue  # this file names them all
            text = path.read_text()
            for pattern, version in NEWER_NAMES.items():
                m = re.search(pattern, text, re.M)
                if m:
                    newest.setdefault(version, []).append(f"{path.relative_to(ROOT)}: {m[0].strip()}")
    too_new = {v: uses for v, uses in newest.items() if v > floor()}
    assert not too_new, f"requires-python is {floor()}, but the code uses {too_new}"
    # asyncio.timeout (3.11) is what sets the floor: a lower one would be untrue.
    assert max(newest) == floor(), newest


def test_this_interpreter_meets_the_floor():
    assert sys.version_info[:2] >= floor()
