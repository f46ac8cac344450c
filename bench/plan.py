"""`kvstash plan`: cache capacity -> hit rate -> TTFT saved, and the break-even load bandwidth.

The operator's sizing tool. It simulates the trace under each eviction policy at a range
of capacities (the same decisions `bench trace` applies to a real store, without the
store), then prices the hits with a linear cost model: recomputing a token costs
1 / prefill_tokens_per_s, loading it costs bytes_per_token / bandwidth. Loading wins
only above the break-even bandwidth bytes_per_token x prefill_tokens_per_s; below it,
every hit makes TTFT worse and the right cache size is zero.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.policies import POLICIES, make_policy
from bench.report import table, write_json
from bench.trace import (
    BLOCK_TOKENS,
    best_achievable,
    break_even_bandwidth,
    kv_bytes_per_token,
    load_trace,
    prefill_tokens_per_s,
    simulate,
    ttft_saved_s,
    working_set,
)
from storage.options import format_size, parse_size

DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
GOOD_ENOUGH = 0.9  # "enough capacity" = 90 % of the best achievable hit rate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, metavar="FILE", help="JSONL trace with hash_ids")
    p.add_argument("--model", required=True, help="model preset or known model (KV bytes/token)")
    p.add_argument("--bandwidth", type=float, required=True, metavar="GB/s",
                   help="load bandwidth from the store to one engine, in GB/s")
    p.add_argument("--prefill-tps", type=float, default=None,
                   help="prefill tokens/s of the engine (else from --ttft-json or the model)")
    p.add_argument("--ttft-json", default=None, metavar="PATH",
                   help="a `bench ttft --json` result to read prefill_tokens_per_s from")
    p.add_argument("--policies", default="lru,s3fifo",
                   help=f"eviction policies, comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--capacities", default=None,
                   help="capacities as sizes, e.g. 10TiB,50TiB (default: fractions of the "
                        "working set)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="first N requests only")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the planning chart here")
    p.add_argument("--json", default=None, metavar="PATH", help="write machine-readable results")


def run(args: argparse.Namespace) -> int:
    requests = load_trace(args.trace, args.limit)
    if not requests:
        raise ValueError(f"{args.trace}: no requests")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bpt = kv_bytes_per_token(args.model)
    tps = prefill_tokens_per_s(args.model, args.prefill_tps, args.ttft_json)
    if tps is None:
        raise ValueError(f"no prefill speed for {args.model!r}: pass --prefill-tps or --ttft-json")
    if args.bandwidth <= 0:
        raise ValueError("--bandwidth must be positive (GB/s)")
    bandwidth = args.bandwidth * 1e9
    chunk_bytes = bpt * BLOCK_TOKENS
    ws = working_set(requests)
    if args.capacities:
        chunks = sorted({max(1, parse_size(s) // chunk_bytes)
                         for s in args.capacities.split(",") if s.strip()})
    else:
        chunks = sorted({max(1, math.ceil(f * ws)) for f in DEFAULT_FRACTIONS})
    best_hits, best_total = best_achievable(requests)
    total_tokens = sum(r.input_length for r in requests)
    prefill_s = total_tokens / tps

    rows = []
    for name in policies:
        for cap in chunks:
            c = simulate(requests, make_policy(name, cap))
            saved = ttft_saved_s(c.hit_tokens, bpt, tps, bandwidth)
            rows.append({
                "policy": name, "capacity_chunks": cap, "capacity_bytes": cap * chunk_bytes,
                "capacity_fraction": cap / ws, "block_hit_rate": c.block_hit_rate,
                "token_hit_rate": c.token_hit_rate,
                "ttft_saved_ms_per_request": 1000 * saved / c.requests,
                "ttft_saved_fraction": saved / prefill_s,
            })
    break_even = break_even_bandwidth(bpt, tps)
    print(f"{args.model}: {format_size(bpt)}/token, {format_size(chunk_bytes)} per "
          f"{BLOCK_TOKENS}-token chunk; prefill {tps:.0f} tokens/s; load {args.bandwidth:g} GB/s")
    print(f"trace: {len(requests)} requests, working set {format_size(ws * chunk_bytes)} "
          f"({ws} chunks), best achievable block hit rate {best_hits / best_total:.1%}")
    print(table(
        ["policy", "capacity", "of working set", "token hit %", "block hit %",
         "TTFT saved ms/req", "TTFT saved %"],
        [[r["policy"], format_size(r["capacity_bytes"]), f"{r['capacity_fraction']:.0%}",
          100 * r["token_hit_rate"], 100 * r["block_hit_rate"],
          r["ttft_saved_ms_per_request"], 100 * r["ttft_saved_fraction"]] for r in rows],
    ))
    print(f"break-even load bandwidth: {break_even / 1e9:.3g} GB/s "
          f"({format_size(bpt)}/token x {tps:.0f} tokens/s); below it, recompute wins")
    recommendation = None
    if bandwidth <= break_even:
        print(f"at {args.bandwidth:g} GB/s loading is slower than recomputing: no cache size helps")
    else:
        target = GOOD_ENOUGH * best_hits / best_total
        enough = [r for r in rows if r["block_hit_rate"] >= target]
        if enough:
            recommendation = min(enough, key=lambda r: (r["capacity_bytes"], -r["block_hit_rate"]))
            print(f"smallest capacity reaching {GOOD_ENOUGH:.0%} of the best hit rate: "
                  f"{format_size(recommendation['capacity_bytes'])} with "
                  f"{recommendation['policy']}")
    if args.plot:
        from bench.plots import plan_chart

        plan_chart(rows, Path(args.plot),
                   title=f"{Path(args.trace).name}, {args.model}, prefill {tps:.0f} tok/s",
                   break_even_gbps=break_even / 1e9, bandwidth_gbps=args.bandwidth)
        print(f"plot: {args.plot}")
    write_json(args.json, {
        "command": "plan", "trace": str(args.trace), "model": args.model,
        "kv_bytes_per_token": bpt, "prefill_tokens_per_s": tps,
        "bandwidth_gbps": args.bandwidth, "break_even_gbps": break_even / 1e9,
        "requests": len(requests), "working_set_chunks": ws,
        "working_set_bytes": ws * chunk_bytes,
        "best_achievable_block_hit_rate": best_hits / best_total,
        "recommendation": recommendation, "rows": rows,
    })
    return 0
