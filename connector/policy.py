"""Load-vs-recompute: load a stored prefix only when the store beats the model at producing it.

Both sides are measured online. Every load reports bytes and seconds (store GB/s as the
engine sees it, placement included); every prefill reports computed tokens and seconds.
What a load saves is the marginal cost of the tokens it skips, not their average: a
forward has a fixed part (on a GPU, launching kernels: a short suffix can take as long
as a long prompt, docs/benchmarks/2026-11-27-gpu-rerun.md), so `PrefillModel` fits
`seconds = fixed + tokens / tokens_per_s` to forwards of different sizes. A stored prefix
of n tokens is worth loading when `n * bytes_per_token / GBps < n / tokens_per_s`. Before
the first measurement the policy is optimistic (storage is usually orders of magnitude
faster than prefill), and the load deadline bounds how much a wrong guess can cost.

When the policy declines, it stops learning the store's speed; so every `probe_every`-th
declined hit loads a single chunk, which costs at most one chunk's worth of time.
"""

from __future__ import annotations

import time
from collections import deque
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


class PrefillModel:
    """Prefill time as `fixed + tokens / tokens_per_s`, learnt from the forwards an engine
    reports. Forwards are kept by size class (a power of two of tokens, the last `keep` of
    each); a class speaks once it holds `min_samples`, through its lower median, so one
    slow forward (the first of a shape compiles or warms kernels: tens of times the
    others) is outvoted rather than averaged in. Two classes or more give the fit's
    slope; with one, `tokens_per_s` is that class's average rate (no fixed part assumed);
    with none yet, every forward's rate as it came, exponentially weighted."""

    def __init__(self, alpha: float = 0.3, keep: int = 8, min_samples: int = 3):
        self.keep = keep
        self.min_samples = min_samples
        self._sizes: dict[int, deque[tuple[int, float]]] = {}
        self._early = Ewma(alpha)
        self._fit: tuple[float, float | None] | None = None  # (fixed s, tokens/s or None: free)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._sizes.setdefault(tokens.bit_length(), deque(maxlen=self.keep)).append(
            (tokens, seconds))
        self._early.add(tokens / seconds)
        self._fit = None

    def _points(self) -> list[tuple[float, float]]:
        """(tokens, seconds) of each size class that speaks: its lower medians."""
        out: list[tuple[float, float]] = []
        for samples in self._sizes.values():
            if len(samples) >= self.min_samples:
                mid = (len(samples) - 1) // 2
                out.append((sorted(n for n, _ in samples)[mid],
                            sorted(t for _, t in samples)[mid]))
        return out

    def _solve(self) -> tuple[float, float | None] | None:
        points = self._points()
        if len(points) >= 2:
            mx = sum(n for n, _ in points) / len(points)
            my = sum(t for _, t in points) / len(points)
            sxx = sum((n - mx) ** 2 for n, _ in points)
            slope = sum((n - mx) * (t - my) for n, t in points) / sxx
            if slope <= 0:  # bigger forwards took no longer: a token costs nothing to add
                return my, None
            return max(0.0, my - slope * mx), 1.0 / slope
        if points:
            n, t = points[0]
            return 0.0, n / t
        return None if self._early.value is None else (0.0, self._early.value)

    def estimate(self) -> tuple[float, float | None] | None:
        """(fixed seconds, marginal tokens/s: None where more tokens cost no measurable
        time), or None before any forward."""
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    @property
    def tokens_per_s(self) -> float | None:
        fit = self.estimate()
        return None if fit is None else fit[1]

    def marginal_s(self, tokens: int) -> float | None:
        """What `tokens` more tokens add to a forward; None before any forward."""
        fit = self.estimate()
        if fit is None:
            return None
        return 0.0 if fit[1] is None else tokens / fit[1]


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
        self.prefill = PrefillModel(alpha)
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
        """One forward's computed prompt tokens and time."""
        self.prefill.add(tokens, seconds)

    def recompute_s(self, tokens: int) -> float | None:
        """What recomputing `tokens` more adds to a forward (`PrefillModel`); None before
        any forward was measured."""
        return self.prefill.marginal_s(tokens)

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
        fit = self.prefill.estimate()
        return {
            "store_gbps_estimate": None if bps is None else bps / 1e9,
            # Marginal: None before any forward, or where more tokens cost no measurable time.
            "prefill_tokens_per_s_estimate": None if fit is None else fit[1],
            "prefill_fixed_s_estimate": None if fit is None else fit[0],
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
