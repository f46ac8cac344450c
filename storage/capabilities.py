"""What a store can do beyond the `Store` protocol, declared as small runtime-checkable protocols.

A caller asks `isinstance(store, SupportsX)` instead of testing for a backend class or
reaching for its attributes; a store that lacks the capability is served through the base
protocol (or, in the store contract tests, skipped with the reason). A wrapper (a tier
list, a tenant scope) has a capability only where what it wraps has it, so the answer is
never a claim it cannot keep.

- `SupportsBlobFiles`: a server sends a verified chunk without copying it through Python
  (`open_blob` may hand over an open file for sendfile(2) or descriptor passing;
  `get_blob_into` fills a reusable buffer). file://, memory://, tier lists whose first tier
  has it, tenant scopes of a backend that has it.
- `SupportsGC`: `gc(capacity)` evicts down to a bound from a fresh scan (`kvstash gc`).
  file:// and s3://.
- `SupportsRootUsage`: `root_usage()` scans the whole root, tenants included (`kvstash stat`).
  file://.
- `SupportsDirectReads`: chunk payloads are read straight into destination tensors on any
  device through a `gds.ChunkIO` (GPUDirect Storage into GPU memory, pinned bounce buffers,
  O_DIRECT into host memory), each header checked against its key; the ChunkIO is handed
  in from above (`gds.enable_direct_reads(store)`), so storage never imports gds.
  file://, and tier lists whose first tier is file:// (what that tier lacks is read from
  the tiers below into host memory, and copied to the destination's device).
- `SupportsRangeReads`: a chunk's header, then byte ranges of its payload (one layer at a
  time). file://, memory://, s3://, http://, and tier lists whose every tier has it.
- `SupportsResidentReads`: a chunk whose bytes are all in this host's page cache is read on
  the calling thread, where handing it to an I/O thread would cost more than the copy; so
  is a lookup (`prefix_len_now`); and a chunk is read one segment (layer) at a time on a
  thread of the caller's (`open_segments`). file:// on a local filesystem.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

if TYPE_CHECKING:
    from gds import ChunkIO
    from storage.base import BlobFile
    from storage.codec import ChunkHeader
    from storage.file import SegmentFile
    from storage.pagecache import Residency


class _NotResident:
    def __repr__(self) -> str:
        return "NOT_RESIDENT"


# `read_resident_into`'s answer for a chunk it did not read: not all in the page cache.
NOT_RESIDENT: Final = _NotResident()


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
    async def gc(self, capacity: int) -> dict[str, Any]:
        """Evict least recently used chunks down to `capacity` bytes, from a fresh scan."""


@runtime_checkable
class SupportsRootUsage(Protocol):
    def root_usage(self) -> dict[str, Any]:
        """What a scan of the store's whole root holds now, every tenant's part included:
        `used_bytes`, `chunks`, and `tenants` ({tenant: {used_bytes, chunks}}). Blocking."""


@runtime_checkable
class SupportsDirectReads(Protocol):
    """The ChunkIO is handed in from the layer above (`gds.enable_direct_reads(store)`
    builds one for `direct_reads_home()`): storage never imports gds."""

    def direct_reads_home(self) -> tuple[str, Residency]:
        """The directory a ChunkIO for this store probes (filesystem, O_DIRECT, GPU), and
        the page-cache oracle that decides which of its reads take O_DIRECT."""

    def enable_direct_reads(self, chunk_io: ChunkIO, *, owned: bool = False) -> ChunkIO:
        """Read through `chunk_io` from now on and return it. `owned`: the store closes it,
        with itself or when another replaces it; else it is shared and its owner closes it."""

    @property
    def chunk_io(self) -> ChunkIO | None:
        """The ChunkIO reads go through, None before `enable_direct_reads`."""

    async def read_chunks_into(
        self, keys: Sequence[str], dests: Sequence[Any], *,
        on_done: Callable[[int, ChunkHeader | None, str | None], bool | None] | None = None,
    ) -> list[ChunkHeader | None]:
        """Each key's payload into the first bytes of its destination (a tensor on any
        device, or writable host memory); per key its verified header, or None on a miss.
        Direct reads must be enabled first (a RuntimeError otherwise: a caller's mistake).
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
        miss or error. The caller verifies what it read (`ChunkHeader.verify_span`)."""


@runtime_checkable
class SupportsResidentReads(Protocol):
    def prefix_len_now(self, keys: Sequence[str]) -> int | None:
        """`prefix_len` on the calling thread, where the store can answer without waiting
        on a device or a network (a local directory: one access(2) per key, microseconds,
        where a hop to the store's loop and back costs more); else None: ask `prefix_len`."""

    def cached_prefix_now(self, keys: Sequence[str]) -> list[bool] | None:
        """`prefix_len_now` and `is_resident` in one pass: for each leading key the store
        holds (as many entries as `prefix_len` would count), whether every byte of its
        chunk is in this host's page cache now (a local directory: one open(2) and
        cachestat(2) per key); None where `prefix_len_now` is."""

    def is_resident(self, key: str) -> bool:
        """Whether every byte of `key`'s chunk is in this host's page cache now, where the
        store could read it on the calling thread (a cheap check: no data is read)."""

    def read_resident_into(self, key: str, out: Any
                           ) -> tuple[ChunkHeader | None, str | None] | _NotResident:
        """Blocking, on the calling thread, and only where it cannot wait on a device or a
        network: if every byte of `key`'s chunk is in this host's page cache, its payload
        into `out` (writable host memory, or a list of such buffers that take the payload
        in order and exactly) and (its verified header, None), or on a miss
        (None, why) with `why` "missing", "corrupt" or "io"; else NOT_RESIDENT, having
        read nothing: the caller reads the chunk the normal way."""

    def read_resident_spans_into(self, key: str, spans: Sequence[tuple[int, int]],
                                 outs: Sequence[Any]
                                 ) -> tuple[ChunkHeader | None, str | None] | _NotResident:
        """`read_resident_into` of part of a chunk: its header, then payload bytes
        [offset, offset + length) of each of `spans` (runs of whole segments) into
        `outs[j]`, each checked against the segments it covers; nothing else of the chunk
        is read. NOT_RESIDENT unless the header and every span are in the page cache."""

    def open_segments(self, key: str) -> tuple[SegmentFile | None, str | None] | _NotResident:
        """Blocking, on the calling thread, and only where it cannot wait on a network:
        `key`'s chunk open for reads of its payload by segment (`SegmentFile.head`, then
        `read(s, parts)` for each segment or `read_span(offset, parts)` for each run of
        whole segments, each checked against its own checksum; then
        `close`), whether or not its bytes are in the page cache (`SegmentFile.resident`
        says), or (None, why) with `why` "missing" or "io"; NOT_RESIDENT where the store
        is not local."""
