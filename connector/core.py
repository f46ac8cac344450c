"""`KVConnector`: the engine side of the cache — lookup, verified pipelined load, write-behind save.

Threading contract. Every public method is synchronous and called from one engine thread.
The connector owns an asyncio event loop in a daemon thread and is the only user of the
store (the store's coroutines all run on that loop). The engine thread only hashes token
ids, waits on futures with deadlines and copies bytes it already has; storage I/O,
verification and saves run on the loop and its worker threads.

Failure contract. Nothing raises into the engine for anything the store does: a miss, a
timeout, an exception from a backend or a chunk that fails verification ends the hit at
the chunks before it (they are already placed and exact), is counted, and the rest is
recomputed. A lookup failure opens a circuit breaker (storage/breaker.py, the one every
store uses) that bypasses the store for `breaker_cooldown`, doubling up to
`breaker_max_cooldown` while probes fail, so an unreachable store costs one timeout, not
one per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from connector.engine_io import direct_chunk_io
from connector.layout import ChunkLayout
from connector.policy import LoadPlan, LoadPolicy
from connector.writebehind import SaveJob, WriteBehindQueue
from gds.buffers import host_view
from hashing import Namespace, chunk_keys, token_array
from storage.base import Store
from storage.breaker import CircuitBreaker
from storage.capabilities import chunk_file_tier
from storage.codec import ChunkError, ChunkHeader

if TYPE_CHECKING:
    from gds import ChunkIO

log = logging.getLogger("kvstash.connector")

COUNTERS = (
    "lookups", "lookup_tokens", "lookup_errors", "bypassed",
    "loads", "hit_tokens", "hit_bytes", "load_seconds", "declined_tokens",
    "load_misses", "load_errors", "load_timeouts", "verify_failures",
    "save_queued", "saved_chunks", "saved_bytes", "save_skipped",
    "save_drops", "save_dropped_bytes", "save_errors",
)


class LoadTarget(Protocol):
    """Where loaded chunks go. `staging(i)` is called for every chunk before any I/O starts;
    `place(i)` runs on the engine thread, in chunk order, once chunk i is verified."""

    def staging(self, i: int) -> Any:
        """Writable, contiguous memory of exactly `layout.payload_nbytes` bytes for chunk i:
        host memory (a buffer, numpy array or CPU tensor), or a tensor on any device when
        the connector `reads_direct`."""

    def place(self, i: int) -> None:
        """Move chunk i from its staging buffer into the engine's KV cache."""


