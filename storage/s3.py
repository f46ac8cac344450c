"""`s3://bucket/prefix?endpoint=...` — chunks as S3 objects through aiobotocore.

Layout: object `<prefix>/<ns_id>/<digest>` per chunk (the digest is random, so request
rate spreads over S3's partitions); tenants under `<prefix>/tenants/<tenant>/`; access
markers for gc under `<scope>/.atime/` (see storage/s3_gc.py).

Hot path. One long-lived aiobotocore client per event loop (created on first use in
that loop), a connection pool of `pool` sockets and at most `max_in_flight` requests at once.
A GET is never preceded by a HEAD: 404/403 is the miss. The first GET asks for the first
1.25 x `range_size` bytes (default 16 MiB, so a 16 MiB payload plus its 4 KiB header is
one request); its Content-Range gives the object size, and the rest is fetched as
parallel ranged GETs while the first body streams, straight into the destination buffer
(`get_into` writes the payload into the caller's buffer). Only a read alone splits (up
to `split_reads` in flight; an endpoint on loopback never splits by default): one
beside others asks for the whole object at once. Every
blob is verified (header and xxh3 payload checksum) and a corrupt object is deleted and
counted as a miss.

Every GET of chunk bytes (`get`, `get_into` and so `get_into_many`, and the ranged
`read_header` / `read_range_into`) runs on the blocking botocore client
in reader threads, each body read with `recv_into` straight into its destination: aiohttp
hands a body over as fresh `bytes` per socket read, copies it again in its parser and
pauses and resumes the socket every 128 KiB, so a GET through it costs more CPU per byte
than a plain boto3 `get_object().read()`, and where the server shares the cores, more
requests in flight made the store slower (see docs/s3.md). The event loop keeps the
gate, the breaker and the deadline; a read whose caller is cancelled (the deadline) is
told to stop and is waited for, so no byte lands in a caller's buffer after the call has
returned. Everything else (puts, HEADs, lists, deletes) stays on aiobotocore.

Publishing is create-only: `PutObject` with `If-None-Match: *` (412 = already there =
success, 409 = a concurrent writer: retried), multipart above `multipart_threshold` with
the same condition on `CompleteMultipartUpload`. Some S3-compatible servers ignore the
header; the first put feature-detects that with a probe object and then falls back to
HEAD-before-PUT (racy, but keys are content-addressed, so a lost race rewrites the same
bytes).

Failures. botocore retries throttling, 5xx and connection errors (`retries` attempts,
`retry_mode` standard or adaptive) under `connect_timeout`/`read_timeout`, and each whole
operation has a `timeout` deadline. Nothing is sized by a server's word alone: an object
over `max_chunk` (default 1 GiB) is a miss refused unread, and a read allocates an
object's buffer only once its chunk header has matched the reported size. A circuit
breaker counts endpoint failures: once it opens, gets answer "miss" and puts raise
StoreUnavailable without a network call until a half-open probe succeeds. No botocore or
aiohttp exception leaves this module.

Checksums and signing. Defaults are `checksum=when_required` and `sign_payload=false`:
botocore >= 1.36 adds CRC32 trailers / headers to every PUT and validates them on GET,
which several S3-compatible servers reject or mangle (ranged GETs carrying a
whole-object CRC), and over plain http it SHA-256-signs every body (~1.9 GB/s of one
core). The chunk format already carries an xxh3-64 of the payload that every reader
verifies end to end, so the transport checksums buy nothing here. Set
`checksum=when_supported` / `sign_payload=true` to get botocore's behaviour back.

Credentials come from the normal AWS chain (env, profile, instance role) unless the URL
gives `access_key`/`secret_key`/`session_token` or `profile`; `anonymous=true` sends
unsigned requests. The URL is only ever shown redacted.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import aiohttp
import urllib3.exceptions
import xxhash
from botocore.exceptions import BotoCoreError, ClientError

from hashing import is_valid_key
from storage.base import PROBE_KEY, Store, check_blob, check_key, check_tenant
from storage.buffers import unfilled_bytearray
from storage.codec import HEADER_SIZE, ChunkError, ChunkHeader, TruncatedHeader, decode_header
from storage.errors import StoreError, StoreUnavailable
from storage.options import StoreURL
from storage.s3_client import BlockingReads, S3Connection, S3Options
from storage.s3_gc import marker_name, plan_eviction

log = logging.getLogger("kvstash.storage.s3")

TENANTS = "tenants"
PROBE_DIR = ".kvstash"
_MISS_STATUS = (403, 404)
_CONFLICT_RETRIES = (0.05, 0.1, 0.2, 0.4)
_TOUCHED_MAX = 100_000
_STALE_UPLOAD_S = 86_400.0
_TRANSPORT_ERRORS = (BotoCoreError, aiohttp.ClientError, OSError, TimeoutError,
                     urllib3.exceptions.HTTPError, http.client.HTTPException)
# A reader thread checks between slices of this size whether its caller still waits.
_SLICE = 1024 * 1024
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_NS_DIR = re.compile(r"[0-9a-f]{16}/")


def _status(exc: ClientError) -> int:
    meta = exc.response.get("ResponseMetadata", {})
    return int(meta.get("HTTPStatusCode") or 0)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _retried(exc: ClientError) -> bool:
    """For a 412 on a create-only put: did botocore retry it? Then the attempt whose answer
    was lost (a timeout, a dropped connection) most likely wrote the object: this call did.
    """
    return int(exc.response.get("ResponseMetadata", {}).get("RetryAttempts") or 0) > 0


def _object_size(resp: dict[str, Any]) -> int:
    """Whole-object size from a (possibly ranged) GET response."""
    m = _CONTENT_RANGE.match(resp.get("ContentRange") or "")
    return int(m.group(3)) if m else int(resp["ContentLength"])


def _split(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """[start, end) in about `size`-byte ranges; the last may be up to 1.25x to save a request."""
    n = max(1, int((end - start) / size + 0.75))
    step = -(-(end - start) // n)
    return [(s, min(s + step, end)) for s in range(start, end, step)]


class _Missing(Exception):
    """The object is not there (404/403): a miss, not a failure."""


class _TooSmall(Exception):
    """The caller's buffer cannot hold the payload: a miss."""


