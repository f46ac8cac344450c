"""Tiers: `open_store([fast, ..., slow])`. Reads try tiers in order and promote hits
upward; writes land in the first tier and cascade down in the background; `prefix_len`
combines tiers, so a prefix split across tiers still counts as one hit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from storage.base import BlobFile, Store, check_blob
from storage.capabilities import SupportsBlobFiles, SupportsDirectReads, SupportsRangeReads
from storage.codec import ChunkHeader
from storage.errors import StoreError

if TYPE_CHECKING:
    from gds.chunkio import ChunkIO  # the layer above: the type of what it hands in
    from storage.pagecache import Residency

log = logging.getLogger("kvstash.storage.tiered")

MAX_BACKGROUND = 64
LIST_BATCH = 1024  # keys of a lower tier checked against the tiers above at a time


class TieredStore(Store):
    """Tiers, fastest first. A tier list has a capability only where its tiers do, and
    `TieredStore(tiers)` is the class that has those (`tier_class`): it sends blobs and
    reads directly into device buffers where its first tier can (`SupportsBlobFiles`,
    `SupportsDirectReads`), and reads ranges where every tier can (`SupportsRangeReads`)."""

    def __new__(cls, tiers: Sequence[Store]) -> TieredStore:
        if cls is TieredStore:
            cls = tier_class(tiers)
        return super().__new__(cls)

    def __init__(self, tiers: Sequence[Store]):
        super().__init__()
        self.tiers = list(tiers)
        self.url = " -> ".join(t.url for t in self.tiers)
        self._pending: set[asyncio.Task] = set()

    def _spawn(self, store: Store, key: str, blob: Any) -> None:
        if len(self._pending) >= MAX_BACKGROUND:
            self.counters["put_errors"] += 1  # dropped: the lower tier is too slow to keep up
            return
        task = asyncio.get_running_loop().create_task(self._copy(store, key, blob))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _copy(self, store: Store, key: str, blob: Any) -> None:
        try:
            await store.put(key, blob)
        except StoreError as exc:
            log.warning("%s: copy of %s to %s failed: %s", self, key, store, exc)

    async def put(self, key: str, blob: Any) -> bool:
        check_blob(key, blob)
        wrote = await self.tiers[0].put(key, blob)
        if len(self.tiers) > 1 and not isinstance(blob, bytes):
            blob = bytes(blob)  # the cascade runs after we return: the caller may reuse blob
        for lower in self.tiers[1:]:
            self._spawn(lower, key, blob)
        self.counters["puts" if wrote else "put_skipped"] += 1
        return wrote

    async def _promote(self, hit_tier: int, key: str, fetch: Any) -> None:
        if hit_tier == 0:
            return
        blob = fetch if isinstance(fetch, (bytes, bytearray)) else await self.tiers[hit_tier].get(key)
        if blob is not None:
            for upper in self.tiers[:hit_tier]:
                self._spawn(upper, key, blob)

    def watch(self, callback: Callable[[str, str], None]) -> None:
        """A tier list reports what its first tier stores and what its last tier drops (a
        chunk evicted from a faster tier is still in the list below it)."""
        seen = {id(self.tiers[0]), id(self.tiers[-1])}
        if len(seen) == 1:
            self.tiers[0].watch(callback)
            return

        def stored(event: str, key: str) -> None:
            if event == "stored":
                callback(event, key)

        def removed(event: str, key: str) -> None:
            if event == "removed":
                callback(event, key)

        self.tiers[0].watch(stored)
        self.tiers[-1].watch(removed)

    async def get(self, key: str) -> bytes | bytearray | None:
        return await self._get_from(0, key)

    async def _get_from(self, first: int, key: str) -> bytes | bytearray | None:
        self.counters["gets"] += 1
        for i in range(first, len(self.tiers)):
            blob = await self.tiers[i].get(key)
            if blob is not None:
                self.counters["hits"] += 1
                self.counters["bytes_read"] += len(blob)
                await self._promote(i, key, blob)
                return blob
        self.counters["misses"] += 1
        return None

    async def get_into(self, key: str, out: Any) -> ChunkHeader | None:
        self.counters["gets"] += 1
        return await self._get_into_from(0, key, out)

    async def _get_into_from(self, first: int, key: str, out: Any) -> ChunkHeader | None:
        for i in range(first, len(self.tiers)):
            header = await self.tiers[i].get_into(key, out)
            if header is not None:
                self.counters["hits"] += 1
                self.counters["bytes_read"] += header.total_len
                if i:
                    # get_into only has the payload; re-read the blob for the upper tiers
                    # off the hot path.
                    task = asyncio.get_running_loop().create_task(self._promote(i, key, None))
                    self._pending.add(task)
                    task.add_done_callback(self._pending.discard)
                return header
        self.counters["misses"] += 1
        return None

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Each tier, fastest first, is asked only for the keys no tier above holds: keys
        on the first tier (a local directory) cost the tiers below (a bucket) no request,
        and a bucket that is slow or down holds up only the lookups of keys it alone may
        have. A lower tier that fails answers "absent" (counted in `errors`); only
        a failure of the first tier is the caller's."""
        found = [False] * len(keys)
        missing = list(range(len(keys)))
        for depth, tier in enumerate(self.tiers):
            if not missing:
                break
            there = await self._ask(depth, tier.exists([keys[i] for i in missing]),
                                    [False] * len(missing))
            for i, present in zip(missing, there, strict=True):
                found[i] = bool(present)
            missing = [i for i, present in zip(missing, there, strict=True) if not present]
        return found

    async def prefix_len(self, keys: Sequence[str]) -> int:
        """The leading keys some tier holds: the first tier's answer, and past each of its
        gaps the tiers below asked for their own prefix of what follows (a bucket's
        `prefix_len` stops at its first gap), so a prompt held locally costs them nothing."""
        local = await self.tiers[0].exists(keys) if keys else []
        lower = TieredStore(self.tiers[1:]) if len(self.tiers) > 2 else (
            self.tiers[1] if len(self.tiers) == 2 else None)
        n = 0
        while n < len(keys):
            if local[n]:
                n += 1
                continue
            more = 0 if lower is None else await self._ask(1, lower.prefix_len(keys[n:]), 0)
            if not more:
                break
            n += more
        return n

    async def _ask(self, depth: int, call: Any, absent: Any) -> Any:
        """`call` answered by the tier at `depth`; a lower tier's failure is `absent`."""
        if depth == 0:
            return await call
        try:
            return await call
        except StoreError as exc:
            self.counters["errors"] += 1
            log.warning("%s: a lower tier could not answer a lookup: %s", self, exc)
            return absent

    async def probe(self) -> str | None:
        reasons = await asyncio.gather(*(t.probe() for t in self.tiers))
        return next((why for why in reasons if why is not None), None)

    async def delete(self, key: str) -> bool:
        # A cascade still in flight would re-create the key below us: let it land first.
        await self.flush()
        results = await asyncio.gather(*(t.delete(key) for t in self.tiers))
        return any(results)

    async def list_keys(self) -> AsyncIterator[str]:
        """Every tier's keys, each once: a lower tier's key is left out where a tier above
        has it (asked a batch at a time), so a listing holds one batch, never the set of
        keys seen. A chunk moving between tiers meanwhile may be listed twice."""
        for i, tier in enumerate(self.tiers):
            batch: list[str] = []
            async for key in tier.list_keys():
                batch.append(key)
                if len(batch) == LIST_BATCH:
                    for k in await self._only_below(i, batch):
                        yield k
                    batch = []
            for k in await self._only_below(i, batch):
                yield k

    async def _only_below(self, i: int, keys: list[str]) -> list[str]:
        """The `keys` of tier i that no tier above it holds."""
        for upper in self.tiers[:i]:
            if not keys:
                break
            keys = [k for k, there in zip(keys, await upper.exists(keys), strict=True) if not there]
        return keys

    def scoped(self, tenant: str) -> TieredStore:
        return TieredStore([t.scoped(tenant) for t in self.tiers])

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "backend": "tiered", "tiers": [t.stats() for t in self.tiers]}

    async def flush(self) -> None:
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
        for t in self.tiers:
            await t.flush()

    async def close(self) -> None:
        await self.flush()
        for t in self.tiers:
            await t.close()