class KVConnector:
    """Engine-agnostic cache client over one store and one namespace.

    `layout` (how a chunk's K/V sit in its payload) is usually bound by an engine adapter
    (`connector.hf.CachedPrefill`). `max_in_flight` bounds concurrent chunk reads;
    `save_queue_bytes` bounds the write-behind queue; `lookup_timeout_s` bounds the one
    store call a miss costs.

    `direct_io`: a file:// store's chunks are read by `gds.ChunkIO` (GPUDirect Storage into
    device memory where the host has it, pinned bounce buffers otherwise, in-place reads
    into host memory), straight into whatever `LoadTarget.staging` returns, CUDA tensors
    included. True builds a ChunkIO for the store's directory; pass one to share it; False
    reads through the store like every other backend (whose bytes land in host staging).
    """

    def __init__(
        self,
        store: Store | str | Sequence[str],
        ns: Namespace,
        *,
        layout: ChunkLayout | None = None,
        max_in_flight: int = 8,
        lookup_timeout_s: float = 1.0,
        save_queue_bytes: int = 512 * 1024**2,
        policy: LoadPolicy | None = None,
        breaker_failures: int = 1,
        breaker_cooldown: float = 1.0,
        breaker_max_cooldown: float = 30.0,
        direct_io: bool | ChunkIO = True,
    ):
        if not isinstance(store, Store):
            from storage.registry import open_store

            store = open_store(store)
        self.store = store
        self.ns = ns
        self.layout: ChunkLayout | None = None
        self.max_in_flight = max_in_flight
        self.lookup_timeout_s = lookup_timeout_s
        self.policy = policy or LoadPolicy()
        self._breaker = CircuitBreaker(breaker_failures, breaker_cooldown, breaker_max_cooldown)
        self._counters = Counters()
        self._count = self._counters.add
        self._closed = False
        if layout is not None:
            self.bind_layout(layout)
        self.chunk_io = direct_chunk_io(store, direct_io, max_in_flight)
        self._owns_chunk_io = direct_io is True and self.chunk_io is not None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvstash-connector", daemon=True
        )
        self._thread.start()
        self._writer = WriteBehindQueue(store, self._loop, self._count, save_queue_bytes)
        # A connector dropped or left open at exit still finishes its queued saves.
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, self._writer)

    def __repr__(self) -> str:
        return f"<KVConnector {self.store} ns={self.ns.id}>"

    # -- configuration -------------------------------------------------------------------

    def bind_layout(self, layout: ChunkLayout) -> None:
        """Fix the chunk layout; the namespace must describe it (or chunks would mix)."""
        wrong = [
            f"{name}={getattr(self.ns, name)!r} (the model needs {want!r})"
            for name, want in (
                ("dtype", layout.dtype), ("layout", layout.name),
                ("chunk_tokens", layout.chunk_tokens),
            )
            if getattr(self.ns, name) != want
        ]
        if wrong:
            raise ValueError(
                "namespace does not describe this model's KV layout: " + ", ".join(wrong)
                + " (build it with connector.hf.namespace_for(model))"
            )
        self.layout = layout

    @property
    def chunk_tokens(self) -> int:
        return self.ns.chunk_tokens

    @property
    def reads_direct(self) -> bool:
        """Whether loads go through `gds.ChunkIO`: staging may then be any tensor, on any
        device; otherwise it must be host memory."""
        return self.chunk_io is not None

    # -- counters ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters since start, plus load GB/s and the policy's current estimates."""
        out: dict[str, Any] = self._counters.snapshot()
        out["load_gbps"] = out["hit_bytes"] / out["load_seconds"] / 1e9 if out["load_seconds"] else 0.0
        out["save_pending_bytes"] = self._writer.pending_bytes
        out["store"] = str(self.store)
        out["namespace"] = self.ns.id
        out["chunk_io"] = self.chunk_io.stats() if self.chunk_io is not None else None
        out.update(self._breaker.snapshot())
        out.update(self.policy.snapshot())
        return out

    # -- the store, from the engine thread -----------------------------------------------

    def _bypassed(self, probe: bool = False) -> bool:
        """Whether to skip the store now. `probe`: this call reports its outcome to the
        breaker (a lookup), so it may be the half-open probe; a load only asks."""
        if self._closed:
            return True
        if self._breaker.allow() if probe else not self._breaker.is_open:
            return False
        self._count(bypassed=1)
        return True

    def _store_failed(self, what: str, exc: BaseException) -> None:
        if self._breaker.record(False):
            log.warning(
                "%s on %s failed (%s); bypassing the store for %.0f s",
                what, self.store, exc or type(exc).__name__, self._breaker.open_for_s,
            )

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run a store coroutine on the connector loop and wait at most `timeout` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    # -- lookup --------------------------------------------------------------------------

    def lookup(self, token_ids: Any, max_tokens: int | None = None) -> int:
        """Tokens of this prompt's prefix the store holds (whole chunks, one batched call)."""
        self._count(lookups=1)
        try:
            tokens = token_array(token_ids)
        except ValueError as exc:
            log.warning("lookup skipped: %s", exc)
            return 0
        if max_tokens is not None:
            tokens = tokens[: max(max_tokens, 0)]
        keys = chunk_keys(tokens, self.ns)
        if not keys or self._bypassed(probe=True):
            return 0
        try:
            n = int(self._call(self.store.prefix_len(keys), self.lookup_timeout_s))
        except BaseException as exc:
            if not isinstance(exc, Exception):  # interrupted: neither verdict
                self._breaker.release()
                raise
            self._count(lookup_errors=1)
            self._store_failed("lookup", exc)
            return 0
        self._breaker.success()
        hit = min(max(n, 0), len(keys)) * self.chunk_tokens
        self._count(lookup_tokens=hit)
        return hit

    def plan(self, cached_tokens: int) -> LoadPlan:
        """How much of a cached prefix is worth loading now (see `connector.policy`)."""
        layout = self._require_layout()
        plan = self.policy.plan(
            cached_tokens // self.chunk_tokens, self.chunk_tokens, layout.payload_nbytes
        )
        declined = cached_tokens // self.chunk_tokens - plan.chunks
        if declined > 0:
            self._count(declined_tokens=declined * self.chunk_tokens)
        return plan

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine reports each prefill it ran, so the policy knows what recompute costs."""
        self.policy.observe_prefill(tokens, seconds)

    def _require_layout(self) -> ChunkLayout:
        if self.layout is None:
            raise RuntimeError("KVConnector has no chunk layout: call bind_layout() first")
        return self.layout

    # -- load ----------------------------------------------------------------------------

    def load(
        self,
        token_ids: Any,
        num_tokens: int,
        target: LoadTarget,
        deadline_s: float | None = None,
    ) -> int:
        """Load the first `num_tokens` (whole chunks) into `target`; returns tokens placed.

        All chunks are requested at once (at most `max_in_flight` reading); chunk i is
        placed on this thread while chunk i+1 is still being read. The first chunk that
        is missing, fails verification or is not there by the deadline ends the hit.
        """
        layout = self._require_layout()
        n = self.chunk_tokens
        try:
            tokens = token_array(token_ids)
        except ValueError as exc:
            log.warning("load skipped: %s", exc)
            return 0
        n_chunks = min(max(num_tokens, 0), len(tokens)) // n
        if n_chunks == 0 or self._bypassed():
            return 0
        tokens = tokens[: n_chunks * n]
        keys = chunk_keys(tokens, self.ns)
        wait_s = self.policy.deadline_s(n_chunks * n) if deadline_s is None else deadline_s
        started = time.monotonic()
        deadline = started + wait_s
        self._count(loads=1)
        try:
            dests = [target.staging(i) for i in range(n_chunks)]
            if self.chunk_io is None:
                dests = [host_view(d) for d in dests]
        except Exception as exc:  # noqa: BLE001 - the engine could not give us memory: recompute
            log.warning("load skipped: no staging memory: %s", exc)
            return 0
        done: list[concurrent.futures.Future[bool]] = [
            concurrent.futures.Future() for _ in range(n_chunks)
        ]
        fetch_all = self._fetch_direct if self.chunk_io is not None else self._fetch_all
        fetch = asyncio.run_coroutine_threadsafe(
            fetch_all(keys, tokens, dests, done, layout), self._loop
        )
        placed, stalled = 0, False
        try:
            for i in range(n_chunks):
                try:
                    ok = done[i].result(timeout=max(deadline - time.monotonic(), 0.0))
                except concurrent.futures.TimeoutError:
                    self._count(load_timeouts=1)
                    log.warning("load from %s: chunk %d not there in %.3f s", self.store, i, wait_s)
                    stalled = True
                    break
                if not ok:
                    break
                target.place(i)
                placed += 1
        except Exception as exc:  # noqa: BLE001 - a placement failure is a shorter hit too
            log.warning("placing chunk %d failed: %s", placed, exc)
        finally:
            if placed < n_chunks:
                fetch.cancel()
        elapsed = time.monotonic() - started
        nbytes = placed * layout.payload_nbytes
        if placed == n_chunks or stalled:
            self.policy.observe_load(nbytes, elapsed)
        self._count(hit_tokens=placed * n, hit_bytes=nbytes, load_seconds=elapsed)
        return placed * n

    async def _fetch_all(
        self,
        keys: list[str],
        tokens: np.ndarray,
        bufs: list[memoryview],
        done: list[concurrent.futures.Future[bool]],
        layout: ChunkLayout,
    ) -> None:
        """Read every chunk with one batched store call. Each chunk is checked as it lands
        (on the store's I/O thread where it has one, else on the loop) and its future set
        there, so the engine thread places it without a hop through the loop; past the
        first chunk that cannot be used no further read is started."""
        n = self.chunk_tokens

        def landed(i: int, header: ChunkHeader | None) -> bool:
            ok = self._accept(keys[i], tokens[i * n : (i + 1) * n], bufs[i], layout, header)
            _resolve(done[i], ok)
            return ok

        try:
            await self.store.get_into_many(keys, bufs, concurrency=self.max_in_flight,
                                           on_done=landed)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any backend failure is a miss
            self._count(load_errors=1)
            log.warning("get from %s failed: %s", self.store, exc)
        finally:
            for f in done:
                _resolve(f, False)

    async def _fetch_direct(
        self,
        keys: list[str],
        tokens: np.ndarray,
        dests: list[Any],
        done: list[concurrent.futures.Future[bool]],
        layout: ChunkLayout,
    ) -> None:
        """`_fetch_all` through ChunkIO: every chunk is submitted at once (ChunkIO runs at
        most `max_inflight`, in order). ChunkIO checks the header against the key and, with
        verify="checksum", the payload's xxh3 (on device for CUDA destinations); the layout
        and token ids are checked here. The store is told of each read (hits refresh its
        LRU, corrupt files are quarantined). With a tier list whose first tier is the file
        store, a chunk that fails there is read through the tier list (`_from_lower_tiers`).
        Past the first chunk that cannot be used the reads not yet started are cancelled."""
        from gds.filestore import settle

        io, files = self.chunk_io, chunk_file_tier(self.store)
        has_lower_tiers = files is not self.store
        n = self.chunk_tokens
        futures: list[concurrent.futures.Future[Any]] = []

        def finish(i: int, ok: bool) -> None:
            _resolve(done[i], ok)
            if not ok:
                for later in futures[i + 1 :]:
                    later.cancel()

        def landed(i: int, fut: concurrent.futures.Future[Any]) -> None:
            # On ChunkIO's request thread, where the store's own reads would have run.
            ok = False
            try:
                if not fut.cancelled():
                    header, why = settle(files, keys[i], fut)
                    if header is not None:
                        ok = self._accept(keys[i], tokens[i * n : (i + 1) * n], None, layout, header)
                    elif has_lower_tiers:
                        # Missing, corrupt (now quarantined) or unreadable in the file tier:
                        # the tier list reads it from below, as its own get_into would.
                        self._loop.call_soon_threadsafe(from_lower, i)
                        return  # done[i] is resolved once the lower tiers answer
                    else:
                        self._count(**{_MISS_COUNTER.get(why, "load_misses"): 1})
            except Exception as exc:  # noqa: BLE001 - any failure is a miss
                self._count(load_errors=1)
                log.warning("chunk %s from %s: %s", keys[i], files, exc)
            finish(i, ok)

        lower_reads: set[asyncio.Task] = set()

        def from_lower(i: int) -> None:
            async def read() -> None:
                ok = False
                try:
                    ok = await self._from_lower_tiers(keys[i], tokens[i * n : (i + 1) * n],
                                                      dests[i], layout)
                except Exception as exc:  # noqa: BLE001 - any failure is a miss
                    self._count(load_errors=1)
                    log.warning("chunk %s from %s: %s", keys[i], self.store, exc)
                finish(i, ok)

            task = asyncio.ensure_future(read())
            lower_reads.add(task)
            task.add_done_callback(lower_reads.discard)

        try:
            for key, dest in zip(keys, dests, strict=True):
                futures.append(io.submit_chunk(files.chunk_path(key), dest, key, trust=files))
            for i, fut in enumerate(futures):  # once the list is whole: `landed` reads it
                fut.add_done_callback(lambda f, i=i: landed(i, f))
            # Every chunk's answer: from ChunkIO, or from the lower tiers it handed over to.
            # (shielded: cancelling this fetch must not cancel the engine's futures)
            await asyncio.gather(*(asyncio.shield(asyncio.wrap_future(f)) for f in done),
                                 return_exceptions=True)
        except Exception as exc:  # noqa: BLE001 - any failure is a miss (not a cancellation)
            self._count(load_errors=1)
            log.warning("direct read from %s failed: %s", files, exc)
        finally:
            for f in futures:
                f.cancel()  # only those not yet started: no read starts after we give up
            for task in list(lower_reads):
                task.cancel()
            for f in done:
                _resolve(f, False)

    async def _from_lower_tiers(self, key: str, tokens: np.ndarray, dest: Any,
                                layout: ChunkLayout) -> bool:
        """A chunk the file tier lacks (or failed to read), read through the tier list
        (which tries the lower tiers and promotes a hit) into `dest`; a CUDA destination is
        filled from pinned host memory, as for any S3 or HTTP store."""
        from gds.buffers import is_cuda

        if not is_cuda(dest):
            host = host_view(dest)
            return self._accept(key, tokens, host, layout, await self.store.get_into(key, host))
        import torch

        staging = torch.empty(layout.payload_nbytes, dtype=torch.uint8, pin_memory=True)
        host = host_view(staging)
        if not self._accept(key, tokens, host, layout, await self.store.get_into(key, host)):
            return False
        flat = dest.detach().reshape(-1).view(torch.uint8)
        flat[: layout.payload_nbytes].copy_(staging, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(dest.device))
        while not done.query():  # the engine thread places it next: the copy must be done
            await asyncio.sleep(0.0002)
        return True

    def _accept(self, key: str, tokens: np.ndarray, buf: memoryview | None, layout: ChunkLayout,
                header: ChunkHeader | None) -> bool:
        """Whether a fetched chunk is the one these tokens need. `buf` None: its payload was
        checked by the reader (ChunkIO) and is not in host memory to check here."""
        if header is None:
            self._count(load_misses=1)
            return False
        why = _verify(header, key, tokens, buf, layout)
        if why:
            self._count(verify_failures=1)
            log.warning("chunk %s from %s rejected: %s", key, self.store, why)
            return False
        return True

    # -- save ----------------------------------------------------------------------------

    def save(
        self, token_ids: Any, payload: Callable[[int], Any], start_tokens: int = 0
    ) -> int:
        """Queue this prompt's full chunks from `start_tokens` on for write-behind.

        `payload(i)` returns chunk i's bytes in the bound layout; it runs later on a worker
        thread, so it must read KV that the engine will not overwrite. Returns the number
        of chunks queued (the rest were dropped: queue full). Never blocks on storage.
        """
        layout = self._require_layout()
        n = self.chunk_tokens
        try:
            tokens = token_array(token_ids)
        except ValueError as exc:
            log.warning("save skipped: %s", exc)
            return 0
        keys = chunk_keys(tokens, self.ns)
        first = max(start_tokens, 0) // n
        if first >= len(keys) or self._closed:
            return 0
        job = SaveJob(
            keys=keys[first:],
            tokens=[tokens[i * n : (i + 1) * n] for i in range(first, len(keys))],
            first=first,
            payload=payload,
            chunk_nbytes=layout.payload_nbytes,
            meta=layout.meta(),
        )
        return self._writer.submit(job)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written (or failed); False on timeout."""
        if self._closed:
            return True
        try:
            self._call(self._writer.join(), timeout)  # type: ignore[arg-type]
        except concurrent.futures.TimeoutError:
            return False
        return True

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run a coroutine on the connector's loop (e.g. a store call from a test or tool)."""
        return self._call(coro, timeout)  # type: ignore[arg-type]

    def close(self, close_store: bool = True, timeout: float | None = 30.0) -> None:
        """Finish queued saves (up to `timeout`), then stop the loop (and close the store)."""
        if self._closed:
            return
        if not self.flush(timeout):
            log.warning("closing %s with saves still queued", self.store)
        self._closed = True
        try:
            if close_store:
                self._call(self.store.close(), timeout)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - closing must not fail the engine either
            log.warning("closing %s: %s", self.store, exc)
        finally:
            self._finalizer()
            if self._owns_chunk_io:
                self.chunk_io.close()

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Counters:
    """The connector's counters; any thread may add."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._values[name] += d

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._values)


def _shutdown(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, writer: WriteBehindQueue,
    timeout: float = 10.0,
) -> None:
    """Stop a connector's loop after its queued saves (bounded by `timeout`)."""
    if loop.is_closed():
        return
    if threading.current_thread() is thread:  # collected on its own loop: cannot wait here
        loop.stop()
        return
    for step in (writer.join, writer.stop):
        try:
            asyncio.run_coroutine_threadsafe(step(), loop).result(timeout)
        except Exception as exc:  # noqa: BLE001 - shutting down must not raise
            log.warning("connector shutdown: %s", exc or type(exc).__name__)
            break
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout)
    if not thread.is_alive():
        loop.close()


# The connector counter for each reason ChunkIO gives for a failed read (gds.errors).
_MISS_COUNTER = {"corrupt": "verify_failures", "io": "load_errors"}


def _resolve(f: concurrent.futures.Future[bool], ok: bool) -> None:
    """Set a chunk's outcome once: the first word (its read, or the batch's end) stands."""
    try:
        f.set_result(ok)
    except concurrent.futures.InvalidStateError:
        pass


def _verify(
    header: ChunkHeader, key: str, tokens: np.ndarray, buf: memoryview | None,
    layout: ChunkLayout,
) -> str | None:
    """Why a fetched chunk cannot be used for these tokens, or None if it can."""
    if header.key != key:
        return f"header holds key {header.key}"
    if not header.matches_tokens(tokens):
        return "header holds other token ids"
    if header.payload_len != layout.payload_nbytes or not layout.matches(header.meta):
        return f"layout {header.meta} ({header.payload_len} bytes), expected {layout.meta()}"
    if buf is None:
        return None
    try:
        header.verify_payload(buf[: header.payload_len])
    except ChunkError as exc:
        return str(exc)
    return None
