"""The operator's view of one server: `GET /status` (an HTML page), `GET /status.json`, and
the tier-health gauges that /metrics exports for alerts.

Authenticated like the API, from a token presented as `Authorization: Bearer`, the
`kvstash_token` cookie, or `?token=` (for a browser: the page's form sends it, and the
answer sets the cookie so a reload needs no query). An admin token (tenant `*` in the
tokens file, kvserver.auth) sees every tenant; a tenant's token sees only its own figures
and the server-wide facts that name no tenant (version, store URL, tiers, limits). Without
a tokens file the page is open, like the API. Figures come from the stores' own counters;
read and write GB/s are measured between consecutive views of the page, over at most
RATE_WINDOW_S (since start on the first view).
"""

from __future__ import annotations

import html
import importlib.metadata
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserver.auth import ADMIN, TokenTable
from kvserver.config import ServerConfig
from kvserver.gate import bearer_token
from kvserver.metrics import ServerMetrics, leaf_stats
from storage.base import Store
from storage.options import StoreURL, format_size

COOKIE = "kvstash_token"
RATE_WINDOW_S = 60.0
MAX_SAMPLES = 256  # per viewer scope: a page polled often shortens the window, not memory
ALL = None  # a viewer who sees every tenant (an admin token, or no tokens configured)


def version() -> str:
    try:
        return importlib.metadata.version("kvstash")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def redact(url: str) -> str:
    """A store URL (or a tier chain `a -> b`) with secret-looking options masked."""
    return " -> ".join(StoreURL(part).redacted() for part in url.split(" -> "))


