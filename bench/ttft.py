"""`kvstash bench ttft`: time to first token of full prefill vs a cache hit vs the ideal, on a real model.

One run, four measurements per repeat, interleaved so that a noisy machine hurts them alike:

- full prefill: the plain model on the whole prompt (the baseline);
- miss: the same prompt through `CachedPrefill` on a store that holds none of it (the
  connector's cost when there is no reuse: one lookup, then queueing the saves);
- hit: a second prompt sharing the first `--cached-tokens` tokens (then a different
  suffix), through `CachedPrefill` after the miss's chunks were stored: lookup, load,
  verify and place the prefix, compute the suffix;
- ideal: the same suffix with the prefix KV already in memory in a ready cache object
  (no lookup, no I/O, no copy): the floor a hit approaches.

TTFT is the prefill call's wall time up to the last position's logits (`logits_to_keep=1`);
with `--device cuda` each timed region ends with a device synchronize, so it holds the GPU's
work too.
Saves are flushed outside the timed regions, as an engine's decode time would cover them.
Each repeat uses a fresh random prefix and each run a fresh namespace salt, so a store
left over from an earlier run never turns a "miss" into a hit.

The helpers (`build_rig`, `measure_ttft`, `timed_*`) are reused by `bench.workloads` and
`bench.demo`. Nothing here imports torch at module level.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.presets import PRESETS, Preset, get_preset

add_workload_arguments: Callable[[argparse.ArgumentParser], None] | None
policy_for: Callable[[argparse.Namespace], Any] | None
run_workload: Callable[[argparse.Namespace], int] | None
try:
    from bench.workloads import add_workload_arguments, policy_for, run_workload
except ModuleNotFoundError:
    add_workload_arguments = policy_for = run_workload = None


@dataclass
class Rig:
    """A preset model, a connector over a store, and the `CachedPrefill` in front of them."""

    preset: Preset
    dtype: str
    model: Any
    prefill: Any
    store_url: str
    build_s: float
    scratch: Path | None = None  # a temporary store directory this rig removes on close
    device: str = "cpu"

    @property
    def connector(self) -> Any:
        return self.prefill.connector

    def close(self) -> None:
        self.connector.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def build_rig(
    preset: str,
    store_url: str | None = None,
    *,
    dtype: str = "bfloat16",
    chunk_tokens: int = 256,
    seed: int = 0,
    salt: str | None = None,
    device: str = "cpu",
    **connector_kwargs: Any,
) -> Rig:
    """Build a preset's model (seeded random weights, on `device`) and a `CachedPrefill` over
    `store_url`.

    No `store_url`: a fresh temporary `file://` directory, removed by `Rig.close()`.
    `salt` (default: random) scopes the namespace, so runs never see each other's chunks.
    """
    from connector import KVConnector
    from connector.hf import CachedPrefill, namespace_for

    p = get_preset(preset)
    scratch = None
    if store_url is None:
        scratch = Path(tempfile.mkdtemp(prefix="kvstash-bench-"))
        store_url = f"file://{scratch}"
    started = time.perf_counter()
    model = p.build(dtype, seed).to(device)
    build_s = time.perf_counter() - started
    ns = namespace_for(model, chunk_tokens, salt=uuid.uuid4().hex if salt is None else salt)
    prefill = CachedPrefill(model, KVConnector(store_url, ns, **connector_kwargs))
    return Rig(p, dtype, model, prefill, store_url, build_s, scratch, device)


def random_prompt(n: int, vocab: int, rng: Any) -> Any:
    """A (1, n) tensor of token ids from a numpy Generator."""
    import torch

    return torch.from_numpy(rng.integers(16, vocab, (1, n)))


def _done(ids: Any) -> float:
    """perf_counter() once the work queued on `ids`'s device has finished (CPU: at once)."""
    if ids.is_cuda:
        import torch

        torch.cuda.synchronize(ids.device)
    return time.perf_counter()


def timed_plain(model: Any, ids: Any) -> tuple[float, Any]:
    """Seconds and output of the plain model on the whole prompt (no cache at all)."""
    import torch

    with torch.no_grad():
        started = _done(ids)
        out = model(ids, use_cache=True, logits_to_keep=1)
        return _done(ids) - started, out


def timed_cached(prefill: Any, ids: Any) -> tuple[float, Any]:
    """Seconds and output of one prefill through the cache (`prefill.last_hit_tokens` says
    how much was loaded)."""
    started = _done(ids)
    out = prefill(ids, logits_to_keep=1)
    return _done(ids) - started, out


