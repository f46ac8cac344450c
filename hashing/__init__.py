"""Token ids -> chained chunk keys, scoped by a Namespace (pure, no I/O, no torch)."""

from hashing.keys import (
    KEY_PATTERN,
    SCHEME_VERSION,
    InvalidTokenIds,
    Namespace,
    chunk_keys,
    is_valid_key,
    keys_from_block_hashes,
    split_key,
    token_array,
)

__all__ = [
    "KEY_PATTERN",
    "SCHEME_VERSION",
    "InvalidTokenIds",
    "Namespace",
    "chunk_keys",
    "is_valid_key",
    "keys_from_block_hashes",
    "split_key",
    "token_array",
]
