"""A connection that ends leaves nothing of itself in the server, however it ends: a client
that resets its connection (it gave up on a reply, or closed with bytes unread) must not
stay referenced by the keep-alive timer until that timer would have fired."""

from __future__ import annotations

import gc
import socket
import struct
import time

from kvserver.protocol import BoundedHeadProtocol
from tests.test_kvserver_sendfile import serving

CONNECTIONS = 50


async def small_app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def live_protocols() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, BoundedHeadProtocol))


def reset_after_one_request(port: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(4096)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # an RST, not a FIN: the connection is lost with an error


def test_a_reset_keep_alive_connection_is_released_at_once():
    before = live_protocols()
    with serving(small_app, timeout_keep_alive=120) as url:  # no keep-alive timer fires here
        port = int(url.rsplit(":", 1)[1])
        for _ in range(CONNECTIONS):
            reset_after_one_request(port)
        deadline = time.monotonic() + 3.0
        held = live_protocols() - before
        while held > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
            held = live_protocols() - before
        assert held == 0, f"{held} of {CONNECTIONS} reset connections still held by the server"
