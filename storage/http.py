"""`http://host:port?token=...` — a kvserver as a store, over pooled raw HTTP/1.1 connections.

Why not httpx: a chunk is tens of MiB, and a generic client hands the body over in small
`bytes` pieces that must be copied again into the caller's buffer. Here `get_into` reads
the response head into a small buffer and then `recv_into`s the payload straight into the
caller's memory, and `put` sends the caller's buffer as is (its header is checked here,
its payload checksum by the server, which verifies every body it stores). Lookups are one
POST for thousands of keys.

Threading contract: one event loop at a time (sockets carry over between loops, so a
store may outlive an `asyncio.run`). Like every store, the hot path (`get`, `get_into`,
`exists`, `prefix_len`) answers "miss" on any failure: refused, reset, timeout, HTTP
error, or a body that fails verification; the connection involved is dropped, never
reused. After `breaker_failures` failures in a row the breaker (storage/breaker.py, the
same one every store and the connector use) opens and the hot path misses at once,
without I/O, for `breaker_cooldown`; then one probe request goes out: its success closes
the breaker, its failure reopens it for twice as long, up to `breaker_max_cooldown`.

Options: `token` (else $KVSTASH_TOKEN), `timeout` (the deadline of one operation, every
request and byte of it included, default 10s),
`connect_timeout` (1s), `pool` (connections, default 16), `verify` (re-check payload
checksums here, default true), `breaker_failures` (3), `breaker_cooldown` (2s),
`breaker_max_cooldown` (60s),
`max_chunk` (the largest chunk a `get` accepts, default 1GiB as the server's limit),
`max_listing` (the most keys one listing may carry, default 10M),
`unix_socket` (connect to a kvserver's `--unix-socket` path instead of HOST:PORT; HOST
still names the server in the Host header), `fd` (over a plain Unix socket, ask for chunk
files as descriptors: default true), and for https:// `ca` (a PEM file of trusted CAs;
default: the system's).

Why a Unix socket for a client on the server's host: every byte of a loopback TCP stream
goes through the TCP stack, which caps any loopback stream; a Unix stream socket skips
it, and the server's sendfile(2) hands the file's pages to the socket without a copy
(docs/kvserver.md has the figures). Better still, `get_into` over a plain Unix socket asks
for the chunk's open file (`Kvstash-Fd: 1`): a file-backed server that has verified the file
answers with a 1-byte body carrying the descriptor (SCM_RIGHTS), and the payload is read
from the page cache straight into the caller's buffer on a worker thread, header and
checksum checked here as for any body. No chunk byte crosses the socket.

Deadlines: the event loop's `sock_recv_into` returns at once, without letting any other
task or timer run, while bytes are waiting; a peer that keeps them coming would hold the
loop, and a timeout would fire only once the socket drains. So every read checks the
operation's deadline itself and gives the loop a turn at least every `_TURN_S`: a call
ends by its deadline however fast or slow the bytes come, and other tasks keep running.
"""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import json
import logging
import math
import os
import re
import socket
import ssl
import stat
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import quote, urlsplit

import xxhash

from hashing import is_valid_key
from storage.base import PROBE_KEY, Store, check_key
from storage.breaker import BreakerOptions, CircuitBreaker
from storage.codec import (
    HEADER_SIZE,
    MAX_CHUNK,
    ChunkError,
    ChunkHeader,
    TruncatedHeader,
    decode_header,
)
from storage.errors import ConfigError, InvalidChunk, StoreFull, StoreUnavailable
from storage.file import read_at, read_into_at
from storage.options import StoreURL, parse_bool, parse_seconds, parse_size

log = logging.getLogger("kvstash.storage.http")

OCTETS = "application/octet-stream"
_HEAD_BUF = 64 * 1024
_MAX_HEAD = _HEAD_BUF
# Bounds on what a reply may make this client hold, checked before anything is allocated
# or parsed (a server is trusted for nothing): kvserver's JSON replies are a few hundred
# bytes (a lookup of LOOKUP_BATCH keys ~1.4 KiB), its error bodies one short line.
_MAX_JSON = 1 << 20
_MAX_ERROR = 64 << 10
# A key listing is read in pieces of this size, so memory grows with the bytes that
# arrive, never with a Content-Length or chunk size the server announces.
_PIECE = 1 << 20
# `get` allocates a body up to this size at once, a larger one in steps of it.
_GROW = 64 << 20
# A listing line is a 49-character key and its newline; the bytes a listing may take are
# bounded at this many a key, so lines that are not keys cannot make it endless either.
_LISTED_BYTES_PER_KEY = 64
_MAX_LISTING = 10_000_000
# The longest a read goes on without letting the event loop run other tasks and timers.
_TURN_S = 0.005
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
# Pooled connections idle longer than this are closed rather than reused; kvserver keeps
# idle connections for 75 s, so the client normally closes first.
_IDLE_S = 30.0
# Keys per lookup request: well under the server's default limit (65536), large enough
# that a 64k-token prompt is one request.
LOOKUP_BATCH = 8192
# Send buffer asked for on Unix-socket connections, by this client and by kvserver (the
# kernel caps it at net.core.wmem_max): a Unix stream socket's sender may have at most
# this much in flight, and the 208 KiB default turns a 16 MiB body into some 80 wake-ups.
UNIX_SNDBUF = 4 << 20


