"""`KVConnector`: the one engine-side core — lookup, load-vs-recompute, bypass, verified loads, counters, write-behind.

Every engine adapter (HF transformers, the vLLM V1 connector, the vLLM offloading tier,
SGLang HiCache) runs on it and only translates the engine's blocks, pages and buffers
into chunks (keys, token ids) and load targets (`LoadTarget`).

Threading contract. Every public method is synchronous, never waits on storage unless it
says so, and may be called from the engine's threads. The store's coroutines all run on
one asyncio loop in a daemon thread (`connector.engine_io.StoreLoop`, shared by every
connector of a process that names the same store URLs). The synchronous `lookup`/`load`
wait with deadlines (HF: the engine thread itself places each chunk); `lookup_async`,
`load_async` and `write` return futures at once (vLLM, SGLang: the adapter polls them).

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
import dataclasses
import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Collection, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np

from connector.engine_io import StoreLoop
from connector.layout import CANON, ChunkLayout, EngineLayout
from connector.lookup import LookupPoll
from connector.options import CoreOptions
from connector.policy import LoadPlan, LoadPolicy, PrefillTimer
from connector.reads import (
    ChunkReads,
    DirectReads,
    LayerFileReads,
    PlainGets,
    RangeReads,
    ReadContext,
    ResidentReads,
)
from connector.reads import resolve as _resolve
from connector.writebehind import SaveJob, WriteBehindQueue
from gds.buffers import for_gpu, host_view
from gds.chunkio import run_on
from gds.filestore import enable_direct_reads
from hashing import Namespace, chunk_keys, token_array
from storage.base import Store
from storage.breaker import CircuitBreaker
from storage.capabilities import (
    SupportsBlobFiles,
    SupportsDirectReads,
    SupportsRangeReads,
    SupportsResidentReads,
)
from storage.memory import MemoryStore
from storage.options import parse_bool

if TYPE_CHECKING:
    from gds import ChunkIO

log = logging.getLogger("kvstash.connector")

# The core's counters (engine adapters export them: vLLM as `vllm:kvstash_<name>`).
COUNTERS = {
    "lookups": "Prompt prefixes looked up in the store.",
    "lookup_tokens": ("Prompt tokens the store held at lookup (whole chunks), past those the "
                      "engine's own prefix cache held."),
    "lookup_errors": "Lookups that failed (store unreachable or erroring): misses.",
    "lookup_timeouts": "Lookups that outlived lookup_timeout_s: misses.",
    "lookups_given_up": ("Lookups not waited for past the time a hit could still beat "
                         "recomputing the prefix they asked for, or not sent where it "
                         "could not (vLLM): misses."),
    "bypassed": "Lookups and loads skipped while the circuit breaker had the store bypassed.",
    "loads": "Loads started.",
    "loaded_chunks": "Chunks read, verified and placed into the engine's KV cache.",
    "resident_chunks": "Chunks read from the page cache on the engine's thread (no I/O thread).",
    "layered_chunks": "Chunks read a layer at a time on the layers thread while the engine computed.",
    "hit_tokens": "Prompt tokens loaded from the store instead of computed.",
    "hit_bytes": "Payload bytes loaded from the store.",
    "hit_needed_bytes": ("Payload bytes of the chunks loaded that their hits need: of a "
                         "sliding-window layer only its part inside the window at the "
                         "hit's end (vLLM)."),
    "load_seconds": "Wall time of loads, from start to the last chunk placed.",
    "declined_tokens": "Stored tokens not loaded because recomputing them was faster.",
    "failed_chunks": "Chunks a load planned but did not place (missing, corrupt, unreadable, late).",
    "failed_load_tokens": "Prompt tokens recomputed because a chunk failed to load.",
    "load_misses": "Chunks absent at load time.",
    "load_errors": "Chunk reads that failed in the store or in placement.",
    "load_timeouts": "Loads cut short by their deadline.",
    "verify_failures": "Chunks rejected by verification (key, token ids, layout, checksum).",
    "prefill_tokens": "Prompt tokens the engine computed (what the policy learns recompute speed from).",
    "prefill_seconds": "Wall time of the engine's prefill steps.",
    "save_queued": "Chunks handed to the write-behind queue.",
    "unsaved_chunks": ("New chunks not saved: a prefix whose load would take this engine "
                       "far longer than recomputing it (vLLM, unless save_all)."),
    "saved_chunks": "Chunks written to the store.",
    "handoffs": "P/D prefills whose last step waited for their saves (kv_producer, do_remote_decode).",
    "handoff_seconds": "Time P/D prefills' last steps waited for their saves.",
    "handoff_failures": "P/D prefills' saves (one per step) that failed or outlived handoff_timeout_s.",
    "saved_bytes": "Bytes of chunks written to the store.",
    "save_skipped": "Chunks not written because the store already held them.",
    "save_drops": "Chunks dropped because the write-behind queue was full.",
    "save_dropped_bytes": "Bytes of chunks dropped because the write-behind queue was full.",
    "save_errors": "Write-behind jobs that failed (their chunks become future misses).",
}


# At most this many keys of one lookup are asked on the calling thread (`_lookup_now`): an
# access(2) each, about a millisecond in all on an engine's scheduler at most
# (docs/benchmarks/2026-11-26-vllm.md).
LOCAL_LOOKUP_MAX_KEYS = 512


class LoadTarget(Protocol):
    """Where loaded chunks go: the engine adapter's side of a load (`load`, `load_async`,
    `load_segments_async`)."""

    def staging(self, i: int) -> Any:
        """Writable, contiguous memory of exactly `layout.staging_nbytes` bytes for chunk i
        (the payload, or the ranges of it this reader reads, packed: `EngineLayout.spans`):
        host memory (a buffer, numpy array or CPU tensor), or a tensor on any device when
        the connector `reads_direct`. Called on the thread that starts the load, for every
        chunk before any read starts (a `load_segments_async(here=True)` asks for a chunk's
        only where it needs it, and a chunk read straight into place takes none). A load
        cut short by its deadline (`LoadHandle.stalled`) may still write it afterwards."""

    def place(self, i: int) -> None:
        """Move chunk i, verified, from its staging buffer into the engine's KV cache. `load`:
        on the thread that called it, in chunk order. `load_async`: on the thread that read
        the chunk (the starting thread for a chunk read from the page cache, else an I/O
        thread of the store or of ChunkIO), in any order, concurrently with other chunks'.
        Raising makes the chunk a miss."""


@runtime_checkable
class InPlaceTarget(LoadTarget, Protocol):
    """A `LoadTarget` that can also take chunk i's payload where it finally goes."""

    def destination(self, i: int) -> list[memoryview] | None:
        """Writable host memory views, in payload order, whose lengths add up to the
        payload: chunk i's bytes are read straight into them and not placed (None: use
        staging and `place`). Called on the thread that starts a `load_async`, for chunks
        read from the page cache there. Written before the chunk is verified: a chunk that
        fails leaves them garbage, so they must be memory the engine recomputes on a
        failure."""


