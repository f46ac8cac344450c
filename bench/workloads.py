"""`kvstash bench ttft --workload multi-turn|long-doc|rag`: realistic prompt streams, cold vs cached TTFT.

Generators (pure, deterministic for a seed, no torch) produce the prompts in arrival order:

- multi-turn: N users x R rounds of chat. Every prompt starts with one shared system
  prompt; round r of a user resends the whole conversation so far (its earlier questions
  and the model's answers) plus a new question. Users take turns round by round.
- long-doc: D long documents, each asked Q questions; the prompt is the document then
  the question, and questions about different documents are interleaved.
- rag: a corpus of passages; each question retrieves its top-k passages (popular
  passages are retrieved more often) in its own relevance order, after a shared
  instruction. Only prompts whose first passages come in the same order share more than
  the instruction: partial reuse.

The runner sends each prompt twice, back to back: once straight to the model (cold: no
cache) and once through `connector.hf.CachedPrefill` over the store (warm: the cache as
it stands after the prompts before it). TTFT is the prefill call's wall time (the first
token is the argmax of the last position's logits). Saves are flushed after each cached
prompt, outside the timed region, as an engine's decode time would cover them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WORKLOADS = ("multi-turn", "long-doc", "rag")
FIRST_TOKEN_ID = 16  # leave the low ids (special tokens in real vocabularies) alone


@dataclass(frozen=True)
class Prompt:
    """One request: who sent it (user, document or question id) and its token ids."""

    source: str
    token_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.token_ids)


class _Text:
    """Random token segments from a seeded generator."""

    def __init__(self, seed: int, vocab_size: int):
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size

    def segment(self, n: int) -> np.ndarray:
        return self.rng.integers(FIRST_TOKEN_ID, self.vocab_size, n, dtype=np.int64)


def multi_turn(
    users: int = 4, rounds: int = 4, system_tokens: int = 512, question_tokens: int = 64,
    answer_tokens: int = 128, *, vocab_size: int = 32000, seed: int = 0,
) -> list[Prompt]:
    """Round r of user u: system prompt + (question, answer) of rounds < r + new question."""
    text = _Text(seed, vocab_size)
    system = text.segment(system_tokens)
    history = {u: system for u in range(users)}
    prompts = []
    for r in range(rounds):
        for u in range(users):
            prompt = np.concatenate([history[u], text.segment(question_tokens)])
            prompts.append(Prompt(f"user{u}/round{r}", prompt))
            history[u] = np.concatenate([prompt, text.segment(answer_tokens)])
    return prompts


def long_doc(
    docs: int = 3, questions: int = 3, doc_tokens: int = 2048, question_tokens: int = 64,
    *, vocab_size: int = 32000, seed: int = 0,
) -> list[Prompt]:
    """Document + question, Q questions per document, in a shuffled interleaved order."""
    text = _Text(seed, vocab_size)
    bodies = [text.segment(doc_tokens) for _ in range(docs)]
    order = [d for d in range(docs) for _ in range(questions)]
    text.rng.shuffle(order)
    asked = dict.fromkeys(range(docs), 0)
    prompts = []
    for d in order:
        prompts.append(Prompt(f"doc{d}/q{asked[d]}",
                              np.concatenate([bodies[d], text.segment(question_tokens)])))
        asked[d] += 1
    return prompts


def rag(
    questions: int = 12, passages: int = 12, top_k: int = 4, passage_tokens: int = 256,
    instruction_tokens: int = 128, question_tokens: int = 64, *, vocab_size: int = 32000,
    seed: int = 0,
) -> list[Prompt]:
    """Instruction + top-k passages in relevance order + question.

    Retrieval draws passages with Zipf-like popularity (weight 1/rank), so a few passages
    recur across questions, but each question ranks its own draw: the same passages in a
    different order share only the instruction.
    """
    if top_k > passages:
        raise ValueError(f"top_k={top_k} exceeds the corpus of {passages} passages")
    text = _Text(seed, vocab_size)
    instruction = text.segment(instruction_tokens)
    corpus = [text.segment(passage_tokens) for _ in range(passages)]
    weights = 1.0 / np.arange(1, passages + 1)
    weights /= weights.sum()
    prompts = []
    for q in range(questions):
        picked = text.rng.choice(passages, size=top_k, replace=False, p=weights)
        parts = [instruction, *(corpus[p] for p in picked), text.segment(question_tokens)]
        prompts.append(Prompt(f"q{q}:" + ",".join(map(str, picked)), np.concatenate(parts)))
    return prompts


def reusable_tokens(prompts: Sequence[Prompt], chunk_tokens: int) -> list[int]:
    """The best hit of each prompt with unlimited capacity: the longest run of whole chunks
    it shares with any earlier prompt, capped so that its last token is computed."""
    seen: set[bytes] = set()
    out = []
    for p in prompts:
        ids = np.ascontiguousarray(p.token_ids, dtype="<u4")
        full = len(ids) // chunk_tokens
        usable = (len(ids) - 1) // chunk_tokens
        hit = 0
        while hit < usable and ids[: (hit + 1) * chunk_tokens].tobytes() in seen:
            hit += 1
        out.append(hit * chunk_tokens)
        seen.update(ids[: (i + 1) * chunk_tokens].tobytes() for i in range(full))
    return out


def generate(args: argparse.Namespace, vocab_size: int) -> list[Prompt]:
    """The prompts of `args.workload` with the sizes given on the command line."""
    if args.workload == "multi-turn":
        return multi_turn(args.users, args.rounds, args.system_tokens, args.question_tokens,
                          args.answer_tokens, vocab_size=vocab_size, seed=args.seed)
    if args.workload == "long-doc":
        return long_doc(args.docs, args.questions, args.doc_tokens, args.question_tokens,
                        vocab_size=vocab_size, seed=args.seed)
    if args.workload == "rag":
        return rag(args.rag_questions, args.passages, args.top_k, args.passage_tokens,
                   args.instruction_tokens, args.question_tokens, vocab_size=vocab_size,
                   seed=args.seed)
    raise ValueError(f"unknown workload {args.workload!r} (known: {', '.join(WORKLOADS)})")


# -- the runner -----------------------------------------------------------------------------


def _add_if_missing(p: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """Add a flag `bench ttft` may already define (it owns the common ones)."""
    if flag not in p._option_string_actions:
        p.add_argument(flag, **kwargs)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Workload flags; call after the command's own flags (common ones are added if absent)."""
    g = p.add_argument_group("workloads")
    g.add_argument("--workload", default=None,
                   help=f"run realistic workloads instead: {', '.join(WORKLOADS)} (comma-separated)")
    g.add_argument("--always-load", action="store_true",
                   help="load every hit, whatever the connector's load-vs-recompute policy says")
    g.add_argument("--users", type=int, default=4, help="multi-turn: users (default 4)")
    g.add_argument("--rounds", type=int, default=4, help="multi-turn: rounds per user (default 4)")
    g.add_argument("--system-tokens", type=int, default=512, help="multi-turn: shared system prompt")
    g.add_argument("--answer-tokens", type=int, default=128, help="multi-turn: tokens per answer")
    g.add_argument("--docs", type=int, default=3, help="long-doc: documents (default 3)")
    g.add_argument("--doc-tokens", type=int, default=2048, help="long-doc: tokens per document")
    g.add_argument("--questions", type=int, default=3, help="long-doc: questions per document")
    g.add_argument("--rag-questions", type=int, default=12, help="rag: questions (default 12)")
    g.add_argument("--passages", type=int, default=12, help="rag: passages in the corpus")
    g.add_argument("--top-k", type=int, default=4, help="rag: passages per question (default 4)")
    g.add_argument("--passage-tokens", type=int, default=256, help="rag: tokens per passage")
    g.add_argument("--instruction-tokens", type=int, default=128, help="rag: shared instruction")
    g.add_argument("--question-tokens", type=int, default=64, help="tokens per question (default 64)")
    _add_if_missing(p, "--seed", type=int, default=0, help="workload and weight seed")
    _add_if_missing(p, "--store", action="append", metavar="URL",
                    help="store URL; repeat to compare stores (default: a temporary directory)")
    _add_if_missing(p, "--model", default="llama-50m", help="model preset (bench.presets)")
    _add_if_missing(p, "--dtype", default="bfloat16", help="model dtype (default bfloat16)")
    _add_if_missing(p, "--chunk-tokens", type=int, default=256, help="tokens per chunk")
    _add_if_missing(p, "--json", default=None, metavar="PATH", help="write machine-readable results")
    _add_if_missing(p, "--plot", default=None, metavar="PNG", help="write the TTFT chart here")


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else 0.0


