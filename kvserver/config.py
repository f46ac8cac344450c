"""The server's one typed configuration object, built once at start-up from flags."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

# 256 tokens of a 70B model in fp32 are 640 MiB; larger chunks are a misconfiguration,
# and the limit bounds what one request can make the server hold.
DEFAULT_MAX_CHUNK_BYTES = 1024**3
DEFAULT_PORT = 8765
# A lookup carries ~52 bytes of JSON per key; 65536 keys is 16M tokens at 256-token chunks.
DEFAULT_MAX_LOOKUP_KEYS = 65536
DEFAULT_STORE_CAPACITY = "8GiB"


def default_store_url() -> str:
    """The embedded default store: a capacity-bounded directory under the user's home."""
    root = Path(os.environ.get("KVSTASH_HOME", Path.home() / ".kvstash")) / "store"
    return f"file://{root.resolve()}?capacity={DEFAULT_STORE_CAPACITY}"


@dataclass(frozen=True)
class ServerConfig:
    """Everything `create_app` needs. `store_urls` are tiers, fastest first."""

    store_urls: tuple[str, ...] = field(default_factory=lambda: (default_store_url(),))
    tokens_file: Path | None = None
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    max_lookup_keys: int = DEFAULT_MAX_LOOKUP_KEYS
    # Readiness answers 503 when one presence check takes longer than this.
    ready_timeout_s: float = 2.0
