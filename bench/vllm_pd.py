"""`kvstash bench vllm-pd`: prefill/decode disaggregation through a shared store, in real
vLLM engines, run as a P/D proxy runs it.

Per store, one prefill instance (`kv_role` kv_producer) whose step ends once its chunks
are stored (the default), a second one that replies without waiting for them
(`handoff_timeout_s: 0`, write-behind only), one decode instance (kv_consumer), and one
engine without kvstash. Each round sends a fresh prompt to a prefill instance and, the
moment it replies, to the decode instance; then another prompt the same way through the
other prefill instance; and a third to the engine without kvstash (the request computed
on one instance, the baseline). Every engine is its own process, all started at once.

Printed per store: the prefill's TTFT with and without the wait for its saves, the tokens
the decode instance loaded and its TTFT after each, their sum (the proxy's time to the
first decoded token, less its own hops), and the ratios against the write-behind prefill
and against no cache.

`--tp P:D` runs the prefill instances at tensor-parallel degree P and the decode instance
at D (e.g. 2:1, and the reverse 1:2): chunks hold every KV head whatever the degree
(docs/chunk-format.md), so the decode instance loads what a prefill of another degree
stored, each of its ranks reading its heads' share. The JSON then also has, per store,
the bytes on the store per chunk and the bytes the decode instance's ranks read per
loaded chunk, per rank and in all (vLLM sums the ranks' counters: bytes read over chunks
loaded is a rank's, as every rank loads every chunk).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.vllm import (
    FIRST_TOKEN_ID,
    KV_CACHE_MIN_BYTES,
    STORES,
    Engine,
    _build_model,
    _kv_bytes_per_token,
    _paired,
    _paired_ci,
    add_model_arguments,
    add_s3_arguments,
    open_stores,
    running,
)

ROLES = ("prefill", "prefill-behind", "decode")


def parse_tp(text: str) -> tuple[int, int]:
    """`--tp P:D`: the prefill's and the decode's tensor-parallel degrees."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tp {text!r}: expected P:D, e.g. 2:1") from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"--tp {text!r}: degrees are at least 1")
    return p, d


def _engines(args: argparse.Namespace, model_dir: Path, stores: list, logs: Path,
             max_model_len: int) -> dict[str, Engine]:
    need = 4 * max_model_len * _kv_bytes_per_token(model_dir, args.dtype)
    spec = dict(model_dir=str(model_dir), dtype=args.dtype, max_model_len=max_model_len,
                chunk_tokens=args.chunk_tokens, prefix_caching=True,
                kv_cache_bytes=max(need, KV_CACHE_MIN_BYTES),
                max_num_batched_tokens=args.max_num_batched_tokens)
    engines = {"no-cache": Engine("no-cache", {**spec, "prefix_caching": False, "store": None},
                                  logs / "engine-no-cache.log")}
    prefill_tp, decode_tp = args.tp
    for s in stores:
        for role, extra in (("prefill", {"kv_role": "kv_producer",
                                         "tensor_parallel_size": prefill_tp}),
                            ("prefill-behind", {"kv_role": "kv_producer",
                                                "tensor_parallel_size": prefill_tp,
                                                "connector": {"handoff_timeout_s": 0}}),
                            ("decode", {"kv_role": "kv_consumer",
                                        "tensor_parallel_size": decode_tp})):
            name = f"{s.scheme}-{role}"
            engines[name] = Engine(name, {**spec, "store": s.url, **extra},
                                   logs / f"engine-{name}.log")
    return engines


def _one(engine: Engine, prompt: np.ndarray) -> dict[str, Any]:
    reply = engine.generate([prompt])
    (answer,) = reply["requests"]
    return {**answer, "kvstash": reply.get("kvstash", {})}