class BlobFileTiers(TieredStore):
    """A tier list whose first tier sends verified blobs (SupportsBlobFiles): its answer
    where it has the chunk (a file to send, where it can give one), else the lower tiers'
    as `get` reads them."""

    def __init__(self, tiers: Sequence[Store]):
        super().__init__(tiers)
        first = self.tiers[0]
        if not isinstance(first, SupportsBlobFiles):
            raise TypeError(f"{first} does not send blobs (SupportsBlobFiles)")
        self.first_blobs: SupportsBlobFiles = first

    async def get_blob_into(self, key: str, out: Any) -> memoryview | None:
        got = await self.first_blobs.get_blob_into(key, out)
        if got is None:
            return await self._lower_blob(key)
        self._count_get(got.nbytes)
        return got

    async def open_blob(self, key: str, out: Any) -> memoryview | BlobFile | None:
        got = await self.first_blobs.open_blob(key, out)
        if got is None:
            return await self._lower_blob(key)
        self._count_get(got.size if isinstance(got, BlobFile) else got.nbytes)
        return got

    async def _lower_blob(self, key: str) -> memoryview | None:
        blob = await self._get_from(1, key)
        return None if blob is None else memoryview(blob).cast("B")


class RangeReadTiers(TieredStore):
    """A tier list whose every tier reads byte ranges (SupportsRangeReads): from the first
    tier that has the chunk."""

    def __init__(self, tiers: Sequence[Store]):
        super().__init__(tiers)
        self.ranged: list[SupportsRangeReads] = []
        for tier in self.tiers:
            if not isinstance(tier, SupportsRangeReads):
                raise TypeError(f"{tier} does not read ranges (SupportsRangeReads)")
            self.ranged.append(tier)

    async def read_header(self, key: str) -> ChunkHeader | None:
        for tier in self.ranged:
            header = await tier.read_header(key)
            if header is not None:
                return header
        return None

    async def read_range_into(self, key: str, header: ChunkHeader, offset: int, out: Any) -> bool:
        # Chunks are immutable: any tier holding the key holds these bytes (the caller's
        # segment checksum says whether they are).
        for tier in self.ranged:
            if await tier.read_range_into(key, header, offset, out):
                return True
        return False


