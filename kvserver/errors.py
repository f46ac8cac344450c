"""How the API answers a failure: one `{"error": "<message>"}` body, a status code per
typed error, and the OpenAPI entries that document them."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from kvserver.slots import SlotsFull
from storage.errors import InvalidChunk, InvalidKey, StoreFull, StoreUnavailable

log = logging.getLogger("kvstash.kvserver")


class ErrorBody(BaseModel):
    error: str = Field(description="one human-readable message")


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for error statuses (each an ErrorBody)."""
    return {code: {"model": ErrorBody} for code in codes}


# What a `/v1/*` route may answer behind --auth-tokens (the gate's refusals).
AUTH_ERRORS = errors(401, 403)
# ... documented without a body where the method carries none (HEAD).
AUTH_ERRORS_NO_BODY: dict[int | str, dict[str, Any]] = {
    code: {"description": "refused (see GET for the JSON error)"} for code in (401, 403)}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def first_error(found: Any, under: tuple[str, ...] = ()) -> str:
    """One line for the first of pydantic's validation errors: `where: what`."""
    first = found[0] if found else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(p) for p in (*under, *first.get("loc", ())))
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


def _told(request: Request, message: str) -> str:
    # Behind tokens no message says where the stores live (kvserver.tenant_view).
    return request.app.state.services.told(message)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(400, first_error(exc.errors()))


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    return error_response(400, _told(request, str(exc)))


async def _no_slot(request: Request, exc: Exception) -> JSONResponse:
    return error_response(429, str(exc))


async def _full(request: Request, exc: Exception) -> JSONResponse:
    return error_response(507, _told(request, str(exc)))


async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
    return error_response(503, _told(request, str(exc)))


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    """Map each typed error to its status: a client's mistake 400, no slot 429, the store
    full 507 or unreachable 503, anything unforeseen 500 (logged, never shown)."""
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(InvalidKey, _invalid)
    app.add_exception_handler(InvalidChunk, _invalid)
    app.add_exception_handler(SlotsFull, _no_slot)
    app.add_exception_handler(StoreFull, _full)
    app.add_exception_handler(StoreUnavailable, _unavailable)
    app.add_exception_handler(Exception, _internal)