class _TooLarge(Exception):
    """The object is over `max_chunk`: a miss, left in place (a store opened with a larger
    `max_chunk` may have written it)."""


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel and reap sibling range reads (after a failure; a no-op once they are done)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _body_readinto(body: Any) -> Callable[[memoryview], int]:
    """`readinto` of a blocking response body that fills caller memory with no copy in
    between: http.client's (under urllib3), whose socket reads land in place; urllib3's
    own `readinto` reads into a fresh buffer and copies."""
    raw = body._raw_stream
    fp: Any = getattr(raw, "_fp", None)  # urllib3's private http.client response, or None
    return fp.readinto if hasattr(fp, "readinto") else raw.readinto


class _Stop(threading.Event):
    """Tells a reader thread that its caller is gone; setting it also shuts the read side
    of the sockets it is reading, so a read blocked on a stalled server ends now rather
    than at `read_timeout` (a thread cannot be cancelled; its socket can)."""

    def __init__(self) -> None:
        super().__init__()
        self._bodies: list[Any] = []
        self._lock = threading.Lock()

    def watch(self, body: Any) -> None:
        with self._lock:
            self._bodies.append(body)
        if self.is_set():
            _shut(body)

    def set(self) -> None:
        super().set()
        with self._lock:
            bodies = list(self._bodies)
        for body in bodies:
            _shut(body)


def _shut(body: Any) -> None:
    with contextlib.suppress(Exception):  # released, closed or never connected: nothing to end
        body._raw_stream.shutdown()


def _fill(body: Any, dest: memoryview, stop: _Stop, digest: Any = None) -> None:
    """Read exactly `dest.nbytes` body bytes into `dest` (a reader thread), ending at the
    first slice boundary after `stop` is set. A body that ends early is a transport
    failure (a cut connection), never a corrupt object. `digest` (an xxh3 hasher) takes
    each slice as it lands, while its bytes are still in the CPU's caches: verifying
    the buffer afterwards would be a second pass over all of it from memory."""
    readinto = _body_readinto(body)
    stop.watch(body)
    pos, n = 0, dest.nbytes
    while pos < n:
        if stop.is_set():
            raise asyncio.CancelledError()
        got = readinto(dest[pos : min(n, pos + _SLICE)])
        if not got:
            raise ConnectionError(f"response ended after {pos} of {n} bytes")
        if digest is not None:
            digest.update(dest[pos : pos + got])
        pos += got


def _payload_digest(verify: bool) -> Any:
    """The hasher a one-request read feeds its payload to as it lands (`_fill`), if it
    verifies."""
    return xxhash.xxh3_64(seed=0) if verify else None


def _read_head(body: Any, head: memoryview, first: int, key: str,
               stop: _Stop) -> tuple[ChunkHeader, memoryview]:
    """Read and check a response's header: its first `HEADER_SIZE` bytes into `head`, and a
    longer header's rest after them where `head` can hold it, else in a buffer of its own.
    Returns the header and a view of its bytes."""
    view = head[: min(HEADER_SIZE, first)]
    _fill(body, view, stop)
    try:
        return decode_header(view, key), view
    except TruncatedHeader as short:
        if short.header_len > first:
            raise
        if head.nbytes >= short.header_len:
            _fill(body, head[view.nbytes : short.header_len], stop)
            view = head[: short.header_len]
        else:  # a new buffer: the failed decode's view may still hold the old one
            longer = bytearray(short.header_len)
            longer[: view.nbytes] = view
            _fill(body, memoryview(longer)[view.nbytes :], stop)
            view = memoryview(longer)
        return decode_header(view, key), view


def _release(body: Any) -> None:
    """Hand a fully read body's connection back to the pool (keep-alive); close a body
    read only in part (its connection cannot carry another request)."""
    raw = body._raw_stream
    fp = getattr(raw, "_fp", None)
    if fp is not None and hasattr(fp, "isclosed") and fp.isclosed():
        raw.release_conn()
    else:
        body.close()


