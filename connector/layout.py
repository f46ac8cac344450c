"""How one chunk's K/V tensors sit in a chunk payload, and the header meta that proves it.

A payload is one row-major array `[layers, 2 (K then V), kv_heads, chunk_tokens, head_dim]`
of the model's dtype. Layer-major keeps a chunk a single contiguous read, so the store can
`get_into` one staging buffer and the engine places it with one strided copy. The layout is
written into every chunk header's meta and checked on load, so a chunk written by another
model shape or dtype is rejected even if its key somehow matched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Element sizes of the dtypes an engine may cache in (names as torch spells them).
DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
LAYOUT_NAME = "LKHTD"


@dataclass(frozen=True)
class ChunkLayout:
    """Shape and dtype of one chunk payload: `[layers, 2, kv_heads, chunk_tokens, head_dim]`."""

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
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.chunk_tokens, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def payload_nbytes(self) -> int:
        return self.bytes_per_token * self.chunk_tokens

    @property
    def name(self) -> str:
        """The namespace `layout` string: two engines share chunks only if it is equal."""
        return f"{LAYOUT_NAME}:L{self.layers}:H{self.kv_heads}:D{self.head_dim}"

    def meta(self) -> dict[str, Any]:
        """What every chunk header of this layout carries in its meta."""
        return {"layout": LAYOUT_NAME, "dtype": self.dtype, "shape": list(self.shape)}

    @property
    def segments(self) -> tuple[int, ...]:
        """Byte length of each layer's K/V in the payload, in order (one checksum each)."""
        return (self.payload_nbytes // self.layers,) * self.layers

    def matches(self, meta: dict[str, Any]) -> bool:
        return meta == self.meta()


@dataclass(frozen=True)
class EngineLayout:
    """A chunk payload in an engine's own layout (vLLM's paged blocks, SGLang's host pages):
    `payload_nbytes` bytes, described by `fields`, which every chunk header's meta carries
    and a load checks (e.g. the engine format and a fingerprint of its KV cache shapes).
    `segments`: where the payload is layer-major, each layer's byte length; chunks are
    then saved with one checksum per layer, so a load may verify and place layer by layer."""

    fields: tuple[tuple[str, Any], ...]
    payload_nbytes: int
    segments: tuple[int, ...] = ()  # byte length of each layer's part, in payload order

    @classmethod
    def of(cls, payload_nbytes: int, segments: Any = (), **fields: Any) -> EngineLayout:
        segments = tuple(int(n) for n in segments)
        if segments and sum(segments) != payload_nbytes:
            raise ValueError(f"segments sum to {sum(segments)} bytes, payload is {payload_nbytes}")
        return cls(tuple(sorted(fields.items())), int(payload_nbytes), segments)

    def meta(self) -> dict[str, Any]:
        return dict(self.fields)

    def matches(self, meta: dict[str, Any]) -> bool:
        return meta == self.meta()
