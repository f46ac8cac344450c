"""Doctor checks of a kvserver deployment: its tokens file, and a running server's health,
readiness, version, limits, breakers and exposure."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

from kvserver.auth import TokenTable
from kvserver.status import version
from kvstash.doctor.findings import Finding, info, ok, unsafe, warn
from storage.errors import ConfigError
from storage.options import format_size

TIMEOUT_S = 5.0


def check_tokens(path: Path) -> list[Finding]:
    try:
        st = path.stat()
    except OSError as exc:
        return [unsafe("tokens.file", f"{path}: {exc.strerror}", "create it: one "
                       "`TENANT TOKEN` line per tenant, mode 600")]
    mode = stat.S_IMODE(st.st_mode)
    out = []
    if mode & 0o077:
        out.append(unsafe("tokens.mode", f"{path} is mode {mode:04o}: other users can read "
                          "every tenant's token (and kvserver refuses to start)",
                          f"chmod 600 {path}"))
    if st.st_uid != os.geteuid():
        out.append(warn("tokens.owner", f"{path} belongs to uid {st.st_uid}, not this user "
                        f"({os.geteuid()})", "run the server as its owner, or chown it"))
    if not out:
        try:
            table = TokenTable.from_file(path)
        except ConfigError as exc:
            return [unsafe("tokens.file", str(exc), "fix the line it names")]
        out.append(ok("tokens.file", f"{path}: mode {mode:04o}, {len(table.tenants)} "
                      f"tenant(s): {', '.join(table.tenants)}"))
    return out


def _loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_url(url: str, token: str | None) -> tuple[str, str | None]:
    """(base URL, token) from `http://host:port?token=...` or a plain base URL."""
    parts = urlsplit(url)
    query_token = parse_qs(parts.query).get("token", [None])[0]
    return f"{parts.scheme}://{parts.netloc}", token or query_token


def check_server(url: str, token: str | None = None, timeout: float = TIMEOUT_S) -> list[Finding]:
    """What a running kvserver says of itself: health, readiness, version, limits, breakers.
    A request that fails or takes longer than `timeout` seconds is a finding, never an
    exception."""
    base, token = server_url(url, token)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=base, timeout=timeout, headers=headers) as client:
        try:
            return _ask_server(client, base)
        except httpx.TimeoutException as exc:
            return [unsafe("server.health", f"{base}: no answer within {timeout:g} s "
                           f"({type(exc).__name__})",
                           "check the server's load and its backend; --timeout to wait longer")]
        except httpx.HTTPError as exc:
            return [unsafe("server.health", f"{base}: not answering ({exc})",
                           "start it, or check the address and the firewall")]


def _ask_server(client: httpx.Client, base: str) -> list[Finding]:
    out: list[Finding] = []
    client.get("/healthz").raise_for_status()
    ready = client.get("/readyz")
    if ready.status_code == 200:
        out.append(ok("server.ready", f"{base}: ready"))
    else:
        why = _error(ready)
        out.append(unsafe("server.ready", f"{base}: not ready ({ready.status_code}: {why})",
                          "see the store findings; `kvstash doctor --store` on its backend"))
    status = client.get("/status.json")
    if status.status_code == 404:
        out.append(warn("server.version", f"{base}: no /status.json (kvstash before the "
                        "status page): version and limits unknown", "upgrade the server"))
        return out
    if status.status_code == 401:
        out.append(warn("server.version", f"{base}: /status.json wants a token",
                        "pass --token (an admin token sees every tenant)"))
        return out
    out += _status_findings(base, status.json())
    return out


def _error(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error"))
    except ValueError:
        return response.text[:200]


def _status_findings(base: str, s: dict[str, Any]) -> list[Finding]:
    out = []
    mine = version()
    if s["version"] == mine:
        out.append(ok("server.version", f"{base}: kvstash {s['version']} (same as this client)"))
    else:
        out.append(warn("server.version", f"{base}: kvstash {s['version']}, this client "
                        f"{mine}", "run one version across servers and engines"))
    lim = s["limits"]
    quota = format_size(lim["tenant_quota"]) if lim["tenant_quota"] else "none"
    out.append(info("server.limits", f"max chunk {format_size(lim['max_chunk_bytes'])}, "
                    f"max lookup keys {lim['max_lookup_keys']}, in-flight bodies "
                    f"{format_size(lim['max_in_flight_bytes'])}, tenant quota {quota}, "
                    f"event streams per tenant {lim['events_max_streams']}"))
    for tier in s["tiers"]:
        if tier["breaker"] == "open":
            out.append(unsafe("server.breaker", f"tier {tier['tier']} ({tier['url']}): circuit "
                              "breaker open: its reads are misses", "check that backend "
                              "(`kvstash doctor --store URL`)"))
    host = urlsplit(base).hostname or ""
    if not s["auth"] and not _loopback(host):
        out.append(unsafe("server.auth", f"{base}: no tokens file, on a network address: "
                          "anyone who reaches it reads and writes every prefix",
                          "start it with --auth-tokens FILE"))
    elif s["auth"] and base.startswith("http://") and not _loopback(host):
        out.append(warn("server.tls", f"{base}: tokens and KV travel unencrypted",
                        "serve with --tls-cert/--tls-key, or keep the link private"))
    else:
        out.append(ok("server.auth", f"{base}: " + ("tokens required" if s["auth"]
                                                    else "open, on loopback only")))
    return out
