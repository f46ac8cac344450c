"""The bytes held under one file:// root, shared by every process and tenant writing there:
a small JSON file, `<root>/.usage`, read and rewritten under an exclusive flock.

It maps each scope of the root ("" for the root's own chunks, a tenant's name for
`tenants/<name>/`, `<scope>/.quarantine` for a quarantine directory) to the bytes of its
files. A writer reserves a chunk's bytes (evicting first, while it holds the lock, where
the reservation would pass the capacity) and gives them back if its file did not land; an
unlink or a move to quarantine is counted by whoever made it succeed. The count therefore
errs only high while a writer dies between its reservation and its link; a scan of the
whole root (at open, and by `kvstash gc`) sets it right again.

NFS: flock is taken on the server over NFSv4 (and emulated with fcntl locks by Linux NFS
clients since 2.6.12); with `local_lock=flock` or `nolock` mounts each host locks only for
itself, and several hosts may each admit one chunk past the capacity at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

LEDGER = ".usage"
QUARANTINE_SCOPE = "/.quarantine"  # appended to a scope's name: its quarantine directory


def quarantine_scope(scope: str) -> str:
    return scope + QUARANTINE_SCOPE


class RootLedger:
    """One root's usage file, locked by one thread of this process at a time (`locked` is
    reentrant within a thread)."""

    def __init__(self, root: Path, mode: int = 0o600):
        self.path = root / LEDGER
        self._mode = mode
        self._fd = self._open()
        self._lock = threading.RLock()
        self._depth = 0
        self.usage: dict[str, int] = {}  # as of the last time this process held the lock
        self.fresh = False  # the file was empty or unreadable when last read: count it anew
        # A flock belongs to the open file, which a forked child shares with its parent:
        # the child opens its own, or the two would never exclude each other.
        reopen = weakref.WeakMethod(self._after_fork)
        os.register_at_fork(after_in_child=lambda: (m := reopen()) is not None and m())

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, self._mode)

    def _after_fork(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = self._open()
        self._lock = threading.RLock()
        self._depth = 0

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, int]]:
        """The usage, to read and change, with the root locked against every other writer."""
        with self._lock:
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                try:
                    self.usage = self._read()
                except BaseException:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                    raise
            self._depth += 1
            try:
                yield self.usage
            finally:
                self._depth -= 1
                if self._depth == 0:
                    try:
                        self._write(self.usage)
                    finally:
                        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _read(self) -> dict[str, int]:
        raw = os.pread(self._fd, 1 << 20, 0)
        try:
            usage = json.loads(raw) if raw else None
        except ValueError:
            usage = None
        if not isinstance(usage, dict) or not all(
                isinstance(k, str) and type(v) is int for k, v in usage.items()):
            self.fresh = True
            return {}
        self.fresh = False
        return usage

    def _write(self, usage: dict[str, int]) -> None:
        data = json.dumps({k: v for k, v in sorted(usage.items()) if v}).encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))

    def total(self) -> int:
        return sum(self.usage.values())

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:  # (not set where opening failed)
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __del__(self) -> None:  # an owner that never closed its store
        self.close()