def _store_label(url: str) -> str:
    """The URL without its query (which may hold credentials)."""
    from storage.options import StoreURL

    u = StoreURL(url)
    return f"{u.scheme}://{u.netloc}{u.path}"


def _store_urls(args: argparse.Namespace, scratch: Path) -> list[str]:
    """`--store` (one URL, or several if repeatable), else a temporary file:// directory."""
    store = getattr(args, "store", None)
    if not store:
        return [f"file://{scratch}"]
    return [store] if isinstance(store, str) else list(store)


def measure(
    model: Any, prompts: Sequence[Prompt], store_url: str, chunk_tokens: int,
    *, policy: Any = None, progress: bool = True,
) -> dict[str, Any]:
    """Cold and cached TTFT of each prompt (see the module docstring) and the cache's traffic.

    `policy` is the connector's `LoadPolicy` (default: its adaptive load-vs-recompute one).
    """
    from tqdm import tqdm

    from bench.ttft import timed_cached, timed_plain
    from connector import KVConnector
    from connector.hf import CachedPrefill, namespace_for, recompute_tolerance
    from hashing import chunk_keys
    from storage import open_store

    ns = namespace_for(model, chunk_tokens, salt=f"bench-{uuid.uuid4().hex}")
    connector = KVConnector(open_store(store_url), ns, policy=policy)
    prefill = CachedPrefill(model, connector)
    rows = []
    try:
        # Warm-up, untimed: the model's thread pools, and the store's client and
        # connections (an engine's connector is long-lived; the first S3 call builds
        # its client), with a key no prompt will have.
        timed_plain(model, _as_batch(prompts[0].token_ids[:chunk_tokens]))
        probe = chunk_keys(np.arange(chunk_tokens), ns)
        connector.run(connector.store.exists(probe), timeout=60)
        for i, p in enumerate(tqdm(prompts, desc="prompts", unit="req", leave=False,
                                   disable=None if progress else True)):
            ids = _as_batch(p.token_ids)
            # Alternate which pass goes first so that drift in a shared CPU's load does
            # not always favour one side.
            order = ("cold", "warm") if i % 2 == 0 else ("warm", "cold")
            timed: dict[str, float] = {}
            last: dict[str, Any] = {}
            for side in order:
                if side == "cold":
                    timed[side], out = timed_plain(model, ids)
                else:
                    timed[side], out = timed_cached(prefill, ids)
                    hit = prefill.last_hit_tokens
                    connector.flush()
                last[side] = out.logits[0, -1]
            rows.append({
                "source": p.source, "tokens": len(p), "hit_tokens": hit,
                "cold_s": timed["cold"], "warm_s": timed["warm"],
                "first_token_equal": bool(last["cold"].argmax() == last["warm"].argmax()),
                "max_abs_logit_diff": float((last["cold"].float() - last["warm"].float())
                                            .abs().max()),
                "recompute_tolerance": recompute_tolerance(last["cold"]),
            })
        stats = connector.stats()
        connector.run(_delete_namespace(connector.store, ns.id))
    finally:
        connector.close()
    return _summarize(rows, stats, store_url)


