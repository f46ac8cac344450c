"""Stand-ins for the vLLM names `connector.vllm_v1` imports, for a GPU host without vLLM.

The GPU hosts the CUDA checks run on have no package registry, and vLLM's CUDA build is
too large to carry there, so `tests/test_vllm_v1_cuda.py` and `kvstash bench vllm-gpu-worker` run the connector's worker side
on CUDA tensors against these instead. They copy only what the worker side touches:
the base class's metadata binding, the metadata and stats bases, the role enum and the KV
event types. Where vLLM is installed, `import_connector` uses it.
"""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    pass


class KVConnectorBase_V1:  # noqa: N801 - vLLM's name
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None


class SupportsHMA:
    pass


@dataclass
class KVConnectorTransferResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass
class KVConnectorStats:
    data: dict[str, Any] = field(default_factory=dict)


class KVConnectorPromMetrics:
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        self._kv_transfer_config = vllm_config.kv_transfer_config


@dataclass
class KVCacheEvent:
    pass


@dataclass
class BlockStored(KVCacheEvent):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


@dataclass
class BlockRemoved(KVCacheEvent):
    block_hashes: list[Any]
    medium: str | None = None


class KVConnectorKVEvents:
    pass


class KVEventAggregator:
    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.events: list[KVCacheEvent] = []

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events.extend(events)


class CacheHitSource(enum.Enum):
    HOST = "host"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"

    @classmethod
    def outermost(cls, sources: Any) -> CacheHitSource:
        order = list(cls)
        return max(sources, key=order.index)


def generate_block_hash_extra_keys(request: Any, start: int, end: int,
                                   mm_index: int) -> tuple[None, int]:
    return None, mm_index  # no LoRA, salt or multimodal items without vLLM's requests


def to_event_extra_keys(extra_keys: list[Any]) -> list[Any] | None:
    return list(extra_keys) or None


MODULES: dict[str, dict[str, Any]] = {
    "vllm": {},
    "vllm.config": {"VllmConfig": object},
    "vllm.distributed": {},
    "vllm.distributed.kv_events": {
        "BlockRemoved": BlockRemoved, "BlockStored": BlockStored, "KVCacheEvent": KVCacheEvent,
        "KVConnectorKVEvents": KVConnectorKVEvents, "KVEventAggregator": KVEventAggregator,
    },
    "vllm.distributed.kv_transfer": {},
    "vllm.distributed.kv_transfer.kv_connector": {},
    "vllm.distributed.kv_transfer.kv_connector.v1": {},
    "vllm.distributed.kv_transfer.kv_connector.v1.base": {
        "KVConnectorBase_V1": KVConnectorBase_V1, "KVConnectorMetadata": KVConnectorMetadata,
        "KVConnectorRole": KVConnectorRole, "SupportsHMA": SupportsHMA,
        "KVConnectorTransferResults": KVConnectorTransferResults,
    },
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics": {
        "KVConnectorPromMetrics": KVConnectorPromMetrics, "KVConnectorStats": KVConnectorStats,
    },
    "vllm.v1": {},
    "vllm.v1.core": {},
    "vllm.v1.core.kv_cache_utils": {
        "generate_block_hash_extra_keys": generate_block_hash_extra_keys,
        "maybe_convert_block_hash": bytes, "to_event_extra_keys": to_event_extra_keys,
    },
    "vllm.v1.metrics": {},
    "vllm.v1.metrics.cache_hit_source": {"CacheHitSource": CacheHitSource},
}


def worker_config(store: str, block_size: int, **extra: Any) -> SimpleNamespace:
    """What the connector reads of a `VllmConfig`, for a worker of one rank driven by hand
    (vLLM's own config needs a platform vLLM supports): `extra` goes to
    `kv_connector_extra_config` (a `model` name is required there without a model config)."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_both",
                                           kv_connector_extra_config={"store": store, **extra}),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto",
                                     prefix_caching_hash_algo="sha256"),
        model_config=None,
        parallel_config=SimpleNamespace(rank=0, world_size=1, tensor_parallel_size=1),
        kv_events_config=None,
    )


def import_connector() -> Any:
    """`connector.vllm_v1`, imported against vLLM where it is installed, else against these
    stand-ins, which leave `sys.modules` again once it is imported (so that other test
    modules still see that vLLM is missing and skip)."""
    import importlib

    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        return importlib.import_module("connector.vllm_v1")
    if "connector.vllm_v1" in sys.modules:
        return sys.modules["connector.vllm_v1"]
    for name, attrs in MODULES.items():
        module = types.ModuleType(name, "kvstash test stand-in (bench/vllm_standin.py)")
        module.__path__ = []  # a package: its submodules resolve from sys.modules
        module.__dict__.update(attrs)
        sys.modules[name] = module
    try:
        return importlib.import_module("connector.vllm_v1")
    finally:
        for name in MODULES:
            sys.modules.pop(name, None)
