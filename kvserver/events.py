"""KV events: every chunk a tenant can see appear or disappear, for cache-aware routers.

A router (llm-d's KV indexer, Dynamo's KV router) routes a request to where its prefix is
cached; vLLM engines publish `BlockStored`/`BlockRemoved` events for that. kvserver
publishes the shared store's own, so a router that never talks to an engine still sees it:

- "stored": a PUT wrote the chunk (not a create-only PUT that found it there);
- "removed": a DELETE, an eviction (capacity, another tenant's room), a corrupt chunk
  quarantined, a chunk found gone.

Every event gets the next sequence number of its tenant in this server process and goes
into the tenant's ring of its last `ring` events: numbers, rings and subscribers are per
tenant, so a tenant learns nothing of how busy others are, and others' events and streams
cost its own nothing. A process numbers on from the microseconds since the epoch at its
start, so numbers grow across restarts: a subscriber that resumes from a number a stopped
process gave is told to resync, never resumed in the middle of another process's events.
Two ways out:

- `GET /v1/events?since=SEQ` (kvserver.app): newline-delimited JSON, tenant-scoped and
  authenticated like `/v1/keys`; the events after SEQ from the ring, then live ones, with
  a heartbeat line every `heartbeat_s`. A subscriber whose SEQ fell out of the ring, or
  came from another process, gets one `{"resync": ...}` line: re-list `/v1/keys`, then go
  on from the sequence number it gives. A server that is stopping ends every stream
  (`end_streams`), so that it can exit; its subscribers reconnect.
- `--events-zmq tcp://HOST:PORT`: a ZMQ PUB socket in vLLM's KV-event wire format
  (multipart `[topic, seq as 8-byte big-endian, msgpack KVEventBatch]`, as vLLM's
  `ZmqEventPublisher` sends, numbered per socket), topic `kvstash/<tenant>`, medium
  "kvstash". vLLM's `block_hashes` carry the chunk key's 16-byte digest (the 32 hex
  characters after the namespace id, as bytes); `token_ids` is empty and `block_size` 0
  (a router keys on the digest, which chains over the whole prefix, as vLLM's block
  hashes do). A PUB socket has no authentication: any subscriber that reaches it receives
  every tenant's events, so with tenants it opens only when the operator says so
  (`open_publisher`, `--events-zmq-all-tenants`).

Neither imports vLLM or torch: the msgspec structs below encode like vLLM's own.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvserver.slots import Slot, Slots
from storage.errors import ConfigError

log = logging.getLogger("kvstash.kvserver.events")

MEDIUM = "kvstash"
STORED, REMOVED = "stored", "removed"


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    ts: float
    tenant: str
    kind: str  # "stored" | "removed"
    key: str

    def line(self) -> bytes:
        return (json.dumps({"seq": self.seq, "ts": round(self.ts, 6), "event": self.kind,
                            "key": self.key}, separators=(",", ":")) + "\n").encode()


Waiter = tuple[asyncio.AbstractEventLoop, asyncio.Event]


def _wake(waiters: list[Waiter]) -> None:
    """Set each subscriber's event on its own loop (from any thread)."""
    for loop, wake in waiters:
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # that subscriber's loop is gone
            pass


class _TenantEvents:
    """One tenant's events: its own sequence numbers, its ring of recent events and its
    live subscribers. Nothing here is shared with another tenant, so what a tenant's event
    costs (numbering, ring, wake-ups) and what its subscribers learn (sequence numbers,
    resyncs) do not depend on other tenants."""

    def __init__(self, ring: int, start: int):
        self.lock = threading.Lock()
        self.ring: collections.deque[Event] = collections.deque(maxlen=ring)
        self.seq = start
        self.waiters: set[Waiter] = set()
        self.wakeups = 0  # subscriber wake-ups this tenant's events caused

    def since(self, seq: int) -> tuple[list[Event], int | None]:
        with self.lock:
            first = self.ring[0].seq if self.ring else self.seq + 1
            if (seq + 1 < first and seq < self.seq) or seq > self.seq:
                return [], self.seq
            # From the newest back to `seq`: a subscriber that keeps up reads only the events
            # it has not seen, not the whole ring (every subscriber asks after every event).
            new = []
            for e in reversed(self.ring):
                if e.seq <= seq:
                    break
                new.append(e)
        new.reverse()
        return new, None


