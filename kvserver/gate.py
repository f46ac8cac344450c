"""The gate in front of every route: bearer tokens checked from the request head, before
any route or body parser runs, and no unread body kept after an answer.

A `/v1/*` request without a valid token is answered 401 or 403 from its head alone: its
body is never read. Any answer given while the request's body is still unread (a refusal:
401, 403, 408, 413, 415, 503) carries `connection: close`, so the server stops reading
that connection instead of draining the rest of the body into nothing; a refused request
leaves nothing behind.
"""

from __future__ import annotations

import json
from typing import Any

from kvserver.auth import ADMIN, TokenTable

# Routes that need a token when tokens are configured (health, readiness, metrics and the
# OpenAPI document stay open for load balancers and scrapers).
TENANT_PREFIX = "/v1/"
# Where the gate leaves the caller's tenant ("" without tokens) in the ASGI scope.
TENANT_SCOPE_KEY = "kvstash.tenant"


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
