"""gds.requests.Request: a request is run exactly once, by a request thread or by the
thread blocked on its result, always within the max_in_flight bound."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor, TimeoutError

import pytest

from gds.requests import Request


def recorder(calls: list, result=None, error: BaseException | None = None):
    def fn():
        calls.append(threading.get_ident())
        if error is not None:
            raise error
        return result
    return fn


def test_a_waiter_runs_a_request_nobody_started_on_its_own_thread():
    calls, ran_here = [], []
    request = Request(recorder(calls, result=42), threading.Semaphore(1),
                      lambda: ran_here.append(True))
    assert request.result(timeout=1) == 42
    assert calls == [threading.get_ident()] and ran_here == [True]
    assert request.run() is False  # the request thread that dequeues it later finds it done
    assert len(calls) == 1


def test_without_a_free_slot_the_waiter_waits_instead():
    slots = threading.Semaphore(1)
    slots.acquire()  # another request is running
    calls = []
    request = Request(recorder(calls), slots)
    with pytest.raises(TimeoutError):
        request.result(timeout=0.05)
    assert calls == []
    slots.release()
    with ThreadPoolExecutor(1) as pool:  # the request thread gets to it
        pool.submit(request.run)
    assert request.result(timeout=1) is None and len(calls) == 1


def test_errors_reach_the_waiter_and_cancelled_requests_never_run():
    calls = []
    failing = Request(recorder(calls, error=OSError("disk on fire")), threading.Semaphore(1))
    with pytest.raises(OSError, match="disk on fire"):
        failing.result(timeout=1)
    assert isinstance(failing.exception(), OSError)
    cancelled = Request(recorder(calls), threading.Semaphore(1))
    assert cancelled.cancel()
    with pytest.raises(CancelledError):
        cancelled.result(timeout=1)
    assert cancelled.run() is False and len(calls) == 1


def test_many_racing_runners_run_each_request_once_within_the_bound():
    bound, running, peak = 3, [0], [0]
    lock = threading.Lock()
    slots = threading.Semaphore(bound)

    def work():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        threading.Event().wait(0.002)
        with lock:
            running[0] -= 1
        return threading.get_ident()

    counts: dict[int, int] = {}

    def counted(i):
        def fn():
            with lock:
                counts[i] = counts.get(i, 0) + 1
            return work()
        return fn

    requests = [Request(counted(i), slots) for i in range(60)]
    with ThreadPoolExecutor(bound) as pool, ThreadPoolExecutor(6) as waiters:
        for r in requests:
            pool.submit(r.run)
        list(waiters.map(lambda r: r.result(timeout=10), requests))
    assert counts == {i: 1 for i in range(60)}
    assert peak[0] <= bound
