"""uvicorn's httptools HTTP protocol with bounds on the request head: its size and its time.

httptools buffers a request head of any size and uvicorn never times out an unfinished
head, so without these bounds one client could make the server hold megabytes of headers
per connection (20 connections x 4 MiB of headers grew the server by ~90 MiB), or keep a
connection forever by trickling a head byte by byte (tests/test_reliability_hostile_http).
Bodies are bounded by the app (`--max-chunk-bytes`, `--body-timeout`).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Request line + headers. kvstash's own requests carry well under 1 KiB.
MAX_HEAD_BYTES = 64 * 1024
# From the first byte of a request (or the accepted connection) to the end of its head.
HEAD_TIMEOUT_S = 10.0


def _refusal(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class BoundedHeadProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that answers 431 past MAX_HEAD_BYTES of unfinished head and 408
    when a head is not complete within HEAD_TIMEOUT_S, then closes the connection."""

    _in_head = False
    _head_bytes = 0
    _feeding = 0  # size of the packet being parsed (a head may begin inside it)
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._begin_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_head()
        super().connection_lost(exc)

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
        if not self._in_head:  # the next request on a kept-alive connection
            self._begin_head(self._feeding)

    def on_headers_complete(self) -> None:
        self._end_head()
        super().on_headers_complete()

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
