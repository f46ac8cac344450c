"""What a tenant may see of its store's stats: its own counts and sizes, never where or how
the store lives.

A store's `stats()` is written for its operator: it names the store's URL, its directory
(`root`), its bucket, prefix and endpoint. Behind `--auth-tokens` a tenant's `/v1/stats`
keeps only the figures below, each its own scope's (counters and sizes of the tenant's
own store, the shared capacity and the quota it is held to, a tier list's tiers in
turn); anything else a store reports, now or later, is left out until it is added here.
"""

from __future__ import annotations

from typing import Any

from storage.base import COUNTERS

TENANT_FIELDS = frozenset({
    *COUNTERS, "hit_rate", "backend", "used_bytes", "used", "chunks", "capacity_bytes",
    "quota_bytes", "breaker", "breaker_open",
})


def tenant_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """`stats` of a tenant's store, cut to what the tenant may see (TENANT_FIELDS)."""
    out = {k: v for k, v in stats.items() if k in TENANT_FIELDS}
    if isinstance(stats.get("tiers"), list):
        out["tiers"] = [tenant_stats(t) for t in stats["tiers"]]
    return out
