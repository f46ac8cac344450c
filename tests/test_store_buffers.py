"""storage.buffers: the fresh blobs a store's `get` returns and the host buffers it fills."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from storage.buffers import HUGE_PAGE, _address, host_buffer, unfilled_bytearray


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("n", [0, 1, 4095, HUGE_PAGE + 1, 5 * HUGE_PAGE + 17])
def test_an_unfilled_bytearray_has_the_asked_length_and_takes_every_byte(n):
    blob = unfilled_bytearray(n)
    assert isinstance(blob, bytearray) and len(blob) == n
    memoryview(blob)[:] = bytes(range(256)) * (n // 256) + bytes(n % 256)
    assert blob[: min(n, 256)] == bytes(range(min(n, 256)))


def test_a_negative_size_is_refused():
    with pytest.raises(ValueError):
        unfilled_bytearray(-1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")
def test_a_large_blobs_whole_huge_pages_are_advised_for_thp():
    """Every 2 MiB page inside a large blob is in a mapping the kernel marks `hg`
    (MADV_HUGEPAGE), whatever THP's system setting; a small blob's memory is left alone."""
    blob = unfilled_bytearray(9 * HUGE_PAGE + 123)
    start = -_address(blob) % HUGE_PAGE + _address(blob)
    for page in range(start, _address(blob) + len(blob) - HUGE_PAGE + 1, HUGE_PAGE):
        assert "hg" in _vm_flags(page), hex(page)
    small = unfilled_bytearray(64 << 10)
    assert "hg" not in _vm_flags(_address(small))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")
def test_a_host_buffer_is_aligned_zeroed_and_advised():
    view = host_buffer(3 * HUGE_PAGE)
    assert _address(view) % HUGE_PAGE == 0 and view.nbytes == 3 * HUGE_PAGE
    assert not any(view[:: 4096])
    assert "hg" in _vm_flags(_address(view))
