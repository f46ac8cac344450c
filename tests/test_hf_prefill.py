"""CachedPrefill on real transformers models: every cache outcome is exact, on every CPU.

The exactness contract (connector/hf.py), asserted by `assert_exact` for every outcome:
(1) the K/V a hit loads are bit-identical to the K/V the model computed when it saved them;
(2) the hit's logits and the K/V it computes are bit-identical to the model continuing from
its own in-memory prefix cache (`continue_from_cache`, what an engine's prefix caching does);
(3) against one full recompute of the prompt the logits agree within `recompute_tolerance`
(bit-equal on some CPUs, not on others: the kernels' reduction order is not ours).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from connector import KVConnector, LoadPolicy  # noqa: E402
from connector.hf import (  # noqa: E402
    CachedPrefill,
    continue_from_cache,
    namespace_for,
    recompute_tolerance,
)
from hashing import chunk_keys  # noqa: E402
from storage import encode_chunk, open_store  # noqa: E402
from storage.memory import MemoryStore  # noqa: E402
from tests.connector_fixtures import (  # noqa: E402
    CHUNK,
    DelayedStore,
    chunk_file,
    closed_port,
    flip_payload_byte,
    plain_forward,
    prompt,
    store_dir_fixture,
    test_namespace,
    tiny_model,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]
_ = store_dir_fixture


def make_prefill(model, store, ns=None, **kwargs) -> CachedPrefill:
    return CachedPrefill(model, KVConnector(store, ns or test_namespace(model), **kwargs))


def assert_exact(out, model, ids, hit: int, saved=None, **kwargs) -> None:
    """`out` (CachedPrefill on `ids`, `hit` tokens loaded) against the contract. `saved`: the
    model's own forward pass whose chunks were stored (default: the plain pass over `ids`)."""
    full = plain_forward(model, ids, **kwargs)
    saved = full if saved is None else saved
    layers = list(zip(out.past_key_values.layers, saved.past_key_values.layers, strict=True))
    for mine, theirs in layers:  # (1) the loaded prefix is the saved K/V, bit for bit
        assert torch.equal(mine.keys[:, :, :hit], theirs.keys[:, :, :hit])
        assert torch.equal(mine.values[:, :, :hit], theirs.values[:, :, :hit])
    if hit == 0:  # a miss is the plain forward pass itself
        assert torch.equal(out.logits, full.logits)
    else:  # (2) the engine's own prefix cache, continued
        ref = continue_from_cache(model, saved.past_key_values, hit, ids, **kwargs)
        assert torch.equal(out.logits, ref.logits)
        for mine, theirs in zip(out.past_key_values.layers, ref.past_key_values.layers,
                                strict=True):
            assert torch.equal(mine.keys, theirs.keys)
            assert torch.equal(mine.values, theirs.values)
    # (3) one full recompute: equal up to the kernels' reduction-order noise
    diff = (out.logits - full.logits[:, hit:]).abs().max().item()
    assert diff <= recompute_tolerance(full.logits), diff


def warm(prefill: CachedPrefill, ids) -> None:
    """Run a prompt through the cache once and wait until its chunks are stored."""
    prefill(ids)
    assert prefill.connector.flush(30)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_miss_then_full_hit_give_the_plain_logits(family, store_dir):
    model = tiny_model(family)
    ids = prompt(200)
    prefill = make_prefill(model, f"file://{store_dir}")

    miss = prefill(ids)
    assert prefill.last_hit_tokens == 0
    assert_exact(miss, model, ids, 0)
    assert prefill.connector.flush(30)

    hit = prefill(ids)
    assert prefill.last_hit_tokens == (200 - 1) // CHUNK * CHUNK == 192
    assert_exact(hit, model, ids, 192)
    stats = prefill.connector.stats()
    assert stats["hit_tokens"] == 192 and stats["saved_chunks"] == 6
    assert stats["hit_bytes"] == 6 * prefill.layout.payload_nbytes
    prefill.connector.close()