class Rates:
    """Bytes per second between samples taken when the page is viewed, per viewer scope."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._samples: dict[str | None, deque[tuple[float, int, int]]] = {}

    def gbps(self, scope: str | None, read: int, written: int) -> tuple[float, float, float]:
        """(read GB/s, write GB/s, seconds measured over) ending now."""
        now = time.monotonic()
        with self._lock:
            samples = self._samples.setdefault(scope, deque(maxlen=MAX_SAMPLES))
            while samples and now - samples[0][0] > RATE_WINDOW_S:
                samples.popleft()
            t0, r0, w0 = samples[0] if samples else (self._started, 0, 0)
            samples.append((now, read, written))
        span = max(now - t0, 1e-9)
        return (read - r0) / span / 1e9, (written - w0) / span / 1e9, span


@dataclass
class StatusSources:
    """What the page reads: built once by `mount_status`."""

    config: ServerConfig
    root: Store
    scopes: dict[str, Store]  # tenant -> its store ({} without tokens)
    tokens: TokenTable | None
    events: Any  # kvserver.events.EventLog
    rates: Rates
    started: float

    def viewer(self, request: Request) -> str | None | Literal[False]:
        """The tenant whose figures the request may see, ALL, or False (refused)."""
        if self.tokens is None:
            return ALL
        token = presented_token(request)
        found = self.tokens.tenant_for(token) if token else None
        if found is None:
            return False
        return ALL if found == ADMIN else found

    def subscribers(self) -> dict[str, int]:
        return self.events.streams_by_tenant()

    def report(self, viewer: str | None) -> dict[str, Any]:
        """Every figure the page shows, for `viewer` (a tenant, or ALL)."""
        visible = self.scopes if viewer is ALL else {viewer: self.scopes[viewer]}
        if not self.scopes:
            visible = {"": self.root}
        tenants = [_tenant_figures(name, store) for name, store in sorted(visible.items())]
        totals = {k: sum(t[k] for t in tenants) for k in ("gets", "hits", "bytes_read",
                                                           "bytes_written", "errors")}
        read, written, span = self.rates.gbps(viewer, totals["bytes_read"],
                                              totals["bytes_written"])
        streams = self.subscribers()
        tiers = _tiers([self.root, *self.scopes.values()])
        if viewer is not ALL:  # a tier's totals would show what the other tenants hold
            for t in tiers:
                t["chunks"] = t["used_bytes"] = None
        c = self.config
        return {
            "version": version(),
            "uptime_s": round(time.monotonic() - self.started, 1),
            "store": redact(self.root.url),
            "auth": self.tokens is not None,
            "viewer": "admin" if viewer is ALL and self.tokens is not None else viewer,
            "hit_rate": totals["hits"] / totals["gets"] if totals["gets"] else None,
            "gets": totals["gets"],
            "errors": totals["errors"],
            "read_gbps": read,
            "write_gbps": written,
            "rate_window_s": round(span, 1),
            "tiers": tiers,
            "tenants": tenants,
            "subscribers": sum(n for t, n in streams.items() if viewer is ALL or t == viewer),
            "limits": {
                "max_chunk_bytes": c.max_chunk_bytes, "max_lookup_keys": c.max_lookup_keys,
                "max_in_flight_bytes": c.max_in_flight_bytes, "tenant_quota": c.tenant_quota,
                "body_timeout_s": c.body_timeout_s, "events_max_streams": c.events_max_streams,
            },
        }


def _tenant_figures(name: str, store: Store) -> dict[str, Any]:
    stats = store.stats()
    first = leaf_stats(stats)[0]  # the fastest tier: the one capacity and quotas bound
    gets = stats.get("gets") or 0
    return {
        "tenant": name, "chunks": first.get("chunks"), "used_bytes": store.used_bytes(),
        "capacity_bytes": stats.get("capacity_bytes") or first.get("capacity_bytes"),
        "quota_bytes": stats.get("quota_bytes"), "gets": gets, "hits": stats.get("hits") or 0,
        "hit_rate": (stats.get("hits") or 0) / gets if gets else None,
        "bytes_read": stats.get("bytes_read") or 0, "bytes_written": stats.get("bytes_written") or 0,
        "errors": (stats.get("errors") or 0) + (stats.get("put_errors") or 0),
    }


def _breaker(leaf: dict[str, Any]) -> str:
    if leaf.get("breaker_open") is True:
        return "open"
    return str(leaf.get("breaker", "none"))


def _tiers(stores: list[Store]) -> list[dict[str, Any]]:
    """Each tier of the root store (`stores[0]`), its chunks, bytes and errors summed over
    the root and every tenant scope (a scope is a store of its own over the same tiers)."""
    leaves = [leaf_stats(s.stats()) for s in stores]
    out = []
    for i, leaf in enumerate(leaves[0]):
        mine = [ls[i] for ls in leaves if len(ls) > i]
        out.append({
            "tier": i, "backend": leaf.get("backend", "?"), "url": redact(leaf.get("url", "")),
            "breaker": _breaker(leaf), "capacity_bytes": leaf.get("capacity_bytes"),
            "chunks": None if leaf.get("chunks") is None else sum(m.get("chunks") or 0 for m in mine),
            "used_bytes": None if leaf.get("used_bytes") is None
            else sum(m.get("used_bytes") or 0 for m in mine),
            "errors": sum((m.get("errors") or 0) + (m.get("put_errors") or 0) for m in mine),
        })
    return out


class TierHealth(Collector):
    """`kvstash_tier_breaker_open` and `kvstash_tier_errors_total` per tier of the root
    store, labelled by position and backend (no URLs, no tenants: /metrics is open)."""

    def __init__(self, stores: Callable[[], list[Store]]):
        self.stores = stores  # the root store first, then every tenant scope

    def collect(self) -> Iterable[Any]:
        breaker = GaugeMetricFamily("kvstash_tier_breaker_open", "1 while the tier's circuit "
                                    "breaker is open (its requests fail fast)",
                                    labels=["tier", "backend"])
        errors = CounterMetricFamily("kvstash_tier_errors", "failed reads and writes of the "
                                     "tier (each a miss or a dropped save)",
                                     labels=["tier", "backend"])
        for tier in _tiers(self.stores()):
            labels = [str(tier["tier"]), tier["backend"]]
            breaker.add_metric(labels, 1.0 if tier["breaker"] == "open" else 0.0)
            errors.add_metric(labels, float(tier["errors"]))
        yield breaker
        yield errors


def _size(n: int | None) -> str:
    return "—" if n is None else format_size(n)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _row(cells: Iterable[tuple[str, Any]]) -> str:
    return "<tr>" + "".join(f'<td data-figure="{k}">{html.escape(str(v))}</td>'
                            for k, v in cells) + "</tr>"


def _table(head: list[str], rows: list[str]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2430;background:#f6f7f9}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:24px 0 8px}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:10px 14px;min-width:150px}
.card b{display:block;font-size:22px}
table{border-collapse:collapse;background:#fff;min-width:60%}
th,td{border:1px solid #dde1e7;padding:5px 10px;text-align:left}
th{background:#eef1f5} .open{color:#b3261e;font-weight:bold} .muted{color:#687385}
"""


