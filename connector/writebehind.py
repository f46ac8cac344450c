"""`WriteBehindQueue`: new chunks go to the store in the background; the engine never waits.

Threading contract: `submit` runs on the engine thread and only does bookkeeping (no I/O,
no copies). One drain task on the connector's event loop takes jobs in order, no sooner
than `start_delay_s` after each was submitted, asks the store which keys already exist
(one batched call; not for a job whose caller knows they are missing), then for each
missing chunk serializes the payload on a worker thread, encodes it and `put`s it. The
queue is bounded in bytes; a job that does not fit keeps its leading chunks that do (a
chunk is only reachable through its predecessors) and the rest are dropped and counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from storage.codec import encode_chunk

log = logging.getLogger("kvstash.connector")


@dataclass
class SaveJob:
    """Chunks of one request to save: chunk `first + j` has key `keys[j]`."""

    keys: list[str]
    tokens: list[np.ndarray]
    first: int
    payload: Callable[[int], Any]  # chunk index -> payload buffer; runs on a worker thread
    chunk_nbytes: int
    meta: dict[str, Any] = field(default_factory=dict)
    # Set for a caller that wants the answer: per chunk, whether the store holds it now.
    done: concurrent.futures.Future[list[bool]] | None = None
    total: int = -1  # chunks asked for (a truncated job answers for the dropped ones too)
    segments: tuple[int, ...] = ()  # per-layer byte lengths: one checksum each in the header
    queued_at: float = 0.0  # time.monotonic() at submit
    # False: the caller knows the chunks were missing (a lookup just said so), and the
    # store is not asked again; one saved meanwhile by another engine is written twice
    # (every backend then keeps one whole chunk: the first, or the second in its place).
    check_store: bool = True
    urgent: bool = False  # its caller waits for the answer: no `start_delay_s`

    def truncate(self, n: int) -> SaveJob:
        return SaveJob(
            self.keys[:n], self.tokens[:n], self.first, self.payload, self.chunk_nbytes,
            self.meta, self.done, len(self.keys) if self.total < 0 else self.total,
            self.segments, self.queued_at, self.check_store, self.urgent,
        )

    def answer(self, stored: list[bool]) -> None:
        if self.done is not None and not self.done.done():
            total = len(self.keys) if self.total < 0 else self.total
            self.done.set_result(stored + [False] * (total - len(stored)))


class WriteBehindQueue:
    def __init__(
        self,
        store: Any,
        loop: asyncio.AbstractEventLoop,
        count: Callable[..., None],
        max_bytes: int,
        start_delay_s: float = 0.0,
    ):
        """`start_delay_s`: how long a job waits after `submit` before its first store call,
        so that the engine step which produced its KV hands its tokens back first instead
        of sharing the interpreter lock with the job's encoding and requests."""
        self.store = store
        self.loop = loop
        self.max_bytes = max_bytes
        self.start_delay_s = start_delay_s
        self._count = count
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._queue: asyncio.Queue[SaveJob | None]
        self._task = asyncio.run_coroutine_threadsafe(self._start(), loop).result()

    async def _start(self) -> asyncio.Task:
        self._queue = asyncio.Queue()
        return asyncio.get_running_loop().create_task(self._drain())

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes

    def submit(self, job: SaveJob) -> int:
        """Queue what fits of `job`; returns the number of chunks accepted (engine thread)."""
        with self._lock:
            room = max(self.max_bytes - self._pending_bytes, 0)
            fits = min(len(job.keys), room // job.chunk_nbytes if job.chunk_nbytes else 0)
            self._pending_bytes += fits * job.chunk_nbytes
        dropped = len(job.keys) - fits
        if dropped:
            self._count(save_drops=dropped, save_dropped_bytes=dropped * job.chunk_nbytes)
        if fits:
            self._count(save_queued=fits)
            job.queued_at = time.monotonic()
            self.loop.call_soon_threadsafe(self._queue.put_nowait, job.truncate(fits))
        else:
            job.answer([])
        return fits

    async def join(self) -> None:
        await self._queue.join()

    async def stop(self) -> None:
        await self._queue.put(None)
        await self._task

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    async def _drain(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                if job is None:
                    return
                wait = job.queued_at + self.start_delay_s - time.monotonic()
                if wait > 0 and not job.urgent:
                    await asyncio.sleep(wait)
                await self._save(job)
            except Exception as exc:  # noqa: BLE001 - nothing from a backend may stop the drain
                self._count(save_errors=1)
                log.warning("write-behind to %s failed: %s", self.store, exc)
            finally:
                self._queue.task_done()

    async def _save(self, job: SaveJob) -> None:
        remaining = len(job.keys)
        stored: list[bool] = []
        try:
            present: Sequence[bool] = (await self.store.exists(job.keys) if job.check_store
                                       else [False] * len(job.keys))
            for j, key in enumerate(job.keys):
                if present[j]:
                    self._count(save_skipped=1)
                else:
                    blob = await asyncio.to_thread(self._encode, job, j)
                    if await self.store.put(key, blob):
                        self._count(saved_chunks=1, saved_bytes=len(blob))
                    else:
                        self._count(save_skipped=1)
                stored.append(True)
                remaining -= 1
                self._release(job.chunk_nbytes)
        finally:
            # A failed job drops its unsaved chunks: without the failed one they are unreachable.
            self._release(remaining * job.chunk_nbytes)
            job.answer(stored)

    @staticmethod
    def _encode(job: SaveJob, j: int) -> bytes:
        payload = job.payload(job.first + j)
        if job.segments:
            return encode_chunk(job.keys[j], job.tokens[j], payload, job.meta,
                                segments=list(job.segments))
        return encode_chunk(job.keys[j], job.tokens[j], payload, job.meta)
