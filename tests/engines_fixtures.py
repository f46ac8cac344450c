"""Builders for the engine-adapter tests: real vLLM config, request and offloading objects on CPU.

vLLM cannot run a model here (no GPU build), so the tests build the engine's own objects
(`VllmConfig` with a CPU `DeviceConfig`, `Request` with vLLM's block hasher, the real
`TieringOffloadingSpec` and its CPU primary tier) and play the parts of the engine loop
that need CUDA: GPU<->CPU copies and the model forward are plain tensor copies.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# vLLM is imported inside the builders, so SGLang's tests can use the engine-agnostic
# helpers here on a machine without vLLM (the vLLM test modules importorskip it first).
if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.request import Request

BLOCK_SIZE = 16
MODEL = "test/tiny-llama"


def make_request(prompt: list[int], req_id: str | None = None, **extra: Any) -> Request:
    """A real vLLM request whose `block_hashes` come from vLLM's own block hasher (`extra`:
    more of `Request`'s arguments, e.g. `lora_request`, `cache_salt`)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)  # vLLM's default: sha256 with the fixed seed, stable across processes
    return Request(
        request_id=req_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        **extra,
    )


def offloading_config(
    store: str | list[str], page_bytes_per_block: int = 8192, blocks_per_chunk: int = 1,
    salt: str = "", kv_events: bool = False,
) -> OffloadingConfig:
    """What vLLM's `build_offloading_config` produces for a 2-layer model, TP=1."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    # vLLM 0.33 added max_model_len to the model part; 0.32 has name and dtype only.
    names = {f.name for f in dataclasses.fields(OffloadingModelConfig)}
    model_extra = {"max_model_len": 4096} if "max_model_len" in names else {}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(
            tokens_per_block=BLOCK_SIZE, layer_names=("layers.0.attn", "layers.1.attn"), group_id=0,
        ),),
        worker_kv_bytes_per_block=page_bytes_per_block,
        enable_kv_cache_events=kv_events,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 64 * page_bytes_per_block * blocks_per_chunk,
            "secondary_tiers": [{
                "type": "KvstashTier", "module_path": "connector.vllm_tier",
                "store": store, "salt": salt, "timeout_s": 10, "enable_kv_events": kv_events,
            }],
        },
        engine_id=uuid.uuid4().hex,  # a fresh CPU region: a new engine process
        model=OffloadingModelConfig(name=MODEL, dtype="bfloat16", **model_extra),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_SIZE, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def vllm_config(store: str | list[str], **extra: Any) -> VllmConfig:
    """A CPU `VllmConfig` naming our V1 connector, as `vllm serve --kv-transfer-config` would,
    with GPU-sized blocks (`BLOCK_SIZE`; vLLM's CPU platform would otherwise pick 128)."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig

    role = extra.pop("kv_role_override", "kv_both")
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvstashConnector",
            kv_connector_module_path="connector.vllm_v1",
            kv_role=role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"store": store, "model": MODEL, **extra},
        ),
    )