# What parsing a hostile reply could raise if a check were missing (ChunkError, a
# ValueError, is the caller's to count as corruption).
_REPLY_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError,
                 MemoryError)


class _HttpError(Exception):
    """A response the operation cannot use; `status` 0 means no response at all."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message


class _Connection:
    """One HTTP/1.1 connection with a small read-ahead buffer for response heads.

    `reusable` turns True only once a response has been read to its end, so a connection
    abandoned mid-body (error, timeout, cancellation) is closed instead of pooled. `fds`:
    descriptors that arrived with responses (only a Unix socket receives any), for
    `take_fd`; those no response claims are closed after each exchange and on close.
    `deadline` (event-loop time) ends every read of the operation in progress; `held`: the
    operation keeps the connection past its exchange (a listing reading its body).
    """

    def __init__(self, sock: socket.socket | None, loop: asyncio.AbstractEventLoop):
        self.sock = sock
        self.loop = loop
        self.buf = bytearray(_HEAD_BUF)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.idle_since = time.monotonic()
        self.reused = False
        self.reusable = False
        self.answered = False  # a response head arrived on this connection
        self.held = False
        self.deadline = math.inf
        self.turn_at = 0.0
        self.fds: list[int] = []

    async def sendall(self, data: Any) -> None:
        assert self.sock is not None
        await self.loop.sock_sendall(self.sock, data)

    async def recv_into(self, view: memoryview) -> int:
        assert self.sock is not None
        return await self.loop.sock_recv_into(self.sock, view)

    async def _recv(self, view: memoryview) -> int:
        """`recv_into` under the deadline, with a turn for the loop at least every _TURN_S
        (the module docstring says why)."""
        now = self.loop.time()
        if now >= self.deadline:
            raise TimeoutError("the deadline passed while the reply was still coming")
        if now >= self.turn_at:
            self.turn_at = now + _TURN_S
            await asyncio.sleep(0)
        return await self.recv_into(view)

    def discard_fds(self) -> None:
        while self.fds:
            os.close(self.fds.pop())

    def take_fd(self) -> int:
        if len(self.fds) != 1:
            raise _HttpError(0, f"expected one descriptor with the body, got {len(self.fds)}")
        return self.fds.pop()

    def close(self) -> None:
        self.discard_fds()
        if self.sock is not None:
            self.sock.close()

    async def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start : self.end]
            self.start, self.end = 0, n
        if self.end == len(self.buf):
            raise _HttpError(0, "response head too large")
        n = await self._recv(self.view[self.end :])
        if n == 0:
            raise ConnectionResetError("server closed the connection")
        self.end += n

    async def read_head(self) -> tuple[int, dict[str, str]]:
        while True:
            i = self.buf.find(b"\r\n\r\n", self.start, self.end)
            if i >= 0:
                break
            await self._fill()
        lines = bytes(self.buf[self.start : i]).decode("latin-1").split("\r\n")
        self.start = i + 4
        self.answered = True
        parts = lines[0].split(" ", 2)
        status = parts[1] if len(parts) > 1 else ""
        if not (parts[0].startswith("HTTP/1.") and len(status) == 3 and status.isascii()
                and status.isdigit()):
            raise _HttpError(0, f"not an HTTP response: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(status), headers

    async def read_into(self, view: memoryview, hasher: Any = None) -> None:
        """Fill `view` exactly: buffered bytes first, then straight from the socket.

        With `hasher`, each piece is hashed as it lands, while it is still in the CPU's
        cache: cheaper than a second pass over the whole buffer afterwards.
        """
        have = min(self.end - self.start, view.nbytes)
        if have:
            view[:have] = self.view[self.start : self.start + have]
            self.start += have
            if hasher is not None:
                hasher.update(view[:have])
        while have < view.nbytes:
            n = await self._recv(view[have:])
            if n == 0:
                raise ConnectionResetError("server closed the connection mid-body")
            if hasher is not None:
                hasher.update(view[have : have + n])
            have += n

    async def read_exact(self, n: int) -> bytearray:
        out = bytearray(n)
        await self.read_into(memoryview(out))
        return out

    async def read_body(self, headers: dict[str, str], limit: int) -> bytes:
        """A small whole body (JSON, errors), chunked or with Content-Length; a body
        announced or grown past `limit` bytes is an _HttpError, before it is buffered."""
        out = bytearray()
        async for piece in self.iter_body(headers, limit):
            out += piece
        return bytes(out)

    async def iter_body(self, headers: dict[str, str], limit: int) -> AsyncIterator[bytes]:
        """The body in pieces of at most _PIECE bytes, refused past `limit` bytes."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            async for piece in self.iter_chunked(limit):
                yield piece
            return
        n = _content_length(headers)
        if n > limit:
            raise _HttpError(0, f"response body of {n} bytes is larger than expected")
        async for piece in self._pieces(n):
            yield piece

    async def _pieces(self, n: int) -> AsyncIterator[bytes]:
        """The next `n` bytes, in pieces of at most _PIECE bytes."""
        while n:
            piece = min(n, _PIECE)
            yield bytes(await self.read_exact(piece))
            n -= piece

    async def _read_line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.buf[self.start : i])
                self.start = i + 2
                return line
            await self._fill()

    async def iter_chunked(self, limit: int) -> AsyncIterator[bytes]:
        total = 0
        while True:
            size_line = await self._read_line()
            field = size_line.split(b";", 1)[0].strip(b" \t")
            if not _CHUNK_SIZE.fullmatch(field):
                raise _HttpError(0, f"bad chunk size line {size_line[:40]!r}")
            size = int(field, 16)
            if size == 0:
                while await self._read_line():  # trailers end with an empty line
                    pass
                return
            total += size
            if total > limit:
                raise _HttpError(0, f"chunked response body past {limit} bytes")
            async for piece in self._pieces(size):
                yield piece
            if await self._read_line() != b"":
                raise _HttpError(0, "chunked body is missing a CRLF")


