"""ChunkIO: the one interface the connector uses to move chunk payloads between files and tensors.

Threading contract: `submit_read`, `submit_chunk` and `submit_write` never block and may be
called from any thread, an event loop's included; each returns a
`concurrent.futures.Future`. `read`, `read_chunk` and `write` are the awaitable versions.
At most `max_in_flight` requests run at once; more wait in a FIFO queue. A caller blocked
in `result()` on a request no request thread has started yet runs it on its own thread
(if a slot is free), saving two thread hand-offs (gds.requests). A read's future
resolves once the bytes are in the destination (for CUDA destinations: once the copies or
DMA have completed), or fails with `ReadError`; a write's future resolves to True (created)
or False (the chunk already existed), or fails with `WriteError`. Synchronous callers
may use `read_chunk_blocking`, which does the same work on the calling thread.

Backends are chosen once, at construction, from one probe (`gds.probe`): CPU destinations
take the host path; CUDA destinations take torch-gds, KvikIO or pinned bounce buffers.
A file on a filesystem that refuses O_DIRECT, or where a cuFile read failed once, is read
through bounce buffers instead of cuFile. `stats()` reports the choices and what each
filesystem allowed.

Verification (`verify=`): the header (magic, key, token ids, lengths, its own checksum) is
always read and checked on the host, and the file length must match it. "checksum" also
checks the payload's xxh3-64: streamed over the destination as pieces land for host
destinations; read back through a pinned slot for CUDA destinations. "header" trusts the
filesystem for the payload bytes (NVMe end-to-end protection, RDMA transport CRCs) and
skips that pass; see docs/gds.md for what each costs. A read given `trust=` (the FileStore
the file belongs to) skips both the header read and the payload hash for a file that store
has verified whole before and that is unchanged since (its `verify=changed` policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import xxhash

from gds.backends import (
    BounceBackend,
    BounceSlots,
    HostBackend,
    KvikioBackend,
    TorchGdsBackend,
    run_pieces,
)
from gds.buffers import ALIGN, aligned_buffer, byte_tensor, host_view, is_cuda, nbytes
from gds.errors import CORRUPT, IO, SHORT, TOO_SMALL, ChunkIOError, ReadError, WriteError
from gds.fsprobe import DirectIOSupport
from gds.hostio import DIRECT_MODES, OpenFile, read_range, write_error, write_range
from gds.probe import Capabilities, choose_cuda_backend, probe
from gds.requests import Request
from storage.codec import (
    HEADER_SIZE,
    ChunkError,
    ChunkHeader,
    TruncatedHeader,
    decode_header,
    encode_header,
)
from storage.file import link_publish
from storage.pagecache import PAGE_CACHE, Residency

log = logging.getLogger("kvstash.gds")

MiB = 1 << 20
TMP_MARK = ".tmp."


def run_on(cpus: Collection[int] | None) -> None:
    """Run the calling thread on `cpus` (None: where it started, on the cores of the thread
    that started it)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            log.info("kvstash I/O thread stays on its cores: cpus %s: %s", sorted(cpus), exc)


class VerifiedFiles(Protocol):
    """Who remembers which chunk files were verified whole (a FileStore): see submit_chunk."""

    def known_header(self, key: str, st: os.stat_result) -> ChunkHeader | None: ...

    def note_verified(self, key: str, st: os.stat_result, header: ChunkHeader) -> None: ...