def measure(args: argparse.Namespace, engines: dict[str, Engine], stores: list,
            vocab: int) -> dict[str, dict[str, list[float]]]:
    """Per store, per series, one value a counted round."""
    rng = np.random.default_rng(args.seed)
    out: dict[str, dict[str, list[float]]] = {s.scheme: {} for s in stores}
    for r in range(args.warmup + args.repeat):
        baseline = _one(engines["no-cache"],
                        rng.integers(FIRST_TOKEN_ID, vocab, args.cached_tokens + 1))
        for s in stores:
            got = {"no_cache_s": baseline["ttft_s"]}
            for prefill, tag in ((f"{s.scheme}-prefill", "handoff"),
                                 (f"{s.scheme}-prefill-behind", "behind")):
                prompt = rng.integers(FIRST_TOKEN_ID, vocab, args.cached_tokens + 1)
                first = _one(engines[prefill], prompt)
                before = engines[f"{s.scheme}-decode"].info.get("kvstash", {})
                then = _one(engines[f"{s.scheme}-decode"], prompt)  # at once, as a proxy
                engines[f"{s.scheme}-decode"].info["kvstash"] = then["kvstash"]
                loaded = (then["kvstash"].get("loaded_chunks", 0)
                          - before.get("loaded_chunks", 0))
                if loaded:  # both summed over the ranks, each of which loads every chunk
                    got[f"decode_{tag}_rank_read_bytes_per_chunk"] = (
                        then["kvstash"].get("hit_bytes", 0) - before.get("hit_bytes", 0)) / loaded
                got[f"prefill_{tag}_s"] = first["ttft_s"]
                got[f"decode_{tag}_s"] = then["ttft_s"]
                got[f"decode_{tag}_cached"] = then["cached_tokens"]
                got[f"pd_{tag}_s"] = first["ttft_s"] + then["ttft_s"]
                time.sleep(args.settle_s)  # the write-behind prefill's saves land between
            if r >= args.warmup:
                for k, v in got.items():
                    out[s.scheme].setdefault(k, []).append(v)
    return out


def summarize(series: dict[str, list[float]]) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in series.items()}

    def ratio(a: str, b: str) -> dict[str, Any]:
        lo, hi = _paired_ci(series[a], series[b])
        return {"median": _paired(series[a], series[b]), "ci": [lo, hi]}

    return {"medians": med,
            "prefill_wait": ratio("prefill_handoff_s", "prefill_behind_s"),
            "pd_vs_behind": ratio("pd_handoff_s", "pd_behind_s"),
            "pd_vs_no_cache": ratio("pd_handoff_s", "no_cache_s"),
            "decode_vs_no_cache": ratio("decode_handoff_s", "no_cache_s")}


