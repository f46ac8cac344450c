"""The floors of the package: storage at the bottom, gds above it, each importing only down.

storage, hashing and kvserver run without torch (a server host has none) and never import
gds: a store that reads directly into device buffers is handed its ChunkIO from above
(`gds.enable_direct_reads`). Imports under `if TYPE_CHECKING:` are for the type checker
only and do not count.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> the packages it must never import, at module level or inside a function
FORBIDDEN = {
    "storage": {"gds", "connector", "kvserver", "torch"},
    "hashing": {"storage", "gds", "connector", "kvserver", "torch"},
    "kvserver": {"gds", "connector", "torch"},
}


def _runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every import in `path` that runs (not type-only)."""
    tree = ast.parse(path.read_text(), str(path))
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for child in node.body for n in ast.walk(child))
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_lower_package_never_imports_one_above_it(package: str):
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((ROOT / package).rglob("*.py"))
             for line, module in _runtime_imports(path) if module in FORBIDDEN[package]]
    assert not wrong, "\n".join(wrong)


def test_storage_and_the_server_import_and_open_tiers_with_torch_and_gds_blocked(tmp_path):
    code = f"""
import sys
sys.modules["torch"] = None  # any import of it fails
sys.modules["gds"] = None
import asyncio, hashing, kvserver.app, storage.tiered, storage.tenancy
from storage import open_store
from storage.capabilities import SupportsDirectReads
store = open_store(["memory://", "file://{tmp_path}/a"])
direct = open_store(["file://{tmp_path}/b", "memory://"])
assert isinstance(direct, SupportsDirectReads) and direct.chunk_io is None
asyncio.run(store.close()); asyncio.run(direct.close())
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
