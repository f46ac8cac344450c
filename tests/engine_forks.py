"""Engine processes forked from one that has already imported vLLM.

An engine start is mostly Python importing vLLM, torch and transformers. `EngineForks`
starts this module once per test session as a process that imports them and then
waits; each engine run (`tests.vllm_engine_fixtures.run_engine`) is a `fork` of it,
with the run's own environment, log file and process group, that runs the engine
(`_main`) and exits. Every engine is still a process of its own, started fresh from
the test's point of view: nothing of one engine is in another, as the fork is taken
before any engine exists. Ranks beyond one are vLLM's own worker processes, spawned by
the fork (a fresh interpreter each), and an engine whose core runs in a process of its
own (`core_process`) spawns it the same way.

The protocol on the pipes is one JSON object a line: the test side sends
`{"id", "spec", "env", "log"}`; this side answers `{"id", "pid"}` once forked and
`{"id", "rc"}` when that child has exited.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TextIO


class EngineForks:
    """The test side: the forking process, started on first use, and the engine runs
    it answers (from any thread)."""

    def __init__(self, root: Path, env: dict[str, str], log: Path):
        self._log = log
        self._err = open(log, "w")  # noqa: SIM115 (held for the process's life)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.engine_forks"], cwd=root, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
            start_new_session=True)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._waiting: dict[int, queue.Queue[dict[str, Any]]] = {}
        threading.Thread(target=self._answers, daemon=True).start()

    def _answers(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._lock:
                waiting = self._waiting.get(msg["id"])
            if waiting is not None:
                waiting.put(msg)
        with self._lock:  # the forking process is gone: every run still waiting fails
            for waiting in self._waiting.values():
                waiting.put({"gone": True})

    def run(self, spec: dict[str, Any], env: dict[str, str], log: Path, timeout: float) -> int:
        """Run one engine (`spec`, as `_main` takes it) in a fork with `env`, its output
        in `log`; its exit code. Raises TimeoutExpired (the fork and its process group
        killed) or RuntimeError (the forking process died)."""
        answers: queue.Queue[dict[str, Any]] = queue.Queue()
        with self._lock:
            run_id = next(self._ids)
            self._waiting[run_id] = answers
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(
                {"id": run_id, "spec": spec, "env": env, "log": str(log)}) + "\n")
            self._proc.stdin.flush()
        pid = None
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    msg = answers.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    if pid is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired("engine fork", timeout) from None
                if msg.get("gone"):
                    raise RuntimeError("the engine-forking process died:\n"
                                       + self._log.read_text()[-4000:])
                if "pid" in msg:
                    pid = msg["pid"]
                elif "rc" in msg:
                    return int(msg["rc"])
        finally:
            with self._lock:
                self._waiting.pop(run_id, None)

    def close(self) -> None:
        if self._proc.poll() is None and self._proc.stdin is not None:
            self._proc.stdin.close()  # it waits for its children, then exits
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._err.close()


_shared: EngineForks | None = None
_shared_lock = threading.Lock()


def shared_forks(root: Path, env: dict[str, str]) -> EngineForks:
    """The test session's forking process (started on the first call, closed at exit)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._proc.poll() is not None:
            log = Path(tempfile.gettempdir()) / f"kvstash-engine-forks-{os.getpid()}.log"
            _shared = EngineForks(root, env, log)
            atexit.register(_shared.close)
        return _shared


# -- the forking process ------------------------------------------------------------------


def _serve() -> None:
    """Import vLLM, then fork one child per request line until stdin closes; answer on
    the original stdout (this process's own output, vLLM's logging included, goes to
    stderr). One thread: children are reaped between polls of stdin, so no lock is ever
    held by another thread when a fork is taken."""
    answers: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import tests.vllm_engine_fixtures  # noqa: F401

    children: dict[int, int] = {}  # pid -> request id
    pending, stdin_open = b"", True
    while stdin_open or children:
        if stdin_open and select.select([0], [], [], 0.2)[0]:
            data = os.read(0, 1 << 16)
            stdin_open = bool(data)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, answers.fileno())  # never returns
                children[pid] = req["id"]
                answers.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
        elif not stdin_open:
            select.select([], [], [], 0.2)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rc = os.waitstatus_to_exitcode(status)
            answers.write(json.dumps({"id": children.pop(pid), "rc": rc}) + "\n")


def _child(req: dict[str, Any], answers_fd: int) -> None:
    """One engine run in a fork: its own process group (killed whole on a timeout), its
    environment, stdout and stderr to its log; exits with 0 once the engine has written
    its result, 1 on any error (the traceback in the log)."""
    code = 1
    try:
        os.setpgid(0, 0)
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(0)
        os.close(answers_fd)  # the test side sees the forking process end, not its children
        os.environ.clear()
        os.environ.update(req["env"])
        from tests.vllm_engine_fixtures import _main

        _main(req["spec"])
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # vLLM's shutdown hooks, as at a normal exit
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    _serve()
