"""Load-vs-recompute: load a stored prefix only when the store beats the model at producing it.

Both sides are measured online. Every load reports bytes and seconds (store GB/s as the
engine sees it, placement included); every prefill reports computed tokens and seconds.
What a load saves is the marginal cost of the tokens it skips, not their average: a
forward has a fixed part (on a GPU, launching kernels: a short suffix can take as long
as a long prompt, docs/benchmarks/2026-11-27-gpu-rerun.md), so `PrefillModel` fits
`seconds = fixed + per_unit * size` to forwards of different sizes, where a forward's
size is its FLOPs where the model is known (`ModelCost`: ~2 x parameters a token, plus
attention growing with the context) and its token count otherwise. A stored prefix of n
tokens is worth loading when `n * bytes_per_token / GBps < per_unit * size(n)`.

Forwards of one size cannot tell the fixed part from the per-token part: an engine that
only computes the short suffixes of hits would otherwise take each step's fixed cost for
the cost of its few tokens and estimate recompute many times too high
(docs/benchmarks/2026-11-29-vllm-lookup-bound.md). With a `PrefillPrior` (the model's
FLOPs and the device's rough speed) such forwards are split between the two parts in the
proportion the prior predicts for their size; measured forwards of sizes far enough
apart replace the prior. Before the first measurement the policy is optimistic about
the store (storage is usually orders of magnitude faster than prefill), and the load
deadline bounds how much a wrong guess can cost.

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


@dataclass(frozen=True)
class ModelCost:
    """FLOPs of a prefill from a model's shape: `per_token` (2 x the weights a token passes
    through: attention projections and MLP of every layer, no embedding lookup, no LM
    head, which a prefill applies to its last token only) and `per_pair` (4 x layers x
    query width: the scores and the weighted sum of one query over one key)."""

    per_token: float
    per_pair: float

    def flops(self, tokens: int, context: int = 0) -> float:
        """Computing `tokens` tokens after `context` cached ones (causal attention: the
        i-th new token reads `context + i` keys)."""
        pairs = tokens * context + tokens * (tokens + 1) / 2
        return self.per_token * tokens + self.per_pair * pairs

    @classmethod
    def of(cls, config: Any) -> ModelCost | None:
        """From a transformers config (or its dict); None where its shape is not there.
        Mixture-of-experts MLPs count the experts a token is routed to."""
        if isinstance(config, dict):
            from types import SimpleNamespace

            config = SimpleNamespace(**config)
        text = getattr(config, "get_text_config", None)
        config = text() if callable(text) else config

        def get(*names: str) -> int | None:
            for name in names:
                value = getattr(config, name, None)
                if isinstance(value, int) and value > 0:
                    return value
            return None

        hidden, layers = get("hidden_size", "n_embd", "d_model"), get("num_hidden_layers", "n_layer")
        heads = get("num_attention_heads", "n_head")
        if not (hidden and layers and heads):
            return None
        head_dim = get("head_dim") or hidden // heads
        kv_heads = get("num_key_value_heads") or heads
        experts = get("num_experts_per_tok") or 1
        inner = get("moe_intermediate_size") if experts > 1 else None
        inner = (inner or get("intermediate_size", "n_inner", "ffn_dim") or 4 * hidden) * experts
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
        mlp = 3 * hidden * inner  # gate, up, down (a gated MLP; an ungated one has 2)
        return cls(per_token=2.0 * layers * (attention + mlp),
                   per_pair=4.0 * layers * heads * head_dim)


# Device speeds for a prior: FLOP/s a prefill reaches, and a forward's fixed cost
# (scheduling, launches, the Python around it). They only set how forwards of a single
# size are split between fixed and per-token cost, until forwards of several sizes replace
# them (PrefillModel). They err fast (about the dense bf16 peak of a large CPU server and of
# a data-centre GPU): a prior that thinks compute cheap declines a load, the engine
# computes the whole prompt, and that forward corrects the estimate; one that thinks it
# dear loads, computes only suffixes, and never learns otherwise.
DEVICE_PRIOR = {"cpu": (1e12, 0.02), "cuda": (1e15, 0.02)}
# Size classes whose token counts differ by this factor give a slope (closer ones differ by
# noise more than by their tokens: a 1-token and a 3-token suffix step say nothing of 256).
FIT_SPAN = 8
RATE_TOKENS = 1024  # the prompt length a reported token rate is for (attention grows with it)
# A store's speed (its loads, its lookups) is judged from at least this many of its
# operations, the lower median of the last JUDGE_KEEP: a first request that pays for a
# connection, a thread pool or a cold cache does not turn later hits into recomputes.
JUDGE_MIN_SAMPLES = 2
JUDGE_KEEP = 8
# A prefix is left unsaved only where its load (lookup included) is predicted to take over
# this many times its recompute: near a tie the estimates move as the engine learns, and a
# chunk not saved is missed by every later reader (`worth_saving`).
SAVE_MARGIN = 2.0


@dataclass(frozen=True)
class PrefillPrior:
    """Prefill time before it is measured: `step_s + cost.flops(tokens) / flops_per_s`."""

    cost: ModelCost
    flops_per_s: float
    step_s: float

    @classmethod
    def of(cls, config: Any, device: str = "cpu") -> PrefillPrior | None:
        """For a transformers config on a device kind ("cpu", "cuda"; others as "cuda");
        None where the config does not give the model's shape."""
        cost = ModelCost.of(config)
        if cost is None:
            return None
        flops_per_s, step_s = DEVICE_PRIOR.get(device, DEVICE_PRIOR["cuda"])
        return cls(cost, flops_per_s, step_s)