def format_table(scheme: str, s: dict[str, Any]) -> str:
    m = s["medians"]

    def ms(k: str) -> str:
        return f"{m[k] * 1e3:.1f}"

    def x(r: dict[str, Any]) -> str:
        return f"{r['median']:.2f}x (CI {r['ci'][0]:.2f}-{r['ci'][1]:.2f})"

    rows = [
        ("prefill TTFT, step waits for its saves (default)", ms("prefill_handoff_s"),
         f"{x(s['prefill_wait'])} the write-behind prefill's"),
        ("prefill TTFT, write-behind (handoff_timeout_s 0)", ms("prefill_behind_s"), ""),
        ("decode TTFT after the waiting prefill", ms("decode_handoff_s"),
         f"{m['decode_handoff_cached']:.0f} tokens loaded; {x(s['decode_vs_no_cache'])} no cache"),
        ("decode TTFT after the write-behind prefill", ms("decode_behind_s"),
         f"{m['decode_behind_cached']:.0f} tokens loaded"),
        ("P/D, prefill + decode, waiting prefill", ms("pd_handoff_s"),
         f"{x(s['pd_vs_behind'])} write-behind's; {x(s['pd_vs_no_cache'])} no cache"),
        ("P/D, prefill + decode, write-behind prefill", ms("pd_behind_s"), ""),
        ("one engine, no cache (baseline)", ms("no_cache_s"), ""),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"store {scheme}://", f"| {'path'.ljust(width)} | TTFT ms (median) | ratio |",
             f"|{'-' * (width + 2)}|------------------|-------|"]
    lines += [f"| {a.ljust(width)} | {b.rjust(16)} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--cached-tokens", type=int, default=2048,
                   help="prompts are this plus one token (default 2048)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="kvstash chunk size (256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="vLLM's token budget per step: below the prompt's length the "
                        "prefill runs over several steps (chunked prefill), and the saves "
                        "of each step's chunks overlap the steps after it (default: vLLM's)")
    p.add_argument("--stores", default="file",
                   help=f"stores, comma-separated, of {', '.join(STORES)} (default file)")
    add_s3_arguments(p)
    p.add_argument("--repeat", type=int, default=10, help="counted rounds (default 10)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--settle-s", type=float, default=0.5,
                   help="pause after each prompt pair, for write-behind saves (default 0.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=parse_tp, default=(1, 1), metavar="P:D",
                   help="tensor-parallel degrees of the prefill and the decode instances "
                        "(default 1:1; e.g. 2:1, 1:2)")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")


def run(args: argparse.Namespace) -> int:
    from bench.report import write_json
    from bench.vllm import _vllm_version

    names = [n.strip() for n in args.stores.split(",") if n.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="kvstash-bench-vllm-pd-"))
    logs = scratch / "logs"
    logs.mkdir()
    model_dir, vocab, model_desc = _build_model(args, scratch)
    max_model_len = args.cached_tokens + 16
    with open_stores(names, scratch, args.s3_endpoint, args.s3_bucket) as (stores, notes):
        for note in notes:
            print(note, flush=True)
        engines = _engines(args, model_dir, stores, logs, max_model_len)
        print(f"starting {len(engines)} vLLM engines ({model_desc}) ...", flush=True)
        with running(engines):
            series = measure(args, engines, stores, vocab)
        on_store = {s.scheme: _store_bytes(s) for s in stores}
    budget = engines["no-cache"].info.get("max_num_batched_tokens")
    print(f"{_vllm_version()}, {model_desc}, {args.dtype}; prompts {args.cached_tokens}+1 "
          f"tokens, chunks of {args.chunk_tokens}, at most {budget} tokens a step; medians "
          f"of {args.repeat} rounds")
    result: dict[str, Any] = {"command": "vllm-pd", "args": vars(args), "model": model_desc,
                              "vllm": _vllm_version(), "max_num_batched_tokens": budget,
                              "stores": {}}
    result["tp"] = {"prefill": args.tp[0], "decode": args.tp[1]}
    for s in stores:
        summary = summarize(series[s.scheme])
        result["stores"][s.scheme] = {"series": series[s.scheme], **summary,
                                      **_read_bytes(series[s.scheme], args.tp[1]),
                                      **on_store[s.scheme]}
        print(format_table(s.scheme, summary))
        print(f"  decode at TP={args.tp[1]} after a prefill at TP={args.tp[0]}: "
              + ", ".join(f"{k} {v:,.0f}" for k, v in result["stores"][s.scheme].items()
                          if "bytes" in k or k == "store_chunks"))
    write_json(args.json, result)
    return 0


def _read_bytes(series: dict[str, list[float]], decode_tp: int) -> dict[str, float]:
    """The bytes the decode instance read per loaded chunk, per rank and in all."""
    read = series.get("decode_handoff_rank_read_bytes_per_chunk")
    if not read:
        return {}
    return {"decode_read_bytes_per_chunk_per_rank": statistics.median(read),
            "decode_read_bytes_per_chunk": statistics.median(read) * decode_tp}


def _store_bytes(store: Any) -> dict[str, float]:
    """Bytes on the store per chunk and the chunks stored (a local directory's files)."""
    out: dict[str, float] = {}
    root = Path(store.url.removeprefix("file://")) if store.url.startswith("file://") else None
    if root is not None and root.is_dir():
        sizes = [p.stat().st_size for p in root.rglob("*.kv")]
        if sizes:
            out["store_bytes_per_chunk"] = statistics.median(sizes)
            out["store_chunks"] = len(sizes)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvstash bench vllm-pd")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
