"""Eviction policies for trace replay: which equal-sized chunks a capacity-limited cache keeps.

A policy only decides; the replay applies its decisions to a real store (deleting the
victims). Capacity is counted in chunks because every chunk of one trace has the same
size. The contract, for one key at a time:

- `key in policy`: is it resident?
- `policy.hit(key)`: a resident key was used again.
- `policy.insert(key) -> list[key]`: offer a missing key; returns the keys that leave the
  cache as a result (victims, and `key` itself when the policy declines to admit it).

Policies here:

- `lru`: least recently used goes first.
- `s3fifo`: S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO (10 %), a main FIFO
  with 2-bit access counters and "second chances", and a ghost FIFO of recently evicted
  keys. A key seen once (a one-off long document, a scan) leaves from the small queue
  without disturbing the main queue: scan-resistant.
- `fifo`: first in, first out; a baseline that ignores reuse.
- `unlimited`: keeps everything (the best achievable rate).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)  # a chunk's key: a store key, or a trace's block id

POLICIES = ("lru", "s3fifo", "fifo", "unlimited")


class EvictionPolicy(ABC, Generic[K]):
    """Decides residency of equal-sized chunks under a capacity of `capacity` chunks."""

    name: str = ""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be at least one chunk, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def hit(self, key: K) -> None: ...

    @abstractmethod
    def insert(self, key: K) -> list[K]: ...


class Unlimited(EvictionPolicy[K]):
    name = "unlimited"

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity or 0
        self._keys: set[K] = set()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def hit(self, key: K) -> None:
        return None

    def insert(self, key: K) -> list[K]:
        self._keys.add(key)
        return []


class LRU(EvictionPolicy[K]):
    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[K, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def hit(self, key: K) -> None:
        self._order.move_to_end(key)

    def insert(self, key: K) -> list[K]:
        self._order[key] = None
        victims = []
        while len(self._order) > self.capacity:
            victims.append(self._order.popitem(last=False)[0])
        return victims


class FIFO(LRU[K]):
    name = "fifo"

    def hit(self, key: K) -> None:
        return None


class S3FIFO(EvictionPolicy[K]):
    """S3-FIFO: small FIFO -> main FIFO with counters, plus a ghost FIFO of keys only.

    A new key enters the small queue, unless the ghost queue remembers it (it was evicted
    from the small queue recently and came back): then it goes straight to main. Leaving
    the small queue, a key that was hit at least once moves to main; otherwise it is
    evicted and remembered as a ghost. Leaving main, a key with a non-zero counter is
    reinserted with the counter decremented; otherwise it is evicted.
    """

    name = "s3fifo"
    SMALL_FRACTION = 0.1  # the paper's default
    MAX_FREQ = 3  # 2-bit counters

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.small_capacity = max(1, int(capacity * self.SMALL_FRACTION))
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._ghost: OrderedDict[K, None] = OrderedDict()
        self._freq: dict[K, int] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def hit(self, key: K) -> None:
        self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def insert(self, key: K) -> list[K]:
        victims: list[K] = []
        while len(self._freq) >= self.capacity:
            victims.append(self._evict())
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        return victims

    def _evict(self) -> K:
        if len(self._small) >= self.small_capacity or not self._main:
            victim = self._evict_small()
            if victim is not None:
                return victim
        return self._evict_main()

    def _evict_small(self) -> K | None:
        """Drain the small queue until one key is evicted (None: all promoted to main)."""
        while self._small:
            key, _ = self._small.popitem(last=False)
            if self._freq[key] > 0:
                self._freq[key] = 0
                self._main[key] = None
                continue
            del self._freq[key]
            self._ghost[key] = None
            # The ghost queue remembers as many keys as main can hold.
            while len(self._ghost) > self.capacity - self.small_capacity:
                self._ghost.popitem(last=False)
            return key
        return None

    def _evict_main(self) -> K:
        while True:
            key, _ = self._main.popitem(last=False)
            freq = self._freq[key]
            if freq > 0:
                self._freq[key] = freq - 1
                self._main[key] = None
                continue
            del self._freq[key]
            return key


def make_policy(name: str, capacity: int | None) -> EvictionPolicy[Any]:
    """A policy by name; `capacity=None` (or the name `unlimited`) keeps everything."""
    if capacity is None or name == "unlimited":
        return Unlimited()
    classes: dict[str, type[LRU[Any]] | type[S3FIFO[Any]]] = {"lru": LRU, "s3fifo": S3FIFO,
                                                              "fifo": FIFO}
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})")
    return classes[name](capacity)
