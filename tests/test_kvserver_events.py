"""kvserver's KV events: a subscriber that never talks to an engine rebuilds the store's index.

Real `kvstash serve` processes on 127.0.0.1 (uvicorn), real HTTP streams and a real ZMQ
subscriber; the events are checked against `/v1/keys` and against vLLM's own decoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from storage import open_store
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks

TOKEN_A, TOKEN_B = "a" * 24 + "-events", "b" * 24 + "-events"


class Subscriber:
    """`GET /v1/events` read on a thread: the index it rebuilds from events alone."""

    def __init__(self, url: str, token: str | None = None, since: int | None = None):
        self.index: set[str] = set()
        self.lines: list[dict] = []
        self.seq = 0
        self.started = threading.Event()
        self._stop = False
        headers = {"authorization": f"Bearer {token}"} if token else {}
        params = {} if since is None else {"since": since}
        self._thread = threading.Thread(target=self._run, args=(url, headers, params), daemon=True)
        self._thread.start()
        assert self.started.wait(10), "the event stream did not start"

    def _run(self, url, headers, params) -> None:
        try:
            self._follow(url, headers, params)
        except httpx.HTTPError:  # the server stopped at the end of the test
            pass

    def _follow(self, url, headers, params) -> None:
        with httpx.stream("GET", f"{url}/v1/events", headers=headers, params=params,
                          timeout=httpx.Timeout(10, read=None)) as resp:
            self.status = resp.status_code
            for line in resp.iter_lines():
                msg = json.loads(line)
                self.lines.append(msg)
                if "since" in msg:
                    self.started.set()
                elif "event" in msg:
                    self.seq = msg["seq"]
                    (self.index.add if msg["event"] == "stored" else self.index.discard)(msg["key"])
                if self._stop:
                    return

    def wait_for(self, seq: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while self.seq < seq:
            assert time.monotonic() < deadline, f"events up to {seq} not seen (at {self.seq})"
            time.sleep(0.02)


def wait_until(cond, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.02)


def keys_of(url: str, token: str | None = None) -> set[str]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return set(httpx.get(f"{url}/v1/keys", headers=headers, timeout=10).text.split())


def last_seq(url: str, token: str | None = None) -> int:
    """The server's current sequence number (the first line of a stream from now on)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.stream("GET", f"{url}/v1/events", headers=headers, timeout=10) as resp:
        for line in resp.iter_lines():
            return json.loads(line)["since"]
    raise AssertionError("empty event stream")


def client(url: str, token: str | None = None):
    return open_store(url + (f"?token={token}" if token else ""))


async def put_all(store, chunks) -> None:
    for key, _, blob in chunks:
        assert await store.put(key, blob)


def test_a_subscriber_rebuilds_the_index_through_puts_deletes_evictions_and_corruption(tmp_path, ns):
    root = tmp_path / "store"
    chunks = make_chunks(ns, 12, payload_size=100_000)
    with running_kvserver("--store", f"file://{root}?capacity=700KB") as server:
        sub = Subscriber(server.url)

        async def work() -> None:
            store = client(server.url)
            await put_all(store, chunks[:4])
            assert await store.put(*chunks[0][::2]) is False  # already there: no event
            assert await store.delete(chunks[1][0])
            await put_all(store, chunks[4:])  # 12 x 100 KB into 700 KB: evictions
            await store.close()

        asyncio.run(work())
        # a chunk damaged on disk is quarantined by the next read of it
        victim = next(iter(keys_of(server.url)))
        path = next(p for p in root.rglob("*.kv") if p.name.startswith(victim.split("/")[1]))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        os.utime(path, (time.time() + 5, time.time() + 5))  # a changed file: read again

        async def read_victim() -> None:
            store = client(server.url)
            assert await store.get(victim) is None
            await store.close()

        asyncio.run(read_victim())
        sub.wait_for(last_seq(server.url))
        truth = keys_of(server.url)
    assert victim not in truth and chunks[1][0] not in truth
    assert len(truth) < 11  # capacity evicted some
    assert sub.index == truth
    kinds = [m["event"] for m in sub.lines if "event" in m]
    assert kinds.count("stored") == 12  # 12 chunks; the create-only repeat put wrote nothing
    assert [m["seq"] for m in sub.lines if "event" in m] == sorted(
        m["seq"] for m in sub.lines if "event" in m)


