"""The server's services, built once at start-up from its ServerConfig, and the two
dependencies through which routes receive them: `Svc` (the services) and `Caller` (the
tenant the gate authenticated, with its store)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from kvserver.admission import BodyBudget
from kvserver.auth import TokenTable
from kvserver.config import ServerConfig
from kvserver.events import EventLog, open_publisher
from kvserver.gate import TENANT_SCOPE_KEY
from kvserver.listings import listing_slots
from kvserver.metrics import ServerMetrics
from kvserver.tenant_view import StorePlaces
from kvserver.transfers import Transfers
from storage.base import Store
from storage.errors import ConfigError
from storage.registry import open_store
from storage.tenancy import open_tenants


class Tenancy:
    """The store each request may touch: the root store, or its tenant's store when tokens
    are configured (storage.tenancy: one capacity shared by all, optional quotas). Opened
    once at start-up (opening a scope may scan a directory)."""

    def __init__(self, store: Store, tokens: TokenTable | None, quota: int | None = None):
        self.root = store
        self.tokens = tokens
        self.scopes: dict[str, Store] = dict(open_tenants(store, tokens.tenants, quota)) if tokens else {}

    def stores(self) -> list[Store]:
        return [self.root, *self.scopes.values()]

    def store_for(self, tenant: str) -> Store:
        """The store of a tenant the gate authenticated ("": no tokens, the root)."""
        return self.scopes[tenant] if self.tokens is not None else self.root


def _per_tenant_budget(config: ServerConfig, tenants: int) -> int:
    """Body bytes one tenant may hold: with several tenants, at most half the budget."""
    per_tenant = config.max_in_flight_bytes // 2 if tenants > 1 else config.max_in_flight_bytes
    if per_tenant < config.max_chunk_bytes:
        raise ConfigError(
            f"--max-in-flight-bytes ({config.max_in_flight_bytes}) leaves {per_tenant} bytes per "
            f"tenant, less than one --max-chunk-bytes ({config.max_chunk_bytes}) chunk: raise it "
            "to at least " + ("twice " if tenants > 1 else "") + "--max-chunk-bytes")
    return per_tenant


class Services:
    """Everything the routes share, opened from `config` (or over an opened `store`).
    Raises ConfigError, in one line, for settings that cannot work together."""

    def __init__(self, config: ServerConfig, store: Store | None = None):
        self.config = config
        root = store if store is not None else open_store(list(config.store_urls))
        tokens = TokenTable.from_file(config.tokens_file) if config.tokens_file else None
        self.tenancy = tenancy = Tenancy(root, tokens, config.tenant_quota)
        self.metrics = ServerMetrics(tenancy.stores)
        budget = BodyBudget(config.max_in_flight_bytes,
                            _per_tenant_budget(config, len(tenancy.scopes)))
        self.transfers = Transfers(config.max_chunk_bytes, budget, self.metrics,
                                   stall_s=config.body_stall_timeout_s,
                                   total_s=config.body_timeout_s)
        self.events = EventLog(config.events_ring, max_streams=config.events_max_streams,
                               max_streams_total=config.events_max_streams_total)
        if tokens is None:
            self.events.watch("", root)
        for tenant, scope in tenancy.scopes.items():
            self.events.watch(tenant, scope)
        # With tenants, no message tells a client where the stores live (kvserver.tenant_view).
        self.told = StorePlaces(tenancy.stores()).hide if tokens is not None else str
        self.listings = listing_slots(config.max_tenant_listings, config.max_listings,
                                      tokens is not None)
        if config.events_zmq:
            self.events.publisher = open_publisher(config.events_zmq, list(tenancy.scopes),
                                                   config.events_zmq_all_tenants)

    @property
    def tokens(self) -> TokenTable | None:
        return self.tenancy.tokens

    async def trim_pools(self) -> None:
        """Runs for the server's life: pooled buffers shrink back after a peak."""
        while True:
            await asyncio.sleep(self.transfers.gets.idle_s / 2)
            self.transfers.trim()

    def render_metrics(self) -> bytes:
        """The Prometheus exposition, its gauges read now."""
        metrics = self.metrics
        metrics.body_bytes_held.set(self.transfers.budget.held)
        pooled = self.transfers.pool_stats()
        metrics.pool_lent.set(sum(p["lent"] for p in pooled))
        metrics.pool_free_bytes.set(sum(p["free_bytes"] for p in pooled))
        metrics.note_events(self.events.streams, self.events.wakeups)
        metrics.listings.set(self.listings.open)
        return metrics.render()

    async def close(self) -> None:
        for s in self.tenancy.stores():
            await s.close()
        self.events.close()


# async dependencies: FastAPI runs a plain `def` dependency in a worker thread, which
# costs a thread hop on every request.
async def services(request: Request) -> Services:
    """The services of the app serving `request` (built once by create_app)."""
    return request.app.state.services


Svc = Annotated[Services, Depends(services)]


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who is calling ("" without tokens) and the store they may touch."""

    name: str
    store: Store


async def caller(request: Request) -> Tenant:
    """The one place a request's tenant is resolved: the gate (kvserver.gate) checked the
    token before any route ran and left its tenant in the request scope."""
    name = request.scope[TENANT_SCOPE_KEY]
    return Tenant(name, request.app.state.services.tenancy.store_for(name))


Caller = Annotated[Tenant, Depends(caller)]
