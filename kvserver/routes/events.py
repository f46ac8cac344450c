"""The event stream route: the caller's chunks as they are stored and removed, as
newline-delimited JSON, resumable from a sequence number (kvserver.events)."""

# No `from __future__ import annotations`: FastAPI resolves the route signatures.
from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException

from kvserver.errors import errors
from kvserver.services import Caller, Svc

router = APIRouter(tags=["chunks"])


@router.get(
    "/v1/events", response_class=StreamingResponse,
    summary="The caller's chunks as they are stored and removed (newline-delimited JSON)",
    responses={200: {"content": {"application/x-ndjson": {"schema": {"type": "string"}}}},
               **errors(400, 429)},
)
async def stream_events(svc: Svc, who: Caller, since: int | None = None) -> StreamingResponse:
    if since is not None and since < 0:
        raise HTTPException(400, "since must be a sequence number >= 0")
    lines = svc.events.open_stream(who.name, since)  # SlotsFull: 429
    return StreamingResponse(lines, media_type="application/x-ndjson",
                             headers={"cache-control": "no-store"})
