"""KvstashHiCache through SGLang 0.5.23's own HiCache storage interface and `dynamic` hook.

Real SGLang pieces: `HiCacheStorage` (the ABC we subclass), `HiCacheStorageConfig`,
`StorageBackendFactory.create_backend("dynamic", ...)` and the page hashes of
`sglang.srt.mem_cache.utils.get_hash_str`. One stand-in: the host KV pool. SGLang's host
pools (`sglang.srt.mem_cache.pool_host`) import `sglang.srt.configs`, which imports
torchvision, whose only wheels require torch >= 2.14 (this machine has the 2.13 CPU
wheel), so `LayerFirstHostPool` below mirrors the page methods of SGLang's
`MHATokenToKVPoolHost` in its `layer_first` layout: `get_data_page`,
`set_from_flat_data_page`, `get_dummy_flat_data_page`, `page_size`, `dtype`, `layout`.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang not installed (scripts/install-engines.sh)",
)

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from connector.sglang_hicache import KvstashHiCache  # noqa: E402
from tests.engines_fixtures import corrupt_chunks, engine_store_url  # noqa: E402

pytest_plugins = ("tests.s3_fixtures",)  # moto_s3_url, for the s3 store cases

PAGE = 16


class LayerFirstHostPool:
    """Stand-in for SGLang's MHATokenToKVPoolHost (layout="layer_first"); see the module doc."""

    layout = "layer_first"

    def __init__(self, pages: int = 16, layers: int = 2, heads: int = 2, head_dim: int = 8):
        self.page_size, self.dtype = PAGE, torch.bfloat16
        self.shape = (2, layers, PAGE, heads, head_dim)
        self.kv_buffer = torch.zeros(2, layers, pages * PAGE, heads, head_dim, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index : index + PAGE] = data_page.reshape(self.shape)


def backend(store: str, pool: LayerFirstHostPool, tp_rank: int = 0) -> KvstashHiCache:
    """What SGLang's cache controller does with --hicache-storage-backend dynamic."""
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="test/tiny-llama",
        extra_config={"backend_name": "kvstash", "module_path": "connector.sglang_hicache",
                      "class_name": "KvstashHiCache", "store": store},
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(storage, KvstashHiCache)
    storage.register_mem_pool_host(pool)
    return storage


def page_keys(tokens: list[int]) -> list[str]:
    return get_hash_str(tokens, page_size=PAGE)


@pytest.fixture(params=["memory", "file", "s3"])
def store_url(request, tmp_path):
    return engine_store_url(request, tmp_path)


def write_pages(store: str, keys: list[str]) -> tuple[KvstashHiCache, LayerFirstHostPool]:
    pool = LayerFirstHostPool()
    pool.kv_buffer[:, :, : len(keys) * PAGE] = torch.randn(
        2, 2, len(keys) * PAGE, 2, 8).to(pool.dtype)
    storage = backend(store, pool)
    assert storage.batch_set_v1(keys, torch.arange(len(keys) * PAGE)) == [True] * len(keys)
    return storage, pool


def test_pages_saved_by_one_rank_set_load_into_another_pool(store_url):
    keys = page_keys(list(range(64)))
    writer, source = write_pages(store_url, keys)
    target = LayerFirstHostPool()
    reader = backend(store_url, target)
    try:
        assert reader.batch_exists(keys) == 4
        # into other host slots (pages 5..8) than they were saved from (0..3)
        assert reader.batch_get_v1(keys, torch.arange(5 * PAGE, 9 * PAGE)) == [True] * 4
    finally:
        writer.close()
        reader.close()
    loaded, saved = target.kv_buffer[:, :, 5 * PAGE : 9 * PAGE], source.kv_buffer[:, :, : 4 * PAGE]
    assert torch.equal(loaded, saved)


def test_batch_exists_counts_the_leading_hits(store_url):
    keys = page_keys(list(range(64)))
    writer, _ = write_pages(store_url, keys[:2])
    try:
        assert writer.batch_exists(keys) == 2
        assert writer.batch_exists(page_keys(list(range(100, 164)))) == 0
        assert writer.exists(keys[0]) and not writer.exists(keys[3])
    finally:
        writer.close()


def test_a_clear_deletes_nothing_and_says_so(tmp_path, caplog):
    """SGLang's `/hicache/storage-backend/clear` (and its L3 release on a P/D role switch,
    which must not cut the instance off a store shared with its peers): every page is
    still there and still read, and the log says why."""
    url = f"file://{tmp_path}/kv"
    keys = page_keys(list(range(32)))
    writer, _ = write_pages(url, keys)
    try:
        with caplog.at_level("WARNING", logger="kvstash.connector.sglang"):
            writer.clear()
        assert writer.batch_exists(keys) == 2
    finally:
        writer.close()
    assert any("deletes nothing" in r.getMessage() for r in caplog.records)
    assert len(list((tmp_path / "kv").rglob("*.kv"))) == 2


def test_other_tp_rank_does_not_see_the_pages(store_url):
    keys = page_keys(list(range(32)))
    writer, _ = write_pages(store_url, keys)
    other = backend(store_url, LayerFirstHostPool(), tp_rank=1)
    try:
        assert other.batch_exists(keys) == 0
    finally:
        writer.close()
        other.close()


def test_corrupt_pages_fail_only_themselves(tmp_path):
    url = f"file://{tmp_path}/kv"
    keys = page_keys(list(range(48)))
    writer, _ = write_pages(url, keys)
    writer.close()
    assert corrupt_chunks(tmp_path / "kv") == 3
    target = LayerFirstHostPool()
    reader = backend(url, target)
    try:
        assert reader.batch_get_v1(keys, torch.arange(3 * PAGE)) == [False] * 3
    finally:
        reader.close()
    assert not target.kv_buffer.any()


def test_per_key_interface_round_trips(store_url):
    pool = LayerFirstHostPool()
    storage = backend(store_url, pool)
    (key,) = page_keys(list(range(16)))
    page = torch.randn(pool.shape).to(pool.dtype).flatten()
    try:
        assert storage.set(key, page)
        assert torch.equal(storage.get(key), page)
        assert storage.get(page_keys(list(range(1, 17)))[0]) is None
    finally:
        storage.close()


@pytest.mark.parametrize("option, message", [
    ({"lookup_timeout_s": -1}, "lookup_timeout_s=-1 must be a positive number"),
    ({"max_in_flight": "many"}, "max_in_flight='many' must be a positive whole number"),
])
def test_bad_options_are_refused_at_start_in_the_line_every_adapter_gives(option, message):
    """The backend takes the core's options under the names the vLLM connector and tier
    use (connector.options), checked the same way."""
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="test/tiny-llama", extra_config={"store": "memory://", **option},
    )
    with pytest.raises(ValueError, match=f"^hicache-storage-backend-extra-config: {message}"):
        KvstashHiCache(config)