def test_a_subscriber_resumes_with_since_and_a_lost_one_is_told_to_resync(tmp_path, ns):
    chunks = make_chunks(ns, 6, payload_size=1000)
    with running_kvserver("--store", f"file://{tmp_path}/s", "--events-ring", "3") as server:
        store_url = server.url
        asyncio.run(_put_then_close(store_url, chunks[:2]))
        seq = last_seq(store_url)
        sub = Subscriber(store_url, since=seq - 2)  # resumes: both puts are still in the ring
        sub.wait_for(seq)
        assert sub.index == {k for k, _, _ in chunks[:2]}
        asyncio.run(_put_then_close(store_url, chunks[2:]))  # 4 more: the ring holds 3
        late = Subscriber(store_url, since=seq)
        deadline = time.monotonic() + 10
        while not any("resync" in m for m in late.lines):
            assert time.monotonic() < deadline, late.lines
            time.sleep(0.02)
        resync = next(m["resync"] for m in late.lines if "resync" in m)
        assert resync == seq + 4  # re-list /v1/keys, then follow from here
        assert keys_of(store_url) == {k for k, _, _ in chunks}


def test_a_subscriber_resuming_from_a_stopped_servers_number_is_told_to_resync(tmp_path, ns):
    chunks = make_chunks(ns, 3, payload_size=1000)
    store_url = f"file://{tmp_path}/s"
    with running_kvserver("--store", store_url) as first:
        asyncio.run(_put_then_close(first.url, chunks[:2]))
        seq = last_seq(first.url)
    with running_kvserver("--store", store_url) as second:
        # Another process numbers its events on from where the first one's could reach:
        # the first one's number is never taken for one of its own.
        asyncio.run(_put_then_close(second.url, chunks[2:]))
        late = Subscriber(second.url, since=seq)
        wait_until(lambda: any("resync" in m for m in late.lines))
        resync = next(m["resync"] for m in late.lines if "resync" in m)
        assert resync == last_seq(second.url) > seq
        assert keys_of(second.url) == {k for k, _, _ in chunks}  # what the resync re-lists
    assert not late.index  # it was given no event of the second process's as one after seq


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stopping_server_ends_its_event_streams_and_exits(tmp_path, ns, workers):
    chunks = make_chunks(ns, 2, payload_size=1000)
    with running_kvserver("--store", f"file://{tmp_path}/s", "--workers", str(workers)) as server:
        sub = Subscriber(server.url)
        asyncio.run(_put_then_close(server.url, chunks))
        if workers == 1:
            sub.wait_for(last_seq(server.url))
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=10)  # before: it waited for the stream, killed after 10 s
        sub._thread.join(timeout=10)
        assert not sub._thread.is_alive()  # the stream ended
    if workers == 1:
        assert sub.index == {k for k, _, _ in chunks}


async def _put_then_close(url, chunks) -> None:
    store = client(url)
    await put_all(store, chunks)
    await store.close()