def test_last_prompt_token_is_always_computed(store_dir):
    model = tiny_model()
    ids = prompt(4 * CHUNK)
    prefill = make_prefill(model, f"file://{store_dir}")
    warm(prefill, ids)
    out = prefill(ids)
    assert prefill.last_hit_tokens == 3 * CHUNK
    assert out.logits.shape[1] == CHUNK
    prefill.connector.close()


def test_partial_hit_loads_the_shared_prefix_and_computes_the_rest(store_dir):
    model = tiny_model()
    shared = prompt(100, seed=1)
    first = torch.cat([shared, prompt(60, seed=2)], dim=1)
    second = torch.cat([shared, prompt(90, seed=3)], dim=1)
    prefill = make_prefill(model, f"file://{store_dir}")
    warm(prefill, first)

    out = prefill(second)
    assert prefill.last_hit_tokens == 96  # the 3 whole chunks inside the shared 100 tokens
    assert_exact(out, model, second, 96, saved=plain_forward(model, first))
    prefill.connector.close()


def test_one_decode_step_after_a_hit_matches(store_dir):
    model = tiny_model()
    ids = prompt(150)
    prefill = make_prefill(model, f"file://{store_dir}")
    warm(prefill, ids)
    out = prefill(ids)
    assert prefill.last_hit_tokens == 128
    full = plain_forward(model, ids)
    ref = continue_from_cache(model, full.past_key_values, 128, ids)
    nxt = out.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        step = model(nxt, past_key_values=out.past_key_values, use_cache=True)
        ref_step = model(nxt, past_key_values=ref.past_key_values, use_cache=True)
        full_step = model(nxt, past_key_values=full.past_key_values, use_cache=True)
    assert torch.equal(step.logits, ref_step.logits)
    diff = (step.logits - full_step.logits).abs().max().item()
    assert diff <= recompute_tolerance(full_step.logits), diff
    prefill.connector.close()


@pytest.mark.parametrize("verify", ["changed", "header"])
def test_corrupt_chunk_ends_the_hit_before_it(store_dir, verify):
    """With `verify=header` the store passes the damage on and the connector's own checksum
    rejects it; with the default the store catches it. Either way: a shorter, exact hit."""
    model = tiny_model()
    ids = prompt(200)
    ns = test_namespace(model)
    prefill = make_prefill(model, f"file://{store_dir}?verify={verify}", ns)
    warm(prefill, ids)
    flip_payload_byte(chunk_file(store_dir, ns, ids, 3))

    out = prefill(ids)
    assert prefill.last_hit_tokens == 3 * CHUNK
    assert_exact(out, model, ids, 3 * CHUNK)
    if verify == "header":
        assert prefill.connector.stats()["verify_failures"] == 1
    prefill.connector.close()


def test_a_stalled_chunk_ends_the_hit_at_the_deadline(store_dir):
    model = tiny_model()
    ids = prompt(200)
    store = DelayedStore(open_store(f"file://{store_dir}"))
    prefill = make_prefill(model, store, policy=LoadPolicy(min_wait_s=2.0, max_wait_s=2.0))
    warm(prefill, ids)
    store.slow.add(chunk_keys(ids, prefill.connector.ns)[2])

    out = prefill(ids)
    assert prefill.last_hit_tokens == 2 * CHUNK
    assert_exact(out, model, ids, 2 * CHUNK)
    assert prefill.connector.stats()["load_timeouts"] == 1
    # the stalled read may still land in that staging later: it is never reused
    assert prefill._buffers.raw is None
    prefill.connector.close()


def test_unreachable_store_is_a_miss_and_never_an_error():
    model = tiny_model()
    ids = prompt(200)
    prefill = make_prefill(model, f"http://127.0.0.1:{closed_port()}?timeout=1s&connect_timeout=1s")
    for _ in range(2):
        out = prefill(ids)
        assert prefill.last_hit_tokens == 0
        assert_exact(out, model, ids, 0)
    prefill.connector.flush(30)
    assert prefill.connector.stats()["saved_chunks"] == 0
    prefill.connector.close()


