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
    rc = main(["--dir", str(tmp_path / "chunks"), "--size-mib", "0.25", "--threads", "2",
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
    # The references beside it, verified like every path: a plain parallel reader and memcpy.
    assert {"preadv, 2 threads, payload only", "memcpy host->host, 1 thread (memory bandwidth)",
            "memcpy host->host, 2 threads (memory bandwidth)"} <= set(paths)
    assert result["memcpy_threads_vs_one"] > 0 and set(result["host_vs_plain_parallel"]) == {
        "blocking call", "through a Future"}
    assert list((tmp_path / "chunks").iterdir()) == []  # its chunk files are removed


def test_the_command_module_does_not_import_torch():
    code = "import sys, bench.gds, gds; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_connector_rows_for_device_staging_fill_the_destinations(tmp_path):
    # The three "connector load -> CUDA" rows with CPU tensors standing in for the device
    # ones (this test runs on CPU hosts too): ChunkIO straight into the staging, and ChunkIO
    # or store reads into the "pinned" staging with one copy per chunk as it is placed. On a
    # GPU host `kvstash bench gds` runs the same rows with CUDA tensors.
    import numpy as np
    import torch

    from gds import aligned_empty

    size = 256 * 2 * 128 * 2  # one KV head of 256 tokens: the smallest connector layout
    refs = [np.frombuffer(np.random.default_rng(i).bytes(size), dtype=np.uint8) for i in range(3)]
    host = [aligned_empty(size).numpy() for _ in refs]
    dev = [torch.zeros(size, dtype=torch.uint8) for _ in refs]
    pinned = [torch.zeros(size, dtype=torch.uint8) for _ in refs]

    def check_dev() -> bool:
        return all(np.array_equal(d.numpy(), r) for d, r in zip(dev, refs, strict=True))

    paths = []
    conns, _ = bench.gds._connector_paths(
        argparse.Namespace(), str(tmp_path), refs, host, lambda: True, "readinto", paths,
        (dev, pinned, check_dev, "torch H2D copy from pinned memory"))
    try:
        rows = [p for p in paths if p.name.startswith("connector load -> CUDA")]
        assert [r.name.split(", ")[1].split(" (")[0] for r in rows] == [
            "ChunkIO", "ChunkIO + H2D", "store reads + H2D"]  # "ChunkIO (<its CUDA backend>)"
        for row in rows:
            for d in dev:
                d.zero_()
            row.read_all()
            assert row.check()
        assert conns[0].stats()["chunk_io"]["counters"]["chunk_reads"] == 6
    finally:
        for c in conns:
            c.close()


def test_cold_rounds_drop_the_connector_rows_chunk_files_too(tmp_path, monkeypatch):
    # The connector rows read the store's own copies of the chunks; a --cold round that
    # left those cached timed page-cache reads under a "cold" heading (seen on an H100 host).
    dropped: list[str] = []
    real = bench.gds._drop_cache
    monkeypatch.setattr(bench.gds, "_drop_cache", lambda paths: (dropped.extend(paths), real(paths)))
    assert main(["--dir", str(tmp_path / "chunks"), "--size-mib", "0.25", "--threads", "2",
                 "--count", "2", "--rounds", "1", "--cold"]) == 0
    assert any("/store-" in p and p.endswith(".kv") for p in dropped), dropped
