"""Chunk bodies for GET: read into reusable huge-page buffers, sent in slices without copies.

A plain `Response(blob)` costs a fresh allocation per chunk (the file read faults in 4 KiB
pages) and, under Python 3.11's asyncio, two more copies of whatever the socket does not
take at once (`data[n:]` of a bytes object, then the transport's own buffer). Here a GET
borrows a buffer from a small pool, the store reads the chunk file straight into it
(`Store.get_blob_into`), and the body goes out in 1 MiB memoryview slices, each awaited
under uvicorn's flow control, so only the part the socket refuses is ever copied. The
buffer goes back to the pool once the last slice is sent or the client is gone.

The pool never makes a request wait: when every buffer is lent (more GETs in flight than
`max_buffers`, say slow readers), a GET falls back to a buffer of its own. It shrinks
back after a peak: a free buffer unused for `idle_s` is dropped (unmapped), at the next
borrow or by `trim()`, which the server runs periodically.

A chunk file the store can vouch for without reading it (`Store.open_blob`) skips the
buffer altogether: `FileBodyResponse` hands the open file to the server's zero-copy send
(sendfile(2), kvserver/protocol.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from kvserver.protocol import FDPASS_MESSAGE, ZEROCOPY
from storage.base import BlobFile
from storage.buffers import host_buffer

PIECE = 1 << 20
# A free pooled buffer unused this long is dropped.
POOL_IDLE_S = 30.0


class BufferPool:
    """At most `max_buffers` host buffers, lent one per GET and reused."""

    def __init__(self, max_buffers: int = 8, max_bytes: int = 1 << 30,
                 idle_s: float = POOL_IDLE_S):
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        # The largest body seen so far (up to max_bytes): what a lent buffer is grown to.
        self.hint = 0
        self._free: list[memoryview] = []
        self._freed_at: list[float] = []  # when each free buffer came back
        self._lent = 0
        self._lock = threading.Lock()

    def borrow(self, size: int) -> tuple[memoryview, Callable[..., None]]:
        """A buffer of at least `size` bytes and the call that gives it back
        (`give_back(reuse=False)`: the buffer may still be in use, never lend it again)."""
        with self._lock:
            self._trim(time.monotonic())
            if self._free or self._lent < self.max_buffers:
                buf = self._free.pop() if self._free else None
                if buf is not None:
                    self._freed_at.pop()
                self._lent += 1
                pooled = True
            else:
                buf, pooled = None, False
        if buf is None or buf.nbytes < size:
            buf = host_buffer(size)
        if not pooled:
            return buf, _nothing
        returned = False

        def give_back(reuse: bool = True) -> None:
            nonlocal returned
            with self._lock:
                if not returned:
                    returned = True
                    self._lent -= 1
                    if reuse:
                        self._free.append(buf)
                        self._freed_at.append(time.monotonic())
        return buf, give_back

    def trim(self, now: float | None = None) -> None:
        """Drop the free buffers unused for `idle_s` (as of `now`, default the clock)."""
        with self._lock:
            self._trim(time.monotonic() if now is None else now)

    def _trim(self, now: float) -> None:
        # Buffers come back in time order, so the idle ones are at the front.
        keep = next((i for i, t in enumerate(self._freed_at) if now - t < self.idle_s),
                    len(self._freed_at))
        if keep:
            del self._free[:keep], self._freed_at[:keep]

    def saw(self, nbytes: int) -> None:
        self.hint = min(max(self.hint, nbytes), self.max_bytes)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"lent": self._lent, "free": len(self._free),
                    "free_bytes": sum(b.nbytes for b in self._free)}


def _nothing(reuse: bool = True) -> None:
    return None


class ViewResponse(Response):
    """A binary body sent from a memoryview in slices; `release` runs when it is done."""

    def __init__(self, view: memoryview, status_code: int, headers: dict[str, str],
                 media_type: str, release: Callable[[], None] = _nothing):
        self.view = view
        self.release = release
        super().__init__(None, status_code, {**headers, "content-length": str(view.nbytes)},
                         media_type)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            n = self.view.nbytes
            # `send` returns once a piece is handed to the transport, which (uvloop) may hold
            # the memory itself until the socket takes it: at most the write high-water mark
            # (64 KiB) more than the piece just written. So the last two pieces of a view
            # that goes back to a pool are copies; when `send` returns for the last one,
            # nothing pending can point into the pooled memory any more.
            owned = n if self.release is _nothing else max(n - 2 * PIECE, 0)
            for start in range(0, n, PIECE):
                piece = self.view[start : min(start + PIECE, n)]
                body = bytes(piece) if start + piece.nbytes > owned else piece
                await send({"type": "http.response.body", "body": body,
                            "more_body": start + PIECE < n})
            if n == 0:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.view = memoryview(b"")
            self.release()


class FileBodyResponse(Response):
    """Bytes [start, stop) of an open chunk file as the body, handed to the server's
    zero-copy send (built only for requests whose scope offers it); the file is closed
    when the response is done."""

    def __init__(self, file: BlobFile, start: int, stop: int, status_code: int,
                 headers: dict[str, str], media_type: str):
        self.file = file
        self.start, self.stop = start, stop
        super().__init__(None, status_code, {**headers, "content-length": str(stop - start)},
                         media_type)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            await send({"type": ZEROCOPY, "file": self.file, "offset": self.start,
                        "count": self.stop - self.start, "more_body": False})
        finally:
            self.file.close()


class FdResponse(Response):
    """A whole chunk handed over as its open file: a 1-byte body that carries the file's
    descriptor (the server's `kvstash.fdpass`, Unix sockets only); `Kvstash-Fd` names the
    chunk's size. The server's descriptor is closed when the response is done."""

    def __init__(self, file: BlobFile, headers: dict[str, str], media_type: str):
        self.file = file
        super().__init__(None, 200, {**headers, "content-length": "1",
                                     "kvstash-fd": str(file.size)}, media_type)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            await send({"type": FDPASS_MESSAGE, "file": self.file})
        finally:
            self.file.close()
