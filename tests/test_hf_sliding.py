"""CachedPrefill on sliding-window transformers models: the same exactness contract.

Mistral with a 40-token window on every layer, and Gemma 3 with a sliding layer beside a
full-attention one; 32-token chunks, so a hit's window at its end spans two chunks. The
reference of a hit is the model continuing from its own cache of the prompt
(`continue_from_cache` on a `recording_cache`'s forward, which keeps every position of a
sliding layer); a miss is the plain forward pass itself (connector/hf.py).
"""

from __future__ import annotations

from functools import cache

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from connector import KVConnector  # noqa: E402
from connector.hf import (  # noqa: E402
    CachedPrefill,
    continue_from_cache,
    namespace_for,
    recompute_tolerance,
    recording_cache,
)
from tests.connector_fixtures import (  # noqa: E402
    CHUNK,
    chunk_file,
    flip_payload_byte,
    plain_forward,
    prompt,
    store_dir_fixture,
    test_namespace,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]
_ = store_dir_fixture
WINDOW = 40


@cache
def sliding_model(family: str):
    """A 2-layer, hidden-256 model with seeded random weights and a 40-token window: every
    layer's (Mistral), or layer 0's beside a full-attention layer 1 (Gemma 3)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig

    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                 max_position_embeddings=2048, sliding_window=WINDOW)
    cfg = (MistralConfig(**shape) if family == "mistral" else Gemma3TextConfig(
        **shape, head_dim=64, layer_types=["sliding_attention", "full_attention"]))
    cfg._name_or_path = f"test/{family}-sliding"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def recorded(model, ids):
    """The model's forward over `ids` keeping every position of every layer."""
    with torch.no_grad():
        return model(ids, past_key_values=recording_cache(model), use_cache=True)


def assert_exact(out, model, ids, hit: int, saved=None) -> None:
    """A miss is the plain forward (logits and cache); a hit equals the model continuing
    from its own cache of the first `hit` tokens of `saved` (default: `ids`), bit for bit,
    in logits and in every layer's K/V (a sliding layer holding its window); against one
    full recompute the logits agree within `recompute_tolerance`."""
    full = plain_forward(model, ids)
    ref = full if hit == 0 else continue_from_cache(
        model, recorded(model, ids if saved is None else saved).past_key_values, hit, ids)
    assert torch.equal(out.logits, ref.logits)
    for mine, theirs in zip(out.past_key_values.layers, ref.past_key_values.layers,
                            strict=True):
        assert torch.equal(mine.keys, theirs.keys)
        assert torch.equal(mine.values, theirs.values)
    assert out.past_key_values.get_seq_length() == ids.shape[1]
    diff = (out.logits - full.logits[:, hit:]).abs().max().item()
    assert diff <= recompute_tolerance(full.logits), diff


def make_prefill(model, store, **kwargs) -> CachedPrefill:
    return CachedPrefill(model, KVConnector(store, test_namespace(model)), **kwargs)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_a_sliding_window_model_misses_then_hits_exactly(family, layerwise, store_dir):
    model = sliding_model(family)
    ids = prompt(200)
    prefill = make_prefill(model, f"file://{store_dir}", layerwise=layerwise)
    miss = prefill(ids)
    assert prefill.last_hit_tokens == 0
    assert_exact(miss, model, ids, 0)
    assert prefill.connector.flush(30)
    hit = prefill(ids)
    assert prefill.last_hit_tokens == 192
    assert_exact(hit, model, ids, 192)
    stats = prefill.connector.stats()
    assert stats["saved_chunks"] == 6 and stats["loaded_chunks"] == 6
    prefill.connector.close()


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_partial_hit_saves_the_rest_from_the_window_on(family, store_dir):
    """A hit of 3 chunks of another prompt, then the rest computed on the window at its
    end: exact, and the new chunks it saves are what a full forward computes (a third
    call hits all of them, exactly)."""
    model = sliding_model(family)
    shared = prompt(100, seed=1)
    first = torch.cat([shared, prompt(60, seed=2)], dim=1)
    second = torch.cat([shared, prompt(90, seed=3)], dim=1)
    prefill = make_prefill(model, f"file://{store_dir}")
    prefill(first)
    assert prefill.connector.flush(30)
    out = prefill(second)
    assert prefill.last_hit_tokens == 96
    assert_exact(out, model, second, 96, saved=first)
    assert prefill.connector.flush(30)
    again = prefill(second)
    assert prefill.last_hit_tokens == 160
    assert_exact(again, model, second, 160)
    prefill.connector.close()


def gemma3_saved(store_dir, tokens: int):
    """A Gemma-3-shaped model, a prompt of `tokens` and its `CachedPrefill`, after a
    miss that saved the prompt's chunks."""
    model = sliding_model("gemma3")
    ids = prompt(tokens)
    prefill = make_prefill(model, f"file://{store_dir}")
    prefill(ids)
    assert prefill.connector.flush(30)
    return model, ids, prefill


def test_a_corrupt_chunk_ends_a_sliding_window_hit_before_it(store_dir):
    model, ids, prefill = gemma3_saved(store_dir, 200)
    flip_payload_byte(chunk_file(store_dir, prefill.connector.ns, ids[0].numpy(), 3))
    out = prefill(ids)
    assert prefill.last_hit_tokens == 3 * CHUNK
    assert_exact(out, model, ids, 3 * CHUNK)
    prefill.connector.close()


def test_decoding_after_a_sliding_window_hit_matches_the_models_own_cache(store_dir):
    model, ids, prefill = gemma3_saved(store_dir, 150)
    out = prefill(ids)
    assert prefill.last_hit_tokens == 128
    ref = continue_from_cache(model, recorded(model, ids).past_key_values, 128, ids)
    nxt = out.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        for _ in range(WINDOW):  # past the window: the sliding layer drops old positions
            step = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            ref_step = model(nxt, past_key_values=ref.past_key_values, use_cache=True)
            assert torch.equal(step.logits, ref_step.logits)
            nxt = step.logits[:, -1:].argmax(-1)
    prefill.connector.close()


def test_a_linear_attention_hybrid_is_refused_with_its_layer_types():
    """Qwen3-Next-shaped (Gated DeltaNet layers beside full attention): transformers' cache
    keeps a linear-attention layer's recurrent state only as it is at the end of a forward
    (`output_final_state`), not at each chunk boundary a chunk would have to hold, so
    `CachedPrefill` refuses the model at once, naming the layer types, rather than storing
    a state it cannot check."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, full_attention_interval=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert "linear_attention" in model.config.layer_types
    with pytest.raises(ValueError, match=r"only full-attention and sliding-window layers "
                                         r"are supported, model has \['full_attention', "
                                         r"'linear_attention'\]"):
        namespace_for(model, chunk_tokens=32)
