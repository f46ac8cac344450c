"""Host buffers for chunk payloads: page-aligned, and backed by huge pages where the kernel allows.

Copying a page-cached chunk into memory mapped with 4 KiB pages costs a TLB miss per page,
and under a hypervisor each miss is a two-level page walk: on the 2-core VM in the README a
16 MiB `preadv` into such a buffer ran at 4-5 GB/s, into a huge-page buffer at 10-13 GB/s.
`host_buffer` maps anonymous memory 2 MiB-aligned and asks for transparent huge pages with
`madvise(MADV_HUGEPAGE)` (honoured when THP is `always` or `madvise`, silently ignored
otherwise), so readers that fill staging memory from a store (`get_into`) run at the
faster speed. Memory is zero-filled on first touch, like any fresh allocation.

`unfilled_bytearray` is the blob a store's `get` returns: a bytearray whose bytes the read
then writes, neither zero-filled by Python first nor faulted in 4 KiB at a time. A fresh
buffer above glibc's mmap threshold is new memory on every call, and the kernel's page
faults on it cost several times the copy into it (docs/s3.md); with its 2 MiB-aligned
interior advised for huge pages, one fault maps 2 MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from collections.abc import Callable

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)  # Linux's value (the only caller)

# CPython's public constructor of a bytearray from (NULL, n) leaves its bytes as they are:
# `bytearray(n)` would write all n once more before the reads overwrite them.
_bytearray_from = ctypes.pythonapi.PyByteArray_FromStringAndSize
_bytearray_from.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_bytearray_from.restype = ctypes.py_object


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def unfilled_bytearray(n: int) -> bytearray:
    """A bytearray of `n` bytes with no zero-fill, for a blob whose every byte a read then
    writes (a read that ends early is a miss, and the buffer is dropped unseen). Where it
    spans whole 2 MiB pages, they are advised for transparent huge pages (ignored where
    THP is off)."""
    if n < 0:
        raise ValueError(f"buffer size must be >= 0, not {n}")
    blob: bytearray = _bytearray_from(None, n)
    if _madvise is not None and n >= 2 * HUGE_PAGE:
        at = _address(blob)
        start = at + -at % HUGE_PAGE
        span = (at + n - start) // HUGE_PAGE * HUGE_PAGE
        _madvise(start, span, _MADV_HUGEPAGE)  # an error leaves plain pages: nothing to do
    return blob


def host_buffer(size: int) -> memoryview:
    """A writable, zero-filled byte buffer of `size` bytes, 2 MiB-aligned, THP-advised."""
    if size < 0:
        raise ValueError(f"buffer size must be >= 0, not {size}")
    span = -(-max(size, 1) // HUGE_PAGE) * HUGE_PAGE
    # Over-map by one huge page and start at the first 2 MiB boundary inside the mapping:
    # mmap only promises 4 KiB alignment, and THP needs the virtual range 2 MiB-aligned.
    m = mmap.mmap(-1, span + HUGE_PAGE)
    view = memoryview(m)
    start = -_address(view) % HUGE_PAGE
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None:
        try:
            m.madvise(advise, start, span)
        except OSError:
            pass  # THP disabled or unsupported here: plain pages
    return view[start : start + size]


def _address(view: memoryview | bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