def test_chunks_of_another_namespace_are_never_used(store_dir):
    model = tiny_model()
    ids = prompt(200)
    store_url = f"file://{store_dir}"
    warm(make_prefill(model, store_url), ids)  # stored under another salt

    other = make_prefill(model, store_url)
    out = other(ids)
    assert other.last_hit_tokens == 0
    assert_exact(out, model, ids, 0)
    other.connector.close()


def test_other_weights_make_another_namespace():
    assert namespace_for(tiny_model(seed=0), CHUNK) != namespace_for(tiny_model(seed=1), CHUNK)
    assert namespace_for(tiny_model(dtype="float32"), CHUNK).dtype == "float32"
    assert namespace_for(tiny_model(dtype="bfloat16"), CHUNK).dtype == "bfloat16"


def test_a_chunk_holding_other_tokens_under_the_right_key_is_rejected():
    """A key collision (or a forged chunk): the header's token ids differ from the prompt's."""
    model = tiny_model()
    ids = prompt(100)
    store = MemoryStore()
    prefill = make_prefill(model, store)
    key = chunk_keys(ids, prefill.connector.ns)[0]
    payload = bytes(prefill.layout.payload_nbytes)
    forged = encode_chunk(key, prompt(CHUNK, seed=9)[0].numpy(), payload, prefill.layout.meta())
    assert prefill.connector.run(store.put(key, forged))

    out = prefill(ids)
    assert prefill.last_hit_tokens == 0
    assert_exact(out, model, ids, 0)
    assert prefill.connector.stats()["verify_failures"] == 1
    prefill.connector.close()


def test_a_namespace_that_does_not_describe_the_model_is_refused():
    model = tiny_model()
    conn = KVConnector(MemoryStore(), namespace_for(tiny_model(dtype="bfloat16"), CHUNK))
    with pytest.raises(ValueError, match="dtype"):
        CachedPrefill(model, conn)
    conn.close()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_hit_is_exact(family, store_dir):
    model = tiny_model(family, "bfloat16")
    ids = prompt(200)
    prefill = make_prefill(model, f"file://{store_dir}")
    warm(prefill, ids)
    out = prefill(ids)
    assert prefill.last_hit_tokens == 192
    assert out.logits.dtype == torch.bfloat16
    assert_exact(out, model, ids, 192)
    prefill.connector.close()


def test_process_b_hits_what_process_a_saved(store_dir):
    """Two fresh interpreters: keys, namespace and weights agree across processes."""
    script = textwrap.dedent(f"""
        import json, sys, torch
        from connector import KVConnector
        from connector.hf import CachedPrefill, continue_from_cache, namespace_for
        from tests.connector_fixtures import prompt, plain_forward, tiny_model
        model = tiny_model()
        ids = prompt(200, seed=5)
        prefill = CachedPrefill(model, KVConnector("file://{store_dir}", namespace_for(model, 32)))
        out = prefill(ids)
        prefill.connector.close()
        hit = prefill.last_hit_tokens
        full = plain_forward(model, ids)  # what process A computed and saved, recomputed here
        ref = continue_from_cache(model, full.past_key_values, hit, ids) if hit else full
        exact = torch.equal(out.logits, ref.logits) and all(
            torch.equal(a.keys[:, :, :hit], b.keys[:, :, :hit])
            for a, b in zip(out.past_key_values.layers, full.past_key_values.layers))
        print(json.dumps({{"hit": hit, "exact": exact}}))
    """)
    root = Path(__file__).resolve().parent.parent

    def run() -> dict:
        proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr
        import json

        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert run() == {"hit": 0, "exact": True}
    assert run() == {"hit": 192, "exact": True}
    assert len(list(open_store(f"file://{store_dir}").root.rglob("*.kv"))) == 6


