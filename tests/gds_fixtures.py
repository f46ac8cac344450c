"""Fixtures for the gds tests: chunk files on ext4 and on tmpfs, and CPU-only ChunkIOs."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gds.chunkio import ChunkIO, IOConfig
from gds.probe import Capabilities
from hashing import Namespace, chunk_keys
from storage.codec import encode_chunk
from storage.pagecache import Residency

KiB = 1024
# Small pieces, so a few hundred KiB already spread over several pieces and threads.
PIECE = 64 * KiB


def payload(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def write_chunk(directory: Path, ns: Namespace, index: int, data: np.ndarray,
                ) -> tuple[Path, str, list[int]]:
    """Chunk `index` of namespace `ns` as a file, written with the codec directly (not ChunkIO)."""
    tokens = [index * ns.chunk_tokens + t for t in range(ns.chunk_tokens)]
    key = chunk_keys(tokens, ns)[0]
    path = directory / f"{index}.kv"
    path.write_bytes(encode_chunk(key, tokens, data))
    return path, key, tokens


def cpu_io(residency: Residency | None = None, **config) -> ChunkIO:
    """A ChunkIO as on a host without CUDA (the capabilities are injected, not probed);
    `residency`: its page-cache oracle (None: the kernel's)."""
    config = {"piece_bytes": PIECE, **config}
    return ChunkIO(IOConfig(**config), caps=Capabilities(notes=("injected",)),
                   residency=residency)


def shm_directory() -> Iterator[Path]:
    """A directory on tmpfs (/dev/shm), removed afterwards (use as a fixture body)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    d = Path(tempfile.mkdtemp(prefix="kvstash-gds-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)
