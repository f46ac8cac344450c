"""Admin routes over the caller's own scope: every stored key (`/v1/keys`) and the store's
counters and capacity (`/v1/stats`)."""

# No `from __future__ import annotations`: FastAPI resolves the route signatures.
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from kvserver.errors import errors
from kvserver.listings import key_lines
from kvserver.services import Caller, Svc
from kvserver.tenant_view import tenant_stats

router = APIRouter()


@router.get(
    "/v1/keys", tags=["chunks"], response_class=StreamingResponse,
    summary="Every stored key of the caller's scope, one per line",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **errors(429)},
)
async def list_keys(svc: Svc, who: Caller) -> StreamingResponse:
    slot = svc.listings.take(who.name)  # SlotsFull: 429
    return StreamingResponse(key_lines(who.store.list_keys(), slot), media_type="text/plain")


@router.get("/v1/stats", tags=["service"], summary="The caller's store counters and capacity")
async def stats(svc: Svc, who: Caller) -> dict[str, Any]:
    # A tenant sees its own figures, not where the store lives (kvserver.tenant_view).
    return who.store.stats() if svc.tokens is None else tenant_stats(who.store.stats())
