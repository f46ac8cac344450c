"""The HTTP API: FastAPI routes over one `Store`, one tenant scope per bearer token.

Routes validate, call one store method and map its typed result to a status code. Tokens
are checked from the request head before any route runs (kvserver.gate), and bodies (a
chunk's, a lookup's) are read by the routes themselves, bounded in size and time and
charged to a budget of bytes held (kvserver.admission). Chunk bodies are raw
`application/octet-stream`: a PUT body is received into one buffer sized by
Content-Length (or counted while streaming when chunked); a GET answers with the store's
own bytes object, so the response body is handed to the transport without a copy. Every
error is `{"error": "<one message>"}`.
"""

# No `from __future__ import annotations`: FastAPI resolves the route signatures, and some
# of their types are local to create_app.
import asyncio
import base64
import logging
import os
import re
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field, StrictBool, StringConstraints, ValidationError
from starlette.exceptions import HTTPException

from hashing import KEY_PATTERN
from kvserver.admission import BodyBudget, BodyCharge, read_body
from kvserver.auth import TokenTable
from kvserver.bodies import BufferPool, FdResponse, FileBodyResponse, ViewResponse
from kvserver.config import CONFIG_ENV, ServerConfig
from kvserver.events import EventLog, open_publisher
from kvserver.gate import TENANT_SCOPE_KEY, RequestGate
from kvserver.listings import key_lines, listing_slots
from kvserver.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvserver.metrics import MetricsMiddleware, ServerMetrics, leaf_stats
from kvserver.protocol import FDPASS, ZEROCOPY
from kvserver.protocol import configure as configure_protocol
from kvserver.slots import SlotsFull
from kvserver.status import mount_status
from kvserver.tenant_view import StorePlaces, tenant_stats
from storage.base import BlobFile, Store
from storage.capabilities import SupportsBlobFiles
from storage.errors import ConfigError, InvalidChunk, InvalidKey, StoreFull, StoreUnavailable
from storage.registry import open_store
from storage.tenancy import open_tenants

log = logging.getLogger("kvstash.kvserver")

OCTETS = "application/octet-stream"
# A key that is never stored: the readiness probe asks the backend about it.
READY_PROBE_KEY = "0" * 16 + "/" + "0" * 32
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")

NsId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="16 hex chars: the namespace")]
Digest = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="32 hex chars: the chunk")]
Key = Annotated[str, StringConstraints(pattern=KEY_PATTERN.pattern)]


class ErrorBody(BaseModel):
    error: str = Field(description="one human-readable message")


class PutResult(BaseModel):
    created: bool = Field(description="false if the chunk was already stored (puts are create-only)")


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


class Health(BaseModel):
    status: str


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody} for code in codes}


def _first_error(errors: Any, under: tuple[str, ...] = ()) -> str:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(p) for p in (*under, *first.get("loc", ())))
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


def _parse_lookup(body: memoryview) -> LookupRequest:
    try:
        return LookupRequest.model_validate_json(bytes(body))
    except ValidationError as exc:
        raise HTTPException(400, _first_error(exc.errors(), ("body",))) from exc


def _breaker_open(stats: dict[str, Any]) -> str | None:
    """A tier whose circuit breaker is open (http:// and s3:// report it in their stats)."""
    for leaf in leaf_stats(stats):
        if leaf.get("breaker_open") is True or leaf.get("breaker") == "open":
            return f"circuit breaker open for {leaf.get('url', 'a tier')}"
    return None


def _error_count(stats: dict[str, Any]) -> int:
    return sum(leaf.get("errors") or 0 for leaf in leaf_stats(stats))


def _keep(reuse: bool = True) -> None:
    return None


