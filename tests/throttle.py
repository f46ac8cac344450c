"""Slow and failing stores and chunk reads for tests, instead of patching private methods.

- `ThrottledStore`: any store behind a wrapper whose chosen operations wait first (on the
  store's loop, as a far store's would) or fail as an unreachable backend does. Like every
  wrapper it has only the capabilities it forwards, here none: a local directory behind it
  is served as a network store is (lookups and reads on the store's loop).
- `ThrottledBackend`: a backend for `storage.registry.BACKENDS`, so that code opening stores
  from URLs (an engine's connector) opens throttled ones:
  `monkeypatch.setitem(BACKENDS, "file", ThrottledBackend(FileStore, {"prefix_len": 0.2}))`.
- `SlowChunkIO`: a real ChunkIO whose chunk reads start `delay_s` late, handed to the core
  or a store in place of its own (`KVConnector(direct_io=...)`, `gds.enable_direct_reads`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gds import ChunkIO
from storage.base import Store
from storage.codec import ChunkHeader
from storage.errors import StoreUnavailable
from storage.options import StoreURL
from storage.registry import Backend

OPERATIONS = frozenset({"put", "get", "get_into", "get_into_many", "exists", "prefix_len",
                        "delete", "list_keys"})


class ThrottledStore(Store):
    """`inner` with each operation named in `delay_s` waiting that many seconds first, and
    each named in `fail` raising StoreUnavailable (after its delay) instead of running.
    `calls` counts each operation asked of it."""

    def __init__(self, inner: Store, delay_s: Mapping[str, float] | None = None,
                 fail: Collection[str] = ()):
        super().__init__()
        unknown = (set(delay_s or {}) | set(fail)) - OPERATIONS
        if unknown:
            raise ValueError(f"not store operations: {sorted(unknown)}")
        self.inner = inner
        self.delay_s = dict(delay_s or {})
        self.fail = set(fail)
        self.url = inner.url
        self.counters = inner.counters
        self.calls: dict[str, int] = dict.fromkeys(OPERATIONS, 0)

    async def _enter(self, op: str) -> None:
        self.calls[op] += 1
        if self.delay_s.get(op):
            await asyncio.sleep(self.delay_s[op])
        if op in self.fail:
            raise StoreUnavailable(f"{self}: {op} fails (ThrottledStore)")

    async def put(self, key: str, blob: Any) -> bool:
        await self._enter("put")
        return await self.inner.put(key, blob)

    async def get(self, key: str) -> bytes | bytearray | None:
        await self._enter("get")
        return await self.inner.get(key)

    async def get_into(self, key: str, out: Any) -> ChunkHeader | None:
        await self._enter("get_into")
        return await self.inner.get_into(key, out)

    async def get_into_many(self, keys: Sequence[str], outs: Sequence[Any], **kw: Any,
                            ) -> list[ChunkHeader | None]:
        await self._enter("get_into_many")
        return await self.inner.get_into_many(keys, outs, **kw)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        await self._enter("exists")
        return await self.inner.exists(keys)

    async def prefix_len(self, keys: Sequence[str]) -> int:
        await self._enter("prefix_len")
        return await self.inner.prefix_len(keys)

    async def delete(self, key: str) -> bool:
        await self._enter("delete")
        return await self.inner.delete(key)

    async def list_keys(self) -> AsyncIterator[str]:
        await self._enter("list_keys")
        async for key in self.inner.list_keys():
            yield key

    def used_bytes(self) -> int:
        return self.inner.used_bytes()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    async def flush(self) -> None:
        await self.inner.flush()

    async def close(self) -> None:
        await self.inner.close()


@dataclass(frozen=True)
class ThrottledBackend:
    """Opens `backend`'s store from a URL, behind a ThrottledStore; `opened` lists them."""

    backend: Backend
    delay_s: Mapping[str, float] = field(default_factory=dict)
    fail: Collection[str] = ()
    opened: list[ThrottledStore] = field(default_factory=list)

    def from_url(self, u: StoreURL) -> Store:
        store = ThrottledStore(self.backend.from_url(u), self.delay_s, self.fail)
        self.opened.append(store)
        return store


class SlowChunkIO(ChunkIO):
    """A ChunkIO whose every chunk read starts `delay_s` after it was submitted (a timer
    thread submits it then), so its answer lands late; cancelled meanwhile, or closed, it
    never starts. Everything else is the ChunkIO's own."""

    def __init__(self, delay_s: float, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s
        self._timers: set[threading.Timer] = set()

    def submit_chunk(self, path: Any, dest: Any, key: str | None = None, token_ids: Any = None,
                     trust: Any = None) -> Future:
        late: Future = Future()

        def start() -> None:
            if not late.set_running_or_notify_cancel():
                return  # cancelled before it started
            real = ChunkIO.submit_chunk(self, path, dest, key, token_ids, trust)

            def settle(done: Future) -> None:
                if done.cancelled():
                    late.set_exception(RuntimeError("cancelled inside the ChunkIO"))
                elif done.exception() is not None:
                    late.set_exception(done.exception())
                else:
                    late.set_result(done.result())

            real.add_done_callback(settle)

        def run() -> None:
            self._timers.discard(timer)
            start()

        timer = threading.Timer(self.delay_s, run)
        timer.daemon = True
        self._timers.add(timer)
        timer.start()
        return late

    def close(self) -> None:
        for timer in list(self._timers):
            timer.cancel()  # its read was not started: never will be
        super().close()
