"""Paths 1 and 2 (torch-gds and KvikIO) with cuFile replaced by stand-ins, run on CPU.

No GPU here, so cuFile cannot run: `torch.cuda.gds.GdsFile` and the `kvikio` module are
replaced by stand-ins that open the path they are given and `preadv` into the storage or
buffer they are given (a CPU tensor). Everything around them is the real code a CUDA
destination runs through: which path is opened, the piece offsets into the file and into
the destination's storage (a view that does not start at its storage's first byte), the
short-read check, and how their errors become typed ReadErrors. Like torch's
`gds_load_storage`, the GdsFile stand-in does not report a short read.
"""

from __future__ import annotations

import os
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from gds.backends import KvikioBackend, TorchGdsBackend
from gds.errors import IO, SHORT, ReadError
from gds.fsprobe import DirectIOSupport
from gds.hostio import OpenFile

PIECE = 16 * 1024
OFFSET = 4096 + 5  # a payload that starts past a header, not on a block boundary


def _bytes_of(storage_or_tensor) -> memoryview:
    """Writable host bytes of a CPU storage or tensor (what cuFile would DMA into)."""
    if isinstance(storage_or_tensor, torch.UntypedStorage):
        t = torch.empty(0, dtype=torch.uint8)
        t.set_(storage_or_tensor)
        return memoryview(t.numpy())
    return memoryview(storage_or_tensor.view(torch.uint8).numpy())


class FakeGdsFile:
    """`torch.cuda.gds.GdsFile` without cuFile: opens the path and reads with preadv."""

    paths: list[str] = []
    fail_load = False

    def __init__(self, filename: str, flags: int):
        FakeGdsFile.paths.append(filename)
        self.fd = os.open(filename, flags)

    def load_storage(self, storage, offset: int = 0) -> None:
        if FakeGdsFile.fail_load:
            raise RuntimeError("cuFileRead failed: stand-in I/O error")
        os.preadv(self.fd, [_bytes_of(storage)], offset)  # a short count is not checked

    def __del__(self) -> None:
        os.close(self.fd)


@pytest.fixture
def gds_file(monkeypatch):
    FakeGdsFile.paths = []
    FakeGdsFile.fail_load = False
    monkeypatch.setattr(torch.cuda.gds, "GdsFile", FakeGdsFile)
    return FakeGdsFile


@pytest.fixture
def pool():
    with ThreadPoolExecutor(3) as executor:
        yield executor


def _file(tmp_path, n: int, name: str = "chunk.bin") -> tuple[str, np.ndarray]:
    data = np.random.default_rng(n).integers(0, 256, OFFSET + n, dtype=np.uint8)
    path = tmp_path / name
    path.write_bytes(data.tobytes())
    return str(path), data[OFFSET:]


