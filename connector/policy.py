"""Load-vs-recompute: load a stored prefix only when the store beats the model at producing it.

Both sides are measured online. Every load reports bytes and seconds (store GB/s as the
engine sees it, placement included); every prefill reports computed tokens and seconds
(prefill tokens/s). A stored prefix of n tokens is worth loading when
`n * bytes_per_token / GBps < n / tokens_per_s`. Before the first measurement the policy
is optimistic (storage is usually orders of magnitude faster than prefill), and the load
deadline bounds how much a wrong guess can cost.

When the policy declines, it stops learning the store's speed; so every `probe_every`-th
declined hit loads a single chunk, which costs at most one chunk's worth of time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class LoadPlan:
    chunks: int          # how many leading chunks to load
    deadline_s: float    # stop waiting after this long; what arrived by then is the hit
    reason: str          # "load", "declined", "probe", "miss"


class Ewma:
    """Exponentially weighted mean; the first sample is taken as is."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value


class LoadPolicy:
    """Decides how many stored chunks to load and how long to wait for them.

    Called from the engine thread only (no locking). `adaptive=False` loads every hit.
    `wait_factor` scales the predicted
    recompute time of the planned tokens into a deadline: waiting longer than recomputing
    would take is already a loss, so a stalled store costs at most that fraction extra.
    """

    def __init__(
        self,
        *,
        alpha: float = 0.3,
        wait_factor: float = 0.5,
        min_wait_s: float = 0.05,
        max_wait_s: float = 5.0,
        probe_every: int = 16,
        adaptive: bool = True,
    ):
        self.store_bytes_per_s = Ewma(alpha)
        self.prefill_tokens_per_s = Ewma(alpha)
        self.wait_factor = wait_factor
        self.min_wait_s = min_wait_s
        self.max_wait_s = max_wait_s
        self.probe_every = probe_every
        self.adaptive = adaptive
        self._declined = 0

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """One load's delivered bytes and wall time; a stalled load reports 0 bytes."""
        if seconds > 0:
            self.store_bytes_per_s.add(nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s.add(tokens / seconds)

    def recompute_s(self, tokens: int) -> float | None:
        tps = self.prefill_tokens_per_s.value
        return None if tps is None else tokens / tps

    def load_s(self, nbytes: int) -> float | None:
        bps = self.store_bytes_per_s.value
        if bps is None:
            return None
        return nbytes / bps if bps > 0 else float("inf")

    def deadline_s(self, tokens: int) -> float:
        recompute = self.recompute_s(tokens)
        if recompute is None:
            return self.max_wait_s
        return min(self.max_wait_s, max(self.min_wait_s, self.wait_factor * recompute))

    def plan(self, hit_chunks: int, chunk_tokens: int, chunk_bytes: int) -> LoadPlan:
        if hit_chunks <= 0:
            return LoadPlan(0, 0.0, "miss")
        tokens = hit_chunks * chunk_tokens
        recompute = self.recompute_s(tokens)
        load = self.load_s(hit_chunks * chunk_bytes)
        if not self.adaptive or recompute is None or load is None or load < recompute:
            return LoadPlan(hit_chunks, self.deadline_s(tokens), "load")
        self._declined += 1
        if self.probe_every and self._declined % self.probe_every == 0:
            return LoadPlan(1, self.deadline_s(chunk_tokens), "probe")
        return LoadPlan(0, 0.0, "declined")

    def snapshot(self) -> dict[str, float | None]:
        bps = self.store_bytes_per_s.value
        return {
            "store_gbps_estimate": None if bps is None else bps / 1e9,
            "prefill_tokens_per_s_estimate": self.prefill_tokens_per_s.value,
        }


class PrefillTimer:
    """Times one forward pass for `observe_prefill`: wall clock on CPU, CUDA events on a GPU,
    whose kernels run after the Python call returns. Read it once `ready()`: never a sync."""

    def __init__(self, tokens: int, device: Any):
        self.tokens = tokens
        self.started = time.monotonic()
        self.ended = self.started
        self._events = None
        if getattr(device, "type", device) == "cuda":
            import torch

            self._events = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        self.ended = time.monotonic()
        if self._events is not None:
            self._events[1].record()

    def ready(self) -> bool:
        return self._events is None or self._events[1].query()

    def seconds(self) -> float:
        if self._events is not None:
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        return self.ended - self.started

    @staticmethod
    def finished(timers: list[PrefillTimer]) -> Iterator[PrefillTimer]:
        """Take from the front of `timers` (stopped, oldest first) those whose time is known."""
        while timers and timers[0].ready():
            yield timers.pop(0)
