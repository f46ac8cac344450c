"""Fixtures for the reliability suite: stores on real disks, a small mounted filesystem,
and a kvserver process that a test may kill and restart on the same port."""

from __future__ import annotations

import contextlib
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

    def __init__(self, args: list[str], port: int, log_path: Path):
        self.args = args
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstash.cli", "serve", "--host", "127.0.0.1",
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


def env_without_proxies() -> dict[str, str]:
    """Loopback traffic must never go through a configured HTTP proxy."""
    env = dict(os.environ)
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy"):
        env.pop(name, None)
    env["NO_PROXY"] = "127.0.0.1,localhost"
    return env
