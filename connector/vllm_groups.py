"""vLLM's KV cache groups as chunks see them: each layer's group and window, what a hit needs.

With vLLM's hybrid KV cache manager on (the connector declares `SupportsHMA`), a model
whose layers attend differently (sliding-window beside full-attention layers: Gemma 3,
gpt-oss, Mistral-style windows) has one KV cache group per kind, each with block ids of
its own: a request's blocks of a sliding group outside the window are vLLM's null block,
and vLLM frees them for other requests. A chunk still holds every layer of its tokens
(the K/V the model computed, whatever the group), so it is saved only while none of its
blocks is the null block in any group, and a hit places a sliding layer only into the
blocks vLLM kept for it: those inside the window at the hit's end (`layers_needed`).

Groups kvstash cannot store exactly (the recurrent state of SSM or linear-attention
layers, whose per-request state is not a block of per-token K/V) turn kvstash off for the
model (`GroupLayout.refusal`), with one line at start: the engine runs as without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupLayout:
    """The KV cache groups of one engine (`of`): per group its kind ("full" or "sliding")
    and window in tokens (None for full attention), and each layer's group."""

    kinds: tuple[str, ...] = ("full",)
    windows: tuple[int | None, ...] = (None,)
    layer_group: tuple[tuple[str, int], ...] = ()
    refusal: str | None = None  # why kvstash cannot store this model (None: it can)

    @classmethod
    def of(cls, kv_cache_config: Any) -> GroupLayout:
        """From vLLM's `KVCacheConfig` (None, or a single group: one full-attention group,
        as before the hybrid manager)."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if not groups:
            return cls()
        kinds: list[str] = []
        windows: list[int | None] = []
        refusal = None
        for g, group in enumerate(groups):
            kind, window = _kind(group.kv_cache_spec)
            if kind not in ("full", "sliding") and refusal is None:
                layers = ", ".join(group.layer_names[:2]) + (
                    ", ..." if len(group.layer_names) > 2 else "")
                what = ("recurrent SSM / linear-attention state" if kind == "MambaSpec"
                        else "a cache of another kind")
                refusal = (f"its KV cache group {g} ({layers}) holds {what} ({kind}), "
                           f"which kvstash does not store exactly (it stores "
                           f"full-attention and sliding-window K/V)")
            kinds.append(kind)
            windows.append(window)
        layer_group = tuple((name, g) for g, group in enumerate(groups)
                            for name in group.layer_names)
        return cls(tuple(kinds), tuple(windows), layer_group, refusal)

    @property
    def hybrid(self) -> bool:
        """Whether requests hold blocks in more than one group."""
        return len(self.kinds) > 1

    @property
    def fails_whole_requests(self) -> bool:
        """Whether a chunk that fails to load fails its whole request (vLLM then
        recomputes it from its own cache, or from the start: a miss) rather than its
        blocks from that chunk on: vLLM takes block-level load errors with one KV cache
        group only, and in a sliding group the window before a failed chunk may be the
        null block (outside the window at the hit's end: never loaded), which a
        recompute from that chunk would read. Loads are then between steps (async),
        where vLLM takes a request's failure."""
        return self.hybrid or bool(self.sliding_groups)

    @property
    def sliding_groups(self) -> list[int]:
        return [g for g, kind in enumerate(self.kinds) if kind == "sliding"]

    def group_of(self, layer_name: str) -> int:
        """The group of a layer (0 for one vLLM does not name: a single-group model)."""
        return dict(self.layer_group).get(layer_name, 0)

    def describe(self) -> str:
        """The group layout for the namespace: every layer's group and its kind and
        window, in vLLM's layer order; "" for a model with one full-attention group (its
        key space stays the one it had before the hybrid manager)."""
        if self.kinds == ("full",):
            return ""
        names = sorted(self.layer_group, key=lambda x: _layer_order(x[0]))
        parts = [f"{g}{_short(self.kinds[g], self.windows[g])}" for _, g in names]
        if not parts:  # groups without layer names: the groups alone
            parts = [_short(k, w) for k, w in zip(self.kinds, self.windows, strict=True)]
        return "groups=" + ",".join(parts)

    def layer_windows(self, layer_names: Sequence[str]) -> list[int | None]:
        """The window of each of `layer_names` (None: full attention)."""
        return [self.windows[self.group_of(name)] for name in layer_names]


def _kind(spec: Any) -> tuple[str, int | None]:
    """("full" | "sliding" | vLLM's spec class name, window in tokens) of a group's spec;
    the window as vLLM keeps it (`SlidingWindowManager.get_num_skipped_tokens`: the
    window plus the tokens it retains beyond it for speculative decoding)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, UniformTypeKVCacheSpecs):  # layers of one kind, other shapes
        kinds = {_kind(s) for s in spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else (type(spec).__name__, None)
    if isinstance(spec, SlidingWindowSpec):
        return "sliding", spec.sliding_window + getattr(spec, "extra_retained_tokens", 0)
    if type(spec) is FullAttentionSpec or type(spec) is MLAAttentionSpec:
        return "full", None
    return type(spec).__name__, None


def _short(kind: str, window: int | None) -> str:
    return f"s{window}" if kind == "sliding" else ("f" if kind == "full" else kind)


def _layer_order(name: str) -> tuple:
    """Layer names in model order: by the numbers in them ("model.layers.10..." after
    "model.layers.9...")."""
    import re

    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def layers_needed(chunks: int, chunk_tokens: int, windows: Sequence[int | None],
                  first: int = 0) -> list[list[int]]:
    """Per chunk `first`..`chunks`-1 of a hit that ends after chunk `chunks`-1, the
    layers (indices into `windows`: each layer's sliding window, None for full attention)
    whose part of the chunk the hit needs: every full-attention layer; a sliding layer
    only in the chunks that overlap the window at the hit's end. vLLM keeps the same
    blocks for such a request (the rest of a sliding group are its null block): a token
    at position t is needed while t >= hit_end - window + 1, where hit_end is the hit's
    length in tokens, as vLLM's `SlidingWindowManager.get_num_skipped_tokens` counts."""
    end = chunks * chunk_tokens
    return [[i for i, w in enumerate(windows)
             if w is None or (c + 1) * chunk_tokens > end - w + 1]
            for c in range(first, chunks)]