def test_mask_and_position_arguments_are_handled_on_a_hit(store_dir):
    model = tiny_model()
    ids = prompt(200)
    kwargs = {"attention_mask": torch.ones_like(ids), "position_ids": torch.arange(200)[None]}
    prefill = make_prefill(model, f"file://{store_dir}")
    warm(prefill, ids)
    out = prefill(ids, **kwargs)
    assert prefill.last_hit_tokens == 192
    assert_exact(out, model, ids, 192, saved=plain_forward(model, ids), **kwargs)
    prefill.connector.close()


def test_batches_and_explicit_caches_bypass_the_connector():
    model = tiny_model()
    ids = torch.cat([prompt(64, 1), prompt(64, 2)])
    prefill = make_prefill(model, MemoryStore())
    out = prefill(ids)
    assert torch.equal(out.logits, plain_forward(model, ids).logits)
    assert prefill.connector.stats()["lookups"] == 0
    prefill.connector.close()


def test_a_hit_through_a_same_host_kvserver_receives_chunk_files_and_is_exact(store_dir):
    """Real kvserver on file:// with --unix-socket: the hit's chunks arrive as descriptors
    of the server's verified files, and the logits are still exactly the plain ones."""
    import re
    import shutil
    import tempfile

    import httpx

    from connector.policy import LoadPolicy
    from tests.kvserver_fixtures import running_kvserver

    model = tiny_model()
    ids = prompt(200)
    where = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    try:
        # settle=0: the server remembers a verification at once (nothing rewrites a chunk).
        with running_kvserver("--store", f"file://{store_dir}?settle=0", "--unix-socket",
                              f"{where}/kv.sock") as server:
            # Every hit loads: the first load (the server verifying each file) is slow enough
            # that the adaptive policy would recompute this tiny model's prefix instead.
            prefill = make_prefill(model, f"http://localhost?unix_socket={where}/kv.sock",
                                   policy=LoadPolicy(adaptive=False))
            warm(prefill, ids)
            prefill(ids)  # the server verifies each file as it first sends it ...
            hit = prefill(ids)  # ... and hands the files themselves over after that
            assert prefill.last_hit_tokens == 192
            assert_exact(hit, model, ids, 192)
            metrics = httpx.get(f"{server.url}/metrics").text
            passed = float(re.search(r"^kvstash_bytes_fd_passed_total (\S+)$", metrics, re.M)[1])
            assert passed >= 6 * prefill.layout.payload_nbytes
            prefill.connector.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_the_contract_holds_where_kernels_are_not_batch_invariant(store_dir, monkeypatch):
    """Stand-in for a CPU whose attention kernel rounds a suffix-only pass differently from a
    full pass (as Intel Xeon's do): here SDPA over a past (fewer queries than keys) runs in
    float64. A hit then differs from one full recompute by rounding, and the contract still
    holds: the loaded K/V and the continuation from the model's own cache are bit-exact."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def order_dependent_sdpa(q, k, v, *args, **kwargs):
        if q.shape[-2] == k.shape[-2]:
            return sdpa(q, k, v, *args, **kwargs)
        mask = kwargs.pop("attn_mask", None)
        mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
        return sdpa(q.double(), k.double(), v.double(), *args, attn_mask=mask,
                    **kwargs).to(q.dtype)

    monkeypatch.setattr(F, "scaled_dot_product_attention", order_dependent_sdpa)
    model = tiny_model()
    ids = prompt(200)
    prefill = make_prefill(model, f"file://{store_dir}")
    warm(prefill, ids)
    out = prefill(ids)
    assert prefill.last_hit_tokens == 192
    assert not torch.equal(out.logits, plain_forward(model, ids).logits[:, 192:])
    assert_exact(out, model, ids, 192)
    prefill.connector.close()


def test_load_buffers_are_reused_without_touching_a_returned_cache(store_dir):
    """Staging and K/V memory are kept between hits (fresh memory costs a page fault per
    page); a cache returned by an earlier call never shares them, so it stays intact."""
    model = tiny_model()
    first, second = prompt(200, seed=1), prompt(200, seed=2)
    prefill = make_prefill(model, f"file://{store_dir}")
    warm(prefill, first)
    warm(prefill, second)

    out1 = prefill(first)
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in out1.past_key_values.layers]
    buffers = prefill._buffers.raw.data_ptr(), prefill._buffers.kv.data_ptr()
    out2 = prefill(second)
    assert prefill.last_hit_tokens == 192
    assert (prefill._buffers.raw.data_ptr(), prefill._buffers.kv.data_ptr()) == buffers
    assert_exact(out2, model, second, 192)
    for layer, (k, v) in zip(out1.past_key_values.layers, kept, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert_exact(out1, model, first, 192)
    prefill.connector.close()


def test_a_cache_still_holding_the_loaded_kv_keeps_it_from_reuse():
    from connector.hf import _PrefixBuffers, kv_layout

    buffers = _PrefixBuffers(kv_layout(tiny_model(), CHUNK), torch.device("cpu"), "host")
    staged = buffers.take(2)
    held = staged.cache(2 * CHUNK, tiny_model().config)  # as if the model kept these tensors
    buffers.release(held)
    assert buffers.kv is None  # the next load gets fresh memory
    assert buffers.take(2).kv.data_ptr() != held.layers[0].keys.data_ptr()


@pytest.mark.parametrize("store_kind", ["file", "memory"])
def test_a_layerwise_hit_computes_each_layer_once_its_prefix_layer_is_placed(store_kind, store_dir):
    """`layerwise=True`: the forward starts at once; each layer's attention waits only for
    that layer's ranges. Same contract as a whole-prefix load."""
    model = tiny_model()
    ids = prompt(200)
    store = f"file://{store_dir}" if store_kind == "file" else MemoryStore()
    prefill = CachedPrefill(model, KVConnector(store, test_namespace(model)), layerwise=True)
    warm(prefill, ids)
    hit = prefill(ids)
    assert prefill.last_hit_tokens == 192
    assert_exact(hit, model, ids, 192)
    stats = prefill.connector.stats()
    assert stats["loaded_chunks"] == 6 and stats["failed_chunks"] == 0
    prefill.connector.close()


