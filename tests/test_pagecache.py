"""The kernel's residency oracle (`storage.pagecache.PAGE_CACHE`): reads that never wait.

Which pages the kernel keeps cannot be held still in a test, so the answers of the kernel
are stood in for here by a recording `os.preadv`; what is checked is what the oracle asks
of the kernel and how it reads the answers.
"""

from __future__ import annotations

import errno
import os

import pytest

from storage.pagecache import PAGE_CACHE

pytestmark = pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT on this OS")


def recording_preadv(monkeypatch, answer) -> list[tuple]:
    calls: list[tuple] = []

    def preadv(fd, buffers, offset, *flags):
        calls.append((fd, offset, flags))
        if isinstance(answer, OSError):
            raise answer
        return answer

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def test_the_kernels_oracle_reads_with_rwf_nowait_and_says_how_much_it_read(monkeypatch):
    calls = recording_preadv(monkeypatch, 100)
    assert PAGE_CACHE.read_nowait(7, [memoryview(bytearray(4096))], 512) == 100
    assert calls == [(7, 512, (os.RWF_NOWAIT,))]


@pytest.mark.parametrize("code", [errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL])
def test_bytes_not_cached_or_a_kernel_without_the_flag_read_as_not_resident(monkeypatch, code):
    recording_preadv(monkeypatch, OSError(code, os.strerror(code)))
    assert PAGE_CACHE.read_nowait(7, [memoryview(bytearray(16))], 0) is None


def test_other_io_errors_are_raised_for_the_reader_to_count(monkeypatch):
    recording_preadv(monkeypatch, OSError(errno.EIO, "I/O error"))
    with pytest.raises(OSError) as err:
        PAGE_CACHE.read_nowait(7, [memoryview(bytearray(16))], 0)
    assert err.value.errno == errno.EIO


def test_more_buffers_than_one_preadv_takes_are_read_in_turn(tmp_path):
    """A chunk read straight into a KV cache's blocks: one buffer per layer, head, K/V and
    block, over IOV_MAX (1024) for a large model. The real kernel, a file just written
    (its pages cached)."""
    path = tmp_path / "chunk"
    data = os.urandom(1500 * 16)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        if PAGE_CACHE.read_nowait(fd, [memoryview(bytearray(16))], 0) is None:
            pytest.skip("this filesystem answers no RWF_NOWAIT read")
        bufs = [memoryview(bytearray(16)) for _ in range(1500)]
        assert PAGE_CACHE.read_nowait(fd, bufs, 0) == len(data)
        assert b"".join(bytes(b) for b in bufs) == data
    finally:
        os.close(fd)
