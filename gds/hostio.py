"""Blocking reads and writes of one file range in host memory: page cache first, O_DIRECT else.

Read modes (`direct=`):

- "auto": a piece whose pages are all in the page cache (`cachestat(2)`, Linux >= 6.5,
  about 3 us for 16 MiB) is read buffered, at memcpy speed; any other piece is read with
  O_DIRECT, so a cold chunk costs one DMA into the destination, starts no readahead and
  does not evict the hot set. Where the kernel cannot tell, the read is buffered.
  (`preadv(RWF_NOWAIT)` cannot serve as the test: on a miss it still starts readahead.)
- "always": O_DIRECT for every aligned byte, even when cached (cold-read benchmarking).
- "never": plain buffered reads.

O_DIRECT needs the file offset, the length and the buffer address 4 KiB-aligned. A range
that is aligned in the file but whose buffer is not (torch CPU tensors are 64-byte aligned)
is read buffered; unaligned heads and tails around an aligned body are read buffered too.
"""

from __future__ import annotations

import errno
import os
import threading

from gds.buffers import ALIGN, address
from gds.errors import IO, MISSING, NO_SPACE, SHORT, ReadError, WriteError
from gds.fsprobe import DirectIOSupport

DIRECT_MODES = ("auto", "always", "never")
_MISSING_ERRNOS = (errno.ENOENT, errno.ESTALE, errno.ENOTDIR)


def read_error(path: str, exc: OSError) -> ReadError:
    reason = MISSING if exc.errno in _MISSING_ERRNOS else IO
    return ReadError(path, reason, exc.strerror or str(exc))


def write_error(path: str, exc: OSError) -> WriteError:
    reason = NO_SPACE if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else IO
    return WriteError(path, reason, exc.strerror or str(exc))


class OpenFile:
    """One file with a buffered descriptor and, opened on first need, an O_DIRECT one."""

    def __init__(self, path: str, fd: int, flags: int, support: DirectIOSupport):
        self.path = path
        self.fd = fd
        self.flags = flags
        self.support = support
        st = os.fstat(fd)
        self.stat = st
        self.dev = st.st_dev
        self.size = st.st_size
        self._direct_fd: int | None = None
        self._direct_tried = False
        self._direct_refused = False
        self._lock = threading.Lock()

    @classmethod
    def for_read(cls, path: str, support: DirectIOSupport) -> OpenFile:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise read_error(path, exc) from exc
        return cls(path, fd, os.O_RDONLY, support)

    def same_file(self) -> str:
        """A path that opens this very file, whatever its name points to now (an evicted
        chunk, a replaced one): /proc/self/fd/N where /proc is mounted, else the name. The
        O_DIRECT descriptor and cuFile handles are opened by path; this keeps them on the
        inode whose header was checked."""
        proc = f"/proc/self/fd/{self.fd}"
        return proc if os.path.exists(proc) else self.path

    def direct_fd(self) -> int | None:
        with self._lock:
            if not self._direct_tried:
                self._direct_tried = True
                self._direct_fd = self.support.open_direct(self.same_file(), self.dev, self.flags)
            return None if self._direct_refused else self._direct_fd

    def refuse_direct(self) -> None:
        """Stop using O_DIRECT here. The descriptor stays open until close(): another piece
        may be reading through it, and a closed number can be reused by any open()."""
        self.support.refuse(self.dev)
        with self._lock:
            self._direct_refused = True

    def close(self) -> None:
        for fd in (self.fd, self._direct_fd):
            if fd is not None:
                os.close(fd)
        self._direct_fd = None

    def __enter__(self) -> OpenFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pread_loop(fd: int, view: memoryview, offset: int, stop_unaligned: bool = False) -> int:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
        if stop_unaligned and n % ALIGN:
            break  # end of file inside a block: the next direct read would be misaligned
    return done


def _read_direct(f: OpenFile, view: memoryview, offset: int) -> tuple[int, int]:
    """Read the aligned body of the range with O_DIRECT (its short head buffered) ->
    (bytes read from the start of the range, of which by O_DIRECT)."""
    head = -offset % ALIGN
    if view.nbytes - head < ALIGN or (address(view) + head) % ALIGN:
        return 0, 0
    dfd = f.direct_fd()
    if dfd is None:
        return 0, 0
    if head and _pread_loop(f.fd, view[:head], offset) < head:
        return 0, 0
    body = (view.nbytes - head) // ALIGN * ALIGN
    try:
        direct = _pread_loop(dfd, view[head : head + body], offset + head, True)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        f.refuse_direct()  # the filesystem took the flag but not the read: buffered from now
        direct = 0
    return head + direct, direct


def _all_cached(f: OpenFile, offset: int, length: int) -> bool | None:
    """Whether every page of the range is in the page cache (the support's residency
    oracle: `cachestat(2)` by default); None: unknown."""
    fs = f.support.filesystem(f.dev)
    if fs.cachestat is False:
        return None
    cached = f.support.residency.all_cached(f.fd, offset, length)
    fs.cachestat = cached is not None  # None: an older kernel, or no page cache there
    return cached


def read_range(f: OpenFile, view: memoryview, offset: int, mode: str = "auto") -> int:
    """Fill `view` with the file's bytes at `offset` -> how many came by O_DIRECT.
    ReadError if the file ends first."""
    direct = 0
    try:
        done = 0
        use_direct = mode == "always"
        if mode == "auto":
            use_direct = _all_cached(f, offset, view.nbytes) is False
        if use_direct:
            done, direct = _read_direct(f, view, offset)
        if done < view.nbytes:
            done += _pread_loop(f.fd, view[done:], offset + done)
    except OSError as exc:
        raise read_error(f.path, exc) from exc
    if done < view.nbytes:
        raise ReadError(f.path, SHORT, f"{offset + done} of {offset + view.nbytes} bytes present")
    return direct


def _pwrite_loop(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwritev(fd, [view[done:]], offset + done)


def write_range(f: OpenFile, view: memoryview, offset: int, direct: bool) -> None:
    """Write `view` at `offset`: the aligned body with O_DIRECT when asked and allowed."""
    try:
        head = -offset % ALIGN
        body = (view.nbytes - head) // ALIGN * ALIGN if view.nbytes > head else 0
        dfd = None
        if direct and body and (address(view) + head) % ALIGN == 0:
            dfd = f.direct_fd()
        if dfd is None:
            _pwrite_loop(f.fd, view, offset)
            return
        _pwrite_loop(f.fd, view[:head], offset)
        try:
            _pwrite_loop(dfd, view[head : head + body], offset + head)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            f.refuse_direct()
            _pwrite_loop(f.fd, view[head : head + body], offset + head)
        _pwrite_loop(f.fd, view[head + body :], offset + head + body)
    except OSError as exc:
        raise write_error(f.path, exc) from exc
