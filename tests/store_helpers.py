"""Helpers for store tests: valid chunks for a namespace."""

from __future__ import annotations

import os
import struct

import xxhash

from hashing import Namespace, chunk_keys
from storage.codec import encode_chunk, encode_header


def make_chunks(ns: Namespace, n: int, payload_size: int = 1000, seed: int = 0):
    """`n` consecutive chunks of one prompt: [(key, tokens, blob)], chained keys."""
    t = ns.chunk_tokens
    tokens = [(seed * 7919 + i) % 50000 for i in range(n * t)]
    keys = chunk_keys(tokens, ns)
    out = []
    for i, key in enumerate(keys):
        part = tokens[i * t : (i + 1) * t]
        out.append((key, part, encode_chunk(key, part, os.urandom(payload_size), {"i": i})))
    return out


def forged_segment_chunk(ns: Namespace, payload_size: int = 4096, seed: int = 1):
    """(key, tokens, blob): a chunk whose whole-payload checksum and header checksum hold
    but whose segment 1 checksum belongs to other bytes, as a forger would write it."""
    (key, tokens, _), = make_chunks(ns, 1, seed=seed)
    payload = bytearray(os.urandom(payload_size))
    half = payload_size // 2
    header = bytearray(encode_header(key, tokens, payload, segments=[half, payload_size - half]))
    table = header.index(struct.pack("<QQ", payload_size - half,
                                     xxhash.xxh3_64_intdigest(bytes(payload[half:]))))
    struct.pack_into("<Q", header, table + 8, xxhash.xxh3_64_intdigest(b"other bytes"))
    struct.pack_into("<Q", header, 32, 0)
    struct.pack_into("<Q", header, 32, xxhash.xxh3_64_intdigest(bytes(header)))
    return key, tokens, bytes(header) + bytes(payload)


def backdate(path: str | os.PathLike, seconds: float = 10.0) -> None:
    """Give a chunk file an mtime `seconds` in the past, as if written then. A later write
    through the filesystem then carries another mtime whatever the timestamp granularity,
    so a store opened with `settle=0` (which remembers a verification at once) still sees
    the change, as the `settle` window guarantees for files that are really that old."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))
