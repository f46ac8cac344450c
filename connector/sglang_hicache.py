"""`KvstashHiCache`: an SGLang (0.5.x) HiCache storage backend (L3) over a kvstash store.

Loaded by SGLang's `dynamic` backend hook, with no SGLang patch:

    --enable-hierarchical-cache --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name": "kvstash",
      "module_path": "connector.sglang_hicache", "class_name": "KvstashHiCache",
      "store": "file:///mnt/nfs/kv"}'

Keys are SGLang's own page hashes (hex SHA-256 chained over each page's tokens), never
recomputed, moved into our key space under a `Namespace` of the model, host-pool dtype,
layout and page geometry, and the TP rank (MLA ranks share one copy) and PP stage.

The backend runs on the engine core, `connector.KVConnector`: lookups behind its circuit
breaker, verified reads (key, layout, checksum) through direct reads where the store has
them, writes through its write-behind queue, one set of counters (`stats()`). SGLang's
cache controller decides what to prefetch, so the core's load-vs-recompute policy does
not apply here; its deadline does (`load_deadline_s`: the bound of one batch).

Threading contract (SGLang's): the cache controller calls `batch_exists`,
`batch_get_v1` and `batch_set_v1` from its prefetch and backup threads, never from the
scheduler, and expects them to return when the I/O is done; each call is one batch on
the core, bounded by `lookup_timeout_s` (an existence check) or the load deadline (a read
or a write: `KVConnector.max_load_wait_s`). A failure is a False for that page (SGLang then stops
the hit there), never an exception.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from connector.buffers import BufferPool, staging_tensor
from connector.core import Buffers, KVConnector
from connector.layout import EngineLayout
from connector.options import CoreOptions
from hashing import Namespace, keys_from_block_hashes

log = logging.getLogger("kvstash.connector.sglang")

FORMAT = "sglang-hicache-v1"
WHERE = "hicache-storage-backend-extra-config"
# `timeout_s`, the former name of both `lookup_timeout_s` and `load_deadline_s`, is still
# read (with a warning).
DEPRECATED = {"timeout_s": ("lookup_timeout_s", "load_deadline_s")}


def hicache_namespace(
    config: HiCacheStorageConfig, host_pool: Any, page_bytes: int, salt: str = "",
) -> Namespace:
    """Everything that makes two SGLang host pages with equal page hashes incompatible."""
    layout = (
        f"{FORMAT};layout={host_pool.layout};page_bytes={page_bytes};"
        f"pp={config.pp_rank}/{config.pp_size};cp={config.attn_cp_rank}/{config.attn_cp_size}"
    )
    rank, world = (0, 1) if config.is_mla_model else (config.tp_rank, config.tp_size)
    return Namespace(
        model=config.model_name or "unknown", dtype=str(host_pool.dtype).removeprefix("torch."),
        layout=layout, chunk_tokens=host_pool.page_size, rank=rank, world_size=world, salt=salt,
    )


class KvstashHiCache(HiCacheStorage):
    """Extra config (besides the hook's three): `store` (URL or list of URLs), `salt`,
    and the core's options every adapter takes (connector.options: `lookup_timeout_s`,
    `load_deadline_s`, `max_in_flight`, `breaker_*`). Other keys are SGLang's."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        extra = storage_config.extra_config or {}
        if not extra.get("store"):
            raise ValueError(
                "hicache-storage-backend-extra-config needs 'store' (e.g. file:///mnt/kv)"
            )
        self.config = storage_config
        self.salt = str(extra.get("salt", ""))
        self.options = CoreOptions.parse(extra, WHERE, aliases=DEPRECATED)
        self.ns: Namespace | None = None
        self.store_urls = extra["store"]
        self.core: KVConnector | None = None
        self._pages: BufferPool | None = None  # read staging, kept between batches
        self._pages_max = 0  # the most pages one batch has read

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        self.page_nbytes = page.numel() * page.element_size()
        self.ns = hicache_namespace(self.config, mem_pool_host, self.page_nbytes, self.salt)
        if self.core is not None:
            self.core.close()
        self.core = KVConnector(
            self.store_urls, self.ns,
            layout=EngineLayout.of(self.page_nbytes, engine=FORMAT),
            **self.options.core_kwargs(),
        )
        self._pages = BufferPool(self._page_buffer, lambda: self._pages_max)
        log.info("SGLang HiCache storage on %s, namespace %s", self.core.store, self.ns.id)

    @property
    def _core(self) -> KVConnector:
        assert self.core is not None, "register_mem_pool_host must come first"
        return self.core

    def stats(self) -> dict[str, Any]:
        """The engine core's counters and state (connector.core.COUNTERS)."""
        return self.core.stats() if self.core is not None else {}

    def _keys(self, keys: list[str]) -> list[str]:
        assert self.ns is not None, "register_mem_pool_host must come first"
        return keys_from_block_hashes(keys, self.ns)

    def _read(self, keys: list[str], pages: list[torch.Tensor]) -> tuple[list[bool], bool]:
        """Read, verify and copy pages into `pages` (host memory), within the load
        deadline: per page whether it was read, and whether every read has ended (a read
        cut short by the deadline may yet write its page)."""
        core = self._core
        wait_s = core.max_load_wait_s
        handle = core.load_async(self._keys(keys), [()] * len(keys), Buffers(pages), wait_s)
        ok = handle.result(wait_s + 1.0)
        return ok, handle.done() and not handle.stalled

    def _write(self, keys: list[str], payload: Any) -> list[bool]:
        """Write pages through the core's queue; waits up to the load deadline for the
        answer."""
        core = self._core
        wait_s = core.max_load_wait_s
        future = core.write(self._keys(keys), None, payload)
        try:
            return future.result(wait_s)
        except Exception as exc:  # noqa: BLE001 - storage trouble is a miss, never an error
            log.warning("HiCache storage on %s: write not done in %.1f s: %s",
                        core.store, wait_s, exc or type(exc).__name__)
            return [False] * len(keys)

    def _page_buffer(self) -> torch.Tensor:
        kind = "direct" if self._core.reads_direct else "host"
        return staging_tensor(kind, self.page_nbytes, torch.device("cpu"))

    # -- the interface SGLang's cache controller uses -----------------------------------

    def clear(self) -> None:
        """SGLang's `/hicache/storage-backend/clear`, and its release of L3 storage on a
        P/D role switch: nothing is deleted and the key space stays (the store may be
        shared with other engines, and its pages stay valid for this one: SGLang calls
        this on no weight update); said in one log line, so that no one takes the store
        for empty."""
        log.warning("SGLang asked to clear its HiCache storage: kvstash deletes nothing "
                    "from %s, which other engines may share, and this engine goes on "
                    "reading it (`kvstash gc` removes chunks; a new `salt` starts an empty "
                    "key space)", self.core.store if self.core is not None else "the store")

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> int:
        return self._core.lookup_async(self._keys(keys)).result()

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        pool = self.mem_pool_host
        starts = [int(x) for x in host_indices[:: pool.page_size]]
        free = self._pages
        assert free is not None, "register_mem_pool_host must come first"
        self._pages_max = max(self._pages_max, len(keys))
        pages = [free.take() for _ in keys]
        ok, ended = self._read(keys, pages)
        for i, good in enumerate(ok):
            if good:
                pool.set_from_flat_data_page(starts[i], pages[i].view(pool.dtype))
        if ended:  # no read is still writing them
            for page in pages:
                free.give(page)
        return ok

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        pool = self.mem_pool_host
        starts = [int(x) for x in host_indices[:: pool.page_size]]

        def payload(i: int) -> Any:  # on the core's worker thread, while SGLang waits
            return pool.get_data_page(starts[i], flat=True).contiguous().view(torch.uint8).numpy()

        return self._write(keys, payload)

    # -- the older per-key interface, still abstract in HiCacheStorage -------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None,
    ) -> torch.Tensor | None:
        out = self._page_buffer()
        if not self._read([key], [out])[0][0]:
            return None
        page = out.view(self.mem_pool_host.dtype)
        if target_location is not None:
            target_location.copy_(page.view_as(target_location))
            return target_location
        return page

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        targets = target_locations or [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None,
    ) -> bool:
        payload = value.contiguous().view(torch.uint8).numpy()
        return self._write([key], lambda i: payload)[0]

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        payloads = [v.contiguous().view(torch.uint8).numpy() for v in values]
        return all(self._write(keys, payloads.__getitem__))

    def close(self) -> None:
        """Flush and release the store (SGLang has no hook for it; call at shutdown)."""
        if self.core is not None:
            self.core.close()
            self.core = None
