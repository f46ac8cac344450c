"""Real kvservers for tests: `kvstash serve` in a subprocess on 127.0.0.1 and a free port.

`kvserver_url` (session-scoped) serves an in-memory store and yields its http:// URL, so
any suite can add http:// to its store URLs; `kvserver_unix_url` serves a file store on a
Unix socket too and yields the socket's URL. `running_kvserver(*flags)` starts one with
any flags for a single test and always stops it.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

START_TIMEOUT_S = 30.0


@dataclass
class KvServer:
    url: str
    proc: subprocess.Popen
    log_path: str
    banner: str

    @property
    def banner_store(self) -> str:
        """The store URL(s) the start-up line names."""
        return self.banner.split(" -> ", 1)[1].rsplit(" (", 1)[0]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def _read_banner(proc: subprocess.Popen, deadline: float) -> str:
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise RuntimeError(f"kvserver did not start (exit code {proc.poll()})")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            byte = os.read(proc.stdout.fileno(), 1)
            if not byte:
                raise RuntimeError(f"kvserver closed stdout (exit code {proc.wait()})")
            line += byte
    return line.decode()


@contextlib.contextmanager
def running_kvserver(*flags: str, env: dict[str, str] | None = None) -> Iterator[KvServer]:
    """`kvstash serve --port 0 FLAGS...` until the block ends; yields its URL and process.

    Runs `python -m kvserver.cli` (the same code as `kvstash serve`, without importing the
    other commands) so a server test depends on nothing but the server."""
    log = tempfile.NamedTemporaryFile(prefix="kvserver-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserver.cli", "--host", "127.0.0.1", "--port", "0", *flags],
        stdout=subprocess.PIPE, stderr=log, env={**os.environ, **(env or {})},
    )
    try:
        try:
            banner = _read_banner(proc, time.monotonic() + START_TIMEOUT_S)
        except RuntimeError as exc:
            with open(log.name) as f:
                raise RuntimeError(f"{exc}; its log ends with:\n{f.read()[-2000:]}") from None
        url = banner.split()[2]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                # A test's TLS server has a self-signed certificate: readiness only here.
                if httpx.get(f"{url}/healthz", timeout=2, verify=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"kvserver at {url} never became healthy")
            time.sleep(0.05)
        yield KvServer(url, proc, log.name, banner.strip())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        log.close()
        os.unlink(log.name)


@pytest.fixture(scope="session")
def kvserver_url() -> Iterator[str]:
    """http://127.0.0.1:PORT of a kvserver over memory:// (no auth), for the whole session."""
    with running_kvserver("--store", "memory://?capacity=1GiB") as server:
        yield server.url


@pytest.fixture(scope="session")
def kvserver_unix_url() -> Iterator[str]:
    """http://localhost?unix_socket=PATH of a kvserver over file:// (no auth) that also
    listens on a Unix socket, for the whole session."""
    where = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")  # a socket path fits in 107 bytes
    try:
        with running_kvserver("--store", f"file://{where}/store", "--unix-socket",
                              f"{where}/kv.sock"):
            yield f"http://localhost?unix_socket={where}/kv.sock"
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def kvserver_factory() -> Iterator:
    """Start kvservers inside a test (`factory(*flags)` -> KvServer); all stop at its end."""
    with contextlib.ExitStack() as stack:
        yield lambda *flags, env=None: stack.enter_context(running_kvserver(*flags, env=env))
