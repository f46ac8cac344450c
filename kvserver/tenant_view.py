"""What a tenant may see of the server's stores: its own counts and sizes, never where or
how the stores live.

A store's `stats()` and its error messages are written for its operator: they name the
store's URL, its directory (`root`), its bucket, prefix and endpoint. Behind
`--auth-tokens`:

- a tenant's `/v1/stats` keeps only the figures in TENANT_FIELDS, each its own scope's
  (counters and sizes of the tenant's own store, the shared capacity and the quota it is
  held to, a tier list's tiers in turn); anything else a store reports, now or later, is
  left out until it is added here;
- error messages that reach a client (a 400, 503 or 507 from a store, `/readyz`'s reason)
  have every place a store lives replaced by `the store` (`StorePlaces.hide`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvserver.metrics import leaf_stats
from storage.base import COUNTERS, Store

TENANT_FIELDS = frozenset({
    *COUNTERS, "hit_rate", "backend", "used_bytes", "used", "chunks", "capacity_bytes",
    "quota_bytes", "breaker", "breaker_open",
})
# The stats fields that name where a store lives.
PLACE_FIELDS = ("url", "root", "endpoint")


def tenant_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """`stats` of a tenant's store, cut to what the tenant may see (TENANT_FIELDS)."""
    out = {k: v for k, v in stats.items() if k in TENANT_FIELDS}
    if isinstance(stats.get("tiers"), list):
        out["tiers"] = [tenant_stats(t) for t in stats["tiers"]]
    return out


class StorePlaces:
    """Every URL, directory and endpoint of `stores` (read once: they do not change)."""

    def __init__(self, stores: Iterable[Store]):
        places = set()
        for store in stores:
            places.add(str(store))
            stats = store.stats()
            for part in (stats, *leaf_stats(stats)):
                places.update(v for k in PLACE_FIELDS if isinstance(v := part.get(k), str))
        # Longest first: a tenant's URL before the root's URL it begins with.
        self._places = sorted((p for p in places if p), key=len, reverse=True)

    def hide(self, message: str) -> str:
        """`message` with every place replaced by `the store`."""
        for place in self._places:
            message = message.replace(place, "the store")
        return message