@dataclass(frozen=True)
class IOConfig:
    # Threads doing preadv/pwrite pieces; 0 = the core count, at least 2 and at most 8
    # (2 threads take a page-cached 16 MiB read from ~16 to ~30 GB/s on this 2-core VM).
    io_threads: int = 0
    max_in_flight: int = 8
    piece_bytes: int = 4 * MiB
    direct: str = "auto"  # "auto" | "always" | "never", see gds.hostio
    verify: str = "checksum"  # "checksum" | "header"
    cuda_backend: str = "auto"  # "auto" | "torch-gds" | "kvikio" | "bounce"
    fsync: bool = True

    def validate(self) -> IOConfig:
        if self.direct not in DIRECT_MODES:
            raise ValueError(f"direct={self.direct!r}: expected one of {', '.join(DIRECT_MODES)}")
        if self.verify not in ("checksum", "header"):
            raise ValueError(f"verify={self.verify!r}: expected checksum or header")
        if self.piece_bytes < ALIGN or self.piece_bytes % ALIGN:
            raise ValueError(f"piece_bytes={self.piece_bytes}: must be a multiple of {ALIGN}")
        if self.max_in_flight < 1 or self.io_threads < 0:
            raise ValueError("max_in_flight must be >= 1 and io_threads >= 0")
        return self

    @property
    def threads(self) -> int:
        return self.io_threads or min(8, max(2, os.cpu_count() or 1))


