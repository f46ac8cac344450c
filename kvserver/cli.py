"""`kvstash serve`: flags -> ServerConfig -> the app under uvicorn, on a socket bound here.

The socket is bound before uvicorn starts so that `--port 0` works: the line printed at
start-up names the real port (tests and scripts read it). With `--unix-socket PATH` the
same app also listens on a Unix stream socket, for clients on this host: a second line
names the store URL they use.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kvserver.config import (
    CONFIG_ENV,
    DEFAULT_BODY_STALL_TIMEOUT_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_IN_FLIGHT_BYTES,
    DEFAULT_MAX_LISTINGS,
    DEFAULT_MAX_LOOKUP_KEYS,
    DEFAULT_MAX_TENANT_LISTINGS,
    DEFAULT_PORT,
    DEFAULT_SEND_TIMEOUT_S,
    DEFAULT_SHUTDOWN_GRACE_S,
    ServerConfig,
    default_store_url,
)
from storage.errors import ConfigError
from storage.options import StoreURL, parse_seconds, parse_size

# Idle keep-alive connections live longer than the client pool's idle limit (30 s), so a
# pooled connection is normally closed by the client, not by surprise under it.
KEEP_ALIVE_S = 75
# A --unix-socket file's permissions: the server's user and group connect; others do not.
UNIX_SOCKET_MODE = 0o660


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", action="append", metavar="URL",
                   help="store URL; repeat for tiers, fastest first "
                        "(default: a local directory, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--unix-socket", metavar="PATH", type=Path,
                   help="also listen on this Unix socket (mode 0660), for clients on this "
                        "host: faster than loopback TCP")
    p.add_argument("--auth-tokens", metavar="FILE", type=Path,
                   help="`TENANT TOKEN` lines; each token gets its tenant's private key space")
    p.add_argument("--tenant-quota", type=parse_size, metavar="SIZE",
                   help="most bytes one tenant may hold (its least recently used chunks go "
                        "past it); the store's capacity is shared by all tenants")
    p.add_argument("--max-chunk-bytes", type=parse_size, default=DEFAULT_MAX_CHUNK_BYTES,
                   metavar="SIZE", help="largest accepted chunk body (default 1GiB)")
    p.add_argument("--max-lookup-keys", type=int, default=DEFAULT_MAX_LOOKUP_KEYS,
                   metavar="N", help=f"most keys in one lookup (default {DEFAULT_MAX_LOOKUP_KEYS})")
    p.add_argument("--max-in-flight-bytes", "--max-inflight-bytes", dest="max_in_flight_bytes",
                   type=parse_size, default=DEFAULT_MAX_IN_FLIGHT_BYTES,
                   metavar="SIZE", help="request body bytes held at once per process, counted "
                                        "as they arrive; beyond it 503 (default 4GiB)")
    p.add_argument("--body-timeout", type=parse_seconds, default=DEFAULT_BODY_TIMEOUT_S,
                   metavar="SECONDS", help="a PUT body must arrive within this time, else 408 "
                                           f"(default {DEFAULT_BODY_TIMEOUT_S:g}s)")
    p.add_argument("--body-stall-timeout", type=parse_seconds,
                   default=DEFAULT_BODY_STALL_TIMEOUT_S, metavar="SECONDS",
                   help="a body that sends nothing for this long (its first byte included) "
                        f"gets 408 (default {DEFAULT_BODY_STALL_TIMEOUT_S:g}s)")
    p.add_argument("--send-timeout", type=parse_seconds, default=DEFAULT_SEND_TIMEOUT_S,
                   metavar="SECONDS", help="a client that takes no response bytes for this "
                   f"long is disconnected (default {DEFAULT_SEND_TIMEOUT_S:g}s)")
    p.add_argument("--max-listings", type=int, default=DEFAULT_MAX_LISTINGS, metavar="N",
                   help="GET /v1/keys listings running at once per server process; more get "
                        f"429 (default {DEFAULT_MAX_LISTINGS})")
    p.add_argument("--max-tenant-listings", type=int, default=DEFAULT_MAX_TENANT_LISTINGS,
                   metavar="N", help="... and per tenant, with --auth-tokens "
                                     f"(default {DEFAULT_MAX_TENANT_LISTINGS})")
    p.add_argument("--shutdown-grace", type=parse_seconds, default=DEFAULT_SHUTDOWN_GRACE_S,
                   metavar="SECONDS", help="on SIGTERM/SIGINT, requests still running after "
                   "this long are cancelled and their connections closed, and the process "
                   f"exits (default {DEFAULT_SHUTDOWN_GRACE_S:g}s)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="server processes sharing the port (default 1); needs a shared "
                        "backend (file://, s3://): a memory:// tier would be per process")
    p.add_argument("--tls-cert", metavar="PEM", type=Path,
                   help="serve https:// with this certificate chain (needs --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", type=Path, help="the certificate's private key")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--events-zmq", metavar="ENDPOINT",
                   help="publish KV events (chunks stored and removed) on a ZMQ PUB socket in "
                        "vLLM's KV-event format, e.g. tcp://127.0.0.1:5557 (default: off; "
                        "GET /v1/events streams them either way)")
    p.add_argument("--events-ring", type=int, default=65536, metavar="N",
                   help="recent events a /v1/events subscriber can resume from (default 65536)")
    p.add_argument("--events-max-streams", type=int, default=64, metavar="N",
                   help="open /v1/events streams one tenant may hold per server process; "
                        "more get 429 (default 64)")
    p.add_argument("--events-max-streams-total", type=int, default=1024, metavar="N",
                   help="open /v1/events streams of all tenants per server process; more "
                        "get 429 (default 1024)")
    p.add_argument("--events-zmq-all-tenants", action="store_true",
                   help="with --auth-tokens, start --events-zmq anyway: its subscribers are "
                        "not authenticated and receive every tenant's events")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        store_urls=tuple(args.store) if args.store else (default_store_url(),),
        tokens_file=args.auth_tokens,
        max_chunk_bytes=args.max_chunk_bytes,
        max_lookup_keys=args.max_lookup_keys,
        body_timeout_s=args.body_timeout,
        max_in_flight_bytes=args.max_in_flight_bytes,
        body_stall_timeout_s=args.body_stall_timeout,
        send_timeout_s=args.send_timeout,
        shutdown_grace_s=getattr(args, "shutdown_grace", DEFAULT_SHUTDOWN_GRACE_S),
        max_listings=getattr(args, "max_listings", DEFAULT_MAX_LISTINGS),
        max_tenant_listings=getattr(args, "max_tenant_listings", DEFAULT_MAX_TENANT_LISTINGS),
        tenant_quota=getattr(args, "tenant_quota", None),
        events_zmq=getattr(args, "events_zmq", None),
        events_ring=getattr(args, "events_ring", 65536),
        events_max_streams=getattr(args, "events_max_streams", 64),
        events_max_streams_total=getattr(args, "events_max_streams_total", 1024),
        events_zmq_all_tenants=getattr(args, "events_zmq_all_tenants", False),
    )


def _listening(sock: socket.socket, address: Any, where: str,
               after_bind: Callable[[], None] | None = None) -> socket.socket:
    """`sock` bound to `address` and listening, inheritable by worker processes; on
    failure closed, and one line naming `where`."""
    try:
        sock.bind(address)
        if after_bind is not None:
            after_bind()
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {where}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return _listening(sock, (host, port), f"{host}:{port}")


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix stream socket at `path`. A socket file left by a server that is gone
    is replaced; a live server's socket, or any other file, is an error."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise OSError(f"cannot listen on {path}: it exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # stale: nobody listens on it
        else:
            raise OSError(f"cannot listen on {path}: another server is listening there")
        finally:
            probe.close()
    return _listening(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), str(path), str(path),
                      lambda: os.chmod(path, UNIX_SOCKET_MODE))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _zmq_is_local(endpoint: str) -> bool:
    """Whether a ZMQ endpoint is reachable from this host only (ipc://, inproc://, or tcp://
    on a loopback address; `*`, a wildcard address or an interface name is not)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    return _is_loopback(rest.rpartition(":")[0].strip("[]"))


