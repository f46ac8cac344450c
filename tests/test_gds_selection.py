"""Which backend serves CUDA destinations, decided once from the start-up probe.

No GPU, cuFile or KvikIO exists on the machine these tests run on: presence is simulated by
injecting `Capabilities` (the probe's result) into `choose_cuda_backend` and `ChunkIO`.
Nothing CUDA is touched: CUDA backends are built on first use, and no test uses one.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from gds import Capabilities, ChunkIO, IOConfig, choose_cuda_backend, probe
from gds.backends import BounceSlots
from gds.errors import IO, ReadError
from gds.hostio import OpenFile
from storage.pagecache import filesystem_of as mount_of
from tests.gds_fixtures import cpu_io, payload, shm_directory, write_chunk

NONE = Capabilities()
CUDA_ONLY = Capabilities(cuda=True, notes=("torch-gds: cuFile driver missing", "kvikio: not installed"))
CUDA_KVIKIO = Capabilities(cuda=True, kvikio=True)
CUDA_CUFILE = Capabilities(cuda=True, torch_gds=True)
EVERYTHING = Capabilities(cuda=True, torch_gds=True, kvikio=True)


@pytest.fixture
def shm_dir():
    yield from shm_directory()


@pytest.mark.parametrize(
    ("caps", "chosen"),
    [
        (NONE, None),  # no CUDA: CUDA destinations cannot exist; CPU ones take the host path
        (CUDA_ONLY, "bounce"),  # CUDA without cuFile or KvikIO: pinned bounce buffers
        (CUDA_KVIKIO, "kvikio"),  # KvikIO installed and working, no torch cuFile
        (CUDA_CUFILE, "torch-gds"),  # torch >= 2.7 with a working cuFile
        (EVERYTHING, "torch-gds"),  # torch's cuFile wins over KvikIO
    ],
)
def test_auto_prefers_torch_gds_then_kvikio_then_bounce(caps, chosen):
    assert choose_cuda_backend(caps) == chosen


def test_kvikio_without_cuda_is_never_chosen():
    """KvikIO imports without a GPU but cannot read even into host memory there."""
    assert choose_cuda_backend(Capabilities(cuda=False, kvikio=True)) is None


def test_a_forced_backend_must_be_usable_and_says_why_not():
    assert choose_cuda_backend(EVERYTHING, "bounce") == "bounce"
    assert choose_cuda_backend(EVERYTHING, "kvikio") == "kvikio"
    with pytest.raises(ValueError, match="cuFile driver missing"):
        choose_cuda_backend(CUDA_ONLY, "torch-gds")
    with pytest.raises(ValueError, match="CUDA is not available"):
        choose_cuda_backend(NONE, "bounce")
    with pytest.raises(ValueError, match="expected auto or one of"):
        choose_cuda_backend(EVERYTHING, "nvme-magic")


def test_bad_settings_fail_at_construction():
    for bad in ({"direct": "sometimes"}, {"verify": "maybe"}, {"piece_bytes": 1000},
                {"max_in_flight": 0}):
        with pytest.raises(ValueError):
            ChunkIO(IOConfig(**bad), caps=NONE)
    with pytest.raises(ValueError):
        ChunkIO(IOConfig(cuda_backend="kvikio"), caps=CUDA_ONLY)


@pytest.mark.parametrize(("caps", "chosen"), [(CUDA_ONLY, "bounce"), (CUDA_KVIKIO, "kvikio"),
                                              (EVERYTHING, "torch-gds")])
def test_stats_report_the_choice_and_cpu_reads_still_take_the_host_path(tmp_path, ns, caps, chosen):
    data = payload(10_000)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    with ChunkIO(caps=caps) as io:
        stats = io.stats()
        assert stats["backends"] == {"cpu": "host", "cuda": chosen}
        assert stats["capabilities"]["cuda"] is True
        dest = np.empty(data.size, np.uint8)
        io.submit_chunk(path, dest, key=key).result()
        assert np.array_equal(dest, data)
        assert io.stats()["counters"]["bytes_host"] == data.size


def test_cufile_backends_fall_back_to_bounce_where_o_direct_is_refused(tmp_path, shm_dir, ns):
    """cuFile needs O_DIRECT: on tmpfs, and with direct=never, a CUDA read takes bounce."""
    on_ext4, _, _ = write_chunk(tmp_path, ns, 0, payload(100))
    on_tmpfs, _, _ = write_chunk(shm_dir, ns, 1, payload(100))
    fstype, _ = mount_of(os.stat(tmp_path).st_dev)
    if fstype not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"tmp_path is on {fstype}")
    with ChunkIO(caps=EVERYTHING) as io:
        assert io.cuda_backend_for(on_ext4) == "torch-gds"
        assert io.cuda_backend_for(on_tmpfs) == "bounce"
    with ChunkIO(IOConfig(direct="never"), caps=EVERYTHING) as io:
        assert io.cuda_backend_for(on_ext4) == "bounce"
    with cpu_io() as io:
        assert io.cuda_backend_for(on_ext4) is None


def test_the_real_probe_agrees_with_torch_about_cuda(tmp_path):
    caps = probe(str(tmp_path))
    if not torch.cuda.is_available():
        assert caps.cuda is False and caps.torch_gds is False and caps.kvikio is False
        assert caps.notes
    else:  # a GPU host: what cuFile and KvikIO can do there is for test_gds_cuda.py to use
        assert caps.cuda is True
    assert list(tmp_path.iterdir()) == []  # no probe file left behind


def test_the_probe_without_torch_reports_it(monkeypatch):
    """torch's absence is simulated by hiding the module from the import system."""
    monkeypatch.setitem(sys.modules, "torch", None)
    assert probe() == Capabilities(notes=("torch is not installed",))


class _BrokenCuFile:
    """Stands in for a cuFile backend whose reads fail (no GPU here to make a real one fail)."""

    name = "torch-gds"
    calls = 0

    def read(self, f, offset, dest, ready=None):
        self.calls += 1
        raise ReadError(f.path, IO, "cuFile read: CU_FILE_DRIVER_NOT_INITIALIZED")


def test_a_failing_cufile_read_is_served_by_bounce_and_not_tried_again_there(tmp_path):
    """The bounce slots are plain host memory and the destination a CPU tensor: the
    pipeline is the same one a CUDA destination takes, minus the side stream."""
    data = payload(3 * 64 * 1024 + 5)
    path = tmp_path / "raw.bin"
    path.write_bytes(data.tobytes())
    with ChunkIO(IOConfig(piece_bytes=64 * 1024), caps=EVERYTHING) as io:
        broken = _BrokenCuFile()
        io._device.update({"torch-gds": broken, "slots": BounceSlots(2, 64 * 1024, pinned=False)})
        for _ in range(2):
            dest = torch.zeros(data.size, dtype=torch.uint8)
            with OpenFile.for_read(str(path), io.support) as f:
                assert io._read_device(f, 0, dest, None) == "bounce"
            assert np.array_equal(dest.numpy(), data)
        assert broken.calls == 1
        assert io.stats()["counters"]["cufile_fallbacks"] == 1
        assert io.cuda_backend_for(path) == "bounce"
