"""Prometheus metrics of one server: requests and latencies, hits and misses, bytes, capacity.

Each app owns its registry (no process-global state), so several servers can live in one
process. Metric names are gathered here; routes call the small `note_*` methods.
Tenant names never become labels: /metrics is unauthenticated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from storage.base import Store

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)


class ServerMetrics:
    def __init__(self, stores: Callable[[], list[Store]]):
        """`stores()` gives the root store first, then every tenant scope."""
        self._stores = stores
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvstash_http_requests", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=r)
        self.latency = Histogram("kvstash_http_request_seconds", "HTTP request latency",
                                 ["method", "route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.hits = Counter("kvstash_chunk_hits", "chunk GETs served from the store", registry=r)
        self.misses = Counter("kvstash_chunk_misses", "chunk GETs that missed", registry=r)
        self.lookup_keys = Counter("kvstash_lookup_keys", "keys asked about in lookups", registry=r)
        self.lookup_present = Counter("kvstash_lookup_present", "keys found by lookups", registry=r)
        self.bytes_out = Counter("kvstash_bytes_served", "chunk bytes sent to clients", registry=r)
        self.bytes_sendfile = Counter(
            "kvstash_bytes_sendfile", "chunk bytes sent from their files with sendfile(2), "
            "not read by the server (part of kvstash_bytes_served)", registry=r)
        self.bytes_fd = Counter(
            "kvstash_bytes_fd_passed", "chunk bytes whose open file was handed to a client on "
            "the Unix socket, which read it itself (part of kvstash_bytes_served)", registry=r)
        self.bytes_in = Counter("kvstash_bytes_received", "chunk bytes stored from clients",
                                registry=r)
        self.used = Gauge("kvstash_store_used_bytes", "bytes held by the store (all tenants)",
                          registry=r)
        self.capacity = Gauge("kvstash_store_capacity_bytes", "configured capacity (0 = none)",
                              registry=r)
        self.chunks = Gauge("kvstash_store_chunks", "chunks held by the store (all tenants)",
                            registry=r)
        self.body_bytes_held = Gauge(
            "kvstash_body_bytes_held", "request body bytes received and held right now "
            "(charged against --max-in-flight-bytes)", registry=r)
        self.pool_lent = Gauge("kvstash_body_buffers_lent",
                               "pooled body buffers lent to requests right now", registry=r)
        self.pool_free_bytes = Gauge(
            "kvstash_body_buffers_free_bytes", "bytes of pooled body buffers kept for reuse "
            "(dropped after 30 s unused)", registry=r)
        self.event_streams = Gauge("kvstash_event_streams",
                                   "open /v1/events streams (all tenants)", registry=r)
        self.event_wakeups = Counter(
            "kvstash_event_wakeups", "event stream wake-ups: one per open stream of the "
            "event's own tenant, per event", registry=r)
        self._wakeups_seen = 0
        self.listings = Gauge("kvstash_listings", "GET /v1/keys listings running (all tenants)",
                              registry=r)

    def note_events(self, streams: int, wakeups: int) -> None:
        """Event streams open now, and wake-ups so far (kvserver.events.EventLog)."""
        self.event_streams.set(streams)
        self.event_wakeups.inc(wakeups - self._wakeups_seen)
        self._wakeups_seen = wakeups

    def render(self) -> bytes:
        used = capacity = chunks = 0
        for i, store in enumerate(self._stores()):
            for s in leaf_stats(store.stats()):
                used += s.get("used_bytes") or 0
                chunks += s.get("chunks") or 0
                if i == 0:  # the root store; tenant scopes share its configured capacity
                    capacity += s.get("capacity_bytes") or 0
        self.used.set(used)
        self.chunks.set(chunks)
        self.capacity.set(capacity)
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware counting every HTTP request by its route template (bounded
    label values: an unknown path counts as "unmatched")."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"]
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - t0)
            self.metrics.requests.labels(method, route, str(status)).inc()


def leaf_stats(stats: dict[str, Any]) -> list[dict[str, Any]]:
    tiers = stats.get("tiers")
    if not tiers:
        return [stats]
    return [leaf for t in tiers for leaf in leaf_stats(t)]
