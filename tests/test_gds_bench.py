"""`kvstash bench gds` verifies every path it times and writes its table as JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import bench.gds


def main(argv: list[str]) -> int:
    """`kvstash bench gds ARGS`, through the command module's own parser."""
    parser = argparse.ArgumentParser()
    bench.gds.add_arguments(parser)
    return bench.gds.run(parser.parse_args(argv))


def test_bench_gds_verifies_every_path_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gds.json"
    rc = main(["--dir", str(tmp_path / "chunks"), "--size-mib", "0.25",
               "--count", "2", "--rounds", "1", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "readinto, 1 thread" in printed and "vs single-threaded readinto" in printed
    result = json.loads(out.read_text())
    paths = {row["path"]: row for row in result["rows"]}
    assert all(row["verified"] for row in result["rows"])
    assert paths["host (path 4), verify=header"]["vs"] == "readinto, 1 thread"
    # The connector's whole load from a file:// store, through ChunkIO and through the store.
    assert {"connector load, ChunkIO, 2 in flight", "connector load, store reads, 2 in flight"} <= set(paths)
    assert result["stats"]["backends"]["cpu"] == "host"
    assert list((tmp_path / "chunks").iterdir()) == []  # its chunk files are removed


def test_the_command_module_does_not_import_torch():
    code = "import sys, bench.gds, gds; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