def render_page(r: dict[str, Any]) -> str:
    e = html.escape
    cards = [("hit_rate", "hit rate", _pct(r["hit_rate"])),
             ("read_gbps", "read GB/s", f"{r['read_gbps']:.3f}"),
             ("write_gbps", "write GB/s", f"{r['write_gbps']:.3f}"),
             ("subscribers", "event subscribers", r["subscribers"]),
             ("errors", "store errors", r["errors"])]
    card_html = "".join(f'<div class="card">{e(label)}<b data-figure="{k}">{e(str(v))}</b></div>'
                        for k, label, v in cards)
    tenants = [_row([("tenant", t["tenant"] or "(no tenants)"), ("chunks", t["chunks"]),
                     ("used", _size(t["used_bytes"])), ("capacity", _size(t["capacity_bytes"])),
                     ("quota", _size(t["quota_bytes"])), ("tenant_hit_rate", _pct(t["hit_rate"]))])
               for t in r["tenants"]]
    tiers = []
    for t in r["tiers"]:
        row = _row([("tier", t["tier"]), ("backend", t["backend"]), ("tier_url", t["url"]),
                    ("tier_chunks", "—" if t["chunks"] is None else t["chunks"]),
                    ("tier_used", _size(t["used_bytes"])),
                    ("tier_capacity", _size(t["capacity_bytes"])), ("breaker", t["breaker"])])
        tiers.append(row.replace('data-figure="breaker">open<',
                                 'data-figure="breaker" class="open">open<'))
    limits = [_row([("limit", k), ("value", _size(v) if k.endswith(("_bytes", "_quota")) else
                                        "—" if v is None else v)])
              for k, v in r["limits"].items()]
    who = r["viewer"] or "open (no tokens configured)"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="10">
<title>kvstash kvserver status</title><style>{_STYLE}</style></head><body>
<h1>kvstash kvserver</h1>
<div class="muted">version <span data-figure="version">{e(r['version'])}</span> ·
store <code data-figure="store">{e(r['store'])}</code> · viewing as
<span data-figure="viewer">{e(str(who))}</span> · up {r['uptime_s']:.0f} s ·
rates over the last <span data-figure="rate_window_s">{r['rate_window_s']:.0f}</span> s</div>
<h2>Traffic</h2><div class="cards">{card_html}</div>
<h2>Tenants</h2>{_table(["tenant", "chunks", "bytes", "capacity (shared)", "quota", "hit rate"], tenants)}
<h2>Tiers</h2>{_table(["#", "backend", "url", "chunks", "bytes", "capacity", "breaker"], tiers)}
<h2>Limits</h2>{_table(["limit", "value"], limits)}
</body></html>"""


_LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>kvstash kvserver status</title></head><body style="font:14px system-ui;margin:24px">
<h1 style="font-size:20px">kvstash kvserver</h1><p>{why}</p>
<form method="get" action="/status"><label>token <input type="password" name="token"
autocomplete="off" size="40"></label> <button>show status</button></form></body></html>"""


def presented_token(request: Request) -> str | None:
    """The token a request carries: a bearer header, the page's cookie or `?token=`."""
    return (bearer_token(request.scope["headers"]) or request.cookies.get(COOKIE)
            or request.query_params.get("token"))


def refused_status(request: Request) -> int:
    """As the API answers: 401 without a token, 403 with one the server does not know."""
    return 403 if presented_token(request) else 401


def status_router(sources: StatusSources) -> APIRouter:
    router = APIRouter(tags=["service"])

    @router.get("/status", response_class=HTMLResponse, include_in_schema=True,
                summary="Status page (HTML): hit rate, tenants against capacity and quotas, "
                        "GB/s, breakers, subscribers, version")
    async def status_page(request: Request) -> HTMLResponse:
        viewer = sources.viewer(request)
        if viewer is False:
            code = refused_status(request)
            why = ("token not recognised" if code == 403
                   else "This page needs a token from the server's tokens file.")
            return HTMLResponse(_LOGIN.format(why=html.escape(why)), status_code=code)
        response = HTMLResponse(render_page(sources.report(viewer)),
                                headers={"cache-control": "no-store"})
        token = request.query_params.get("token")
        if token and sources.tokens is not None:
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict",
                                secure=request.url.scheme == "https", path="/status")
        return response

    @router.get("/status.json", summary="The status page's figures as JSON")
    async def status_json(request: Request) -> JSONResponse:
        viewer = sources.viewer(request)
        if viewer is False:
            code = refused_status(request)
            return JSONResponse({"error": "token not recognised" if code == 403
                                 else "missing bearer token (Authorization: Bearer <token>)"},
                                status_code=code, headers={"www-authenticate": "Bearer"})
        return JSONResponse(sources.report(viewer), headers={"cache-control": "no-store"})

    return router


def mount_status(app: FastAPI, metrics: ServerMetrics) -> None:
    """Add /status and /status.json to `app` (after create_app set its state) and the
    tier-health gauges to its /metrics."""
    tenancy, config = app.state.tenancy, app.state.config
    sources = StatusSources(config, tenancy.root, tenancy.scopes, tenancy.tokens,
                            app.state.events, Rates(), time.monotonic())
    metrics.registry.register(TierHealth(tenancy.stores))
    app.include_router(status_router(sources))