class LeanTarget(LoadTarget, Protocol):
    """A `LoadTarget` that needs only some of each chunk's byte ranges."""

    def wanted(self, i: int) -> Sequence[int] | None:
        """The ranges of chunk i the engine needs, as indices into the layout's
        `read_spans`, in order (None: every one), e.g. no sliding-window layer outside the
        window at the hit's end. Where ranged reads are in use (`partial_reads`), only
        those are read and verified; the staging bytes of the others are left as they are,
        so `place(i)` must copy nothing of them anywhere the engine reads. Called on the
        thread that starts the load, for every chunk."""


class SegmentInPlaceTarget(Protocol):
    """A `SegmentTarget` that can also take segment s of chunk i where it finally goes."""

    def segment_destination(self, i: int, s: int) -> list[memoryview] | None:
        """Writable host memory views, in payload order, whose lengths add up to segment
        s of chunk i: its bytes are read straight into them and not placed (None: use
        staging and `place_segment`). Called on the layers thread (or, with `here`, the
        thread that starts the load) of a local directory's layer-pipelined load. Written
        before the segment is verified, and maybe after the load's deadline has passed (by
        a read of page-cached bytes already under way), so they must be memory the engine
        recomputes on a failure, not before the step ends."""


class Buffers:
    """A `LoadTarget` whose staging buffers are the destinations themselves (nothing to
    place): host pages of an offloading tier, SGLang's page buffers."""

    def __init__(self, bufs: Sequence[Any]):
        self.bufs = bufs

    def staging(self, i: int) -> Any:
        return self.bufs[i]

    def place(self, i: int) -> None:
        pass


class LoadHandle:
    """A load in flight (`KVConnector.load_async`). `chunks[i]` resolves to whether chunk
    i was read, verified and placed; `done()` once every chunk has its answer and the
    fetch has ended. `stalled`: the deadline cut it short, so a read still running may
    yet write a staging buffer (do not reuse them)."""

    def __init__(self, n: int, started: float):
        self.chunks: list[concurrent.futures.Future[bool]] = [
            concurrent.futures.Future() for _ in range(n)
        ]
        self.started = started
        self.deadline = started
        self.stalled = False
        self.fetch: concurrent.futures.Future[None] | None = None
        # Bytes read of each chunk where a load reads some of its ranges (`LeanTarget`);
        # None: every chunk's `staging_nbytes` (or its whole payload).
        self.nbytes: list[int] | None = None

    def done(self) -> bool:
        return self.fetch is None or self.fetch.done()

    def result(self, timeout: float | None = None) -> list[bool]:
        """Per chunk, whether it was placed (waits up to `timeout` for the load to end)."""
        if self.fetch is not None:
            try:
                self.fetch.result(timeout)
            except concurrent.futures.CancelledError:
                pass
        return [f.done() and not f.cancelled() and f.result() for f in self.chunks]

    def cancel(self) -> None:
        if self.fetch is not None:
            self.fetch.cancel()
        for f in self.chunks:
            _resolve(f, False)


class SegmentTarget(LoadTarget, Protocol):
    """A `LoadTarget` that places a chunk one layer at a time (`load_segments_async`)."""

    def place_segment(self, i: int, s: int) -> None:
        """Move segment (layer) s of chunk i, verified, from its staging buffer into the KV
        cache. On whichever thread read it: the layers thread, the thread that starts the
        load (`here`, or chunks read from the page cache there), the store's loop (ranged
        reads) or one of its I/O threads (whole chunks), or a ChunkIO thread; segments of
        different chunks concurrently, those of one chunk never at once."""


class SegmentLoad(LoadHandle):
    """A layer-pipelined load (`KVConnector.load_segments_async`): `wait_segment(s)` returns
    once every chunk has placed its segment s or failed, so layer s may compute while later
    layers are still being read. `chunks[i]` resolves True once all of chunk i is placed."""

    def __init__(self, n: int, n_segments: int, started: float):
        super().__init__(n, started)
        self._lock = threading.Lock()
        self._ready = [threading.Event() for _ in range(n_segments)]
        self._left = [n] * n_segments  # chunks still to answer for each segment
        self._placed = [[False] * n_segments for _ in range(n)]
        self._alive = [True] * n
        if n == 0:
            for e in self._ready:
                e.set()

    def wait_segment(self, s: int, timeout: float | None = None) -> bool:
        """Wait until segment s of every chunk is placed or its chunk failed; False on timeout."""
        return self._ready[s].wait(timeout)

    def alive(self, i: int) -> bool:
        return self._alive[i]

    def placed(self, i: int, s: int) -> None:
        # The chunk's answer is set before its segment is: whoever wakes from
        # `wait_segment` of the last segment reads every chunk's answer at once.
        with self._lock:
            if not self._alive[i] or self._placed[i][s]:
                return
            self._placed[i][s] = True
            whole = all(self._placed[i])
        if whole:
            _resolve(self.chunks[i], True)
        with self._lock:
            self._answered(s)

    def placed_whole(self, i: int) -> None:
        """`placed(i, s)` for every segment s at once (a chunk read straight into place)."""
        with self._lock:
            if not self._alive[i] or all(self._placed[i]):
                return
            todo = [s for s, done in enumerate(self._placed[i]) if not done]
            self._placed[i] = [True] * len(self._placed[i])
        _resolve(self.chunks[i], True)
        with self._lock:
            for s in todo:
                self._answered(s)

    def fail(self, i: int) -> None:
        """Chunk i will not be placed whole: its segments not yet placed stop being waited for."""
        with self._lock:
            if not self._alive[i] or all(self._placed[i]):
                return
            self._alive[i] = False
        _resolve(self.chunks[i], False)
        with self._lock:
            for s, done in enumerate(self._placed[i]):
                if not done:
                    self._answered(s)

    def _answered(self, s: int) -> None:
        self._left[s] -= 1
        if self._left[s] == 0:
            self._ready[s].set()

    def cancel(self) -> None:
        for i in range(len(self.chunks)):
            self.fail(i)
        super().cancel()


H = TypeVar("H", bound=LoadHandle)


def _chunks_on_this_host(store: Store) -> bool:
    """Whether a ranged read of `store` costs about what its bytes cost (`partial_reads`
    "auto"): chunks in files on this host (file://, or a tier list whose first tier is a
    directory) or in this process's memory; not a request over the network per range."""
    return isinstance(store, (SupportsBlobFiles, MemoryStore))