def test_a_layerwise_hit_with_a_corrupt_layer_is_recomputed_whole(store_dir):
    model = tiny_model()
    ids = prompt(200)
    prefill = CachedPrefill(model, KVConnector(f"file://{store_dir}", test_namespace(model)),
                            layerwise=True)
    warm(prefill, ids)
    flip_payload_byte(chunk_file(store_dir, prefill.connector.ns, ids[0].numpy(), 3))
    out = prefill(ids)
    assert prefill.last_hit_tokens == 0  # the forward ran on a broken layer: thrown away
    assert_exact(out, model, ids, 0)
    assert prefill.connector.stats()["verify_failures"] >= 1
    prefill.connector.close()


def test_the_policy_learns_each_forward_once_its_time_is_known(store_dir, monkeypatch):
    """Every forward pass's computed tokens reach the policy: on CPU at once; on a GPU (CUDA
    events stand in here: a timer not yet `ready`) at a later call, never by waiting."""
    import connector.hf as hf

    model = tiny_model()
    prefill = make_prefill(model, f"file://{store_dir}")
    ids = prompt(200)
    warm(prefill, ids)
    prefill(ids)  # a hit: 192 loaded, 8 computed
    stats = prefill.connector.stats()
    assert stats["prefill_tokens"] == 200 + 8 and stats["prefill_seconds"] > 0

    class Pending(hf.PrefillTimer):  # a GPU whose kernels finish only after the next call
        answered = 0

        def ready(self) -> bool:
            Pending.answered += 1
            return Pending.answered > 1

    monkeypatch.setattr(hf, "PrefillTimer", Pending)
    prefill(prompt(40, seed=5))
    assert prefill.connector.stats()["prefill_tokens"] == 208  # not known yet: not waited for
    prefill(prompt(30, seed=6))
    assert prefill.connector.stats()["prefill_tokens"] == 208 + 40 + 30
    prefill.connector.close()
