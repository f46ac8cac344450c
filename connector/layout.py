"""How one chunk's K/V tensors sit in a chunk payload, and the header meta that proves it.

The canonical payload (`CanonLayout`, docs/chunk-format.md) is independent of how a
deployment splits the model: one **layer part** per stored layer, in the model's layer
order, each ONE contiguous byte range, and inside it head-major
`[kv_heads, kv (2: K then V; 1: MLA's latent), chunk_tokens, head_dim]` of the model's
dtype. So a tensor-parallel rank's KV heads are one contiguous range per layer, which it
reads alone (`CanonLayout.reader`), and a reader can skip a whole layer. Every
(layer, head) is its own checksummed segment: a reader verifies exactly what it read.
The layout is written into every chunk header's meta and checked on load, so a chunk of
another model shape or dtype is rejected even if its key somehow matched.

`ChunkLayout` is the canonical layout of a uniform model (HF transformers adapter);
`EngineLayout` is what the core reads and checks: the fields every header carries, the
payload length, its segments, and the byte ranges (`spans`) this reader reads of it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import xxhash

# Element sizes of the dtypes an engine may cache in (names as torch spells them).
DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
CANON = "kv-canon-1"  # the payload format's name and version, in every header's meta


@dataclass(frozen=True)
class CanonLayout:
    """The canonical payload of one chunk: per layer `(kv_heads, kv, head_dim)` (kv 2 for
    K and V, 1 for MLA's latent, whose one "head" is the latent width), `chunk_tokens`
    tokens, one dtype."""

    layers: tuple[tuple[int, int, int], ...]
    chunk_tokens: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r} (known: {sorted(DTYPE_BYTES)})")
        if self.chunk_tokens <= 0 or not self.layers:
            raise ValueError("a canonical layout needs layers and a positive chunk_tokens")
        for heads, kv, dim in self.layers:
            if heads <= 0 or kv not in (1, 2) or dim <= 0:
                raise ValueError(f"bad layer shape {(heads, kv, dim)}: (kv_heads, 1 or 2, head_dim)")

    def head_nbytes(self, layer: int) -> int:
        """Bytes of one head of one layer: `[kv, chunk_tokens, head_dim]`."""
        _, kv, dim = self.layers[layer]
        return kv * self.chunk_tokens * dim * DTYPE_BYTES[self.dtype]

    def layer_nbytes(self, layer: int) -> int:
        return self.layers[layer][0] * self.head_nbytes(layer)

    @property
    def layer_offsets(self) -> list[int]:
        sizes = [self.layer_nbytes(i) for i in range(len(self.layers))]
        return [0, *itertools.accumulate(sizes[:-1])]

    @property
    def payload_nbytes(self) -> int:
        return sum(self.layer_nbytes(i) for i in range(len(self.layers)))

    @property
    def segments(self) -> tuple[int, ...]:
        """One checksummed segment per (layer, head), in payload order."""
        return tuple(self.head_nbytes(i) for i, (heads, _, _) in enumerate(self.layers)
                     for _ in range(heads))

    def meta(self) -> dict[str, Any]:
        """What every chunk header of this layout carries in its meta."""
        return {"layout": CANON, "dtype": self.dtype, "tokens": self.chunk_tokens,
                "layers": [list(shape) for shape in self.layers]}

    @property
    def name(self) -> str:
        """The payload's part of a namespace `layout` string (no rank, no TP degree)."""
        shapes = ",".join(f"{h}x{k}x{d}" for h, k, d in self.layers)
        return f"{CANON}:{xxhash.xxh3_64_hexdigest(shapes.encode())[:12]}:L{len(self.layers)}"

    def reader(self, heads: list[tuple[int, int]] | None = None, **fields: Any) -> EngineLayout:
        """The layout a reader of these chunks loads: `heads`, per layer, the (first,
        count) of the KV heads it holds (None: all of every layer); its `spans` are one
        byte range of each layer part, in layer order; `fields` go into the meta."""
        offsets = self.layer_offsets
        spans = []
        for i, (total, _, _) in enumerate(self.layers):
            first, count = heads[i] if heads is not None else (0, total)
            if not (0 <= first and count > 0 and first + count <= total):
                raise ValueError(f"layer {i}: heads {first}..{first + count - 1} of {total}")
            size = self.head_nbytes(i)
            spans.append((offsets[i] + first * size, count * size))
        return EngineLayout.of(self.payload_nbytes, segments=self.segments, spans=spans,
                               **self.meta(), **fields)


@dataclass(frozen=True)
class ChunkLayout:
    """The canonical payload of a uniform model (every layer `kv_heads` heads of
    `head_dim`): `[layers, kv_heads, 2 (K then V), chunk_tokens, head_dim]`."""

    layers: int
    kv_heads: int
    head_dim: int
    chunk_tokens: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r} (known: {sorted(DTYPE_BYTES)})")
        for name in ("layers", "kv_heads", "head_dim", "chunk_tokens"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

    @property
    def canon(self) -> CanonLayout:
        return CanonLayout(((self.kv_heads, 2, self.head_dim),) * self.layers,
                           self.chunk_tokens, self.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, self.kv_heads, 2, self.chunk_tokens, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def payload_nbytes(self) -> int:
        return self.bytes_per_token * self.chunk_tokens

    @property
    def name(self) -> str:
        """The namespace `layout` string: two engines share chunks only if it is equal."""
        return f"{CANON}:L{self.layers}:H{self.kv_heads}:D{self.head_dim}"

    def meta(self) -> dict[str, Any]:
        """What every chunk header of this layout carries in its meta."""
        return self.canon.meta()

    @property
    def segments(self) -> tuple[int, ...]:
        """One checksummed segment per (layer, head)."""
        return self.canon.segments

    @property
    def read_spans(self) -> tuple[tuple[int, int], ...]:
        """Each layer's byte range: what a layer-pipelined load reads and places at once."""
        size = self.payload_nbytes // self.layers
        return tuple((i * size, size) for i in range(self.layers))

    @property
    def staging_nbytes(self) -> int:
        return self.payload_nbytes

    partial = False  # a reader of every head reads whole chunks

    def matches(self, meta: dict[str, Any]) -> bool:
        return meta == self.meta()


@dataclass(frozen=True)
class EngineLayout:
    """A chunk payload as an engine adapter reads it: `payload_nbytes` bytes, described by
    `fields`, which every chunk header's meta carries and a load checks. `segments`: byte
    lengths of its checksummed ranges, in payload order (the header's table). `spans`:
    the (offset, length) ranges of the payload this reader reads, in order, each a run of
    whole segments (a tensor-parallel rank's heads of each layer); packed one after the
    other they make its staging (`staging_nbytes`). Without spans a reader reads every
    segment (each its own span: a layer-major payload), or the whole payload."""

    fields: tuple[tuple[str, Any], ...]
    payload_nbytes: int
    segments: tuple[int, ...] = ()  # byte length of each checksummed range, in order
    spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, payload_nbytes: int, segments: Any = (), spans: Any = (),
           **fields: Any) -> EngineLayout:
        segments = tuple(int(n) for n in segments)
        if segments and sum(segments) != payload_nbytes:
            raise ValueError(f"segments sum to {sum(segments)} bytes, payload is {payload_nbytes}")
        spans = tuple((int(o), int(n)) for o, n in spans)
        if any(o < 0 or n <= 0 or o + n > payload_nbytes for o, n in spans):
            raise ValueError(f"spans {spans} do not lie in a {payload_nbytes}-byte payload")
        return cls(tuple(sorted(fields.items())), int(payload_nbytes), segments, spans)

    def meta(self) -> dict[str, Any]:
        return dict(self.fields)

    def matches(self, meta: dict[str, Any]) -> bool:
        return meta == self.meta()

    @property
    def read_spans(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) of each range this reader reads, in staging order."""
        if self.spans:
            return self.spans
        sizes = self.segments or (self.payload_nbytes,)
        return tuple(zip(itertools.accumulate((0, *sizes[:-1])), sizes, strict=True))

    @property
    def staging_nbytes(self) -> int:
        return sum(n for _, n in self.read_spans)

    @property
    def partial(self) -> bool:
        """Whether this reader reads less than the whole payload (a rank's heads)."""
        return self.staging_nbytes != self.payload_nbytes
