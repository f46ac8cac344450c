"""The lookup route: which of up to `max_lookup_keys` chunk keys are stored, as a prefix
length and a presence bitmap, in one request."""

# No `from __future__ import annotations`: FastAPI resolves the route signatures.
import base64
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, StrictBool, StringConstraints, ValidationError
from starlette.exceptions import HTTPException

from hashing import KEY_PATTERN
from kvserver.errors import errors, first_error
from kvserver.services import Caller, Svc
from storage.base import Store

Key = Annotated[str, StringConstraints(pattern=KEY_PATTERN.pattern)]

router = APIRouter(tags=["chunks"])


class LookupRequest(BaseModel):
    keys: list[Key] = Field(description="chunk keys in prompt order")
    stop_at_gap: StrictBool = Field(
        False, description="only check keys up to the first absent one (cheaper for prefix_len)"
    )


class LookupResult(BaseModel):
    prefix_len: int = Field(description="how many leading keys are present")
    count: int = Field(description="number of keys asked about")
    present: str = Field(
        description="base64 bitmap, bit i (byte i//8, bit i%8, LSB first) = keys[i] present; "
        "with stop_at_gap, bits past prefix_len are 0"
    )


def lookup_body_limit(max_keys: int) -> int:
    # A key is 49 chars; quoted, with a comma and some spacing, 64 bytes is ample.
    return 1024 + 64 * max_keys


def presence_bitmap(present: list[bool]) -> str:
    bits = bytearray((len(present) + 7) // 8)
    for i, p in enumerate(present):
        if p:
            bits[i >> 3] |= 1 << (i & 7)
    return base64.b64encode(bits).decode("ascii")


def parse_lookup(body: memoryview) -> LookupRequest:
    try:
        return LookupRequest.model_validate_json(bytes(body))
    except ValidationError as exc:
        raise HTTPException(400, first_error(exc.errors(), ("body",))) from exc


async def presence(store: Store, keys: list[str], stop_at_gap: bool) -> tuple[int, list[bool]]:
    """(prefix_len, present) of `keys` in `store`; with `stop_at_gap`, nothing past the
    first absent key is asked about (and all of it reads absent)."""
    n = len(keys)
    if stop_at_gap:
        prefix = await store.prefix_len(keys)
        return prefix, [True] * prefix + [False] * (n - prefix)
    present = await store.exists(keys)
    return (present.index(False) if False in present else n), present


@router.post(
    "/v1/lookup", response_model=LookupResult,
    summary="Batched presence: prefix_len and a bitmap for up to max-lookup-keys keys",
    responses=errors(400, 408, 413, 503),
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": LookupRequest.model_json_schema()}}}},
)
async def lookup(request: Request, svc: Svc, who: Caller) -> Any:
    most = svc.config.max_lookup_keys
    req = parse_lookup(await svc.transfers.small_body(
        request, who.name, lookup_body_limit(most), "lookup body"))
    n = len(req.keys)
    if n > most:
        raise HTTPException(413, f"{n} keys exceed the lookup limit of {most}")
    prefix, present = await presence(who.store, req.keys, req.stop_at_gap)
    svc.metrics.lookup_keys.inc(n)
    svc.metrics.lookup_present.inc(sum(present))
    return {"prefix_len": prefix, "count": n, "present": presence_bitmap(present)}
