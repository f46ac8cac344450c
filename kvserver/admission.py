"""Request bodies: admitted against a budget of bytes actually held, read under deadlines.

A body is charged for the bytes that have arrived, never for the size it declares: a
client that announces a 1 GiB upload and then drips bytes holds a few bytes of the
budget, not 1 GiB of it, so it cannot make other uploads answer 503. A body is refused
up front (503 + Retry-After) only when its declared size would not fit beside the bytes
really held now, and midway when a part that arrives does not fit (other bodies grew
meanwhile); refusing, never waiting for room, keeps uploads from deadlocking each other.
With several tenants, one tenant's bodies hold at most half the budget, so the other
half always stays open to the rest.

Deadlines: the first byte must come within the stall timeout of the server asking for it
(after `100 Continue`), each later part within the stall timeout of the one before, and
the whole body within the body timeout; else 408. The buffer a body lands in is taken
only once its first byte arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request


class BodyBudget:
    """Bytes of request bodies held by this process, in total and per tenant (one event
    loop: no lock needed)."""

    def __init__(self, total: int, per_tenant: int):
        self.total = total
        self.per_tenant = per_tenant
        self.held = 0
        self.by_tenant: dict[str, int] = {}

    def fits(self, tenant: str, nbytes: int) -> bool:
        return (self.held + nbytes <= self.total
                and self.by_tenant.get(tenant, 0) + nbytes <= self.per_tenant)

    def _add(self, tenant: str, nbytes: int) -> None:
        self.held += nbytes
        left = self.by_tenant.get(tenant, 0) + nbytes
        if left:
            self.by_tenant[tenant] = left
        else:
            self.by_tenant.pop(tenant, None)


class BodyCharge:
    """The bytes one request's body holds in a `BodyBudget`; `release` gives them back."""

    def __init__(self, budget: BodyBudget, tenant: str):
        self.budget = budget
        self.tenant = tenant
        self.bytes = 0

    def admit(self, declared: int) -> None:
        """503 unless a body of `declared` bytes fits beside what is held now."""
        if not self.budget.fits(self.tenant, declared):
            raise _busy()

    def charge(self, nbytes: int) -> None:
        if not self.budget.fits(self.tenant, nbytes):
            raise _busy()
        self.budget._add(self.tenant, nbytes)
        self.bytes += nbytes

    def release(self) -> None:
        self.budget._add(self.tenant, -self.bytes)
        self.bytes = 0


def _busy() -> HTTPException:
    return HTTPException(503, "too many uploads in progress, retry shortly",
                         headers={"Retry-After": "1"})


def declared_length(request: Request) -> int | None:
    """The body's Content-Length (400 when malformed), or None for a chunked body."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    if not (declared.isascii() and declared.isdigit()):
        raise HTTPException(400, f"bad Content-Length {declared!r}")
    return int(declared)


async def read_body(request: Request, limit: int, charge: BodyCharge, *, stall_s: float,
                    total_s: float, what: str = "body",
                    buffer: Callable[[int], memoryview] | None = None) -> memoryview:
    """The whole request body in one buffer, bytes charged to `charge` as they arrive;
    413 past `limit` (from the headers alone when a Content-Length says so), 408 past a
    deadline, 503 when a part does not fit the budget. With a Content-Length the body
    lands in `buffer(size)` (default: a fresh bytearray); without one it grows a
    bytearray."""
    size = declared_length(request)
    if size is not None and size > limit:
        raise HTTPException(413, f"{what} of {size} bytes exceeds the limit of {limit} bytes")
    charge.admit(size if size is not None else 0)
    loop = asyncio.get_running_loop()
    end = loop.time() + total_s
    buf: memoryview | bytearray | None = None
    pos = 0
    while True:
        wait = min(stall_s, end - loop.time())
        try:
            async with asyncio.timeout(wait):
                message = await request.receive()
        except TimeoutError as exc:
            raise HTTPException(408, f"{what} stalled: no bytes for {stall_s:g}s"
                                if wait == stall_s else
                                f"{what} not received within {total_s:g}s") from exc
        if message["type"] != "http.request":
            raise HTTPException(400, f"client disconnected before the {what} ended")
        part = message.get("body", b"")
        if part:
            if pos + len(part) > (limit if size is None else size):
                if size is None:
                    raise HTTPException(413, f"{what} exceeds the limit of {limit} bytes")
                raise HTTPException(400, f"{what} is longer than its Content-Length")
            charge.charge(len(part))
            if buf is None:
                buf = (buffer or _fresh)(size) if size is not None else bytearray()
            if size is None:
                buf += part
            else:
                buf[pos : pos + len(part)] = part
            pos += len(part)
        if not message.get("more_body", False):
            break
    if size is not None and pos != size:
        raise HTTPException(400, f"{what} ended after {pos} of {size} bytes")
    if buf is None:
        buf = bytearray()
    return memoryview(buf)


def _fresh(size: int) -> memoryview:
    return memoryview(bytearray(size))
