"""`KvstashScheduler`: the vLLM connector's scheduler side — lookups, load decisions, metadata.

Runs in vLLM's engine core process, on its scheduler thread, which must never wait on
storage. `get_num_new_matched_tokens` starts one batched existence check per request
(`KVConnector.start_lookup`), waits up to `lookup_wait_ms` for it (up to
`lookup_idle_wait_ms` when the request is the only one in the engine), and answers None
("ask again next step") until it resolves (within `lookup_timeout_s`; a failure or
timeout is no hit), or until it has taken as long as recomputing the chunks it asked for
(`LookupPoll`: no hit either). The core's policy then decides how many of the stored
chunks are worth loading, from the load and prefill speeds the workers measure and
report through vLLM's KV-connector stats. Hits load asynchronously between steps (the
request waits in WAITING_FOR_REMOTE_KVS, other requests keep running), or within the
step, layer by layer (`load_mode`). `build_connector_meta` ships this step's loads (with
the policy's deadline) and the chunks each request completes this step (of its prompt,
and with `save_decode` of the tokens it generates) to the workers (`KvstashMetadata`).
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_events import BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

from connector.inflight import InFlightLoads
from connector.lookup import LookupPoll
from connector.vllm_config import UNSEEDED_HASHES, VllmSettings
from connector.vllm_meta import (
    MAX_WAITING_EVENTS,
    NULL_BLOCK_ID,
    ChunkRef,
    CounterDeltas,
    KvstashConnectorStats,
    KvstashKVEvents,
    KvstashMetadata,
    ReqChunks,
    external_hash,
)
from hashing import keys_from_block_hashes, token_array

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvstash")

# How long a request whose first chunk to load another request's async load is bringing in
# waits for that load (then vLLM's prefix cache holds the chunk) before it loads its own.
WAIT_FOR_OTHER_LOAD_S = 10.0
# Chunks not saved for being too short (`_worth_saving`) remembered, to be saved after all
# by a longer request that finds them in vLLM's own prefix cache.
UNSAVED_REMEMBERED = 1 << 14


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
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
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
    worth_saving: bool = False  # long enough that a hit of it would be loaded (`_worth_saving`)
    unsaved_chunks: int = 0  # its chunks not saved so far for being too short (counted once)
    unsaved_from: int = 0  # of the chunks vLLM held at the lookup, the first never saved
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
        tokens = self.prompt_tokens()
        assert tokens is not None
        return self.request.num_tokens if len(tokens) == prompt else prompt

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


def handoff_requested(request: Request) -> bool:
    """Whether the request is the prefill half of a disaggregated pair: vLLM's P/D
    proxies mark it with kv_transfer_params {"do_remote_decode": true}. Its chunks are
    stored before its step ends, so that its reply reaches the proxy only once the decode
    instance, which gets the request next, can load them."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("do_remote_decode") is True