class EventLog:
    """Every tenant's events and live subscribers; `emit` from any thread.

    Each tenant has its own sequence, ring of the last `ring` events and set of
    subscribers: an event wakes only the subscribers of its own tenant. A tenant holds at
    most `max_streams` open streams, and the process at most `max_streams_total`
    (`slots`)."""

    def __init__(self, ring: int = 65536, heartbeat_s: float = 10.0, max_streams: int = 64,
                 max_streams_total: int = 1024):
        self._ring = ring
        self.slots = Slots(max_streams, max_streams_total, "event streams open",
                           "--events-max-streams", "--events-max-streams-total")
        self._tenants: dict[str, _TenantEvents] = {}
        self._lock = threading.Lock()  # the tenants, `_ended`
        self._start = time.time_ns() // 1000  # above any number an earlier process gave
        self._ended = False
        self.heartbeat_s = heartbeat_s
        self.publisher: ZmqPublisher | None = None

    def _of(self, tenant: str) -> _TenantEvents:
        events = self._tenants.get(tenant)
        if events is None:
            with self._lock:
                events = self._tenants.setdefault(tenant, _TenantEvents(self._ring, self._start))
        return events

    def last_seq(self, tenant: str) -> int:
        """The sequence number of the tenant's last event (none yet: where this process
        starts)."""
        return self._of(tenant).seq

    @property
    def streams(self) -> int:
        """Open streams, all tenants."""
        return self.slots.open

    def streams_by_tenant(self) -> dict[str, int]:
        """Open streams by tenant ("" without tokens)."""
        return self.slots.held()

    @property
    def wakeups(self) -> int:
        """Subscriber wake-ups for events so far, all tenants (one per subscriber of the
        event's tenant, per event)."""
        return sum(t.wakeups for t in list(self._tenants.values()))

    def emit(self, tenant: str, kind: str, key: str) -> None:
        events = self._of(tenant)
        with events.lock:
            events.seq += 1
            event = Event(events.seq, time.time(), tenant, kind, key)
            events.ring.append(event)
            waiters = list(events.waiters)
            events.wakeups += len(waiters)
        _wake(waiters)
        if self.publisher is not None:
            self.publisher.publish(event)

    def watch(self, tenant: str, store: Any) -> None:
        """Report `store`'s changes as `tenant`'s events."""
        self._of(tenant)
        store.watch(lambda kind, key: self.emit(tenant, kind, key))

    def since(self, tenant: str, seq: int) -> tuple[list[Event], int | None]:
        """(tenant's events after `seq` still in its ring, None) or ([], the sequence
        number to resync from) when events after `seq` have left the ring, or `seq` is
        past the tenant's last (a number an earlier process, or another worker, gave)."""
        return self._of(tenant).since(seq)

    def open_stream(self, tenant: str, since: int | None) -> AsyncIterator[bytes]:
        """`stream` for `tenant`; SlotsFull when it holds `max_streams` open already, or
        the process `max_streams_total` (each stream costs the server a wake-up and a write
        per event of its tenant, a heartbeat when idle, and a connection). The slot is held
        until the stream ends, or, for one never started, until it is collected."""
        return self.stream(tenant, since, self.slots.take(tenant))

    async def stream(self, tenant: str, since: int | None,
                     slot: Slot | None = None) -> AsyncIterator[bytes]:
        """NDJSON lines: the tenant's events after `since` (default: from now on), a
        `{"resync": SEQ}` line if they are gone, a `{"heartbeat": SEQ}` line when idle;
        `slot` (from `open_stream`) is given back when it ends."""
        events = self._of(tenant)
        me = (asyncio.get_running_loop(), asyncio.Event())
        wake = me[1]
        with events.lock:
            events.waiters.add(me)
            seq = events.seq if since is None else since
        try:
            yield (json.dumps({"since": seq, "medium": MEDIUM}) + "\n").encode()
            while True:
                wake.clear()
                new, resync = events.since(seq)
                if resync is not None:
                    yield (json.dumps({"resync": resync}) + "\n").encode()
                    seq = resync
                    continue
                if new:
                    seq = new[-1].seq
                    yield b"".join(e.line() for e in new)
                    continue
                if self._ended:
                    return
                try:
                    await asyncio.wait_for(wake.wait(), self.heartbeat_s)
                except TimeoutError:
                    yield (json.dumps({"heartbeat": seq}) + "\n").encode()
        finally:
            with events.lock:
                events.waiters.discard(me)
            if slot is not None:
                slot.release()

    def end_streams(self) -> None:
        """End every `stream` after the events it has yet to send (a stopping server waits
        for its open responses, and a stream has no end of its own)."""
        with self._lock:
            self._ended = True
            tenants = list(self._tenants.values())
        for events in tenants:
            with events.lock:
                waiters = list(events.waiters)
            _wake(waiters)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


