"""What travels between vLLM's scheduler and workers: step metadata, counters as stats, KV events.

The scheduler sends each step's loads and saves to the workers in `KvstashMetadata`; the
workers send back their counters (`KvstashConnectorStats`, also Prometheus counters
`vllm:kvstash_<name>`: `KvstashPromMetrics`) and the chunks they stored or found gone
(`KvstashKVEvents`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents, KVEventAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from connector.core import COUNTERS, KVConnector

# vLLM configures only the loggers under "vllm" (its format, INFO level), so this one is a
# child of it; `_route_kvstash_warnings` sends the store-side warnings there too.
log = logging.getLogger("vllm.kvstash")

# The core's counters (connector.core.COUNTERS) travel in vLLM's KV-connector stats: logged
# in vLLM's periodic "KV Transfer metrics" line and exported as Prometheus counters
# `vllm:kvstash_<name>` (`_total`). The scheduler also reads the workers' load and prefill
# measurements from them, for its load-vs-recompute policy.

# BlockStored events some ranks reported and others not yet, kept by the scheduler (the
# oldest dropped beyond this many).
MAX_WAITING_EVENTS = 65536

# Counted by worker rank 0 alone: every rank of a tensor- or pipeline-parallel engine loads
# and computes its own part of the same prompt tokens.
RANK_ZERO_COUNTERS = ("hit_tokens", "prefill_tokens", "prefill_seconds")


@dataclass
class KvstashConnectorStats(KVConnectorStats):
    """kvstash counters since the last report; vLLM sums them over the scheduler and the
    workers (`aggregate`) and over its logging interval."""

    def reset(self) -> None:
        self.data: dict[str, float] = {}

    def aggregate(self, other: KVConnectorStats) -> KvstashConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: value for name, value in sorted(self.data.items()) if value}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvstashPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per name in COUNTERS, labelled per engine like vLLM's own."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvstash_{name}", documentation=doc,
                                  labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if value and name in self.counters:
                self.counters[name][engine_idx].inc(value)


MEDIUM = "kvstash"  # the medium of kvstash's KV events


class KvstashKVEvents(KVConnectorKVEvents):
    """The KV events of one step's workers; vLLM merges those of several workers into one
    (`add_events`, `increment_workers`) and the scheduler keeps the events every worker
    reported (`aggregate`)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._events = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.add_events(events)

    def aggregate(self) -> KvstashKVEvents:
        common = self._events.get_common_events()
        self._events.clear_events()
        self._events.add_events(common)
        self._events.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._events.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._events.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._events.get_number_of_workers()

    def clear_events(self) -> None:
        self._events.clear_events()
        self._events.reset_workers()


class _ToVllmLogger(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        log.handle(record)


def _route_kvstash_warnings() -> None:
    """Send warnings of kvstash's own loggers (store loop, write-behind) through vLLM's
    handlers, once per process, unless the application configured "kvstash" itself."""
    root = logging.getLogger("kvstash")
    if not root.handlers:
        root.addHandler(_ToVllmLogger())


@dataclass
class ChunkRef:
    """One chunk of one request. `block_hash` is vLLM's hash of its last block; `first`
    skips blocks of a load that the GPU prefix cache already holds. `token_bytes` are the
    chunk's token ids as little-endian uint32, the form chunk headers hold them in: they
    go to the workers with every step's metadata, where a list of ints takes several
    times as long to pickle and unpickle, and longer to check against a header."""

    block_hash: bytes
    token_bytes: bytes
    block_ids: list[int]  # of KV cache group 0 (the only one of a full-attention model)
    first: int = 0
    # Of a model with several KV cache groups (vLLM's hybrid manager: sliding-window
    # beside full-attention layers), every group's blocks of the chunk, group 0's first;
    # empty with one group.
    groups: list[list[int]] = field(default_factory=list)
    # For KV events only (else empty): vLLM's hashes of every block of the chunk, and of
    # the block before it, and the rest of what vLLM's own BlockStored says of them
    # (`event_fields`).
    block_hashes: list[Any] = field(default_factory=list)  # as vLLM publishes them
    parent_hash: Any = None
    event_fields: dict[str, Any] = field(default_factory=dict)

    @property
    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.token_bytes, dtype="<u4")

    def ids(self, group: int) -> list[int]:
        """The chunk's blocks in KV cache group `group`."""
        return self.groups[group] if self.groups else self.block_ids

    def all_ids(self) -> list[int]:
        """The chunk's blocks in every group."""
        return [b for ids in self.groups for b in ids] if self.groups else self.block_ids


@dataclass
class ReqChunks:
    req_id: str
    chunks: list[ChunkRef]
    deadline_s: float | None = None  # loads: the policy's bound on waiting for them
    sync: bool = False  # loads: within the step, each layer waited for before it computes
    absent: bool = False  # saves: the request's lookup found the store's prefix ends before them
    handoff: bool = False  # saves: stored before the step ends (`handoff_requested`)


@dataclass
class KvstashMetadata(KVConnectorMetadata):
    loads: list[ReqChunks] = field(default_factory=list)
    saves: list[ReqChunks] = field(default_factory=list)
    prefill_tokens: int = 0  # prompt tokens this step computes (the workers time it)
    # P/D prefills whose prompt this step completes: their saves, this step's and earlier
    # ones', are stored before it ends (`_hand_off`)
    handoffs: list[str] = field(default_factory=list)
    idle: bool = False  # the step computes nothing: its workers may wait for its loads
    step_tokens: int = 0  # tokens the step computes, every request's
    epoch: str = ""  # the key space since vLLM last reset the connector's cache (`reset_cache`)


class CounterDeltas:
    """The growth of a core's counters since the last `take` (vLLM asks every step, on
    each side). `rank_zero_only`: drop RANK_ZERO_COUNTERS (a worker of rank > 0)."""

    def __init__(self, core: KVConnector, rank_zero_only: bool = False):
        self.core = core
        self.rank_zero_only = rank_zero_only
        self._reported: dict[str, float] = {}  # counters already handed to vLLM's stats

    def take(self) -> KvstashConnectorStats | None:
        now = self.core.counters()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        if self.rank_zero_only:
            # vLLM sums the workers' stats: with several ranks (tensor or pipeline
            # parallel) each loads and computes its own part of the same prompt tokens,
            # so tokens and prefill time are counted by rank 0 alone. Chunks and bytes are
            # per rank, each rank's part being a chunk of its own in the store.
            for name in RANK_ZERO_COUNTERS:
                delta.pop(name, None)
        delta = {k: v for k, v in delta.items() if v}
        return KvstashConnectorStats(data=delta) if delta else None


def external_hash(block_hash: bytes) -> Any:
    """A block hash as vLLM's own KV events publish it (by default its last 8 bytes as an
    int, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), so that a router matches kvstash's
    events with vLLM's and with the hashes it computes itself."""
    return maybe_convert_block_hash(bytes(block_hash))


# vLLM's null block (vllm/v1/core/block_pool.py: the first block of the pool, never handed
# to a request's computation): a request's block list holds it in place of blocks whose
# K/V the model no longer reads, e.g. those outside a sliding window. Its bytes are shared
# scratch: nothing is loaded into it, and no chunk holding it is saved.
NULL_BLOCK_ID = 0
