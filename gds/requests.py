"""ChunkIO's request futures: run by a request thread, or by the thread that waits for one.

A caller that submits a read and then blocks in `result()` would otherwise sit idle while a
request thread wakes up to do the work, then wait again to be woken itself: two thread
hand-offs per request, which on a 2-vCPU VM cost about as long as copying a page-cached
16 MiB payload (`kvstash bench gds`, the `submit_chunk(...).result()` row). So a
`Request` that no request thread has started yet when someone calls `result()` or
`exception()` on it is run right there, on the waiting thread, if a slot of the
`max_in_flight` bound is free; the request thread that later dequeues it finds it done.

The bound holds for both kinds of runner: each takes a slot of the same semaphore first
(request threads wait for one, waiting callers only take a free one). Callers that await
(`asyncio.wrap_future`) or use `concurrent.futures.wait` never run requests themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class Request(Future):
    def __init__(self, fn: Callable[[], Any], slots: threading.Semaphore,
                 on_waiter_run: Callable[[], None] | None = None):
        super().__init__()
        self._fn = fn
        self._slots = slots
        self._on_waiter_run = on_waiter_run
        self._claim = threading.Lock()
        self._claimed = False

    def run(self, wait_for_slot: bool = True) -> bool:
        """Run the request unless it is already running, done or cancelled: True if this
        call ran it. A request thread waits for a slot; a waiting caller only takes a free one."""
        if self.done() or not self._slots.acquire(blocking=wait_for_slot):
            return False
        failed: BaseException | None = None
        try:
            with self._claim:
                if self._claimed:
                    return False  # the other runner has it
                self._claimed = True
            if not self.set_running_or_notify_cancel():
                return False  # cancelled while queued
            try:
                result = self._fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter, as an executor does
                failed = exc
        finally:
            self._slots.release()  # the bound is on I/O: done-callbacks run outside it
        if failed is not None:
            self.set_exception(failed)
        else:
            self.set_result(result)
        return True

    def _run_here(self) -> None:
        if self.run(wait_for_slot=False) and self._on_waiter_run:
            self._on_waiter_run()

    def result(self, timeout: float | None = None) -> Any:
        self._run_here()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._run_here()
        return super().exception(timeout)