# Read-then-hash unit of a handed-over chunk file: small enough to stay in the CPU's L2
# cache between the read and the hash (a hash pass over the whole payload rereads memory).
# Through a same-host kvserver on the README's VM, 256-512 KiB pieces ran best of 128 KiB
# to 4 MiB, and 5-20 % faster than one read followed by one hash.
_FILE_PIECE = 256 << 10
_FD_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize) if hasattr(socket, "CMSG_SPACE") else 0


class _UnixConnection(_Connection):
    """A plain Unix-socket connection that keeps the descriptors the server sends along
    (SCM_RIGHTS) in `fds`."""

    async def recv_into(self, view: memoryview) -> int:
        assert self.sock is not None
        while True:
            try:
                n, ancillary, flags, _ = self.sock.recvmsg_into([view], _FD_SPACE)
                break
            except (BlockingIOError, InterruptedError):
                await self._readable()
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self.fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise _HttpError(0, "the server sent more descriptors than asked for")
        return n

    async def _readable(self) -> None:
        assert self.sock is not None
        ready = self.loop.create_future()
        fd = self.sock.fileno()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        self.loop.add_reader(fd, wake)
        try:
            await ready
        finally:
            self.loop.remove_reader(fd)


async def _read_chunk_header(conn: _Connection, key: str, length: int) -> tuple[ChunkHeader, bytes]:
    """The header of the chunk body of `length` bytes that follows on `conn` and its raw
    bytes: it must name `key`, and the payload must end where the body ends."""
    if length < HEADER_SIZE:
        raise ChunkError(f"body of {length} bytes is too short for a chunk")
    head = await conn.read_exact(HEADER_SIZE)
    try:
        header = decode_header(head, key)
    except TruncatedHeader as short:  # a header longer than 4 KiB: the rest follows
        if short.header_len > length:
            raise
        head = head + await conn.read_exact(short.header_len - HEADER_SIZE)
        header = decode_header(head, key)
    if header.header_len != len(head) or header.total_len != length:
        raise ChunkError(f"body is {length} bytes, header says {header.total_len}")
    return header, bytes(head)


def _read_chunk_file(fd: int, key: str, dst: memoryview, verify: bool) -> ChunkHeader | None:
    """The chunk in the open file `fd` (handed over by the server): header checked, payload
    read into `dst` (None when it does not fit), checksum checked when `verify`. Closes fd."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a pipe, socket or device: never read
            raise ChunkError("the descriptor handed over is not a regular file")
        size = st.st_size
        head = read_at(fd, HEADER_SIZE)
        try:
            header = decode_header(head, key)
        except TruncatedHeader as short:
            if short.header_len > size:
                raise
            header = decode_header(read_at(fd, short.header_len), key)
        if header.total_len != size:
            raise ChunkError(f"file is {size} bytes, header says {header.total_len}")
        if dst.nbytes < header.payload_len:
            return None
        payload = dst[: header.payload_len]
        hasher = xxhash.xxh3_64(seed=0) if verify else None
        step = _FILE_PIECE if verify else payload.nbytes
        for start in range(0, payload.nbytes, step):
            # Hashed piece by piece right after it is read, while it is still in the CPU's
            # cache: a second pass over the whole payload would read it from memory again.
            piece = payload[start : start + step]
            if read_into_at(fd, piece, header.header_len + start) != piece.nbytes:
                raise ChunkError("the chunk file ended early")
            if hasher is not None:
                hasher.update(piece)
        if hasher is not None and hasher.intdigest() != header.payload_checksum:
            raise ChunkError(f"payload checksum mismatch for {key}")
        return header
    finally:
        os.close(fd)


async def _read_handed_over(fd: int, key: str, dst: memoryview, verify: bool) -> ChunkHeader | None:
    """`_read_chunk_file` on a worker thread, which owns `fd` once it starts. Cancelled
    before it starts, the read never starts and `fd` is closed here; cancelled while it
    runs, it is waited for: no byte lands in the caller's buffer after this returns."""
    unclaimed = [fd]

    def read() -> ChunkHeader | None:
        try:
            mine = unclaimed.pop()
        except IndexError:
            return None  # given up before this thread got to it
        return _read_chunk_file(mine, key, dst, verify)

    work = asyncio.get_running_loop().run_in_executor(None, read)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        try:
            os.close(unclaimed.pop())
        except IndexError:  # the read is running
            while not work.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({work})
            if not work.cancelled():
                work.exception()  # retrieved: the cancellation is what the caller sees
        raise