class DirectReadTiers(TieredStore):
    """A tier list whose first tier reads directly into device buffers (SupportsDirectReads):
    chunks go there first; what it lacks, or fails to read, is read from the tiers below
    (which promote it) into host memory, and copied to a device destination."""

    def __init__(self, tiers: Sequence[Store]):
        super().__init__(tiers)
        first = self.tiers[0]
        if not isinstance(first, SupportsDirectReads):
            raise TypeError(f"{first} does not read directly (SupportsDirectReads)")
        self.first_direct: SupportsDirectReads = first

    def direct_reads_home(self) -> tuple[str, Residency]:
        return self.first_direct.direct_reads_home()

    def enable_direct_reads(self, chunk_io: ChunkIO, *, owned: bool = False) -> ChunkIO:
        return self.first_direct.enable_direct_reads(chunk_io, owned=owned)

    @property
    def chunk_io(self) -> ChunkIO | None:
        return self.first_direct.chunk_io

    async def read_chunks_into(
        self, keys: Sequence[str], dests: Sequence[Any], *,
        on_done: Callable[[int, ChunkHeader | None, str | None], bool | None] | None = None,
    ) -> list[ChunkHeader | None]:
        loop = asyncio.get_running_loop()
        results: list[ChunkHeader | None] = [None] * len(keys)
        lower: set[asyncio.Task] = set()
        self.counters["gets"] += len(keys)

        async def from_lower(i: int) -> None:
            header = None
            try:
                header = await self._lower_into(keys[i], dests[i])
            except Exception as exc:  # noqa: BLE001 - any failure is a miss
                log.warning("%s: reading %s from the lower tiers failed: %s", self, keys[i], exc)
            results[i] = header
            if on_done is not None:
                on_done(i, header, None if header is not None else "missing")

        def start_lower(i: int) -> None:
            task = loop.create_task(from_lower(i))
            lower.add(task)
            task.add_done_callback(lower.discard)

        def landed(i: int, header: ChunkHeader | None, why: str | None) -> bool | None:
            if header is None and len(self.tiers) > 1:
                loop.call_soon_threadsafe(start_lower, i)
                return None  # `on_done` once the lower tiers answer
            results[i] = header
            if header is not None:
                self.counters["hits"] += 1
                self.counters["bytes_read"] += header.total_len
            else:
                self.counters["misses"] += 1
            return on_done(i, header, why) if on_done is not None else None

        try:
            await self.first_direct.read_chunks_into(keys, dests, on_done=landed)
            await asyncio.sleep(0)  # let the hand-offs from the I/O threads start
            while lower:
                await asyncio.gather(*list(lower), return_exceptions=True)
                await asyncio.sleep(0)
        finally:
            for task in list(lower):
                task.cancel()
        return results

    async def _lower_into(self, key: str, dest: Any) -> ChunkHeader | None:
        """`key` read through the tiers below the first (promoting it) into `dest`; a CUDA
        destination is filled from pinned host memory, as for any S3 or HTTP store."""
        io = self.chunk_io
        if io is None:
            raise RuntimeError(f"{self}: direct reads are not enabled (gds.enable_direct_reads)")
        return await io.fill_through_host(dest, lambda host: self._get_into_from(1, key, host))


@functools.cache  # one class per set of capabilities
def _combined(caps: tuple[type[TieredStore], ...]) -> type[TieredStore]:
    if len(caps) == 1:
        return caps[0]
    name = "".join(c.__name__.removesuffix("Tiers") for c in caps) + "Tiers"
    return cast("type[TieredStore]", type(name, caps, {}))


def tier_class(tiers: Sequence[Store]) -> type[TieredStore]:
    """The TieredStore class with the capabilities `tiers` give a tier list."""
    caps = tuple(c for c, has in (
        (DirectReadTiers, bool(tiers) and isinstance(tiers[0], SupportsDirectReads)),
        (BlobFileTiers, bool(tiers) and isinstance(tiers[0], SupportsBlobFiles)),
        (RangeReadTiers, bool(tiers) and all(isinstance(t, SupportsRangeReads) for t in tiers)),
    ) if has)
    return _combined(caps) if caps else TieredStore
