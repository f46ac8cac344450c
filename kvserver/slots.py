"""Places for long-lived responses (event streams, key listings): at most so many per
tenant and per server process, each held from the request until its response ends."""

from __future__ import annotations

import collections
import threading


class SlotsFull(Exception):
    """No place left, for the tenant or for the process; the message names the flag
    (kvserver.app answers it with 429)."""


class Slot:
    """One place, given back once: at the end of its response, or when a response that
    never started is collected."""

    def __init__(self, slots: Slots, tenant: str):
        self._slots: Slots | None = slots
        self._tenant = tenant

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots._release(self._tenant)

    def __del__(self) -> None:
        self.release()


class Slots:
    """At most `per_tenant` places held by one tenant and `total` by all (thread-safe).

    `what` names a place in refusals ("event streams open"), `tenant_flag` and `total_flag`
    the settings that raise the limits."""

    def __init__(self, per_tenant: int, total: int, what: str, tenant_flag: str, total_flag: str):
        self.per_tenant, self.total = per_tenant, total
        self._what, self._tenant_flag, self._total_flag = what, tenant_flag, total_flag
        self._held: collections.Counter[str] = collections.Counter()
        self._open = 0
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        """Places held now, all tenants."""
        return self._open

    def held(self) -> dict[str, int]:
        """Places held now, by tenant."""
        with self._lock:
            return dict(self._held)

    def take(self, tenant: str) -> Slot:
        """A place for `tenant`, or SlotsFull."""
        with self._lock:
            if self._held[tenant] >= self.per_tenant:
                raise SlotsFull(f"this tenant has {self.per_tenant} {self._what} "
                                f"({self._tenant_flag}): close one first")
            if self._open >= self.total:
                raise SlotsFull(f"the server has {self.total} {self._what} "
                                f"({self._total_flag}): try again later")
            self._held[tenant] += 1
            self._open += 1
        return Slot(self, tenant)

    def _release(self, tenant: str) -> None:
        with self._lock:
            self._held[tenant] -= 1
            if self._held[tenant] <= 0:
                del self._held[tenant]
            self._open -= 1
