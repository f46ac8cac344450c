"""`ExitSignals`: on SIGINT/SIGTERM, first finish what this process holds, then stop as before.

Whatever holds data or clients a stop would cut off (an engine's queued saves, a server's
open event streams) runs its action from the signal itself, before the handler that was
there (uvicorn's graceful shutdown, vLLM's, or the default: the process ends by the same
signal). The one place both the engine side (`connector.exit_flush`) and kvserver chain
their handlers. Handlers are set only from the main thread, where Python runs them, and
never over one set from outside Python (`signal.getsignal` answers None for it).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitSignals:
    """`action()` on SIGTERM/SIGINT, before the handlers that were there; `install` once,
    `remove` (or use as a context manager) to put back each handler that is still ours.
    `action` runs in a signal handler: it must be quick and must not wait on a lock the
    interrupted code may hold (hand work to a loop, or do bounded I/O)."""

    def __init__(self, action: Callable[[], None]):
        self.action = action
        self._installed: dict[int, tuple[Any, Any]] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            if previous is None:  # set from outside Python: leave it alone
                continue

            def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
                self.action()
                if callable(previous):
                    previous(signum, frame)
                elif previous == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    signal.raise_signal(signum)

            signal.signal(sig, handler)
            self._installed[sig] = (handler, previous)

    def remove(self) -> None:
        """Undo `install`: each signal's handler that is still ours (another may have
        replaced it since, and restores its own predecessor) goes back to what it was."""
        if threading.current_thread() is threading.main_thread():
            for sig, (handler, previous) in self._installed.items():
                if signal.getsignal(sig) is handler:
                    signal.signal(sig, previous)
        self._installed = {}

    def __enter__(self) -> ExitSignals:
        self.install()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()