def test_a_tenant_sees_only_its_own_events(tmp_path, ns):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKEN_A}\nbob {TOKEN_B}\n")
    tokens.chmod(0o600)
    a, b = make_chunks(ns, 3, seed=1), make_chunks(ns, 3, seed=2)
    with running_kvserver("--store", f"file://{tmp_path}/s", "--auth-tokens", str(tokens)) as server:
        sub_a = Subscriber(server.url, TOKEN_A)
        sub_b = Subscriber(server.url, TOKEN_B)
        asyncio.run(_put_then_close(server.url + f"?token={TOKEN_A}", a))
        asyncio.run(_put_then_close(server.url + f"?token={TOKEN_B}", b[:1]))
        # each sees its own puts; then a put of A's after B's: B's stream stays silent
        wait_until(lambda: len(sub_a.index) == 3 and len(sub_b.index) == 1)
        asyncio.run(_put_then_close(server.url + f"?token={TOKEN_A}", make_chunks(ns, 1, seed=3)))
        wait_until(lambda: len(sub_a.index) == 4)
        unauthenticated = httpx.get(f"{server.url}/v1/events", timeout=5)
    assert {k for k, _, _ in a} < sub_a.index and sub_b.index == {b[0][0]}
    assert all(m.get("key") != b[0][0] for m in sub_a.lines)
    assert unauthenticated.status_code == 401


def test_the_zmq_publisher_speaks_vllms_kv_event_format(tmp_path, ns):
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    from tests.test_http_store_client import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    chunks = make_chunks(ns, 3, payload_size=1000)
    with running_kvserver("--store", f"file://{tmp_path}/s", "--events-zmq", endpoint) as server:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"kvstash/")
        sock.connect(endpoint)
        try:
            _wait_until_subscribed(sock, zmq, msgspec, server.url, ns)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            asyncio.run(_put_then_close(server.url, chunks))

            async def delete_one() -> None:
                store = client(server.url)
                assert await store.delete(chunks[0][0])
                await store.close()

            asyncio.run(delete_one())
            frames = [sock.recv_multipart() for _ in range(4)]
        finally:
            sock.close(0)
    decoded = [_decode(f[2], msgspec) for f in frames]
    index: set[bytes] = set()
    for batch in decoded:
        for ev in batch["events"]:
            assert ev["medium"] == "kvstash"
            (index.update if ev["type"] == "BlockStored" else index.difference_update)(
                ev["block_hashes"])
    assert index == {bytes.fromhex(k.split("/")[1]) for k, _, _ in chunks[1:]}
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == list(range(seqs[0], seqs[0] + 4))
    assert {f[0] for f in frames} == {b"kvstash/"}
    with contextlib.suppress(ImportError):  # vLLM's own decoder, where vLLM is installed
        from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

        batches = [msgspec.msgpack.Decoder(type=KVEventBatch).decode(f[2]) for f in frames]
        assert [type(b.events[0]) for b in batches] == [BlockStored] * 3 + [BlockRemoved]
        assert batches[3].events[0].block_hashes == [bytes.fromhex(chunks[0][0].split("/")[1])]


def _wait_until_subscribed(sock, zmq, msgspec, url: str, ns) -> None:
    """Put warm-up chunks, one at a time, until `sock` receives one's event, and every
    event published before it: a SUB socket misses what is published before its
    subscription reaches the publisher, however long that takes on a loaded host.
    Bounded: 40 chunks, 0.25 s each."""
    sock.setsockopt(zmq.RCVTIMEO, 250)
    for key, tokens, blob in make_chunks(ns, 40, payload_size=100, seed=99):
        asyncio.run(_put_then_close(url, [(key, tokens, blob)]))
        digest = bytes.fromhex(key.split("/")[1])
        try:
            while True:
                events = _decode(sock.recv_multipart()[2], msgspec)["events"]
                if any(digest in ev["block_hashes"] for ev in events):
                    return
        except zmq.Again:
            continue
    pytest.fail("the subscriber received no event of 40 warm-up puts")


def _decode(payload: bytes, msgspec) -> dict:
    ts, events, *_ = msgspec.msgpack.decode(payload)
    return {"ts": ts, "events": events}


