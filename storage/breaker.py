"""The one circuit breaker: after repeated failures a backend is skipped until a probe succeeds.

Used by the s3:// and http:// stores and by the connector's bypass of a failing store,
with one option vocabulary: `breaker_failures` (failures in a row that open it),
`breaker_cooldown` (how long it stays open first) and `breaker_max_cooldown`.

States: *closed* (every call goes through), *open* (every call is refused at no cost
for the cooldown), *half-open* (one probe call goes through; its success closes the
breaker, its failure re-opens it for twice as long, up to the maximum cooldown).

Only failures of the backend count (connection errors, timeouts, 5xx after the client's
own retries); a 404 is an answer, not a failure. One thread at a time (an event loop, or
an engine thread): no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from storage.errors import ConfigError
from storage.options import StoreURL, parse_seconds

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


@dataclass(frozen=True)
class BreakerOptions:
    """`breaker_failures`, `breaker_cooldown`, `breaker_max_cooldown`: the same three
    settings (and names) on every store URL and on `KVConnector`."""

    failures: int
    cooldown_s: float
    max_cooldown_s: float = 60.0

    @classmethod
    def from_url(cls, u: StoreURL, failures: int, cooldown_s: float,
                 max_cooldown_s: float = 60.0) -> BreakerOptions:
        """Take the options from a store URL, these values as defaults. `breaker_reset`, the
        older s3:// spelling of `breaker_cooldown`, is still accepted."""
        older = u.take("breaker_reset", parse_seconds, None)
        opts = cls(
            failures=u.take("breaker_failures", int, failures),
            cooldown_s=u.take("breaker_cooldown", parse_seconds,
                              cooldown_s if older is None else older),
            max_cooldown_s=u.take("breaker_max_cooldown", parse_seconds, max_cooldown_s),
        )
        if opts.failures < 1 or opts.cooldown_s < 0 or opts.max_cooldown_s < 0:
            raise ConfigError(f"{u.redacted()}: breaker_failures must be >= 1 and the "
                              "breaker cooldowns >= 0")
        return opts

    def breaker(self) -> CircuitBreaker:
        return CircuitBreaker(self.failures, self.cooldown_s, self.max_cooldown_s)


class CircuitBreaker:
    def __init__(
        self,
        failures: int = 5,
        cooldown_s: float = 5.0,
        max_cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.failures = max(1, failures)
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max(max_cooldown_s, cooldown_s)
        self._clock = clock
        self._consecutive = 0
        self._opened_at = 0.0
        self._open_for = cooldown_s
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
        self._open_for = self.cooldown_s
        self._state = CLOSED

    def failure(self) -> None:
        self._consecutive += 1
        if self._probing:
            self._probing = False
            self._open_for = min(self._open_for * 2, self.max_cooldown_s)
            self._trip()
        elif self._state == CLOSED and self._consecutive >= self.failures:
            self._trip()

    def release(self) -> None:
        """A call that ended with neither verdict (cancelled): let another probe go."""
        self._probing = False

    def record(self, verdict: bool | None) -> bool:
        """One call's outcome: True (answered), False (failed), None (neither, e.g.
        cancelled). Returns whether this outcome opened the breaker (to log it once)."""
        if verdict is None:
            self.release()
        elif verdict:
            self.success()
        else:
            opened = self.opened
            self.failure()
            return self.opened != opened
        return False

    @property
    def is_open(self) -> bool:
        """Whether calls are being refused now (open, or half-open with its probe out)."""
        state = self.state
        return state == OPEN or (state == HALF_OPEN and self._probing)

    @property
    def open_for_s(self) -> float:
        """The cooldown of the current (or next) opening."""
        return self._open_for

    def _trip(self) -> None:
        self._state = OPEN
        self._opened_at = self._clock()
        self.opened += 1

    def snapshot(self) -> dict[str, object]:
        return {"breaker": self.state, "breaker_opened": self.opened, "breaker_refused": self.refused}