def presence_bitmap(present: list[bool]) -> str:
    bits = bytearray((len(present) + 7) // 8)
    for i, p in enumerate(present):
        if p:
            bits[i >> 3] |= 1 << (i & 7)
    return base64.b64encode(bits).decode("ascii")


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


class Tenancy:
    """The store each request may touch: the root store, or its tenant's store when tokens
    are configured (storage.tenancy: one capacity shared by all, optional quotas). Opened
    once at start-up (opening a scope may scan a directory)."""

    def __init__(self, store: Store, tokens: TokenTable | None, quota: int | None = None):
        self.root = store
        self.tokens = tokens
        self.scopes: dict[str, Store] = dict(open_tenants(store, tokens.tenants, quota)) if tokens else {}

    def stores(self) -> list[Store]:
        return [self.root, *self.scopes.values()]

    def store_for(self, tenant: str) -> Store:
        """The store of a tenant the gate authenticated ("": no tokens, the root)."""
        return self.scopes[tenant] if self.tokens is not None else self.root


def lookup_body_limit(max_keys: int) -> int:
    # A key is 49 chars; quoted, with a comma and some spacing, 64 bytes is ample.
    return 1024 + 64 * max_keys


@contextmanager
def on_exit_signals(action: Callable[[], None]) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM run `action` (from the signal handler: it
    must only hand work to a loop) before the handlers already there (uvicorn's, which
    start its graceful shutdown). Nothing outside the main thread, where Python runs
    signal handlers (a test client's app, say)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    installed: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: Any, previous: Any = previous) -> None:
            action()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        signal.signal(sig, handler)
        installed[sig] = (handler, previous)
    try:
        yield
    finally:
        for sig, (handler, previous) in installed.items():
            if signal.getsignal(sig) is handler:  # uvicorn restores its own predecessors
                signal.signal(sig, previous)


def create_app(config: ServerConfig, store: Store | None = None) -> FastAPI:
    """The kvserver ASGI app over `config.store_urls` (or an already opened `store`)."""
    store = store if store is not None else open_store(list(config.store_urls))
    tokens = TokenTable.from_file(config.tokens_file) if config.tokens_file else None
    tenancy = Tenancy(store, tokens, config.tenant_quota)
    metrics = ServerMetrics(tenancy.stores)
    bodies = BufferPool(max_bytes=config.max_chunk_bytes)  # GET bodies, see kvserver.bodies
    put_bodies = BufferPool(max_bytes=config.max_chunk_bytes)  # and PUT bodies
    # With several tenants, one tenant's bodies hold at most half the budget.
    per_tenant = config.max_in_flight_bytes // 2 if len(tenancy.scopes) > 1 else config.max_in_flight_bytes
    if per_tenant < config.max_chunk_bytes:
        raise ConfigError(
            f"--max-in-flight-bytes ({config.max_in_flight_bytes}) leaves {per_tenant} bytes per "
            f"tenant, less than one --max-chunk-bytes ({config.max_chunk_bytes}) chunk: raise it "
            "to at least " + ("twice " if len(tenancy.scopes) > 1 else "") + "--max-chunk-bytes")
    budget = BodyBudget(config.max_in_flight_bytes, per_tenant)
    events = EventLog(config.events_ring, max_streams=config.events_max_streams,
                      max_streams_total=config.events_max_streams_total)
    if tokens is None:
        events.watch("", store)
    for tenant, scope in tenancy.scopes.items():
        events.watch(tenant, scope)
    # With tenants, no message tells a client where the stores live (kvserver.tenant_view).
    told = StorePlaces(tenancy.stores()).hide if tokens is not None else str
    listings = listing_slots(config.max_tenant_listings, config.max_listings, tokens is not None)
    if config.events_zmq:
        events.publisher = open_publisher(config.events_zmq, list(tenancy.scopes),
                                          config.events_zmq_all_tenants)

    async def trim_pools() -> None:
        while True:
            await asyncio.sleep(bodies.idle_s / 2)
            bodies.trim()
            put_bodies.trim()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        trimmer = asyncio.create_task(trim_pools())
        loop = asyncio.get_running_loop()
        try:
            # uvicorn stops on SIGINT/SIGTERM once every open response has ended, and an
            # event stream never ends by itself: without this a subscriber kept the server
            # up until it was killed.
            with on_exit_signals(lambda: loop.call_soon_threadsafe(events.end_streams)):
                yield
        finally:
            trimmer.cancel()
            for s in tenancy.stores():
                await s.close()
            events.close()

    app = FastAPI(
        title="kvstash kvserver",
        version="1",
        summary="KV-cache chunks by key: put, get, batched prefix lookup.",
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.tenancy = tenancy
    app.state.metrics = metrics
    app.state.events = events

    if tokens is not None:
        bearer = HTTPBearer(auto_error=False, description="a token from the server's tokens file")

        Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]

        # The gate (kvserver.gate) has checked the token before any route ran; the bearer
        # dependency documents it in the OpenAPI document. async: FastAPI runs a plain
        # `def` dependency in a worker thread, which costs a thread hop on every request.
        async def tenant_store(request: Request, credentials: Credentials) -> Store:
            return tenancy.store_for(request.scope[TENANT_SCOPE_KEY])
    else:

        async def tenant_store() -> Store:
            return tenancy.root

    TenantStore = Annotated[Store, Depends(tenant_store)]
    auth_errors = (401, 403) if tokens is not None else ()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _first_error(exc.errors()))

    @app.exception_handler(InvalidKey)
    @app.exception_handler(InvalidChunk)
    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        return _error(400, told(str(exc)))

    @app.exception_handler(SlotsFull)
    async def no_slot(request: Request, exc: SlotsFull) -> JSONResponse:
        return _error(429, str(exc))

    @app.exception_handler(StoreFull)
    async def full(request: Request, exc: StoreFull) -> JSONResponse:
        return _error(507, told(str(exc)))

    @app.exception_handler(StoreUnavailable)
    async def unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
        return _error(503, told(str(exc)))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, "internal server error")

    chunk_path = "/v1/chunks/{ns_id}/{digest}"
    limit = config.max_chunk_bytes
    deadlines = {"stall_s": config.body_stall_timeout_s, "total_s": config.body_timeout_s}

    @app.put(
        chunk_path, status_code=201, response_model=PutResult, tags=["chunks"],
        summary="Store a chunk (create-only; 200 if it already existed)",
        responses={200: {"model": PutResult},
                   **_errors(400, 408, 413, 415, 503, 507, *auth_errors)},
        openapi_extra={"requestBody": {"required": True, "content": {
            OCTETS: {"schema": {"type": "string", "format": "binary"}}}}},
    )
    async def put_chunk(request: Request, ns_id: NsId, digest: Digest, s: TenantStore) -> Any:
        ctype = request.headers.get("content-type", OCTETS).split(";")[0].strip().lower()
        if ctype != OCTETS:
            raise HTTPException(415, f"chunk bodies are {OCTETS}, not {ctype!r}")
        charge = BodyCharge(budget, request.scope[TENANT_SCOPE_KEY])
        release: Any = _keep
        reuse = True

        def pooled(size: int) -> memoryview:
            # A pooled huge-page buffer (kvserver.bodies), taken once the first byte is in:
            # fresh memory per body costs more than the copy on a VM. Stores do not keep
            # `body` past `put` (the Store contract).
            nonlocal release
            buf, release = put_bodies.borrow(size)
            return buf[:size]

        try:
            body = await read_body(request, limit, charge, what="chunk", buffer=pooled,
                                   **deadlines)
            created = await s.put(f"{ns_id}/{digest}", body)
        except asyncio.CancelledError:
            reuse = False  # a store thread may still be reading the body: never lend it again
            raise
        finally:
            release(reuse)
            charge.release()
        if created:
            metrics.bytes_in.inc(body.nbytes)
        return JSONResponse({"created": created}, status_code=201 if created else 200)

    @app.get(
        chunk_path, tags=["chunks"], response_class=Response,
        summary="Fetch a verified chunk (header + payload); Range gives a byte slice",
        responses={
            200: {"content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}},
            206: {"content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}},
            **_errors(400, 404, 416, 503, *auth_errors),
        },
    )
    async def get_chunk(
        request: Request, ns_id: NsId, digest: Digest, s: TenantStore,
        range_: Annotated[str | None, Header(alias="Range")] = None,
        want_fd: Annotated[str | None, Header(
            alias="Kvstash-Fd", description="`1`: on a Unix-socket connection, the chunk may "
            "come as its open file's descriptor (SCM_RIGHTS) with a 1-byte body, the response "
            "header `Kvstash-Fd` giving the chunk's size; elsewhere ignored")] = None,
    ) -> Response:
        buf, release = bodies.borrow(bodies.hint)
        key = f"{ns_id}/{digest}"
        offered = request.scope.get("extensions", {})
        try:
            if not isinstance(s, SupportsBlobFiles):
                blob = await s.get(key)
                got = None if blob is None else memoryview(blob).cast("B")
            elif ZEROCOPY in offered:
                got = await s.open_blob(key, buf)
            else:
                got = await s.get_blob_into(key, buf)
            if got is None:
                metrics.misses.inc()
                raise HTTPException(404, "chunk not found")
            metrics.hits.inc()
            if isinstance(got, BlobFile):
                release()
                release = got.close
                total = got.size
            else:
                bodies.saw(got.nbytes)
                total = got.nbytes
            headers = {"accept-ranges": "bytes", "cache-control": "max-age=31536000, immutable"}
            status = 200
            if range_ is not None:
                try:
                    start, stop = parse_range(range_, total)
                except ValueError as exc:
                    raise HTTPException(400, str(exc)) from exc
                except LookupError as exc:
                    raise HTTPException(416, str(exc), headers={"content-range": f"bytes */{total}"}) from exc
                headers["content-range"] = f"bytes {start}-{stop - 1}/{total}"
                status = 206
            else:
                start, stop = 0, total
        except BaseException:
            release()
            raise
        metrics.bytes_out.inc(stop - start)
        if isinstance(got, BlobFile) and want_fd == "1" and range_ is None and FDPASS in offered:
            metrics.bytes_fd.inc(stop - start)
            return FdResponse(got, headers, OCTETS)
        if isinstance(got, BlobFile):
            metrics.bytes_sendfile.inc(stop - start)
            return FileBodyResponse(got, start, stop, status, headers, OCTETS)
        return ViewResponse(got[start:stop], status, headers, OCTETS, release)

    @app.head(
        chunk_path, tags=["chunks"], status_code=200, response_class=Response,
        summary="Is the chunk stored? (no body)",
        responses={  # HEAD answers carry no body, so no media type is documented
            200: {"description": "stored"}, 404: {"description": "not stored"},
            **{code: {"description": "refused (see GET for the JSON error)"}
               for code in (400, *auth_errors)},
        },
    )
    async def head_chunk(ns_id: NsId, digest: Digest, s: TenantStore) -> Response:
        (present,) = await s.exists([f"{ns_id}/{digest}"])
        response = Response(status_code=200 if present else 404)
        # The chunk's size is not known without reading it: say nothing rather than "0".
        del response.headers["content-length"]
        return response

    @app.delete(
        chunk_path, tags=["chunks"], status_code=204, response_class=Response,
        summary="Remove a chunk", responses=_errors(400, 404, 503, *auth_errors),
    )
    async def delete_chunk(ns_id: NsId, digest: Digest, s: TenantStore) -> Response:
        if not await s.delete(f"{ns_id}/{digest}"):
            raise HTTPException(404, "chunk not found")
        return Response(status_code=204)

    lookup_limit = lookup_body_limit(config.max_lookup_keys)

    @app.post(
        "/v1/lookup", response_model=LookupResult, tags=["chunks"],
        summary="Batched presence: prefix_len and a bitmap for up to max-lookup-keys keys",
        responses=_errors(400, 408, 413, 503, *auth_errors),
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": LookupRequest.model_json_schema()}}}},
    )
    async def lookup(request: Request, s: TenantStore) -> Any:
        # Read here, not by FastAPI: bounded in size and time, after the gate's token check.
        charge = BodyCharge(budget, request.scope[TENANT_SCOPE_KEY])
        try:
            req = _parse_lookup(await read_body(request, lookup_limit, charge,
                                                what="lookup body", **deadlines))
        finally:
            charge.release()
        n = len(req.keys)
        if n > config.max_lookup_keys:
            raise HTTPException(413, f"{n} keys exceed the lookup limit of {config.max_lookup_keys}")
        if req.stop_at_gap:
            prefix = await s.prefix_len(req.keys)
            present = [True] * prefix + [False] * (n - prefix)
        else:
            present = await s.exists(req.keys)
            prefix = present.index(False) if False in present else n
        metrics.lookup_keys.inc(n)
        metrics.lookup_present.inc(sum(present))
        return {"prefix_len": prefix, "count": n, "present": presence_bitmap(present)}

    @app.get(
        "/v1/keys", tags=["chunks"], response_class=StreamingResponse,
        summary="Every stored key of the caller's scope, one per line",
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                   **_errors(429, *auth_errors)},
    )
    async def list_keys(request: Request, s: TenantStore) -> StreamingResponse:
        slot = listings.take(request.scope[TENANT_SCOPE_KEY])  # SlotsFull: 429
        return StreamingResponse(key_lines(s.list_keys(), slot), media_type="text/plain")

    @app.get(
        "/v1/events", tags=["chunks"], response_class=StreamingResponse,
        summary="The caller's chunks as they are stored and removed (newline-delimited JSON)",
        responses={200: {"content": {"application/x-ndjson": {"schema": {"type": "string"}}}},
                   **_errors(400, 429, *auth_errors)},
    )
    async def stream_events(request: Request, since: int | None = None) -> StreamingResponse:
        if since is not None and since < 0:
            raise HTTPException(400, "since must be a sequence number >= 0")
        tenant = request.scope.get(TENANT_SCOPE_KEY, "") if tokens is not None else ""
        lines = events.open_stream(tenant, since)
        return StreamingResponse(lines, media_type="application/x-ndjson",
                                 headers={"cache-control": "no-store"})

    @app.get("/v1/stats", tags=["service"], summary="The caller's store counters and capacity",
             responses=_errors(*auth_errors))
    async def stats(s: TenantStore) -> dict[str, Any]:
        # A tenant sees its own figures, not where the store lives (kvserver.tenant_view).
        return s.stats() if tokens is None else tenant_stats(s.stats())

    @app.get("/healthz", tags=["service"], response_model=Health, summary="The process is up")
    async def healthz() -> Any:
        return {"status": "ok"}

    @app.get("/readyz", tags=["service"], response_model=Health, responses=_errors(503),
             summary="The backend can serve: root present and writable, disk not full, "
                     "no circuit breaker open, a presence check answered in time")
    async def readyz() -> Any:
        try:
            async with asyncio.timeout(config.ready_timeout_s):
                why = await store.health() or _breaker_open(store.stats())
                if why is None:
                    # A store answers "absent" when it cannot reach its backend, and
                    # counts the failure: a probe that added errors did not get through.
                    errors = _error_count(store.stats())
                    await store.exists([READY_PROBE_KEY])
                    if _error_count(store.stats()) > errors:
                        why = "the backend's presence check failed"
        except TimeoutError as exc:
            raise HTTPException(503, f"backend did not answer within {config.ready_timeout_s}s") from exc
        if why is not None:
            raise HTTPException(503, told(why))
        return {"status": "ready"}

    @app.get("/metrics", tags=["service"], response_class=Response,
             summary="Prometheus metrics",
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        metrics.body_bytes_held.set(budget.held)
        pooled = [bodies.stats(), put_bodies.stats()]
        metrics.pool_lent.set(sum(p["lent"] for p in pooled))
        metrics.pool_free_bytes.set(sum(p["free_bytes"] for p in pooled))
        metrics.note_events(events.streams, events.wakeups)
        metrics.listings.set(listings.open)
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    mount_status(app, metrics)
    app.add_middleware(RequestGate, tokens=tokens)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def app_from_env() -> FastAPI:
    """The app of one `--workers` process: the parent's config arrives as JSON in the
    environment (uvicorn starts workers by importing this factory)."""
    config = ServerConfig.from_json(os.environ[CONFIG_ENV])
    configure_protocol(config.send_timeout_s)
    return create_app(config)
