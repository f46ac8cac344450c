"""Service routes open to load balancers and scrapers: liveness (`/healthz`), readiness
(`/readyz`: the backend can serve) and Prometheus metrics (`/metrics`)."""

# No `from __future__ import annotations`: FastAPI resolves the route signatures.
import asyncio
import logging
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from kvserver.errors import errors
from kvserver.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvserver.metrics import leaf_stats
from kvserver.services import Svc
from storage.base import Store

log = logging.getLogger("kvstash.kvserver")

router = APIRouter(tags=["service"])


class Health(BaseModel):
    status: str


def breaker_open(stats: dict[str, Any]) -> str | None:
    """A tier whose circuit breaker is open (http:// and s3:// report it in their stats)."""
    for leaf in leaf_stats(stats):
        if leaf.get("breaker_open") is True or leaf.get("breaker") == "open":
            return f"circuit breaker open for {leaf.get('url', 'a tier')}"
    return None


async def why_unready(store: Store) -> str | None:
    """Why `store` cannot serve now, or None: its own health (root, disk), then an open
    breaker, then one presence check that must reach the backend. The probe's own answer
    decides (Store.probe), not counters that concurrent requests also move."""
    why = await store.health() or breaker_open(store.stats())
    if why is not None:
        return why
    failed = await store.probe()
    if failed is not None:
        log.warning("readiness: %s", failed)
        return "the backend's presence check failed"
    return None


@router.get("/healthz", response_model=Health, summary="The process is up")
async def healthz() -> Any:
    return {"status": "ok"}


@router.get("/readyz", response_model=Health, responses=errors(503),
            summary="The backend can serve: root present and writable, disk not full, "
                    "no circuit breaker open, a presence check answered in time")
async def readyz(svc: Svc) -> Any:
    limit = svc.config.ready_timeout_s
    try:
        async with asyncio.timeout(limit):
            why = await why_unready(svc.tenancy.root)
    except TimeoutError as exc:
        raise HTTPException(503, f"backend did not answer within {limit}s") from exc
    if why is not None:
        raise HTTPException(503, svc.told(why))
    return {"status": "ready"}


@router.get("/metrics", response_class=Response, summary="Prometheus metrics",
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def prometheus(svc: Svc) -> Response:
    return Response(svc.render_metrics(), media_type=METRICS_CONTENT_TYPE)
