"""Bytes by key: the Store protocol, the chunk codec, backends, tiers, capacity and eviction."""

from storage.base import Store
from storage.codec import Chunk, ChunkError, ChunkHeader, decode_chunk, encode_chunk
from storage.errors import (
    ConfigError,
    InvalidChunk,
    InvalidKey,
    StoreError,
    StoreFull,
    StoreUnavailable,
)
from storage.registry import open_store

__all__ = [
    "Chunk",
    "ChunkError",
    "ChunkHeader",
    "ConfigError",
    "InvalidChunk",
    "InvalidKey",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "decode_chunk",
    "encode_chunk",
    "open_store",
]
