"""Page-cache residency for tests: declared, not asked of the kernel, and the few real-kernel checks.

`DeclaredResidency` is a `storage.pagecache.Residency` whose answers a test sets: every
file counts as all in the page cache until the test `drop`s it (or a byte range of it),
and `read_nowait` then answers as the kernel's `preadv(RWF_NOWAIT)` does for bytes that
are not cached (None, nothing read). Files are told apart by device and inode, so a test
drops the very file a store has open, whatever its name points to later. It stands in
for the kernel's page cache, which the suite cannot hold still: the kernel may bring a
dropped file's pages back (readahead, another reader) at any moment, and may keep them
after `POSIX_FADV_DONTNEED`.

`drop_from_page_cache` asks the real kernel, for the few tests that check the kernel
path end to end: each calls `skip_unless_dropped` right before the step under test, which
skips (with the reason) where the kernel kept the pages, and skips again where the step's
outcome shows the kernel brought them back in between (a read with RWF_NOWAIT succeeds,
or cachestat(2) says cached, only for pages in the cache): a test never asserts that the
kernel keeps a page out.
"""

from __future__ import annotations

import os
import threading

import pytest

from storage.file import read_parts_at
from storage.pagecache import all_cached

FileId = tuple[int, int]  # (st_dev, st_ino)


def _file_id(st: os.stat_result) -> FileId:
    return st.st_dev, st.st_ino


class DeclaredResidency:
    """Residency as the test declares it: all cached, but for the ranges dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dropped: dict[FileId, list[tuple[int, int]]] = {}  # [start, end) ranges

    def drop(self, path: str | os.PathLike, offset: int = 0, length: int | None = None) -> None:
        """Count bytes [offset, offset + length) of the file at `path` (to its end, and
        beyond: whatever it grows to, when `length` is None) as not in the page cache."""
        end = 1 << 62 if length is None else offset + length
        with self._lock:
            self._dropped.setdefault(_file_id(os.stat(path)), []).append((offset, end))

    def cache(self, path: str | os.PathLike) -> None:
        """Count every byte of the file at `path` as in the page cache again."""
        with self._lock:
            self._dropped.pop(_file_id(os.stat(path)), None)

    def _cached(self, fd: int, offset: int, length: int) -> bool:
        with self._lock:
            ranges = self._dropped.get(_file_id(os.fstat(fd)), ())
            return not any(start < offset + length and offset < end for start, end in ranges)

    def all_cached(self, fd: int, offset: int, length: int) -> bool | None:
        return self._cached(fd, offset, length)

    def read_nowait(self, fd: int, buffers: list[memoryview], offset: int) -> int | None:
        if not self._cached(fd, offset, sum(b.nbytes for b in buffers)):
            return None
        return read_parts_at(fd, buffers, offset)


def page_cached(path: str | os.PathLike, offset: int = 0, length: int | None = None,
                ) -> bool | None:
    """The kernel's answer: whether every byte of the range (the whole file by default)
    is in the page cache; None: it cannot tell (no cachestat(2): Linux < 6.5)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return all_cached(fd, offset, os.fstat(fd).st_size - offset if length is None else length)
    finally:
        os.close(fd)


def skip_unless_cached(path: str | os.PathLike) -> None:
    """Skip unless the kernel says the whole file is in the page cache now."""
    cached = page_cached(path)
    if cached is None:
        pytest.skip("the kernel cannot say what is in the page cache (cachestat(2))")
    if not cached:
        pytest.skip("the kernel dropped the file's pages before the step under test")


def drop_from_page_cache(path: str | os.PathLike) -> None:
    """Ask the kernel to drop the file's pages (the store fsyncs what it writes, so they
    are clean and may go); whether they went is for `skip_unless_dropped` to say, right
    before the step that depends on it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def skip_unless_dropped(path: str | os.PathLike, offset: int = 0, length: int | None = None,
                        ) -> None:
    """Skip unless the kernel says the range (the whole file by default) is not all in
    the page cache now: it may keep a file's pages after DONTNEED, or bring them back."""
    cached = page_cached(path, offset, length)
    if cached is None:
        pytest.skip("the kernel cannot say what is in the page cache (cachestat(2))")
    if cached:
        pytest.skip("the kernel kept or brought back the file's pages after DONTNEED")


def skip_brought_back() -> None:
    """Skip: the step found in the page cache what the kernel had just said was not."""
    pytest.skip("the kernel brought the file's pages back between the check and the step")
