"""`LookupPoll`: a lookup an engine polls from a thread that must not wait, within a patience bound.

vLLM's scheduler asks for a request's stored prefix once per step and may not block the
step on storage: it starts a lookup (`KVConnector.start_lookup`), waits a few
milliseconds at most (`wait`), and asks again next step while `answer()` is None. A
lookup is not waited for past the time recomputing the chunks it asked for would take,
less the time their load would (`KVConnector.lookup_patience_s`: a hit found later loses
to recompute, its load coming on top), so a slow or stalled store costs a miss no more
than the prefix's own compute. Where even a hit found at once would lose, the lookup is
not sent (`asked=False`), but for an occasional probe, which is sent and timed, not
waited for. A lookup given up on is left to run to its timeout: its answer still times
the store.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from connector.core import KVConnector

log = logging.getLogger("kvstash.connector")


class LookupPoll:
    """One lookup in flight. Called from the engine's scheduler thread only."""

    def __init__(self, core: KVConnector, future: concurrent.futures.Future[int],
                 asked_tokens: int, floor_s: float, cached: list[bool] | None = None,
                 probe: bool = False, asked: bool = True):
        self._core = core
        self.future = future
        self.asked_tokens = asked_tokens  # the tokens of the chunks asked for
        self.floor_s = floor_s  # patience is never shorter than this
        # Per chunk asked for, whether its files were all in the page cache at the lookup
        # (a local directory answers that in the same pass); None where not asked.
        self.cached = cached
        self.started = time.monotonic()
        self.probe = probe  # `LoadPolicy.lookup_probe`: sent whatever its patience
        self.asked = asked  # False: not sent (a hit could not win); answers 0 at once
        self.answered = False
        self.given_up = False
        if asked:
            future.add_done_callback(self._timed)

    def _timed(self, future: concurrent.futures.Future[int]) -> None:
        """The store's answer came (on the loop's thread), given up on or not: the policy
        learns how long it took."""
        if not future.cancelled():
            self._core.policy.observe_lookup(time.monotonic() - self.started)

    def done(self) -> bool:
        return self.future.done()

    def cancel(self) -> None:
        """The request is gone. A lookup given up on is left to end by its timeout, so
        that its answer still times the store."""
        if not self.given_up:
            self.future.cancel()

    def patience_s(self) -> float:
        """How long this lookup is waited for (`KVConnector.lookup_patience_s`)."""
        return self._core.lookup_patience_s(self.asked_tokens, self.floor_s, self.probe)

    def wait(self, max_s: float) -> None:
        """Wait for the answer at most `max_s`, and no longer than the patience left."""
        if not self.future.done():
            concurrent.futures.wait([self.future], timeout=min(self.patience_s(), max_s))

    def answer(self) -> int | None:
        """Leading chunks the store holds of those asked for; None while the lookup is
        pending and within its patience. A failure, a timeout, or a lookup given up (past
        its patience: counted as lookups_given_up) answers 0."""
        core = self._core
        waited = time.monotonic() - self.started
        if self.given_up or not self.asked:
            return 0
        if self.future.done():
            try:
                found = self.future.result()
            except Exception as exc:  # noqa: BLE001 - cancelled: a miss
                log.warning("lookup on %s failed: %s", core.store, exc)
                return 0
            self.answered = True
            return found
        if waited > core.lookup_timeout_s + 1.0:
            self.future.cancel()  # the core answers by its timeout; this is its loop stuck
            core.count(lookup_timeouts=1)
            return 0
        if waited >= self.patience_s():
            core.count(lookups_given_up=1)  # it ends by its timeout, timed but unheard
            self.given_up = True
            return 0
        return None