def test_bad_event_settings_fail_at_start_in_one_line(tmp_path):
    for flags, says in ((["--events-ring", "0"], "--events-ring"),
                        (["--events-zmq", "tcp://127.0.0.1:1", "--workers", "2"], "--workers 1")):
        proc = subprocess.run(
            [sys.executable, "-m", "kvserver.cli", "--port", "0",
             "--store", f"file://{tmp_path}/s", *flags], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and says in proc.stderr, proc.stderr


def test_the_ring_answers_each_tenant_the_events_after_its_number_in_order():
    from kvserver.events import EventLog

    log = EventLog(ring=4)
    start = log.last_seq("a")
    for i in range(12):  # 6 events each into rings of 4: each tenant's first 2 are gone
        log.emit("ab"[i % 2], "stored", f"k{i}")
    assert log.last_seq("a") == log.last_seq("b") == start + 6  # numbered per tenant
    assert [e.key for e in log.since("a", start + 2)[0]] == ["k4", "k6", "k8", "k10"]
    assert [e.key for e in log.since("b", start + 4)[0]] == ["k9", "k11"]
    assert log.since("a", start + 6) == ([], None)  # up to date
    assert log.since("a", start + 1) == ([], start + 6)  # its event 2 (k2) left the ring
    assert log.since("a", start + 7) == ([], start + 6)  # a number this process never gave


def test_bench_events_delivers_every_event_to_every_subscriber(tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvstash.cli", "bench", "events", "--fill", "50", "--puts", "30",
         "--subscribers", "3", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "vs no subscriber" in done.stdout
    result = json.loads(out.read_text())
    assert result["every_event_delivered"] is True
    assert result["puts_per_s_no_subscribers"] > 0 and result["puts_per_s_with_subscribers"] > 0


def test_past_its_event_stream_limit_a_tenant_gets_429_until_a_stream_closes(tmp_path):
    """Every subscriber costs the server a wake-up and a write per event, so a tenant holds
    at most `--events-max-streams` streams; a closed one gives its slot back."""

    held = []  # each stream's line iterator: one dropped unfinished closes its stream

    def opened(client):
        resp = stack.enter_context(client.stream("GET", f"{server.url}/v1/events"))
        if resp.status_code == 200:
            held.append(resp.iter_lines())
            assert "since" in json.loads(next(held[-1]))
        else:
            resp.read()
        return resp

    with contextlib.ExitStack() as stack, running_kvserver(
            "--store", f"file://{tmp_path}/s", "--events-max-streams", "2") as server:
        client = stack.enter_context(httpx.Client(timeout=10))
        first, second = opened(client), opened(client)
        refused = opened(client)
        assert (first.status_code, second.status_code, refused.status_code) == (200, 200, 429)
        assert "--events-max-streams" in refused.json()["error"]
        first.close()
        wait_until(lambda: opened(client).status_code == 200)


def test_a_stream_closed_early_gives_back_its_slot_and_its_subscription():
    from kvserver.events import EventLog
    from kvserver.slots import SlotsFull

    async def main() -> None:
        log = EventLog(max_streams=1)
        lines = log.open_stream("", None)
        with pytest.raises(SlotsFull):  # the one slot is taken
            log.open_stream("", None)
        assert "since" in json.loads(await anext(lines))
        await lines.aclose()  # as the server does when its client goes away
        assert not log._of("").waiters and log.streams == 0
        never_started = log.open_stream("", None)
        del never_started  # collected unstarted: the slot comes back too
        assert log.open_stream("", None) is not None

    asyncio.run(main())


def two_tenants(tmp_path) -> str:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKEN_A}\nbob {TOKEN_B}\n")
    tokens.chmod(0o600)
    return str(tokens)


def test_a_tenants_event_numbers_do_not_move_with_other_tenants_events(tmp_path, ns):
    """Sequence numbers are per tenant: a tenant cannot count another's writes from them,
    and resuming replays only its own events."""
    with running_kvserver("--store", f"file://{tmp_path}/s", "--auth-tokens",
                          two_tenants(tmp_path)) as server:
        alice_from, bob_from = last_seq(server.url, TOKEN_A), last_seq(server.url, TOKEN_B)
        sub_a = Subscriber(server.url, TOKEN_A)
        asyncio.run(_put_then_close(server.url + f"?token={TOKEN_A}", make_chunks(ns, 5, seed=1)))
        sub_a.wait_for(alice_from + 5)
        assert last_seq(server.url, TOKEN_B) == bob_from  # alice's 5 puts left bob's number
        bob_chunk = make_chunks(ns, 1, seed=2)
        asyncio.run(_put_then_close(server.url + f"?token={TOKEN_B}", bob_chunk))
        late_b = Subscriber(server.url, TOKEN_B, since=bob_from)
        late_b.wait_for(bob_from + 1)
    assert [m["seq"] for m in sub_a.lines if "event" in m] == list(range(alice_from + 1, alice_from + 6))
    assert [m["seq"] for m in late_b.lines if "event" in m] == [bob_from + 1]
    assert late_b.index == {bob_chunk[0][0]}
    assert not any("resync" in m for m in late_b.lines)


def test_events_zmq_with_tenants_starts_only_when_told_it_publishes_every_tenant(tmp_path, ns):
    """A ZMQ PUB socket has no authentication: with --auth-tokens, --events-zmq alone stops
    the server at start in one line naming --events-zmq-all-tenants."""
    zmq = pytest.importorskip("zmq")
    from tests.test_http_store_client import free_port

    tokens = two_tenants(tmp_path)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    refused = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "--port", "0", "--store", f"file://{tmp_path}/s",
         "--auth-tokens", tokens, "--events-zmq", endpoint],
        capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stdout == ""
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--events-zmq-all-tenants" in refused.stderr
    with running_kvserver("--store", f"file://{tmp_path}/s", "--auth-tokens", tokens,
                          "--events-zmq", endpoint, "--events-zmq-all-tenants") as server:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"kvstash/")
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(endpoint)
        try:
            time.sleep(0.5)  # a SUB socket misses what was sent before it joined
            asyncio.run(_put_then_close(server.url + f"?token={TOKEN_A}", make_chunks(ns, 1)))
            topic = sock.recv_multipart()[0]
        finally:
            sock.close(0)
        assert "--events-zmq" not in server.log()  # on loopback: no warning
    assert topic == b"kvstash/alice"


