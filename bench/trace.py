"""`kvstash bench trace`: replay a block-hash request trace through a real store, per policy and capacity.

Trace format (Mooncake FAST'25, one JSON object per line): `timestamp` (ms), `input_length`
(tokens), `hash_ids` (one id per 512-token block; an id covers its block and every block
before it, so equal ids mean an equal prefix). Requests run one after another in arrival
order (timestamp, then file order), as fast as the store answers; arrival *times* are not
waited for, so the hit counts are deterministic.

One request, exactly as the connector would see it:

1. its block ids become store keys (`hashing.keys_from_block_hashes`, in a namespace of
   its own per run, so runs never see each other's chunks);
2. `store.prefix_len(keys)` gives the hit: the first missing block ends it;
3. the hit chunks are read back with `get` (timed: the store's read GB/s);
4. the eviction policy sees the request (hits, then admissions), and its decisions are
   applied to the store: victims are deleted, admitted chunks are written with `put`
   (timed: write GB/s). Payloads are synthetic, sized `bytes_per_token x 512 x scale`.

The store itself must not evict (give memory:// a large capacity): the policy owns
capacity. The replay checks every step: a store answer that disagrees with the policy's
residency is counted in `disagreements` (0 in a correct run).

Blocks of one request are offered to the policy deepest first and the root last, so a
shared prefix is always the most recently used part of a chain: evicting a chain's tail
keeps its prefix useful, evicting its root would strand every block after it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from bench.policies import POLICIES, EvictionPolicy, K, make_policy
from bench.presets import PRESETS
from bench.report import table, write_json
from hashing import Namespace, keys_from_block_hashes
from storage import encode_chunk, open_store
from storage.base import Store
from storage.options import StoreURL, format_size, parse_size

BLOCK_TOKENS = 512  # the Mooncake traces hash 512-token blocks
DEFAULT_FRACTIONS = (0.05, 0.1, 0.25, 0.5)
DEFAULT_STORE = "memory://?capacity=1TiB"

# KV bytes per token of real models without a preset, bf16: 2 (K and V) x layers x
# kv_heads x head_dim x 2 bytes, from each model's config.json; DeepSeek-V3 stores one MLA
# latent (512 + 64 rope dims) per layer.
MODEL_KV_BYTES_PER_TOKEN = {
    "llama-3-8b": 2 * 32 * 8 * 128 * 2,
    "qwen2.5-7b": 2 * 28 * 4 * 128 * 2,
    "llama-3-70b": 2 * 80 * 8 * 128 * 2,
    "deepseek-v3": 61 * (512 + 64) * 2,
}
# Prefill tokens/s measured on this project's 2-core CPU machine (shared/notes/probe.md:
# the llama-1.5b shape, bf16, 4096 tokens in 18.6 s). Pass --prefill-tps or --ttft-json
# for any other model or hardware.
MEASURED_PREFILL_TPS = {"llama-1.5b": 220.0}


@dataclass(frozen=True)
class TraceRequest:
    timestamp: float
    input_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Requests in arrival order (stable by timestamp); the first `limit` of them."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                req = TraceRequest(
                    float(r.get("timestamp", 0)), int(r["input_length"]), tuple(r["hash_ids"])
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trace request: {exc}") from exc
            requests.append(req)
    requests.sort(key=lambda r: r.timestamp)
    return requests[:limit] if limit is not None else requests


def working_set(requests: Iterable[TraceRequest]) -> int:
    """Distinct blocks in the trace: the capacity at which nothing is ever evicted."""
    return len({h for r in requests for h in r.hash_ids})


def hit_tokens(request: TraceRequest, hit_blocks: int) -> int:
    """Tokens covered by the first `hit_blocks` blocks (the last block may be partial)."""
    return min(hit_blocks * BLOCK_TOKENS, request.input_length)


def best_achievable(requests: Iterable[TraceRequest]) -> tuple[int, int]:
    """(hit blocks, total blocks) with unlimited capacity.

    A block is a hit when its id appeared in any earlier request and so did every block
    before it in this request: prefix-contiguous, the first never-seen block ends the hit.
    """
    seen: set[int] = set()
    hits = total = 0
    for r in requests:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in seen:
            n += 1
        hits += n
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    return hits, total


def admit_request(policy: EvictionPolicy[K], keys: Sequence[K]) -> tuple[list[K], list[K]]:
    """Show one request to the policy; returns (keys to write, resident keys to delete).

    Resident keys are hits (even past a gap: this request rewrites the gap, so they
    become reachable again); missing keys are offered for admission. A key admitted and
    evicted within the same request is neither written nor deleted.
    """
    admitted: dict[K, None] = {}
    victims: list[K] = []
    for key in reversed(keys):
        if key in policy:
            policy.hit(key)
            continue
        admitted[key] = None
        for gone in policy.insert(key):
            if gone in admitted:
                del admitted[gone]
            else:
                victims.append(gone)
    return list(admitted), victims


@dataclass
class Counts:
    """Hit counts of one replay or simulation."""

    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    writes: int = 0
    evictions: int = 0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def add(self, request: TraceRequest, hit: int, writes: int, evictions: int) -> None:
        self.requests += 1
        self.blocks += len(request.hash_ids)
        self.hit_blocks += hit
        self.tokens += request.input_length
        self.hit_tokens += hit_tokens(request, hit)
        self.writes += writes
        self.evictions += evictions


def simulate(requests: Iterable[TraceRequest], policy: EvictionPolicy[int]) -> Counts:
    """The replay's decisions without a store (block ids are the keys): the planner's model."""
    counts = Counts()
    for r in requests:
        ids = r.hash_ids
        hit = 0
        while hit < len(ids) and ids[hit] in policy:
            hit += 1
        writes, victims = admit_request(policy, ids)
        counts.add(r, hit, len(writes), len(victims))
    return counts


# -- the cost model: bytes per token, prefill speed, TTFT saved ----------------------------


def kv_bytes_per_token(model: str) -> int:
    """KV bytes per token (bf16) of a random-weight preset (bench.presets) or a real model."""
    if model in PRESETS:
        return PRESETS[model].bytes_per_token("bfloat16")
    if model in MODEL_KV_BYTES_PER_TOKEN:
        return MODEL_KV_BYTES_PER_TOKEN[model]
    known = sorted(MODEL_KV_BYTES_PER_TOKEN) + sorted(PRESETS)
    raise ValueError(f"unknown model {model!r} (known: {', '.join(known)})")


def _find_number(doc: Any, name: str) -> float | None:
    values: Iterable[Any]
    if isinstance(doc, dict):
        if isinstance(doc.get(name), int | float):
            return float(doc[name])
        values = doc.values()
    elif isinstance(doc, list):
        values = doc
    else:
        return None
    for v in values:
        found = _find_number(v, name)
        if found is not None:
            return found
    return None


def prefill_tokens_per_s(model: str, tps: float | None, ttft_json: str | None) -> float | None:
    """Prefill speed: `--prefill-tps`, else from a `bench ttft --json` result (a workload
    run's `prefill_tokens_per_s`, or a single run's prompt_tokens / full_prefill_s), else
    the value measured here for the model, else None (no TTFT estimate)."""
    if tps is not None:
        return tps
    if ttft_json:
        doc = json.loads(Path(ttft_json).read_text())
        found = _find_number(doc, "prefill_tokens_per_s")
        if found is None and isinstance(doc, dict) and doc.get("full_prefill_s"):
            found = doc["prompt_tokens"] / doc["full_prefill_s"]
        if found is None:
            raise ValueError(f"{ttft_json}: no prefill speed in this bench ttft result")
        return float(found)
    return MEASURED_PREFILL_TPS.get(model)


def ttft_saved_s(
    hit_tokens: int, bytes_per_token: int, prefill_tps: float, load_bytes_per_s: float
) -> float:
    """Prefill seconds saved by loading `hit_tokens` instead of recomputing them.

    Linear model: recomputing costs 1/prefill_tps per token, loading costs bytes_per_token
    / load bandwidth; negative when the load is slower than the recompute.
    """
    return hit_tokens / prefill_tps - hit_tokens * bytes_per_token / load_bytes_per_s


def break_even_bandwidth(bytes_per_token: int, prefill_tps: float) -> float:
    """Load bytes/s at which loading a token costs as much as recomputing it."""
    return bytes_per_token * prefill_tps


# -- the replay through a real store ----------------------------------------------------


@dataclass
class ReplayResult:
    policy: str
    capacity_chunks: int | None
    counts: Counts
    bytes_read: int = 0
    bytes_written: int = 0
    lookup_s: float = 0.0
    read_s: float = 0.0
    write_s: float = 0.0
    wall_s: float = 0.0
    disagreements: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_s / 1e9 if self.read_s else 0.0

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_s / 1e9 if self.write_s else 0.0


async def _gather_limited(calls: Sequence[Callable[[], Any]], limit: int) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Any]) -> Any:
        async with sem:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls))


async def replay(
    requests: Sequence[TraceRequest],
    store: Store,
    policy: EvictionPolicy[str],
    payload_bytes: int,
    *,
    concurrency: int = 8,
    progress: Callable[[int], None] | None = None,
    cleanup: bool = True,
) -> ReplayResult:
    """Replay `requests` through `store` under `policy`; see the module docstring."""
    ns = Namespace(
        model="kvstash/trace-replay", dtype="synthetic", layout=f"payload{payload_bytes}",
        chunk_tokens=BLOCK_TOKENS, salt=uuid.uuid4().hex,
    )
    payload = np.random.default_rng(0).integers(0, 256, payload_bytes, dtype=np.uint8).tobytes()
    tokens = np.zeros(BLOCK_TOKENS, dtype="<u4")  # synthetic: the key alone tells chunks apart
    result = ReplayResult(policy.name, policy.capacity or None, Counts())
    stored: set[str] = set()
    started = time.perf_counter()
    for r in requests:
        keys = keys_from_block_hashes(r.hash_ids, ns)
        t0 = time.perf_counter()
        hit = await store.prefix_len(keys)
        t1 = time.perf_counter()
        blobs = await _gather_limited([functools.partial(store.get, k) for k in keys[:hit]], concurrency)
        t2 = time.perf_counter()
        expected = 0
        while expected < len(keys) and keys[expected] in policy:
            expected += 1
        result.disagreements += (expected != hit) + sum(b is None for b in blobs)
        result.bytes_read += sum(len(b) for b in blobs if b is not None)
        writes, victims = admit_request(policy, keys)
        t3 = time.perf_counter()
        for key in victims:
            await store.delete(key)
            stored.discard(key)
        blobs_out = [encode_chunk(k, tokens, payload) for k in writes]
        wrote = await _gather_limited(
            [functools.partial(store.put, k, b) for k, b in zip(writes, blobs_out, strict=True)],
            concurrency,
        )
        t4 = time.perf_counter()
        result.disagreements += sum(not w for w in wrote)
        result.bytes_written += sum(len(b) for b in blobs_out)
        stored.update(writes)
        result.counts.add(r, hit, len(writes), len(victims))
        result.lookup_s += t1 - t0
        result.read_s += t2 - t1
        result.write_s += t4 - t3
        if progress is not None:
            progress(1)
    result.wall_s = time.perf_counter() - started
    result.stats = store.stats()
    if len(stored) != len(policy):
        result.disagreements += 1
    if cleanup:
        await _gather_limited([functools.partial(store.delete, k) for k in stored], concurrency)
    return result


# -- the command --------------------------------------------------------------------------


def parse_fraction(text: str) -> float:
    """`"1/4096"` or `"0.001"` -> a float in (0, 1]."""
    try:
        value = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError) as exc:
        raise argparse.ArgumentTypeError(f"not a fraction: {text!r} (try 1/4096)") from exc
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"scale must be in (0, 1], got {text}")
    return value


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, metavar="FILE", help="JSONL trace with hash_ids")
    p.add_argument("--store", default=DEFAULT_STORE, metavar="URL",
                   help=f"store to replay through; it must not evict (default {DEFAULT_STORE})")
    p.add_argument("--model", default="llama-3-8b",
                   help="model whose KV bytes per token size the chunks (default llama-3-8b)")
    p.add_argument("--scale", type=parse_fraction, default=Fraction(1, 4096),
                   help="payload scale so the working set fits this machine (default 1/4096)")
    p.add_argument("--policies", default="lru,s3fifo",
                   help=f"eviction policies, comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--fractions", type=_floats, default=list(DEFAULT_FRACTIONS),
                   help="capacities as fractions of the working set (default 0.05,0.1,0.25,0.5)")
    p.add_argument("--capacities", default=None,
                   help="capacities as real (unscaled) sizes, e.g. 1TiB,4TiB; replaces --fractions")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="first N requests only")
    p.add_argument("--concurrency", type=int, default=8, help="store calls in flight (default 8)")
    p.add_argument("--prefill-tps", type=float, default=None,
                   help="prefill tokens/s of the engine (else from --ttft-json or the model)")
    p.add_argument("--ttft-json", default=None, metavar="PATH",
                   help="a `bench ttft --json` result to read prefill_tokens_per_s from")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GB/s",
                   help="load bandwidth for the TTFT estimate (default: the replay's read GB/s)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the hit-rate curve here")
    p.add_argument("--json", default=None, metavar="PATH", help="write machine-readable results")


def _capacities(args: argparse.Namespace, ws_chunks: int, chunk_bytes: int) -> list[int]:
    if args.capacities:
        sizes = [parse_size(s) for s in args.capacities.split(",") if s.strip()]
        return sorted({max(1, s // chunk_bytes) for s in sizes})
    return sorted({max(1, math.ceil(f * ws_chunks)) for f in args.fractions})


async def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    requests = load_trace(args.trace, args.limit)
    if not requests:
        raise ValueError(f"{args.trace}: no requests")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in policies:
        make_policy(name, 1)  # unknown names fail before any work
    bpt = kv_bytes_per_token(args.model)
    chunk_bytes = bpt * BLOCK_TOKENS
    payload_bytes = max(1, round(chunk_bytes * float(args.scale)))
    ws = working_set(requests)
    best_hits, best_total = best_achievable(requests)
    tps = prefill_tokens_per_s(args.model, args.prefill_tps, args.ttft_json)
    shown = StoreURL(args.store).redacted()  # URLs may carry credentials
    print(f"trace {args.trace}: {len(requests)} requests, {best_total} blocks, working set "
          f"{ws} chunks = {format_size(ws * chunk_bytes)} of {args.model} KV "
          f"({format_size(chunk_bytes)} per 512-token chunk); replay payload "
          f"{format_size(payload_bytes)} (scale {Fraction(args.scale).limit_denominator(1 << 24)}) "
          f"through {shown}")

    runs = [("unlimited", None)] + [(p, c) for c in _capacities(args, ws, chunk_bytes)
                                    for p in policies]
    results: list[ReplayResult] = []
    store = open_store(args.store)
    try:
        for name, cap in runs:
            label = f"{name} {cap if cap else 'all'}"
            with tqdm(total=len(requests), desc=label, unit="req", leave=False,
                      disable=None) as bar:
                results.append(await replay(
                    requests, store, make_policy(name, cap), payload_bytes,
                    concurrency=args.concurrency, progress=bar.update,
                ))
    finally:
        await store.close()

    unlimited = results[0]
    # One load bandwidth for every row, so the TTFT column compares capacities, not noise.
    read_s = sum(r.read_s for r in results)
    measured_gbps = sum(r.bytes_read for r in results) / read_s / 1e9 if read_s else 0.0
    load_bw = (args.bandwidth or measured_gbps) * 1e9
    rows, out_runs = [], []
    for res in results:
        c = res.counts
        saved = (ttft_saved_s(c.hit_tokens, bpt, tps, load_bw) / c.requests
                 if tps and load_bw else None)
        cap = res.capacity_chunks
        rows.append([
            res.policy, f"{cap / ws:.0%}" if cap else "all",
            format_size((cap or ws) * chunk_bytes), 100 * c.block_hit_rate,
            100 * c.token_hit_rate, res.read_gbps, res.write_gbps,
            None if saved is None else 1000 * saved, res.disagreements,
        ])
        out_runs.append({
            "policy": res.policy, "capacity_chunks": cap,
            "capacity_fraction": cap / ws if cap else None,
            "capacity_bytes": (cap or ws) * chunk_bytes, **asdict(c),
            "block_hit_rate": c.block_hit_rate, "token_hit_rate": c.token_hit_rate,
            "bytes_read": res.bytes_read, "bytes_written": res.bytes_written,
            "read_gbps": res.read_gbps, "write_gbps": res.write_gbps,
            "lookup_s": res.lookup_s, "read_s": res.read_s, "write_s": res.write_s,
            "wall_s": res.wall_s, "ttft_saved_ms_per_request": None if saved is None else 1000 * saved,
            "disagreements": res.disagreements,
        })
    print(table(["policy", "capacity", "real size", "block hit %", "token hit %", "read GB/s",
                 "write GB/s", "TTFT saved ms/req", "disagreements"], rows))
    matches = unlimited.counts.hit_blocks == best_hits
    print(f"best achievable (independent count): {best_hits}/{best_total} blocks = "
          f"{best_hits / best_total:.2%}; unlimited replay: {unlimited.counts.hit_blocks} "
          f"-> {'equal' if matches else 'MISMATCH'}")
    if tps:
        print(f"TTFT estimate: prefill {tps:.0f} tokens/s, load {load_bw / 1e9:.3g} GB/s "
              f"({'--bandwidth' if args.bandwidth else 'measured over the replay'}), "
              f"break-even {break_even_bandwidth(bpt, tps) / 1e9:.3g} GB/s")
    if args.plot:
        from bench.plots import hit_rate_curve

        hit_rate_curve(
            out_runs, Path(args.plot),
            title=f"{Path(args.trace).name}: {len(requests)} requests through {shown}",
        )
        print(f"plot: {args.plot}")
    write_json(args.json, {
        "command": "bench trace", "trace": str(args.trace), "store": shown,
        "model": args.model, "kv_bytes_per_token": bpt, "chunk_bytes": chunk_bytes,
        "scale": float(args.scale), "payload_bytes": payload_bytes, "requests": len(requests),
        "working_set_chunks": ws, "best_achievable_hit_blocks": best_hits,
        "total_blocks": best_total, "best_achievable_block_hit_rate": best_hits / best_total,
        "unlimited_matches_best": matches, "prefill_tokens_per_s": tps,
        "load_gbps": load_bw / 1e9, "read_gbps_measured": measured_gbps, "runs": out_runs,
    })
    disagreements = sum(r.disagreements for r in results)
    return 0 if matches and not disagreements else 1
