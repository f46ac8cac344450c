"""uvicorn's httptools HTTP protocol with bounds on the request head: its size and its time.

httptools buffers a request head of any size and uvicorn never times out an unfinished
head, so without these bounds one client could make the server hold megabytes of headers
per connection, or keep a connection forever by trickling a head byte by byte
(tests/test_reliability_hostile_http; what that cost, docs/benchmarks/2026-11-22-soak.md).
Bodies are bounded by the app (`--max-chunk-bytes`, `--body-timeout`).

It also offers the ASGI "Zero Copy Send" extension (`http.response.zerocopysend`) on
connections without TLS (TCP or Unix socket): the app hands over an open file and the
bytes go to the socket with sendfile(2) (kvserver/sendfile.py). uvicorn has no such
extension; this wraps the `send` of each request it starts.

On Unix-socket connections it also offers `kvstash.fdpass`: the app hands over an open
chunk file and the client receives its descriptor (SCM_RIGHTS) with the body's one byte,
and reads the file itself (kvserver/sendfile.py `pass_fd`; the client side is
storage/http.py).

Every response has a stall deadline: a body message (or a sendfile, or a descriptor
hand-over) that the client does not take within `send_timeout_s` aborts the connection, so
a client that never reads cannot pin a chunk's buffer in the server (`--send-timeout`).

Unix-socket connections get a larger send buffer: a Unix stream socket's sender may have
at most its send buffer in flight, and the 208 KiB default makes a 16 MiB body some 80
round trips between the server's sendfile and the client's receive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvserver.sendfile import STALL_TIMEOUT_S, NoSendfile, PeerGone, pass_fd, sendfile_to
from storage.file import read_at
from storage.http import UNIX_SNDBUF

# Request line + headers. kvstash's own requests carry well under 1 KiB.
MAX_HEAD_BYTES = 64 * 1024
# From the first byte of a request (or the accepted connection) to the end of its head.
HEAD_TIMEOUT_S = 10.0

ZEROCOPY = "http.response.zerocopysend"
FDPASS = "kvstash.fdpass"  # scope extension; its message type is FDPASS_MESSAGE
FDPASS_MESSAGE = "kvstash.response.fd"
log = logging.getLogger("kvstash.kvserver")
# The hook that wraps each request's `send` (uvicorn's own method): without it, no offer.
_CAN_WRAP_SEND = hasattr(HttpToolsProtocol, "_start_asgi_task")


def _refusal(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def configure(send_timeout_s: float) -> None:
    """Set the response stall deadline of every connection this process serves (the
    protocol class is named in uvicorn's config, so workers get it by import)."""
    BoundedHeadProtocol.send_timeout_s = send_timeout_s


class BoundedHeadProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that answers 431 past MAX_HEAD_BYTES of unfinished head and 408
    when a head is not complete within HEAD_TIMEOUT_S, then closes the connection; and
    aborts a connection whose client takes no response bytes for `send_timeout_s`."""

    send_timeout_s = STALL_TIMEOUT_S
    _in_head = False
    _head_bytes = 0
    _feeding = 0  # size of the packet being parsed (a head may begin inside it)
    _head_timer: asyncio.TimerHandle | None = None
    _zerocopy = False
    _fdpass = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        self._zerocopy = (_CAN_WRAP_SEND and hasattr(os, "sendfile") and sock is not None
                          and transport.get_extra_info("sslcontext") is None)
        if sock is not None and sock.family == socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
            self._fdpass = self._zerocopy
        self._begin_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_head()
        super().connection_lost(exc)
        # uvicorn cancels the keep-alive timer only on a clean close: a connection the
        # client reset would stay referenced by it (protocol, transport, request cycle)
        # for the whole keep-alive time.
        self._unset_keepalive_if_required()

    def data_received(self, data: bytes) -> None:
        self._feeding = len(data)
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        self._feeding = 0
        # Counted before the parser ran: if the head is still open after more than the
        # limit was fed, the head itself is too large (a complete head with a large body
        # in the same packet has already ended the head).
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, "Request Header Fields Too Large",
                         f"request head exceeds {MAX_HEAD_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._zerocopy:
            self.scope["extensions"] = {ZEROCOPY: {}, FDPASS: {}} if self._fdpass else {ZEROCOPY: {}}
        if not self._in_head:  # the next request on a kept-alive connection
            self._begin_head(self._feeding)

    def on_headers_complete(self) -> None:
        self._end_head()
        super().on_headers_complete()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        super()._start_asgi_task(cycle, _with_send_deadline(app, cycle, self._zerocopy,
                                                            self.send_timeout_s))

    def _begin_head(self, already: int = 0) -> None:
        self._in_head = True
        self._head_bytes = already
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _end_head(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self._refuse(408, "Request Timeout",
                     f"request head not received within {HEAD_TIMEOUT_S:g}s")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        self._end_head()
        if not self.transport.is_closing():
            self.transport.write(_refusal(status, reason, message))
            self.transport.close()


def _with_send_deadline(app: Any, cycle: Any, zerocopy: bool, timeout: float) -> Any:
    """`app` with a `send` that aborts the connection when a message waits more than
    `timeout` for the client to take bytes, and that carries out zerocopysend and fdpass
    messages (offered only where `zerocopy`)."""
    async def app_with_deadline(scope: Any, receive: Any, send: Any) -> None:
        async def timed_send(message: Any) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                log.info("client took no response bytes for %gs: connection dropped", timeout)
                _drop(cycle)

        async def send_within_deadline(message: Any) -> None:
            if zerocopy and message["type"] == ZEROCOPY:
                await _send_file(cycle, timed_send, message, timeout)
            elif zerocopy and message["type"] == FDPASS_MESSAGE:
                await _send_fd(cycle, timed_send, message, timeout)
            else:
                await timed_send(message)
        await app(scope, receive, send_within_deadline)
    return app_with_deadline


def _drop(cycle: Any) -> None:
    """Abort the request's connection: later messages of its response are dropped (as
    uvicorn drops a gone client's) and its buffers are freed now, not when the client
    reads."""
    transport = getattr(cycle, "transport", None)
    if transport is not None:
        transport.abort()
    cycle.disconnected = True


# uvicorn's per-request state that the zero-copy send reads (and the byte count it keeps).
_CYCLE_STATE = ("disconnected", "response_started", "response_complete", "chunked_encoding",
                "expected_content_length", "transport", "scope")


async def _send_file(cycle: Any, send: Any, message: Any, timeout: float) -> None:
    """One zerocopysend message: the file's bytes as (part of) the body under the
    response's Content-Length; then an empty body message ends it or keeps it open."""
    if not all(hasattr(cycle, name) for name in _CYCLE_STATE):
        # A uvicorn whose request state looks different: send the bytes the plain way.
        await _send_read(send, message)
        return
    if cycle.disconnected:
        return  # as uvicorn's own send: a gone client's messages are dropped
    if not cycle.response_started or cycle.response_complete:
        raise RuntimeError(f"Unexpected ASGI message {ZEROCOPY!r} outside a response body")
    if cycle.scope["method"] != "HEAD":
        fd, offset, count = _span(message)
        if cycle.chunked_encoding or count > cycle.expected_content_length:
            raise RuntimeError("zerocopysend needs a Content-Length that covers the file")
        try:
            sent = await sendfile_to(cycle.transport, fd, offset, count, timeout)
        except NoSendfile:
            await _send_read(send, message)
            return
        except (PeerGone, TimeoutError):
            sent = -1
        except OSError as exc:
            log.warning("sendfile of %d bytes failed: %s", count, exc)
            sent = -1
        if sent != count:
            # The head promised bytes that will not come: only a cut connection says so.
            cycle.transport.abort()
            cycle.disconnected = True
            return
        cycle.expected_content_length -= count
        _moved_on(message, offset + count)
    await send({"type": "http.response.body", "body": b"", "more_body": message.get("more_body", False)})


async def _send_fd(cycle: Any, send: Any, message: Any, timeout: float) -> None:
    """One kvstash.response.fd message: the body's single byte goes out with the file's
    descriptor attached (SCM_RIGHTS), and the response ends."""
    if not all(hasattr(cycle, name) for name in _CYCLE_STATE):
        raise RuntimeError(f"{FDPASS_MESSAGE!r} needs uvicorn's request state")
    if cycle.disconnected:
        return
    if not cycle.response_started or cycle.response_complete or cycle.expected_content_length != 1:
        raise RuntimeError(f"{FDPASS_MESSAGE!r} must be the whole body of a 1-byte response")
    if cycle.scope["method"] != "HEAD":
        try:
            await pass_fd(cycle.transport, message["file"].fileno(), timeout)
        except (PeerGone, TimeoutError, OSError) as exc:
            log.debug("passing a descriptor failed: %s", exc)
            cycle.transport.abort()
            cycle.disconnected = True
            return
        cycle.expected_content_length = 0
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _span(message: Any) -> tuple[int, int, int]:
    """(fd, offset, count) of a zerocopysend message: no offset means the file position,
    no count means up to the end of the file."""
    fd = message["file"].fileno()
    offset = message.get("offset")
    if offset is None:
        offset = os.lseek(fd, 0, os.SEEK_CUR)
    count = message.get("count")
    if count is None:
        count = os.fstat(fd).st_size - offset
    return fd, offset, count


def _moved_on(message: Any, end: int) -> None:
    """As sendfile(2) without an offset: the file position moves past what was sent."""
    if message.get("offset") is None:
        os.lseek(message["file"].fileno(), end, os.SEEK_SET)


async def _send_read(send: Any, message: Any) -> None:
    """A zerocopysend message carried out by reading the bytes and sending them."""
    fd, offset, count = _span(message)
    body = await asyncio.to_thread(read_at, fd, count, offset)
    if len(body) != count:
        raise OSError(f"file ended {count - len(body)} bytes early")
    _moved_on(message, offset + count)
    await send({"type": "http.response.body", "body": body,
                "more_body": message.get("more_body", False)})