def _as_batch(token_ids: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(token_ids))[None]


async def _delete_namespace(store: Any, ns_id: str) -> None:
    """Remove this run's chunks so repeated runs start cold and buckets do not fill up."""
    keys = [k async for k in store.list_keys() if k.startswith(ns_id + "/")]
    for key in keys:
        await store.delete(key)


def _summarize(rows: list[dict[str, Any]], stats: dict[str, Any], store_url: str) -> dict[str, Any]:
    cold = [r["cold_s"] for r in rows]
    warm = [r["warm_s"] for r in rows]
    hits = [r for r in rows if r["hit_tokens"] > 0]
    misses = [r for r in rows if r["hit_tokens"] == 0]
    tokens = sum(r["tokens"] for r in rows)
    miss_cost = [r["warm_s"] - r["cold_s"] for r in misses]
    return {
        "store": _store_label(store_url),
        "prompts": len(rows), "tokens": tokens,
        "hit_tokens": sum(r["hit_tokens"] for r in rows),
        "token_hit_rate": sum(r["hit_tokens"] for r in rows) / tokens if tokens else 0.0,
        "cold_p50_s": _percentile(cold, 50), "cold_p90_s": _percentile(cold, 90),
        "warm_p50_s": _percentile(warm, 50), "warm_p90_s": _percentile(warm, 90),
        "speedup_total": sum(cold) / sum(warm) if sum(warm) else 0.0,
        "speedup_p50": _percentile(cold, 50) / _percentile(warm, 50) if warm else 0.0,
        "hit_speedup_p50": (statistics.median(r["cold_s"] / r["warm_s"] for r in hits)
                            if hits else None),
        "miss_prompts": len(misses),
        "miss_cost_p50_s": statistics.median(miss_cost) if miss_cost else None,
        "miss_cost_p50_fraction": (statistics.median(c / r["cold_s"] for c, r in
                                                     zip(miss_cost, misses, strict=True))
                                   if misses else None),
        "bytes_loaded": stats["hit_bytes"], "bytes_saved": stats["saved_bytes"],
        "load_seconds": stats["load_seconds"], "load_gbps": stats["load_gbps"],
        "declined_tokens": stats["declined_tokens"],
        "load_timeouts": stats["load_timeouts"],
        "load_failures": stats["load_misses"] + stats["load_errors"] + stats["load_timeouts"]
        + stats["verify_failures"],
        "first_token_equal": all(r["first_token_equal"] for r in rows),
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
        # The warm pass continues from K/V saved by earlier prompts' passes, so against this
        # cold full pass it agrees up to the kernels' rounding (connector/hf.py's contract).
        "within_rounding": all(r["max_abs_logit_diff"] <= r["recompute_tolerance"] for r in rows),
        "prefill_tokens_per_s": tokens / sum(cold) if sum(cold) else 0.0,
        "per_prompt": rows,
    }


