"""What a store can do beyond the `Store` protocol, declared as small runtime-checkable protocols.

A caller asks `isinstance(store, SupportsX)` instead of testing for a backend class or
reaching for its attributes; a store that lacks the capability is served through the base
protocol (or, in the store contract tests, skipped with the reason).

- `SupportsBlobFiles`: a server sends a verified chunk without copying it through Python
  (`open_blob` may hand over an open file for sendfile(2) or descriptor passing;
  `get_blob_into` fills a reusable buffer). file://, memory://, tiers whose first tier has it.
- `SupportsGC`: `gc(capacity)` evicts down to a bound from a fresh scan (`kvstash gc`).
  file:// and s3://.
- `SupportsChunkFiles`: the store's chunks are files a reader outside it may read directly
  (gds.ChunkIO, straight into device memory): where each key's file is, which files it has
  verified, and how such reads are accounted back to it. file://.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from storage.base import BlobFile, Store
    from storage.codec import ChunkHeader


@runtime_checkable
class SupportsBlobFiles(Protocol):
    async def get_blob_into(self, key: str, out: Any) -> memoryview | None:
        """The verified blob (header + payload) as a byte view, or None on a miss; `out` (a
        writable buffer, used when it holds the whole blob) may back the view, which is
        valid only until `out` is reused."""

    async def open_blob(self, key: str, out: Any) -> memoryview | BlobFile | None:
        """The verified blob for sending, or None on a miss: an open `BlobFile` where the
        store can vouch for a file's bytes without reading them, else as `get_blob_into`.
        The caller closes a `BlobFile`."""


@runtime_checkable
class SupportsGC(Protocol):
    async def gc(self, capacity: int) -> dict[str, int]:
        """Evict least recently used chunks down to `capacity` bytes, from a fresh scan."""


@runtime_checkable
class SupportsChunkFiles(Protocol):
    root: Path  # the directory every chunk file lives under

    def chunk_path(self, key: str) -> Path:
        """The file that holds `key` (it may not exist)."""

    def known_header(self, key: str, st: os.stat_result) -> ChunkHeader | None:
        """The header of `key`'s file if the store verified this very file (same identity)."""

    def record_read(self, key: str, size: int | None, *, corrupt: str | None = None,
                    error: bool = False) -> None:
        """Account for a read done outside the store: a hit refreshes its LRU place, a
        corrupt file is quarantined, a miss or an I/O error is counted."""


def chunk_file_tier(store: Store) -> SupportsChunkFiles | None:
    """The store whose chunk files a direct reader may read: `store` itself, or the first
    tier of a tier list (`[file:///nvme, s3://...]`, whose `get_into` reads what that
    tier lacks from the tiers below), or None."""
    from storage.tiered import TieredStore

    if isinstance(store, TieredStore) and store.tiers:
        store = store.tiers[0]
    return store if isinstance(store, SupportsChunkFiles) else None
