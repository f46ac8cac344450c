"""Builders for the engine-adapter tests: real vLLM config, request and offloading objects on CPU.

vLLM cannot run a model here (no GPU build), so the tests build the engine's own objects
(`VllmConfig` with a CPU `DeviceConfig`, `Request` with vLLM's block hasher, the real
`TieringOffloadingSpec` and its CPU primary tier) and play the parts of the engine loop
that need CUDA: GPU<->CPU copies and the model forward are plain tensor copies.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-engines.sh)")

from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.request import Request  # noqa: E402

BLOCK_SIZE = 16
MODEL = "test/tiny-llama"

init_none_hash(sha256)


def make_request(prompt: list[int], req_id: str | None = None) -> Request:
    """A real vLLM request whose `block_hashes` come from vLLM's own block hasher."""
    return Request(
        request_id=req_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def offloading_config(
    store: str | list[str], page_bytes_per_block: int = 8192, blocks_per_chunk: int = 1,
    salt: str = "",
) -> OffloadingConfig:
    """What vLLM's `build_offloading_config` produces for a 2-layer model, TP=1."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(
            tokens_per_block=BLOCK_SIZE, layer_names=("layers.0.attn", "layers.1.attn"), group_id=0,
        ),),
        worker_kv_bytes_per_block=page_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 64 * page_bytes_per_block * blocks_per_chunk,
            "secondary_tiers": [{
                "type": "KvstashTier", "module_path": "connector.vllm_tier",
                "store": store, "salt": salt, "timeout_s": 10,
            }],
        },
        engine_id=uuid.uuid4().hex,  # a fresh CPU region: a new engine process
        model=OffloadingModelConfig(name=MODEL, dtype="bfloat16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_SIZE, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def vllm_config(store: str | list[str], **extra: Any) -> VllmConfig:
    """A CPU `VllmConfig` that names our V1 connector, as `vllm serve --kv-transfer-config` would."""
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvstashConnector",
            kv_connector_module_path="connector.vllm_v1",
            kv_role="kv_both",
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
