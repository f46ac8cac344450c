"""`kvstash serve --unix-socket PATH` and the http:// store's `unix_socket` option: the same
API, auth and zero-copy GETs over a Unix stream socket for clients on the server's host,
and chunk files handed over as descriptors (SCM_RIGHTS) to `get_into`. All against real
uvicorn, real sockets and real files."""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from storage import open_store
from storage.errors import ConfigError
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks
from tests.test_http_store_client import ScriptedServer, self_signed_cert
from tests.test_kvserver_sendfile import TRUST_AT_ONCE, sendfile_bytes
from tests.test_kvserver_sendfile import open_fds as process_fds

TOKEN = "unix-socket-token-0123456789"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory: a Unix socket path must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def unix_url(path: Path, scheme: str = "http", host: str = "localhost", **opts: str) -> str:
    extra = "".join(f"&{k}={quote(v, safe='/')}" for k, v in opts.items())
    return f"{scheme}://{host}?unix_socket={quote(str(path), safe='/')}{extra}"


def fd_bytes(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(r"^kvstash_bytes_fd_passed_total (\S+)$", text, re.M)
    assert m, "no descriptor counter in /metrics"
    return float(m.group(1))


def serve_error(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserver.cli", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=60)


async def test_the_store_api_works_over_the_unix_socket_with_descriptors_and_sendfile(tmp_path, sock_dir, ns):
    path = sock_dir / "kv.sock"
    chunks = make_chunks(ns, 3, payload_size=(3 << 20) + 17)
    with running_kvserver("--store", f"file://{tmp_path}?{TRUST_AT_ONCE}", "--unix-socket",
                          str(path)) as server:
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert stat.S_IMODE(path.lstat().st_mode) == 0o660
        store = open_store(unix_url(path))
        try:
            keys = [k for k, _, _ in chunks]
            for key, _, blob in chunks:
                assert await store.put(key, blob) is True
            assert await store.put(keys[0], chunks[0][2]) is False  # already there
            assert await store.prefix_len(keys) == 3
            assert await store.exists([keys[2], "ab" * 8 + "/" + "cd" * 16]) == [True, False]
            for key, _, blob in chunks:  # the first reads verify the files ...
                assert await store.get(key) == blob
            total = sum(len(b) for _, _, b in chunks)
            sent, passed = sendfile_bytes(server.url), fd_bytes(server.url)
            out = bytearray(4 << 20)
            for key, _, blob in chunks:  # ... later get_intos get the files themselves
                header = await store.get_into(key, out)
                assert header is not None
                assert bytes(out[: header.payload_len]) == blob[header.header_len :]
            assert fd_bytes(server.url) - passed == total
            for key, _, blob in chunks:  # and a whole-blob get is sent from them
                assert await store.get(key) == blob
            assert sendfile_bytes(server.url) - sent == total
            no_fd = open_store(unix_url(path, fd="false"))
            try:
                header = await no_fd.get_into(keys[0], out)
                assert header is not None
                assert bytes(out[: header.payload_len]) == chunks[0][2][header.header_len :]
            finally:
                await no_fd.close()
            assert fd_bytes(server.url) - passed == total
            assert sendfile_bytes(server.url) - sent == total + len(chunks[0][2])
            assert await store.delete(keys[1]) is True
            assert await store.prefix_len(keys) == 1
            # A TCP client sees the same chunks: one app behind both listeners.
            tcp = open_store(server.url)
            try:
                assert await tcp.get(keys[0]) == chunks[0][2]
                assert await tcp.get(keys[1]) is None
            finally:
                await tcp.close()
        finally:
            await store.close()
    assert not path.exists(), "the socket file outlived the server"


async def test_auth_and_tenancy_hold_on_the_unix_socket(tmp_path, sock_dir, ns):
    path = sock_dir / "kv.sock"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKEN}\n")
    tokens.chmod(0o600)
    (key, _, blob), = make_chunks(ns, 1)
    with running_kvserver("--store", f"file://{tmp_path / 'root'}", "--auth-tokens", str(tokens),
                          "--unix-socket", str(path)):
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as client:
            r = client.get(f"http://localhost/v1/chunks/{key}")
            assert r.status_code == 401 and r.json()["error"]
        anonymous = open_store(unix_url(path))
        alice = open_store(unix_url(path, token=TOKEN))
        try:
            with pytest.raises(Exception, match="401"):
                await anonymous.put(key, blob)
            assert await alice.put(key, blob) is True
            assert await alice.get(key) == blob
            assert await anonymous.get(key) is None
        finally:
            await anonymous.close()
            await alice.close()


async def test_https_over_the_unix_socket(tmp_path, sock_dir, ns):
    cert, key_file = self_signed_cert(tmp_path)
    path = sock_dir / "kv.sock"
    (key, _, blob), = make_chunks(ns, 1, payload_size=2 << 20)
    with running_kvserver("--store", f"file://{tmp_path / 'root'}", "--tls-cert", cert,
                          "--tls-key", key_file, "--unix-socket", str(path)):
        store = open_store(unix_url(path, "https", "127.0.0.1", ca=cert))
        untrusting = open_store(unix_url(path, "https", "127.0.0.1"))
        try:
            assert await store.put(key, blob) is True
            assert await store.get(key) == blob
            assert await untrusting.get(key) is None  # unknown CA: a miss, not an exception
        finally:
            await store.close()
            await untrusting.close()


async def test_descriptors_leak_nowhere_and_a_changed_payload_is_caught(tmp_path, sock_dir, ns):
    """verify=header: the server vouches for any file whose header checks, so a payload
    damaged in place reaches the client as a descriptor; the client's checksum catches it."""
    path = sock_dir / "kv.sock"
    root = tmp_path / "root"
    chunks = make_chunks(ns, 4, payload_size=(1 << 20) + 5)
    with running_kvserver("--store", f"file://{root}?verify=header", "--unix-socket", str(path)) as server:
        store = open_store(unix_url(path))
        try:
            for key, _, blob in chunks:
                assert await store.put(key, blob) is True
            out = bytearray(2 << 20)
            await store.get_into(chunks[0][0], out)  # connections opened, pool warm
            mine, theirs = process_fds(os.getpid()), process_fds(server.pid)
            for _ in range(5):
                for key, _, blob in chunks:
                    header = await store.get_into(key, out)
                    assert header is not None
                    assert bytes(out[: header.payload_len]) == blob[header.header_len :]
            assert await store.get_into(chunks[0][0], bytearray(100)) is None  # too small
            assert process_fds(os.getpid()) == mine
            # The server closes a handed-over file (and its socket duplicate) once the
            # response is done, which may come just after the client has read it; the
            # client may also drop the connection of the read that did not fit.
            deadline = time.monotonic() + 5
            while process_fds(server.pid) > theirs and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert process_fds(server.pid) <= theirs
            assert fd_bytes(server.url) > 0
            # Damage one payload byte in place.
            key, _, blob = chunks[1]
            (victim,) = [p for p in root.rglob("*.kv") if p.stem == key.split("/")[1]]
            with open(victim, "r+b") as f:
                f.seek(len(blob) - 1)
                f.write(bytes([blob[-1] ^ 0xFF]))
            corrupt = store.stats()["corrupt"]
            assert await store.get_into(key, out) is None
            assert store.stats()["corrupt"] == corrupt + 1
            assert process_fds(os.getpid()) <= mine  # (the connection involved is dropped)
        finally:
            await store.close()


def test_ranges_and_tcp_ignore_the_descriptor_request(tmp_path, sock_dir, ns):
    path = sock_dir / "kv.sock"
    (key, _, blob), = make_chunks(ns, 1, payload_size=100_000)
    want = {"Kvstash-Fd": "1"}
    with running_kvserver("--store", f"file://{tmp_path}?{TRUST_AT_ONCE}", "--unix-socket",
                          str(path)) as server:
        assert httpx.put(f"{server.url}/v1/chunks/{key}", content=blob,
                         headers={"content-type": "application/octet-stream"}).status_code == 201
        assert httpx.get(f"{server.url}/v1/chunks/{key}").content == blob  # verified now
        r = httpx.get(f"{server.url}/v1/chunks/{key}", headers=want)  # TCP: a plain body
        assert r.status_code == 200 and r.content == blob and "kvstash-fd" not in r.headers
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as client:
            r = client.get(f"http://localhost/v1/chunks/{key}", headers={**want, "Range": "bytes=10-99"})
            assert r.status_code == 206 and r.content == blob[10:100]
            r = client.get(f"http://localhost/v1/chunks/{key}", headers=want)
            # httpx reads no ancillary data, so the kernel drops the descriptor; the answer
            # is the documented 1-byte body with the chunk's size in a header.
            assert r.status_code == 200 and r.content == b"\0"
            assert r.headers["kvstash-fd"] == str(len(blob))


def test_a_stale_socket_file_is_replaced(tmp_path, sock_dir):
    path = sock_dir / "kv.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays behind, nobody listens
    with running_kvserver("--store", f"file://{tmp_path}", "--unix-socket", str(path)):
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as client:
            assert client.get("http://localhost/healthz").status_code == 200


def test_a_live_socket_or_another_file_is_left_alone(tmp_path, sock_dir):
    live_path = sock_dir / "live.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(live_path))
    live.listen(1)
    try:
        result = serve_error("--store", f"file://{tmp_path}", "--unix-socket", str(live_path))
        assert result.returncode == 2
        assert "another server is listening" in result.stderr
        assert stat.S_ISSOCK(live_path.lstat().st_mode)
    finally:
        live.close()
    other = sock_dir / "data.txt"
    other.write_text("keep me")
    result = serve_error("--store", f"file://{tmp_path}", "--unix-socket", str(other))
    assert result.returncode == 2 and "is not a socket" in result.stderr
    assert other.read_text() == "keep me"
    result = serve_error("--store", f"file://{tmp_path}", "--unix-socket", "/" + "x" * 120)
    assert result.returncode == 2 and "cannot listen on" in result.stderr


async def test_a_client_whose_socket_is_missing_misses(sock_dir, ns):
    (key, _, blob), = make_chunks(ns, 1)
    store = open_store(unix_url(sock_dir / "nobody.sock", breaker_failures="100"))
    try:
        assert await store.get(key) is None
        assert await store.get_into(key, bytearray(4096)) is None
        assert await store.prefix_len([key]) == 0
        assert store.stats()["errors"] >= 2
    finally:
        await store.close()
    with pytest.raises(ConfigError, match="unix_socket"):
        open_store("http://localhost?unix_socket=")


def test_the_bench_raw_stream_runs_over_a_unix_socket(sock_dir):
    from bench.store_http import raw_stream_gbps

    assert raw_stream_gbps(1 << 20, 8, 2, 1, str(sock_dir)) > 0


def test_the_bench_raw_stream_into_a_new_buffer_per_chunk_runs_over_tcp():
    """The baseline for the simple `get` (a new blob per chunk)."""
    from bench.store_http import raw_stream_gbps

    assert raw_stream_gbps(1 << 20, 8, 2, 1, None, fresh=True) > 0


class LyingUnixServer(ScriptedServer):
    """A Unix socket that answers every request with `head` and one body byte carrying the
    descriptors `fds()` makes (a kvserver never sends these)."""

    def __init__(self, path: Path, head: bytes, fds):
        self.head, self.fds = head, fds
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.listen(8)
        super().__init__(sock)

    def answer(self, conn: socket.socket) -> None:
        while conn.recv(65536):  # the client keeps a connection for the next request
            fds = self.fds()
            conn.sendall(self.head)
            socket.send_fds(conn, [b"\0"], fds) if fds else conn.sendall(b"\0")
            for fd in fds:
                os.close(fd)


@pytest.mark.parametrize("lie", ["pipe", "other_chunk", "two_fds", "no_fd", "stray_fd_on_404"])
async def test_lying_descriptor_answers_are_misses_and_leak_nothing(tmp_path, sock_dir, ns, lie):
    (key, _, blob), (_, _, other_blob) = make_chunks(ns, 2, payload_size=5000)
    other = tmp_path / "other.kv"
    other.write_bytes(other_blob)
    pipes: list[int] = []

    def fds() -> list[int]:
        if lie == "pipe":  # not a regular file (the test holds the write end open)
            r, w = os.pipe()
            pipes.append(w)
            return [r]
        if lie == "two_fds":
            return [os.open(other, os.O_RDONLY), os.open(other, os.O_RDONLY)]
        if lie == "no_fd":
            return []
        return [os.open(other, os.O_RDONLY)]

    status = b"404 Not Found" if lie == "stray_fd_on_404" else b"200 OK"
    head = b"HTTP/1.1 %s\r\nContent-Length: 1\r\nKvstash-Fd: 5000\r\n\r\n" % status
    server = LyingUnixServer(sock_dir / "liar.sock", head, fds)
    store = open_store(unix_url(sock_dir / "liar.sock", timeout="3s", breaker_failures="100"))
    try:
        assert await store.get_into(key, bytearray(10_000)) is None  # connections opened
        mine, held = process_fds(os.getpid()), len(pipes)
        t0 = time.monotonic()
        for _ in range(5):
            assert await store.get_into(key, bytearray(10_000)) is None
        assert time.monotonic() - t0 < 5
        # The liar runs in this process: only the pipe ends the test holds may be new, once
        # its threads have closed the connections the client dropped.
        deadline = time.monotonic() + 2
        while process_fds(os.getpid()) > mine + len(pipes) - held and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert process_fds(os.getpid()) <= mine + len(pipes) - held
        assert store.stats()["hits"] == 0
    finally:
        await store.close()
        server.close()
        for w in pipes:
            os.close(w)


async def test_cancelled_reads_of_handed_over_files_leave_no_descriptor_open(tmp_path, sock_dir, ns):
    """Reads given up at random points (before the server answers, while the descriptor
    waits for a thread, while the thread reads): none leaves a chunk file open here."""
    path = sock_dir / "kv.sock"
    chunks = make_chunks(ns, 8, payload_size=(4 << 20) + 3)
    with running_kvserver("--store", f"file://{tmp_path}?{TRUST_AT_ONCE}", "--unix-socket",
                          str(path)) as server:
        store = open_store(unix_url(path, pool="32", breaker_failures="100000"))
        try:
            for key, _, blob in chunks:
                assert await store.put(key, blob) is True
            for key, _, _ in chunks:  # verified by the server: handed over from now on
                assert await store.get(key) is not None
            rng = random.Random(7)
            given_up = 0

            async def lane(j: int) -> None:
                nonlocal given_up
                out = bytearray(5 << 20)
                for _ in range(12):
                    key, _, blob = rng.choice(chunks)
                    try:
                        async with asyncio.timeout(rng.random() * 0.01):
                            header = await store.get_into(key, out)
                    except TimeoutError:
                        given_up += 1
                        continue
                    if header is not None:
                        assert bytes(out[: header.payload_len]) == blob[header.header_len :]

            async def crowd() -> None:
                # Keeps the worker threads busy now and then, so that some handed-over
                # descriptors are still waiting for a thread when their caller gives up.
                for _ in range(20):
                    await asyncio.to_thread(time.sleep, 0.01)

            await asyncio.gather(*(lane(j) for j in range(32)), *(crowd() for _ in range(8)))
            assert given_up > 0 and fd_bytes(server.url) > 0
        finally:
            await store.close()
        await asyncio.sleep(0.2)  # reads still running when their caller gave up end here
        left = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")]
        assert not [p for p in left if p.endswith(".kv")], left


async def test_worker_processes_share_the_unix_socket(tmp_path, sock_dir, ns):
    from tests.test_kvserver_shared import each_connection_sees_every_chunk, worker_pids

    path = sock_dir / "kv.sock"
    chunks = make_chunks(ns, 8, payload_size=20_000)
    with running_kvserver("--store", f"file://{tmp_path}/store", "--workers", "2",
                          "--unix-socket", str(path)) as server:
        assert len(worker_pids(server.pid)) >= 2
        await each_connection_sees_every_chunk(unix_url(path, pool="1"), chunks, gets=3)
    assert not path.exists(), "the socket file outlived the server"
