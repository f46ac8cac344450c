"""`kvstash bench vllm-chat`: multi-turn chats through real vLLM engines, the replies the
engines generate sent back in the next turn, each turn to the other of two engines.

Every chat starts with one system prompt shared by all users and a question; the engine
generates a reply (`--reply-tokens`, greedy, to the end); the next turn sends the whole
conversation so far, the reply included, and a new question. Users take turns round by
round. Side by side, each configuration holding its own conversations:

- no cache: one engine, no connector, vLLM's prefix caching off (the baseline);
- vLLM prefix cache: one engine with vLLM's own prefix caching, every turn of every user
  (sticky routing, the ideal a single engine reaches);
- kvstash, replies saved: two engines (vLLM's prefix caching on in both) on one store
  (`--store`: a file:// directory, a kvserver over one, or moto's S3 on loopback) with
  `save_decode` true (the default), turn t of a chat on engine t mod 2, as a router that
  does not keep a chat on one engine sends it: the last reply was generated on the other
  engine;
- kvstash, prompts only: the same pair with `save_decode` false, on the same store under
  another `salt` (a key space of its own);
- vLLM prefix cache + kvstash: one engine with both, every turn of every user (sticky), on
  the same store under a third `salt`: what kvstash costs a request vLLM's own prefix cache
  already serves (its lookup, its saves), against "vLLM prefix cache".

Printed: per configuration, the median TTFT of the turns after the first, the prompt
tokens they found cached (vLLM's `num_cached_tokens`), and ratios to no cache and to
vLLM's prefix cache, paired by (user, turn); and the pair that saves replies against the
pair that saves prompts only, with the median time a reply takes to decode after its first
token in each (what saving the reply's chunks costs decode).
"""

from __future__ import annotations

import argparse
import random
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

CONFIGS = {  # name -> (label, engines)
    "no-cache": ("no cache", ["no-cache"]),
    "prefix-cache": ("vLLM prefix cache, one engine (sticky)", ["prefix-cache"]),
    "replies": ("kvstash, replies saved, 2 engines", ["replies-a", "replies-b"]),
    "prompts": ("kvstash, prompts only, 2 engines", ["prompts-a", "prompts-b"]),
    "sticky": ("vLLM prefix cache + kvstash, one engine (sticky)", ["sticky"]),
}


def _engines(args: argparse.Namespace, model_dir: Path, store: str | list[str], logs: Path,
             max_model_len: int) -> dict[str, Engine]:
    need = 4 * max_model_len * _kv_bytes_per_token(model_dir, args.dtype) * args.users
    spec = dict(model_dir=str(model_dir), dtype=args.dtype, max_model_len=max_model_len,
                chunk_tokens=args.chunk_tokens, prefix_caching=True,
                kv_cache_bytes=max(need, KV_CACHE_MIN_BYTES))
    specs = {"no-cache": {**spec, "prefix_caching": False, "store": None},
             "prefix-cache": {**spec, "store": None}}
    for name, save_decode in (("replies", True), ("prompts", False)):
        for side in ("a", "b"):
            specs[f"{name}-{side}"] = {**spec, "store": store, "connector": {
                "save_decode": save_decode, "salt": f"bench-chat-{name}"}}
    specs["sticky"] = {**spec, "store": store, "connector": {"salt": "bench-chat-sticky"}}
    return {n: Engine(n, s, logs / f"engine-{n}.log") for n, s in specs.items()}


def measure(args: argparse.Namespace, engines: dict[str, Engine], vocab: int
            ) -> dict[str, list[dict[str, Any]]]:
    """Per configuration, one record per request: user, turn, prompt tokens, TTFT, the
    reply's decode after its first token, cached tokens."""
    rng = np.random.default_rng(args.seed)
    order = random.Random(args.seed)
    system = rng.integers(FIRST_TOKEN_ID, vocab, args.system_tokens)
    questions = [[rng.integers(FIRST_TOKEN_ID, vocab, args.question_tokens)
                  for _ in range(args.turns)] for _ in range(args.users)]
    history = {c: [system.copy() for _ in range(args.users)] for c in CONFIGS}
    out: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for turn in range(args.turns):
        for user in range(args.users):
            for config in order.sample(list(CONFIGS), len(CONFIGS)):
                names = CONFIGS[config][1]
                engine = engines[names[turn % len(names)]]
                prompt = np.concatenate([history[config][user], questions[user][turn]])
                got = engine.generate([prompt], max_tokens=args.reply_tokens)
                (answer,) = got["requests"]
                history[config][user] = np.concatenate(
                    [prompt, np.asarray(answer["token_ids"], dtype=prompt.dtype)])
                out[config].append({"user": user, "turn": turn, "prompt_tokens": len(prompt),
                                    "ttft_s": answer["ttft_s"],
                                    "decode_s": got["wall_s"] - answer["ttft_s"],
                                    "cached_tokens": answer["cached_tokens"]})
                if len(names) > 1:
                    time.sleep(args.settle_s)  # the reply's last chunk is written behind
    return out


