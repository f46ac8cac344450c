"""ExitSignals: a stop signal first runs what the process must finish, then the handler that
was there; the engine side's exit flush and kvserver's stream ending both chain this way."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from storage.exit_signals import ExitSignals

ROOT = Path(__file__).resolve().parent.parent
main_thread_only = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="signal handlers are set from the main thread only")


@main_thread_only
def test_a_stop_signal_runs_the_action_then_the_handler_that_was_there():
    seen: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("previous"))
    try:
        with ExitSignals(lambda: seen.append("action")):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # what the signal runs
            assert seen == ["action", "previous"]
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # removed: the old one alone
        assert seen == ["action", "previous", "previous"]
    finally:
        signal.signal(signal.SIGTERM, previous)


@main_thread_only
def test_remove_leaves_a_handler_set_after_it_alone():
    previous = signal.getsignal(signal.SIGINT)
    hooks = ExitSignals(lambda: None)
    hooks.install()
    try:
        def later(signum: int, frame: object) -> None:
            pass

        signal.signal(signal.SIGINT, later)  # e.g. uvicorn's, which restores its own
        hooks.remove()
        assert signal.getsignal(signal.SIGINT) is later
    finally:
        hooks.remove()
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    hooks = ExitSignals(lambda: None)
    t = threading.Thread(target=hooks.install)
    t.start()
    t.join(10)
    assert signal.getsignal(signal.SIGTERM) is before


def test_over_the_default_handler_the_process_still_ends_by_the_signal():
    code = textwrap.dedent("""
        import os, signal, time
        from storage.exit_signals import ExitSignals
        ExitSignals(lambda: print("finished", flush=True)).install()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("still running", flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.stdout == "finished\n"
    assert run.returncode == -signal.SIGTERM
