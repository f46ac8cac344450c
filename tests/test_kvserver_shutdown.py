"""Stopping a kvserver: SIGTERM ends it within `--shutdown-grace`, whatever its clients do.

A real `kvstash serve` on 127.0.0.1 and raw sockets for the slow clients: one dripping a
PUT body (a byte at a time, within --body-stall-timeout) and one that sends a GET and
never reads the answer.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import httpx
import pytest

from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks

GRACE_S = 2.0
OCTETS = {"content-type": "application/octet-stream"}


def read_head(sock: socket.socket) -> bytes:
    """One response head (e.g. `100 Continue`), read whole; bounded in time and size."""
    sock.settimeout(30)
    head = b""
    while not head.endswith(b"\r\n\r\n") and len(head) < 4096:
        part = sock.recv(1)
        if not part:
            break
        head += part
    return head


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stopping_server_exits_within_its_grace_period_despite_slow_clients(ns, tmp_path, workers):
    """Before --shutdown-grace, uvicorn waited for every running request: a slow-drip PUT
    or a client that never reads held the exit for --body-timeout / --send-timeout (60 s).
    With --workers, each worker process keeps the grace."""
    (big, _, big_blob), (dripped, _, dripped_blob) = make_chunks(ns, 2, payload_size=24 << 20)
    stop = threading.Event()
    # --workers needs a shared store; one process serves memory:// (a GET from a buffer).
    store = "memory://" if workers == 1 else f"file://{tmp_path}/s"
    with running_kvserver("--store", store, "--workers", str(workers),
                          "--shutdown-grace", f"{GRACE_S:g}s") as server:
        assert httpx.put(f"{server.url}/v1/chunks/{big}", content=big_blob, headers=OCTETS,
                         timeout=30).status_code == 201
        host, port = server.url.removeprefix("http://").split(":")
        never_reads = socket.socket()
        never_reads.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        never_reads.connect((host, int(port)))
        never_reads.sendall(f"GET /v1/chunks/{big} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        drips = socket.create_connection((host, int(port)))
        drips.sendall((f"PUT /v1/chunks/{dripped} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       f"application/octet-stream\r\nContent-Length: {len(dripped_blob)}\r\n"
                       "Expect: 100-continue\r\n\r\n").encode())

        def drip() -> None:
            for i in range(600):  # at most 5 minutes, a byte every 0.5 s
                if stop.is_set():
                    return
                try:
                    drips.sendall(dripped_blob[i:i + 1])
                except OSError:  # the server closed the connection
                    return
                time.sleep(0.5)

        dripper = threading.Thread(target=drip, daemon=True)
        try:
            # Both requests are running: the PUT's route asked for its body (100 Continue),
            # the GET's answer has begun (its first byte is here, left unread).
            assert read_head(drips).startswith(b"HTTP/1.1 100")
            dripper.start()
            never_reads.settimeout(30)
            assert never_reads.recv(1, socket.MSG_PEEK) == b"H"
            server.proc.send_signal(signal.SIGTERM)
            # A bound, not a measurement: the grace, then cancelling and exiting.
            server.proc.wait(timeout=3 * GRACE_S + 5)
        finally:
            stop.set()
            if dripper.is_alive():
                dripper.join(10)
            never_reads.close()
            drips.close()
