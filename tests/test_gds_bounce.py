"""Path 3's pipeline (file -> bounce slot -> destination), run on CPU.

No GPU here: the slots are plain 4 KiB-aligned host tensors instead of pinned ones, and
the copies are synchronous instead of `non_blocking` on a side stream, so no CUDA events
are recorded. The piece scheduling, slot reuse and byte placement are the same code a
CUDA destination runs through.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

from gds.backends import BounceBackend, BounceSlots
from gds.errors import SHORT, ReadError
from gds.fsprobe import DirectIOSupport
from gds.hostio import OpenFile

PIECE = 16 * 1024


@pytest.fixture
def pool():
    with ThreadPoolExecutor(3) as executor:
        yield executor


@pytest.mark.parametrize("length", [1, PIECE - 1, PIECE, 9 * PIECE + 123])
def test_more_pieces_than_slots_land_in_order(tmp_path, pool, length):
    data = np.random.default_rng(length).integers(0, 256, length + 4096 + 5, dtype=np.uint8)
    path = tmp_path / "chunk.bin"
    path.write_bytes(data.tobytes())
    slots = BounceSlots(2, PIECE, pinned=False)  # 2 slots, up to 10 pieces, 3 threads
    dest = torch.zeros(length, dtype=torch.uint8)
    with OpenFile.for_read(str(path), DirectIOSupport()) as f:
        BounceBackend(pool, PIECE, "auto", slots).read(f, 4096 + 5, dest)
    assert np.array_equal(dest.numpy(), data[4096 + 5 : 4096 + 5 + length])


def test_every_slot_is_returned_even_when_a_read_fails(tmp_path, pool):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * (3 * PIECE))
    slots = BounceSlots(2, PIECE, pinned=False)
    with OpenFile.for_read(str(path), DirectIOSupport()) as f, pytest.raises(ReadError) as err:
        BounceBackend(pool, PIECE, "auto", slots).read(f, 0, torch.empty(6 * PIECE, dtype=torch.uint8))
    assert err.value.reason == SHORT
    held = [slots.acquire() for _ in range(2)]  # would block forever if a slot had leaked
    assert len(held) == 2


def test_device_checksum_reads_back_through_a_slot(pool):
    """The verify=checksum pass for destinations outside host memory: read back, xxh3."""
    data = np.random.default_rng(1).integers(0, 256, 3 * PIECE + 77, dtype=np.uint8)
    slots = BounceSlots(1, PIECE, pinned=False)
    assert slots.device_xxh3(torch.from_numpy(data)) == xxhash.xxh3_64_intdigest(data.tobytes())