def policy_for(args: argparse.Namespace) -> Any:
    """`--always-load`: a LoadPolicy that loads every hit; else None (the adaptive one)."""
    if not args.always_load:
        return None
    from connector import LoadPolicy

    # A deadline far above any prefill here: a slow load still completes.
    return LoadPolicy(adaptive=False, min_wait_s=60.0, max_wait_s=60.0)


def run_workload(args: argparse.Namespace) -> int:
    """Run every workload in `args.workload` on every store; print, plot and write results."""
    from bench.presets import get_preset
    from bench.report import table, write_json

    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    preset = get_preset(args.model)
    model = preset.build(args.dtype, seed=args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvstash-workloads-") as scratch:
        for name in names:
            prompts = generate(argparse.Namespace(**{**vars(args), "workload": name}),
                               preset.vocab)
            ideal = sum(reusable_tokens(prompts, args.chunk_tokens))
            for url in _store_urls(args, Path(scratch)):
                print(f"{name}: {len(prompts)} prompts, {sum(map(len, prompts))} tokens, "
                      f"through {_store_label(url)}")
                result = measure(model, prompts, url, args.chunk_tokens, policy=policy_for(args))
                result.update(workload=name, ideal_hit_rate=ideal / result["tokens"])
                results.append(result)
    ms = lambda s: None if s is None else 1000 * s  # noqa: E731
    print(table(
        ["workload", "store", "hit % (ideal)", "cold p50/p90 ms", "warm p50/p90 ms",
         "speedup", "hit p50 speedup", "loaded MiB", "load GB/s", "miss cost ms (%) [misses]",
         "same token", "within rounding"],
        [[r["workload"], r["store"],
          f"{100 * r['token_hit_rate']:.1f} ({100 * r['ideal_hit_rate']:.1f})",
          f"{ms(r['cold_p50_s']):.0f}/{ms(r['cold_p90_s']):.0f}",
          f"{ms(r['warm_p50_s']):.0f}/{ms(r['warm_p90_s']):.0f}",
          r["speedup_total"], r["hit_speedup_p50"], r["bytes_loaded"] / 2**20, r["load_gbps"],
          "-" if r["miss_cost_p50_s"] is None else
          f"{ms(r['miss_cost_p50_s']):+.1f} ({100 * r['miss_cost_p50_fraction']:+.1f}%) "
          f"[{r['miss_prompts']}]",
          "yes" if r["first_token_equal"] else "no",
          "yes" if r["within_rounding"] else "NO"] for r in results],
    ))
    cold_tokens = sum(r["tokens"] for r in results)
    cold_seconds = sum(r["tokens"] / r["prefill_tokens_per_s"] for r in results)
    if getattr(args, "plot", None):
        from bench.plots import ttft_bars

        ttft_bars(results, Path(args.plot),
                  title=f"{args.model} ({args.dtype}), chunks of {args.chunk_tokens} tokens")
        print(f"plot: {args.plot}")
    write_json(getattr(args, "json", None), {
        "command": "bench ttft --workload", "model": args.model, "dtype": args.dtype,
        "chunk_tokens": args.chunk_tokens, "seed": args.seed,
        "prefill_tokens_per_s": cold_tokens / cold_seconds, "results": results,
    })
    return 0 if all(r["within_rounding"] for r in results) else 1
