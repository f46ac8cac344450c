"""The async `Store` protocol every backend implements, and its shared counters.

Threading contract: every coroutine may be called from any task of the event loop that
first used the store; backends push blocking I/O to threads at one seam. Hot-path
methods (`get`, `get_into`, `exists`, `prefix_len`) never raise for storage failures:
they count the failure and answer "miss". `put` raises only typed `StoreError`s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from hashing import is_valid_key
from storage.codec import ChunkError, ChunkHeader, decode_chunk, decode_header
from storage.errors import InvalidChunk, InvalidKey

log = logging.getLogger("kvstash.storage")

TENANT_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # checked whole (fullmatch)

# A key that is never stored: `probe` asks the backend about it.
PROBE_KEY = "0" * 16 + "/" + "0" * 32

COUNTERS = (
    "gets", "hits", "misses", "errors", "corrupt", "rechecked", "puts", "put_skipped", "put_errors",
    "evictions", "bytes_read", "bytes_written", "deletes",
)


def check_key(key: str) -> str:
    if not is_valid_key(key):
        raise InvalidKey(f"malformed key {key!r}: expected <16 hex>/<32 hex>")
    return key


def check_tenant(tenant: str) -> str:
    """Tenant names become path components and key prefixes: keep them boring."""
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        raise ValueError(f"bad tenant name {tenant!r}: use 1-64 of [A-Za-z0-9_-]")
    return tenant


def check_blob(key: str, blob: Any) -> ChunkHeader:
    """Reject a blob that is not a complete, valid chunk for `key` (used by every `put`):
    its header, length and every checksum it carries."""
    header = check_blob_header(key, blob)
    check_blob_payload(header, blob)
    return header


def check_blob_header(key: str, blob: Any) -> ChunkHeader:
    """`check_blob` without the payload hash: header, key and exact length (microseconds)."""
    check_key(key)
    try:
        header = decode_header(blob, key)
    except ChunkError as exc:
        raise InvalidChunk(f"rejected chunk for {key}: {exc}") from exc
    size = memoryview(blob).nbytes
    if size != header.total_len:
        raise InvalidChunk(f"rejected chunk for {key}: chunk is {size} bytes, header says "
                           f"{header.total_len}")
    return header


def check_blob_payload(header: ChunkHeader, blob: Any) -> None:
    """The rest of `check_blob`: the payload against every checksum of the (checked)
    header, the whole payload's and each segment's."""
    try:
        header.verify_contents(memoryview(blob).cast("B")[header.header_len :])
    except ChunkError as exc:
        raise InvalidChunk(f"rejected chunk for {header.key}: {exc}") from exc


def copy_payload(key: str, blob: Any, out: Any) -> ChunkHeader | None:
    """Copy a verified blob's payload into `out`: its header, or None if `out` is too small."""
    header = decode_header(blob, key)
    dst = memoryview(out).cast("B")
    if dst.nbytes < header.payload_len:
        return None
    dst[: header.payload_len] = memoryview(blob)[header.header_len :]
    return header


def check_batch(keys: Sequence[str], outs: Sequence[Any]) -> None:
    """`get_into_many` takes one destination buffer per key."""
    if len(keys) != len(outs):
        raise ValueError(f"{len(keys)} keys but {len(outs)} destination buffers")


class BlobFile:
    """An open file whose bytes [0, size) are a verified blob, for senders that move file
    bytes without reading them (sendfile(2)). The holder closes it."""

    def __init__(self, fd: int, size: int):
        self.fd = fd
        self.size = size

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __del__(self) -> None:  # a holder that never got to close it (a cancelled request)
        self.close()

    def __enter__(self) -> BlobFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verify_blob(key: str, blob: Any) -> ChunkHeader | None:
    """Header + checksum verification of a fetched blob; None if it is not the chunk."""
    try:
        return decode_chunk(blob, key).header
    except ChunkError:
        return None


