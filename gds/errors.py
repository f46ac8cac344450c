"""The typed errors of chunk I/O: every failure below `gds/` surfaces as one of these."""

from __future__ import annotations

# Why a read failed; the connector treats all of them as a miss, stats count them apart.
MISSING = "missing"  # ENOENT/ESTALE: the chunk was evicted or never written
SHORT = "short"  # the file ends before the requested range does
IO = "io"  # EIO and every other OSError, or a CUDA/cuFile error
CORRUPT = "corrupt"  # header or payload checksum, key, tokens or length do not match
TOO_SMALL = "too_small"  # the destination cannot hold the payload the header announces
NO_SPACE = "no_space"  # ENOSPC/EDQUOT while writing


class ChunkIOError(Exception):
    """Base of the errors `gds` raises for a failed read or write."""

    def __init__(self, path: str, reason: str, detail: str = ""):
        self.path = str(path)
        self.reason = reason
        self.detail = detail
        super().__init__(f"{self.path}: {reason}" + (f": {detail}" if detail else ""))


class ReadError(ChunkIOError):
    """A range or chunk could not be read into its destination; the connector's miss."""


class WriteError(ChunkIOError):
    """A chunk file could not be written (no space, I/O error); the write is dropped."""