class PrefillModel:
    """Prefill time as `fixed + per_unit * size`, learnt from the forwards an engine
    reports; a forward's size is its FLOPs (`prior.cost`) where a prior is given, else its
    tokens. Forwards are kept by size class (a power of two of tokens, the last `keep` of
    each); a class speaks once it holds `min_samples`, through its lower median, so one
    slow forward (the first of a shape compiles or warms kernels: tens of times the
    others) is outvoted rather than averaged in.

    Classes `FIT_SPAN` times apart in tokens give the fit's slope (least squares over every
    class that speaks; closer forwards differ by noise more than by their tokens).
    Otherwise the largest class that speaks (or, before any does, the most frequent one)
    is split between fixed and per-token cost in the proportion the prior predicts for its
    size: a 1-token suffix step is then nearly all fixed cost. That split answers for
    prompts more than `FIT_SPAN` times longer than that class; a prompt within its span
    is estimated at the class's own rate, all of it per token. Either way an error
    corrects itself: a prior that thinks compute cheap declines a load and the whole
    prompt is computed; a rate that thinks it dear loads and only a suffix is computed.
    Both give the fit a second size.
    Without a prior: the largest class gives its average rate (no fixed part assumed),
    none yet every forward's rate as it came, exponentially weighted.

    `min_samples` is 2 by default: the lower median of two forwards is the faster one, which
    outvotes a cold forward, and an engine that needs forwards of a new size to correct
    its estimate computes one more prompt for it, not two."""

    def __init__(self, alpha: float = 0.3, keep: int = 8, min_samples: int = 2,
                 prior: PrefillPrior | None = None):
        self.keep = keep
        self.min_samples = min_samples
        self.prior = prior
        self._sizes: dict[int, deque[tuple[int, float]]] = {}
        self._early = Ewma(alpha)
        self._fit: tuple[float, float | None] | None = None  # (fixed s, s per unit or None: free)
        # (size, seconds, tokens) of the one size class a prior split, while there is no fit
        self._basis: tuple[float, float, int] | None = None

    @property
    def measured(self) -> bool:
        """Whether any forward was reported (before that, estimates are the prior's)."""
        return bool(self._sizes)

    def size(self, tokens: int) -> float:
        """A forward of `tokens` prompt tokens in the fit's units (FLOPs or tokens)."""
        return tokens if self.prior is None else self.prior.cost.flops(tokens)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._sizes.setdefault(tokens.bit_length(), deque(maxlen=self.keep)).append(
            (tokens, seconds))
        self._early.add(tokens / seconds)
        self.forget_fit()

    def forget_fit(self) -> None:
        """Refit at the next estimate (the samples or the prior changed)."""
        self._fit = None

    @staticmethod
    def _lower_median(samples: deque[tuple[int, float]]) -> tuple[int, float]:
        mid = (len(samples) - 1) // 2
        return sorted(n for n, _ in samples)[mid], sorted(t for _, t in samples)[mid]

    def _points(self) -> list[tuple[float, float, int]]:
        """(size, seconds, tokens) of each size class that speaks, smallest first."""
        return sorted((self.size(n), t, n) for n, t in (
            self._lower_median(s) for s in self._sizes.values() if len(s) >= self.min_samples))

    @staticmethod
    def _spanned(points: list[tuple[float, float, int]]) -> bool:
        """Whether `points` hold two size classes `FIT_SPAN` apart: enough for a fit."""
        return len(points) >= 2 and points[-1][2] >= FIT_SPAN * points[0][2]

    def _solve(self) -> tuple[float, float | None] | None:
        points = self._points()
        prior = self.prior
        self._basis = None
        if self._spanned(points):
            mx = sum(x for x, _, _ in points) / len(points)
            my = sum(t for _, t, _ in points) / len(points)
            sxx = sum((x - mx) ** 2 for x, _, _ in points)
            slope = sum((x - mx) * (t - my) for x, t, _ in points) / sxx
            if slope <= 0:  # bigger forwards took no longer: a token costs nothing to add
                return my, None
            if my - slope * mx < 0:  # no fixed part: the line through the origin
                return 0.0, sum(x * t for x, t, _ in points) / sum(x * x for x, _, _ in points)
            return my - slope * mx, slope
        if prior is not None:
            if points:
                x, t, n = points[-1]
            elif self._sizes:
                n, t = self._lower_median(max(self._sizes.values(), key=len))
                x = self.size(n)
            else:
                return prior.step_s, 1.0 / prior.flops_per_s
            self._basis = (x, t, n)
            scale = t / (prior.step_s + x / prior.flops_per_s)
            return prior.step_s * scale, scale / prior.flops_per_s
        if points:
            x, t, _ = points[-1]
            return 0.0, t / x
        return None if self._early.value is None else (0.0, 1.0 / self._early.value)

    def one_size(self) -> tuple[float, float] | None:
        """(size, seconds) of the largest class that speaks where no two classes are
        `FIT_SPAN` apart and there is no prior: the estimate is then that class's rate
        alone, which cannot tell a fixed part from the rest. None otherwise."""
        points = self._points()
        if self.prior is not None or not points or self._spanned(points):
            return None
        x, t, _ = points[-1]
        return x, t

    def estimate(self) -> tuple[float, float | None] | None:
        """(fixed seconds, marginal seconds per unit of `size`: None where a bigger
        forward costs no measurable time), or None before any forward (and no prior)."""
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    @property
    def tokens_per_s(self) -> float | None:
        """The marginal token rate over a prompt of RATE_TOKENS (any prompt without a
        prior, where the fit is in tokens); None where tokens cost nothing, or before any
        forward (and no prior)."""
        fit = self.estimate()
        if fit is None or fit[1] is None:
            return None
        return RATE_TOKENS / (self.size(RATE_TOKENS) * fit[1])

    def marginal_s(self, tokens: int) -> float | None:
        """What `tokens` more tokens add to a forward; None before any forward (and no prior)."""
        fit = self.estimate()
        if fit is None:
            return None
        if self._basis is not None and self._basis[2] * FIT_SPAN >= tokens:
            # Forwards of about this size were measured: their time, all of it per token,
            # errs towards loading, and the suffix a load leaves gives a second size.
            x, t, _ = self._basis
            return self.size(tokens) * t / x
        return 0.0 if fit[1] is None else self.size(tokens) * fit[1]