class _TlsConnection(_Connection):
    """https:// through asyncio streams: TLS decrypts into its own buffers anyway."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 loop: asyncio.AbstractEventLoop):
        super().__init__(None, loop)
        self.reader, self.writer = reader, writer

    async def sendall(self, data: Any) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv_into(self, view: memoryview) -> int:
        data = await self.reader.read(view.nbytes)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.writer.close()


_RANGE = re.compile(r"bytes (\d{1,18})-(\d{1,18})/(\d{1,18})")


def _content_length(headers: dict[str, str]) -> int:
    value = headers.get("content-length", "")
    # 18 digits: below 2**63, so no length can overflow an allocation or a slice.
    if not (value.isascii() and value.isdigit() and len(value) <= 18):
        raise _HttpError(0, f"response without a usable Content-Length ({value[:40]!r})")
    return int(value)


def _take_keys(lines: list[bytes], keys: list[str]) -> int:
    """Append the well-formed keys among `lines` to `keys` -> how many lines were not
    empty and not a key."""
    bad = 0
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        text = line.decode("ascii", "replace")
        if is_valid_key(text):
            keys.append(text)
        else:
            bad += 1
    return bad


def _parse_json(body: bytes) -> Any:
    """A JSON reply already bounded in size; anything unparsable (bad UTF-8, nesting
    deeper than the parser's recursion limit, an over-long number) is an _HttpError."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise _HttpError(0, f"unparsable JSON reply ({type(exc).__name__})") from exc


def _lookup_answer(answer: Any, count: int) -> tuple[int, list[bool]]:
    """(prefix_len, presence bits) of a lookup reply for `count` keys, checked against
    each other: a reply of another shape, or one that contradicts itself, is an _HttpError."""
    if not isinstance(answer, dict):
        raise _HttpError(0, "lookup reply is not a JSON object")
    prefix, present = answer.get("prefix_len"), answer.get("present")
    if type(prefix) is not int or not 0 <= prefix <= count:
        raise _HttpError(0, f"lookup reply has prefix_len {str(prefix)[:40]} for {count} keys")
    if type(answer.get("count", count)) is not int or answer.get("count", count) != count:
        raise _HttpError(0, f"lookup reply counts other keys than the {count} asked for")
    if not isinstance(present, str):
        raise _HttpError(0, "lookup reply has no usable presence bitmap")
    try:
        bits = base64.b64decode(present, validate=True)
    except ValueError as exc:
        raise _HttpError(0, "lookup bitmap is not base64") from exc
    if len(bits) != (count + 7) // 8:
        raise _HttpError(0, f"lookup bitmap of {len(bits)} bytes for {count} keys")
    out = [bool(bits[i >> 3] >> (i & 7) & 1) for i in range(count)]
    if not all(out[:prefix]) or (prefix < count and out[prefix]):
        raise _HttpError(0, "lookup reply's prefix_len disagrees with its bitmap")
    return prefix, out


class HttpStore(Store):
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        connect_timeout: float = 1.0,
        pool: int = 16,
        verify: bool = True,
        breaker_failures: int = 3,
        breaker_cooldown: float = 2.0,
        breaker_max_cooldown: float = 60.0,
        ca_file: str | None = None,
        unix_socket: str | None = None,
        fd: bool = True,
        max_chunk: int = MAX_CHUNK,
        max_listing: int = _MAX_LISTING,
        url: str | None = None,
    ):
        super().__init__()
        parts = urlsplit(base_url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.username:
            raise ConfigError(f"{url or base_url}: expected http[s]://HOST[:PORT][/prefix]")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if self.tls else 80)
        self.host_header = parts.netloc
        self.prefix = parts.path.rstrip("/")
        self.url = url or base_url
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.pool_size = pool
        self.verify = verify
        self.max_chunk = max_chunk
        self.max_listing = max_listing
        self._breaker = CircuitBreaker(breaker_failures, breaker_cooldown, breaker_max_cooldown)
        token = token if token is not None else os.environ.get("KVSTASH_TOKEN")
        if token and not (token.isascii() and token.isprintable() and " " not in token):
            raise ConfigError(f"{self.url}: the token must be printable ASCII without spaces")
        self._auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._idle: list[_Connection] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._warned: set[int] = set()
        self.ca_file = ca_file
        self._tls_context: ssl.SSLContext | None = None
        if unix_socket is not None and not unix_socket:
            raise ConfigError(f"{self.url}: unix_socket needs a path")
        self.unix_socket = unix_socket
        self._want_fd = "Kvstash-Fd: 1\r\n" if unix_socket and fd and not self.tls else ""

    @classmethod
    def from_url(cls, u: StoreURL) -> HttpStore:
        opts = {
            "token": u.take("token"),
            "timeout": u.take("timeout", parse_seconds, 10.0),
            "connect_timeout": u.take("connect_timeout", parse_seconds, 1.0),
            "pool": u.take("pool", int, 16),
            "verify": u.take("verify", parse_bool, True),
            "ca_file": u.take("ca"),
            "unix_socket": u.take("unix_socket"),
            "fd": u.take("fd", parse_bool, True),
            "max_chunk": u.take("max_chunk", parse_size, MAX_CHUNK),
            "max_listing": u.take("max_listing", int, _MAX_LISTING),
        }
        breaker = BreakerOptions.from_url(u, failures=3, cooldown_s=2.0)
        u.finish()
        if opts["pool"] < 1:
            raise ConfigError(f"{u.redacted()}: pool must be >= 1")
        if opts["max_listing"] < 1:
            raise ConfigError(f"{u.redacted()}: max_listing must be >= 1")
        if opts["max_chunk"] < HEADER_SIZE:
            raise ConfigError(f"{u.redacted()}: max_chunk must be at least {HEADER_SIZE} bytes")
        base = f"{u.scheme}://{u.netloc}{u.path}"
        return cls(base, url=u.redacted(), breaker_failures=breaker.failures,
                   breaker_cooldown=breaker.cooldown_s,
                   breaker_max_cooldown=breaker.max_cooldown_s, **opts)

    # -- connections ---------------------------------------------------------------------

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # Plain sockets survive a new loop; TLS streams and the semaphore do not.
            self._idle = [c for c in self._idle if not isinstance(c, _TlsConnection)]
            for c in self._idle:
                c.loop = loop
            self._loop = loop
            self._slots = asyncio.Semaphore(self.pool_size)
        return loop

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        if self.tls:
            if self._tls_context is None:
                self._tls_context = ssl.create_default_context(cafile=self.ca_file)
            if self.unix_socket:
                opening = asyncio.open_unix_connection(
                    self.unix_socket, ssl=self._tls_context, server_hostname=self.host)
            else:
                opening = asyncio.open_connection(self.host, self.port, ssl=self._tls_context)
            reader, writer = await asyncio.wait_for(opening, self.connect_timeout)
            return _TlsConnection(reader, writer, loop)
        unix = bool(self.unix_socket)
        if unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
            addr: Any = self.unix_socket
        else:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        try:
            # asyncio.timeout, not wait_for: wait_for runs the connect in a task of its own
            # whose ConnectionRefusedError goes unretrieved (and logged) when the caller
            # is cancelled at the same moment.
            async with asyncio.timeout(self.connect_timeout):
                await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return _UnixConnection(sock, loop) if unix else _Connection(sock, loop)

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            c = self._idle.pop()
            if now - c.idle_since < _IDLE_S:
                c.reused = True
                return c
            c.close()
        return None

    async def _exchange(self, op: Any, deadline: float) -> Any:
        """Run `op(conn)` on a pooled connection, its reads ending at `deadline`; retry once
        on a fresh one when a reused connection turns out to have been closed by the server
        while idle. A connection `op` marks `held` is its to close."""
        loop = self._bind_loop()
        assert self._slots is not None
        async with self._slots:
            for attempt in (0, 1):
                conn = self._take_idle() if attempt == 0 else None
                if conn is None:
                    conn = await self._connect(loop)
                conn.reusable = conn.answered = conn.held = False
                conn.deadline = deadline
                conn.turn_at = loop.time() + _TURN_S
                try:
                    result = await op(conn)
                except (ConnectionResetError, BrokenPipeError) as exc:
                    conn.close()
                    if conn.reused and attempt == 0 and not conn.answered:
                        continue
                    raise _HttpError(0, f"connection lost: {exc}") from exc
                except _REPLY_ERRORS as exc:
                    conn.close()
                    if isinstance(exc, ChunkError):
                        raise
                    # Every reply is bounded and checked before use; this is the last line,
                    # so that no reply can raise anything else into the caller.
                    log.warning("%s: unusable reply: %s: %.200s", self, type(exc).__name__, exc)
                    raise _HttpError(0, f"unusable reply ({type(exc).__name__})") from exc
                except BaseException:
                    conn.close()
                    raise
                conn.discard_fds()  # unannounced ones: a server may not pile them up here
                if not conn.held:
                    self._release(conn)
                return result
        raise AssertionError("unreachable")

    def _release(self, conn: _Connection) -> None:
        """Back to the pool if its last response was read to the end, else closed."""
        if conn.reusable and len(self._idle) < self.pool_size:
            conn.idle_since = time.monotonic()
            conn.deadline = math.inf
            self._idle.append(conn)
        else:
            conn.close()

    def _deadline(self) -> float:
        """The event-loop time by which an operation starting now must end."""
        return asyncio.get_running_loop().time() + self.timeout

    async def _call(self, op: Any, deadline: float | None = None) -> Any:
        """`_exchange` under the circuit breaker, ending by `deadline` (default: `timeout`
        from now; an operation of several requests passes the one it started with)."""
        breaker = self._breaker
        if not breaker.allow():
            raise _HttpError(0, "circuit open: recent requests to the server failed")
        verdict: bool | None = None  # None: cancelled, neither answer nor failure
        if deadline is None:
            deadline = self._deadline()
        try:
            async with asyncio.timeout_at(deadline):  # no inner task (see _connect)
                result = await self._exchange(op, deadline)
            verdict = True
        except (TimeoutError, OSError, _HttpError) as exc:
            # A 4xx is the server answering: it is up.
            verdict = isinstance(exc, _HttpError) and 0 < exc.status < 500
            if isinstance(exc, _HttpError):
                raise
            raise _HttpError(0, f"{type(exc).__name__}: {exc}") from exc
        finally:
            if breaker.record(verdict):
                log.warning("%s: requests failing, not trying for %.1fs", self,
                            breaker.open_for_s)
        return result

    def _head(self, method: str, path: str, length: int | None = None,
              ctype: str = OCTETS, extra: str = "") -> bytes:
        body = f"Content-Length: {length}\r\nContent-Type: {ctype}\r\n" if length is not None else ""
        return (f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                f"{self._auth}{body}{extra}\r\n").encode("latin-1")

    @staticmethod
    def _chunk_path(key: str) -> str:
        return "/v1/chunks/" + quote(key, safe="/")

    async def _error_of(self, conn: _Connection, status: int, headers: dict[str, str]) -> _HttpError:
        """Read a small error body (keeping the connection) and turn it into an _HttpError
        of that status; a body too large or malformed loses its message and its connection,
        never the status."""
        try:
            body = await conn.read_body(headers, _MAX_ERROR)
        except _HttpError:
            return _HttpError(status, f"HTTP {status}")
        conn.reusable = headers.get("connection", "").lower() != "close"
        try:
            answer = _parse_json(body) if body else None
        except _HttpError:
            answer = None
        message = answer.get("error") if isinstance(answer, dict) else None
        if not isinstance(message, str) or not message:
            message = f"HTTP {status}"
        return _HttpError(status, message[:200])

    def _note_failure(self, what: str, key: str, exc: Exception) -> None:
        status = getattr(exc, "status", 0)
        if status in (401, 403) and status not in self._warned:
            self._warned.add(status)
            log.warning("%s: %s refused: %s (check the token)", self, what, exc)
        else:
            log.debug("%s: %s %s failed: %s", self, what, key, exc)

    # -- the Store protocol --------------------------------------------------------------

    async def put(self, key: str, blob: Any) -> bool:
        check_key(key)
        view = memoryview(blob).cast("B")
        # Header, key and length are checked here, so a wrong blob costs no round trip; the
        # payload checksum is left to the server, which verifies every body it stores.
        try:
            header = decode_header(view, key)
        except ChunkError as exc:
            raise InvalidChunk(f"rejected chunk for {key}: {exc}") from exc
        if header.total_len != view.nbytes:
            raise InvalidChunk(f"rejected chunk for {key}: {view.nbytes} bytes, header says "
                               f"{header.total_len}")

        async def op(conn: _Connection) -> bool:
            # Expect: 100-continue lets the server refuse (413, 401, 415) before a large
            # body is sent; kvserver answers 100 once the route starts reading the body.
            await conn.sendall(self._head("PUT", self._chunk_path(key), view.nbytes,
                                          extra="Expect: 100-continue\r\n"))
            status, headers = await conn.read_head()
            if status != 100:
                err = await self._error_of(conn, status, headers)
                conn.reusable = False  # the server may still be waiting for the body
                raise err
            await conn.sendall(view)
            status, headers = await conn.read_head()
            if status in (200, 201):
                await conn.read_body(headers, _MAX_JSON)
                conn.reusable = True
                return status == 201
            raise await self._error_of(conn, status, headers)

        try:
            wrote = await self._call(op)
        except _HttpError as exc:
            self.counters["put_errors"] += 1
            if exc.status == 400:
                raise InvalidChunk(f"{self}: server rejected {key}: {exc.message}") from exc
            if exc.status in (413, 507):
                raise StoreFull(f"{self}: no room for {key}: {exc.message}") from exc
            raise StoreUnavailable(f"{self}: put {key} failed: {exc}") from exc
        if wrote:
            self.counters["puts"] += 1
            self.counters["bytes_written"] += view.nbytes
        else:
            self.counters["put_skipped"] += 1
        return wrote

    async def _get_response(self, conn: _Connection, key: str,
                            extra: str = "") -> tuple[int, dict[str, str]] | None:
        """Send a GET; (the body's length, the headers) on 200, None on 404 (body consumed)."""
        await conn.sendall(self._head("GET", self._chunk_path(key), extra=extra))
        status, headers = await conn.read_head()
        if status == 200:
            return _content_length(headers), headers
        err = await self._error_of(conn, status, headers)
        if status == 404:
            return None
        raise err

    def _count_failure(self, what: str, key: str, exc: Exception) -> None:
        if isinstance(exc, ChunkError):
            self.counters["corrupt"] += 1
            log.warning("%s: %s of %s failed verification: %s", self, what, key, exc)
        else:
            self.counters["errors"] += 1
            self._note_failure(what, key, exc)

    async def get(self, key: str) -> bytes | bytearray | None:
        check_key(key)

        async def op(conn: _Connection) -> bytearray | None:
            answer = await self._get_response(conn, key)
            if answer is None:
                return None
            length = answer[0]
            if length > self.max_chunk:
                raise _HttpError(0, f"a {length}-byte chunk is over max_chunk={self.max_chunk}")
            # The header first: nothing the size of the body is allocated before the
            # header names this key and this very length.
            header, head = await _read_chunk_header(conn, key, length)
            blob = bytearray(min(length, _GROW))
            blob[: len(head)] = head
            hasher = xxhash.xxh3_64(seed=0) if self.verify else None
            have = len(head)
            while True:
                with memoryview(blob) as view:
                    await conn.read_into(view[have:], hasher)
                have = len(blob)
                if have == length:
                    break
                # A larger body grows as it arrives: allocating (and zeroing) what a
                # header announces could outlast the deadline before a byte is read.
                blob += bytes(min(length - have, _GROW))
            conn.reusable = True
            if hasher is not None and hasher.intdigest() != header.payload_checksum:
                raise ChunkError(f"payload checksum mismatch for {key}")
            return blob  # a bytearray filled in place: no copy after the network

        try:
            blob = await self._call(op)
        except (_HttpError, ChunkError) as exc:
            self._count_failure("get", key, exc)
            blob = None
        self._count_get(None if blob is None else len(blob))
        return blob

    async def get_into(self, key: str, out: Any) -> ChunkHeader | None:
        check_key(key)
        dst = memoryview(out).cast("B")

        async def op(conn: _Connection) -> ChunkHeader | None:
            answer = await self._get_response(conn, key, self._want_fd)
            if answer is None:
                return None
            length, headers = answer
            if "kvstash-fd" in headers and isinstance(conn, _UnixConnection):
                if length != 1:
                    raise _HttpError(0, f"a descriptor answer with a {length}-byte body")
                await conn.read_exact(1)
                fd = conn.take_fd()
                conn.reusable = True
                return await _read_handed_over(fd, key, dst, self.verify)
            header, _ = await _read_chunk_header(conn, key, length)
            if dst.nbytes < header.payload_len:
                return None  # the connection is dropped unread: cheaper than draining it
            hasher = xxhash.xxh3_64(seed=0) if self.verify else None
            await conn.read_into(dst[: header.payload_len], hasher)
            conn.reusable = True
            if hasher is not None and hasher.intdigest() != header.payload_checksum:
                raise ChunkError(f"payload checksum mismatch for {key}")
            return header

        try:
            header = await self._call(op)
        except (_HttpError, ChunkError) as exc:
            self._count_failure("get_into", key, exc)
            header = None
        self._count_get(None if header is None else header.total_len)
        return header

    # -- ranged reads (SupportsRangeReads) --------------------------------------------------

    async def _range_response(self, conn: _Connection, key: str, start: int,
                              stop: int) -> tuple[int, int] | None:
        """Send `GET` with `Range: bytes=start-(stop-1)`; (the body's length, the chunk's
        total size) on a 206 whose Content-Range is the range asked for (clipped at the
        end), None on 404 or 416."""
        await conn.sendall(self._head("GET", self._chunk_path(key),
                                      extra=f"Range: bytes={start}-{stop - 1}\r\n"))
        status, headers = await conn.read_head()
        if status == 206:
            length = _content_length(headers)
            got = _RANGE.fullmatch(headers.get("content-range", ""))
            if got is None:
                raise _HttpError(0, f"a 206 with Content-Range {headers.get('content-range')!r}")
            first, last, total = (int(x) for x in got.groups())
            if first != start or last != min(stop, total) - 1 or length != last - first + 1:
                raise _HttpError(0, f"asked for bytes {start}-{stop - 1}, got {first}-{last} "
                                    f"({length} bytes)")
            if total > self.max_chunk:
                raise _HttpError(0, f"a {total}-byte chunk is over max_chunk={self.max_chunk}")
            return length, total
        if status == 200:  # Range ignored: the whole chunk follows; not worth reading
            raise _HttpError(0, "the server ignored Range")
        err = await self._error_of(conn, status, headers)
        if status in (404, 416):
            return None
        raise err

    async def read_header(self, key: str) -> ChunkHeader | None:
        """The verified header: one `Range: bytes=0-4095` GET (a second for a longer one),
        both within one `timeout`."""
        check_key(key)
        deadline = self._deadline()

        async def head_of(stop: int) -> tuple[bytearray, int] | None:
            async def op(conn: _Connection) -> tuple[bytearray, int] | None:
                got = await self._range_response(conn, key, 0, stop)
                if got is None:
                    return None
                data = await conn.read_exact(got[0])
                conn.reusable = True
                return data, got[1]

            return await self._call(op, deadline)

        header = None
        try:
            got = await head_of(HEADER_SIZE)
            if got is not None:
                try:
                    header = decode_header(got[0], key)
                except TruncatedHeader as short:
                    again = await head_of(short.header_len)
                    got = None if again is None else (again[0], got[1])
                    header = None if again is None else decode_header(again[0], key)
            if header is not None and got is not None and header.total_len != got[1]:
                raise ChunkError(f"chunk is {got[1]} bytes, header says {header.total_len}")
        except (_HttpError, ChunkError) as exc:
            self._count_failure("read_header", key, exc)
            header = None
        self._count_get(None if header is None else header.total_len)
        return header

    async def read_range_into(self, key: str, header: ChunkHeader, offset: int, out: Any) -> bool:
        """Payload bytes [offset, offset + len(out)) by one Range GET; False on a miss."""
        check_key(key)
        view = memoryview(out).cast("B")
        if offset < 0 or offset + view.nbytes > header.payload_len or not view.nbytes:
            return False
        start = header.header_len + offset

        async def op(conn: _Connection) -> bool:
            got = await self._range_response(conn, key, start, start + view.nbytes)
            if got is None:
                return False
            if got[0] != view.nbytes or got[1] != header.total_len:
                raise _HttpError(0, f"range of {got[0]} bytes of a {got[1]}-byte chunk, "
                                    f"expected {view.nbytes} of {header.total_len}")
            await conn.read_into(view)
            conn.reusable = True
            return True

        try:
            return bool(await self._call(op))
        except (_HttpError, ChunkError) as exc:
            self._count_failure("read_range_into", key, exc)
            return False

    async def _lookup(self, keys: Sequence[str], stop_at_gap: bool,
                      deadline: float) -> tuple[int, list[bool]]:
        body = json.dumps({"keys": list(keys), "stop_at_gap": stop_at_gap},
                          separators=(",", ":")).encode()

        async def op(conn: _Connection) -> tuple[int, list[bool]]:
            await conn.sendall(self._head("POST", "/v1/lookup", len(body), "application/json") + body)
            status, headers = await conn.read_head()
            if status != 200:
                raise await self._error_of(conn, status, headers)
            answer = _parse_json(await conn.read_body(headers, _MAX_JSON))
            conn.reusable = True
            return _lookup_answer(answer, len(keys))

        return await self._call(op, deadline)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        for k in keys:
            check_key(k)
        out: list[bool] = []
        deadline = self._deadline()  # one for all the batches: a lookup is one operation
        try:
            for i in range(0, len(keys), LOOKUP_BATCH):
                out += (await self._lookup(keys[i : i + LOOKUP_BATCH], False, deadline))[1]
        except _HttpError as exc:
            self._count_failure("lookup", "", exc)
            return [False] * len(keys)
        return out

    async def probe(self) -> str | None:
        try:
            await self._lookup([PROBE_KEY], False, self._deadline())
        except _HttpError as exc:
            self._count_failure("lookup", "", exc)
            return f"{self}: lookup failed: {exc}"
        return None

    async def prefix_len(self, keys: Sequence[str]) -> int:
        for k in keys:
            check_key(k)
        n = 0
        deadline = self._deadline()
        try:
            for i in range(0, len(keys), LOOKUP_BATCH):
                batch = keys[i : i + LOOKUP_BATCH]
                got = (await self._lookup(batch, True, deadline))[0]
                n += got
                if got < len(batch):
                    break
        except _HttpError as exc:
            self._count_failure("lookup", "", exc)
            return 0
        return n

    async def delete(self, key: str) -> bool:
        check_key(key)

        async def op(conn: _Connection) -> bool:
            await conn.sendall(self._head("DELETE", self._chunk_path(key)))
            status, headers = await conn.read_head()
            if status == 204:  # no body by definition
                conn.reusable = True
                return True
            err = await self._error_of(conn, status, headers)
            if status == 404:
                return False
            raise err

        try:
            deleted = await self._call(op)
        except _HttpError as exc:
            raise StoreUnavailable(f"{self}: delete {key} failed: {exc}") from exc
        if deleted:
            self.counters["deletes"] += 1
        return deleted

    async def list_keys(self) -> AsyncIterator[str]:
        """Every key the server lists, handed on as its reply arrives.

        Memory stays at one piece of the reply however long the listing is. The server has
        `timeout` in all to deliver it (the time the caller spends between keys is not
        counted: the reply waits in the socket meanwhile) and at most `max_listing` keys in
        as many times 64 bytes; past either, or on any failure, the keys already handed on
        are followed by StoreUnavailable. The connection is the listing's own while it
        runs, so the caller may use the store's pool meanwhile.
        """
        async def op(conn: _Connection) -> tuple[_Connection, dict[str, str]]:
            await conn.sendall(self._head("GET", "/v1/keys"))
            status, headers = await conn.read_head()
            if status != 200:
                raise await self._error_of(conn, status, headers)
            conn.held = True
            return conn, headers

        try:
            deadline = self._deadline()
            conn, headers = await self._call(op, deadline)
        except _HttpError as exc:
            raise StoreUnavailable(f"{self}: listing failed: {exc}") from exc
        loop = asyncio.get_running_loop()
        left = deadline - loop.time()
        listed = bad = 0
        rest = b""
        try:
            async with contextlib.aclosing(
                    conn.iter_body(headers, self.max_listing * _LISTED_BYTES_PER_KEY)) as body:
                while True:
                    # The clock runs while this reads and parses, never while the caller
                    # holds the keys handed on: the deadline moves on by that time.
                    resumed = loop.time()
                    conn.deadline = resumed + left
                    async with asyncio.timeout_at(conn.deadline):
                        piece = await anext(body, None)
                        await asyncio.sleep(0)  # a turn for the loop for each piece
                    if piece is None:
                        lines, rest = [rest], b""
                    else:
                        lines = (rest + piece).split(b"\n")
                        rest = lines.pop()
                        if len(rest) > 4096:  # no line of a key listing is this long
                            raise _HttpError(0, "key listing has an over-long line")
                    keys: list[str] = []
                    bad += _take_keys(lines, keys)
                    left -= loop.time() - resumed
                    if left <= 0:
                        raise TimeoutError(f"the listing took longer than {self.timeout}s")
                    for k in keys:
                        if listed == self.max_listing:
                            raise _HttpError(0, f"more than max_listing={listed} keys")
                        listed += 1
                        yield k
                    if piece is None:
                        break
            conn.reusable = True
        except (OSError, _HttpError, *_REPLY_ERRORS) as exc:  # TimeoutError is an OSError
            conn.reusable = False
            self._breaker.failure()
            if not isinstance(exc, (OSError, _HttpError)):
                log.warning("%s: unusable listing: %s: %.200s", self, type(exc).__name__, exc)
            raise StoreUnavailable(f"{self}: listing failed after {listed} keys: "
                                   f"{type(exc).__name__}: {exc}") from exc
        finally:
            conn.discard_fds()
            self._release(conn)
            if bad:
                self.counters["errors"] += 1
                log.warning("%s: key listing had %d malformed line(s), skipped", self, bad)

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(), "backend": "http", "pooled_connections": len(self._idle),
            "breaker_open": self._breaker.is_open, **self._breaker.snapshot(),
        }

    async def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()
