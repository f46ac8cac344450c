"""The kvserver ASGI app: the services built once from a ServerConfig, the routers of
kvserver.routes over them, the request gate and the metrics middleware in front.

Tokens are checked from the request head before any route runs (kvserver.gate); the
routes (one APIRouter per area) receive the services and the caller's tenant as FastAPI
dependencies (kvserver.services); every error is `{"error": "<one message>"}`
(kvserver.errors).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.security import HTTPBearer

from kvserver.config import CONFIG_ENV, ServerConfig
from kvserver.errors import AUTH_ERRORS, AUTH_ERRORS_NO_BODY, install_error_handlers
from kvserver.gate import RequestGate
from kvserver.metrics import MetricsMiddleware
from kvserver.protocol import configure as configure_protocol
from kvserver.routes import admin, chunks, events, health, lookups
from kvserver.services import Services
from kvserver.status import mount_status
from storage.base import Store
from storage.exit_signals import ExitSignals

# Documents the token in the OpenAPI document; the gate has checked it before any route.
BEARER = HTTPBearer(auto_error=False, description="a token from the server's tokens file")
# The routers behind a token when tokens are configured, and how their refusals read.
TENANT_ROUTERS = ((chunks.router, AUTH_ERRORS), (chunks.heads, AUTH_ERRORS_NO_BODY),
                  (lookups.router, AUTH_ERRORS), (admin.router, AUTH_ERRORS),
                  (events.router, AUTH_ERRORS))


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Pools trimmed while the server runs; event streams ended on a stop signal; every
    store closed at the end."""
    svc: Services = app.state.services
    trimmer = asyncio.create_task(svc.trim_pools())
    loop = asyncio.get_running_loop()
    try:
        # uvicorn stops on SIGINT/SIGTERM once every open response has ended, and an
        # event stream never ends by itself: without this a subscriber kept the server
        # up until it was killed.
        def end_streams() -> None:
            loop.call_soon_threadsafe(svc.events.end_streams)

        with ExitSignals(end_streams):
            yield
    finally:
        trimmer.cancel()
        await svc.close()


def _include(app: FastAPI, router: APIRouter, refusals: dict[int | str, dict[str, Any]],
             tokens: bool) -> None:
    if tokens:
        app.include_router(router, dependencies=[Depends(BEARER)], responses=refusals)
    else:
        app.include_router(router)


def create_app(config: ServerConfig, store: Store | None = None) -> FastAPI:
    """The kvserver ASGI app over `config.store_urls` (or an already opened `store`).
    Raises ConfigError for a store, tokens file or limit that cannot work."""
    svc = Services(config, store)
    app = FastAPI(
        title="kvstash kvserver",
        version="1",
        summary="KV-cache chunks by key: put, get, batched prefix lookup.",
        lifespan=lifespan,
    )
    app.state.services = svc
    app.state.config = config
    app.state.tenancy = svc.tenancy
    app.state.metrics = svc.metrics
    app.state.events = svc.events
    install_error_handlers(app)
    for router, refusals in TENANT_ROUTERS:
        _include(app, router, refusals, svc.tokens is not None)
    app.include_router(health.router)
    mount_status(app, svc.metrics)
    app.add_middleware(RequestGate, tokens=svc.tokens)
    app.add_middleware(MetricsMiddleware, metrics=svc.metrics)
    return app


def app_from_env() -> FastAPI:
    """The app of one `--workers` process: the parent's config arrives as JSON in the
    environment (uvicorn starts workers by importing this factory)."""
    config = ServerConfig.from_json(os.environ[CONFIG_ENV])
    configure_protocol(config.send_timeout_s)
    return create_app(config)
