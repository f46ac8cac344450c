"""Whether a file's bytes are in this host's page cache, and whether its filesystem is local.

`all_cached(fd, offset, length)` asks the kernel (`cachestat(2)`, Linux >= 6.5, a few
microseconds for a whole chunk) and answers None where it cannot tell (an older kernel,
another OS, a filesystem without a page cache). `preadv(RWF_NOWAIT)` is no substitute: on a
miss it still starts readahead.

`Residency` is the one oracle every reader that plans by the page cache asks (a FileStore's
reads on a caller's thread, its `SegmentFile`s, the O_DIRECT choice of its `gds.ChunkIO`):
"is this byte range cached", and "read it only if it is". `PAGE_CACHE`, the kernel's
answers, is the default; a test hands a store another to declare a chunk resident or not,
so the read plan it checks does not depend on what the kernel keeps.

`filesystem_of(dev)` names a device's filesystem from /proc/self/mountinfo; `is_local`
says whether opening and reading a file there can never wait on a network (NFS, SMB,
FUSE, cluster filesystems are not local: even `open` of a cached file may ask a server).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import Protocol

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_SYS_CACHESTAT = 451  # Linux >= 6.5, one number on every architecture
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# Filesystems whose open, stat and cached reads never leave this host.
LOCAL_FILESYSTEMS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "jfs", "reiserfs",
    "tmpfs", "ramfs", "overlay",
})


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def all_cached(fd: int, offset: int, length: int) -> bool | None:
    """Whether every page of the file range is in the page cache; None: the kernel cannot
    tell (no cachestat(2), or a filesystem without a page cache)."""
    if _libc is None:
        return None
    stat = _CacheStat()
    rng = _CacheRange(offset, length)
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(stat), 0) != 0:
        return None
    pages = (offset + length + _PAGE - 1) // _PAGE - offset // _PAGE
    return stat.nr_cache >= pages


# preadv(RWF_NOWAIT) found a byte not in the page cache, or the kernel takes no such flag.
_NOWAIT_ERRNOS = (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux only
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers a preadv takes


class Residency(Protocol):
    """Which bytes of an open file are in this host's page cache. Called from any thread."""

    def all_cached(self, fd: int, offset: int, length: int) -> bool | None:
        """Whether every byte of the range is cached; None: this oracle cannot tell."""

    def read_nowait(self, fd: int, buffers: list[memoryview], offset: int) -> int | None:
        """Fill `buffers` in order from `offset` with cached bytes only, never waiting on a
        device: the bytes read (fewer where the file ends or a later byte is not cached),
        or None where the first byte is not cached (or such a read cannot be done here).
        Other I/O errors raise OSError."""


class PageCache:
    """The kernel's answers: `cachestat(2)` and `preadv(RWF_NOWAIT)`."""

    def all_cached(self, fd: int, offset: int, length: int) -> bool | None:
        return all_cached(fd, offset, length)

    def read_nowait(self, fd: int, buffers: list[memoryview], offset: int) -> int | None:
        """One `preadv(RWF_NOWAIT)` per IOV_MAX buffers (a chunk read straight into a KV
        cache's blocks takes one buffer per layer, head, K/V and block: over a thousand
        for a large model), the next only after a whole one."""
        if _RWF_NOWAIT is None:
            return None
        done = 0
        for start in range(0, len(buffers), _IOV_MAX):
            batch = buffers[start : start + _IOV_MAX]
            try:
                n = os.preadv(fd, batch, offset + done, _RWF_NOWAIT)
            except OSError as exc:
                if exc.errno in _NOWAIT_ERRNOS:
                    return done or None
                raise
            done += n
            if n < sum(b.nbytes for b in batch):
                break
        return done

    def __repr__(self) -> str:
        return "PAGE_CACHE"


PAGE_CACHE: Residency = PageCache()


def filesystem_of(dev: int) -> tuple[str, str]:
    """(fstype, mount point) for a device number, from /proc/self/mountinfo."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) > 4 and fields[2] == want:
                    return right.split()[0], fields[4]
    except OSError:
        pass
    return "unknown", "?"


def is_local(dev: int) -> bool:
    """Whether the filesystem of device `dev` is a local one (LOCAL_FILESYSTEMS)."""
    return filesystem_of(dev)[0] in LOCAL_FILESYSTEMS
