"""The gate in front of every route: request paths and bearer tokens checked from the
request head, before any route or body parser runs, and no unread body kept after an answer.

A path whose percent-decoding makes a separator or a control character (`%2F`, `%5C`,
`%00`-`%1F`, `%7F`, or a raw backslash) is answered 400 whatever the route: routing
matches the decoded path, so `/v1/chunks/NS%2FDIGEST` would otherwise be served as
`/v1/chunks/NS/DIGEST`, and a route pattern's `$` would take `/v1/keys%0A` for `/v1/keys`.

A `/v1/*` request without a valid token is answered 401 or 403 from its head alone: its
body is never read. Any answer given while the request's body is still unread (a refusal:
401, 403, 408, 413, 415, 503) carries `connection: close`, so the server stops reading
that connection instead of draining the rest of the body into nothing; a refused request
leaves nothing behind.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvserver.auth import ADMIN, TokenTable

# Routes that need a token when tokens are configured (health, readiness, metrics and the
# OpenAPI document stay open for load balancers and scrapers).
TENANT_PREFIX = "/v1/"
# Where the gate leaves the caller's tenant ("" without tokens) in the ASGI scope.
TENANT_SCOPE_KEY = "kvstash.tenant"
# What a request path must not carry: an encoded slash or backslash (in the raw path), a
# control character or a backslash (in the decoded one).
_ENCODED_SEPARATOR = re.compile(rb"%(2f|5c)", re.IGNORECASE)
_CONTROL_OR_BACKSLASH = re.compile(r"[\x00-\x1f\x7f\\]")


def path_refusal(scope: dict) -> str | None:
    """Why the request's path is refused (400), or None: see the module docstring."""
    raw = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
    found = _ENCODED_SEPARATOR.search(raw)
    if found is not None:
        return (f"request path holds an encoded separator ({found.group().decode()}): "
                "path segments never contain '/' or '\\'")
    bad = _CONTROL_OR_BACKSLASH.search(scope["path"])
    if bad is not None:
        return (f"request path holds a control character or backslash ({bad.group()!r}); "
                "a chunk path is /v1/chunks/<16 hex>/<32 hex>")
    return None


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token if scheme.lower() == "bearer" and token else None
    return None


def _has_unread_body(scope: dict) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False


class RequestGate:
    """Pure ASGI middleware: authenticates `/v1/*` requests from their head, records the
    tenant in the scope, and closes connections whose body an answer leaves unread."""

    def __init__(self, app: Any, tokens: TokenTable | None):
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        unread = _has_unread_body(scope)

        async def receive_noting_the_end() -> Any:
            nonlocal unread
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                unread = False
            return message

        async def send_closing_if_unread(message: Any) -> None:
            if message["type"] == "http.response.start" and unread:
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"connection", b"close")]}
            await send(message)

        refusal = path_refusal(scope)
        if refusal is not None:
            await _refuse(send_closing_if_unread, 400, refusal)
            return
        tenant = ""
        if self.tokens is not None and scope["path"].startswith(TENANT_PREFIX):
            token = bearer_token(scope["headers"])
            if token is None:
                await _refuse(send_closing_if_unread, 401,
                              "missing bearer token (Authorization: Bearer <token>)",
                              [(b"www-authenticate", b"Bearer")])
                return
            found = self.tokens.tenant_for(token)
            if found is None:
                await _refuse(send_closing_if_unread, 403, "token not recognised")
                return
            if found == ADMIN:
                await _refuse(send_closing_if_unread, 403, "an admin token reads /status "
                              "only; chunks need a tenant's token")
                return
            tenant = found
        scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive_noting_the_end, send_closing_if_unread)


async def _refuse(send: Any, status: int, message: str,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