class LoadPolicy:
    """Decides how many stored chunks to load and how long to wait for them.

    Called from the engine thread only (no locking). `adaptive=False` loads every hit.
    `prior`: the model's FLOPs and the device's rough speed (`PrefillPrior`), without which
    forwards of one size are taken as all per-token cost. `wait_factor` scales the predicted
    recompute time of the planned tokens into a deadline: waiting longer than recomputing
    would take is already a loss, so a stalled store costs at most that fraction extra.
    """

    def __init__(
        self,
        *,
        alpha: float = 0.3,
        prior: PrefillPrior | None = None,
        wait_factor: float = 0.5,
        min_wait_s: float = 0.05,
        max_wait_s: float = 5.0,
        probe_every: int = 16,
        adaptive: bool = True,
    ):
        self.store_bytes_per_s = Ewma(alpha)
        self.prefill = PrefillModel(alpha, prior=prior)
        # The same fit over a load's bytes: its fixed part is the store's round trips (a
        # far bucket's one-chunk load is nearly all of it), its slope the bandwidth.
        self.loads = PrefillModel(alpha)
        self._stalls = Ewma(alpha)  # 1 for a load that delivered nothing, else 0
        # Seconds from a lookup's start to the store's answer, given up on or not: the
        # last `JUDGE_KEEP`, judged by their lower median once there are JUDGE_MIN_SAMPLES.
        self._lookup_seconds: deque[float] = deque(maxlen=JUDGE_KEEP)
        self._loads_seen = 0
        self.wait_factor = wait_factor
        self.min_wait_s = min_wait_s
        self.max_wait_s = max_wait_s
        self.probe_every = probe_every
        self.adaptive = adaptive
        self._declined = 0
        self._lookups = 0
        self._bytes_per_token: float | None = None  # of the chunks last planned
        self._loaded_bytes_per_token: float | None = None  # of the chunks last loaded

    def know_model(self, prior: PrefillPrior | None) -> None:
        """Take `prior` where the policy was built without one (an adapter that knows the
        model: the HF one); a prior given at construction stays."""
        if self.prefill.prior is None and prior is not None:
            self.prefill.prior = prior
            self.prefill.forget_fit()

    def observe_load(self, nbytes: int, seconds: float, tokens: int = 0) -> None:
        """One load's delivered bytes and wall time; a stalled load reports 0 bytes.
        `tokens`: the prompt tokens those bytes hold, where known (the bytes a lookup's
        chunks will cost, before a plan of them knows their size)."""
        if tokens > 0 and nbytes > 0:
            self._loaded_bytes_per_token = nbytes / tokens
        if seconds > 0:
            self._loads_seen += 1
            self.store_bytes_per_s.add(nbytes / seconds)
            self._stalls.add(0.0 if nbytes else 1.0)
            self.loads.add(nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One forward's computed prompt tokens and time."""
        self.prefill.add(tokens, seconds)

    def recompute_s(self, tokens: int) -> float | None:
        """What recomputing `tokens` more adds to a forward (`PrefillModel`); None before
        any forward was measured."""
        return self.prefill.marginal_s(tokens)

    def load_s(self, nbytes: int) -> float | None:
        """A load of `nbytes`: fixed cost plus bytes over bandwidth, fitted to loads of
        several sizes (`PrefillModel` over bytes), and slower by recent stalls (a load that
        delivered nothing); inf after stalls alone; None before JUDGE_MIN_SAMPLES loads
        (a store's first request often pays for a connection and threads to start: one
        slow load alone must not make every later hit a recompute).

        Loads of one size alone cannot tell the store's round trip from its bandwidth: a
        far store's one-chunk loads (all that probes and short hits give) are mostly round
        trip, and their rate alone would price an eight-chunk hit at eight round trips and
        decline a load that beats recompute. There the store's lookup time (a round trip
        to the same store, `lookup_s`) is taken as the fixed part and the rest of those
        loads' time as per byte; a load then made gives the fit its second size."""
        if self._loads_seen < JUDGE_MIN_SAMPLES:
            return None
        fit = self.loads.estimate()
        stalled = self._stalls.value or 0.0
        if fit is None or stalled >= 1.0:
            return float("inf")
        fixed, per_byte = fit
        one, trip = self.loads.one_size(), self.lookup_s()
        if one is not None and trip is not None:
            size, seconds = one
            fixed = min(trip, seconds)
            per_byte = (seconds - fixed) / size
        return (fixed + (0.0 if per_byte is None else nbytes * per_byte)) / (1.0 - stalled)

    def _measured_recompute_s(self, tokens: int) -> float | None:
        """`recompute_s` once a forward was measured; None before (the prior alone, fast
        on purpose, does not bound a wait)."""
        return self.recompute_s(tokens) if self.prefill.measured else None

    def deadline_s(self, tokens: int, load_s: float | None = None) -> float:
        """How long a load of `tokens` is waited for: `wait_factor` of their recompute,
        and, for a load predicted to take `load_s`, twice that up to the whole recompute (a
        load chosen because it beats recompute is not cut off before it can arrive: the
        wait and then the recompute would cost more than either); `max_wait_s` before
        any forward was measured, and for a policy that loads every hit."""
        recompute = self._measured_recompute_s(tokens) if self.adaptive else None
        if recompute is None:
            return self.max_wait_s
        wait = self.wait_factor * recompute
        if load_s is not None:
            wait = max(wait, min(recompute, 2.0 * load_s))
        return min(self.max_wait_s, max(self.min_wait_s, wait))

    def observe_lookup(self, seconds: float) -> None:
        """How long a lookup took the store to answer (also one given up on meanwhile).
        Any thread: one append to a bounded deque."""
        self._lookup_seconds.append(seconds)

    @property
    def lookups_timed(self) -> int:
        """How many recent lookups' times are held (at most JUDGE_KEEP)."""
        return len(self._lookup_seconds)

    def lookup_s(self) -> float | None:
        """How long this store's lookups take: the lower median of the recent ones, None
        before JUDGE_MIN_SAMPLES (a cold first lookup alone does not stop lookups)."""
        recent = sorted(self._lookup_seconds)
        if len(recent) < JUDGE_MIN_SAMPLES:
            return None
        return recent[(len(recent) - 1) // 2]

    def lookup_patience_s(self, tokens: int, probe: bool = False) -> float | None:
        """How long a lookup of `tokens` is worth waiting for: a hit found after that
        loses to recomputing them, its load coming on top. Recompute less the predicted
        load (before loads are judged, less this store's lookup time, the least a load
        can take; recompute alone for a `probe`: `lookup_probe`), and 0 where this
        store's lookups take longer than that (the wait would almost always be lost);
        None (until the lookup's own timeout) before any forward was measured, or for a
        policy that loads every hit."""
        recompute = self._measured_recompute_s(tokens) if self.adaptive else None
        if recompute is None:
            return None
        patience = recompute
        answer = self.lookup_s()
        load = None if probe else self._load_of_tokens_s(tokens)
        if load is None and not probe:
            # No load judged yet: one takes at least the store's round trip, as long as
            # its lookups take. (Waiting the whole recompute for an answer that a load
            # then comes on top of lost every request of a store as slow to answer as
            # recompute, and none of them loaded, so the store was never judged.)
            load = answer
        if load is not None:
            patience = max(0.0, recompute - load)
        return 0.0 if answer is not None and answer > patience else patience

    def _load_of_tokens_s(self, tokens: int) -> float | None:
        """`load_s` of the bytes `tokens` tokens of chunks hold (as last loaded, else as
        last planned); None before either is known."""
        per_token = self._loaded_bytes_per_token or self._bytes_per_token
        return None if per_token is None else self.load_s(int(tokens * per_token))

    def worth_saving(self, tokens: int) -> bool:
        """Whether a prefix of `tokens` could be worth loading for an engine like this one:
        False only where its predicted load, the store's lookup included, takes over
        SAVE_MARGIN times recomputing it (a short prompt on a far store); True before a
        forward and the store were measured, and for a policy that loads every hit."""
        recompute = self._measured_recompute_s(tokens) if self.adaptive else None
        if recompute is None:
            return True
        answer, load = self.lookup_s(), self._load_of_tokens_s(tokens)
        if answer is None and load is None:
            return True
        return (answer or 0.0) + (load or 0.0) <= SAVE_MARGIN * recompute

    def lookup_probe(self) -> bool:
        """Whether the lookup starting now is a probe (every `probe_every`-th): sent even
        where its patience is 0, so that a store's lookup time is still measured (the
        others are then not sent), and waited for as long as recomputing its tokens takes
        where this store's lookups answer within that (its answer may then lead to a
        load, from which the store's load speed is learnt again)."""
        self._lookups += 1
        return bool(self.probe_every) and self._lookups % self.probe_every == 0

    def plan(self, hit_chunks: int, chunk_tokens: int, chunk_bytes: int) -> LoadPlan:
        if hit_chunks <= 0:
            return LoadPlan(0, 0.0, "miss")
        self._bytes_per_token = chunk_bytes / chunk_tokens
        tokens = hit_chunks * chunk_tokens
        recompute = self.recompute_s(tokens)
        load = self.load_s(hit_chunks * chunk_bytes)
        if not self.adaptive or recompute is None or load is None or load < recompute:
            return LoadPlan(hit_chunks, self.deadline_s(tokens, load), "load")
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
            "prefill_tokens_per_s_estimate": self.prefill.tokens_per_s,
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