class KvstashScheduler:
    """The scheduler side of `KvstashConnector` (module docstring): built only in vLLM's
    scheduler role, called on its scheduler thread."""

    def __init__(self, vllm_config: VllmConfig, settings: VllmSettings):
        self.settings = settings
        self.block_size = settings.block_size
        self.chunk_tokens, self.chunk_blocks = settings.chunk_tokens, settings.chunk_blocks
        self.rank = settings.rank
        self.key_spaces = settings.key_spaces
        self.lookup_wait_s = settings.lookup_wait_s
        self.lookup_idle_wait_s = settings.lookup_idle_wait_s
        self.load_mode, self.auto_layerwise = settings.load_mode, settings.auto_layerwise
        self.loads, self.saves, self.producer = settings.loads, settings.saves, settings.producer
        self.handoff_timeout_s = settings.handoff_timeout_s
        self.save_decode, self.save_all = settings.save_decode, settings.save_all
        self.kv_events = settings.kv_events
        self.core = settings.core(worker=False)
        self.stats = CounterDeltas(self.core)
        self._reqs: dict[str, _Req] = {}
        self._loads: list[ReqChunks] = []
        # Chunks async loads are bringing in, by vLLM's hash of the chunk's last block.
        self._loading_chunks = InFlightLoads(WAIT_FOR_OTHER_LOAD_S)
        # Requests' INFO lines, written at the next step (`_write_request_lines`).
        self._request_lines: list[tuple[Any, ...]] = []
        self._chunk_nbytes_seen = 0  # one chunk's payload, as the workers report it
        # vLLM's hash of the last block of each chunk computed here and not saved, for
        # being too short to be worth loading (`_worth_saving`): a later request that finds
        # it in vLLM's own prefix cache saves it after all once that request is worth saving.
        # Bounded; a chunk forgotten here is only a chunk never saved (fewer hits elsewhere).
        self._unsaved: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self._collected: KvstashKVEvents | None = None  # the workers' events
        # A BlockStored goes out once every rank that saves (one per key space in
        # `lookup_ns`) has reported it; ranks' saves end in different steps, so the count
        # is kept across steps.
        self._stored_reports: collections.Counter[KVCacheEvent] = collections.Counter()
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

    def get_kv_connector_stats(self) -> KvstashConnectorStats | None:
        return self.stats.take()

    def _lookup_keys(self, req: Request, n: int) -> list[list[str]]:
        """Per rank, the keys of the request's first `n` chunks, from vLLM's block hashes
        alone: a lookup and the page-cache check need no token ids (building the chunks
        with theirs is a measurable part of a lookup: docs/benchmarks/2026-11-26-vllm.md)."""
        last = [self._chunk_hash(req, c) for c in range(n)]
        return [keys_from_block_hashes(last, ns) for ns in self.key_spaces.lookup_ns]

    def _chunk_hash(self, req: Request, c: int) -> Any:
        """vLLM's hash of chunk `c`'s last block: the chunk's identity, its whole prefix in it."""
        return req.block_hashes[(c + 1) * self.chunk_blocks - 1]

    def _chunk_refs(self, st: _Req, start: int, stop: int, first_block: int = 0) -> list[ChunkRef]:
        req, k = st.request, self.chunk_blocks
        hashes, n = req.block_hashes, self.chunk_tokens
        hybrid = len(st.block_ids) > 1
        return [
            ChunkRef(
                block_hash=bytes(hashes[(c + 1) * k - 1]),
                token_bytes=st.token_ids(c * n, (c + 1) * n).tobytes(),
                block_ids=st.block_ids[0][c * k : (c + 1) * k] if st.block_ids else [],
                groups=[ids[c * k : (c + 1) * k] for ids in st.block_ids] if hybrid else [],
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
            st.unsaved_from = self._first_unsaved(req, first)
            if n <= first:
                st.saved_chunks = max(st.saved_chunks, st.unsaved_from)
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
        # Already stored, but for a chunk vLLM held that no request here saved.
        st.saved_chunks = max(st.saved_chunks, stored if st.unsaved_from >= st.lookup_from
                              else min(stored, st.unsaved_from))
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
        if self.settings.groups.fails_whole_requests:
            st.sync = False  # vLLM takes a failed load of such a model between steps only
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
        self._move_to_epoch(secrets.token_hex(8))
        for st in self._reqs.values():
            if st.lookup is not None:
                st.lookup.cancel()
            st.load = st.save = False
        log.warning("kvstash: vLLM reset the connector's cache (e.g. around a weight "
                    "update): chunks stored before are no longer read by this engine, which "
                    "stores its new ones in a key space of its own (epoch %s)", self.key_spaces.epoch)
        return True


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
        st.block_ids = [list(ids) for ids in blocks.get_block_ids()]
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
        held = min((len(ids) for ids in st.block_ids), default=0)
        limit = min(limit, held // self.chunk_blocks)
        if limit > st.saved_chunks and not self._worth_saving(st, limit):
            counted = max(st.saved_chunks, st.unsaved_chunks)
            if limit > counted:
                self.core.count(unsaved_chunks=limit - counted)
                st.unsaved_chunks = limit
                for c in range(counted, limit):
                    self._unsaved[self._chunk_hash(req, c)] = None
                while len(self._unsaved) > UNSAVED_REMEMBERED:
                    self._unsaved.popitem(last=False)
            return
        if limit > st.saved_chunks:
            # Chunks from the end of the stored prefix on were missing at the lookup; after
            # a failed load (saved_chunks cut below it) write-behind asks the store again,
            # as it does for chunks holding generated tokens (another engine may have
            # generated the same reply).
            absent = (st.stored is not None and st.saved_chunks >= st.stored
                      and limit * self.chunk_tokens <= req.num_prompt_tokens)
            # A chunk holding vLLM's null block in any group has blocks whose K/V is gone
            # (outside a sliding window, before this step; or freed and handed to another
            # request: `_forget_reused`): it is not saved, as a hit needs every layer of
            # it (a sliding layer's part inside the window at that hit's end).
            chunks = [c for c in self._chunk_refs(st, st.saved_chunks, limit)
                      if NULL_BLOCK_ID not in c.all_ids()]
            if chunks:
                out.append(ReqChunks(req.request_id, chunks, absent=absent, handoff=st.handoff))
                if self._unsaved:
                    for ref in chunks:
                        self._unsaved.pop(ref.block_hash, None)
            st.saves_planned += len(chunks)
            st.saved_chunks = limit

    def _worth_saving(self, st: _Req, chunks: int) -> bool:
        """Whether a request's first `chunks` chunks are worth saving: a prefix whose
        predicted load, the store's lookup included, takes this engine far longer than
        recomputing it (`KVConnector.worth_saving`: a short prompt on a far store) is not
        written (its gather would cost the step that computed it, and its writes the
        store's requests, for no reader like this engine), until the request (its reply
        too, with `save_decode`) grows long enough; then it is saved from its first
        chunk. A P/D prefill (its decode reads it) and `save_all` save everything."""
        if st.worth_saving or st.handoff or self.save_all:
            return True
        st.worth_saving = self.core.worth_saving(chunks * self.chunk_tokens)
        return st.worth_saving

    def _first_unsaved(self, req: Request, held: int) -> int:
        """Of a request's first `held` chunks (vLLM's own prefix cache holds them, so they
        are not looked up and were taken as stored), the first that a request here
        computed and did not save (`_worth_saving`); `held` where none."""
        if self._unsaved:
            for c in range(held):
                if self._chunk_hash(req, c) in self._unsaved:
                    return c
        return held

    def _forget_reused(self, scheduler_output: SchedulerOutput) -> None:
        """A sliding-window group's block outside the window is freed by vLLM (its place in
        the request's list becomes the null block in vLLM's copy, not in the one this side
        keeps from the scheduler's outputs) and may be handed to any request, whose
        forward then writes it. A block id this step hands out is marked the null block
        wherever an unsaved chunk of a sliding group still names it, so that chunk is not
        saved with another request's K/V (as vLLM's OffloadingConnector does)."""
        sliding = self.settings.groups.sliding_groups
        if not sliding or not self._reqs:
            return
        handed: set[int] = set()
        for new in scheduler_output.scheduled_new_reqs:
            handed.update(b for ids in new.block_ids for b in ids)
        for new_ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            handed.update(b for ids in new_ids or () for b in ids)
        for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
            handed.add(copy.dst_block_id)
        handed.discard(NULL_BLOCK_ID)
        if not handed:
            return
        for st in self._reqs.values():
            start = st.saved_chunks * self.chunk_blocks
            for g in sliding:
                if g < len(st.block_ids):
                    ids = st.block_ids[g]
                    for j in range(start, len(ids)):
                        if ids[j] in handed:
                            ids[j] = NULL_BLOCK_ID

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

        self._forget_reused(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = [list(ids) for ids in new.block_ids]
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
                st.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                if not st.block_ids:
                    st.block_ids = [[] for _ in new_ids]
                for ids, more in zip(st.block_ids, new_ids, strict=True):
                    ids.extend(more)
            n = scheduled.get(req_id, 0)
            prefill += prompt_part(st, cached.num_computed_tokens[i], n)
            self._plan_save(st, cached.num_computed_tokens[i] + n, saves)
            self._hand_off_when_done(st, cached.num_computed_tokens[i] + n, handoffs)
        meta = KvstashMetadata(loads=self._loads, saves=saves, prefill_tokens=prefill,
                               idle=scheduler_output.total_num_scheduled_tokens == 0,
                               step_tokens=scheduler_output.total_num_scheduled_tokens,
                               handoffs=handoffs, epoch=self.key_spaces.epoch)
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
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            if (st := self._reqs.get(req_id)) is not None:
                self._load_failed(st, st.loaded_tokens)
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
            first_bad = min((i for ids in st.block_ids for i, b in enumerate(ids) if b in bad),
                            default=None)
            if first_bad is None:
                continue
            loaded_end = st.num_computed + st.loaded_tokens
            valid = max(first_bad * self.block_size, st.num_computed)
            self._load_failed(st, max(0, loaded_end - valid), valid)

    def _load_failed(self, st: _Req, failed: int, valid: int = 0) -> None:
        """`failed` of the tokens the request loaded are recomputed from token `valid` on
        (a failed request: vLLM recomputes it whole, past its own cache)."""
        failed -= st.failed_tokens
        if failed <= 0:
            return
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
        there delays that output (docs/benchmarks/2026-11-28-vllm-hit-path.md). They are
        written at the next step instead (vLLM runs one after any
        request ends, to tell the workers) and at shutdown."""
        lines, self._request_lines = self._request_lines, []
        for args in lines:
            log.info("kvstash: request %s: %d prompt tokens, %d %s%s, %d chunks of %d tokens "
                     "sent for saving", *args)

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
            if waiting[event] >= len(self.key_spaces.lookup_ns):
                del waiting[event]
                out.append(event)
        while len(waiting) > MAX_WAITING_EVENTS:  # a rank whose save failed never reports
            del waiting[next(iter(waiting))]
        return out

    def _move_to_epoch(self, epoch: str) -> None:
        self.key_spaces = self.key_spaces.in_epoch(epoch)
        self.core.set_namespace(self.key_spaces.ns_by_rank[self.rank])

    def shutdown(self) -> None:
        self._write_request_lines()
        self.core.close()
