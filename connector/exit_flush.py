"""`ExitFlush`: an engine process that is told to stop first writes the saves it has queued.

Engines stop their workers without calling the adapter's shutdown (vLLM's OpenAI server,
on SIGINT/SIGTERM, aborts its engine core and kills it within seconds), so the flush runs
from the signal itself, before the handler that was there (which then runs as before),
and again at interpreter exit; each bounded by `timeout_s`. Signal handlers are set only
from the main thread and never over one set from outside Python.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connector.core import KVConnector

log = logging.getLogger("kvstash.connector")


class ExitFlush:
    """Flush `core`'s queued saves (and the store's own write-behind) at exit or on
    SIGTERM/SIGINT, for at most `timeout_s`; `install` once, `remove` at shutdown."""

    def __init__(self, core: KVConnector, timeout_s: float, logger: logging.Logger = log):
        self.core = core
        self.timeout_s = timeout_s
        self.log = logger
        self._handlers: dict[int, tuple[Any, Any]] = {}

    def install(self) -> None:
        atexit.register(self.flush_now)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if previous is None:  # set from outside Python: leave it alone
                continue

            def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                self.flush_now()
                if callable(previous):
                    previous(signum, frame)
                elif previous == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)

            signal.signal(sig, handler)
            self._handlers[sig] = (handler, previous)

    def remove(self) -> None:
        """Undo `install`: the atexit hook, and each signal handler still ours."""
        atexit.unregister(self.flush_now)
        if threading.current_thread() is threading.main_thread():
            for sig, (handler, previous) in self._handlers.items():
                if signal.getsignal(sig) is handler:
                    signal.signal(sig, previous)
        self._handlers = {}

    def flush_now(self) -> None:
        """Write what is queued, within `timeout_s`; one log line either way."""
        pending = self.core.save_pending_bytes
        if not pending:
            return
        deadline = time.monotonic() + self.timeout_s
        flushed = self.core.flush(self.timeout_s)
        if flushed:  # and the cascade of a tier list to its lower tiers
            flushed = self.core.flush_store(max(deadline - time.monotonic(), 0.1))
        if flushed:
            self.log.info("kvstash: flushed %d bytes of queued saves before exit", pending)
        else:
            self.log.warning("kvstash: %d bytes of queued saves not written within "
                             "exit_flush_s=%.1f s; those chunks will be misses",
                             self.core.save_pending_bytes, self.timeout_s)
