"""KVConnector without an engine: lookup, pipelined verified load, write-behind, failures, policy.

The engine here is a list of numpy buffers; placement records the order chunks arrive in.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid

import numpy as np
import pytest

from connector import ChunkLayout, KVConnector, LoadPolicy
from hashing import Namespace, chunk_keys
from storage.memory import MemoryStore
from tests.connector_fixtures import DelayedStore

LAYOUT = ChunkLayout(layers=2, kv_heads=2, head_dim=8, chunk_tokens=16, dtype="float32")
TOKENS = np.arange(1000, 1000 + 10 * 16)  # 10 whole chunks


def namespace(layout: ChunkLayout = LAYOUT) -> Namespace:
    return Namespace(model="test/engine", dtype=layout.dtype, layout=layout.name,
                     chunk_tokens=layout.chunk_tokens, salt=uuid.uuid4().hex)


def payload_of(i: int) -> np.ndarray:
    """Chunk i's KV bytes: recognisable values."""
    return np.full(LAYOUT.payload_nbytes // 4, float(i), dtype=np.float32).view(np.uint8)


class ListEngine:
    """A stand-in KV cache: one buffer per chunk, and the order chunks were placed in."""

    def __init__(self, n: int):
        self.bufs = [np.zeros(LAYOUT.payload_nbytes, dtype=np.uint8) for _ in range(n)]
        self.placed: list[int] = []

    def staging(self, i: int) -> np.ndarray:
        return self.bufs[i]

    def place(self, i: int) -> None:
        self.placed.append(i)


def connector(store=None, **kwargs) -> KVConnector:
    return KVConnector(store or MemoryStore(), namespace(), layout=LAYOUT, **kwargs)


def saved(conn: KVConnector, tokens=TOKENS, start: int = 0) -> KVConnector:
    conn.save(tokens, payload_of, start)
    assert conn.flush(10)
    return conn


def test_lookup_counts_whole_stored_chunks_in_one_call():
    conn = connector()
    assert conn.lookup(TOKENS) == 0
    saved(conn, TOKENS[: 4 * 16])
    assert conn.lookup(TOKENS) == 4 * 16
    assert conn.lookup(TOKENS, max_tokens=2 * 16 + 5) == 2 * 16
    conn.close()


def test_load_places_every_chunk_in_order_with_its_bytes():
    conn = saved(connector())
    engine = ListEngine(10)
    assert conn.load(TOKENS, 10 * 16, engine) == 10 * 16
    assert engine.placed == list(range(10))
    for i, buf in enumerate(engine.bufs):
        assert np.array_equal(buf, payload_of(i))
    stats = conn.stats()
    assert stats["hit_tokens"] == 160 and stats["hit_bytes"] == 10 * LAYOUT.payload_nbytes
    assert stats["load_seconds"] > 0 and stats["load_gbps"] > 0
    conn.close()


def test_save_skips_chunks_the_store_already_has():
    conn = saved(connector(), TOKENS[: 6 * 16])
    saved(conn)
    stats = conn.stats()
    assert stats["saved_chunks"] == 10 and stats["save_skipped"] == 6
    conn.close()


def test_a_full_write_behind_queue_drops_and_counts_instead_of_waiting():
    store = DelayedStore(MemoryStore())
    conn = connector(store, save_queue_bytes=3 * LAYOUT.payload_nbytes)
    blocked = False

    def slow_payload(i: int):
        nonlocal blocked
        while not blocked:
            time.sleep(0.01)
        return payload_of(i)

    started = time.monotonic()
    assert conn.save(TOKENS, slow_payload) == 3  # the leading chunks that fit
    assert conn.save(TOKENS[:16] + 1, slow_payload) == 0  # nothing fits now
    assert time.monotonic() - started < 5  # the engine did not wait for the store
    stats = conn.stats()
    assert stats["save_drops"] == 7 + 1
    assert stats["save_dropped_bytes"] == 8 * LAYOUT.payload_nbytes
    blocked = True
    assert conn.flush(10)
    assert conn.stats()["saved_chunks"] == 3 and conn.stats()["save_pending_bytes"] == 0
    conn.close()


def test_a_save_delay_holds_each_job_back_and_a_flush_still_writes_it():
    store = MemoryStore()
    conn = connector(store, save_delay_s=1.5)
    queued = time.monotonic()
    assert conn.save(TOKENS, payload_of) == 10
    time.sleep(0.3)
    assert conn.lookup(TOKENS) == 0  # not started yet: the step that made it goes first
    assert conn.flush(10)  # a flush (and shutdown) waits the delay out, then writes
    assert time.monotonic() - queued >= 1.5
    assert conn.lookup(TOKENS) == 160 and conn.stats()["saved_chunks"] == 10
    conn.close()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_write_told_not_to_ask_the_store_rewrites_a_stored_chunk_harmlessly(kind, tmp_path):
    store = MemoryStore() if kind == "memory" else f"file://{tmp_path}"
    conn = saved(connector(store))
    asked = []
    exists = conn.store.exists

    async def counted(keys):
        asked.append(list(keys))
        return await exists(keys)

    conn.store.exists = counted
    keys = chunk_keys(TOKENS, conn.ns)
    tokens = [TOKENS[i * 16 : (i + 1) * 16] for i in range(10)]
    done = conn.write(keys, tokens, payload_of, check_store=False)
    assert done.result(10) == [True] * 10 and asked == []
    engine = ListEngine(10)
    assert conn.load(TOKENS, 160, engine) == 160
    assert all(np.array_equal(engine.bufs[i], payload_of(i)) for i in range(10))
    conn.close()


def test_a_missing_chunk_ends_the_hit_before_it():
    store = MemoryStore()
    conn = saved(connector(store))
    conn.run(store.delete(chunk_keys(TOKENS, conn.ns)[4]))
    engine = ListEngine(10)
    assert conn.load(TOKENS, 160, engine) == 4 * 16
    assert engine.placed == [0, 1, 2, 3]
    assert conn.stats()["load_misses"] >= 1
    conn.close()


def test_a_stalled_chunk_ends_the_hit_at_the_deadline():
    store = DelayedStore(MemoryStore())
    conn = saved(connector(store))
    store.slow.add(chunk_keys(TOKENS, conn.ns)[2])
    engine = ListEngine(10)
    started = time.monotonic()
    assert conn.load(TOKENS, 160, engine, deadline_s=0.5) == 2 * 16
    assert time.monotonic() - started < 10
    assert engine.placed == [0, 1]
    assert conn.stats()["load_timeouts"] == 1
    conn.close()


def test_a_backend_exception_is_a_shorter_hit():
    store = DelayedStore(MemoryStore())
    conn = saved(connector(store))
    store.broken.add(chunk_keys(TOKENS, conn.ns)[5])
    assert conn.load(TOKENS, 160, ListEngine(10)) == 5 * 16
    assert conn.stats()["load_errors"] == 1
    conn.close()


def test_a_chunk_of_another_layout_is_rejected():
    store = MemoryStore()
    conn = saved(connector(store))
    other = ChunkLayout(layers=4, kv_heads=1, head_dim=8, chunk_tokens=16, dtype="float32")
    reader = KVConnector(store, conn.ns, layout=LAYOUT)
    reader.layout = other  # a reader that expects a different shape of the same size
    assert reader.load(TOKENS, 160, ListEngine(10)) == 0
    assert reader.stats()["verify_failures"] >= 1  # chunks in flight are each rejected
    reader.close(close_store=False)
    conn.close()


def test_lookup_failures_open_a_breaker_that_bypasses_the_store():
    class Unreachable(MemoryStore):
        async def exists(self, keys):
            raise OSError("connection refused")

    conn = connector(Unreachable(), breaker_cooldown=60.0)
    assert conn.lookup(TOKENS) == 0
    assert conn.lookup(TOKENS) == 0
    stats = conn.stats()
    assert stats["lookup_errors"] == 1 and stats["bypassed"] == 1
    conn.close()


def test_layout_must_match_the_namespace():
    with pytest.raises(ValueError, match="layout"):
        KVConnector(MemoryStore(), Namespace(model="m", dtype="float32", layout="other",
                                             chunk_tokens=16), layout=LAYOUT)


def test_policy_loads_when_the_store_beats_recompute_and_declines_otherwise():
    policy = LoadPolicy(probe_every=3)
    assert policy.plan(4, 16, 1 << 20).chunks == 4  # nothing measured yet: optimistic
    policy.observe_prefill(1000, 1.0)  # 1000 tokens/s: 4 chunks recompute in 64 ms
    policy.observe_load(1 << 30, 1.0)  # 1 GiB/s: 4 MiB load in 4 ms
    policy.observe_load(1 << 30, 1.0)
    assert policy.plan(4, 16, 1 << 20).reason == "load"
    slow = LoadPolicy(probe_every=3)
    slow.observe_prefill(1000, 1.0)
    slow.observe_load(1 << 20, 1.0)  # 1 MiB/s: 4 s to load what recomputes in 64 ms
    slow.observe_load(1 << 20, 1.0)
    reasons = [slow.plan(4, 16, 1 << 20).reason for _ in range(3)]
    assert reasons == ["declined", "declined", "probe"]
    assert not LoadPolicy(adaptive=False).plan(4, 16, 1 << 20).reason == "declined"


def test_policy_deadline_is_bounded_by_the_recompute_it_saves():
    policy = LoadPolicy(wait_factor=0.5, min_wait_s=0.01, max_wait_s=5.0)
    assert policy.deadline_s(1000) == 5.0  # unknown prefill speed: the cap
    policy.observe_prefill(1000, 1.0)
    assert policy.deadline_s(1000) == pytest.approx(0.5)
    assert policy.deadline_s(1) == 0.01


def test_the_connector_declines_a_hit_that_would_load_slower_than_recompute():
    conn = saved(connector(policy=LoadPolicy(probe_every=0)))
    conn.policy.observe_prefill(10**9, 1.0)  # an engine that recomputes 1e9 tokens/s
    conn.policy.observe_load(1, 1.0)
    conn.policy.observe_load(1, 1.0)
    plan = conn.plan(conn.lookup(TOKENS))
    assert plan.chunks == 0 and conn.stats()["declined_tokens"] == 160
    conn.close()


def test_a_connector_dropped_without_close_still_finishes_its_saves():
    store = MemoryStore()
    conn = connector(store)
    keys, thread = chunk_keys(TOKENS, conn.ns), conn.io._thread

    def slow_payload(i: int):
        time.sleep(0.05)
        return payload_of(i)

    assert conn.save(TOKENS, slow_payload) == 10
    del conn
    gc.collect()
    assert not thread.is_alive()
    assert asyncio.run(store.exists(keys)) == [True] * 10


def test_a_closed_connector_misses_and_drops_quietly():
    conn = saved(connector())
    conn.close()
    assert conn.lookup(TOKENS) == 0
    assert conn.load(TOKENS, 160, ListEngine(10)) == 0
    assert conn.save(TOKENS, payload_of) == 0
    assert conn.flush(1)


def chunk_tokens_of(tokens=TOKENS, n: int = 16) -> list[np.ndarray]:
    return [tokens[i : i + n] for i in range(0, len(tokens), n)]


def test_an_async_load_places_chunks_as_they_land_and_fails_a_stalled_one_by_its_deadline():
    """`load_async` (the vLLM worker's path): nothing waits on the caller's thread; every
    chunk is placed on an I/O thread as it lands, and the stalled one fails at the deadline."""
    store = DelayedStore(MemoryStore())
    conn = saved(connector(store))
    keys = chunk_keys(TOKENS, conn.ns)
    store.slow.add(keys[2])
    engine = ListEngine(10)
    handle = conn.load_async(keys[:4], chunk_tokens_of()[:4], engine, deadline_s=0.5)
    ok = handle.result(10)
    assert handle.done() and handle.stalled
    assert ok[:2] == [True, True] and ok[2] is False
    assert sorted(engine.placed) == [i for i, good in enumerate(ok) if good]
    for i in engine.placed:
        assert (engine.bufs[i] == payload_of(i)).all()
    stats = conn.stats()
    assert stats["load_timeouts"] == 1 and stats["loaded_chunks"] == sum(ok)
    assert stats["failed_chunks"] == 4 - sum(ok)
    conn.close()


def test_an_async_load_of_a_bypassed_store_fails_every_chunk_at_once():
    class Unreachable(MemoryStore):
        async def prefix_len(self, keys):
            raise ConnectionError("no route to store")

    conn = saved(connector(Unreachable(), breaker_cooldown=60))
    keys = chunk_keys(TOKENS, conn.ns)
    assert conn.lookup_async(keys).result(5) == 0  # fails, and opens the breaker
    handle = conn.load_async(keys[:3], chunk_tokens_of()[:3], ListEngine(3))
    assert handle.done() and handle.result() == [False] * 3
    assert conn.lookup_async(keys).result(5) == 0
    stats = conn.stats()
    assert stats["lookup_errors"] == 1 and stats["bypassed"] == 2
    conn.close()


def test_write_answers_per_chunk_whether_the_store_holds_it():
    conn = connector()
    keys = chunk_keys(TOKENS, conn.ns)
    assert conn.write(keys[:3], chunk_tokens_of()[:3], payload_of).result(10) == [True] * 3
    # already there: still True (the store holds it), and counted as skipped
    assert conn.write(keys[:2], chunk_tokens_of()[:2], payload_of).result(10) == [True] * 2
    assert conn.stats()["saved_chunks"] == 3 and conn.stats()["save_skipped"] == 2
    small = connector(save_queue_bytes=LAYOUT.payload_nbytes)  # room for one chunk
    assert small.write(keys[:3], chunk_tokens_of()[:3], payload_of).result(10) == [True, False, False]
    conn.close()
    small.close()


@pytest.mark.parametrize("outcome", ["placed", "failed"])
def test_a_layer_wait_that_returns_finds_every_chunks_answer_set(monkeypatch, outcome):
    """Whoever wakes from `wait_segment` of the last layer reads each chunk's answer at once
    (the vLLM worker reports failed blocks right then), so a chunk's answer is set before
    its last segment is: made visible here by slowing down the answer."""
    import threading

    import connector.core as core

    real = core._resolve

    def slow_resolve(f, ok):
        time.sleep(0.05)
        real(f, ok)

    monkeypatch.setattr(core, "_resolve", slow_resolve)
    handle = core.SegmentLoad(1, 2, time.monotonic())
    handle.placed(0, 0)
    finish = (lambda: handle.placed(0, 1)) if outcome == "placed" else (lambda: handle.fail(0))
    worker = threading.Thread(target=finish)
    worker.start()
    assert handle.wait_segment(1, timeout=5)
    assert handle.chunks[0].done() and handle.chunks[0].result() is (outcome == "placed")
    worker.join()
