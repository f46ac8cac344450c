"""Tenants over one backend: one shared capacity, optional per-tenant quotas, eviction
across tenants. Written once, as a wrapper around any store's tenant scopes.

A backend contributes only the layout of a tenant's key space (`Store.scoped`: for
file://, `<root>/tenants/<tenant>/`; for s3://, `<prefix>/tenants/<tenant>/`; for
memory://, a separate map). Everything else lives here:

- **One capacity.** The backend's `capacity` (its URL option) bounds the bytes of the root
  and every tenant together, not each of them: before a tenant's put lands, when the total
  (plus the puts under way) would pass it, the tenant holding the most bytes loses its
  least recently used chunks first (`Store.evict_to`), so a tenant that writes little keeps
  its chunks while a heavy writer recycles its own.
- **Quotas.** With `quota`, a tenant holds at most that many bytes: past it, its own least
  recently used chunks go; a chunk larger than the quota is refused (`StoreFull`).
- **A full disk.** When a put finds the disk full (`StoreFull` from the backend, which has
  already freed what it could, file:// from the largest scope of its root first), the
  largest other holder frees twice the chunk's size and the put is tried once more.

Capacity is enforced from each scope's own count of its bytes (`Store.used_bytes`), so it
holds for backends that keep one (memory://); for others (s3://, tiers) each scope keeps
the backend's own rules, and these counts are per process. A backend that counts its
whole root across processes (file:// with a capacity: `capacity_shared`) enforces the
capacity itself, for every process and tenant sharing the root; quotas stay per process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from storage.base import BlobFile, Store, check_tenant
from storage.capabilities import SupportsBlobFiles
from storage.codec import ChunkHeader
from storage.errors import StoreFull


class SharedCapacity:
    """The byte budget of one backend, its root store and every tenant scope over it."""

    def __init__(self, root: Store, quota: int | None = None):
        self.root = root
        self.capacity: int | None = root.stats().get("capacity_bytes") or None
        # A backend that counts the bytes of its whole root across processes (file://
        # with a capacity) enforces the capacity itself, under its own lock.
        self.enforced_below = bool(getattr(root, "capacity_shared", False))
        self.quota = quota
        self.members: dict[str, Store] = {"": root}
        self.pending = 0  # bytes of puts admitted and not yet landed

    def used(self) -> int:
        return sum(m.used_bytes() for m in self.members.values()) + self.pending

    async def make_room(self, tenant: str, scope: Store, size: int) -> None:
        if self.capacity is not None and size > self.capacity:
            raise StoreFull(f"{scope}: chunk of {size} bytes exceeds capacity {self.capacity}")
        if self.quota is not None:
            if size > self.quota:
                raise StoreFull(f"{scope}: chunk of {size} bytes exceeds the tenant quota "
                                f"of {self.quota} bytes")
            if scope.used_bytes() + size > self.quota:
                await scope.evict_to(self.quota - size)
        if self.capacity is None or self.enforced_below:
            return
        for _ in range(len(self.members) + 1):
            over = self.used() + size - self.capacity
            if over <= 0:
                return
            largest = max(self.members.values(), key=lambda m: m.used_bytes())
            held = largest.used_bytes()
            if held == 0 or not await largest.evict_to(max(held - over, 0)):
                return  # nothing left to evict: the backend's own checks decide

    async def free_elsewhere(self, scope: Store, nbytes: int) -> int:
        others = [m for m in self.members.values() if m is not scope]
        if not others:
            return 0
        largest = max(others, key=lambda m: m.used_bytes())
        return await largest.evict_to(max(largest.used_bytes() - nbytes, 0))


class TenantStore(Store):
    """One tenant's scope of a backend, under the shared capacity and the quota. It has the
    capabilities of its scope that it forwards (`SupportsBlobFiles`) only where the scope
    has them: `TenantStore(...)` is a `BlobFileTenantStore` over a scope that sends files."""

    def __new__(cls, tenant: str, scope: Store, shared: SharedCapacity) -> TenantStore:
        if cls is TenantStore and isinstance(scope, SupportsBlobFiles):
            cls = BlobFileTenantStore
        return super().__new__(cls)

    def __init__(self, tenant: str, scope: Store, shared: SharedCapacity):
        super().__init__()
        self.tenant = tenant
        self.scope = scope
        self.shared = shared
        self.url = scope.url
        self.counters = scope.counters  # one set of counters: the scope's

    async def put(self, key: str, blob: Any) -> bool:
        size = memoryview(blob).nbytes
        await self.shared.make_room(self.tenant, self.scope, size)
        self.shared.pending += size
        try:
            try:
                return await self.scope.put(key, blob)
            except StoreFull:
                # The backend freed what it could of this tenant's chunks; the disk is
                # shared, so room may be had from the others.
                if not await self.shared.free_elsewhere(self.scope, 2 * size):
                    raise
            return await self.scope.put(key, blob)
        finally:
            self.shared.pending -= size

    def watch(self, callback: Any) -> None:
        self.scope.watch(callback)  # the scope's own changes, evictions for others included

    async def get(self, key: str) -> bytes | bytearray | None:
        return await self.scope.get(key)

    async def get_into(self, key: str, out: Any) -> ChunkHeader | None:
        return await self.scope.get_into(key, out)

    async def get_into_many(self, keys: Sequence[str], outs: Sequence[Any], **kw: Any,
                            ) -> list[ChunkHeader | None]:
        return await self.scope.get_into_many(keys, outs, **kw)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.scope.exists(keys)

    async def prefix_len(self, keys: Sequence[str]) -> int:
        return await self.scope.prefix_len(keys)

    async def delete(self, key: str) -> bool:
        return await self.scope.delete(key)

    def list_keys(self) -> AsyncIterator[str]:
        return self.scope.list_keys()

    def used_bytes(self) -> int:
        return self.scope.used_bytes()

    async def evict_to(self, used_bytes: int) -> int:
        return await self.scope.evict_to(used_bytes)

    async def health(self) -> str | None:
        return await self.scope.health()

    async def probe(self) -> str | None:
        return await self.scope.probe()

    def stats(self) -> dict[str, Any]:
        out = self.scope.stats()
        if self.shared.capacity is not None:
            out["capacity_bytes"] = self.shared.capacity  # shared with every other tenant
        out["quota_bytes"] = self.shared.quota
        return out

    async def flush(self) -> None:
        await self.scope.flush()

    async def close(self) -> None:
        await self.scope.close()


class BlobFileTenantStore(TenantStore):
    """A tenant's scope of a backend that sends verified blobs (`SupportsBlobFiles`)."""

    def __init__(self, tenant: str, scope: Store, shared: SharedCapacity):
        if not isinstance(scope, SupportsBlobFiles):
            raise TypeError(f"{scope} does not send blobs (SupportsBlobFiles)")
        super().__init__(tenant, scope, shared)
        self.blobs: SupportsBlobFiles = scope

    async def get_blob_into(self, key: str, out: Any) -> memoryview | None:
        return await self.blobs.get_blob_into(key, out)

    async def open_blob(self, key: str, out: Any) -> memoryview | BlobFile | None:
        return await self.blobs.open_blob(key, out)


def open_tenants(root: Store, tenants: Sequence[str], quota: int | None = None,
                 ) -> dict[str, TenantStore]:
    """Every tenant's store over `root`, sharing its capacity (opened once: opening a scope
    may scan a directory)."""
    shared = SharedCapacity(root, quota)
    out = {}
    for tenant in tenants:
        scope = root.scoped(check_tenant(tenant))
        shared.members[tenant] = scope
        out[tenant] = TenantStore(tenant, scope, shared)
    return out
