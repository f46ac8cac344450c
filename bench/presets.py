"""Model presets for benchmarks and the demo: real transformers architectures with random weights.

Every preset is built from a config (no hub download); the code path is the one a user runs
with real weights. Shapes follow published models where it matters: `llama-1.5b` is the
Llama-3.2-1B shape with untied embeddings (probe.md §1 measured it), `qwen2-500m` is the
Qwen2-0.5B shape; `gemma3-test` has Gemma 3's layer pattern (five sliding-window layers to
one full-attention layer), a hybrid model for vLLM's hybrid KV cache manager. This module
imports no torch, so a trace or planning tool can read
`bytes_per_token` without one; `build` imports torch and transformers when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Preset:
    name: str
    family: str  # "llama", "qwen2" or "gemma3"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool
    max_positions: int = 32768
    note: str = ""
    window: int | None = None  # gemma3: the sliding layers' window, in tokens

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        """Parameter count (exact for these architectures)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = 2 * h * h + 2 * h * kv + (h + 2 * kv if self.family == "qwen2" else 0)
        if self.family == "gemma3":  # q and k norms; four norms a layer
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * self.intermediate + (4 if self.family == "gemma3" else 2) * h
        embeddings = self.vocab * h * (1 if self.tie_embeddings else 2)
        return self.layers * per_layer + embeddings + h

    def bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """KV-cache bytes one token occupies: K and V, every layer, every KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    @property
    def layer_types(self) -> list[str]:
        """Per layer, "full_attention" or "sliding_attention" (gemma3: every sixth full)."""
        if self.family != "gemma3":
            return ["full_attention"] * self.layers
        return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                for i in range(self.layers)]

    def config(self) -> Any:
        from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

        common = dict(
            hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
            max_position_embeddings=self.max_positions, tie_word_embeddings=self.tie_embeddings,
        )
        if self.family == "gemma3":
            return Gemma3TextConfig(**common, head_dim=self.head_dim, sliding_window=self.window,
                                    layer_types=self.layer_types)
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[self.family]
        return cls(**common)

    def build(self, dtype: str = "bfloat16", seed: int = 0) -> Any:
        """The model in eval mode with seeded random weights (equal seeds give equal weights).

        The seed is part of the model's name, so namespaces of different weights differ.
        """
        import torch
        from transformers import AutoModelForCausalLM

        cfg = self.config()
        cfg._name_or_path = f"kvstash-random/{self.name}-seed{seed}"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        return model.eval()


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama-test", "llama", 256, 512, 4, 4, 2, 2048, False,
               note="tests and smoke runs"),
        Preset("qwen2-test", "qwen2", 256, 512, 4, 4, 2, 2048, True,
               note="tests and smoke runs"),
        Preset("gemma3-test", "gemma3", 256, 512, 6, 4, 2, 2048, True, window=128,
               note="Gemma 3 layer pattern: 5 sliding layers (128-token window) to 1 full"),
        Preset("llama-50m", "llama", 512, 1344, 8, 8, 2, 32000, False,
               note="the demo's model; probe.md §1 small config"),
        Preset("qwen2-50m", "qwen2", 512, 1536, 8, 8, 2, 32000, True),
        Preset("llama-250m", "llama", 1024, 2816, 16, 16, 4, 32000, False),
        Preset("qwen2-500m", "qwen2", 896, 4864, 24, 14, 2, 151936, True,
               note="Qwen2-0.5B shape"),
        Preset("llama-1.5b", "llama", 2048, 8192, 16, 32, 8, 128256, False,
               note="Llama-3.2-1B shape, untied embeddings"),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError as exc:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})") from exc


def bytes_per_token(name: str, dtype: str = "bfloat16") -> int:
    """KV bytes per token of a preset (for trace replay and capacity planning)."""
    return get_preset(name).bytes_per_token(dtype)
