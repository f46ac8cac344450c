"""CUDA destinations through every usable backend. These need a GPU: they are skipped on
hosts without CUDA (this project's CI machine has none, so they have not run there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gds import ChunkIO, IOConfig, probe
from gds.errors import CORRUPT, ReadError
from tests.gds_fixtures import payload, write_chunk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _usable(tmp_path) -> list[str]:
    caps = probe(str(tmp_path))
    return [name for name, ok in (("torch-gds", caps.torch_gds), ("kvikio", caps.kvikio),
                                  ("bounce", True)) if ok]


@pytest.mark.parametrize("verify", ["header", "checksum"])
def test_every_usable_backend_fills_a_cuda_tensor_byte_for_byte(tmp_path, ns, verify):
    data = payload(9 * 1024 * 1024 + 123)
    path, key, tokens = write_chunk(tmp_path, ns, 0, data)
    for name in _usable(tmp_path):
        dest = torch.zeros(data.size // 2 + 1, dtype=torch.bfloat16, device="cuda")
        with ChunkIO(IOConfig(verify=verify, cuda_backend=name), probe_dir=tmp_path) as io:
            header = io.submit_chunk(path, dest, key=key, token_ids=tokens).result()
            assert io.stats()["counters"].get(f"bytes_{name}") == data.size
        got = dest.view(torch.uint8)[: data.size].cpu().numpy()
        assert header.payload_len == data.size and np.array_equal(got, data), name


def test_checksum_mode_catches_a_flipped_byte_on_the_device_path(tmp_path, ns):
    data = payload(1024 * 1024)
    path, key, _ = write_chunk(tmp_path, ns, 0, data)
    blob = bytearray(path.read_bytes())
    blob[-7] ^= 0x10
    path.write_bytes(bytes(blob))
    for name in _usable(tmp_path):
        dest = torch.empty(data.size, dtype=torch.uint8, device="cuda")
        with ChunkIO(IOConfig(cuda_backend=name), probe_dir=tmp_path) as io:
            with pytest.raises(ReadError) as err:
                io.submit_chunk(path, dest, key=key).result()
        assert err.value.reason == CORRUPT, name


def test_a_cuda_tensor_is_written_as_a_chunk(tmp_path, ns):
    data = payload(3 * 1024 * 1024 + 5)
    src = torch.from_numpy(data).cuda()
    with ChunkIO(probe_dir=tmp_path) as io:
        assert io.submit_write(tmp_path / "c.kv", "0" * 16 + "/" + "1" * 32, [1, 2, 3], src).result()
        dest = torch.empty(data.size, dtype=torch.uint8)
        io.submit_chunk(tmp_path / "c.kv", dest).result()
    assert np.array_equal(dest.numpy(), data)
