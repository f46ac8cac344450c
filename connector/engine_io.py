"""`StoreLoop`: one store driven by an asyncio loop in a daemon thread, shared by engine adapters.

Threading contract. Engines (vLLM's scheduler and workers, SGLang's cache controller)
call their adapters from threads that must never wait on storage. An adapter hands a
coroutine to `submit`, which returns a `concurrent.futures.Future` at once; the store's
coroutines all run on this one loop. `StoreLoop.shared(urls)` gives every adapter in a
process that names the same store URL(s) the same loop and store (so the scheduler and
worker halves of a vLLM connector in one process see one `memory://` store), counted by
references and closed with the last `release()`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from gds.chunkio import run_on
from storage.base import Store
from storage.registry import open_store

log = logging.getLogger("kvstash.connector")

T = TypeVar("T")
StoreSpec = str | Sequence[str]


def store_id(urls: StoreSpec) -> tuple[str, ...]:
    return (urls,) if isinstance(urls, str) else tuple(urls)


async def _cancel_others(grace: float = 1.0) -> None:
    """Cancel every other task of the running loop; wait up to `grace` for them to end."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=grace)


class StoreLoop:
    _shared: dict[tuple[str, ...], StoreLoop] = {}
    _shared_lock = threading.Lock()

    def __init__(self, urls: StoreSpec | Store):
        if isinstance(urls, Store):  # a store object: this loop is its own, not shared
            self.id: tuple[str, ...] = ()
            self.store = urls
        else:
            self.id = store_id(urls)
            # Opening validates the URL(s) now, on the caller's thread: a bad setting fails
            # engine start-up with one clear ConfigError instead of every request missing.
            self.store = open_store(list(self.id))
        self.loop = asyncio.new_event_loop()
        self._refs = 0 if self.id else 1  # shared(): counted there
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kvstash-engine-io", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"<StoreLoop {self.store}>"

    @classmethod
    def shared(cls, urls: StoreSpec) -> StoreLoop:
        """The process-wide loop for these store URL(s); pair every call with `release()`."""
        key = store_id(urls)
        with cls._shared_lock:
            io = cls._shared.get(key)
            if io is None:
                io = cls._shared[key] = cls(key)
            io._refs += 1
            return io

    def run_on(self, cpus: frozenset[int] | None, timeout: float = 5.0) -> None:
        """Move the loop's thread to `cpus` (None: leave it), and with it the threads it
        starts from then on (asyncio's executor: the store's file I/O, save encoding)."""
        if not cpus:
            return
        moved: concurrent.futures.Future[None] = concurrent.futures.Future()

        def move() -> None:
            run_on(cpus)
            moved.set_result(None)

        self.loop.call_soon_threadsafe(move)
        moved.result(timeout)

    def submit(self, fn: Callable[[Store], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Run `fn(store)` on the loop; never blocks the caller."""
        return asyncio.run_coroutine_threadsafe(fn(self.store), self.loop)

    def call(self, fn: Callable[[Store], Coroutine[Any, Any, T]], timeout: float | None) -> T:
        """Run `fn(store)` and wait for it (for background threads and shutdown, not hot paths)."""
        future = self.submit(fn)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def release(self, timeout: float = 30.0, close_store: bool = True) -> None:
        """Drop one reference; the last one flushes and closes the store (unless
        `close_store` is False: a store object its owner closes) and stops the loop."""
        with self._shared_lock:
            self._refs -= 1
            if self._refs > 0:
                return
            if self._shared.get(self.id) is self:
                del self._shared[self.id]
        if self.loop.is_closed():
            return
        if threading.current_thread() is self._thread:  # dropped on its own loop
            self.loop.stop()
            return
        try:
            self.call(lambda store: store.close() if close_store else store.flush(), timeout)
            # Requests still waiting on the store (a lookup to a store that never answers)
            # end here, not as "Task was destroyed but it is pending!" when the loop goes.
            self.call(lambda _: _cancel_others(), timeout)
        except Exception as exc:  # noqa: BLE001 - shutting down must not fail the engine
            log.warning("closing %s: %s", self.store, exc)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.loop.close()
