"""How the core reads chunks: one read plan per store capability.

`KVConnector` asks the store once, when it is built, what it can do, and keeps one plan
for each way of reading it has, as a reference typed by that capability:

- `ResidentReads` (`SupportsResidentReads`: a local file:// directory): the leading chunks
  whose bytes are all in the page cache (a lean load's: whose header and wanted ranges
  are), read on the thread that starts the load, with no hand-off to an I/O thread; `LayerFileReads`, a local directory's layer-pipelined loads,
  on the layers thread beside the engine's forward (or on the engine's thread before it).
- `DirectReads` (`SupportsDirectReads`: ChunkIO, into buffers on any device), `RangeReads`
  (`SupportsRangeReads`: a header, then each layer's byte range) and `PlainGets` (any
  `Store`: `get_into_many`, `get_into`): what the store's loop reads, whole chunks
  (`fetch`) or layer by layer (`fetch_segments`).

A new capability adds one plan here and one line in `KVConnector.__init__`. Every plan
answers for each chunk exactly once (placed, or failed: counted and logged), never raises
into the engine, and ends a load's account (`ReadContext.account`) when it owns the load's
end. Threads: `ResidentReads` runs on the caller's thread, `LayerFileReads` on the layers
thread (or the engine's), the others' coroutines on the store's loop, their `landed`
callbacks on its I/O threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gds.buffers import host_view
from storage.base import Store
from storage.capabilities import (
    NOT_RESIDENT,
    SupportsDirectReads,
    SupportsRangeReads,
    SupportsResidentReads,
)
from storage.codec import ChunkError, ChunkHeader, decode_header

if TYPE_CHECKING:
    from connector.core import LoadHandle, LoadTarget, SegmentLoad, SegmentTarget
    from connector.layout import ChunkLayout, EngineLayout

    Layout = ChunkLayout | EngineLayout

log = logging.getLogger("kvstash.connector")

# At most this much of one load is read on the engine's thread (`ResidentReads`).
RESIDENT_LOAD_BYTES = 256 * 1024**2

# The connector counter for each reason a store gives for a failed read (gds.errors).
MISS_COUNTER = {"corrupt": "verify_failures", "io": "load_errors"}


@dataclass(frozen=True)
class ReadContext:
    """What every plan needs of the core: where to count, how to tell a usable chunk, and
    how to close a load's account (counters and the policy's store speed)."""

    store: Store  # for log lines
    loop: asyncio.AbstractEventLoop
    max_in_flight: int
    count: Callable[..., None]
    account: Callable[[LoadHandle, int, int], None]

    def accept(self, key: str, tokens: Any, buf: memoryview | None, layout: Layout,
               header: ChunkHeader | None) -> bool:
        """Whether a fetched chunk is the one these tokens need. `buf` None: its payload
        was checked by the reader (ChunkIO, the page-cache read) and is not here to check."""
        if header is None:
            self.count(load_misses=1)
            return False
        why = verify(header, key, tokens, buf, layout)
        if why:
            self.count(verify_failures=1)
            log.warning("chunk %s from %s rejected: %s", key, self.store, why)
            return False
        return True

    def usable(self, key: str, tokens: Any, buf: memoryview | None, layout: Layout,
               header: ChunkHeader | None, why: str | None,
               place: Callable[[], None] | None) -> bool:
        """Whether a chunk that landed (`header` None: it did not, for reason `why`) is the
        one these tokens need, placed by `place` if so. Runs on the thread that read it;
        any failure, placement included, is counted and logged: a miss."""
        try:
            if header is None:
                self.count(**{MISS_COUNTER.get(why or "", "load_misses"): 1})
                return False
            if not self.accept(key, tokens, buf, layout, header):
                return False
            if place is not None:
                place()
            return True
        except Exception as exc:  # noqa: BLE001 - any failure is a miss
            self.count(load_errors=1)
            log.warning("chunk %s from %s: %s", key, self.store, exc)
            return False


class ResidentReads:
    """Chunks whose bytes are all in this host's page cache, read, verified and placed on
    the thread that starts the load (`SupportsResidentReads`: a local file:// directory):
    a copy from the page cache costs less than handing the chunk to an I/O thread and its
    answer back, most of all where the engine's threads share one core. Also answers
    lookups there (`prefix_len_now`, `cached_prefix_now`) and `is_resident`."""

    def __init__(self, store: SupportsResidentReads, ctx: ReadContext):
        self.store = store
        self.ctx = ctx
        # A local directory (`prefix_len_now` answers here, and None where a read may wait
        # on a network): its layer-pipelined loads run on the layers thread.
        self.local = store.prefix_len_now([]) is not None

    def all_resident(self, keys: Sequence[str]) -> bool:
        try:
            return all(self.store.is_resident(k) for k in keys)
        except Exception:  # noqa: BLE001 - a malformed key, say: not resident
            return False

    def read_here(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
                  layout: Layout, place: Callable[[int], None] | None,
                  settle: Callable[[int, bool], None], target: Any = None,
                  placed: Callable[[int], None] | None = None,
                  wanted: Sequence[Sequence[int]] | None = None) -> int:
        """Read, verify and `place` the leading chunks all in the page cache, up to
        RESIDENT_LOAD_BYTES, and `settle(i, placed)` each. Where `target` is an
        `InPlaceTarget` that gives chunk i's destination (and `place` is given), the chunk
        is read straight there instead of into its staging buffer, and `placed(i)` runs in
        place of `place(i)`. `wanted` (a `LeanTarget`'s): per chunk, the indices of the
        layout's `read_spans` to read; only those (header and ranges in the page cache)
        are read, each into its place in staging, checked against its segments, then
        `place(i)` (`read_resident_spans_into`). Returns how many leading chunks have their
        answer (all of them once one failed); the rest are read by the loop's plan. The
        caller does not call this for a GPU's staging: its host has the cores to read in
        parallel, and a large hit is bandwidth, not hand-offs
        (docs/benchmarks/2026-11-27-gpu.md)."""
        budget = RESIDENT_LOAD_BYTES
        # What InPlaceTarget's runtime check asks, without its cost.
        in_place = (wanted is None and place is not None
                    and callable(getattr(target, "destination", None)))
        staged = staged_spans(layout) if wanted is not None else []
        for i, key in enumerate(keys):
            parts = None
            try:
                if wanted is not None:
                    runs = merged_spans([staged[s] for s in wanted[i]])
                    nbytes = sum(size for _, size, _ in runs)
                    if budget < nbytes:
                        return i
                    out = host_view(dests[i])
                    got = self.store.read_resident_spans_into(
                        key, [(off, size) for off, size, _ in runs],
                        [out[at : at + size] for _, size, at in runs])
                else:
                    nbytes = layout.payload_nbytes
                    if budget < nbytes:
                        return i
                    parts = target.destination(i) if in_place else None
                    got = self.store.read_resident_into(
                        key, host_view(dests[i]) if parts is None else parts)
            except Exception as exc:  # noqa: BLE001 - the normal path reads it (or fails)
                log.debug("resident read of %s failed: %s", key, exc)
                return i
            if not isinstance(got, tuple):  # NOT_RESIDENT
                return i
            budget -= nbytes
            header, why = got  # the store checked the payload, as direct reads do
            then = place if parts is None else placed
            ok = self.ctx.usable(key, tokens[i], None, layout, header, why,
                                 None if then is None else functools.partial(then, i))
            settle(i, ok)
            self.ctx.count(resident_chunks=1)
            if not ok:
                for later in range(i + 1, len(keys)):
                    settle(later, False)
                return len(keys)
        return len(keys)


class LayerFileReads:
    """A local directory's layer-pipelined loads (`SupportsResidentReads.open_segments`)."""

    def __init__(self, store: SupportsResidentReads, ctx: ReadContext):
        self.store = store
        self.ctx = ctx

    def read(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
             handle: SegmentLoad, layout: Layout, target: SegmentTarget,
             place_all: Callable[[int], None], wait: bool = True) -> None:
        """On the layers thread while the engine computes: every chunk's header, with its
        segment 0 in the same read where it can, then segment 1 of every chunk, then
        segment 2, ..., each checked against its own checksum and placed as it lands, so
        layer s computes while later layers are read. Bytes in the page cache go straight
        into the engine's blocks where the target gives them (`SegmentInPlaceTarget`); any
        read that would wait on the disk goes to the chunk's staging buffer instead, then
        is placed (so nothing lands in the blocks after the load's deadline has let the
        engine recompute them). A chunk that fails is read no further; a cancelled load
        (its deadline) stops before its next read. `wait=False` (on the engine's thread,
        where no layer computes before the others land): a chunk is read whole in one call
        (`SegmentFile.read_all`) where it can be, into every layer's blocks; a chunk with a
        byte that is not in the page cache is missed instead.

        Every line of Python here holds the interpreter lock the engine's thread needs
        between its operations, so this thread makes as few calls as it can
        (docs/benchmarks/2026-11-27-vllm-layers-thread.md)."""
        ctx = self.ctx
        spans = staged_spans(layout)
        wanted = [(off, size) for off, size, _ in spans]
        contiguous = not layout.partial  # the spans are the payload, in order
        in_place = callable(getattr(target, "segment_destination", None))
        whole = in_place and not wait  # no forward waits for layer 0 before the rest
        files: list[Any] = [None] * len(keys)
        by_segment: list[int] = []  # chunks read a segment at a time
        # A target that gives a chunk's blocks in one list (`InPlaceTarget`) is asked once
        # a chunk, not once a layer: the whole payload is then one range of `read_all`.
        destination: Callable[[int], list[memoryview] | None] | None = getattr(
            target, "destination", None)
        if not (whole and contiguous and callable(destination)):
            destination = None

        def staged(i: int, s: int) -> list[memoryview]:
            _, size, at = spans[s]
            return [host_view(dests[i])[at : at + size]]

        def landed(i: int, s: int, ok: Any, parts: list[memoryview] | None) -> None:
            # No destination, or not all cached: staging, then placed.
            if ok is NOT_RESIDENT and (wait or files[i].resident):
                parts, ok = None, files[i].read_span(spans[s][0], staged(i, s))
                if ok is NOT_RESIDENT and wait:  # evicted: `resident` is off, this read waits
                    ok = files[i].read_span(spans[s][0], staged(i, s))
            if ok is not True:
                ctx.count(**{"load_misses" if ok is NOT_RESIDENT else "verify_failures": 1})
                handle.fail(i)
                return
            if parts is None and handle.alive(i):
                target.place_segment(i, s)
            handle.placed(i, s)

        try:
            for i, key in enumerate(keys):
                if not handle.alive(i):
                    continue
                opened = self.store.open_segments(key)
                f, why = opened if isinstance(opened, tuple) else (None, None)
                if f is None:
                    ctx.count(**{MISS_COUNTER.get(why or "", "load_misses"): 1})
                    handle.fail(i)
                    continue
                files[i] = f
                if whole:  # every layer's blocks, then header and layers in one read
                    views = destination(i) if destination is not None else None
                    segments = [views] if views is not None else [
                        target.segment_destination(i, s)  # type: ignore[attr-defined]
                        for s in range(len(spans))]
                    got = (f.read_all(segments) if contiguous and None not in segments
                           else False)
                    if got is None:
                        ctx.count(verify_failures=1)
                        handle.fail(i)
                        continue
                    if got:
                        if ctx.accept(key, tokens[i], None, layout, f.header):
                            handle.placed_whole(i)
                        else:
                            handle.fail(i)
                        continue
                by_segment.append(i)
                parts = (target.segment_destination(i, 0)  # type: ignore[attr-defined]
                         if in_place else None)
                header = f.head(parts or staged(i, 0), wait, spans[0][0])
                if header is NOT_RESIDENT:
                    ctx.count(load_misses=1)
                    handle.fail(i)
                elif header is None:
                    ctx.count(verify_failures=1)
                    handle.fail(i)
                elif not ctx.accept(key, tokens[i], None, layout, header):
                    handle.fail(i)
                elif not header.aligned(wanted):
                    # Saved without segment checksums: read, checked and placed whole (a
                    # reader of part of it cannot check it: a miss).
                    if (contiguous and f.read_payload(host_view(dests[i]))
                            and handle.alive(i)):
                        place_all(i)
                    else:
                        ctx.count(verify_failures=1)
                        handle.fail(i)
                else:
                    parts = parts if f.resident else None
                    landed(i, 0, f.read_span(spans[0][0], parts) if parts is not None
                           else NOT_RESIDENT, parts)
            for s in range(1, len(spans)):
                for i in by_segment:
                    f = files[i]
                    if not handle.alive(i):
                        continue
                    parts = (target.segment_destination(i, s)  # type: ignore[attr-defined]
                             if in_place and f.resident else None)
                    landed(i, s, f.read_span(spans[s][0], parts) if parts is not None
                           else NOT_RESIDENT, parts)
            ctx.count(layered_chunks=sum(f is not None for f in files))
        except Exception as exc:  # noqa: BLE001 - any failure is a miss
            ctx.count(load_errors=1)
            log.warning("layered load from %s failed: %s", ctx.store, exc)
        finally:
            for i in range(len(keys)):
                handle.fail(i)  # no-op for chunks placed whole
            ok = [f.result() for f in handle.chunks]
            ctx.account(handle, sum(ok), len(ok))
            for f in files:
                if f is not None:
                    f.close()


class ChunkReads(Protocol):
    """A plan the store's loop runs: whole chunks (`fetch`) or layer by layer
    (`fetch_segments`), from chunk `first` on (those before have their answer)."""

    def fetch(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
              handle: LoadHandle, layout: Layout, placer: LoadTarget | None,
              first: int, wanted: Sequence[Sequence[int]] | None = None
              ) -> Coroutine[Any, Any, None]: ...

    def fetch_segments(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
                       handle: SegmentLoad, layout: Layout, target: SegmentTarget,
                       place_all: Callable[[int], None],
                       first: int) -> Coroutine[Any, Any, None]: ...


class PlainGets:
    """Any `Store`: each chunk read whole into host staging (`get_into_many`, `get_into`)
    and verified here, on the store's I/O thread that read it."""

    direct = False  # payloads land in host staging, checked here

    def __init__(self, store: Store, ctx: ReadContext):
        self.store = store
        self.ctx = ctx

    async def fetch(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
                    handle: LoadHandle, layout: Layout, placer: LoadTarget | None,
                    first: int, wanted: Sequence[Sequence[int]] | None = None) -> None:
        """Every chunk with one batched store call; each verified as it lands, on the
        store's I/O thread, placed there too when `placer` is given, and its future
        resolved there, so nobody waits on a hop through the loop; past the first chunk
        that cannot be used no further read is started. The deadline resolves what is left
        as failed. `wanted`: per chunk, the indices of the layout's `read_spans` to read
        (`LeanTarget`), by `_fetch_spans`."""
        done = handle.chunks
        if layout.partial or wanted is not None:
            await self._fetch_spans(keys, tokens, dests, handle, layout, placer, first,
                                    wanted)
            return

        def landed(j: int, header: ChunkHeader | None, why: str | None = None) -> bool:
            i = first + j
            ok = self.ctx.usable(
                keys[i], tokens[i], None if self.direct else dests[i], layout, header, why,
                None if placer is None else functools.partial(placer.place, i))
            resolve(done[i], ok)
            return ok

        async def read() -> None:
            await self._read_whole(keys[first:], list(dests[first:]), landed)

        try:
            await self._within(handle, read(), "get")
        finally:
            self._settle(handle, placer)

    def _settle(self, handle: LoadHandle, placer: LoadTarget | None) -> None:
        """At a load's end: every chunk not yet resolved is a miss, and, where this plan
        placed the chunks (`placer`), the load's hits are counted."""
        for f in handle.chunks:
            resolve(f, False)
        if placer is not None:
            ok = [f.result() for f in handle.chunks]
            self.ctx.account(handle, sum(ok), len(ok))

    async def _fetch_spans(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
                           handle: LoadHandle, layout: Layout, placer: LoadTarget | None,
                           first: int, wanted: Sequence[Sequence[int]] | None = None
                           ) -> None:
        """A reader of part of each chunk (`layout.partial`: a tensor-parallel rank's
        heads; `wanted`: per chunk, the indices of those ranges it needs): per chunk its
        header, then its ranges (`_read_spans`), each checked against the segments it
        covers, in their places in staging, and placed. Chunks after the first that
        cannot be used are not read."""
        done = handle.chunks
        staged = staged_spans(layout)
        spans = [staged if wanted is None else [staged[s] for s in wanted[i]]
                 for i in range(len(keys))]
        gate = asyncio.Semaphore(self.ctx.max_in_flight)
        failed = [len(keys)]  # the first chunk that could not be used

        async def one(i: int) -> None:
            ok = False
            async with gate:
                if i < failed[0] and not done[i].done():
                    ok = await self._read_spans(keys[i], tokens[i], dests[i], layout,
                                                spans[i])
            if ok and placer is not None:
                ok = await asyncio.to_thread(self._place, keys[i], placer, i)
            if not ok:
                failed[0] = min(failed[0], i)
            resolve(done[i], ok)

        async def every() -> None:
            await asyncio.gather(*(one(i) for i in range(first, len(keys))))

        try:
            await self._within(handle, every(), "ranged get")
        finally:
            self._settle(handle, placer)

    def _place(self, key: str, placer: LoadTarget, i: int) -> bool:
        try:
            placer.place(i)
            return True
        except Exception as exc:  # noqa: BLE001 - a placement failure is a miss
            self.ctx.count(load_errors=1)
            log.warning("chunk %s from %s: %s", key, self.ctx.store, exc)
            return False

    async def _read_spans(self, key: str, tokens: Any, dest: Any, layout: Layout,
                          spans: list[tuple[int, int, int]]) -> bool:
        """`key`'s chunk read whole, checked, and `spans` of its payload copied into `dest`
        (a store without ranged reads); False on a miss."""
        blob = await self.store.get(key)
        if blob is None:
            self.ctx.count(load_misses=1)
            return False
        view = memoryview(blob).cast("B")
        try:
            header = decode_header(view, key)
        except ChunkError:
            self.ctx.count(verify_failures=1)
            return False
        if not self.ctx.accept(key, tokens, view[header.header_len :], layout, header):
            return False
        payload = view[header.header_len :]
        out = host_view(dest)
        for off, size, at in spans:
            out[at : at + size] = payload[off : off + size]
        return True

    async def _read_whole(self, keys: list[str], dests: list[Any],
                          landed: Callable[..., bool]) -> None:
        await self.store.get_into_many(keys, dests, max_in_flight=self.ctx.max_in_flight,
                                       on_done=landed)

    async def fetch_segments(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
                             handle: SegmentLoad, layout: Layout, target: SegmentTarget,
                             place_all: Callable[[int], None], first: int) -> None:
        """Each chunk read whole, verified and placed at once (no ranged reads here; a
        reader of part of it keeps its ranges: `_read_spans`)."""
        gate = asyncio.Semaphore(self.ctx.max_in_flight)
        if layout.partial:
            spans = staged_spans(layout)

            async def one(i: int) -> None:
                async with gate:
                    ok = handle.alive(i) and await self._read_spans(keys[i], tokens[i], dests[i],
                                                                    layout, spans)
                if ok:
                    await asyncio.to_thread(place_all, i)
                else:
                    handle.fail(i)

            async def every() -> None:
                await asyncio.gather(*(one(i) for i in range(first, len(keys))))

            await self._segments(handle, keys, every())
            return
        await self._segments(handle, keys, self._whole_chunks(
            keys, tokens, dests, handle, layout, place_all, range(first, len(keys)), gate))

    async def _whole_chunks(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
                            handle: SegmentLoad, layout: Layout,
                            place_all: Callable[[int], None], todo: Sequence[int],
                            gate: asyncio.Semaphore) -> None:
        await asyncio.gather(*(self._whole_chunk(keys, tokens, dests, handle, layout,
                                                 place_all, i, gate) for i in todo))

    async def _whole_chunk(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
                           handle: SegmentLoad, layout: Layout,
                           place_all: Callable[[int], None], i: int,
                           gate: asyncio.Semaphore) -> None:
        async with gate:
            if not handle.alive(i):
                return
            header = await self.store.get_into(keys[i], dests[i])
        if self.ctx.accept(keys[i], tokens[i], dests[i], layout, header):
            await asyncio.to_thread(place_all, i)
        else:
            handle.fail(i)

    async def _within(self, handle: LoadHandle, work: Coroutine[Any, Any, None],
                      what: str) -> None:
        """Run `work` until the load's deadline; a failure is counted and logged (a miss)."""
        try:
            async with asyncio.timeout_at(self.ctx.loop.time() + handle.deadline
                                          - time.monotonic()):
                await work
        except TimeoutError:
            handle.stalled = any(not f.done() for f in handle.chunks)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any backend failure is a miss
            self.ctx.count(load_errors=1)
            log.warning("%s from %s failed: %s", what, self.ctx.store, exc)

    async def _segments(self, handle: SegmentLoad, keys: list[str],
                        work: Coroutine[Any, Any, None],
                        tasks: Sequence[asyncio.Future[Any]] = ()) -> None:
        """`_within` for a layer-pipelined load, which this plan ends: chunks not placed
        whole by then fail, and the load's account is closed."""
        try:
            await self._within(handle, work, "layered load")
        finally:
            for t in tasks:
                t.cancel()
            for i in range(len(keys)):
                handle.fail(i)  # no-op for chunks placed whole
            ok = [f.result() for f in handle.chunks]
            self.ctx.account(handle, sum(ok), len(ok))


class RangeReads(PlainGets):
    """`SupportsRangeReads`: a layer-pipelined load reads every chunk's header, then each
    layer's byte range, segment-major (layer 0 of every chunk first), each checked against
    its own checksum and placed as it lands. Whole chunks as `PlainGets`."""

    def __init__(self, store: SupportsRangeReads, ctx: ReadContext):
        assert isinstance(store, Store)
        super().__init__(store, ctx)
        self.ranges = store

    async def _read_spans(self, key: str, tokens: Any, dest: Any, layout: Layout,
                          spans: list[tuple[int, int, int]]) -> bool:
        """The header, then each of `spans` ranged into its place in `dest`, each checked
        against the segments it covers (nothing else of the chunk is read). Spans that
        follow each other in the payload and in staging are read as one range."""
        ctx = self.ctx
        header = await self.ranges.read_header(key)
        if not ctx.accept(key, tokens, None, layout, header):
            return False
        assert header is not None
        if not header.aligned([(off, size) for off, size, _ in spans]):
            ctx.count(verify_failures=1)
            log.warning("chunk %s from %s rejected: no segment checksums for its ranges",
                        key, ctx.store)
            return False
        out = host_view(dest)
        runs = merged_spans(spans)
        got = await asyncio.gather(*(
            self.ranges.read_range_into(key, header, off, out[at : at + size])
            for off, size, at in runs))
        if not all(got):
            ctx.count(load_misses=1)
            return False
        try:
            for off, size, at in runs:
                header.verify_span(off, out[at : at + size])
        except ChunkError as exc:
            self._rejected(key, exc)
            return False
        return True

    def _rejected(self, key: str, exc: ChunkError) -> None:
        """A range of `key` failed its checksums: counted, logged, and told to a store
        that quarantines what its readers reject (a file:// directory's `record_read`),
        so the chunk is written again, whole, by the next engine that computes it."""
        self.ctx.count(verify_failures=1)
        log.warning("chunk %s from %s rejected: %s", key, self.ctx.store, exc)
        record = getattr(self.ranges, "record_read", None)
        if callable(record):
            try:
                record(key, None, corrupt=str(exc))
            except Exception as err:  # noqa: BLE001 - a quarantine that fails: still a miss
                log.warning("chunk %s from %s not quarantined: %s", key, self.ctx.store, err)

    async def fetch_segments(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
                             handle: SegmentLoad, layout: Layout, target: SegmentTarget,
                             place_all: Callable[[int], None], first: int) -> None:
        if len(layout.read_spans) == 1 and not layout.partial:  # nothing to read by range
            await super().fetch_segments(keys, tokens, dests, handle, layout, target,
                                         place_all, first)
            return
        ctx, ranges = self.ctx, self.ranges
        spans = staged_spans(layout)
        expected = [(off, size) for off, size, _ in spans]
        gate = asyncio.Semaphore(ctx.max_in_flight)
        tasks: list[asyncio.Future[Any]] = []
        todo = range(first, len(keys))

        async def head(i: int) -> ChunkHeader | None:
            async with gate:
                header = await ranges.read_header(keys[i])
            if not ctx.accept(keys[i], tokens[i], None, layout, header):
                handle.fail(i)
                return None
            return header

        def check_and_place(i: int, s: int, header: ChunkHeader) -> bool:
            off, size, at = spans[s]
            try:
                header.verify_span(off, dests[i][at : at + size])
            except ChunkError as exc:
                self._rejected(keys[i], exc)
                return False
            if handle.alive(i):
                target.place_segment(i, s)
                handle.placed(i, s)
            return True

        async def segment(i: int, s: int, header: ChunkHeader) -> None:
            async with gate:
                if not handle.alive(i):
                    return
                off, size, at = spans[s]
                ok = await ranges.read_range_into(keys[i], header, off,
                                                  dests[i][at : at + size])
            if not ok:
                ctx.count(load_misses=1)
                handle.fail(i)
            elif not check_and_place(i, s, header):
                handle.fail(i)

        async def read() -> None:
            headers: list[ChunkHeader | None] = [None] * first
            headers += await asyncio.gather(*(head(i) for i in todo))
            for i, h in enumerate(headers):
                if h is not None and not h.aligned(expected):
                    headers[i] = None
                    if layout.partial:  # no checksum for what this reader reads: a miss
                        ctx.count(verify_failures=1)
                        handle.fail(i)
                        continue
                    tasks.append(asyncio.ensure_future(self._whole_chunk(  # no segment checksums
                        keys, tokens, dests, handle, layout, place_all, i, gate)))
            for s in range(len(expected)):  # segment-major: layer 0 of every chunk first
                for i, h in enumerate(headers):
                    if h is not None:
                        tasks.append(asyncio.ensure_future(segment(i, s, h)))
            await asyncio.gather(*tasks)

        await self._segments(handle, keys, read(), tasks)


class DirectReads(PlainGets):
    """`SupportsDirectReads`: ChunkIO reads each chunk whole straight into its staging,
    on any device, and checks its payload there; in a layer-pipelined load too, where one
    read a chunk costs less than a header read and a read per layer."""

    direct = True  # the reader checked each payload; nothing in host memory to check

    def __init__(self, store: SupportsDirectReads, ctx: ReadContext):
        assert isinstance(store, Store)
        super().__init__(store, ctx)
        self.reader = store

    async def _read_whole(self, keys: list[str], dests: list[Any],
                          landed: Callable[..., bool]) -> None:
        await self.reader.read_chunks_into(keys, dests, on_done=landed)

    async def fetch_segments(self, keys: list[str], tokens: list[Any], dests: Sequence[Any],
                             handle: SegmentLoad, layout: Layout, target: SegmentTarget,
                             place_all: Callable[[int], None], first: int) -> None:
        def landed(j: int, header: ChunkHeader | None, why: str | None = None) -> bool:
            i = first + j
            ok = self.ctx.usable(keys[i], tokens[i], None, layout, header, why,
                                 functools.partial(place_all, i))
            if not ok:
                handle.fail(i)
            return ok

        async def read() -> None:
            await self.reader.read_chunks_into(keys[first:], list(dests[first:]),
                                               on_done=landed)

        await self._segments(handle, keys, read())


def staged_spans(layout: Layout) -> list[tuple[int, int, int]]:
    """(payload offset, length, staging offset) of each range a reader of `layout` reads
    (`read_spans`, packed one after the other in its staging)."""
    out, at = [], 0
    for off, size in layout.read_spans:
        out.append((off, size, at))
        at += size
    return out


def merged_spans(spans: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """`spans` ((payload offset, length, staging offset), in order) with each run that
    follows on in both the payload and staging made one span: one read, one check of the
    segments it covers."""
    out: list[tuple[int, int, int]] = []
    for off, size, at in spans:
        if out and out[-1][0] + out[-1][1] == off and out[-1][2] + out[-1][1] == at:
            out[-1] = (out[-1][0], out[-1][1] + size, out[-1][2])
        else:
            out.append((off, size, at))
    return out


def resolve(f: concurrent.futures.Future[bool], ok: bool) -> None:
    """Set a chunk's outcome once: the first word (its read, or the batch's end) stands."""
    try:
        f.set_result(ok)
    except concurrent.futures.InvalidStateError:
        pass


def verify(header: ChunkHeader, key: str, tokens: Any, buf: memoryview | None,
           layout: Layout) -> str | None:
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
