"""`python -m bench.recompute_grid`: TTFT of the load-vs-recompute choice against a far S3 store, over a grid of links.

For each link (`bench.s3shape`: a latency and a per-connection bandwidth in front of a
moto server on loopback) two fresh vLLM engines read the same bucket through it:

- "kvstash": the connector as shipped (the adaptive policy);
- "load": the same connector loading every hit (`adaptive: false`, lookups and loads
  waited for up to 30 s).

A third engine, started once, saves each round's prefix straight to moto (unshaped), so
the hit engines find it stored. Each round draws a fresh prefix of each `--prefixes`
length plus one token; the hit engines get it with a different last token: their TTFT
is "kvstash" and "load", and the "load" engine answers it once more with kvstash off for
that request (no lookup, no save): "recompute". With `--own-off` the kvstash engine
answers it once more with kvstash off too ("kvstash_off"): kvstash / kvstash_off is the
connector's own cost on one engine, apart from any difference between engine processes
(off by default: those full prefills would teach the kvstash engine its prefill cost,
which the grid means it to learn from its own choices). Each measured request follows a
short request on the saver engine, so none runs on caches its own engine's last request
left warm (`--no-interlude` drops it). The hit engines compute nothing but
1-token suffixes unless they decline a load, as a fresh engine serving a shared cache
does: the case where a policy that learns its prefill cost from suffix steps alone goes
wrong (docs/benchmarks/2026-11-29-vllm-lookup-bound.md). Reported per point: medians of
the counted rounds, and kvstash / min(recompute, load); and each TTFT's parts from vLLM's
engine-core times (`ttft_parts_s`: held before its first step, i.e. the lookup and any
load; the first step; the rest), which say where a gap to recompute comes from.

The engines are `bench.vllm` engine processes (`--engine-child`); this module imports
neither torch nor vllm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bench.vllm import (
    FIRST_TOKEN_ID,
    KV_CACHE_MIN_BYTES,
    KVSTASH_OFF,
    MOTO_BUCKET,
    BenchStore,
    Engine,
    StoreWatch,
    _build_model,
    _kv_bytes_per_token,
    _moto_endpoint,
)

WITHIN = 1.10  # the target: kvstash within 10 % of min(recompute, load)
TIMED = ("kvstash", "load", "recompute", "kvstash_off")  # each round's measured requests
LOAD_ALL = {"adaptive": False, "load_deadline_s": 30.0, "lookup_timeout_s": 30.0}


def _shaper(upstream: str, shape: str) -> tuple[subprocess.Popen, str]:
    """A `bench.s3shape` process in front of `upstream`; (process, its endpoint URL)."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.s3shape", "--upstream",
                             upstream.removeprefix("http://"), "--shape", shape],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline().split()
    if len(line) != 2 or line[0] != "listening":
        proc.kill()
        raise RuntimeError(f"bench.s3shape did not start: {line}")
    return proc, f"http://127.0.0.1:{line[1]}"


def _s3_url(endpoint: str, prefix: str) -> str:
    return (f"s3://{MOTO_BUCKET}/{prefix}?endpoint={endpoint}&region=us-east-1"
            "&access_key=bench&secret_key=bench")


# What the kvstash engine did for a request: its counters' growth over it.
DID = ("lookups_given_up", "lookup_timeouts", "hit_tokens", "declined_tokens", "load_timeouts",
       "failed_load_tokens", "prefill_tokens")


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in DID if after.get(k, 0) != before.get(k, 0)}


def _ttft(answer: dict[str, Any]) -> float:
    return float(answer["requests"][0]["ttft_s"])


