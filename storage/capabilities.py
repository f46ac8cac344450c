"""What a store can do beyond the `Store` protocol, declared as small runtime-checkable protocols.

A caller asks `isinstance(store, SupportsX)` instead of testing for a backend class or
reaching for its attributes; a store that lacks the capability is served through the base
protocol (or, in the store contract tests, skipped with the reason).

- `SupportsBlobFiles`: a server sends a verified chunk without copying it through Python
  (`open_blob` may hand over an open file for sendfile(2) or descriptor passing;
  `get_blob_into` fills a reusable buffer). file://, memory://, tiers whose first tier has it.
- `SupportsGC`: `gc(capacity)` evicts down to a bound from a fresh scan (`kvstash gc`).
  file:// and s3://.
- `SupportsDirectReads`: chunk payloads are read straight into destination tensors on any
  device through the store's own `gds.ChunkIO` (GPUDirect Storage into GPU memory, pinned
  bounce buffers, O_DIRECT into host memory), each header checked against its key.
  file://, and tier lists whose first tier is file:// (what that tier lacks is read from
  the tiers below into host memory, and copied to the destination's device).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from gds import ChunkIO
    from storage.base import BlobFile
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
class SupportsDirectReads(Protocol):
    def enable_direct_reads(self, chunk_io: ChunkIO | None = None, *,
                            max_in_flight: int = 8) -> ChunkIO:
        """Read through a ChunkIO from now on and return it: the one given (shared; its
        owner closes it), else the store's own, built once for its directory (probing the
        filesystem and the GPU) and closed with the store."""

    async def read_chunks_into(
        self, keys: Sequence[str], dests: Sequence[Any], *,
        on_done: Callable[[int, ChunkHeader | None, str | None], bool | None] | None = None,
    ) -> list[ChunkHeader | None]:
        """Each key's payload into the first bytes of its destination (a tensor on any
        device, or writable host memory); per key its verified header, or None on a miss.
        Every read is submitted at once (the ChunkIO runs `max_in_flight` of them, in
        order). `on_done(i, header, why)` runs on an I/O thread as key i settles: `why` is
        None on a hit, else "missing", "corrupt" or "io"; returning False cancels the reads
        not yet started. Cancelled, the call starts no further read; a read already
        running may still write its destination."""


@runtime_checkable
class SupportsRangeReads(Protocol):
    async def read_header(self, key: str) -> ChunkHeader | None:
        """The verified header of `key`'s chunk, or None on a miss (one small request)."""

    async def read_range_into(self, key: str, header: ChunkHeader, offset: int, out: Any) -> bool:
        """Payload bytes [offset, offset + len(out)) of `key`'s chunk into `out`; False on a
        miss or error. The caller verifies what it read (`ChunkHeader.verify_segment`)."""
