"""`KvstashHiCache`: an SGLang (0.5.x) HiCache storage backend (L3) over a kvstash store.

Loaded by SGLang's `dynamic` backend hook, with no SGLang patch:

    --enable-hierarchical-cache --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name": "kvstash",
      "module_path": "connector.sglang_hicache", "class_name": "KvstashHiCache",
      "store": "file:///mnt/nfs/kv"}'

Keys are SGLang's own page hashes (hex SHA-256 chained over each page's tokens), never
recomputed, moved into our key space under a `Namespace` of the model, host-pool dtype,
layout and page geometry, and the TP rank (MLA ranks share one copy) and PP stage.

Threading contract (SGLang's): the cache controller calls `batch_exists`,
`batch_get_v1` and `batch_set_v1` from its prefetch and backup threads, never from the
scheduler, and expects them to return when the I/O is done; each call is one batch on
the store loop (`connector.engine_io.StoreLoop`), bounded by `timeout_s`. A failure is a
False for that page (SGLang then stops the hit there), never an exception.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from connector.engine_io import StoreLoop, each_bounded
from hashing import Namespace, keys_from_block_hashes
from storage.base import Store
from storage.codec import encode_chunk

log = logging.getLogger("kvstash.connector.sglang")

FORMAT = "sglang-hicache-v1"


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
    `timeout_s` (deadline of one batch, default 10), `max_in_flight` (default 16)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        extra = storage_config.extra_config or {}
        if not extra.get("store"):
            raise ValueError(
                "hicache-storage-backend-extra-config needs 'store' (e.g. file:///mnt/kv)"
            )
        self.config = storage_config
        self.salt = str(extra.get("salt", ""))
        self.timeout_s = float(extra.get("timeout_s", 10.0))
        self.max_in_flight = int(extra.get("max_in_flight", 16))
        self.ns: Namespace | None = None
        self.io = StoreLoop.shared(extra["store"])

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        self.page_nbytes = page.numel() * page.element_size()
        self.ns = hicache_namespace(self.config, mem_pool_host, self.page_nbytes, self.salt)
        log.info("SGLang HiCache storage on %s, namespace %s", self.io.store, self.ns.id)

    def _keys(self, keys: list[str]) -> list[str]:
        assert self.ns is not None, "register_mem_pool_host must come first"
        return keys_from_block_hashes(keys, self.ns)

    def _run(self, fn: Any, default: Any) -> Any:
        try:
            return self.io.call(fn, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - storage trouble is a miss, never an error
            log.warning("HiCache storage on %s failed: %s", self.io.store, exc)
            return default

    # -- the interface SGLang's cache controller uses -----------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> int:
        ours = self._keys(keys)
        return self._run(lambda store: store.prefix_len(ours), 0)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        ours, pool = self._keys(keys), self.mem_pool_host
        starts = [int(x) for x in host_indices[:: pool.page_size]]

        async def read(store: Store) -> list[bool]:
            async def one(i: int) -> bool:
                page = torch.empty(self.page_nbytes, dtype=torch.uint8)
                header = await store.get_into(ours[i], page.numpy())
                if header is None or header.payload_len != self.page_nbytes:
                    return False
                pool.set_from_flat_data_page(starts[i], page.view(pool.dtype))
                return True

            return await each_bounded(one, len(ours), self.max_in_flight)

        return self._run(read, [False] * len(keys))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        ours, pool = self._keys(keys), self.mem_pool_host
        starts = [int(x) for x in host_indices[:: pool.page_size]]
        meta = {"engine": FORMAT}

        async def write(store: Store) -> list[bool]:
            present = await store.exists(ours)

            async def one(i: int) -> bool:
                if present[i]:
                    return True
                page = pool.get_data_page(starts[i], flat=True).contiguous()
                payload = page.view(torch.uint8).numpy()
                blob = await asyncio.to_thread(encode_chunk, ours[i], (), payload, meta)
                await store.put(ours[i], blob)
                return True

            return await each_bounded(one, len(ours), self.max_in_flight)

        return self._run(write, [False] * len(keys))

    # -- the older per-key interface, still abstract in HiCacheStorage -------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None,
    ) -> torch.Tensor | None:
        (ours,) = self._keys([key])
        out = torch.empty(self.page_nbytes, dtype=torch.uint8)
        header = self._run(lambda store: store.get_into(ours, out.numpy()), None)
        if header is None or header.payload_len != self.page_nbytes:
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
        (ours,) = self._keys([key])
        payload = value.contiguous().view(torch.uint8).numpy()

        async def put(store: Store) -> bool:
            await store.put(ours, encode_chunk(ours, (), payload, {"engine": FORMAT}))
            return True

        return self._run(put, False)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return all([self.set(k, v) for k, v in zip(keys, values, strict=True)])

    def close(self) -> None:
        """Flush and release the store (SGLang has no hook for it; call at shutdown)."""
        self.io.release()
