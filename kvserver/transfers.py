"""Request and chunk bytes through pooled buffers: a PUT's body received into a lent
buffer, a lookup's body read bounded, a GET's chunk read into a lent buffer or opened as
its file; every body bounded in size and time and charged to the byte budget.

Each call hands back what it lent on every path, cancellation included (kvserver.bodies
for the pools, kvserver.admission for the budget).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from kvserver.admission import BodyBudget, BodyCharge, read_body
from kvserver.bodies import BufferPool
from kvserver.metrics import ServerMetrics
from storage.base import BlobFile, Store
from storage.capabilities import SupportsBlobFiles


def _keep(reuse: bool = True) -> None:
    return None


@dataclass
class Fetched:
    """A chunk in hand: a view of a lent buffer, or its open file (no copy at all)."""

    body: memoryview | BlobFile
    total: int
    # Gives the buffer back, or closes the file: call once, after the response is sent.
    release: Callable[[], None]


class Transfers:
    """The buffer pools, the byte budget and the body deadlines, built once at start-up."""

    def __init__(self, max_chunk_bytes: int, budget: BodyBudget, metrics: ServerMetrics,
                 stall_s: float, total_s: float):
        self.max_chunk_bytes = max_chunk_bytes
        self.budget = budget
        self.metrics = metrics
        self.gets = BufferPool(max_bytes=max_chunk_bytes)  # GET bodies, see kvserver.bodies
        self.puts = BufferPool(max_bytes=max_chunk_bytes)  # and PUT bodies
        self.stall_s = stall_s
        self.total_s = total_s

    @asynccontextmanager
    async def chunk_body(self, request: Request, tenant: str) -> AsyncIterator[memoryview]:
        """The PUT body, in a lent buffer until the block ends. Stores do not keep a body
        past `put` (the Store contract), so the buffer is lent again after."""
        charge = BodyCharge(self.budget, tenant)
        release: Any = _keep
        reuse = True

        def pooled(size: int) -> memoryview:
            # A pooled huge-page buffer (kvserver.bodies), taken once the first byte is in:
            # fresh memory per body costs more than the copy into a reused buffer
            # (docs/benchmarks/2026-11-22-kvserver.md, PUT before and after pooling).
            nonlocal release
            buf, release = self.puts.borrow(size)
            return buf[:size]

        try:
            yield await read_body(request, self.max_chunk_bytes, charge, what="chunk",
                                  buffer=pooled, stall_s=self.stall_s, total_s=self.total_s)
        except asyncio.CancelledError:
            reuse = False  # a store thread may still be reading the body: never lend it again
            raise
        finally:
            release(reuse)
            charge.release()

    async def small_body(self, request: Request, tenant: str, limit: int, what: str) -> memoryview:
        """A small request body (a lookup's JSON), read here rather than by FastAPI: bounded
        in size and time, after the gate's token check."""
        charge = BodyCharge(self.budget, tenant)
        try:
            return await read_body(request, limit, charge, what=what, stall_s=self.stall_s,
                                   total_s=self.total_s)
        finally:
            charge.release()

    async def fetch(self, store: Store, key: str, zerocopy: bool) -> Fetched | None:
        """The chunk at `key` (None: not stored), counted as a hit or a miss: its open file
        where the transport sends files (`zerocopy`) and the store can vouch for one, else
        read into a lent buffer, else the store's own bytes."""
        buf, release = self.gets.borrow(self.gets.hint)
        try:
            got: memoryview | BlobFile | None
            if not isinstance(store, SupportsBlobFiles):
                blob = await store.get(key)
                got = None if blob is None else memoryview(blob).cast("B")
            elif zerocopy:
                got = await store.open_blob(key, buf)
            else:
                got = await store.get_blob_into(key, buf)
        except BaseException:
            release()
            raise
        if got is None:
            release()
            self.metrics.misses.inc()
            return None
        self.metrics.hits.inc()
        if isinstance(got, BlobFile):
            release()
            return Fetched(got, got.size, got.close)
        self.gets.saw(got.nbytes)
        return Fetched(got, got.nbytes, release)

    def trim(self) -> None:
        """Drop pooled buffers idle past their pool's `idle_s`."""
        self.gets.trim()
        self.puts.trim()

    def pool_stats(self) -> list[dict[str, int]]:
        return [self.gets.stats(), self.puts.stats()]