def summarize(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    later = {c: [r for r in rs if r["turn"] > 0] for c, rs in records.items()}
    ttft = {c: [r["ttft_s"] for r in rs] for c, rs in later.items()}
    out: dict[str, Any] = {}
    for config, rs in later.items():
        prompt = sum(r["prompt_tokens"] for r in rs)
        cached = sum(r["cached_tokens"] for r in rs)
        row: dict[str, Any] = {
            "label": CONFIGS[config][0], "requests": len(rs),
            "ttft_s": statistics.median(ttft[config]),
            # the reply's decode after its first token, every turn's (first turns too)
            "decode_s": statistics.median(r["decode_s"] for r in records[config]),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_fraction": cached / prompt if prompt else 0.0,
        }
        for base in ("no-cache", "prefix-cache", "prompts"):
            if config != base and (base != "prompts" or config == "replies"):
                row[f"ttft_vs_{base}"] = _paired(ttft[config], ttft[base])
                row[f"ttft_vs_{base}_ci"] = list(_paired_ci(ttft[config], ttft[base]))
        out[config] = row
    return out


def format_table(summary: dict[str, Any]) -> str:
    width = max(len(r["label"]) for r in summary.values())
    lines = [f"| {'configuration'.ljust(width)} | TTFT ms | cached of prompt | vs no cache "
             f"| vs vLLM prefix cache |",
             f"|{'-' * (width + 2)}|---------|------------------|-------------|"
             "----------------------|"]
    for r in summary.values():
        def x(base: str, r=r) -> str:
            if f"ttft_vs_{base}" not in r:
                return "-"
            lo, hi = r[f"ttft_vs_{base}_ci"]
            return f"{r[f'ttft_vs_{base}']:.2f}x ({lo:.2f}-{hi:.2f})"
        lines.append(f"| {r['label'].ljust(width)} | {r['ttft_s'] * 1e3:7.1f} | "
                     f"{r['cached_tokens']:>7}/{r['prompt_tokens']:<7} {r['cached_fraction']:4.0%}"
                     f" | {x('no-cache')} | {x('prefix-cache')} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--users", type=int, default=3, help="chats, side by side (default 3)")
    p.add_argument("--turns", type=int, default=4, help="turns per chat (default 4)")
    p.add_argument("--system-tokens", type=int, default=512,
                   help="system prompt shared by every chat (default 512)")
    p.add_argument("--question-tokens", type=int, default=64,
                   help="tokens of each turn's new question (default 64)")
    p.add_argument("--reply-tokens", type=int, default=256,
                   help="tokens each reply generates (default 256)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="kvstash chunk size (256)")
    p.add_argument("--store", default="file", choices=STORES,
                   help="the kvstash engines' store (default file)")
    add_s3_arguments(p)
    p.add_argument("--settle-s", type=float, default=0.2,
                   help="pause after each kvstash request, for its write-behind saves")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")


def run(args: argparse.Namespace) -> int:
    from bench.report import write_json
    from bench.vllm import _vllm_version

    scratch = Path(tempfile.mkdtemp(prefix="kvstash-bench-vllm-chat-"))
    logs = scratch / "logs"
    logs.mkdir()
    model_dir, vocab, model_desc = _build_model(args, scratch)
    max_model_len = args.system_tokens + args.turns * (args.question_tokens
                                                       + args.reply_tokens) + 16
    with open_stores([args.store], scratch, args.s3_endpoint, args.s3_bucket) as (stores, notes):
        if not stores:
            raise SystemExit("; ".join(notes))
        engines = _engines(args, model_dir, stores[0].url, logs, max_model_len)
        print(f"starting {len(engines)} vLLM engines ({model_desc}; kvstash on "
              f"{stores[0].label} {stores[0].about}) ...", flush=True)
        with running(engines):
            records = measure(args, engines, vocab)
    summary = summarize(records)
    print(f"{_vllm_version()}, {model_desc}, {args.dtype}, {stores[0].label}; "
          f"{args.users} chats of {args.turns} "
          f"turns: {args.system_tokens}-token system prompt, {args.question_tokens}-token "
          f"questions, {args.reply_tokens}-token replies, chunks of {args.chunk_tokens}; "
          f"turns 2-{args.turns}, medians")
    print(format_table(summary))
    r, p = summary["replies"], summary["prompts"]
    lo, hi = r["ttft_vs_prompts_ci"]
    print(f"replies saved against prompts only: TTFT {r['ttft_vs_prompts']:.2f}x "
          f"(CI {lo:.2f}-{hi:.2f}), cached {r['cached_tokens']} against "
          f"{p['cached_tokens']} prompt tokens; a reply's decode {r['decode_s']:.2f} s "
          f"against {p['decode_s']:.2f} s ({r['decode_s'] / p['decode_s']:.2f}x)")
    k = summary["sticky"]
    lo, hi = k["ttft_vs_prefix-cache_ci"]
    print(f"one engine, kvstash on against off: TTFT {k['ttft_vs_prefix-cache']:.2f}x "
          f"(CI {lo:.2f}-{hi:.2f}) of vLLM's prefix cache alone")
    write_json(args.json, {"command": "vllm-chat", "args": vars(args), "model": model_desc,
                           "store": f"{stores[0].label} {stores[0].about}",
                           "vllm": _vllm_version(), "summary": summary, "records": records})
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvstash bench vllm-chat")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
