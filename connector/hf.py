"""`CachedPrefill`: prefill a transformers causal LM through the cache — load prefix, run suffix, save.

The loaded prefix becomes a `DynamicCache` (transformers 5.x: `DynamicCache(ddp_cache_data=
[(k, v) per layer], config=...)`, positions follow from the cache length); the model then
runs only on the suffix. Supported: decoder-only models whose layers are full-attention or
sliding-window attention with one K/V head size (Llama family incl. GQA, Qwen2, Mistral
with or without its window, Gemma 3), any dtype in `connector.layout.DTYPE_BYTES`, batch
size 1.

A chunk holds every layer's K/V of its tokens, sliding layers included. transformers keeps
only the last `sliding_window - 1` positions of a sliding layer, so the forward runs on a
cache whose sliding layers record every position until it ends (`recording_cache`); the
new chunks are taken from there and the layers are then cut back to their window. A hit
gives a sliding layer only the positions inside the window at the hit's end, as the
model's own cache would hold them.

Exactness, precisely (checked with torch 2.13.0+cpu and transformers 5.19.0 and 5.23.0):
1. the K/V a hit loads are bit-identical to the K/V the model computed for those tokens
   when their chunks were saved;
2. a hit's outputs are bit-identical to the same model continuing from its own in-memory
   prefix cache holding those K/V (`continue_from_cache`: what an engine's prefix caching
   does), on every machine;
3. against one full recompute of the whole prompt they agree within the kernels'
   reduction-order noise (`RECOMPUTE_ULPS`): a suffix-only pass may block its matmuls and
   attention reductions differently from a full pass. They are bit-equal only where the
   kernels happen to be batch-invariant (some CPUs' are, others' not).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np
import torch
import xxhash
from transformers import DynamicCache

from connector.buffers import staging_tensor
from connector.core import KVConnector
from connector.layout import ChunkLayout
from connector.policy import PrefillPrior, PrefillTimer
from hashing import Namespace

log = logging.getLogger("kvstash.connector.hf")

# Config fields that do not change the KV a model computes (or are spelled per version).
_VOLATILE_CONFIG = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache")


# How far a hit's logits may be from one full recompute of the prompt, in units of the
# dtype's machine epsilon times the largest logit magnitude: a prefix computed apart from
# its suffix moves the logits by a few epsilons (docs/connector.md, "What a hit
# guarantees"); 32 leaves room for deeper models while a wrong prefix moves them by the
# logits' own magnitude.
RECOMPUTE_ULPS = 32


def recompute_tolerance(logits: Any) -> float:
    """Largest |hit - full recompute| difference reduction-order noise explains for `logits`."""
    return RECOMPUTE_ULPS * torch.finfo(logits.dtype).eps * max(1.0, logits.abs().max().item())


def recording_cache(model: Any) -> DynamicCache:
    """An empty `DynamicCache` for `model` whose sliding-window layers keep every position
    until `end_recording` (transformers' `activate_past_recording`): the K/V of a whole
    prompt, which a plain cache keeps of full-attention layers alone. A forward on it
    computes exactly what it computes on a plain one."""
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    return cache


def end_recording(cache: Any) -> None:
    """Cut a recording cache's sliding layers back to their window, as a plain cache holds
    them after the same forward, and stop recording."""
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, "record_past", False):
            layer.crop(0)
            layer.record_past = False


def _first_position(layer: Any) -> int:
    """The position of a cache layer's first K/V row (a sliding layer drops earlier ones)."""
    return getattr(layer, "cumulative_length", layer.keys.shape[-2]) - layer.keys.shape[-2]


def prefix_cache(model: Any, cache: Any, tokens: int) -> DynamicCache:
    """A new `DynamicCache` holding the first `tokens` positions of `cache` (not copied;
    `cache` stays as it is: DynamicCache replaces its tensors on update). A sliding layer of
    `cache` must hold them all (a `recording_cache`'s); the new cache keeps its window."""
    kv = [(layer.keys[:, :, :tokens], layer.values[:, :, :tokens]) for layer in cache.layers]
    return DynamicCache(ddp_cache_data=kv, config=model.config)


@torch.no_grad()
def continue_from_cache(model: Any, cache: Any, tokens: int, input_ids: Any, **kwargs: Any) -> Any:
    """What the engine's own prefix caching computes: the model continuing from the first
    `tokens` positions of a cache it computed itself, over the rest of `input_ids`. A hit of
    `tokens` whose chunks were saved from `cache` gives bit-identical outputs."""
    ids = torch.as_tensor(input_ids)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    return model(ids[:, tokens:], past_key_values=prefix_cache(model, cache, tokens),
                 use_cache=True, **_suffix_kwargs(kwargs, tokens))


def kv_layout(model: Any, chunk_tokens: int) -> ChunkLayout:
    """The chunk layout of `model`'s KV cache; ValueError for unsupported attention types."""
    cfg = model.config.get_text_config(decoder=True)
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise ValueError("only full-attention and sliding-window layers are supported, "
                         f"model has {sorted(kinds)}")
    heads = cfg.num_attention_heads
    return ChunkLayout(
        layers=cfg.num_hidden_layers,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        chunk_tokens=chunk_tokens,
        dtype=str(model.dtype).removeprefix("torch."),
    )


def model_id(model: Any) -> str:
    """`<name or model_type>@<hash of the config>`: equal only for models that compute equal KV
    from equal weights (the name stands for the weights; the hash guards the shape)."""
    cfg = model.config
    fields = {k: v for k, v in cfg.to_dict().items() if k not in _VOLATILE_CONFIG}
    digest = xxhash.xxh3_64_hexdigest(json.dumps(fields, sort_keys=True, default=str).encode(), seed=0)
    return f"{cfg._name_or_path or cfg.model_type}@{digest[:12]}"


def namespace_for(
    model: Any, chunk_tokens: int = 256, *, salt: str = "", rank: int = 0, world_size: int = 1
) -> Namespace:
    """The namespace a model's chunks live in: model id, dtype, KV layout and chunk size."""
    layout = kv_layout(model, chunk_tokens)
    return Namespace(
        model=model_id(model), dtype=layout.dtype, layout=layout.name,
        chunk_tokens=chunk_tokens, rank=rank, world_size=world_size, salt=salt,
    )


class _PrefixBuffers:
    """Staging memory for the chunks being read and the per-layer K/V they are placed into,
    kept from one load to the next and grown to the largest prefix loaded so far.

    Fresh host memory costs a page fault per 4 KiB page on first touch, slower than reading
    or copying into memory already touched: reusing the buffers is what lets a load run
    near the store's own read rate (docs/benchmarks/2026-11-23-ttft-load.md).

    Where staging sits is `KVConnector.staging_kind`'s answer: on the GPU when cuFile or
    KvikIO fill it (placing is then a device-side copy); 4 KiB-aligned host memory that
    O_DIRECT can fill for a model on CPU; otherwise host memory, pinned when the model is on
    a GPU, which `place` copies over asynchronously. The K/V buffer is handed to the model
    as the loaded `DynamicCache`; the model's first update replaces those tensors
    (`torch.cat`), so the buffer is reused only once no returned cache still shares its
    memory (`release`)."""

    def __init__(self, layout: ChunkLayout, device: torch.device, kind: str):
        self.layout = layout
        self.dtype = getattr(torch, layout.dtype)
        self.device = device
        self.kind = kind  # "device", "direct" or "host" (KVConnector.staging_kind)
        self.raw: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None

    def take(self, n_chunks: int) -> _StagedPrefix:
        if self.raw is None or self.raw.shape[0] < n_chunks:
            self.raw = self._staging(n_chunks)
        if self.kv is None or self.kv.shape[4] < n_chunks * self.layout.chunk_tokens:
            L, H, _, n, D = self.layout.shape
            self.kv = torch.empty((L, 2, 1, H, n_chunks * n, D), dtype=self.dtype,
                                  device=self.device)
        return _StagedPrefix(self.layout, self.raw, self.kv)

    def _staging(self, n_chunks: int) -> torch.Tensor:
        return staging_tensor(self.kind, (n_chunks, self.layout.payload_nbytes), self.device)

    def release(self, cache: Any) -> None:
        """After the forward pass: forget the K/V buffer if `cache` still holds any of it."""
        if self.kv is None or cache is None:
            return
        ours = self.kv.untyped_storage().data_ptr()
        for layer in getattr(cache, "layers", ()):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ours:
                    self.kv = None
                    return


class _StagedPrefix:
    """One load's view of `_PrefixBuffers`: the `LoadTarget` the connector fills."""

    def __init__(self, layout: ChunkLayout, raw: torch.Tensor, kv: torch.Tensor):
        self.layout = layout
        self.dtype = kv.dtype
        self.raw = raw
        self.kv = kv

    def staging(self, i: int) -> Any:
        return self.raw[i]

    def place(self, i: int) -> None:
        n = self.layout.chunk_tokens
        chunk = self.raw[i].view(self.dtype).view(self.layout.shape)  # [L, H, 2, T, D]
        self.kv[:, :, 0, :, i * n : (i + 1) * n, :].copy_(chunk.transpose(1, 2),
                                                          non_blocking=True)

    def place_segment(self, i: int, s: int) -> None:
        """Layer s of chunk i (layerwise loads: one verified layer range at a time)."""
        n = self.layout.chunk_tokens
        layer = self.raw[i].view(self.dtype).view(self.layout.shape)[s]  # [H, 2, T, D]
        self.kv[s, :, 0, :, i * n : (i + 1) * n, :].copy_(layer.transpose(0, 1),
                                                          non_blocking=True)

    def cache(self, tokens: int, config: Any) -> DynamicCache:
        """A `DynamicCache` over the first `tokens` positions, holding views of the K/V buffer.

        Built from zero-length views and then pointed at the placed tensors: handing them to
        the constructor would copy the whole prefix once more (its first `update` is a
        `torch.cat` onto an empty tensor), into fresh memory. The model's first forward
        replaces these views with its own `torch.cat`, as it does for any cache."""
        return self._fill(DynamicCache, tokens, config)

    def _fill(self, cls: type, tokens: int, config: Any, **extra: Any) -> Any:
        kv = self.kv[:, :, :, :, :tokens]
        cache = cls(ddp_cache_data=[(layer[0][:, :, :0], layer[1][:, :, :0]) for layer in kv],
                    config=config, **extra)
        for layer, loaded in zip(cache.layers, kv, strict=True):
            if getattr(layer, "is_sliding", False):
                # The window at the hit's end, as the model's own cache keeps it; recorded
                # from there on, so that the new chunks' K/V are there to save.
                keep = min(tokens, layer.sliding_window - 1)
                layer.keys, layer.values = loaded[0][:, :, tokens - keep :], loaded[1][:, :, tokens - keep :]
                layer.cumulative_length = tokens
                layer.activate_past_recording()
            else:
                layer.keys, layer.values = loaded[0], loaded[1]
        return cache


class _LayerwiseCache(DynamicCache):
    """The loaded prefix while it is still loading (`CachedPrefill(layerwise=True)`): the
    model's update of layer i (its attention) first waits until layer i of every chunk is
    verified and placed, so layer i computes while later layers are still being read."""

    def __init__(self, *args: Any, load: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._load = load

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any,
               **kwargs: Any) -> Any:
        load = self._load
        if load is not None:
            if not load.wait_segment(layer_idx, max(load.deadline - time.monotonic(), 0.0)):
                load.stalled = True
                load.cancel()  # the rest fails; CachedPrefill recomputes
            if layer_idx == len(self.layers) - 1:
                self._load = None
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _chunk_payload(layout: ChunkLayout, keys: list[torch.Tensor], values: list[torch.Tensor],
                   first: list[int] | None = None):
    """A function chunk index -> payload bytes, reading the given per-layer K/V tensors
    (`first`: per layer, the position of its first row; 0 for all by default)."""
    dtype = getattr(torch, layout.dtype)
    n = layout.chunk_tokens
    first = first or [0] * len(keys)

    def payload(i: int) -> Any:
        out = torch.empty(layout.shape, dtype=dtype)  # [L, H, 2, T, D]: head-major
        for layer, k, v, f in zip(out, keys, values, first, strict=True):
            layer[:, 0].copy_(k[0, :, i * n - f : (i + 1) * n - f])
            layer[:, 1].copy_(v[0, :, i * n - f : (i + 1) * n - f])
        return out.view(torch.uint8).numpy()

    return payload


def _suffix_kwargs(kwargs: dict[str, Any], hit: int) -> dict[str, Any]:
    """Per-position arguments cut to the suffix; `attention_mask` covers past + new, as is."""
    out = dict(kwargs)
    if hit and out.get("position_ids") is not None:
        out["position_ids"] = out["position_ids"][..., hit:]
    if hit and out.get("cache_position") is not None:
        out["cache_position"] = out["cache_position"][hit:]
    return out


class CachedPrefill:
    """`prefill(input_ids)` behaves like `model(input_ids, use_cache=True)` with the cache in front.

    The hit is capped at the last whole chunk before the final prompt token, which is always
    computed, so `.logits` covers positions `last_hit_tokens..T-1` and `.past_key_values`
    covers all T tokens. After the forward pass the prompt's new full chunks go to the
    connector's write-behind queue. Anything the cache does wrong is a miss, never an error.
    """

    def __init__(self, model: Any, connector: KVConnector, *, layerwise: bool = False):
        self.model = model
        self.connector = connector
        # layerwise: the forward starts at once and each layer waits only for its own
        # ranges (ranged reads and per-layer checksums; see KVConnector.load_segments_async).
        self.layerwise = layerwise
        self.layout = kv_layout(model, connector.chunk_tokens)
        connector.bind_layout(self.layout)
        # whether transformers' cache keeps a window of some layer (Mistral names its
        # window without `layer_types`)
        self.sliding = any(getattr(layer, "is_sliding", False)
                           for layer in DynamicCache(config=model.config).layers)
        device = next(iter(model.parameters()), torch.empty(0)).device.type
        connector.policy.know_model(PrefillPrior.of(model.config, device))
        self._buffers: _PrefixBuffers | None = None
        self._layer_load: Any = None
        self.last_hit_tokens = 0
        self.last_cached_tokens = 0
        # Wall seconds of the last call: "cache" (lookup, load, placement), "compute" (the
        # model), "save" (queueing the new chunks). cache + save is the connector's own cost.
        self.last_timings: dict[str, float] = {}

    def _load(self, ids: torch.Tensor, tokens: np.ndarray,
              max_tokens: int) -> tuple[int, DynamicCache | None]:
        conn = self.connector
        cached = conn.lookup(tokens, max_tokens=max_tokens)
        self.last_cached_tokens = cached
        plan = conn.plan(cached)
        if plan.chunks == 0:
            return 0, None
        if self._buffers is None or self._buffers.device != ids.device:
            # layerwise: ranges land in host memory, then each layer is placed on the device
            kind = "host" if self.layerwise else conn.staging_kind(ids.device)
            self._buffers = _PrefixBuffers(self.layout, ids.device, kind)
        staged = self._buffers.take(plan.chunks)
        if self.layerwise:
            keys, tokens = conn.keys(tokens, plan.chunks * conn.chunk_tokens)
            n = conn.chunk_tokens
            load = conn.load_segments_async(
                keys, [tokens[i * n : (i + 1) * n] for i in range(len(keys))], staged,
                plan.deadline_s)
            hit = len(keys) * n
            self._layer_load = load
            return hit, staged._fill(_LayerwiseCache, hit, self.model.config, load=load)
        hit = conn.load(tokens, plan.chunks * conn.chunk_tokens, staged, plan.deadline_s)
        if hit < plan.chunks * conn.chunk_tokens:
            # Reads past the end of the hit may still be landing in the staging memory (a
            # stalled chunk): the next load must not verify and place from it.
            self._buffers.raw = None
        return hit, (staged.cache(hit, self.model.config) if hit else None)

    @torch.no_grad()
    def __call__(self, input_ids: Any, **kwargs: Any) -> Any:
        self.last_hit_tokens = self.last_cached_tokens = 0
        self.last_timings = {}
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.shape[0] != 1 or "past_key_values" in kwargs or "inputs_embeds" in kwargs:
            return self.model(ids, use_cache=True, **kwargs)
        n = self.connector.chunk_tokens
        total = ids.shape[1]
        t0 = time.perf_counter()
        # The prompt on the host, once: lookup, load and save all key on it, and copying it
        # after the forward would wait for a GPU to finish before the saves are queued.
        tokens = ids[0].cpu().numpy()
        hit, cache = 0, None
        try:
            hit, cache = self._load(ids, tokens, (total - 1) // n * n)
        except Exception:  # noqa: BLE001 - the cache may make a request faster, never fail it
            log.exception("cache load failed; computing the whole prompt")
            hit, cache = 0, None
        t1 = time.perf_counter()
        if cache is None and self.sliding:
            cache = recording_cache(self.model)
        timer = PrefillTimer(total - hit, ids.device)
        out = self.model(ids[:, hit:], past_key_values=cache, use_cache=True,
                         **_suffix_kwargs(kwargs, hit))
        timer.stop()
        load, self._layer_load = self._layer_load, None
        if load is not None and not all(load.result(max(load.deadline - time.monotonic(), 0) + 1)):
            # A layer of some chunk failed while the forward ran: that output used a wrong
            # prefix. Recompute the whole prompt (the staging may still be written: dropped).
            log.warning("layerwise load fell short; computing the whole prompt")
            self._drop_staging()
            hit, cache = 0, recording_cache(self.model) if self.sliding else None
            timer = PrefillTimer(total, ids.device)
            out = self.model(ids, past_key_values=cache, use_cache=True, **kwargs)
            timer.stop()
        t2 = time.perf_counter()
        if cache is not None and self._buffers is not None:
            self._buffers.release(out.past_key_values)
        # The policy learns what the forward cost once its time is known (on a GPU once its
        # kernels are done: the Python call returns before).
        self.connector.prefill_timed(timer)
        self.last_hit_tokens = hit
        self._save(tokens, out.past_key_values, hit)
        end_recording(out.past_key_values)
        self.last_timings = {"cache": t1 - t0, "compute": t2 - t1, "save": time.perf_counter() - t2}
        return out

    def _drop_staging(self) -> None:
        """Reads may still be landing in the staging memory: the next load takes new."""
        if self._buffers is not None:
            self._buffers.raw = None

    def _save(self, tokens: np.ndarray, cache: Any, hit: int) -> None:
        if cache is None or len(tokens) // self.connector.chunk_tokens * self.connector.chunk_tokens <= hit:
            return
        try:
            # DynamicCache replaces (never mutates) its tensors on update, so these references
            # stay valid while the engine keeps decoding and the writer serializes later.
            keys = [layer.keys for layer in cache.layers]
            values = [layer.values for layer in cache.layers]
            first = [_first_position(layer) for layer in cache.layers]
            self.connector.save(tokens, _chunk_payload(self.layout, keys, values, first), hit)
        except Exception:  # noqa: BLE001 - a lost save costs a future hit, never this request
            log.exception("queueing the prompt's chunks for saving failed")
