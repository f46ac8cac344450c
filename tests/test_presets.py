"""Model presets: real transformers architectures with random weights, shaped as stated."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench.presets import PRESETS  # noqa: E402


@pytest.mark.parametrize("name", ["llama-test", "qwen2-test", "gemma3-test"])
def test_a_presets_parameter_count_is_its_models(name):
    preset = PRESETS[name]
    model = preset.build("bfloat16")
    assert sum(p.numel() for p in model.parameters()) == preset.params


def test_the_hybrid_preset_has_gemma3s_pattern_of_five_sliding_layers_to_one_full():
    preset = PRESETS["gemma3-test"]
    cfg = preset.build("bfloat16").config
    assert type(preset.build("bfloat16")).__name__ == "Gemma3ForCausalLM"
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg.sliding_window == preset.window == 128