def _offset_view(n: int) -> torch.Tensor:
    """A bfloat16 destination whose bytes start 6 bytes into its storage, as a flat uint8
    view of it (what ChunkIO hands the backend)."""
    base = torch.zeros(3 + n // 2 + 1, dtype=torch.bfloat16)
    return base[3:].view(torch.uint8)[:n]


@pytest.mark.parametrize("n", [1, PIECE - 1, PIECE, 5 * PIECE + 123])
def test_torch_gds_pieces_land_at_the_right_offsets(tmp_path, pool, gds_file, n):
    path, want = _file(tmp_path, n)
    dest = _offset_view(n)
    assert dest.storage_offset() == 6
    with OpenFile.for_read(path, DirectIOSupport()) as f:
        TorchGdsBackend(pool, PIECE).read(f, OFFSET, dest)
        assert gds_file.paths == [f"/proc/self/fd/{f.fd}"]  # the inode whose header was read
    assert np.array_equal(dest.numpy(), want)
    storage = _bytes_of(dest.untyped_storage())  # nothing written before or after the view
    assert bytes(storage[:6]) == bytes(6) and bytes(storage[6 + n :]) == bytes(storage.nbytes - 6 - n)


def test_torch_gds_reads_the_file_it_opened_even_after_it_was_replaced(tmp_path, pool, gds_file):
    path, want = _file(tmp_path, 3 * PIECE)
    other, _ = _file(tmp_path, 3 * PIECE + 1, "other.bin")
    dest = torch.zeros(3 * PIECE, dtype=torch.uint8)
    with OpenFile.for_read(path, DirectIOSupport()) as f:
        os.replace(other, path)  # the chunk evicted and its name reused after the header read
        TorchGdsBackend(pool, PIECE).read(f, OFFSET, dest)
    assert np.array_equal(dest.numpy(), want)


def test_torch_gds_reports_a_file_cut_short_under_it(tmp_path, pool, gds_file):
    path, _ = _file(tmp_path, 4 * PIECE)
    dest = torch.zeros(4 * PIECE, dtype=torch.uint8)
    with OpenFile.for_read(path, DirectIOSupport()) as f:
        os.truncate(path, OFFSET + 2 * PIECE)  # in place: the stand-in, like torch, says nothing
        with pytest.raises(ReadError) as err:
            TorchGdsBackend(pool, PIECE).read(f, OFFSET, dest)
    assert err.value.reason == SHORT


def test_torch_gds_errors_are_typed(tmp_path, pool, gds_file):
    path, _ = _file(tmp_path, PIECE)
    dest = torch.zeros(PIECE, dtype=torch.uint8)
    gds_file.fail_load = True
    with OpenFile.for_read(path, DirectIOSupport()) as f, pytest.raises(ReadError) as err:
        TorchGdsBackend(pool, PIECE).read(f, OFFSET, dest)
    assert err.value.reason == IO and "stand-in I/O error" in str(err.value)


class _Future:
    def __init__(self, n: int):
        self.n = n

    def get(self) -> int:
        return self.n


def _fake_kvikio(monkeypatch, *, new_api: bool = True, fail: bool = False) -> types.SimpleNamespace:
    """A `kvikio` module without cuFile: CuFile opens the path, pread reads with preadv."""
    seen = types.SimpleNamespace(paths=[], threads=None)

    class CuFile:
        def __init__(self, path: str, flags: str = "r"):
            seen.paths.append(path)
            self.fd = os.open(path, os.O_RDONLY)

        def pread(self, buf, size: int, file_offset: int = 0) -> _Future:
            if fail:
                raise RuntimeError("cuFile error: stand-in")
            return _Future(os.preadv(self.fd, [_bytes_of(buf)[:size]], file_offset))

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            os.close(self.fd)

    def set_threads(name, value):
        seen.threads = (name, value)

    def reset_threads(value):
        seen.threads = ("reset", value)

    defaults = types.ModuleType("kvikio.defaults")
    if new_api:
        defaults.set = set_threads
    else:
        defaults.num_threads_reset = reset_threads
    kvikio = types.ModuleType("kvikio")
    kvikio.CuFile = CuFile
    kvikio.defaults = defaults
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    return seen


@pytest.mark.parametrize("new_api", [True, False])
def test_kvikio_fills_the_destination_and_sizes_its_pool(tmp_path, monkeypatch, new_api):
    seen = _fake_kvikio(monkeypatch, new_api=new_api)
    path, want = _file(tmp_path, 5 * PIECE + 123)
    dest = _offset_view(want.size)
    backend = KvikioBackend(3)
    assert seen.threads == (("num_threads", 3) if new_api else ("reset", 3))
    with OpenFile.for_read(path, DirectIOSupport()) as f:
        backend.read(f, OFFSET, dest)
        assert seen.paths == [f"/proc/self/fd/{f.fd}"]
    assert np.array_equal(dest.numpy(), want)


def test_kvikio_short_reads_and_errors_are_typed(tmp_path, monkeypatch):
    _fake_kvikio(monkeypatch)
    path, _ = _file(tmp_path, 2 * PIECE)
    with OpenFile.for_read(path, DirectIOSupport()) as f:
        os.truncate(path, OFFSET + PIECE)
        with pytest.raises(ReadError) as err:
            KvikioBackend(2).read(f, OFFSET, torch.zeros(2 * PIECE, dtype=torch.uint8))
    assert err.value.reason == SHORT
    _fake_kvikio(monkeypatch, fail=True)
    with OpenFile.for_read(path, DirectIOSupport()) as f, pytest.raises(ReadError) as err:
        KvikioBackend(2).read(f, OFFSET, torch.zeros(PIECE, dtype=torch.uint8))
    assert err.value.reason == IO