def _open_chunk(client: Any, bucket: str, name: str, rng: str, key: str, max_chunk: int,
                stop: _Stop) -> tuple[Any, ChunkHeader, memoryview, int]:
    """The first GET of a chunk read (a reader thread), read up to the end of its checked
    header: (body, header, the header's bytes, bytes this response carries); the object's
    size is the header's `total_len`.
    Nothing the size of the object is allocated here: an object over `max_chunk` is
    refused before its body is read, and one whose header gives another size is corrupt.
    Raises `_TooLarge`, ChunkError; the body is closed on any failure."""
    resp = client.get_object(Bucket=bucket, Key=name, Range=rng)
    body = resp["Body"]
    stop.watch(body)
    try:
        if stop.is_set():  # the caller is gone: nobody would close this body
            raise asyncio.CancelledError()
        total, first = _object_size(resp), int(resp["ContentLength"])
        if total > max_chunk:
            raise _TooLarge(f"a {total}-byte object is over max_chunk={max_chunk}")
        header, head = _read_head(body, memoryview(bytearray(HEADER_SIZE)), first, key, stop)
        if total != header.total_len:
            raise ChunkError(f"object is {total} bytes, header says {header.total_len}")
    except BaseException:
        body.close()
        raise
    return body, header, head, first


def _finish_one_request(body: Any, dest: memoryview, verify: bool, header: ChunkHeader,
                        stop: _Stop) -> None:
    """A one-request chunk's payload into `dest`, hashed as it lands and verified; its
    connection back to the pool (a reader thread)."""
    digest = _payload_digest(verify)
    try:
        _fill(body, dest, stop, digest)
    except BaseException:
        body.close()
        raise
    _release(body)
    if digest is not None:
        header.verify_digest(digest.intdigest())


def _get_into_start(client: Any, bucket: str, name: str, rng: str, key: str, out: memoryview,
                    verify: bool, max_chunk: int,
                    stop: _Stop) -> tuple[Any, ChunkHeader, int]:
    """The first GET of a `get_into` (a reader thread): the header is read and checked
    first, so that every later byte lands in place in `out`. A chunk of one request is
    read, and verified, here whole: (None, header, first). A larger one returns its body,
    for the caller to start the other ranges before reading the rest of it: (body,
    header, first). Raises `_TooSmall` when `out` cannot hold the payload."""
    body, header, _, first = _open_chunk(client, bucket, name, rng, key, max_chunk, stop)
    if out.nbytes < header.payload_len:
        body.close()
        raise _TooSmall()
    if first < header.total_len:
        return body, header, first
    _finish_one_request(body, out[: header.payload_len], verify, header, stop)
    return None, header, first


def _get_blob_start(client: Any, bucket: str, name: str, rng: str, key: str, verify: bool,
                    max_chunk: int, stop: _Stop) -> tuple[Any, ChunkHeader, bytearray, int]:
    """The first GET of a whole blob (a reader thread): (its body or None, the header, the
    object's buffer with the header in place, the bytes this response carries). The
    buffer is allocated once the header has given its size, with no zero-fill. A chunk
    of one request is read and verified here whole (the body None); a larger one's body
    is returned for the caller to start the other ranges before reading the rest of it."""
    body, header, head, first = _open_chunk(client, bucket, name, rng, key, max_chunk, stop)
    try:
        blob = unfilled_bytearray(header.total_len)
        blob[: head.nbytes] = head
    except BaseException:
        body.close()
        raise
    if first < header.total_len:
        return body, header, blob, first
    _finish_one_request(body, memoryview(blob)[head.nbytes :], verify, header, stop)
    return None, header, blob, first


def _get_range(client: Any, bucket: str, name: str, start: int, end: int, dest: memoryview,
               stop: _Stop) -> None:
    """Bytes [start, end) of an object into `dest` by one ranged GET (a reader thread)."""
    resp = client.get_object(Bucket=bucket, Key=name, Range=f"bytes={start}-{end - 1}")
    body = resp["Body"]
    stop.watch(body)
    try:
        if not (resp.get("ContentRange") or "").startswith(f"bytes {start}-{end - 1}/"):
            raise ChunkError(f"asked for bytes {start}-{end - 1}, got {resp.get('ContentRange')}")
        _fill(body, dest, stop)
    except BaseException:
        body.close()
        raise
    _release(body)


def _get_header(client: Any, bucket: str, name: str, key: str, stop: _Stop) -> ChunkHeader:
    """The verified header of an object (a reader thread): one `Range: bytes=0-4095` GET,
    and a second for a header longer than that."""
    resp = client.get_object(Bucket=bucket, Key=name, Range=f"bytes=0-{HEADER_SIZE - 1}")
    body = resp["Body"]
    stop.watch(body)
    try:
        total, first = _object_size(resp), int(resp["ContentLength"])
        if first > HEADER_SIZE:
            raise ChunkError(f"asked for {HEADER_SIZE} bytes, got {first}")
        head = bytearray(first)
        _fill(body, memoryview(head), stop)
    except BaseException:
        body.close()
        raise
    _release(body)
    try:
        header = decode_header(head, key)
    except TruncatedHeader as short:
        head = bytearray(short.header_len)
        _get_range(client, bucket, name, 0, short.header_len, memoryview(head), stop)
        header = decode_header(head, key)
    if total != header.total_len:
        raise ChunkError(f"object is {total} bytes, header says {header.total_len}")
    return header


def _fill_rest(_client: Any, body: Any, dest: memoryview, stop: _Stop) -> None:
    """The rest of a body into `dest`, then its connection back to the pool."""
    try:
        _fill(body, dest, stop)
    except BaseException:
        body.close()
        raise
    _release(body)


