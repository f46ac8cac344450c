"""Helpers for store tests: valid chunks for a namespace."""

from __future__ import annotations

import os

from hashing import Namespace, chunk_keys
from storage.codec import encode_chunk


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