# Open files a server asks for at start where its hard limit allows (the kernel's own cap,
# fs.nr_open, is 1048576 by default).
WANTED_OPEN_FILES = 1 << 20
FEW_OPEN_FILES = 4096


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (at most
    WANTED_OPEN_FILES) and return it. Every connection holds a descriptor: under the
    common default soft limit of 1024, one client holding that many idle connections
    would make every other client's request fail (docs/kvserver.md, open files)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANTED_OPEN_FILES)
    while want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):  # above the kernel's fs.nr_open: try less
            want //= 2
    return soft


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from kvserver.app import create_app
    from kvserver.protocol import BoundedHeadProtocol, configure

    config = config_from_args(args)
    workers = args.workers
    if workers < 1:
        raise ConfigError("--workers must be at least 1")
    if workers > 1 and any(StoreURL(u).scheme == "memory" for u in config.store_urls):
        raise ConfigError("--workers > 1 needs shared stores: each process would have its own "
                          "memory:// tier")
    if workers > 1 and config.events_zmq:
        raise ConfigError("--events-zmq needs --workers 1: every process would publish its own "
                          "sequence on its own socket")
    if config.events_ring < 1:
        raise ConfigError("--events-ring must be at least 1")
    if config.events_max_streams < 1:
        raise ConfigError("--events-max-streams must be at least 1")
    if config.events_max_streams_total < 1:
        raise ConfigError("--events-max-streams-total must be at least 1")
    if config.max_listings < 1 or config.max_tenant_listings < 1:
        raise ConfigError("--max-listings and --max-tenant-listings must be at least 1")
    if config.shutdown_grace_s < 0:
        raise ConfigError("--shutdown-grace must be 0 or more seconds")
    if config.tenant_quota is not None and config.tokens_file is None:
        raise ConfigError("--tenant-quota needs --auth-tokens (tenants come from tokens)")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("give both --tls-cert and --tls-key, or neither")
    for path in (args.tls_cert, args.tls_key):
        if path is not None and not path.is_file():
            raise ConfigError(f"TLS file {path} does not exist")
    open_files = raise_open_file_limit()  # inherited by --workers processes
    if open_files < FEW_OPEN_FILES:
        print(f"kvstash serve: warning: {open_files} open files at most (hard limit): every "
              "connection takes one; raise it (ulimit -Hn, LimitNOFILE=) for many clients",
              file=sys.stderr, flush=True)
    # Built here even with workers: bad stores or tokens fail now, in one line.
    app = create_app(config)
    configure(config.send_timeout_s)
    sock = bind(args.host, args.port)
    sockets = [sock]
    unix_path = getattr(args, "unix_socket", None)
    if unix_path is not None:
        unix_path = unix_path.absolute()
        try:
            sockets.append(bind_unix(unix_path))
        except OSError:
            sock.close()
            raise
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    stores = ", ".join(StoreURL(u).redacted() for u in config.store_urls)
    auth = f"tenants: {', '.join(app.state.tenancy.scopes)}" if config.tokens_file else "no auth"
    scheme = "https" if args.tls_cert else "http"
    print(f"kvstash serve: {scheme}://{shown}:{port} -> {stores} ({auth})", flush=True)
    if unix_path is not None:
        local = f"{scheme}://localhost?unix_socket={quote(str(unix_path), safe='/')}"
        print(f"kvstash serve: clients on this host: {local}", flush=True)
    if not config.tokens_file and not _is_loopback(host):
        print("kvstash serve: warning: listening beyond loopback without --auth-tokens",
              file=sys.stderr, flush=True)
    if config.events_zmq and not _zmq_is_local(config.events_zmq):
        print(f"kvstash serve: warning: --events-zmq {config.events_zmq} is reachable beyond "
              "this host, and its subscribers are not authenticated: anyone who connects "
              "receives every chunk event", file=sys.stderr, flush=True)
    common = {
        "log_level": "info" if getattr(args, "verbose", False) else "warning",
        "access_log": args.access_log, "timeout_keep_alive": KEEP_ALIVE_S, "lifespan": "on",
        # On a stop signal: idle connections close at once, running requests get this
        # long, then uvicorn cancels them and the process exits.
        "timeout_graceful_shutdown": config.shutdown_grace_s,
        # httptools with a cap on request-head size and time (see kvserver/protocol.py).
        "http": BoundedHeadProtocol,
    }
    if args.tls_cert:
        common |= {"ssl_certfile": str(args.tls_cert), "ssl_keyfile": str(args.tls_key)}
    def remove_unix_socket() -> None:
        if unix_path is not None:
            unix_path.unlink(missing_ok=True)

    class Server(uvicorn.Server):
        # Removed at shutdown, before uvicorn re-raises the signal that stopped it (which
        # ends the process before any `finally` below could run).
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            try:
                await super().shutdown(sockets=sockets)
            finally:
                remove_unix_socket()

    try:
        if workers == 1:
            Server(uvicorn.Config(app, **common)).run(sockets=sockets)
            return 0
        os.environ[CONFIG_ENV] = config.to_json()
        uv_config = uvicorn.Config("kvserver.app:app_from_env", factory=True, workers=workers,
                                   **common)
        Multiprocess(uv_config, sockets=sockets).run()
        return 0
    finally:
        remove_unix_socket()


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserver.cli`: the same as `kvstash serve`, without loading other commands."""
    parser = argparse.ArgumentParser(prog="kvstash serve", description="serve a store over HTTP")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as exc:
        print(f"kvstash serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
