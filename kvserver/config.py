"""The server's one typed configuration object, built once at start-up from flags."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from storage.codec import MAX_CHUNK

# 256 tokens of a 70B model in fp32 are 640 MiB; larger chunks are a misconfiguration,
# and the limit bounds what one request can make the server hold.
DEFAULT_MAX_CHUNK_BYTES = MAX_CHUNK  # the stores' own default `max_chunk`
DEFAULT_PORT = 8765
# A lookup carries ~52 bytes of JSON per key; 65536 keys is 16M tokens at 256-token chunks.
DEFAULT_MAX_LOOKUP_KEYS = 65536
# A PUT body must arrive within this time, so a slow-drip client cannot hold a connection
# and its preallocated buffer forever; 60 s moves the largest default chunk (1 GiB) at
# 18 MB/s.
DEFAULT_BODY_TIMEOUT_S = 60.0
# A body (PUT or lookup) that sends nothing for this long, its first byte included, gets
# 408: a connection that announces a body and then stalls holds nothing for long.
DEFAULT_BODY_STALL_TIMEOUT_S = 10.0
# A response whose client takes no bytes for this long is dropped (its buffer freed).
DEFAULT_SEND_TIMEOUT_S = 60.0
# On SIGTERM or SIGINT, requests still running after this long are cancelled and their
# connections closed, so that the process exits well within the 30 s Kubernetes gives a
# pod by default (terminationGracePeriodSeconds) before it kills it; without a bound, one
# slow-drip PUT or a client that never reads held the exit for --body-timeout or
# --send-timeout (60 s).
DEFAULT_SHUTDOWN_GRACE_S = 10.0
# `GET /v1/keys` listings running at once, per process and per tenant: each holds a piece
# of ~50 KiB, the store's walk state and a worker-thread trip per 1,024 keys.
DEFAULT_MAX_LISTINGS = 16
DEFAULT_MAX_TENANT_LISTINGS = 4
DEFAULT_STORE_CAPACITY = "8GiB"
# Request body bytes held at once (per process, counted as they arrive): a body that does
# not fit gets 503 + Retry-After instead of growing the server's memory without bound.
DEFAULT_MAX_IN_FLIGHT_BYTES = 4 * 1024**3
# Worker processes (`--workers N`) receive the parent's ServerConfig through this variable.
CONFIG_ENV = "KVSTASH_SERVE_CONFIG"


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
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES
    body_stall_timeout_s: float = DEFAULT_BODY_STALL_TIMEOUT_S
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    # Most bytes one tenant may hold (None: only the backend's shared capacity).
    tenant_quota: int | None = None
    # Readiness answers 503 when one presence check takes longer than this.
    ready_timeout_s: float = 2.0
    # KV events (kvserver.events): a ZMQ PUB endpoint in vLLM's format (None: off), and
    # how many recent events `GET /v1/events?since=` can resume from.
    events_zmq: str | None = None
    events_ring: int = 65536
    # Open `GET /v1/events` streams a tenant may hold at once (each costs the server a
    # wake-up and a write per event).
    events_max_streams: int = 64
    # ... and all tenants of the process together.
    events_max_streams_total: int = 1024
    # `GET /v1/keys` listings running at once, per tenant and per process.
    max_tenant_listings: int = DEFAULT_MAX_TENANT_LISTINGS
    max_listings: int = DEFAULT_MAX_LISTINGS
    # With tenants, --events-zmq (unauthenticated, every tenant's events) starts only when
    # the operator says so.
    events_zmq_all_tenants: bool = False

    def to_json(self) -> str:
        d = asdict(self)
        d["tokens_file"] = str(self.tokens_file) if self.tokens_file else None
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        d = json.loads(text)
        d["store_urls"] = tuple(d["store_urls"])
        d["tokens_file"] = Path(d["tokens_file"]) if d["tokens_file"] else None
        return cls(**d)
