"""`ExitFlush`: an engine process that is told to stop first writes the saves it has queued.

Engines stop their workers without calling the adapter's shutdown (vLLM's OpenAI server,
on SIGINT/SIGTERM, aborts its engine core and kills it within seconds), so the flush runs
from the signal itself, before the handler that was there (which then runs as before),
and again at interpreter exit; each bounded by `timeout_s`. The signals are chained as
kvserver chains its own (`storage.exit_signals.ExitSignals`): only from the main thread,
never over a handler set from outside Python.
"""

from __future__ import annotations

import atexit
import logging
import time
from typing import TYPE_CHECKING

from storage.exit_signals import ExitSignals

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
        self._signals = ExitSignals(self.flush_now)

    def install(self) -> None:
        atexit.register(self.flush_now)
        self._signals.install()

    def remove(self) -> None:
        """Undo `install`: the atexit hook, and each signal handler still ours."""
        atexit.unregister(self.flush_now)
        self._signals.remove()

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