class ChunkIO:
    """Reads file ranges and whole chunks into tensors; writes tensors as chunk files."""

    def __init__(self, config: IOConfig | None = None, *, caps: Capabilities | None = None,
                 probe_dir: str | os.PathLike | None = None,
                 residency: Residency | None = None):
        """`caps` replaces the start-up probe (tests inject it to stand in for absent hardware);
        `probe_dir` is where the probe reads a file: use the chunk store's directory.
        `residency`: the page-cache oracle that decides which reads take O_DIRECT
        (`direct="auto"`): the chunk store's, so both plan by the same answers (None: the
        kernel's)."""
        self.config = (config or IOConfig()).validate()
        self.caps = caps if caps is not None else probe(str(probe_dir) if probe_dir else None)
        self.cuda_backend = choose_cuda_backend(self.caps, self.config.cuda_backend)
        threads = self.config.threads
        self._cpus: frozenset[int] | None = None  # see threads_on
        self._pool = ThreadPoolExecutor(threads, "kvstash-gds-io", initializer=self._place)
        self._requests = ThreadPoolExecutor(self.config.max_in_flight, "kvstash-gds-req",
                                            initializer=self._place)
        self._inflight = threading.Semaphore(self.config.max_in_flight)  # see gds.requests
        self.support = DirectIOSupport(self.config.direct != "never",
                                       PAGE_CACHE if residency is None else residency)
        self.host = HostBackend(self._pool, self.config.piece_bytes, self.config.direct, threads)
        self._device_lock = threading.Lock()
        self._device: dict[str, Any] = {}
        self._no_cufile: set[int] = set()  # filesystems (st_dev) where a cuFile read failed
        self._counters: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._local = threading.local()

    # -- backends for CUDA destinations, built on first use --------------------------------

    def _slots(self) -> BounceSlots:
        with self._device_lock:
            if "slots" not in self._device:
                # Two slots per I/O thread: one being filled while the other's copy drains.
                self._device["slots"] = BounceSlots(
                    2 * self.config.threads, self.config.piece_bytes, pinned=self.caps.cuda
                )
            return self._device["slots"]

    def _backend(self, name: str) -> Any:
        if name == "bounce":
            slots = self._slots()
        with self._device_lock:
            if name not in self._device:
                backend: BounceBackend | TorchGdsBackend | KvikioBackend
                if name == "bounce":
                    backend = BounceBackend(
                        self._pool, self.config.piece_bytes, self.config.direct, slots
                    )
                elif name == "torch-gds":
                    backend = TorchGdsBackend(self._pool, self.config.piece_bytes)
                else:
                    backend = KvikioBackend(self.config.threads)
                self._device[name] = backend
            return self._device[name]

    def _device_backend_name(self, f: OpenFile) -> str:
        name = self.cuda_backend or "bounce"
        if name != "bounce" and (f.dev in self._no_cufile or f.direct_fd() is None):
            name = "bounce"  # cuFile needs O_DIRECT; this filesystem refuses it (or direct=never)
        return name

    def _read_device(self, f: OpenFile, offset: int, dest: Any, ready: Any) -> str:
        name = self._device_backend_name(f)
        try:
            self._backend(name).read(f, offset, dest, ready)
            return name
        except ReadError as exc:
            if name == "bounce" or exc.reason != IO:
                raise
            # cuFile failed where O_DIRECT works (say NFS without RDMA and compat mode off):
            # serve this read, and every later one on this filesystem, through bounce buffers.
            log.warning("%s failed on %s, using bounce buffers there: %s", name, f.path, exc)
            self._no_cufile.add(f.dev)
            self._count(cufile_fallbacks=1)
        self._backend("bounce").read(f, offset, dest, ready)
        return "bounce"

    def cuda_backend_for(self, path: str | os.PathLike) -> str | None:
        """The backend a CUDA destination would be filled by from this file (None: no CUDA)."""
        if self.cuda_backend is None:
            return None
        with OpenFile.for_read(os.fspath(path), self.support) as f:
            return self._device_backend_name(f)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Request:
        """Queue `fn(*args)` for a request thread; a caller blocking on the returned future
        runs it itself if no request thread has started it (gds.requests)."""
        request = Request(functools.partial(fn, *args), self._inflight,
                          lambda: self._count(requests_run_by_waiter=1))
        self._requests.submit(request.run)
        return request

    # -- counters --------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._count_lock:
            self._counters.update(deltas)

    def _failed(self, exc: ChunkIOError) -> None:
        kind = "read" if isinstance(exc, ReadError) else "write"
        self._count(**{f"{kind}_errors": 1, f"{kind}_{exc.reason}": 1})

    # -- reads -----------------------------------------------------------------------------

    @staticmethod
    def _ready_event(dest: Any) -> Any:
        """An event on the caller's current stream: work queued before the submit (the kernels
        that last used `dest`'s memory, or that produced a payload) must finish first."""
        if not is_cuda(dest):
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dest.device))
        return event

    def _read_payload(self, f: OpenFile, offset: int, length: int, dest: Any, ready: Any,
                      checksum: int | None) -> None:
        if is_cuda(dest):
            flat = byte_tensor(dest)[:length]
            name = self._read_device(f, offset, flat, ready)
            got = self._slots().device_xxh3(flat) if checksum is not None else None
            self._count(**{f"bytes_{name}": length})
        else:
            view = host_view(dest)[:length]
            hasher = xxhash.xxh3_64() if checksum is not None else None
            direct = self.host.read(f, offset, view, hasher)
            got = hasher.intdigest() if hasher else None
            self._count(bytes_host=length, bytes_host_direct=direct)
        if got != checksum:
            raise ReadError(f.path, CORRUPT, "payload checksum mismatch")

    def _read_range_sync(self, path: str, offset: int, length: int, dest: Any, ready: Any) -> int:
        try:
            with OpenFile.for_read(path, self.support) as f:
                if offset + length > f.size:
                    raise ReadError(path, SHORT, f"file is {f.size} bytes, range ends at {offset + length}")
                self._read_payload(f, offset, length, dest, ready, None)
        except ReadError as exc:
            self._failed(exc)
            raise
        self._count(reads=1, bytes_read=length)
        return length

    def _header_buffer(self, size: int) -> memoryview:
        """Aligned, so a cold header is read with O_DIRECT too: a buffered read would start
        readahead and pull the payload through the page cache after all."""
        if size > HEADER_SIZE:
            return aligned_buffer(size)
        buf = getattr(self._local, "header", None)
        if buf is None:
            buf = self._local.header = aligned_buffer(HEADER_SIZE)
        return buf[:size]

    def _read_header(self, f: OpenFile, key: str | None) -> ChunkHeader:
        size = min(f.size, HEADER_SIZE)
        while True:
            head = self._header_buffer(size)
            read_range(f, head, 0, self.config.direct)
            try:
                return decode_header(head, key)
            except TruncatedHeader as short:
                # A header longer than 4 KiB (many tokens, big meta): read all of it once.
                if short.header_len > f.size or size > HEADER_SIZE:
                    raise ReadError(f.path, CORRUPT, str(short)) from short
                size = short.header_len
            except ChunkError as exc:
                raise ReadError(f.path, CORRUPT, str(exc)) from exc

    def _read_chunk_sync(self, path: str, dest: Any, key: str | None, token_ids: Any,
                         ready: Any, trust: VerifiedFiles | None = None) -> ChunkHeader:
        if key is None:
            trust = None
        try:
            with OpenFile.for_read(path, self.support) as f:
                known = (trust.known_header(key, f.stat)
                         if trust is not None and key is not None else None)
                header = known or self._read_header(f, key)
                if f.size != header.total_len:
                    raise ReadError(path, CORRUPT, f"file is {f.size} bytes, header says {header.total_len}")
                if token_ids is not None and not header.matches_tokens(token_ids):
                    raise ReadError(path, CORRUPT, f"chunk {header.key} holds other tokens")
                if nbytes(dest) < header.payload_len:
                    raise ReadError(path, TOO_SMALL, f"payload is {header.payload_len} bytes, "
                                                     f"destination holds {nbytes(dest)}")
                checksum = None
                if self.config.verify == "checksum" and known is None:
                    checksum = header.payload_checksum
                self._read_payload(f, header.header_len, header.payload_len, dest, ready, checksum)
                if trust is not None and key is not None and checksum is not None:
                    trust.note_verified(key, f.stat, header)
        except ReadError as exc:
            self._failed(exc)
            raise
        self._count(chunk_reads=1, bytes_read=header.payload_len,
                    chunks_known_verified=int(known is not None))
        return header

    def submit_read(self, path: str | os.PathLike, offset: int, length: int, dest: Any) -> Future:
        """Read `length` bytes at `offset` into the first bytes of `dest` -> Future[int]."""
        if offset < 0 or length < 0 or nbytes(dest) < length:
            raise ValueError(f"bad range: offset {offset}, length {length}, destination {nbytes(dest)} bytes")
        return self._submit(self._read_range_sync, os.fspath(path), offset, length, dest,
                            self._ready_event(dest))

    def submit_chunk(self, path: str | os.PathLike, dest: Any, key: str | None = None,
                     token_ids: Any = None, trust: VerifiedFiles | None = None) -> Future:
        """Verify a chunk file's header (and `key`, `token_ids` if given) and read its payload
        into the first bytes of `dest` -> Future[ChunkHeader].

        `trust` (a FileStore, with `key`): a file it has already verified whole, and that has
        not changed since (same inode, size, mtime, ctime), is read without its header and
        without the payload hash, as the store's own reads do under `verify=changed`; a file
        this read checksums is reported back to it."""
        return self._submit(self._read_chunk_sync, os.fspath(path), dest, key, token_ids,
                            self._ready_event(dest), trust)

    def read_chunk_blocking(self, path: str | os.PathLike, dest: Any, key: str | None = None,
                            token_ids: Any = None, trust: VerifiedFiles | None = None,
                            ) -> ChunkHeader:
        """`submit_chunk(...).result()` without the hand-offs: runs on the calling thread
        (pieces still fan out to the I/O pool) and is not counted against `max_in_flight`.
        For synchronous callers; raises ReadError like the future would."""
        return self._read_chunk_sync(os.fspath(path), dest, key, token_ids,
                                     self._ready_event(dest), trust)

    def submit_reads(self, ranges: Iterable[tuple[str | os.PathLike, int, int, Any]]) -> list[Future]:
        """`submit_read` for many (path, offset, length, dest) ranges at once."""
        return [self.submit_read(*r) for r in ranges]

    async def read_many(self, ranges: Iterable[tuple[str | os.PathLike, int, int, Any]],
                        ) -> list[int | ReadError]:
        """Await many ranges; per range its length, or the ReadError that made it a miss."""
        results = await asyncio.gather(
            *(asyncio.wrap_future(f) for f in self.submit_reads(ranges)), return_exceptions=True
        )
        out: list[int | ReadError] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, ReadError):
                raise r
            out.append(r)
        return out

    async def read(self, path: str | os.PathLike, offset: int, length: int, dest: Any) -> int:
        return await asyncio.wrap_future(self.submit_read(path, offset, length, dest))

    async def read_chunk(self, path: str | os.PathLike, dest: Any, key: str | None = None,
                         token_ids: Any = None) -> ChunkHeader:
        return await asyncio.wrap_future(self.submit_chunk(path, dest, key, token_ids))

    async def read_chunks_into(
        self, paths: Sequence[str | os.PathLike], dests: Sequence[Any], keys: Sequence[str],
        on_done: Callable[[int, ChunkHeader | None, ReadError | None], bool | None], *,
        trust: VerifiedFiles | None = None,
    ) -> None:
        """Read each chunk file into its destination (`submit_chunk`, all submitted at once)
        and return once `on_done(i, header, failure)` has returned for every one that ran.
        `on_done` runs on an I/O thread as chunk i settles: (header, None) on a hit, else
        (None, the ReadError; any other exception, a CUDA error, is logged and reported as
        an "io" ReadError); returning False cancels the reads not yet started. Cancelled
        (the caller gave up waiting), no further read starts; a read already running may
        still write its destination."""
        futures: list[Future] = []
        # Set once `on_done` has returned for every chunk. Waiting for the reads themselves
        # is not enough: a read's other done-callbacks (an awaiter's) run at once from any
        # thread that adds them after it finished, while the reading thread may still be
        # inside `on_done` (placing the chunk): the batch would end before its answers.
        # One future for the batch also wakes the caller's loop once, not once per chunk.
        settled: Future[None] = Future()
        left = [len(paths)]
        lock = threading.Lock()

        def landed(i: int, fut: Future) -> None:
            try:
                if fut.cancelled():
                    return
                header: ChunkHeader | None = None
                failure: ReadError | None = None
                try:
                    header = fut.result(timeout=0)
                except ReadError as exc:
                    failure = exc
                except Exception as exc:  # noqa: BLE001 - not a ReadError (a CUDA error): a miss
                    log.warning("direct read of %s failed: %s", paths[i], exc)
                    failure = ReadError(os.fspath(paths[i]), IO, f"{type(exc).__name__}: {exc}")
                if on_done(i, header, failure) is False:
                    for later in futures[i + 1 :]:
                        later.cancel()
            finally:
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    # Cancelled (at any moment) when the caller gave up waiting: nobody reads it.
                    with contextlib.suppress(InvalidStateError):
                        settled.set_result(None)

        try:
            for path, dest, key in zip(paths, dests, keys, strict=True):
                futures.append(self.submit_chunk(path, dest, key, trust=trust))
            for i, fut in enumerate(futures):  # once the list is whole: `landed` reads it
                fut.add_done_callback(functools.partial(landed, i))
            if futures:
                await asyncio.wrap_future(settled)
        finally:
            for f in futures:
                f.cancel()  # only those not yet started: no read starts after we give up

    async def fill_through_host(
        self, dest: Any, read: Callable[[memoryview], Awaitable[ChunkHeader | None]],
    ) -> ChunkHeader | None:
        """`dest` filled by `read`, which puts a chunk's payload into the host memory it is
        given and returns its header (None: a miss): `dest` itself where it is host memory;
        for a CUDA destination, pinned staging that is then copied to it (done when this
        returns, so the caller may place it at once)."""
        if not is_cuda(dest):
            return await read(host_view(dest))
        import torch

        staging = torch.empty(nbytes(dest), dtype=torch.uint8, pin_memory=True)
        header = await read(host_view(staging))
        if header is None:
            return None
        flat = dest.detach().reshape(-1).view(torch.uint8)
        flat[: header.payload_len].copy_(staging[: header.payload_len], non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(dest.device))
        while not done.query():  # the caller places it next: the copy must be done
            await asyncio.sleep(0.0002)
        return header

    # -- writes ----------------------------------------------------------------------------

    def _host_payload(self, payload: Any) -> memoryview:
        if not is_cuda(payload):
            return host_view(payload)
        import torch

        # The header carries the payload's xxh3-64, computed on the host, so device bytes
        # are staged through pinned memory (torch caches pinned blocks between writes).
        src = byte_tensor(payload)
        staging = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
        staging.copy_(src)
        return host_view(staging)

    def _write_file(self, tmp: Path, header: bytes, view: memoryview) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with OpenFile(str(tmp), fd, os.O_WRONLY, self.support) as f:
            try:
                os.ftruncate(fd, len(header) + view.nbytes)
            except OSError as exc:
                raise write_error(str(tmp), exc) from exc
            write_range(f, memoryview(header), 0, direct=False)
            direct = self.config.direct == "always"

            def work(a: int, b: int) -> None:
                write_range(f, view[a:b], len(header) + a, direct)

            run_pieces(self._pool, work, view.nbytes, self.config.piece_bytes)
            if self.config.fsync:
                try:
                    os.fsync(fd)
                except OSError as exc:
                    raise write_error(str(tmp), exc) from exc

    def _write_sync(self, path: str, key: str, token_ids: Any, payload: Any,
                    meta: dict | None, ready: Any) -> bool:
        final = Path(path)
        if final.exists():
            self._count(writes_skipped=1)
            return False
        try:
            if ready is not None:
                ready.synchronize()  # the producer's kernels have written the payload
            view = self._host_payload(payload)
            try:
                header = encode_header(key, token_ids, view, meta)
            except ChunkError as exc:
                raise ValueError(f"cannot encode chunk {key!r}: {exc}") from exc
            tmp = final.parent / f".{final.name}{TMP_MARK}{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                self._write_file(tmp, header, view)
                created = link_publish(tmp, final)
            except OSError as exc:
                raise write_error(path, exc) from exc
            finally:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        except WriteError as exc:
            self._failed(exc)
            raise
        if created:
            self._count(writes=1, bytes_written=len(header) + view.nbytes)
        else:
            self._count(writes_skipped=1)
        return created

    def submit_write(self, path: str | os.PathLike, key: str, token_ids: Any, payload: Any,
                     meta: dict | None = None) -> Future:
        """Write `payload` (a tensor or buffer) as the chunk file `path`, create-only and
        atomic (tmp in the same directory, fsync, link) -> Future[bool]."""
        return self._submit(self._write_sync, os.fspath(path), key, token_ids, payload, meta,
                            self._ready_event(payload))

    async def write(self, path: str | os.PathLike, key: str, token_ids: Any, payload: Any,
                    meta: dict | None = None) -> bool:
        return await asyncio.wrap_future(self.submit_write(path, key, token_ids, payload, meta))

    # -- lifecycle and stats ----------------------------------------------------------------

    def threads_on(self, cpus: Collection[int] | None) -> None:
        """Start the I/O threads from now on on `cpus` (None: on the cores of the thread
        whose request starts them, which an engine may have bound to its own compute)."""
        self._cpus = frozenset(cpus) if cpus else None

    def _place(self) -> None:
        run_on(self._cpus)

    def stats(self) -> dict[str, Any]:
        with self._count_lock:
            counters = dict(self._counters)
        return {
            "backends": {"cpu": self.host.name, "cuda": self.cuda_backend},
            "capabilities": self.caps.as_dict(),
            "config": {**asdict(self.config), "io_threads": self.config.threads},
            "filesystems": self.support.stats(),
            "counters": counters,
        }

    def close(self) -> None:
        self._requests.shutdown(wait=True)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ChunkIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

