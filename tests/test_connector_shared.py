"""What the core offers every engine adapter besides loads: staging pools, in-flight
de-duplication of loads and saves, the exit flush, and the policy fed from counters."""

from __future__ import annotations

import asyncio
import math
import signal
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from connector import ChunkLayout, KVConnector, LoadPolicy
from connector.buffers import BufferPool
from connector.exit_flush import ExitFlush
from connector.inflight import InFlightLoads
from hashing import Namespace
from storage.memory import MemoryStore

LAYOUT = ChunkLayout(layers=2, kv_heads=2, head_dim=8, chunk_tokens=16, dtype="float32")


def connector(**kwargs) -> KVConnector:
    ns = Namespace(model="m", dtype=LAYOUT.dtype, layout=LAYOUT.name, chunk_tokens=16)
    return KVConnector("memory://", ns, layout=LAYOUT, **kwargs)


def test_a_buffer_pool_keeps_what_it_is_given_up_to_its_bound_and_only_what_fits():
    made = []
    bound = [2]
    pool = BufferPool(lambda: made.append(bytearray(8)) or made[-1], lambda: bound[0],
                      fits=lambda buf: len(buf) == 8)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert len(made) == 3
    for buf in (a, b, c, bytearray(4)):
        pool.give(buf)
    assert len(pool) == 2 and all(len(buf) == 8 for buf in pool)
    assert pool.take() in (a, b) and len(made) == 3  # reused, not made
    bound[0] = 3  # the bound may grow (the most one step used)
    pool.give(c)
    assert len(pool) == 2


def test_a_chunk_being_loaded_is_waited_for_by_other_requests_not_by_its_own():
    loads = InFlightLoads(max_wait_s=60.0)
    loads.claim("first", [b"h1", b"h2"])
    assert loads.loaded_by_another(b"h2", "second")
    assert not loads.loaded_by_another(b"h2", "first")
    assert not loads.loaded_by_another(b"h3", "second")
    loads.release("second", [b"h1"])  # not its claim: stays
    assert loads.loaded_by_another(b"h1", "second")
    loads.release("first", [b"h1", b"h2"])
    assert not loads and not loads.loaded_by_another(b"h1", "second")
    stale = InFlightLoads(max_wait_s=0.0)  # never waited for past its bound
    stale.claim("first", [b"h1"])
    assert not stale.loaded_by_another(b"h1", "second")


def test_a_chunk_being_written_is_known_until_its_write_ends():
    core = connector()
    try:
        keys = core.keys(np.arange(32))[0]
        done = core.write(keys, None, lambda i: np.zeros(LAYOUT.payload_nbytes, np.uint8))
        assert core.writing(keys[0]) in (done, None)  # None once it has already ended
        assert done.result(10) == [True, True]
        assert core.writing(keys[0]) is None and core.writing(keys[1]) is None
    finally:
        core.close()


def test_the_policy_learns_from_another_process_counters_without_counting_them_again():
    core = connector()
    try:
        core.learn_from({"prefill_tokens": 4096, "prefill_seconds": 2.0,
                         "loads": 1, "hit_bytes": 10**9, "load_seconds": 0.5})
        stats = core.stats()
        assert stats["prefill_tokens"] == 0 and stats["hit_bytes"] == 0
        assert stats["store_gbps_estimate"] == pytest.approx(2.0)
        assert core.lookup_patience_s(2048, floor_s=0.0) == pytest.approx(1.0)
        assert core.lookup_patience_s(16, floor_s=0.25) == 0.25
    finally:
        core.close()


def test_a_policy_that_loads_every_hit_waits_for_every_lookup():
    # A far store's lookup is not given up at the recompute estimate when nothing is
    # weighed against recompute: the hit is what such an engine was configured for.
    core = connector(policy=LoadPolicy(adaptive=False))
    try:
        core.learn_from({"prefill_tokens": 4096, "prefill_seconds": 2.0})
        assert core.lookup_patience_s(2048) == math.inf
    finally:
        core.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers are set from the main thread only")
def test_a_stop_signal_writes_queued_saves_then_runs_the_handler_that_was_there():
    core = connector(save_delay_s=0.5)  # queued saves wait a little before they are written
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(
        (signum, core.save_pending_bytes)))
    flush = ExitFlush(core, timeout_s=10.0)
    try:
        flush.install()
        keys, _ = core.keys(np.arange(32))
        core.write(keys, None, lambda i: np.ones(LAYOUT.payload_nbytes, np.uint8))
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # what the signal runs
        assert seen == [(signal.SIGTERM, 0)]  # flushed first, then the old handler
        assert core.exists(keys) == [True, True]
        flush.remove()
        assert signal.getsignal(signal.SIGTERM) is not previous  # the test's handler is back
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert len(seen) == 2
    finally:
        flush.remove()
        signal.signal(signal.SIGTERM, previous)
        core.close()


