"""`kvstash demo`: kvserver on the embedded default store, a real model through the connector, TTFT cold vs warm.

What it does, end to end, in well under a minute:
1. starts `kvstash serve` in a child process on a free loopback port (the embedded default
   store, a directory under ~/.kvstash, unless `--store` names another) and waits for
   `/healthz`;
2. builds a real transformers model with random weights (`--model`, a `bench.presets` name)
   and puts `connector.hf.CachedPrefill` in front of it, over `http://127.0.0.1:PORT`;
3. sends the same prompt twice: cold (nothing stored; its chunks are saved behind the
   request) and warm (the prefix is loaded from kvserver, only the tail is computed);
4. prints both TTFTs, the tokens and bytes loaded, whether the warm logits are identical to
   the model continuing from its own in-memory prefix cache (they must be, on every CPU),
   and how far they are from the cold full recompute (rounding noise at most);
5. deletes the demo's chunks (each run has its own namespace) and stops the server.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench.presets import PRESETS

SERVER_START_S = 60.0


class DemoServer:
    """`kvstash serve --port 0` as a child process; the port comes from its first line."""

    def __init__(self, store_urls: list[str] | None, flags: tuple[str, ...] = ()):
        args = [sys.executable, "-m", "kvstash.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                *flags]
        for url in store_urls or []:
            args += ["--store", url]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.url = ""
        self.banner = ""
        self.log: list[str] = []
        self._started = threading.Event()
        # Read everything the server prints, so a full pipe never blocks it.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if not self.banner and line.startswith("kvstash serve: http://"):
                self.banner = line.strip().removeprefix("kvstash serve: ")
                self.url = self.banner.split()[0]
                self._started.set()
        self._started.set()  # the server exited

    def _fail(self, why: str) -> None:
        self.stop()
        tail = "".join(self.log[-10:]).strip()
        raise RuntimeError(f"kvserver {why}" + (f":\n{tail}" if tail else ""))

    def wait_ready(self, timeout_s: float = SERVER_START_S) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        if not self._started.wait(timeout_s) or not self.url:
            self._fail("did not start")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"exited with status {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self._fail(f"at {self.url} not healthy after {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _delete_chunks(store: Any, keys: list[str]) -> int:
    deleted = 0
    for key in keys:
        try:
            deleted += bool(await store.delete(key))
        except Exception:  # noqa: BLE001 - cleanup of a demo must not fail it
            pass
    return deleted


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from bench.ttft import build_rig, random_prompt, timed_cached, warm_up
    from connector.hf import continue_from_cache, recompute_tolerance
    from hashing import chunk_keys
    from storage.options import format_size

    server = DemoServer(args.store)
    try:
        print("kvstash demo: starting kvserver ...", flush=True)
        server.wait_ready()
        print(f"kvserver: {server.banner}", flush=True)
        rig = build_rig(args.model, server.url, dtype=args.dtype, chunk_tokens=args.chunk_tokens,
                        salt=f"demo-{uuid.uuid4().hex}")
        p = rig.preset
        print(f"model: {p.name} ({p.params / 1e6:.0f}M params, {p.family}, {args.dtype}, random "
              f"weights), {format_size(p.bytes_per_token(args.dtype))} of KV per token", flush=True)
        try:
            warm_up(rig)
            ids = random_prompt(args.prompt_tokens, p.vocab, np.random.default_rng(args.seed))
            conn = rig.connector
            cold_s, cold = timed_cached(rig.prefill, ids)
            cold_hit = rig.prefill.last_hit_tokens
            conn.flush(60)
            saved = conn.stats()
            warm_s, warm = timed_cached(rig.prefill, ids)
            stats = conn.stats()
            warm_hit = rig.prefill.last_hit_tokens
            # The contract (connector/hf.py): the hit equals the model continuing from its
            # own in-memory prefix cache bit for bit, and the full recompute up to rounding.
            own = continue_from_cache(rig.model, cold.past_key_values, warm_hit, ids,
                                      logits_to_keep=1)
            exact = bool(torch.equal(warm.logits[0, -1], own.logits[0, -1]))
            recompute_diff = (warm.logits[0, -1] - cold.logits[0, -1]).abs().max().item()
            tolerance = recompute_tolerance(cold.logits[0, -1])
            keys = chunk_keys(ids[0].numpy(), conn.ns)
            if not args.keep:
                conn.run(_delete_chunks(conn.store, keys), timeout=60)
        finally:
            rig.close()
    finally:
        server.stop()
    loaded = stats["hit_bytes"] - saved["hit_bytes"]
    load_s = stats["load_seconds"] - saved["load_seconds"]
    result = {
        "server": server.url, "model": p.name, "dtype": args.dtype,
        "prompt_tokens": args.prompt_tokens, "chunk_tokens": args.chunk_tokens,
        "cold_ttft_s": cold_s, "cold_hit_tokens": cold_hit,
        "saved_chunks": saved["saved_chunks"], "saved_bytes": saved["saved_bytes"],
        "warm_ttft_s": warm_s, "warm_hit_tokens": warm_hit,
        "loaded_bytes": loaded, "load_s": load_s,
        "speedup": cold_s / warm_s, "logits_identical": exact,
        "recompute_max_abs_diff": recompute_diff, "recompute_tolerance": tolerance,
    }
    print(
        f"request 1 (cold): TTFT {cold_s * 1e3:8.1f} ms   hit {cold_hit} of {args.prompt_tokens} "
        f"tokens; {saved['saved_chunks']} chunks ({format_size(saved['saved_bytes'])}) saved to "
        "kvserver behind the request\n"
        f"request 2 (warm): TTFT {warm_s * 1e3:8.1f} ms   hit {warm_hit} of {args.prompt_tokens} "
        f"tokens; {format_size(loaded)} loaded in {load_s * 1e3:.1f} ms\n"
        f"warm is {cold_s / warm_s:.1f}x faster than cold; last-token logits identical to the "
        f"model's own prefix cache: {'yes' if exact else 'NO'}; vs a full recompute: max |diff| "
        f"{recompute_diff:.3g} (rounding bound {tolerance:.3g})",
        flush=True,
    )
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-50m", choices=sorted(PRESETS),
                   help="model preset, random weights (default llama-50m)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length (default 2048)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--store", action="append", metavar="URL",
                   help="kvserver's store (default: the embedded default store); repeat for tiers")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--keep", action="store_true", help="leave the demo's chunks in the store")
    p.add_argument("--json", metavar="PATH", type=Path, help="also write the results as JSON")


def run(args: argparse.Namespace) -> int:
    result = run_demo(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    ok = result["recompute_max_abs_diff"] <= result["recompute_tolerance"]
    return 0 if result["logits_identical"] and ok and result["warm_hit_tokens"] > 0 else 1