class KVConnector:
    """Engine-agnostic cache client over one store and one namespace.

    `store`: URL(s) (the process shares one loop and store per URL list) or a `Store`
    (driven by a loop of its own). `layout` (how a chunk's K/V sit in its payload) is
    bound by the engine adapter. `max_in_flight` bounds concurrent chunk reads;
    `save_queue_bytes` bounds the write-behind queue, and `save_delay_s` holds each save
    that long after it is queued (see WriteBehindQueue); `lookup_timeout_s` bounds the one
    store call a miss costs. `policy` decides how much of a stored prefix is worth
    loading and how long to wait for it; `breaker_*` set the circuit breaker that
    bypasses a failing store. These are `CoreOptions`, with its defaults;
    `load_deadline_s` fixes the deadline of every load (None: the policy's).

    `direct_io`: a store that reads directly into device buffers (`SupportsDirectReads`:
    file://, or a tier list whose first tier is file://) is read that way, straight into
    whatever `LoadTarget.staging` returns, CUDA tensors included. True enables it (the
    store gets a ChunkIO of its own); a `gds.ChunkIO` is shared with the store; False reads
    through `get_into_many` like every other backend (bytes land in host staging).

    `resident_reads`: chunks of a local file:// directory that are all in the page cache
    (`SupportsResidentReads`) are read on the thread that starts the load, without a
    hand-off to an I/O thread: into host staging, or straight into the engine's memory
    where the target gives it (`InPlaceTarget`); the rest as above. A layer-pipelined load
    (`load_segments_async`) of a local directory runs on a thread of its own, the layers
    thread, while the engine computes. `io_cpus`: the adapter's choice of cores, away from
    the engine's compute threads, for every thread the connector runs on (the layers
    thread, the store's loop and its executor, ChunkIO's); None leaves them where they
    start, on the cores of the thread that starts them.
    """

    def __init__(
        self,
        store: Store | str | Sequence[str],
        ns: Namespace,
        *,
        layout: ChunkLayout | EngineLayout | None = None,
        max_in_flight: int = CoreOptions.max_in_flight,
        lookup_timeout_s: float = CoreOptions.lookup_timeout_s,
        load_deadline_s: float | None = CoreOptions.load_deadline_s,
        save_queue_bytes: int = 512 * 1024**2,
        save_delay_s: float = 0.0,
        policy: LoadPolicy | None = None,
        breaker_failures: int = CoreOptions.breaker_failures,
        breaker_cooldown: float = CoreOptions.breaker_cooldown,
        breaker_max_cooldown: float = CoreOptions.breaker_max_cooldown,
        partial_reads: str = CoreOptions.partial_reads,
        direct_io: bool | str | ChunkIO = True,
        segment_checksums: bool = True,
        resident_reads: bool = True,
        io_cpus: Collection[int] | None = None,
    ):
        self.io = StoreLoop(store) if isinstance(store, Store) else StoreLoop.shared(store)
        self._owns_store = not isinstance(store, Store)
        self.store = self.io.store
        self._loop = self.io.loop
        self.ns = ns
        self.layout: ChunkLayout | EngineLayout | None = None
        self.max_in_flight = max_in_flight
        self.lookup_timeout_s = lookup_timeout_s
        self.load_deadline_s = load_deadline_s
        self.policy = policy or LoadPolicy()
        self._prefill_timers: list[PrefillTimer] = []  # stopped, time not yet known
        self._timers_lock = threading.Lock()
        # Chunks being written (key -> the write that holds them), for `writing`.
        self._writing: dict[str, concurrent.futures.Future[list[bool]]] = {}
        self._writing_lock = threading.Lock()  # writes end on write-behind's thread
        self.segment_checksums = segment_checksums
        self.resident_reads = resident_reads  # a switch; the read plans say what can be
        self.io_cpus = frozenset(io_cpus) if io_cpus else None
        self._layers: concurrent.futures.ThreadPoolExecutor | None = None
        self._breaker = CircuitBreaker(breaker_failures, breaker_cooldown, breaker_max_cooldown)
        self._breaker_lock = threading.Lock()  # asked on engine threads, told on the loop
        self._counters = Counters()
        self._count = self._counters.add
        self._closed = False
        if layout is not None:
            self.bind_layout(layout)
        if isinstance(direct_io, str):
            direct_io = parse_bool(direct_io)
        self.chunk_io: ChunkIO | None = None
        if direct_io is not False and isinstance(self.store, SupportsDirectReads):
            given = None if direct_io is True else direct_io
            self.chunk_io = enable_direct_reads(self.store, given, max_in_flight=max_in_flight)
        # One read plan per capability of the store (connector/reads.py), each asked once:
        # a runtime protocol check costs tens of microseconds, and loads ask per chunk.
        reads = ReadContext(self.store, self._loop, max_in_flight, self._count, self._account)
        store = self.store
        self._resident: ResidentReads | None = (
            ResidentReads(store, reads) if isinstance(store, SupportsResidentReads) else None)
        self._layer_files: LayerFileReads | None = (
            LayerFileReads(self._resident.store, reads)
            if self._resident is not None and self._resident.local else None)
        self._whole: ChunkReads
        self._by_segment: ChunkReads
        if self.chunk_io is not None and isinstance(store, SupportsDirectReads):
            self._whole = self._by_segment = DirectReads(store, reads)
        else:
            self._whole = PlainGets(store, reads)
            self._by_segment = (RangeReads(store, reads) if isinstance(store, SupportsRangeReads)
                                else self._whole)
        # A reader of some of each chunk (a tensor-parallel rank's heads): ranged reads, or
        # whole chunks read aside and its ranges copied out where the store has none.
        if partial_reads == "auto":
            partial_reads = "ranges" if _chunks_on_this_host(store) else "whole"
        self._spans: ChunkReads = (
            RangeReads(store, reads) if isinstance(store, SupportsRangeReads)
            and partial_reads == "ranges" else PlainGets(store, reads))
        self._spans_whole = not isinstance(self._spans, RangeReads)  # reads every byte
        if self.io_cpus:  # off the engine's compute cores: the loop, its executor, ChunkIO
            self.io.run_on(self.io_cpus)
            if self.chunk_io is not None:
                self.chunk_io.threads_on(self.io_cpus)
        self._writer = WriteBehindQueue(self.store, self._loop, self._count, save_queue_bytes,
                                        save_delay_s)
        # A connector dropped or left open at exit still finishes its queued saves.
        self._finalizer = weakref.finalize(self, _shutdown, self.io, self._writer,
                                           self._owns_store)

    def __repr__(self) -> str:
        return f"<KVConnector {self.store} ns={self.ns.id}>"

    # -- configuration -------------------------------------------------------------------

    def bind_layout(self, layout: ChunkLayout | EngineLayout) -> None:
        """Fix the chunk layout; the namespace must describe a model's ChunkLayout (or
        chunks would mix). An EngineLayout's namespace is the adapter's to build."""
        wrong = [
            f"{name}={getattr(self.ns, name)!r} (the model needs {want!r})"
            for name, want in (
                ("dtype", layout.dtype), ("layout", layout.name),
                ("chunk_tokens", layout.chunk_tokens),
            )
            if getattr(self.ns, name) != want
        ] if isinstance(layout, ChunkLayout) else []
        if wrong:
            raise ValueError(
                "namespace does not describe this model's KV layout: " + ", ".join(wrong)
                + " (build it with connector.hf.namespace_for(model))"
            )
        self.layout = layout

    def set_namespace(self, ns: Namespace) -> None:
        """Move to another key space (e.g. a new epoch after the engine reset its cache):
        lookups, loads and saves started from now on use `ns`."""
        self.ns = ns

    @property
    def chunk_tokens(self) -> int:
        return self.ns.chunk_tokens

    @property
    def reads_direct(self) -> bool:
        """Whether loads go through the store's direct reads (`gds.ChunkIO`): staging may
        then be any tensor, on any device; otherwise it must be host memory."""
        return self.chunk_io is not None

    def staging_kind(self, device: Any) -> str:
        """Where a load into the engine's KV cache on `device` (a torch device) stages its
        chunks: "device" memory that ChunkIO fills with cuFile or KvikIO; "direct" aligned
        host memory that ChunkIO fills for a CPU cache; else "host" memory (pinned for a
        GPU), which ChunkIO or the store's reads fill and the adapter copies over as it
        places each chunk. A GPU without cuFile or KvikIO stages on the host: ChunkIO's
        bounce buffers into device staging are slower than that
        (docs/benchmarks/2026-11-27-gpu.md)."""
        if self.chunk_io is None:
            return "host"
        if getattr(device, "type", device) != "cuda":
            return "direct"
        if self.layout is not None and self.layout.partial:  # ranged reads land in host memory
            return "host"
        return "device" if self.chunk_io.cuda_backend in ("torch-gds", "kvikio") else "host"

    # -- counters ------------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        """The counters of COUNTERS since start (any thread)."""
        return self._counters.snapshot()

    def count(self, **deltas: float) -> None:
        """Add to counters of COUNTERS that only the engine adapter can see."""
        self._count(**deltas)

    def stats(self) -> dict[str, Any]:
        """Counters since start, plus load GB/s and the policy's current estimates."""
        out: dict[str, Any] = self._counters.snapshot()
        out["load_gbps"] = out["hit_bytes"] / out["load_seconds"] / 1e9 if out["load_seconds"] else 0.0
        out["save_pending_bytes"] = self._writer.pending_bytes
        out["store"] = str(self.store)
        out["namespace"] = self.ns.id
        out["chunk_io"] = self.chunk_io.stats() if self.chunk_io is not None else None
        with self._breaker_lock:
            out.update(self._breaker.snapshot())
        out.update(self.policy.snapshot())
        return out

    # -- the store, from the engine thread -----------------------------------------------

    def _bypassed(self, probe: bool = False) -> bool:
        """Whether to skip the store now. `probe`: this call reports its outcome to the
        breaker (a lookup), so it may be the half-open probe; a load only asks."""
        if self._closed:
            return True
        with self._breaker_lock:
            if self._breaker.allow() if probe else not self._breaker.is_open:
                return False
        self._count(bypassed=1)
        return True

    def _store_answered(self, exc: BaseException | None, what: str = "lookup") -> None:
        """Tell the breaker how a probing call went (None: it succeeded)."""
        with self._breaker_lock:
            if exc is None:
                self._breaker.success()
                return
            if not isinstance(exc, Exception):  # interrupted or cancelled: neither verdict
                self._breaker.release()
                return
            tripped = self._breaker.record(False)
            open_for = self._breaker.open_for_s
        if tripped:
            log.warning("%s on %s failed (%s); bypassing the store for %.0f s",
                        what, self.store, exc or type(exc).__name__, open_for)

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
        """Run a store coroutine on the connector loop and wait at most `timeout` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    # -- lookup --------------------------------------------------------------------------

    def keys(self, token_ids: Any, max_tokens: int | None = None) -> tuple[list[str], np.ndarray]:
        """(chunk keys, token ids) of a prompt's full chunks in this namespace."""
        tokens = token_array(token_ids)
        if max_tokens is not None:
            tokens = tokens[: max(max_tokens, 0)]
        keys = chunk_keys(tokens, self.ns)
        return keys, tokens[: len(keys) * self.chunk_tokens]

    def lookup(self, token_ids: Any, max_tokens: int | None = None) -> int:
        """Tokens of this prompt's prefix the store holds (whole chunks, one batched call);
        waits at most `lookup_timeout_s`."""
        try:
            keys, _ = self.keys(token_ids, max_tokens)
        except ValueError as exc:
            self._count(lookups=1)
            log.warning("lookup skipped: %s", exc)
            return 0
        return self.lookup_async(keys).result() * self.chunk_tokens

    def lookup_async(self, keys: Sequence[str] | Sequence[Sequence[str]]) -> concurrent.futures.Future[int]:
        """Leading chunks of `keys` the store holds, without waiting: one batched call;
        given several key lists (e.g. every worker rank's), the chunks held for all of
        them. The future resolves within `lookup_timeout_s`, to 0 for a failure, a timeout
        or a bypassed store (counted, and the breaker told), never to an exception."""
        self._count(lookups=1)
        lists = ([list(cast(Sequence[str], k)) for k in keys]
                 if keys and not isinstance(keys[0], str) else [cast(list[str], list(keys))])
        now = 0 if not lists[0] or self._bypassed(probe=True) else self._lookup_now(lists)
        if now is None:
            return asyncio.run_coroutine_threadsafe(self._lookup(lists), self._loop)
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        done.set_result(now)
        return done

    def start_lookup(self, lists: Sequence[Sequence[str]], asked_tokens: int, floor_s: float,
                     page_cache: bool = False) -> LookupPoll:
        """`lookup_async` of every key list, to be polled (`LookupPoll`) within the
        patience `lookup_patience_s(asked_tokens, floor_s)`; not sent at all where that
        patience is 0 (a miss, counted as given up), except every `probe_every`-th
        (`LoadPolicy.lookup_probe`), sent to keep the store's lookup time known.
        `page_cache`: also ask, where the store answers on this thread (`lookup_cached`),
        which chunks are all in the page cache now (`LookupPoll.cached`)."""
        now = self.lookup_cached(lists) if page_cache else None
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        if now is not None:
            done.set_result(now[0])
            return LookupPoll(self, done, asked_tokens, floor_s, cached=now[1])
        probe = self.policy.lookup_probe()
        if not probe and self.lookup_patience_s(asked_tokens, floor_s) == 0:
            # A hit found at once would still lose to recompute: the store is not asked
            # (its requests would only compete with the prefill for the host).
            self._count(lookups=1, lookups_given_up=1)
            done.set_result(0)
            return LookupPoll(self, done, asked_tokens, floor_s, asked=False)
        return LookupPoll(self, self.lookup_async(lists), asked_tokens, floor_s, probe=probe)

    def worth_saving(self, tokens: int) -> bool:
        """Whether a prefix of `tokens` is worth storing for readers like this engine
        (`LoadPolicy.worth_saving`: not where its load would take far longer than its
        recompute)."""
        return self.policy.worth_saving(tokens)

    def lookup_patience_s(self, tokens: int, floor_s: float = 0.0, probe: bool = False) -> float:
        """How long a lookup of `tokens` is worth waiting for (`LoadPolicy.lookup_patience_s`:
        once prefill has been timed, recomputing them less their predicted load; the
        whole recompute for a `probe`), and at least `floor_s`; before any prefill was
        timed, until the lookup's timeout (inf here), and so with a policy that loads
        every hit (`adaptive=False`): it weighs nothing against recompute. 0 where the
        predicted load alone takes longer than recompute."""
        patience = self.policy.lookup_patience_s(tokens, probe)
        if patience is None:
            return math.inf
        # A hit that cannot win, even found at once, is not waited for at all.
        return 0.0 if patience <= 0 else max(floor_s, patience)

    def _lookup_now(self, lists: list[list[str]]) -> int | None:
        """`_lookup` on this thread where the store answers here (`prefix_len_now`: a local
        directory, an access(2) per key, where the hop to the loop and back costs the engine
        milliseconds: docs/benchmarks/2026-11-26-vllm.md) and the lookup is short enough
        (LOCAL_LOOKUP_MAX_KEYS); None: ask on the loop."""
        resident = self._here()
        if resident is None or sum(map(len, lists)) > LOCAL_LOOKUP_MAX_KEYS:
            return None
        found = self._ask_here(resident.store.prefix_len_now, lists)
        if found is None:
            return 0
        return None if None in found else self._found(found, lists)

    def _ask_here(self, ask: Callable[[list[str]], Any], lists: list[list[str]]) -> list[Any] | None:
        """`ask(keys)` of every key list, on this thread; None after a failure (counted,
        and the breaker told): no hit."""
        try:
            return [ask(k) for k in lists]
        except Exception as exc:  # noqa: BLE001 - any failure is no hit
            self._store_answered(exc)
            self._count(lookup_errors=1)
            return None

    def lookup_cached(self, keys: Sequence[Sequence[str]]) -> tuple[int, list[bool]] | None:
        """`lookup_async` and `resident` in one pass on this thread, for a local directory
        (one open(2) and cachestat(2) a chunk file, against an access(2) for the lookup and
        an open(2) and cachestat(2) again for `resident`): the leading chunks held for
        every key list (given several, e.g. every worker rank's), and for each of them
        whether its files are all in the page cache now. Counted and told to the breaker
        as `lookup_async`; None for any other store (ask `lookup_async`, then `resident`)."""
        lists = [list(k) for k in keys]
        resident = self._here()
        if (resident is None or not resident.local
                or sum(map(len, lists)) > LOCAL_LOOKUP_MAX_KEYS):
            return None
        self._count(lookups=1)
        if not lists or not lists[0] or self._bypassed(probe=True):
            return 0, []
        found = self._ask_here(resident.store.cached_prefix_now, lists)
        if found is None:
            return 0, []
        n = self._found([len(f) for f in found], lists)
        return n, [all(f[i] for f in found) for i in range(n)]

    async def _lookup(self, lists: list[list[str]]) -> int:
        try:
            async with asyncio.timeout(self.lookup_timeout_s):
                found = await asyncio.gather(*(self.store.prefix_len(k) for k in lists))
        except TimeoutError as exc:
            self._count(lookup_timeouts=1)
            self._store_answered(exc)
            return 0
        except BaseException as exc:
            self._store_answered(exc)
            if not isinstance(exc, Exception):
                raise
            self._count(lookup_errors=1)
            return 0
        return self._found(found, lists)

    def _found(self, found: Sequence[int], lists: list[list[str]]) -> int:
        """A lookup the store answered (`found`: leading chunks stored, per key list): the
        chunks held for every list, counted, and the breaker told."""
        self._store_answered(None)
        n = min(min(max(int(f), 0), len(k)) for f, k in zip(found, lists, strict=True))
        self._count(lookup_tokens=n * self.chunk_tokens)
        return n

    def exists(self, keys: Sequence[str], timeout: float | None = None) -> list[bool]:
        """Which keys the store holds (waits at most `timeout`, default `lookup_timeout_s`);
        all False for a failure or a bypassed store."""
        if not keys or self._bypassed(probe=True):
            return [False] * len(keys)
        try:
            found = self._call(self.store.exists(list(keys)), timeout or self.lookup_timeout_s)
        except BaseException as exc:
            self._store_answered(exc, "existence check")
            if not isinstance(exc, Exception):
                raise
            self._count(lookup_errors=1)
            return [False] * len(keys)
        self._store_answered(None)
        return [bool(f) for f in found]

    def plan(self, cached_tokens: int, chunk_nbytes: int | None = None) -> LoadPlan:
        """How much of a cached prefix is worth loading now (see `connector.policy`);
        `chunk_nbytes` defaults to the bound layout's payload size."""
        if chunk_nbytes is None:
            chunk_nbytes = self._require_layout().staging_nbytes
        plan = self.policy.plan(cached_tokens // self.chunk_tokens, self.chunk_tokens, chunk_nbytes)
        declined = cached_tokens // self.chunk_tokens - plan.chunks
        if declined > 0:
            self._count(declined_tokens=declined * self.chunk_tokens)
        if plan.chunks and self.load_deadline_s is not None:
            plan = dataclasses.replace(plan, deadline_s=self.load_deadline_s)
        return plan

    def load_deadline(self, tokens: int) -> float:
        """How long a load of `tokens` waits for its chunks: `load_deadline_s` where set,
        else the policy's deadline."""
        if self.load_deadline_s is not None:
            return self.load_deadline_s
        return self.policy.deadline_s(tokens)

    @property
    def max_load_wait_s(self) -> float:
        """The longest any load waits: `load_deadline_s`, or the policy's ceiling."""
        return self.load_deadline_s if self.load_deadline_s is not None else self.policy.max_wait_s

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine reports each prefill it ran, so the policy knows what recompute costs."""
        self.policy.observe_prefill(tokens, seconds)
        self._count(prefill_tokens=tokens, prefill_seconds=seconds)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """A load measured elsewhere (e.g. vLLM's workers, reported to its scheduler)."""
        self.policy.observe_load(nbytes, seconds)

    def learn_from(self, counters: dict[str, float]) -> None:
        """The policy learns from counters another process's core counted (vLLM's
        workers report theirs to the scheduler, whose policy plans their loads): how fast
        loads delivered bytes, and how fast the engine computed prompt tokens. Not
        counted again here."""
        # A load is counted as it starts (`loads`) and its bytes and time as it ends, which
        # for a load between steps is a later step's counters: its end is what is learnt.
        # One that placed some of its chunks, not stalled, says little of the store's speed.
        if counters.get("load_seconds") and (
                not counters.get("failed_chunks") or counters.get("load_timeouts")):
            self.policy.observe_load(int(counters.get("hit_bytes", 0)),
                                     float(counters["load_seconds"]),
                                     int(counters.get("hit_tokens", 0)))
        if counters.get("prefill_tokens") and counters.get("prefill_seconds"):
            self.policy.observe_prefill(int(counters["prefill_tokens"]),
                                        float(counters["prefill_seconds"]))

    def prefill_timed(self, timer: PrefillTimer | None) -> None:
        """A stopped `PrefillTimer` of a forward the engine ran (None: none this time):
        observed (`observe_prefill`) once its time is known, with every earlier one now
        known (on a GPU once its kernels are done: never a sync). Any thread."""
        with self._timers_lock:
            if timer is not None:
                self._prefill_timers.append(timer)
            done = list(PrefillTimer.finished(self._prefill_timers))
        for t in done:
            self.observe_prefill(t.tokens, t.seconds())

    def _require_layout(self) -> ChunkLayout | EngineLayout:
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
        n = self.chunk_tokens
        try:
            tokens = token_array(token_ids)
        except ValueError as exc:
            log.warning("load skipped: %s", exc)
            return 0
        n_chunks = min(max(num_tokens, 0), len(tokens)) // n
        if n_chunks == 0:
            return 0
        keys, tokens = self.keys(tokens, n_chunks * n)
        per_chunk = [tokens[i * n : (i + 1) * n] for i in range(n_chunks)]
        handle = self._start_load(keys, per_chunk, target, deadline_s, place_on_io=False)
        if handle.fetch is None:
            return 0
        placed = 0
        wait_s = handle.deadline - handle.started
        try:
            for i in range(n_chunks):
                # The fetch resolves every chunk by the deadline; the margin covers a loop
                # that is itself stuck.
                remaining = max(handle.deadline - time.monotonic(), 0.0) + 1.0
                try:
                    ok = handle.chunks[i].result(timeout=remaining)
                except concurrent.futures.TimeoutError:
                    ok = False
                    handle.stalled = True
                if not ok:
                    if handle.stalled:
                        log.warning("load from %s: chunk %d not there in %.3f s",
                                    self.store, i, wait_s)
                    break
                target.place(i)
                placed += 1
        except Exception as exc:  # noqa: BLE001 - a placement failure is a shorter hit too
            log.warning("placing chunk %d failed: %s", placed, exc)
        finally:
            if placed < n_chunks:
                handle.cancel()
        self._account(handle, placed, n_chunks)
        return placed * n

    def load_async(
        self,
        keys: Sequence[str],
        tokens: Sequence[Any],
        target: LoadTarget,
        deadline_s: float | None = None,
    ) -> LoadHandle:
        """Start loading chunks `keys` (chunk i holds token ids `tokens[i]`) into `target`
        and return a `LoadHandle`; never raises for anything the store does.

        Before it returns, on this thread: the load's deadline is set (`deadline_s`, else
        `load_deadline` of its tokens); every chunk's staging is taken (`target.staging`);
        and where the store is a local directory and `resident_reads` is on, the leading
        chunks whose bytes are all in the page cache are read, verified and placed here
        (`ResidentReads`: straight into `target.destination(i)` where an `InPlaceTarget`
        gives it, else into staging, then `target.place(i)`). The rest are read by the
        store's plan on its loop (`DirectReads` through ChunkIO, else `PlainGets`), each
        verified and placed (`target.place(i)`) on the I/O thread that read it, as it
        lands, in any order. A `LeanTarget` that needs only some ranges of some chunks
        (a sliding-window layer outside the window) has, where ranged reads are in use,
        every chunk read by range instead: its header, then the ranges it needs, each
        checked against its segments, into staging, then placed; nothing else of it is
        read. The leading chunks whose header and those ranges are in the page cache are
        read so here (`ResidentReads`, `read_resident_spans_into`), the rest on the loop
        (`RangeReads`). Past
        the first chunk that cannot be used no further read starts. Chunks not placed by
        the deadline fail, and `handle.stalled` says a read may still write their staging.
        A bypassed store (the breaker), or staging the
        engine cannot give, starts nothing and fails every chunk. Poll `handle.done()`;
        `handle.result()` says which chunks were placed."""
        return self._start_load(list(keys), list(tokens), target, deadline_s, place_on_io=True)

    def read(self, keys: Sequence[str], bufs: Sequence[Any], tokens: Sequence[Any] | None = None,
             timeout: float | None = None) -> list[bool]:
        """Blocking: read, verify and copy each chunk's payload into its buffer (host
        memory, or any tensor when `reads_direct`); per chunk whether it is there. For
        adapters whose engine waits on a background thread (SGLang)."""
        tokens = tokens if tokens is not None else [()] * len(keys)
        handle = self.load_async(keys, tokens, Buffers(bufs), timeout)
        return handle.result(None if timeout is None else timeout + 1.0)

    def load_segments_async(
        self,
        keys: Sequence[str],
        tokens: Sequence[Any],
        target: SegmentTarget,
        deadline_s: float | None = None,
        here: bool = False,
    ) -> SegmentLoad:
        """Start a layer-pipelined load and return at once: every chunk's header is read and
        checked (key, token ids, layout), then every segment's byte range is requested,
        segment-major (segment 0 of every chunk first), at most `max_in_flight` at a time;
        each is verified against its own checksum and placed (`target.place_segment(i, s)`,
        on an I/O thread) as it lands. The engine computes layer s after
        `handle.wait_segment(s)`. A chunk saved without segment checksums (an older chunk),
        or a store without ranged reads (`SupportsRangeReads`), is read and verified whole
        and placed at once. So is every chunk of a store read directly (`reads_direct`) into
        GPU staging, where one read per chunk costs less than a header read and a read per
        layer. A local directory into host memory is read on the layers thread instead
        (`LayerFileReads`), or with `here`, on the calling thread before this returns, from
        the page cache: each chunk in one read, header and every layer, straight into
        its blocks (no staging taken for it); a chunk whose read finds a byte not cached
        is missed (vLLM recomputes it) rather than waited for on the engine's thread (a
        header longer than 4 KiB, and a chunk saved without per-layer checksums, are read
        as before). A chunk that fails stops being read; the deadline fails what is
        left."""
        layout = self._require_layout()
        n_segments = len(layout.read_spans)
        handle = SegmentLoad(len(keys), n_segments, time.monotonic())
        keys, tokens = list(keys), list(tokens)

        def place_all(i: int) -> None:
            for s in range(n_segments):
                target.place_segment(i, s)
                handle.placed(i, s)

        def placed_all(i: int) -> None:  # read straight into the KV cache: nothing to copy
            handle.placed_whole(i)

        def fetch(dests: Sequence[Any]) -> Any:
            files = self._layer_files if self.resident_reads else None
            if files is not None and not for_gpu(dests[0]):
                if here:
                    files.read(keys, tokens, dests, handle, layout, target, place_all,
                               wait=False)
                    return None
                return self._layers_thread().submit(files.read, keys, tokens, dests,
                                                    handle, layout, target, place_all)
            dests = list(dests)  # all staging taken on this thread, before the loop's reads
            first = self._read_here(keys, tokens, dests, layout, place_all,
                                    lambda i, ok: None if ok else handle.fail(i),
                                    target, placed_all)
            if first == len(keys):  # all read and placed whole here
                ok = [f.result() for f in handle.chunks]
                self._account(handle, sum(ok), len(ok))
                return None
            plan = self._spans if layout.partial else self._by_segment
            return plan.fetch_segments(keys, tokens, dests, handle, layout, target,
                                       place_all, first)

        return self._start(handle, target, deadline_s, self.chunk_io is None, fetch, lazy=here)

    def _layers_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._layers is None:
            self._layers = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="kvstash-layers", initializer=run_on, initargs=(self.io_cpus,))
        return self._layers

    def _start_load(self, keys: list[str], tokens: list[Any], target: LoadTarget,
                    deadline_s: float | None, place_on_io: bool) -> LoadHandle:
        layout = self._require_layout()
        handle = LoadHandle(len(keys), time.monotonic())
        placer = target if place_on_io else None
        wanted = self._wanted(target, len(keys), layout)
        if wanted is not None:
            spans = layout.read_spans
            handle.nbytes = [sum(spans[s][1] for s in w) for w in wanted]

        def fetch(dests: Sequence[Any]) -> Coroutine[Any, Any, None] | None:
            # `wanted`: each chunk's ranges the engine needs, nothing else.
            first = self._read_here(keys, tokens, dests, layout,
                                    None if placer is None else placer.place,
                                    lambda i, ok: _resolve(handle.chunks[i], ok), placer,
                                    wanted=wanted)
            if first == len(keys):  # all read here: no hop through the loop
                if placer is not None:
                    ok = [f.result() for f in handle.chunks]
                    self._account(handle, sum(ok), len(ok))
                return None
            plan = self._spans if layout.partial or wanted is not None else self._whole
            return plan.fetch(keys, tokens, dests, handle, layout, placer, first, wanted)

        return self._start(handle, target, deadline_s, self.chunk_io is None, fetch)

    def _wanted(self, target: LoadTarget, n: int, layout: ChunkLayout | EngineLayout
                ) -> list[list[int]] | None:
        """Per chunk, the ranges of it a `LeanTarget` needs, where ranged reads are in use
        (`partial_reads`) and some chunk needs fewer than all; None: the load reads as
        any other (whole chunks, or this reader's ranges of every one)."""
        ask = getattr(target, "wanted", None)  # LeanTarget's runtime check, without its cost
        if self._spans_whole or not callable(ask):
            return None
        every = list(range(len(layout.read_spans)))
        wanted = [every if (w := ask(i)) is None else list(w) for i in range(n)]
        return wanted if any(len(w) < len(every) for w in wanted) else None

    def resident(self, keys: Sequence[str]) -> bool:
        """Whether every chunk of `keys` would be read from the page cache on the thread that
        loads it (`resident_reads`, a local file:// directory, every byte cached now): an
        adapter may then load them within the engine step instead of between steps. A
        cheap check on this thread (no data is read)."""
        resident = self._here()
        return bool(keys) and resident is not None and resident.all_resident(keys)

    def _here(self) -> ResidentReads | None:
        """The page-cache plan, where the store has one and `resident_reads` is on."""
        return self._resident if self.resident_reads else None

    def _read_here(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
                   layout: ChunkLayout | EngineLayout, place: Callable[[int], None] | None,
                   settle: Callable[[int, bool], None], target: Any = None,
                   placed: Callable[[int], None] | None = None,
                   wanted: list[list[int]] | None = None) -> int:
        """`ResidentReads.read_here` of the leading chunks, for host staging (one target's
        staging is all for the GPU, or none); 0 where there is no such plan. A reader of
        part of each chunk (`layout.partial`) is read here only by `wanted` ranges."""
        resident = self._here()
        if (resident is None or not keys or (layout.partial and wanted is None)
                or for_gpu(dests[0])):
            return 0
        return resident.read_here(keys, tokens, dests, layout, place, settle, target, placed,
                                  wanted)

    def _start(self, handle: H, target: LoadTarget, deadline_s: float | None,
               host: bool, fetch: Callable[[Sequence[Any]], Any], lazy: bool = False) -> H:
        """Start `handle`'s load: its deadline (default: the policy's), every chunk's staging
        (`host`: as host memory), then `fetch(staging)`, a coroutine run on the loop (None:
        `fetch` did the whole load itself; a future: it runs on the layers thread). A load
        that cannot start (nothing to load, the store bypassed, no staging memory) fails
        every chunk. `lazy`: each chunk's staging is taken when `fetch` first asks for it
        (a chunk read straight into place takes none), and a failure to take it fails the
        load there."""
        n_chunks = len(handle.chunks)
        if n_chunks == 0 or self._bypassed():
            handle.cancel()
            return handle
        wait_s = (self.load_deadline(n_chunks * self.chunk_tokens)
                  if deadline_s is None else deadline_s)
        handle.deadline = handle.started + wait_s
        try:
            dests: Sequence[Any] = _Staging(target, n_chunks, host)
            if not lazy:
                dests = list(dests)
        except Exception as exc:  # noqa: BLE001 - the engine could not give us memory: recompute
            log.warning("load skipped: no staging memory: %s", exc)
            handle.cancel()
            return handle
        self._count(loads=1)
        try:
            work = fetch(dests)
        except Exception as exc:  # noqa: BLE001 - lazy staging the engine could not give
            if not lazy:
                raise
            log.warning("load skipped: no staging memory: %s", exc)
            handle.cancel()
            return handle
        if work is None:
            handle.fetch = concurrent.futures.Future()
            handle.fetch.set_result(None)
        elif isinstance(work, concurrent.futures.Future):  # running on the layers thread
            handle.fetch = work
        else:
            handle.fetch = asyncio.run_coroutine_threadsafe(work, self._loop)
        return handle

    def _account(self, handle: LoadHandle, placed: int, planned: int) -> None:
        """Counters and the policy's store speed, once a load has its answer."""
        layout = self._require_layout()
        elapsed = time.monotonic() - handle.started
        # what this reader read of each chunk: its ranges, or all of it where read whole
        if handle.nbytes is not None:  # the ranges each chunk's engine needed
            got = [i for i, f in enumerate(handle.chunks)
                   if f.done() and not f.cancelled() and f.result()][:placed]
            nbytes = sum(handle.nbytes[i] for i in got)
        else:
            nbytes = placed * (layout.payload_nbytes if self._spans_whole and layout.partial
                               else layout.staging_nbytes)
        if placed == planned or handle.stalled:
            self.policy.observe_load(nbytes, elapsed)
        self._count(hit_tokens=placed * self.chunk_tokens, hit_bytes=nbytes,
                    load_seconds=elapsed, loaded_chunks=placed,
                    failed_chunks=planned - placed, load_timeouts=int(handle.stalled))

    # -- save ----------------------------------------------------------------------------

    def save(
        self, token_ids: Any, payload: Callable[[int], Any], start_tokens: int = 0
    ) -> int:
        """Queue this prompt's full chunks from `start_tokens` on for write-behind.

        `payload(i)` returns chunk i's bytes in the bound layout; it runs later on a worker
        thread, so it must read KV that the engine will not overwrite. Returns the number
        of chunks queued (the rest were dropped: queue full). Never blocks on storage.
        """
        n = self.chunk_tokens
        try:
            keys, tokens = self.keys(token_ids)
        except ValueError as exc:
            log.warning("save skipped: %s", exc)
            return 0
        first = max(start_tokens, 0) // n
        return self.save_chunks(
            keys[first:], [tokens[i * n : (i + 1) * n] for i in range(first, len(keys))],
            payload, first=first,
        )

    def save_chunks(self, keys: Sequence[str], tokens: Sequence[Any],
                    payload: Callable[[int], Any], *, first: int = 0) -> int:
        """Queue chunks by key for write-behind: chunk `first + j` has key `keys[j]`, token
        ids `tokens[j]` and payload `payload(first + j)` (called later on a worker thread).
        Returns the number of chunks queued (the rest were dropped: queue full)."""
        if not keys or self._closed:
            return 0
        return self._writer.submit(self._job(keys, tokens, payload, first))

    def write(self, keys: Sequence[str], tokens: Sequence[Any] | None,
              payload: Callable[[int], Any], *, check_store: bool = True,
              urgent: bool = False) -> concurrent.futures.Future[list[bool]]:
        """`save_chunks` with an answer: the future resolves, once the queue has written
        them, to whether each chunk is in the store (written, or already there); a chunk
        the queue had no room for, or that failed, is False. For engines that track their
        offload jobs (vLLM's offloading tier, SGLang's backup thread). `check_store`
        False: a lookup has just found these chunks missing, so write-behind does not
        ask the store which of them exist before writing (one request a chunk fewer on
        S3). `urgent`: the caller waits for the answer, so the job does not wait out
        `save_delay_s`."""
        job = self._job(keys, [()] * len(keys) if tokens is None else tokens, payload, 0)
        job.check_store, job.urgent = check_store, urgent
        done: concurrent.futures.Future[list[bool]] = concurrent.futures.Future()
        job.done = done
        if self._closed:
            done.set_result([False] * len(keys))
            return done
        with self._writing_lock:
            self._writing.update(dict.fromkeys(job.keys, done))
        done.add_done_callback(functools.partial(self._written, job.keys))
        self._writer.submit(job)
        return done

    def writing(self, key: str) -> concurrent.futures.Future[list[bool]] | None:
        """The write (`write`) that holds chunk `key` while it is in flight, else None:
        an adapter that would save the same chunk again (another request of the same
        prefix) waits for that write or leaves the chunk to it."""
        with self._writing_lock:
            return self._writing.get(key)

    def _written(self, keys: list[str], done: concurrent.futures.Future[list[bool]]) -> None:
        """A write has ended (any thread): its chunks are no longer in flight."""
        with self._writing_lock:
            for key in keys:
                if self._writing.get(key) is done:
                    del self._writing[key]

    def _job(self, keys: Sequence[str], tokens: Sequence[Any], payload: Callable[[int], Any],
             first: int) -> SaveJob:
        layout = self._require_layout()
        return SaveJob(
            keys=list(keys), tokens=[token_array(t) for t in tokens], first=first,
            payload=payload, chunk_nbytes=layout.payload_nbytes, meta=layout.meta(),
            # A canonical payload always carries its segments: readers of some heads need them.
            segments=(tuple(layout.segments) if self.segment_checksums
                      or layout.meta().get("layout") == CANON else ()),
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written (or failed); False on timeout."""
        if self._closed:
            return True
        try:
            self._call(self._writer.join(), timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def flush_store(self, timeout: float | None = None) -> bool:
        """Wait for the store's own write-behind (a tier list's cascade to its lower
        tiers) after `flush`; False on timeout or a failing tier."""
        if self._closed:
            return True
        try:
            self._call(self.store.flush(), timeout)
        except Exception:  # noqa: BLE001 - a timeout or a failing tier: not flushed
            return False
        return True

    @property
    def save_pending_bytes(self) -> int:
        return self._writer.pending_bytes

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run a coroutine on the connector's loop (e.g. a store call from a test or tool)."""
        return self._call(coro, timeout)

    def close(self, close_store: bool = True, timeout: float | None = 30.0) -> None:
        """Finish queued saves (up to `timeout`), then release the loop; the store is
        closed with the last connector of the process that uses it (a store object given
        to the constructor only if `close_store`)."""
        if self._closed:
            return
        if not self.flush(timeout):
            log.warning("closing %s with saves still queued", self.store)
        self._closed = True
        self._finalizer.detach()
        if self._layers is not None:
            self._layers.shutdown(wait=True, cancel_futures=True)
        _shutdown(self.io, self._writer, self._owns_store or close_store,
                  30.0 if timeout is None else timeout)

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


def _shutdown(io: StoreLoop, writer: WriteBehindQueue, close_store: bool,
              timeout: float = 10.0) -> None:
    """Finish a connector's queued saves (bounded by `timeout`) and release its loop."""
    if io.loop.is_closed():
        return
    if threading.current_thread() is not io._thread:  # else collected on its own loop
        for step in (writer.join, writer.stop):
            try:
                asyncio.run_coroutine_threadsafe(step(), io.loop).result(timeout)
            except Exception as exc:  # noqa: BLE001 - shutting down must not raise
                log.warning("connector shutdown: %s", exc or type(exc).__name__)
                break
    io.release(timeout, close_store=close_store)





class _Staging(Sequence[Any]):
    """A load's staging: chunk i's buffer (`host`: as a host memoryview) taken from the
    target when first asked for."""

    def __init__(self, target: LoadTarget, n: int, host: bool):
        self._target, self._host = target, host
        self._bufs: list[Any] = [None] * n

    def __len__(self) -> int:
        return len(self._bufs)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._bufs)))]
        buf = self._bufs[i]
        if buf is None:
            buf = self._target.staging(i)
            self._bufs[i] = buf = host_view(buf) if self._host else buf
        return buf