# -- vLLM's KV-event wire format --------------------------------------------------------------


def open_publisher(endpoint: str, tenants: list[str], all_tenants: bool) -> ZmqPublisher:
    """The `--events-zmq` socket; a ConfigError naming the flag when the server has tenants
    and `all_tenants` (`--events-zmq-all-tenants`) does not accept that every subscriber
    gets every tenant's events, or when the endpoint cannot be bound."""
    if tenants and not all_tenants:
        raise ConfigError(
            f"--events-zmq publishes every tenant's chunk digests ({len(tenants)} tenants from "
            "--auth-tokens) to any subscriber, unauthenticated: add --events-zmq-all-tenants "
            "to accept that, or use the tenant-scoped GET /v1/events")
    try:
        return ZmqPublisher(endpoint)
    except Exception as exc:  # noqa: BLE001 - a bad endpoint: one line at start-up
        raise ConfigError(f"--events-zmq {endpoint}: {exc}") from exc


def _structs() -> tuple[type, type, type]:
    """msgspec structs that encode like vLLM's `KVEventBatch`, `BlockStored`, `BlockRemoved`
    (vllm/distributed/kv_events.py): the batch as an array, events as tagged maps."""
    import msgspec

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes]
        parent_block_hash: bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes]
        medium: str | None

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved]
        data_parallel_rank: int | None = None

    return KVEventBatch, BlockStored, BlockRemoved


def key_digest(key: str) -> bytes:
    """The 16-byte digest of a chunk key ("<ns_id>/<32 hex>"): its vLLM `block_hashes` entry."""
    return bytes.fromhex(key.partition("/")[2])


class ZmqPublisher:
    """A ZMQ PUB socket sending each event as a one-event vLLM `KVEventBatch`, from one
    sender thread (ZMQ sockets are not thread-safe; `publish` only queues)."""

    def __init__(self, endpoint: str, hwm: int = 100_000):
        import msgspec
        import zmq

        self._batch, self._stored, self._removed = _structs()
        self._encode = msgspec.msgpack.Encoder().encode
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._sock.bind(endpoint)
        else:
            host_port = endpoint.removeprefix("tcp://")
            self._sock.bind(f"tcp://{host_port}")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = time.time_ns() // 1000  # as EventLog: numbers grow across restarts
        self._queue: collections.deque[Event | None] = collections.deque(maxlen=hwm)
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._send_loop, name="kvstash-events-zmq",
                                        daemon=True)
        self._thread.start()

    def publish(self, event: Event) -> None:
        with self._ready:
            self._queue.append(event)
            self._ready.notify()

    def encode(self, event: Event, seq: int) -> list[bytes]:
        """The multipart message for `event` as this socket's message `seq`: [topic, seq,
        msgpack KVEventBatch]."""
        digest = [key_digest(event.key)]
        if event.kind == STORED:
            body = self._stored(block_hashes=digest, parent_block_hash=None, token_ids=[],
                                block_size=0, lora_id=None, medium=MEDIUM, lora_name=None)
        else:
            body = self._removed(block_hashes=digest, medium=MEDIUM)
        payload = self._encode(self._batch(ts=event.ts, events=[body]))
        return [f"kvstash/{event.tenant}".encode(), seq.to_bytes(8, "big"), payload]

    def _send_loop(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                event = self._queue.popleft()
            if event is None:
                return
            self._seq += 1
            try:
                self._sock.send_multipart(self.encode(event, self._seq))
            except Exception as exc:  # noqa: BLE001 - events are best effort, the store is not
                log.warning("KV event not published on %s: %s", self.endpoint, exc)

    def close(self) -> None:
        with self._ready:
            self._queue.append(None)
            self._ready.notify()
        self._thread.join(5)
        self._sock.close(0)
