"""The `kvstash` command line: help everywhere, one-line errors (tracebacks with --verbose),
ls/stat/gc on a real store, and never a store created by reading one."""

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
    assert main(["stat", "--json", "--store", url, chunks[0][0]]) == 0
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


def kvstash(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstash.cli", *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", [["ls"], ["stat"], ["gc", "--capacity", "1GiB"]])
def test_read_commands_on_a_missing_directory_say_so_and_create_nothing(tmp_path, command):
    missing = tmp_path / "nonexistent" / "x"
    r = kvstash(*command, "--store", f"file://{missing}")
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"no store at file://{missing}" in r.stderr and "does not exist" in r.stderr
    assert not (tmp_path / "nonexistent").exists()


def test_read_commands_refuse_a_file_where_the_store_directory_should_be(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    r = kvstash("ls", "--store", f"file://{tmp_path}/f")
    assert r.returncode != 0 and "is not a directory" in r.stderr


def test_a_memory_store_alone_has_nothing_to_read_from_the_command_line():
    r = kvstash("stat", "--store", "memory://?capacity=1GiB")
    assert r.returncode != 0 and r.stderr.count("\n") == 1
    assert "memory://" in r.stderr and "inside one process" in r.stderr


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_prints_the_traceback_above_the_one_line_error(tmp_path, where):
    args = ["ls", "--store", f"file://{tmp_path}/missing"]
    quiet = kvstash(*args)
    assert "Traceback" not in quiet.stderr
    loud = kvstash(*(["--verbose", *args] if where == "before" else [*args, "--verbose"]))
    assert loud.returncode == quiet.returncode != 0
    assert loud.stderr.startswith("Traceback (most recent call last):")
    assert "storage/admin.py" in loud.stderr and "ConfigError" in loud.stderr
    assert loud.stderr.splitlines()[-1] == quiet.stderr.strip()


def test_stat_prints_a_summary_for_people_and_json_for_tools(tmp_path, ns, capsys):
    chunks = make_chunks(ns, 3, payload_size=10_000)
    store = FileStore(tmp_path, capacity=1 << 20)

    async def fill():
        for k, _, b in chunks:
            await store.put(k, b)

    asyncio.run(fill())
    url = f"file://{tmp_path}?capacity=1MiB"
    used = sum(len(b) for _, _, b in chunks)

    assert main(["stat", "--store", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"store:     {url} (file)"
    assert "chunks:    3 listed" in lines[1]
    assert lines[2].startswith("used:      ") and "of 1.0 MiB" in lines[2]
    assert f"({100 * used / (1 << 20):.1f} %)" in lines[2]
    assert not any(line.lstrip().startswith("{") for line in lines)

    assert main(["stat", "--json", "--store", url]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["listed_chunks"] == 3 and raw["used_bytes"] == used

    key = chunks[0][0]
    assert main(["stat", "--store", url, key]) == 0
    out = capsys.readouterr().out
    assert f"key:       {key}" in out and "payload:   " in out and "(10000 bytes)" in out


def test_stat_of_tiers_summarises_each_tier(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert main(["stat", "--store", "memory://", "--store", f"file://{tmp_path}/a",
                 "--store", f"file://{tmp_path}/b"]) == 0
    out = capsys.readouterr().out
    assert out.count("tier ") == 3 and f"store:     file://{tmp_path}/b (file)" in out


def test_in_flight_limits_have_one_spelling_and_the_former_flag_still_reads():
    import argparse

    from kvserver.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--max-in-flight-bytes", "2MiB"]).max_in_flight_bytes == 2 << 20
    assert p.parse_args(["--max-inflight-bytes", "3MiB"]).max_in_flight_bytes == 3 << 20