def test_a_lookup_whose_hit_could_not_win_is_not_waited_for_at_all():
    core = connector(policy=LoadPolicy(probe_every=0))
    try:
        core.learn_from({"prefill_tokens": 4096, "prefill_seconds": 0.4,
                         "loads": 1, "hit_bytes": 1 << 20, "load_seconds": 2.0})
        core.learn_from({"loads": 1, "hit_bytes": 1 << 20, "load_seconds": 2.0})  # twice
        core.policy.plan(1, 16, LAYOUT.payload_nbytes)  # the chunks' size
        assert core.lookup_patience_s(2048, floor_s=0.005) == 0.0
    finally:
        core.close()


def test_a_lookups_patience_counts_the_bytes_loads_delivered_before_any_plan_knew_them():
    # vLLM's scheduler plans before its workers report a chunk's size (a placeholder of one
    # byte): the patience of later lookups takes the size from the workers' loads.
    core = connector(policy=LoadPolicy(probe_every=0))
    try:
        core.learn_from({"prefill_tokens": 4096, "prefill_seconds": 0.4})
        core.policy.plan(1, 16, 1)
        for _ in range(2):  # a store is judged from two loads
            core.learn_from({"loads": 1, "hit_bytes": 64 << 20, "hit_tokens": 2048,
                             "load_seconds": 2.0})
        assert core.lookup_patience_s(2048, floor_s=0.005) == 0.0
    finally:
        core.close()


class CountedStore(MemoryStore):
    """A memory store that counts the lookups it is asked and answers them `delay_s` late
    (a far bucket's round trips)."""

    def __init__(self, delay_s: float = 0.0):
        super().__init__()
        self.delay_s = delay_s
        self.asked = 0

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        self.asked += 1
        await asyncio.sleep(self.delay_s)
        return await super().exists(keys)


def counted_connector(store: CountedStore, policy: LoadPolicy) -> KVConnector:
    ns = Namespace(model="m", dtype=LAYOUT.dtype, layout=LAYOUT.name, chunk_tokens=16)
    return KVConnector(store, ns, layout=LAYOUT, policy=policy)


def test_a_load_whose_start_and_end_are_reported_in_different_steps_is_learnt():
    # vLLM's workers report their counters every step; an async load is counted as it
    # starts and its bytes and time when it ends, steps later.
    core = connector(policy=LoadPolicy(probe_every=0))
    try:
        for _ in range(2):  # a store is judged from two loads
            core.learn_from({"loads": 1, "prefill_tokens": 1, "prefill_seconds": 0.02})
            core.learn_from({"hit_bytes": 4 << 20, "hit_tokens": 2048, "loaded_chunks": 8,
                             "load_seconds": 0.3})
        assert core.policy.load_s(4 << 20) == pytest.approx(0.3)
    finally:
        core.close()


def test_a_lookup_whose_hit_could_not_win_is_not_sent_but_for_a_probe():
    store = CountedStore()
    core = counted_connector(store, LoadPolicy(probe_every=2))
    try:
        core.learn_from({"prefill_tokens": 4096, "prefill_seconds": 0.4})
        for _ in range(2):  # a store is judged from two loads
            core.learn_from({"loads": 1, "hit_bytes": 64 << 20, "hit_tokens": 2048,
                             "load_seconds": 2.0})  # slower than recomputing them
        keys = [core.keys(np.arange(2048))[0]]
        skipped = core.start_lookup(keys, 2048, floor_s=0.005)
        assert skipped.answer() == 0 and not skipped.answered
        assert store.asked == 0 and core.counters()["lookups_given_up"] == 1
        probe = core.start_lookup(keys, 2048, floor_s=0.005)  # the 2nd: sent, and timed
        assert probe.future.result(10) == 0 and store.asked == 1
    finally:
        core.close()


def test_a_lookup_given_up_on_still_times_the_store_after_its_request_ends():
    store = CountedStore(delay_s=0.3)
    core = counted_connector(store, LoadPolicy(probe_every=0))
    try:
        core.learn_from({"prefill_tokens": 4096, "prefill_seconds": 0.02})  # recompute: ms
        poll = core.start_lookup([core.keys(np.arange(2048))[0]], 2048, floor_s=0.0)
        deadline = time.monotonic() + 10
        while (answer := poll.answer()) is None and time.monotonic() < deadline:
            poll.wait(0.05)
        assert answer == 0 and core.counters()["lookups_given_up"] == 1
        poll.cancel()  # the request ends
        while not core.policy.lookups_timed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.policy.lookups_timed == 1
    finally:
        core.close()