def _parts(answer: dict[str, Any]) -> dict[str, float]:
    """A TTFT's parts (`bench.vllm`): held before the first step (lookup, load), the first
    step, and the rest (the front end's hand-offs to and from the engine core)."""
    row = answer["requests"][0]
    if "held_s" not in row:
        return {}
    held, step = float(row["held_s"]), float(row["first_step_s"])
    return {"held_s": held, "first_step_s": step, "other_s": float(row["ttft_s"]) - held - step}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    prefixes = [int(p) for p in args.prefixes.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="kvstash-grid-"))
    logs = args.keep_logs or scratch
    logs.mkdir(parents=True, exist_ok=True)
    model_dir, vocab, about = _build_model(args, scratch)
    max_len = max(prefixes) + 64
    spec = dict(model_dir=str(model_dir), dtype=args.dtype, max_model_len=max_len,
                block_size=0, chunk_tokens=args.chunk_tokens, prefix_caching=False,
                kv_cache_bytes=max(8 * max_len * _kv_bytes_per_token(model_dir, args.dtype),
                                   KV_CACHE_MIN_BYTES))
    prefix = f"grid-{uuid.uuid4().hex[:8]}"
    links: list[dict[str, Any]] = []
    with _moto_endpoint() as moto:
        store = BenchStore("s3", _s3_url(moto, prefix), "s3://", "moto on loopback")
        watch = StoreWatch([store])
        # The saver stands for another host that writes every prefix for the others to
        # read, whatever its own policy would think of loading it (`save_all`).
        saver = Engine("save", {**spec, "store": store.url, "connector": {"save_all": True}},
                       logs / "engine-save.log")
        saver.start()
        saver.wait_ready()
        try:
            for shape in args.shapes:
                shaper, endpoint = _shaper(moto, shape)
                url = _s3_url(endpoint, prefix)
                tag = shape.replace(",", "-")
                engines = {
                    "kvstash": Engine(f"kvstash-{tag}", {**spec, "store": url},
                                      logs / f"engine-kvstash-{tag}.log"),
                    "load": Engine(f"load-{tag}", {**spec, "store": url, "connector": LOAD_ALL},
                                   logs / f"engine-load-{tag}.log"),
                }
                started = time.monotonic()
                last: dict[str, dict[str, float]] = {}
                try:
                    for e in engines.values():
                        e.start()
                    for e in engines.values():
                        e.wait_ready()
                    runs: dict[int, dict[str, list[Any]]] = {
                        n: {"kvstash": [], "load": [], "recompute": [], "kvstash_off": [],
                            "kvstash_hit": [], "kvstash_did": [], "parts": []}
                        for n in prefixes}
                    for r in range(args.warmup + args.repeat):
                        for n in prefixes:
                            x = rng.integers(FIRST_TOKEN_ID, vocab, n)
                            a, b = rng.choice(np.arange(FIRST_TOKEN_ID, vocab), 2, replace=False)
                            saved, asked = np.append(x, a), np.append(x, b)
                            saver.generate([saved])
                            store.expect([saved], args.chunk_tokens)
                            watch.wait_saved(store)
                            order = ["kvstash", "load"] if r % 2 else ["load", "kvstash"]
                            got = {}
                            for name in order:
                                _interlude(saver, rng, vocab, args.interlude)
                                got[name] = engines[name].generate([asked])
                            _interlude(saver, rng, vocab, args.interlude)
                            got["recompute"] = engines["load"].generate([asked], KVSTASH_OFF)
                            if args.own_off:
                                _interlude(saver, rng, vocab, args.interlude)
                                got["kvstash_off"] = engines["kvstash"].generate([asked],
                                                                                 KVSTASH_OFF)
                            did = _delta(last.get("kvstash", {}), got["kvstash"]["kvstash"])
                            last = {"kvstash": got.get("kvstash_off", got["kvstash"])["kvstash"],
                                    "load": got["recompute"]["kvstash"]}
                            if r < args.warmup:
                                continue
                            for name in got:
                                runs[n][name].append(_ttft(got[name]))
                            runs[n]["kvstash_hit"].append(
                                got["kvstash"]["requests"][0]["cached_tokens"])
                            runs[n]["kvstash_did"].append(did)
                            runs[n]["parts"].append({name: _parts(got[name]) for name in got})
                finally:
                    for e in engines.values():
                        e.close_input()
                    for e in engines.values():
                        e.stop()
                    shaper.kill()
                    shaper.wait()
                points = []
                for n, rows in runs.items():
                    med = {k: statistics.median(rows[k]) for k in TIMED if rows[k]}
                    best = min(med["recompute"], med["load"])
                    parts = {name: {k: statistics.median(p[name][k] for p in rows["parts"])
                                    for k in ("held_s", "first_step_s", "other_s")}
                             for name in TIMED if all(p.get(name) for p in rows["parts"])}
                    points.append({
                        "shape": shape, "prefix_tokens": n, "ttft_parts_s": parts,
                        "ttft_s": med, "rounds_s": rows,
                        "kvstash_vs_best": med["kvstash"] / best,
                        **({"kvstash_vs_own_engine_off": med["kvstash"] / med["kvstash_off"]}
                           if "kvstash_off" in med else {}),
                        "best": "load" if med["load"] <= med["recompute"] else "recompute",
                        "kvstash_loaded_rounds": sum(1 for h in rows["kvstash_hit"] if h),
                        "within_target": med["kvstash"] / best <= WITHIN,
                    })
                    print(_line(points[-1]), flush=True)
                links.append({"shape": shape, "seconds": time.monotonic() - started,
                              "points": points, "engine_counters": last})
        finally:
            saver.stop()
            watch.close()
    return {"model": about, "chunk_tokens": args.chunk_tokens, "repeat": args.repeat,
            "warmup": args.warmup, "interlude": args.interlude, "own_off": args.own_off,
            "target": WITHIN, "links": links}


