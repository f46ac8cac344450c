"""`memory://?capacity=8GiB` — an in-process byte-capacity LRU, safe across threads and tasks."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from storage.base import Store, check_blob, check_key, check_tenant
from storage.errors import StoreFull
from storage.options import StoreURL, format_size, parse_size

DEFAULT_CAPACITY = 4 * 1024**3


class MemoryStore(Store):
    def __init__(self, capacity: int = DEFAULT_CAPACITY, url: str | None = None):
        super().__init__()
        self.capacity = capacity
        self.url = url or f"memory://?capacity={capacity}"
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._scopes: dict[str, MemoryStore] = {}

    @classmethod
    def from_url(cls, u: StoreURL) -> MemoryStore:
        capacity = u.take("capacity", parse_size, DEFAULT_CAPACITY)
        u.finish()
        return cls(capacity, u.url)

    async def put(self, key: str, blob: Any) -> bool:
        check_blob(key, blob)
        data = bytes(blob)
        if len(data) > self.capacity:
            self.counters["put_errors"] += 1
            raise StoreFull(f"{self}: chunk of {len(data)} bytes exceeds capacity {self.capacity}")
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self.counters["put_skipped"] += 1
                return False
            while self._used + len(data) > self.capacity:
                _, old = self._data.popitem(last=False)
                self._used -= len(old)
                self.counters["evictions"] += 1
            self._data[key] = data
            self._used += len(data)
            self.counters["puts"] += 1
            self.counters["bytes_written"] += len(data)
        return True

    async def get(self, key: str) -> bytes | None:
        check_key(key)
        with self._lock:
            self.counters["gets"] += 1
            data = self._data.get(key)
            if data is None:
                self.counters["misses"] += 1
                return None
            self._data.move_to_end(key)
            self.counters["hits"] += 1
            self.counters["bytes_read"] += len(data)
        return data

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        for k in keys:
            check_key(k)
        with self._lock:
            return [k in self._data for k in keys]

    async def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            data = self._data.pop(key, None)
            if data is None:
                return False
            self._used -= len(data)
            self.counters["deletes"] += 1
        return True

    async def list_keys(self) -> AsyncIterator[str]:
        with self._lock:
            keys = list(self._data)
        for k in keys:
            yield k

    def scoped(self, tenant: str) -> MemoryStore:
        check_tenant(tenant)
        with self._lock:
            if tenant not in self._scopes:
                self._scopes[tenant] = MemoryStore(self.capacity, f"{self.url}#{tenant}")
            return self._scopes[tenant]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            used, n = self._used, len(self._data)
        return {
            **super().stats(), "backend": "memory", "used_bytes": used,
            "capacity_bytes": self.capacity, "chunks": n, "used": format_size(used),
        }