class Store(ABC):
    """Bytes by key. Chunks are immutable: `put` is create-only, there is no overwrite."""

    url: str = ""

    def __init__(self) -> None:
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._started = time.monotonic()
        self._watchers: list[Callable[[str, str], None]] = []

    # -- change events (kvserver publishes them for cache-aware routers) -------------------

    def watch(self, callback: Callable[[str, str], None]) -> None:
        """Call `callback(event, key)` whenever a chunk becomes visible here ("stored": a
        put that wrote it) or stops being ("removed": a delete, an eviction, a corrupt
        chunk quarantined, a chunk found gone). It runs on whatever thread made the
        change and must not block. Stores that keep no chunks of their own (an http://
        client) report nothing."""
        self._watchers.append(callback)

    def _changed(self, event: str, key: str) -> None:
        for callback in self._watchers:
            try:
                callback(event, key)
            except Exception as exc:  # noqa: BLE001 - a watcher must never fail a store call
                log.warning("%s: change watcher failed: %s", self, exc)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"

    @abstractmethod
    async def put(self, key: str, blob: Any) -> bool:
        """Store a verified chunk; True if written, False if the key already existed.

        `blob` is any bytes-like object; the store does not keep or read it after `put`
        returns (callers reuse their buffers), so one it holds on to is copied."""

    @abstractmethod
    async def get(self, key: str) -> bytes | bytearray | None:
        """The verified blob (bytes, or a bytearray the store filled in place), or None
        (absent, corrupt, unreachable)."""

    async def get_into(self, key: str, out: Any) -> ChunkHeader | None:
        """Write the chunk's payload into `out` (a writable buffer at least payload-sized).

        Returns the verified header, or None on a miss. The default copies through `get`;
        backends that can read straight into the caller's memory override it.
        """
        blob = await self.get(key)
        return None if blob is None else copy_payload(key, blob, out)

    async def get_into_many(
        self,
        keys: Sequence[str],
        outs: Sequence[Any],
        *,
        max_in_flight: int = 4,
        on_done: Callable[[int, ChunkHeader | None], bool | None] | None = None,
    ) -> list[ChunkHeader | None]:
        """`get_into(keys[i], outs[i])` for every i, at most `max_in_flight` reads at a time,
        started in index order.

        `on_done(i, header)` runs as each read lands (on the event loop, or on a backend's
        worker thread: keep it short and thread-safe); when it returns False no further read
        is started, and the keys never read answer None. Backends override this to read a
        whole batch with one hand-off to their I/O threads instead of one per key.
        """
        check_batch(keys, outs)
        gate = asyncio.Semaphore(max(max_in_flight, 1))
        stopped = False

        async def one(i: int) -> ChunkHeader | None:
            nonlocal stopped
            async with gate:
                if stopped:
                    return None
                header = await self.get_into(keys[i], outs[i])
                if on_done is not None and on_done(i, header) is False:
                    stopped = True
                return header

        return list(await asyncio.gather(*(one(i) for i in range(len(keys)))))

    @abstractmethod
    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key, in one batched call; unreachable answers all-False."""

    async def prefix_len(self, keys: Sequence[str]) -> int:
        """How many leading keys are present: the first gap ends the hit."""
        n = 0
        for present in await self.exists(keys):
            if not present:
                break
            n += 1
        return n

    @abstractmethod
    async def delete(self, key: str) -> bool:
        """Remove a key; True if it was there."""

    @abstractmethod
    def list_keys(self) -> AsyncIterator[str]:
        """Every stored key (order unspecified)."""

    def scoped(self, tenant: str) -> Store:
        """A store over the same backend whose keys are invisible to every other scope (the
        backend's layout of a tenant; capacity shared between scopes, quotas and eviction
        across tenants are storage.tenancy's)."""
        raise NotImplementedError(f"{type(self).__name__} does not support tenant scopes")

    def used_bytes(self) -> int:
        """Bytes this store holds, as far as it keeps count (0 when it does not)."""
        return int(self.stats().get("used_bytes") or 0)

    async def evict_to(self, used_bytes: int) -> int:
        """Evict least-recently-used chunks until this store holds at most `used_bytes`;
        the bytes freed. A store without an index of its own chunks frees nothing."""
        return 0

    async def health(self) -> str | None:
        """Why this store cannot serve right now (its root gone or read-only, its disk
        full), or None. Checked by readiness probes, never on the hot path."""
        return None

    async def probe(self) -> str | None:
        """Why one presence check (of PROBE_KEY) did not reach the backend, or None.

        `exists` answers "absent" when its backend cannot be reached (a miss, never an
        error, on the hot path); this answers for itself, so a readiness probe needs no
        shared counters to tell. A failure still counts in `stats()` and feeds a breaker
        like any other request. The default suits stores whose `exists` cannot fail
        silently (memory, local files)."""
        await self.exists([PROBE_KEY])
        return None

    def _count_get(self, size: int | None) -> None:
        """Count one read: a miss (None) or a hit of `size` bytes."""
        self.counters["gets"] += 1
        if size is None:
            self.counters["misses"] += 1
        else:
            self.counters["hits"] += 1
            self.counters["bytes_read"] += size

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"url": self.url, **self.counters}
        gets = self.counters["gets"]
        out["hit_rate"] = self.counters["hits"] / gets if gets else 0.0
        return out

    async def flush(self) -> None:
        """Wait for background work (cascading writes, promotions) to finish."""
        return None

    async def close(self) -> None:
        await self.flush()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