def timed_ideal(model: Any, prefix_cache: Any, prefix_tokens: int, suffix_ids: Any) -> tuple[float, Any]:
    """Seconds and output of the suffix with the first `prefix_tokens` of `prefix_cache`
    already in a ready cache object; building that object is not timed."""
    import torch

    from connector.hf import prefix_cache as cropped

    cache = cropped(model, prefix_cache, prefix_tokens)
    with torch.no_grad():
        started = _done(suffix_ids)
        out = model(suffix_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return _done(suffix_ids) - started, out


@dataclass
class TtftSample:
    full_s: float
    miss_s: float
    hit_s: float
    ideal_s: float
    hit_tokens: int
    load_s: float
    load_bytes: int
    exact: bool
    store_read_s: float      # the store's own batched read of the hit's chunks (baseline)
    miss_connector_s: float  # lookup + queueing saves, on the engine thread
    hit_connector_s: float   # lookup + load + placement + queueing saves
    hit_compute_s: float     # the model's part of the hit: what the ideal measures alone


def timed_store_read(conn: Any, keys: list[str], buffers: list[Any]) -> float:
    """Seconds of the store's own batched read (`get_into_many`) of `keys` into `buffers`
    (host memory touched before): the rate a load into the model's cache is measured against."""
    started = time.perf_counter()
    got = conn.run(conn.store.get_into_many(keys, buffers[: len(keys)],
                                            max_in_flight=conn.max_in_flight), timeout=120)
    elapsed = time.perf_counter() - started
    if any(header is None for header in got):
        raise RuntimeError("the store lost a chunk the hit just loaded")
    return elapsed


def read_buffers(rig: Rig, cached_tokens: int) -> list[Any]:
    """One touched, huge-page-advised host buffer per cached chunk, for `timed_store_read`."""
    from storage.buffers import host_buffer

    payload = rig.prefill.layout.payload_nbytes
    buffers = [host_buffer(payload) for _ in range(cached_tokens // rig.connector.chunk_tokens)]
    for b in buffers:
        b[::4096] = bytes(len(b[::4096]))  # one write per page: fault it in now
    return buffers


def measure_once(rig: Rig, prompt_tokens: int, cached_tokens: int, rng: Any,
                 buffers: list[Any]) -> TtftSample:
    """One interleaved round of full / miss / hit / ideal on fresh random prompts, and the
    store's own batched read of the hit's chunks."""
    import torch

    from hashing import chunk_keys

    vocab = rig.preset.vocab
    prefix = random_prompt(cached_tokens, vocab, rng)
    first = random_prompt(prompt_tokens - cached_tokens, vocab, rng)
    second = random_prompt(prompt_tokens - cached_tokens, vocab, rng)
    second[0, 0] = (first[0, 0] + 1) % vocab  # the prompts share exactly the prefix
    prompt_a = torch.cat([prefix, first], dim=1).to(rig.device)
    prompt_b = torch.cat([prefix, second], dim=1).to(rig.device)
    conn = rig.connector

    full_s, full = timed_plain(rig.model, prompt_a)
    miss_s, miss = timed_cached(rig.prefill, prompt_a)
    miss_connector_s = rig.prefill.last_timings["cache"] + rig.prefill.last_timings["save"]
    if rig.prefill.last_hit_tokens:
        raise RuntimeError("a fresh random prefix hit the store: namespace not fresh?")
    conn.flush()
    before = conn.stats()
    hit_s, hit = timed_cached(rig.prefill, prompt_b)
    after = conn.stats()
    hit_tokens = rig.prefill.last_hit_tokens
    hit_connector_s = rig.prefill.last_timings["cache"] + rig.prefill.last_timings["save"]
    hit_compute_s = rig.prefill.last_timings["compute"]
    conn.flush()
    ideal_s, ideal = timed_ideal(rig.model, full.past_key_values, hit_tokens, prompt_b[:, hit_tokens:])
    keys = chunk_keys(prompt_b[0, :hit_tokens].cpu().numpy(), conn.ns)
    store_read_s = timed_store_read(conn, keys, buffers) if keys else 0.0
    exact = bool(
        torch.equal(miss.logits, full.logits) and torch.equal(hit.logits, ideal.logits)
    )
    return TtftSample(
        full_s, miss_s, hit_s, ideal_s, hit_tokens,
        load_s=after["load_seconds"] - before["load_seconds"],
        load_bytes=after["hit_bytes"] - before["hit_bytes"],
        exact=exact,
        store_read_s=store_read_s,
        miss_connector_s=miss_connector_s,
        hit_connector_s=hit_connector_s,
        hit_compute_s=hit_compute_s,
    )


def warm_up(rig: Rig, tokens: int = 256) -> None:
    """One small forward pass, so thread pools and allocators are warm before timing."""
    import numpy as np

    ids = random_prompt(tokens, rig.preset.vocab, np.random.default_rng(1))
    timed_plain(rig.model, ids.to(rig.device))


def measure_ttft(
    rig: Rig, prompt_tokens: int, cached_tokens: int, repeat: int = 3, seed: int = 0
) -> dict[str, Any]:
    """Medians over `repeat` interleaved rounds, the ratios, and every sample."""
    import numpy as np

    n = rig.connector.chunk_tokens
    if cached_tokens % n or not 0 < cached_tokens < prompt_tokens:
        raise ValueError(
            f"--cached-tokens must be a multiple of the chunk size ({n}) and below --prompt-tokens"
        )
    rng = np.random.default_rng(seed)
    warm_up(rig)
    buffers = read_buffers(rig, cached_tokens)
    samples = [measure_once(rig, prompt_tokens, cached_tokens, rng, buffers)
               for _ in range(repeat)]

    def med(name: str) -> float:
        return statistics.median(getattr(s, name) for s in samples)

    full, miss, hit, ideal = med("full_s"), med("miss_s"), med("hit_s"), med("ideal_s")
    load_s, load_bytes = med("load_s"), med("load_bytes")
    miss_conn, hit_conn = med("miss_connector_s"), med("hit_connector_s")
    return {
        "model": rig.preset.name,
        "params": rig.preset.params,
        "dtype": rig.dtype,
        "bytes_per_token": rig.preset.bytes_per_token(rig.dtype),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "chunk_tokens": n,
        "store": rig.store_url,
        "device": _device_name(rig.device),
        "policy": "adaptive" if rig.connector.policy.adaptive else "always load",
        "repeat": repeat,
        "threads": _torch_threads(),
        "full_prefill_s": full,
        "miss_s": miss,
        "hit_s": hit,
        "ideal_s": ideal,
        "hit_tokens": min(s.hit_tokens for s in samples),
        "speedup_vs_full": full / hit,
        "load_overhead_vs_ideal": (hit - ideal) / ideal,
        "miss_cost_vs_full": (miss - full) / full,
        "load_s": load_s,
        "load_bytes": load_bytes,
        "load_gbps": load_bytes / load_s / 1e9 if load_s else 0.0,
        "store_read_s": med("store_read_s"),
        "store_read_gbps": load_bytes / med("store_read_s") / 1e9 if med("store_read_s") else 0.0,
        "load_vs_store_read": med("store_read_s") / load_s if load_s else 0.0,
        "miss_connector_s": miss_conn,
        "miss_connector_vs_full": miss_conn / full,
        "hit_connector_s": hit_conn,
        "hit_connector_vs_ideal": hit_conn / ideal,
        "hit_compute_s": med("hit_compute_s"),
        "exact": all(s.exact for s in samples),
        "samples": [s.__dict__ for s in samples],
        "connector": rig.connector.stats(),
    }


def _device_name(device: str) -> str:
    """`device`, with the GPU's name where it is one."""
    import torch

    dev = torch.device(device)
    return f"{device} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else device


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def format_report(r: dict[str, Any]) -> str:
    from storage.options import format_size

    full = r["full_prefill_s"]
    rows = [
        ("full prefill (baseline, no cache)", r["full_prefill_s"], "1.00x"),
        ("miss through the connector", r["miss_s"],
         f"{full / r['miss_s']:.2f}x  (connector cost {r['miss_cost_vs_full']:+.1%})"),
        (f"hit ({r['hit_tokens']} tokens loaded)", r["hit_s"],
         f"{r['speedup_vs_full']:.2f}x  (load overhead {r['load_overhead_vs_ideal']:+.1%} of ideal)"),
        ("ideal (prefix KV already in memory)", r["ideal_s"], f"{full / r['ideal_s']:.2f}x"),
    ]
    lines = [
        f"model {r['model']} ({r['params'] / 1e6:.0f}M params, {r['dtype']}, "
        f"{format_size(r['bytes_per_token'])}/token), prompt {r['prompt_tokens']} tokens, "
        f"{r['cached_tokens']} cached, chunks of {r['chunk_tokens']}, store {r['store']}, "
        f"on {r.get('device', 'cpu')}, {r.get('policy', 'adaptive')} policy, "
        f"{r['threads']} torch threads, median of {r['repeat']}",
        f"{'path':<38} {'TTFT':>9}  vs full prefill",
    ]
    lines += [f"{name:<38} {secs:>8.3f}s  {ratio}" for name, secs, ratio in rows]
    lines.append(
        f"load: {format_size(r['load_bytes'])} in {r['load_s'] * 1e3:.1f} ms "
        f"({r['load_gbps']:.2f} GB/s incl. verify and placement into the model's cache; "
        f"the store's own batched read of the same chunks {r['store_read_gbps']:.2f} GB/s: "
        f"{r['load_vs_store_read']:.2f}x of it); "
        f"logits exact (miss = full prefill, hit = ideal, bit for bit): "
        f"{'yes' if r['exact'] else 'NO'}"
    )
    lines.append(
        f"connector time on the engine thread: miss {r['miss_connector_s'] * 1e3:.1f} ms "
        f"({r['miss_connector_vs_full']:.2%} of full prefill), hit {r['hit_connector_s'] * 1e3:.1f} ms "
        f"({r['hit_connector_vs_ideal']:.2%} of ideal; the hit's model part took "
        f"{r['hit_compute_s']:.3f}s vs ideal {r['ideal_s']:.3f}s)"
    )
    return "\n".join(lines)


def format_summary(results: list[dict[str, Any]]) -> str:
    """One line per model: the numbers a README table needs."""
    head = (f"{'model':<12} {'params':>7} {'full':>9} {'miss':>9} {'hit':>9} {'ideal':>9} "
            f"{'speed-up':>8} {'load ovh':>8} {'miss cost':>9} {'conn/miss':>9} exact")
    lines = [head]
    for r in results:
        lines.append(
            f"{r['model']:<12} {r['params'] / 1e6:>6.0f}M {r['full_prefill_s']:>8.3f}s "
            f"{r['miss_s']:>8.3f}s {r['hit_s']:>8.3f}s {r['ideal_s']:>8.3f}s "
            f"{r['speedup_vs_full']:>7.2f}x {r['load_overhead_vs_ideal']:>+8.1%} "
            f"{r['miss_cost_vs_full']:>+9.1%} {r['miss_connector_vs_full']:>9.2%} "
            f"{'yes' if r['exact'] else 'NO'}"
        )
    return "\n".join(lines)


def _presets(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        get_preset(name)
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-50m", type=str,
                   help="model preset(s), random weights, comma-separated to compare several "
                        f"(default llama-50m; known: {', '.join(PRESETS)})")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="model and KV dtype (default bfloat16)")
    p.add_argument("--store", metavar="URL",
                   help="store URL (default: a temporary file:// directory, removed after)")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length (default 4096)")
    p.add_argument("--cached-tokens", type=int, default=3584,
                   help="shared prefix stored before the hit (default 3584)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians (default 3)")
    p.add_argument("--device", default="cpu",
                   help="torch device of the model and its cache, e.g. cuda (default cpu)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default 0: torch's choice, one per core); on a "
                        "busy shared machine 1 is steadier")
    p.add_argument("--json", metavar="PATH", type=Path,
                   help="also write the results as JSON (one model: its result; several: "
                        "{\"runs\": [...]})")
    if add_workload_arguments is not None:
        add_workload_arguments(p)  # adds --seed too
    else:
        p.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default 0)")


def run(args: argparse.Namespace) -> int:
    if run_workload is not None and getattr(args, "workload", None):
        return run_workload(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = []
    policy = policy_for(args) if policy_for is not None else None
    for name in _presets(args.model):
        rig = build_rig(name, args.store, dtype=args.dtype, chunk_tokens=args.chunk_tokens,
                        seed=args.seed, device=args.device, policy=policy)
        try:
            result = measure_ttft(rig, args.prompt_tokens, args.cached_tokens, args.repeat,
                                  args.seed)
        finally:
            rig.close()
        print(format_report(result) + "\n", flush=True)
        results.append(result)
    if len(results) > 1:
        print(format_summary(results))
    if args.json:
        doc = results[0] if len(results) == 1 else {"runs": results}
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 0 if all(r["exact"] for r in results) else 1
