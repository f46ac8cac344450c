"""Response bodies sent straight from a file to the socket with sendfile(2).

A GET of a page-cached chunk file otherwise copies every byte three times on the way to
the client: file -> server buffer (read), server buffer -> socket (send), socket ->
client buffer (recv). sendfile(2) moves the file's pages into the socket inside the
kernel, which drops the first copy and leaves the server process no per-byte work.

Protocol side: `send_file` runs for an ASGI `http.response.zerocopysend` message (the
ASGI "Zero Copy Send" extension), which kvserver.protocol offers on connections without TLS.

The socket belongs to the event loop's transport, so this code writes only once the
transport's own buffer is empty (the response head went out first), and through a
duplicate of the socket's descriptor (and of the file's): if the loop closes the
connection (or the caller the file) meanwhile, the duplicate still names the same socket
and file, never a descriptor number reused by another connection or chunk. The sendfile calls run on a worker thread (a page-cache miss blocks in
sendfile); a worker gives the thread back as soon as the socket stays full for
`POLL_S`, and the wait for room happens on the event loop, so slow readers hold no
threads.
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import socket
from typing import Any

# How long a worker thread waits for socket room before handing the wait to the loop.
POLL_S = 0.02
# A peer that takes no bytes for this long is dropped.
STALL_TIMEOUT_S = 60.0
# Largest single sendfile(2) call (the kernel caps one call near 2 GiB anyway).
STEP = 64 << 20

_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ESHUTDOWN, errno.EBADF)
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


class PeerGone(Exception):
    """The client closed the connection while its body was being sent."""


class NoSendfile(Exception):
    """sendfile(2) refused this file before sending anything (a filesystem without it)."""


def _send_some(sock_fd: int, file_fd: int, offset: int, count: int,
               start: int | None = None) -> tuple[int, bool]:
    """sendfile until `count` bytes are sent, the file ends, or the socket stays full for
    POLL_S. Returns (bytes sent, socket full). `start`: the body's first offset (a refusal
    there is NoSendfile: nothing went out yet)."""
    sent = 0
    poller = None
    while sent < count:
        try:
            n = os.sendfile(sock_fd, file_fd, offset + sent, min(count - sent, STEP))
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(sock_fd, select.POLLOUT)
            if not poller.poll(POLL_S * 1000):
                return sent, True
            continue
        except OSError as exc:
            if exc.errno in _GONE:
                raise PeerGone(str(exc)) from exc
            if exc.errno in _UNSUPPORTED and offset + sent == start:
                raise NoSendfile(str(exc)) from exc
            raise
        if n == 0:  # the file is shorter than promised
            return sent, False
        sent += n
    return sent, False


async def _writable(loop: asyncio.AbstractEventLoop, fd: int, timeout: float) -> None:
    room = loop.create_future()

    def ready() -> None:
        if not room.done():
            room.set_result(None)
    loop.add_writer(fd, ready)
    try:
        await asyncio.wait_for(room, timeout)
    finally:
        loop.remove_writer(fd)


async def _drained(transport: asyncio.WriteTransport, timeout: float) -> bool:
    """Wait until the transport has written everything queued before us (the response
    head, or the tail of an earlier response on this connection)."""
    waited = 0.0
    delay = 0.0005
    while transport.get_write_buffer_size():
        if transport.is_closing() or waited > timeout:
            return False
        await asyncio.sleep(delay)
        waited += delay
        delay = min(delay * 2, 0.05)
    return not transport.is_closing()


async def sendfile_to(transport: Any, file_fd: int, offset: int, count: int,
                      timeout: float = STALL_TIMEOUT_S) -> int:
    """Send `count` bytes of `file_fd` from `offset` on the transport's socket; the bytes
    sent (fewer when the file is shorter). Raises PeerGone when the client went away,
    TimeoutError when it took nothing for `timeout` seconds, NoSendfile when the file's
    filesystem has no sendfile (nothing was sent: the caller may send the bytes itself),
    and OSError for an I/O error reading the file."""
    if not await _drained(transport, timeout):
        raise PeerGone("connection closed before the body")
    loop = asyncio.get_running_loop()
    sock_fd = os.dup(transport.get_extra_info("socket").fileno())
    try:
        file_fd = os.dup(file_fd)
    except OSError:
        os.close(sock_fd)
        raise
    in_thread: asyncio.Future | None = None
    try:
        sent = 0
        while sent < count:
            in_thread = loop.run_in_executor(None, _send_some, sock_fd, file_fd,
                                             offset + sent, count - sent, offset)
            n, full = await asyncio.shield(in_thread)
            in_thread = None
            sent += n
            if not full:
                break
            await _writable(loop, sock_fd, timeout)
        return sent
    finally:
        if in_thread is not None and not in_thread.done():
            # Cancelled while a worker still uses the descriptors: close them only once
            # that worker is done, so their numbers cannot be reused under it.
            in_thread.add_done_callback(lambda _: _close(sock_fd, file_fd))
        else:
            _close(sock_fd, file_fd)


async def pass_fd(transport: Any, file_fd: int, timeout: float = STALL_TIMEOUT_S) -> None:
    """Send one byte on the transport's Unix socket with `file_fd` attached (SCM_RIGHTS):
    the receiver gets its own descriptor of the same open file. Through a duplicate of the
    socket's descriptor, once the transport's own buffer is empty, as `sendfile_to`."""
    if not await _drained(transport, timeout):
        raise PeerGone("connection closed before the body")
    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
    try:
        while True:
            try:
                if socket.send_fds(sock, [b"\0"], [file_fd]) == 1:
                    return
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno in _GONE:
                    raise PeerGone(str(exc)) from exc
                raise
            await _writable(loop, sock.fileno(), timeout)
    finally:
        sock.close()


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)