def _interlude(saver: Engine, rng: np.random.Generator, vocab: int, on: bool) -> None:
    """A short request on the saver engine (kvstash off), so that every measured request
    follows the same other engine's step. Without it "recompute" always came right after
    its own engine's request (its weights in the CPU's caches) and the kvstash engine's
    after another engine's, an order that could favour one side (it did not move the
    256-token gap: docs/benchmarks/2026-11-30-recompute-grid-256.md)."""
    if on:
        saver.generate([rng.integers(FIRST_TOKEN_ID, vocab, 16)], KVSTASH_OFF)


def _line(p: dict[str, Any]) -> str:
    t = p["ttft_s"]
    parts = p["ttft_parts_s"].get("kvstash")
    held = "" if not parts else (f"; kvstash held {parts['held_s'] * 1e3:.1f} ms, first step"
                                 f" {parts['first_step_s'] * 1e3:.1f}, other {parts['other_s'] * 1e3:.1f}")
    return (f"{p['shape']:>13} {p['prefix_tokens']:>5} tokens: kvstash {t['kvstash'] * 1e3:7.1f} ms"
            f"  recompute {t['recompute'] * 1e3:7.1f}  load {t['load'] * 1e3:7.1f}"
            f"  -> {p['kvstash_vs_best']:.2f}x of {p['best']}"
            f" (loaded {p['kvstash_loaded_rounds']}/{len(p['rounds_s']['kvstash'])}){held}"
            + (f"; {own:.2f}x of its engine with kvstash off"
               if (own := p.get("kvstash_vs_own_engine_off")) else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=[
        f"{lat},{bw}" for bw in ("90MBps", "1GBps") for lat in ("5ms", "30ms", "100ms")])
    p.add_argument("--prefixes", default="256,2048", help="cached tokens per prompt, comma-separated")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--model", default="llama-test")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--own-off", action="store_true",
                   help="also time each prompt on the kvstash engine with kvstash off")
    p.add_argument("--no-interlude", dest="interlude", action="store_false",
                   help="measure each request right after the last, whichever engine ran it")
    p.add_argument("--keep-logs", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
