"""A circuit breaker: after repeated failures an endpoint is skipped until a probe succeeds.

States: *closed* (every call goes through), *open* (every call is refused at no cost
for `reset_s`), *half-open* (one probe call goes through; its success closes the
breaker, its failure re-opens it for twice as long, up to `max_reset_s`).

Only failures of the endpoint count (connection errors, timeouts, 5xx after the client's
own retries); a 404 is an answer, not a failure. Single event-loop thread use: no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class CircuitBreaker:
    def __init__(
        self,
        failures: int = 5,
        reset_s: float = 5.0,
        max_reset_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.failures = max(1, failures)
        self.reset_s = reset_s
        self.max_reset_s = max(max_reset_s, reset_s)
        self._clock = clock
        self._consecutive = 0
        self._opened_at = 0.0
        self._open_for = reset_s
        self._probing = False
        self._state = CLOSED
        self.opened = 0
        self.refused = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self._open_for:
            return HALF_OPEN
        return self._state

    def allow(self) -> bool:
        """May a call go out now? Refusals are counted; at most one probe while half-open."""
        state = self.state
        if state == CLOSED:
            return True
        if state == HALF_OPEN and not self._probing:
            self._probing = True
            self._state = HALF_OPEN
            return True
        self.refused += 1
        return False

    def success(self) -> None:
        self._consecutive = 0
        self._probing = False
        self._open_for = self.reset_s
        self._state = CLOSED

    def failure(self) -> None:
        self._consecutive += 1
        if self._probing:
            self._probing = False
            self._open_for = min(self._open_for * 2, self.max_reset_s)
            self._trip()
        elif self._state == CLOSED and self._consecutive >= self.failures:
            self._trip()

    def release(self) -> None:
        """A call that ended with neither verdict (cancelled): let another probe go."""
        self._probing = False

    def _trip(self) -> None:
        self._state = OPEN
        self._opened_at = self._clock()
        self.opened += 1

    def snapshot(self) -> dict[str, object]:
        return {"breaker": self.state, "breaker_opened": self.opened, "breaker_refused": self.refused}