async def _outlive(job: asyncio.Future) -> None:
    """Wait for a reader thread's job to end, whatever cancels the caller meanwhile: until
    it does, it may write into the caller's memory. Bounded: a told-to-stop job ends at its
    next slice, and a read blocked in its socket ends when `_Stop` shuts that socket (or at
    its `read_timeout`)."""
    while not job.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([job])
    if not job.cancelled():
        job.exception()  # retrieved: the caller is already on its way out


class S3Store(Store):
    def __init__(self, opts: S3Options, url: str, *, conn: S3Connection | None = None,
                 prefix: str | None = None):
        super().__init__()
        self.opts = opts
        self.url = url
        self.prefix = opts.prefix if prefix is None else prefix
        self._owner = conn is None
        self._conn = conn or S3Connection(opts, url)
        self._background: set[asyncio.Task] = set()
        # existence checks in flight, by event loop and object name
        self._heads: dict[tuple[Any, str], asyncio.Future[bool]] = {}

    @classmethod
    def from_url(cls, u: StoreURL) -> S3Store:
        return cls(S3Options.from_url(u), u.redacted())

    # -- plumbing ------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self.prefix + key

    @contextlib.asynccontextmanager
    async def _op(self, what: str) -> AsyncIterator[Any]:
        """One guarded operation: breaker, in-flight gate, deadline, error mapping.

        Raises StoreUnavailable for endpoint failures (and counts them against the
        breaker), `_Missing` for 404/403; other ClientErrors pass through for the caller.
        """
        breaker = self._conn.breaker
        if not breaker.allow():
            raise StoreUnavailable(f"{self}: {what}: circuit breaker open")
        verdict: bool | None = True
        failure = ""
        try:
            lc = await self._conn.client()
            async with asyncio.timeout(self.opts.timeout), lc.gate:
                yield lc.client
        except ClientError as exc:
            status = _status(exc)
            if status in _MISS_STATUS:
                raise _Missing() from exc
            # 501 Not Implemented: a header or feature this server lacks, not a failing
            # endpoint (the caller names the option to change)
            if (status >= 500 and status != 501) or status == 429:
                verdict, failure = False, f"{what}: {status} {_code(exc)}"
                raise StoreUnavailable(f"{self}: {failure}") from exc
            raise
        except _TRANSPORT_ERRORS as exc:
            verdict, failure = False, f"{what}: {type(exc).__name__}: {exc}"
            raise StoreUnavailable(f"{self}: {failure}") from exc
        except asyncio.CancelledError:
            verdict = None
            raise
        finally:
            if breaker.record(verdict):
                log.warning("%s: circuit breaker open (last failure: %s); reads are misses "
                            "until a probe succeeds", self, failure)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- reads ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _chunk_read(self) -> Iterator[str]:
        """Counts a chunk read as in flight while it lasts and gives its first GET's Range.
        While at most `split_reads` chunk reads are in flight (this one included) that is
        the first 1.25 x `range_size` bytes (a chunk just over a round size, payload plus
        header, is still one request) and a larger object's rest comes as parallel
        ranges: they put an idle store's spare connections to work. Otherwise it is the
        whole object in one request: the connections are busy with the other reads
        already, and parallel ranges of one object would only add requests and a second
        pass over its payload to verify it (ranges land out of order, so it cannot be
        hashed as it lands)."""
        token = object()
        reading = self._conn.reading
        reading.add(token)
        try:
            if len(reading) <= self.opts.split_reads:
                yield f"bytes=0-{self.opts.range_size * 5 // 4 - 1}"
            else:
                yield "bytes=0-"
        finally:
            reading.discard(token)

    @staticmethod
    async def _in_thread(reads: BlockingReads, job: Callable[..., Any], *args: Any) -> Any:
        """`job(reads.client, *args, stop)` on a reader thread. Cancelled (the operation's
        deadline), it tells the job to stop and waits for it to end (see `_outlive`)."""
        stop = _Stop()
        fut: Future = reads.threads.submit(job, reads.client, *args, stop)
        done = asyncio.wrap_future(fut)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            if not fut.cancel():  # a job not started yet never will; a started one must end
                stop.set()
                await _outlive(done)
            raise

    async def _read_range(self, reads: BlockingReads, name: str, start: int, end: int,
                          dest: memoryview) -> None:
        """Bytes [start, end) of an object into `dest`: one guarded ranged GET, threaded."""
        async with self._op("get range"):
            await self._in_thread(reads, _get_range, self.opts.bucket, name, start, end, dest)

    async def _read_blob(self, key: str, first_range: str) -> tuple[ChunkHeader, bytearray]:
        """The whole verified blob, in one `unfilled_bytearray` allocated once the first
        GET's header has given its size; a larger object's other ranges started at once
        and landing in place while the first body streams (a join of pieces would cost a
        copy of every byte). Raises `_Missing`, `_TooLarge`, StoreUnavailable, ClientError
        or ChunkError (a corrupt object).
        """
        name, opts, loop = self._name(key), self.opts, asyncio.get_running_loop()
        tasks: list[asyncio.Task] = []
        try:
            async with self._op("get"):
                reads = await self._conn.blocking()
                body, header, blob, first = await self._in_thread(
                    reads, _get_blob_start, opts.bucket, name, first_range, key,
                    opts.verify, opts.max_chunk)
                if body is None:  # one request: read, checked and verified
                    return header, blob
                try:
                    view = memoryview(blob)
                    tasks = [loop.create_task(self._read_range(reads, name, s, e, view[s:e]))
                             for s, e in _split(first, header.total_len, opts.range_size)]
                except BaseException:
                    body.close()
                    raise
                await self._in_thread(reads, _fill_rest, body, view[header.header_len : first])
            # Outside the first request's in-flight slot: with every slot held by a first
            # request waiting for its own ranges, nothing could make progress.
            await asyncio.gather(*tasks)
        finally:
            await _cancel(tasks)
        if opts.verify:  # off the event loop (xxhash lets go of the GIL)
            await asyncio.to_thread(header.verify_payload, view[header.header_len :])
        return header, blob

    async def _read_into(self, key: str, out: memoryview, first_range: str) -> ChunkHeader:
        """Stream the payload into `out`; the header is parsed first so that every later
        byte lands in place. Raises like `_read_blob`, and `_TooSmall`.
        """
        name, opts, loop = self._name(key), self.opts, asyncio.get_running_loop()
        tasks: list[asyncio.Task] = []
        try:
            async with self._op("get"):
                reads = await self._conn.blocking()
                body, header, first = await self._in_thread(
                    reads, _get_into_start, opts.bucket, name, first_range, key, out,
                    opts.verify, opts.max_chunk)
                if body is None:  # one request: read and verified
                    return header
                try:
                    hlen, payload = header.header_len, out[: header.payload_len]
                    tasks = [loop.create_task(self._read_range(reads, name, s, e,
                                                               payload[s - hlen : e - hlen]))
                             for s, e in _split(first, header.total_len, opts.range_size)]
                except BaseException:
                    body.close()
                    raise
                await self._in_thread(reads, _fill_rest, body, payload[: first - hlen])
            await asyncio.gather(*tasks)  # outside the first request's slot (see _read_blob)
        finally:
            await _cancel(tasks)
        if opts.verify:
            await asyncio.to_thread(header.verify_payload, payload)
        return header

    async def _guarded_read(self, key: str, out: memoryview | None) -> tuple[ChunkHeader, Any] | None:
        """A read with every failure turned into a counted miss: (header, blob or None)."""
        with self._chunk_read() as first_range:
            if out is None:
                return await self._guarded(key, self._read_blob(key, first_range))
            header = await self._guarded(key, self._read_into(key, out, first_range))
        return None if header is None else (header, None)

    async def _guarded(self, key: str, read: Any) -> Any:
        """Await a read of `key` with every failure turned into a counted miss (None)."""
        try:
            got = await read
        except (_Missing, _TooSmall):
            return None
        except (StoreError, ClientError, _TooLarge) as exc:
            if (isinstance(exc, ClientError) and _status(exc) in (400, 501)
                    and self.opts.checksum == "when_supported"):
                self._refuse("get", _status(exc))
            if isinstance(exc, ClientError) and _status(exc) == 416:
                # "bytes=0-..." is unsatisfiable only for a 0-byte object: no chunk is empty,
                # and left in place it would make create-only puts skip the key forever.
                self._quarantine(key, "empty object")
                return None
            self.counters["errors"] += 1
            log.debug("%s: get %s: %s", self, key, exc)
            return None
        except ChunkError as exc:
            self._quarantine(key, str(exc))
            return None
        self._touch(key)
        return got

    def _quarantine(self, key: str, why: str) -> None:
        self.counters["corrupt"] += 1
        self._changed("removed", key)
        log.warning("%s: deleting corrupt chunk %s: %s", self, key, why)
        self._spawn(self._delete_quietly([self._name(key), marker_name(self._name(key))]))

    async def _delete_quietly(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(StoreUnavailable, _Missing, ClientError):
                async with self._op("delete") as client:
                    await client.delete_object(Bucket=self.opts.bucket, Key=name)

    def _touch(self, key: str) -> None:
        """Refresh the chunk's access marker, at most once per `touch` interval (for gc)."""
        if self.opts.touch <= 0:
            return
        name, now, touched = self._name(key), time.monotonic(), self._conn.touched
        last = touched.get(name)
        if last is not None and now - last < self.opts.touch:
            return
        touched[name] = now
        touched.move_to_end(name)
        while len(touched) > _TOUCHED_MAX:
            touched.popitem(last=False)
        self._spawn(self._write_marker(name))

    async def _write_marker(self, name: str) -> None:
        with contextlib.suppress(StoreUnavailable, _Missing, ClientError):
            async with self._op("touch") as client:
                await client.put_object(Bucket=self.opts.bucket, Key=marker_name(name), Body=b"")

    # -- ranged reads (SupportsRangeReads) --------------------------------------------------

    async def read_header(self, key: str) -> ChunkHeader | None:
        """The verified header: one `Range: bytes=0-4095` GET (a second for a longer header)."""
        check_key(key)
        header = await self._guarded(key, self._read_header(key))
        self._count_get(None if header is None else header.total_len)
        return header

    async def _read_header(self, key: str) -> ChunkHeader:
        async with self._op("get header"):
            reads = await self._conn.blocking()
            return await self._in_thread(reads, _get_header, self.opts.bucket, self._name(key),
                                         key)

    async def read_range_into(self, key: str, header: ChunkHeader, offset: int, out: Any) -> bool:
        """Payload bytes [offset, offset + len(out)) by one Range GET; False on a miss."""
        check_key(key)
        view = memoryview(out).cast("B")
        if offset < 0 or offset + view.nbytes > header.payload_len:
            return False
        start = header.header_len + offset

        async def ranged() -> bool:
            reads = await self._conn.blocking()
            await self._read_range(reads, self._name(key), start, start + view.nbytes, view)
            return True

        return await self._guarded(key, ranged()) is True

    async def get(self, key: str) -> bytes | None:
        """The verified blob, with no copy after the network: a bytearray filled in place
        (`unfilled_bytearray`), by one request up to 1.25 x `range_size`, else by
        parallel ranges."""
        check_key(key)
        got = await self._guarded_read(key, None)
        blob = None if got is None else got[1]
        self._count_get(None if blob is None else len(blob))
        return blob

    async def get_into(self, key: str, out: Any) -> ChunkHeader | None:
        check_key(key)
        got = await self._guarded_read(key, memoryview(out).cast("B"))
        header = None if got is None else got[0]
        self._count_get(None if header is None else header.total_len)
        return header

    async def _head(self, name: str) -> bool:
        """Is the object there? Raises StoreUnavailable when the endpoint cannot say."""
        try:
            async with self._op("head") as client:
                await client.head_object(Bucket=self.opts.bucket, Key=name)
        except _Missing:
            return False
        except ClientError as exc:
            raise StoreUnavailable(f"{self}: head: {_status(exc)} {_code(exc)}") from exc
        return True

    async def _present(self, key: str) -> bool:
        """Whether the object is there (False when the endpoint cannot say). Lookups at
        once of keys in common (requests of one prompt, or of one system prompt) share
        one HEAD a key: a burst of N such requests made N HEADs of each key before."""
        name = self._name(key)
        at = (asyncio.get_running_loop(), name)
        head = self._heads.get(at)
        if head is None:
            head = self._heads[at] = asyncio.ensure_future(self._head_or_false(name))
            head.add_done_callback(lambda f: self._head_done(at, f))
        # One waiter cancelled (its lookup's timeout) leaves the HEAD to the others.
        return await asyncio.shield(head)

    def _head_done(self, at: tuple[Any, str], head: asyncio.Future[bool]) -> None:
        if self._heads.get(at) is head:
            del self._heads[at]
        if not head.cancelled():
            head.exception()  # retrieved here too: every waiter may have been cancelled

    async def _head_or_false(self, name: str) -> bool:
        try:
            return await self._head(name)
        except StoreError:
            self.counters["errors"] += 1
            return False

    async def probe(self) -> str | None:
        try:
            await self._head(self._name(PROBE_KEY))
        except StoreError as exc:
            self.counters["errors"] += 1
            return str(exc)
        return None

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        for k in keys:
            check_key(k)
        return list(await asyncio.gather(*(self._present(k) for k in keys)))

    async def prefix_len(self, keys: Sequence[str]) -> int:
        """One HEAD for the first key (a prompt never seen costs one request, as S3 bills
        them), then HEADs in windows of `max_in_flight` keys, stopping at the window
        holding the first gap."""
        for k in keys:
            check_key(k)
        step = max(1, self.opts.max_in_flight)
        windows = [keys[:1], *(keys[i : i + step] for i in range(1, len(keys), step))]
        n = 0
        for window in windows:
            for present in await asyncio.gather(*(self._present(k) for k in window)):
                if not present:
                    return n
                n += 1
        return n

    # -- writes --------------------------------------------------------------------------

    async def _conditional_mode(self) -> str:
        """'header' if the server enforces If-None-Match, else 'head' (found by a probe on
        the first put, which also finds a server that refuses what this client's settings
        send: then every put raises StoreUnavailable with one line naming the option)."""
        conn = self._conn
        if conn.refused:
            raise StoreUnavailable(conn.refused)
        if conn.conditional is None:
            name = f"{self.opts.prefix}{PROBE_DIR}/probe-{secrets.token_hex(8)}"
            try:
                mode = await self._probe(name)
            finally:
                await self._delete_quietly([name])
            if mode == "head":
                log.warning("%s: the server ignores or refuses If-None-Match; puts HEAD first "
                            "instead (set conditional=head to skip the probe)", self)
            conn.conditional = mode
        return conn.conditional

    async def _probe_put(self, name: str, conditional: bool) -> int:
        """One probe PUT: 200, or the status it was refused with (400/412/501)."""
        extra = {"IfNoneMatch": "*"} if conditional else {}
        try:
            async with self._op("probe put") as client:
                await client.put_object(Bucket=self.opts.bucket, Key=name, Body=b"probe", **extra)
        except ClientError as exc:
            if _status(exc) in (400, 412, 501):
                return _status(exc)
            raise StoreUnavailable(f"{self}: probe put: {_status(exc)} {_code(exc)}") from exc
        except _Missing as exc:
            raise StoreUnavailable(f"{self}: probe put denied (403/404): "
                                   "check the bucket and credentials") from exc
        return 200

    async def _probe(self, name: str) -> str:
        """Put a probe object twice with If-None-Match: the second must be refused (412).
        400/501 to it: the same put without the header tells a server that refuses the
        header ('head') from one that refuses the request; then a GET of the probe checks
        that reads go through with these settings."""
        first = await self._probe_put(name, True)
        if first in (400, 501):
            if await self._probe_put(name, False) in (400, 501):
                raise StoreUnavailable(self._refuse("put", first))
            mode = "head"
        else:
            mode = "header" if await self._probe_put(name, True) == 412 else "head"
        try:
            async with self._op("probe get") as client:
                resp = await client.get_object(Bucket=self.opts.bucket, Key=name)
                async with resp["Body"] as body:
                    await body.read()
        except ClientError as exc:
            if _status(exc) in (400, 501):
                raise StoreUnavailable(self._refuse("get", _status(exc))) from exc
            raise StoreUnavailable(f"{self}: probe get: {_status(exc)} {_code(exc)}") from exc
        except _Missing as exc:
            raise StoreUnavailable(f"{self}: probe get denied (403/404): "
                                   "check the credentials") from exc
        return mode

    def _refuse(self, what: str, status: int) -> str:
        """The one line for a server that refuses requests as this client sends them, with
        the URL option to change; remembered, logged once, reported by `health()`."""
        if self.opts.checksum == "when_supported":
            fix = ("with checksum=when_supported botocore sends CRC32 checksum headers "
                   "(x-amz-checksum-*, x-amz-sdk-checksum-algorithm), which it refuses: "
                   "set checksum=when_required")
        else:
            fix = "check addressing=path|virtual and sign_payload=true|false for this server"
        line = f"{self}: the server answers {status} to a plain {what}: {fix}"
        if self._conn.refused is None:
            self._conn.refused = line
            log.error("%s", line)
        return self._conn.refused

    async def _put_single(self, name: str, data: bytes, conditional: bool) -> bool:
        extra = {"IfNoneMatch": "*"} if conditional else {}
        for delay in (*_CONFLICT_RETRIES, None):
            try:
                async with self._op("put") as client:
                    await client.put_object(Bucket=self.opts.bucket, Key=name, Body=data,
                                            ContentLength=len(data), **extra)
                return True
            except ClientError as exc:
                status = _status(exc)
                if status == 412:
                    return _retried(exc)
                if status in (400, 501) and conditional:
                    raise StoreUnavailable(
                        f"{self}: put: {status} {_code(exc)} to If-None-Match: this server "
                        "refuses conditional writes; set conditional=auto or conditional=head"
                    ) from exc
                if status != 409 or delay is None:
                    raise StoreUnavailable(f"{self}: put: {status} {_code(exc)}") from exc
            except _Missing as exc:
                raise StoreUnavailable(f"{self}: put denied (403/404)") from exc
            # 409 ConditionalRequestConflict: another writer is mid-flight on this key.
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _put_multipart(self, name: str, data: memoryview, conditional: bool) -> bool:
        bucket = self.opts.bucket
        try:
            async with self._op("create multipart") as client:
                upload = (await client.create_multipart_upload(Bucket=bucket, Key=name))["UploadId"]
        except (ClientError, _Missing) as exc:
            raise StoreUnavailable(f"{self}: create multipart upload failed: {exc}") from exc

        async def part(number: int, start: int, end: int) -> dict[str, Any]:
            async with self._op("upload part") as client:
                resp = await client.upload_part(Bucket=bucket, Key=name, UploadId=upload,
                                                PartNumber=number, Body=bytes(data[start:end]))
            return {"PartNumber": number, "ETag": resp["ETag"]}

        done = False
        try:
            # S3 refuses parts but the last under 5 MiB (EntityTooSmall), so parts are
            # exactly part_size (>= 5 MiB) and the remainder goes last; _split's even
            # division could make every part smaller than part_size.
            ranges = [(s, min(s + self.opts.part_size, data.nbytes))
                      for s in range(0, data.nbytes, self.opts.part_size)]
            parts = await asyncio.gather(*(part(i + 1, s, e) for i, (s, e) in enumerate(ranges)))
            extra = {"IfNoneMatch": "*"} if conditional else {}
            try:
                async with self._op("complete multipart") as client:
                    await client.complete_multipart_upload(
                        Bucket=bucket, Key=name, UploadId=upload,
                        MultipartUpload={"Parts": list(parts)}, **extra)
            except ClientError as exc:
                if _status(exc) == 412:
                    return _retried(exc)
                raise StoreUnavailable(f"{self}: complete multipart: {_status(exc)} "
                                       f"{_code(exc)}") from exc
            done = True
            return True
        except (ClientError, _Missing) as exc:
            raise StoreUnavailable(f"{self}: multipart put failed: {exc}") from exc
        finally:
            if not done:
                with contextlib.suppress(Exception):
                    async with self._op("abort multipart") as client:
                        await client.abort_multipart_upload(Bucket=bucket, Key=name,
                                                            UploadId=upload)

    async def put(self, key: str, blob: Any) -> bool:
        check_blob(key, blob)
        name, view = self._name(key), memoryview(blob).cast("B")
        try:
            mode = await self._conditional_mode()
            if mode == "head" and await self._head(name):
                wrote = False
            elif view.nbytes > self.opts.multipart_threshold:
                wrote = await self._put_multipart(name, view, mode == "header")
            else:
                data = blob if isinstance(blob, bytes) else view.tobytes()
                wrote = await self._put_single(name, data, mode == "header")
        except StoreUnavailable:
            self.counters["put_errors"] += 1
            raise
        if wrote:
            self.counters["puts"] += 1
            self.counters["bytes_written"] += view.nbytes
            self._changed("stored", key)
        else:
            self.counters["put_skipped"] += 1
        return wrote

    async def delete(self, key: str) -> bool:
        check_key(key)
        name = self._name(key)
        present = await self._head(name)
        try:
            async with self._op("delete") as client:
                await client.delete_object(Bucket=self.opts.bucket, Key=name)
                await client.delete_object(Bucket=self.opts.bucket, Key=marker_name(name))
        except (ClientError, _Missing) as exc:
            raise StoreUnavailable(f"{self}: delete {key}: {exc}") from exc
        self._conn.touched.pop(name, None)
        if present:
            self.counters["deletes"] += 1
            self._changed("removed", key)
        return present

    # -- listing and gc ------------------------------------------------------------------

    async def _list(self, prefix: str, delimiter: str = "") -> AsyncIterator[dict[str, Any]]:
        """Objects (and, with a delimiter, {"Prefix": ...} entries) under `prefix`."""
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.opts.bucket, "Prefix": prefix}
            if delimiter:
                kw["Delimiter"] = delimiter
            if token:
                kw["ContinuationToken"] = token
            try:
                async with self._op("list") as client:
                    page = await client.list_objects_v2(**kw)
            except (ClientError, _Missing) as exc:
                raise StoreUnavailable(f"{self}: list {prefix!r}: {exc}") from exc
            for entry in page.get("CommonPrefixes", []):
                yield entry
            for entry in page.get("Contents", []):
                yield entry
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    async def list_keys(self) -> AsyncIterator[str]:
        namespaces = [e["Prefix"] async for e in self._list(self.prefix, "/")
                      if _NS_DIR.fullmatch(e.get("Prefix", "")[len(self.prefix):])]
        for ns_prefix in namespaces:
            async for entry in self._list(ns_prefix):
                key = entry["Key"][len(self.prefix):]
                if is_valid_key(key):
                    yield key

    async def gc(self, capacity: int) -> dict[str, int]:
        """Evict least-recently-used chunks under this prefix (tenants included) to `capacity`.

        Safe while engines read and write: it only deletes whole objects, so a reader of
        an evicted chunk gets a miss (a 404, or a failed verification if the object
        vanished mid-read), never wrong bytes; a chunk written after the listing is not
        counted and never deleted.
        """
        objects = []
        async for e in self._list(self.prefix):
            objects.append((e["Key"][len(self.prefix):], int(e["Size"]),
                            e["LastModified"].timestamp()))
        plan = plan_eviction(objects, capacity)
        failed = await self._delete_many([self.prefix + rel for rel in plan.delete])
        self.counters["evictions"] += plan.evicted
        return {
            "evicted": plan.evicted, "evicted_bytes": plan.evicted_bytes,
            "used_bytes": plan.used_bytes, "chunks": plan.chunks,
            "orphan_markers": plan.orphan_markers, "delete_failures": failed,
            "aborted_uploads": await self._abort_stale_uploads(),
        }

    async def _abort_stale_uploads(self) -> int:
        """Abort multipart uploads under the prefix older than a day (crashed writers);
        their parts take space but are invisible to listings. Best effort."""
        cutoff, aborted = time.time() - _STALE_UPLOAD_S, 0
        try:
            async with self._op("list uploads") as client:
                page = await client.list_multipart_uploads(Bucket=self.opts.bucket,
                                                           Prefix=self.prefix)
            for up in page.get("Uploads", []):
                if up["Initiated"].timestamp() < cutoff:
                    async with self._op("abort upload") as client:
                        await client.abort_multipart_upload(
                            Bucket=self.opts.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    aborted += 1
        except (ClientError, _Missing, StoreUnavailable) as exc:
            log.info("%s: skipped aborting stale multipart uploads: %s", self, exc)
        return aborted

    async def _delete_many(self, names: list[str]) -> int:
        """Batch deletes (1000 per request); per-object deletes if the server lacks them."""
        failed = 0
        for i in range(0, len(names), 1000):
            batch = names[i : i + 1000]
            try:
                async with self._op("delete objects") as client:
                    resp = await client.delete_objects(
                        Bucket=self.opts.bucket,
                        Delete={"Objects": [{"Key": n} for n in batch], "Quiet": True})
                failed += len(resp.get("Errors", []))
            except (ClientError, _Missing):
                for name in batch:
                    try:
                        async with self._op("delete") as client:
                            await client.delete_object(Bucket=self.opts.bucket, Key=name)
                    except (ClientError, _Missing, StoreUnavailable):
                        failed += 1
        return failed

    # -- scopes, stats, lifetime ---------------------------------------------------------

    def scoped(self, tenant: str) -> S3Store:
        check_tenant(tenant)
        return S3Store(self.opts, f"{self.url}#{tenant}", conn=self._conn,
                       prefix=f"{self.prefix}{TENANTS}/{tenant}/")

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(), "backend": "s3", "bucket": self.opts.bucket,
            "prefix": self.prefix, "endpoint": self.opts.endpoint,
            "conditional_put": self._conn.conditional or "unknown",
            **self._conn.breaker.snapshot(),
        }

    async def health(self) -> str | None:
        """A server found to refuse requests as this store sends them: the line naming the
        URL option to change (see `_refuse`). Never a network call."""
        return self._conn.refused

    async def flush(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        if self._owner:
            await self._conn.close()

