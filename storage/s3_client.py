"""The S3 connection: URL options, one aiobotocore client per event loop, the shared breaker.

Every scope (tenant) of one `s3://` store shares one `S3Connection`: its options, its
per-loop clients (each with its own aiohttp connection pool of `pool` sockets and an
in-flight gate of `max_in_flight` requests), one blocking botocore client with the reader
threads that stream GET bodies through it (see `S3Store` in storage/s3.py for why), its
circuit breaker and what it learned about the server (whether it enforces If-None-Match).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import BotoCoreError
from botocore.session import Session

from storage.breaker import BreakerOptions
from storage.codec import HEADER_SIZE, MAX_CHUNK
from storage.errors import ConfigError
from storage.options import StoreURL, parse_bool, parse_seconds, parse_size

MiB = 1024 * 1024


@dataclass(frozen=True)
class S3Options:
    bucket: str
    prefix: str
    endpoint: str | None = None
    region: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    session_token: str | None = None
    profile: str | None = None
    anonymous: bool = False
    addressing: str = "auto"
    pool: int = 64
    max_in_flight: int = 64
    retries: int = 4
    retry_mode: str = "standard"
    connect_timeout: float = 2.0
    read_timeout: float = 5.0
    timeout: float = 30.0
    range_size: int = 16 * MiB
    split_reads: int = 1
    max_chunk: int = MAX_CHUNK
    multipart_threshold: int = 64 * MiB
    part_size: int = 16 * MiB
    checksum: str = "when_required"
    sign_payload: bool = False
    conditional: str = "auto"
    breaker: BreakerOptions = BreakerOptions(failures=5, cooldown_s=5.0)
    touch: float = 3600.0
    verify: bool = True

    @classmethod
    def from_url(cls, u: StoreURL) -> S3Options:
        bucket = u.netloc
        if not bucket or "@" in bucket:
            raise ConfigError(f"{u.redacted()}: expected s3://bucket/prefix")
        prefix = u.path.strip("/")
        endpoint = u.take("endpoint")
        try:
            host = urlsplit(endpoint).hostname if endpoint else None
        except ValueError as e:
            raise ConfigError(f"{u.redacted()}: endpoint: {e}") from None
        pool = u.take("pool", int, 64)

        def choice(name: str, allowed: tuple[str, ...], default: str) -> str:
            value = u.take(name, str, default)
            if value not in allowed:
                raise ConfigError(f"{u.redacted()}: {name}={value!r}: expected one of {allowed}")
            return value

        opts = cls(
            bucket=bucket,
            prefix=f"{prefix}/" if prefix else "",
            endpoint=endpoint,
            region=u.take("region"),
            access_key=u.take("access_key"),
            secret_key=u.take("secret_key"),
            session_token=u.take("session_token"),
            profile=u.take("profile"),
            anonymous=u.take("anonymous", parse_bool, False),
            addressing=choice("addressing", ("auto", "path", "virtual"),
                              "path" if endpoint else "auto"),
            pool=pool,
            max_in_flight=_in_flight(u, pool),
            retries=u.take("retries", int, 4),
            retry_mode=choice("retry_mode", ("standard", "adaptive", "legacy"), "standard"),
            connect_timeout=u.take("connect_timeout", parse_seconds, 2.0),
            read_timeout=u.take("read_timeout", parse_seconds, 5.0),
            timeout=u.take("timeout", parse_seconds, 30.0),
            range_size=u.take("range_size", parse_size, 16 * MiB),
            split_reads=u.take("split_reads", int, 0 if _on_this_host(host) else 1),
            max_chunk=u.take("max_chunk", parse_size, MAX_CHUNK),
            multipart_threshold=u.take("multipart_threshold", parse_size, 64 * MiB),
            part_size=u.take("part_size", parse_size, 16 * MiB),
            checksum=choice("checksum", ("when_required", "when_supported"), "when_required"),
            sign_payload=u.take("sign_payload", parse_bool, False),
            conditional=choice("conditional", ("auto", "header", "head"), "auto"),
            breaker=BreakerOptions.from_url(u, failures=5, cooldown_s=5.0),
            touch=u.take("touch", parse_seconds, 3600.0),
            verify=u.take("verify", parse_bool, True),
        )
        u.finish()
        if (opts.access_key is None) != (opts.secret_key is None):
            raise ConfigError(f"{u.redacted()}: give both access_key and secret_key, or neither")
        if opts.pool < 1 or opts.max_in_flight < 1 or opts.retries < 1:
            raise ConfigError(f"{u.redacted()}: pool, max_in_flight and retries must be >= 1")
        if opts.split_reads < 0:
            raise ConfigError(f"{u.redacted()}: split_reads must be >= 0")
        if opts.max_chunk < HEADER_SIZE:
            raise ConfigError(f"{u.redacted()}: max_chunk must be at least {HEADER_SIZE} bytes")
        if opts.range_size < MiB or opts.part_size < 5 * MiB:
            raise ConfigError(f"{u.redacted()}: range_size must be >= 1MiB, part_size >= 5MiB")
        if endpoint and not endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"{u.redacted()}: endpoint must be an http:// or https:// URL")
        if opts.addressing == "virtual" and host and (host == "localhost" or _is_ip(host)):
            raise ConfigError(f"{u.redacted()}: addressing=virtual puts the bucket in the host "
                              f"name ({opts.bucket}.{host}), which cannot reach an IP-address or "
                              "localhost endpoint: set addressing=path")
        return opts

    def client_config(self) -> AioConfig:
        return AioConfig(**self._config_args())

    def blocking_config(self) -> Config:
        """The same settings for the blocking botocore client that reads GET bodies."""
        return Config(**self._config_args())

    def _config_args(self) -> dict[str, Any]:
        s3: dict[str, Any] = {"addressing_style": self.addressing,
                              "payload_signing_enabled": self.sign_payload}
        return dict(
            max_pool_connections=self.pool,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            retries={"total_max_attempts": self.retries, "mode": self.retry_mode},
            request_checksum_calculation=self.checksum,
            response_checksum_validation=self.checksum,
            signature_version=UNSIGNED if self.anonymous else None,
            tcp_keepalive=True,
            s3=s3,
        )


_SESSIONS: dict[str | None, AioSession] = {}
_BLOCKING_SESSIONS: dict[str | None, Session] = {}
_BLOCKING_LOCK = threading.Lock()


def _session(profile: str | None) -> AioSession:
    """One botocore session per profile: it caches the parsed S3 model (~0.4 s per load)."""
    if profile not in _SESSIONS:
        _SESSIONS[profile] = AioSession(profile=profile) if profile else AioSession()
    return _SESSIONS[profile]


def _blocking_session(profile: str | None) -> Session:
    """One blocking botocore session per profile (as `_session`; creation is not thread-safe)."""
    with _BLOCKING_LOCK:
        if profile not in _BLOCKING_SESSIONS:
            _BLOCKING_SESSIONS[profile] = Session(profile=profile)
        return _BLOCKING_SESSIONS[profile]


@dataclass
class BlockingReads:
    """A blocking botocore client and the threads that run its GETs (at most `max_in_flight`
    at once, which the per-loop gates already bound)."""

    client: Any
    threads: ThreadPoolExecutor


@dataclass
class _LoopClient:
    client: Any
    gate: asyncio.Semaphore
    exit: contextlib.AsyncExitStack


class S3Connection:
    """What every scope of one store shares: options, per-loop clients, breaker, probes."""

    def __init__(self, opts: S3Options, label: str):
        self.opts = opts
        self.label = label
        self.breaker = opts.breaker.breaker()
        self._clients: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
        self.conditional: str | None = None if opts.conditional == "auto" else opts.conditional
        self.touched: OrderedDict[str, float] = OrderedDict()
        # one line naming the URL option to change, once the server refused our requests
        self.refused: str | None = None
        self._blocking: Future[BlockingReads] | None = None
        # chunk reads in flight, one token each (set updates are atomic under the GIL,
        # and reads may run in several event loops)
        self.reading: set[object] = set()
        self._blocking_pid = 0
        self._blocking_lock = threading.Lock()

    async def client(self) -> _LoopClient:
        loop = asyncio.get_running_loop()
        task = self._clients.get(loop)
        if task is None:
            task = self._clients[loop] = loop.create_task(self._create())
        try:
            return await asyncio.shield(task)
        except Exception:
            if self._clients.get(loop) is task and task.done():
                del self._clients[loop]
            raise

    async def _create(self) -> _LoopClient:
        o = self.opts
        session = _session(o.profile)
        stack = contextlib.AsyncExitStack()
        try:
            client = await stack.enter_async_context(session.create_client(
                "s3", region_name=o.region, endpoint_url=o.endpoint,
                aws_access_key_id=o.access_key, aws_secret_access_key=o.secret_key,
                aws_session_token=o.session_token, config=o.client_config(),
            ))
        except (BotoCoreError, ValueError) as exc:
            await stack.aclose()
            raise ConfigError(f"{self.label}: cannot create an S3 client: {exc}") from exc
        return _LoopClient(client, asyncio.Semaphore(self.opts.max_in_flight), stack)

    async def blocking(self) -> BlockingReads:
        """The blocking client and its reader threads, made on first use (from any loop)."""
        with self._blocking_lock:
            made = self._blocking
            if made is not None and self._blocking_pid != os.getpid():
                made = None  # a forked child: its parent's reader threads are not here
            if made is None:
                self._blocking_pid = os.getpid()
                threads = ThreadPoolExecutor(self.opts.max_in_flight,
                                             thread_name_prefix="kvstash-s3-read")
                made = self._blocking = threads.submit(self._create_blocking, threads)
        try:
            return await asyncio.shield(asyncio.wrap_future(made))
        except Exception:
            with self._blocking_lock:
                if self._blocking is made:
                    self._blocking = None
            raise

    def _create_blocking(self, threads: ThreadPoolExecutor) -> BlockingReads:
        o = self.opts
        try:
            client = _blocking_session(o.profile).create_client(
                "s3", region_name=o.region, endpoint_url=o.endpoint,
                aws_access_key_id=o.access_key, aws_secret_access_key=o.secret_key,
                aws_session_token=o.session_token, config=o.blocking_config(),
            )
        except (BotoCoreError, ValueError) as exc:
            threads.shutdown(wait=False)
            raise ConfigError(f"{self.label}: cannot create an S3 client: {exc}") from exc
        return BlockingReads(client, threads)

    async def close(self) -> None:
        """Close the client of the running loop; clients of finished loops are dropped."""
        loop = asyncio.get_running_loop()
        for owner, task in list(self._clients.items()):
            if owner is loop and task.done() and not task.exception():
                await task.result().exit.aclose()
            if owner is loop or owner.is_closed():
                del self._clients[owner]
        with self._blocking_lock:
            made = self._blocking if not self._clients else None
            if made is not None:
                self._blocking = None
        if made is not None and made.done() and not made.exception():
            reads = made.result()
            reads.client.close()
            reads.threads.shutdown(wait=False)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _on_this_host(host: str | None) -> bool:
    """Whether an endpoint's host is this machine (`localhost` or a loopback address): a
    server that shares the client's cores and has no network between them, so parallel
    ranges of one object add requests and CPU and buy no bandwidth (`split_reads` 0)."""
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _in_flight(u: Any, default: int) -> int:
    """`max_in_flight` (the one spelling of in-flight limits), or the former `inflight`."""
    old = u.take("inflight", int, None)
    new = u.take("max_in_flight", int, None)
    if old is not None and new is not None and old != new:
        raise ConfigError(f"{u.redacted()}: inflight={old} contradicts max_in_flight={new}; "
                          "set only max_in_flight")
    return new if new is not None else old if old is not None else default