def test_events_zmq_beyond_loopback_is_warned_about_at_start(tmp_path):
    """As for --host: a publisher anyone on the network can subscribe to is said so at start
    (bound to every interface on a free port; nothing connects to it)."""
    pytest.importorskip("zmq")
    with running_kvserver("--store", f"file://{tmp_path}/s", "--events-zmq", "tcp://*:*") as server:
        log = server.log()
    assert "warning: --events-zmq tcp://*:* is reachable beyond this host" in log


def events_metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_an_event_wakes_only_the_streams_of_its_own_tenant(tmp_path, ns):
    """Other tenants' idle streams cost a tenant's writes nothing: each event wakes the
    streams of its own tenant and no other (counted, not timed)."""
    tokens = tmp_path / "tokens"
    names = {t: t * 20 + "-events" for t in "abcd"}
    tokens.write_text("".join(f"tenant-{t} {tok}\n" for t, tok in names.items()))
    tokens.chmod(0o600)
    with running_kvserver("--store", f"file://{tmp_path}/s", "--auth-tokens", str(tokens)) as server:
        idle = [Subscriber(server.url, names[t]) for t in "abc" for _ in range(4)]
        wait_until(lambda: events_metric(server.url, "kvstash_event_streams") == 12)
        d_url = server.url + f"?token={names['d']}"
        asyncio.run(_put_then_close(d_url, make_chunks(ns, 20, payload_size=1000, seed=1)))
        assert events_metric(server.url, "kvstash_event_wakeups_total") == 0
        d_sub = Subscriber(server.url, names["d"])
        d_from = d_sub.lines[0]["since"]
        asyncio.run(_put_then_close(d_url, make_chunks(ns, 10, payload_size=1000, seed=2)))
        d_sub.wait_for(d_from + 10)
        assert events_metric(server.url, "kvstash_event_wakeups_total") == 10
    assert all("event" not in m for sub in idle for m in sub.lines)
