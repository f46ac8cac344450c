"""Which filesystems take O_DIRECT: decided once per filesystem (device number), then cached.

tmpfs, ramfs and overlayfs are never read with O_DIRECT, whether or not the kernel accepts
the flag (recent kernels accept it on tmpfs, where it only adds a constraint: the data is
memory already). Everywhere else the first file opened on a filesystem settles it: an
`open(O_DIRECT)` that fails with EINVAL, or a direct read that fails with EINVAL, marks the
filesystem buffered-only from then on. The fallback is silent: reads stay correct, a stat
says which way each filesystem went.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass

from storage.pagecache import PAGE_CACHE, Residency, filesystem_of

_BUFFERED_ONLY = frozenset({"tmpfs", "ramfs", "overlay", "devtmpfs", "squashfs", "proc", "sysfs"})
HAS_O_DIRECT = hasattr(os, "O_DIRECT")


@dataclass
class Filesystem:
    dev: int
    fstype: str
    mount: str
    direct: bool | None  # None until the first file on it was opened with O_DIRECT
    cachestat: bool | None = None  # None until cachestat(2) was tried here


class DirectIOSupport:
    """Per-filesystem O_DIRECT verdicts, shared by every reader and writer of one ChunkIO,
    and the page-cache oracle (`residency`) whose answers decide where O_DIRECT is used."""

    def __init__(self, enabled: bool = True, residency: Residency = PAGE_CACHE):
        self.enabled = enabled and HAS_O_DIRECT
        self.residency = residency
        self._lock = threading.Lock()
        self._fs: dict[int, Filesystem] = {}

    def filesystem(self, dev: int) -> Filesystem:
        with self._lock:
            fs = self._fs.get(dev)
        if fs is None:
            fstype, mount = filesystem_of(dev)
            direct = False if (not self.enabled or fstype in _BUFFERED_ONLY) else None
            fs = Filesystem(dev, fstype, mount, direct)
            with self._lock:
                fs = self._fs.setdefault(dev, fs)
        return fs

    def open_direct(self, path: str, dev: int, flags: int) -> int | None:
        """An O_DIRECT descriptor for `path`, or None where its filesystem does not take one."""
        fs = self.filesystem(dev)
        if fs.direct is False:
            return None
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # the filesystem refuses O_DIRECT
                self.refuse(dev)
                return None
            raise
        fs.direct = True
        return fd

    def refuse(self, dev: int) -> None:
        self.filesystem(dev).direct = False

    def stats(self) -> dict[str, dict]:
        with self._lock:
            return {
                fs.mount: {"fstype": fs.fstype, "direct": fs.direct, "cachestat": fs.cachestat}
                for fs in self._fs.values()
            }