def wait_until(step: Callable[[], bool], timeout: float = 20.0) -> None:
    """Call `step` (one engine step) until it returns True; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not step():
        if time.monotonic() > deadline:
            pytest.fail(f"engine did not settle within {timeout} s")
        time.sleep(0.005)


def corrupt_chunks(root: Path) -> int:
    """Flip one payload byte of every chunk file under `root` (the header stays valid)."""
    n = 0
    for path in root.rglob("*.kv"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        n += 1
    return n


FORWARD_LAYER_S = 0.002  # what each layer of the stand-in forward takes


class V1Engine:
    """One vLLM engine's two connector halves (scheduler and one worker, TP=1) over CPU
    tensors standing in for the paged GPU KV cache: 2 layers of [blocks, heads, block, K|V].

    Loads are async (between steps) unless `load_mode` says otherwise: the default "auto"
    would load chunks just written (all in the page cache) within the step instead. Block 0
    is vLLM's null block, as in a real engine: tests hand requests blocks from 1 on, or 0
    where a block is outside a sliding window.

    `kv_cache_config`: vLLM's KV cache groups (`hybrid_kv_cache_config`), as vLLM hands
    them to both halves with its hybrid manager on; then `step`'s block ids of a request
    are a tuple of per-group lists."""

    def __init__(self, store: str | list[str], num_blocks: int = 32,
                 kv_cache_config: Any = None, **extra: Any):
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from connector.vllm_v1 import KvstashConnector

        extra.setdefault("load_mode", "async")
        cfg = vllm_config(store, **extra)
        self.scheduler = KvstashConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.worker = KvstashConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
        self.kv = {
            f"layers.{i}.attn": torch.zeros(num_blocks, 2, BLOCK_SIZE, 16, dtype=torch.bfloat16)
            for i in range(2)
        }
        self.worker.register_kv_caches(self.kv)

    def lookup(self, request: Request, local_tokens: int = 0) -> tuple[int | None, bool]:
        """Ask like vLLM's scheduler does, once per step, until the answer is not None."""
        answers = []

        def step() -> bool:
            answers.append(self.scheduler.get_num_new_matched_tokens(request, local_tokens))
            return answers[-1][0] is not None

        wait_until(step)
        return answers[-1]

    def step(self, new_requests=(), block_ids=None, scheduled=None, cached=None):
        """One engine step: build metadata, run the worker around a forward, collect results.

        `cached` lists (request, new block ids, computed tokens before this step) of requests
        scheduled before, as vLLM's `CachedRequestData` carries them.
        """
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        scheduled = scheduled or {}
        cached = cached or []
        out = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData.from_request(r, _groups(block_ids[r.request_id]))
                for r in new_requests
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r, _, _ in cached], resumed_req_ids=set(),
                new_token_ids=[], all_token_ids={}, new_block_ids=[_groups(ids) for _, ids, _ in cached],
                num_computed_tokens=[n for _, _, n in cached],
                num_output_tokens=[0 for _ in cached],
            ),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )
        meta = self.scheduler.build_connector_meta(out)
        # vLLM's order (kv_connector_model_runner_mixin): bind; start_load_kv before the
        # forward only when the step has synchronous (layerwise) loads, else after it.
        self.worker.bind_connector_metadata(meta)
        sync = any(r.sync for r in meta.loads)
        if sync:
            self.worker.start_load_kv(None)
        for name, kv in self.kv.items():  # the attention layers of the forward
            self.worker.wait_for_layer_load(name)
            time.sleep(FORWARD_LAYER_S)
            self.worker.save_kv_layer(name, kv, None)
        if not sync:
            self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        _, recving = self.worker.get_finished(set())
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        if recving:  # as vLLM's scheduler hears of loads done (tests hand on load errors)
            from vllm.v1.outputs import KVConnectorOutput

            self.scheduler.update_connector_output(KVConnectorOutput(finished_recving=recving))
        return meta, recving or set(), errors

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def _groups(ids: Any) -> tuple[list[int], ...]:
    """A request's block ids as vLLM's scheduler outputs carry them: one list per group."""
    return ids if isinstance(ids, tuple) else (ids,)


def hybrid_kv_cache_config(window: int, num_blocks: int = 32, layers: int = 2,
                           sliding: tuple[int, ...] = (0,)) -> Any:
    """vLLM's `KVCacheConfig` of `V1Engine`'s layers with the hybrid manager on: the
    layers in `sliding` (a `window`-token sliding window) in group 0, the others (full
    attention) in group 1; or a Mamba group (`window` 0) in place of the sliding one."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    attn = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 8,
            "dtype": torch.bfloat16}
    names = [f"layers.{i}.attn" for i in range(layers)]
    first = ([KVCacheGroupSpec([names[i] for i in sliding],
                               SlidingWindowSpec(**attn, sliding_window=window))]
             if window else
             [KVCacheGroupSpec([names[i] for i in sliding], MambaSpec(
                 block_size=BLOCK_SIZE, shapes=((4, 8), (2, 8, 8)),
                 dtypes=(torch.bfloat16, torch.float32)))])
    full = [n for i, n in enumerate(names) if i not in sliding]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[*first, KVCacheGroupSpec(full, FullAttentionSpec(**attn))])


def engine_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store behind an engine test: `memory`, `file` or `s3` (a moto server on 127.0.0.1)."""
    if request.param == "memory":
        return "memory://?capacity=64MiB"
    if request.param == "file":
        return f"file://{tmp_path}/kv"
    from tests.s3_fixtures import with_prefix

    return with_prefix(request.getfixturevalue("moto_s3_url"))
