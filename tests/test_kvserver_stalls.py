"""Responses under a client that never reads: the stall deadline drops the connection and
frees its buffer; pooled buffers shrink back after a peak. A real `kvstash serve` on
127.0.0.1 and raw sockets."""

from __future__ import annotations

import contextlib
import resource
import socket
import time

import httpx
import pytest

from kvserver.bodies import BufferPool
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks

OCTETS = {"content-type": "application/octet-stream"}


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def wait_for(predicate, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_get_whose_client_never_reads_is_dropped_and_its_buffer_returned(ns):
    """A 24 MiB chunk behind memory:// goes out from a pooled buffer (not sendfile): a
    client that reads nothing holds it only until --send-timeout."""
    (key, _, blob), = make_chunks(ns, 1, payload_size=24 << 20)
    with running_kvserver("--store", "memory://", "--send-timeout", "1s") as server:
        assert httpx.put(f"{server.url}/v1/chunks/{key}", content=blob, headers=OCTETS).status_code == 201
        host, port = server.url.removeprefix("http://").split(":")
        stuck = []
        for _ in range(3):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(f"GET /v1/chunks/{key} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            stuck.append(sock)
        try:
            wait_for(lambda: metric(server.url, "kvstash_body_buffers_lent") == 3,
                     "the GETs never started")
            wait_for(lambda: metric(server.url, "kvstash_body_buffers_lent") == 0,
                     "a stalled GET kept its buffer")
            for sock in stuck:
                sock.settimeout(10)
                got = 0
                try:
                    while part := sock.recv(1 << 20):
                        got += len(part)
                except ConnectionResetError:
                    pass
                assert got < len(blob)  # cut off, never completed
            assert 'status="500"' not in httpx.get(f"{server.url}/metrics").text
        finally:
            for sock in stuck:
                sock.close()
        # A reader that does read still gets the chunk.
        assert httpx.get(f"{server.url}/v1/chunks/{key}").content == blob


def test_pool_drops_buffers_unused_for_its_idle_time():
    pool = BufferPool(max_buffers=4, max_bytes=8 << 20, idle_s=30.0)
    lent = [pool.borrow(4 << 20) for _ in range(3)]
    for _, give_back in lent:
        give_back()
    assert pool.stats()["free"] == 3
    now = time.monotonic()
    pool.trim(now + 10)
    assert pool.stats()["free"] == 3
    pool.trim(now + 31)
    assert pool.stats() == {"lent": 0, "free": 0, "free_bytes": 0}
    buf, give_back = pool.borrow(1 << 20)  # still lends after shrinking
    give_back()
    assert pool.stats()["free"] == 1 and buf.nbytes >= 1 << 20


IDLE_CONNECTIONS = 1100  # over the soft limit on open files many hosts start processes with


def test_idle_connections_past_a_1024_file_soft_limit_leave_other_clients_served(tmp_path):
    """The server raises its soft limit on open files to the hard one at start: started
    under a soft limit of 1024, 1100 connections that send nothing made every other
    request fail (the accept found no descriptor) until they timed out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * IDLE_CONNECTIONS + 100:
        pytest.skip(f"hard limit on open files {hard}: too low to tell")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # the server inherits it
    try:
        server_cm = running_kvserver("--store", f"file://{tmp_path}/s")
        server = server_cm.__enter__()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # this process needs more
    with contextlib.ExitStack() as stack:
        stack.push(server_cm)
        host, port = server.url.removeprefix("http://").split(":")
        for _ in range(IDLE_CONNECTIONS):
            sock = stack.enter_context(socket.create_connection((host, int(port)), timeout=5))
            assert sock is not None
        for _ in range(3):
            assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
