"""Chunk routes: PUT (create-only), GET (whole or a byte range), HEAD and DELETE of
`/v1/chunks/{ns_id}/{digest}`.

Chunk bodies are raw `application/octet-stream`: a PUT body is received into one buffer
sized by Content-Length (or counted while streaming when chunked); a GET answers with a
lent buffer's view, the chunk's open file (sendfile) or its descriptor (Unix sockets), so
the body reaches the transport without a copy (kvserver.transfers, kvserver.bodies).
"""

# No `from __future__ import annotations`: FastAPI resolves the route signatures.
import re
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from kvserver.bodies import FdResponse, FileBodyResponse, ViewResponse
from kvserver.errors import errors
from kvserver.protocol import FDPASS, ZEROCOPY
from kvserver.services import Caller, Svc
from kvserver.transfers import Fetched
from storage.base import BlobFile

OCTETS = "application/octet-stream"
CHUNK_PATH = "/v1/chunks/{ns_id}/{digest}"
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")
_BINARY = {OCTETS: {"schema": {"type": "string", "format": "binary"}}}

NsId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="16 hex chars: the namespace")]
Digest = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="32 hex chars: the chunk")]

router = APIRouter(tags=["chunks"])
# HEAD answers carry no body: kvserver.app documents this router's refusals without one.
heads = APIRouter(tags=["chunks"])


class PutResult(BaseModel):
    created: bool = Field(description="false if the chunk was already stored (puts are create-only)")


def parse_range(header: str, total: int) -> tuple[int, int]:
    """`Range: bytes=a-b | a- | -n` -> (start, stop) with stop exclusive.

    ValueError for a malformed header (400), LookupError for an unsatisfiable one (416).
    """
    m = _RANGE.fullmatch(header.strip())
    if not m or m.groups() == ("", ""):
        raise ValueError(f"malformed Range header {header!r}: expected bytes=START-END")
    first, last = m.groups()
    if first == "":
        suffix = int(last)
        if suffix == 0:
            raise LookupError("empty suffix range")
        return max(total - suffix, 0), total
    start = int(first)
    if last != "" and int(last) < start:
        raise ValueError(f"malformed Range header {header!r}: end before start")
    if start >= total:
        raise LookupError(f"range starts at {start}, chunk has {total} bytes")
    return start, total if last == "" else min(int(last) + 1, total)


def _span(range_: str | None, total: int) -> tuple[int, int, int, dict[str, str]]:
    """(start, stop, status, headers) of the answer to a GET with this Range header."""
    headers = {"accept-ranges": "bytes", "cache-control": "max-age=31536000, immutable"}
    if range_ is None:
        return 0, total, 200, headers
    try:
        start, stop = parse_range(range_, total)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from exc
    except LookupError as exc:
        raise HTTPException(416, str(exc), headers={"content-range": f"bytes */{total}"}) from exc
    headers["content-range"] = f"bytes {start}-{stop - 1}/{total}"
    return start, stop, 206, headers


@router.put(
    CHUNK_PATH, status_code=201, response_model=PutResult,
    summary="Store a chunk (create-only; 200 if it already existed)",
    responses={200: {"model": PutResult}, **errors(400, 408, 413, 415, 503, 507)},
    openapi_extra={"requestBody": {"required": True, "content": _BINARY}},
)
async def put_chunk(request: Request, ns_id: NsId, digest: Digest, svc: Svc, who: Caller) -> Any:
    ctype = request.headers.get("content-type", OCTETS).split(";")[0].strip().lower()
    if ctype != OCTETS:
        raise HTTPException(415, f"chunk bodies are {OCTETS}, not {ctype!r}")
    async with svc.transfers.chunk_body(request, who.name) as body:
        created = await who.store.put(f"{ns_id}/{digest}", body)
    if created:
        svc.metrics.bytes_in.inc(body.nbytes)
    return JSONResponse({"created": created}, status_code=201 if created else 200)


@router.get(
    CHUNK_PATH, response_class=Response,
    summary="Fetch a verified chunk (header + payload); Range gives a byte slice",
    responses={200: {"content": _BINARY}, 206: {"content": _BINARY},
               **errors(400, 404, 416, 503)},
)
async def get_chunk(
    request: Request, ns_id: NsId, digest: Digest, svc: Svc, who: Caller,
    range_: Annotated[str | None, Header(alias="Range")] = None,
    want_fd: Annotated[str | None, Header(
        alias="Kvstash-Fd", description="`1`: on a Unix-socket connection, the chunk may "
        "come as its open file's descriptor (SCM_RIGHTS) with a 1-byte body, the response "
        "header `Kvstash-Fd` giving the chunk's size; elsewhere ignored")] = None,
) -> Response:
    offered = request.scope.get("extensions", {})
    got = await svc.transfers.fetch(who.store, f"{ns_id}/{digest}", ZEROCOPY in offered)
    if got is None:
        raise HTTPException(404, "chunk not found")
    try:
        start, stop, status, headers = _span(range_, got.total)
    except BaseException:
        got.release()
        raise
    fd = want_fd == "1" and range_ is None and FDPASS in offered
    return _chunk_response(svc, got, start, stop, status, headers, fd)


def _chunk_response(svc: Svc, got: Fetched, start: int, stop: int, status: int,
                    headers: dict[str, str], fd: bool) -> Response:
    """The answer that sends bytes [start, stop) of `got` with the fewest copies."""
    metrics = svc.metrics
    metrics.bytes_out.inc(stop - start)
    if isinstance(got.body, BlobFile):
        if fd:
            metrics.bytes_fd.inc(stop - start)
            return FdResponse(got.body, headers, OCTETS)
        metrics.bytes_sendfile.inc(stop - start)
        return FileBodyResponse(got.body, start, stop, status, headers, OCTETS)
    return ViewResponse(got.body[start:stop], status, headers, OCTETS, got.release)


@heads.head(
    CHUNK_PATH, status_code=200, response_class=Response,
    summary="Is the chunk stored? (no body)",
    responses={  # HEAD answers carry no body, so no media type is documented
        200: {"description": "stored"}, 404: {"description": "not stored"},
        400: {"description": "refused (see GET for the JSON error)"},
    },
)
async def head_chunk(ns_id: NsId, digest: Digest, who: Caller) -> Response:
    (present,) = await who.store.exists([f"{ns_id}/{digest}"])
    response = Response(status_code=200 if present else 404)
    # The chunk's size is not known without reading it: say nothing rather than "0".
    del response.headers["content-length"]
    return response


@router.delete(
    CHUNK_PATH, status_code=204, response_class=Response,
    summary="Remove a chunk", responses=errors(400, 404, 503),
)
async def delete_chunk(ns_id: NsId, digest: Digest, who: Caller) -> Response:
    if not await who.store.delete(f"{ns_id}/{digest}"):
        raise HTTPException(404, "chunk not found")
    return Response(status_code=204)
