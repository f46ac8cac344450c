"""The `kvstash` command line: help everywhere, one-line errors, ls/stat/gc on a real store."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from kvstash.cli import build_parser, main
from storage.file import FileStore
from tests.store_helpers import make_chunks


def _commands():
    parser = build_parser()
    out = []
    for action in parser._subparsers._group_actions:
        for name, sub in action.choices.items():
            if sub._subparsers is None:
                out.append([name])
            else:
                for a in sub._subparsers._group_actions:
                    out.extend([name, s] for s in a.choices)
    return out


def test_every_command_has_help():
    commands = _commands()
    assert ["ls"] in commands and ["bench", "store"] in commands
    for words in commands:
        with pytest.raises(SystemExit) as exc:
            main([*words, "--help"])
        assert exc.value.code == 0


def test_errors_are_one_line_and_exit_non_zero(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvstash.cli", "ls", "--store", "nope://x"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and "unknown store scheme" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvstash.cli", "gc", "--store", f"file://{tmp_path}",
                        "--capacity", "huge"], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "--capacity" in r.stderr


def test_ls_stat_and_gc_on_a_file_store(tmp_path, ns, capsys):
    chunks = make_chunks(ns, 4, payload_size=10_000)
    store = FileStore(tmp_path)

    async def fill():
        for k, _, b in chunks:
            await store.put(k, b)

    asyncio.run(fill())
    url = f"file://{tmp_path}"
    assert main(["ls", "--store", url]) == 0
    assert set(capsys.readouterr().out.split()) == {k for k, _, _ in chunks}
    assert main(["stat", "--store", url, chunks[0][0]]) == 0
    assert json.loads(capsys.readouterr().out)["payload_bytes"] == 10_000
    assert main(["gc", "--store", url, "--capacity", str(2 * len(chunks[0][2]))]) == 0
    assert json.loads(capsys.readouterr().out)["evicted"] == 2
    assert len(list(tmp_path.rglob("*.kv"))) == 2


def test_bench_store_prints_ratios_against_the_raw_baseline(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "store", "--store", f"file://{tmp_path}/s", "--sizes", "1",
                 "--concurrency", "1,2", "--count", "3", "--rounds", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "get ratio" in printed and "raw preadv" in printed
    result = json.loads(out.read_text())
    assert {r["concurrency"] for r in result["rows"]} == {1, 2}
    assert all(r["baselines"][0]["get_gbps"] > 0 for r in result["rows"])
    assert result["machine"]["cores"] >= 1
