"""CachedPrefill on real transformers models: every cache outcome gives the plain forward's logits.

Exactness is `torch.equal` (max abs diff 0): on this CPU, SDPA over a loaded prefix is
bit-identical to the full pass (shared/notes/probe.md §1).
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
from connector.hf import CachedPrefill, namespace_for  # noqa: E402
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

pytestmark = pytest.mark.engine
_ = store_dir_fixture


def make_prefill(model, store, ns=None, **kwargs) -> CachedPrefill:
    return CachedPrefill(model, KVConnector(store, ns or test_namespace(model), **kwargs))


def assert_exact(out, ref, hit: int) -> None:
    assert torch.equal(out.logits, ref.logits[:, hit:])
    for mine, theirs in zip(out.past_key_values.layers, ref.past_key_values.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys)
        assert torch.equal(mine.values, theirs.values)


def warm(prefill: CachedPrefill, ids) -> None:
    """Run a prompt through the cache once and wait until its chunks are stored."""
    prefill(ids)
    assert prefill.connector.flush(30)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_miss_then_full_hit_give_the_plain_logits(family, store_dir):
    model = tiny_model(family)
    ids = prompt(200)
    ref = plain_forward(model, ids)
    prefill = make_prefill(model, f"file://{store_dir}")

    miss = prefill(ids)
    assert prefill.last_hit_tokens == 0
    assert_exact(miss, ref, 0)
    assert prefill.connector.flush(30)

    hit = prefill(ids)
    assert prefill.last_hit_tokens == (200 - 1) // CHUNK * CHUNK == 192
    assert_exact(hit, ref, 192)
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
    assert_exact(out, plain_forward(model, second), 96)
    prefill.connector.close()


def test_one_decode_step_after_a_hit_matches(store_dir):
    model = tiny_model()
    ids = prompt(150)
    prefill = make_prefill(model, f"file://{store_dir}")
    warm(prefill, ids)
    out = prefill(ids)
    ref = plain_forward(model, ids)
    nxt = ref.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        step = model(nxt, past_key_values=out.past_key_values, use_cache=True)
        ref_step = model(nxt, past_key_values=ref.past_key_values, use_cache=True)
    assert torch.equal(step.logits, ref_step.logits)
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
    assert_exact(out, plain_forward(model, ids), 3 * CHUNK)
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
    assert_exact(out, plain_forward(model, ids), 2 * CHUNK)
    assert prefill.connector.stats()["load_timeouts"] == 1
    prefill.connector.close()


def test_unreachable_store_is_a_miss_and_never_an_error():
    model = tiny_model()
    ids = prompt(200)
    prefill = make_prefill(model, f"http://127.0.0.1:{closed_port()}?timeout=1s&connect_timeout=1s")
    for _ in range(2):
        out = prefill(ids)
        assert prefill.last_hit_tokens == 0
        assert_exact(out, plain_forward(model, ids), 0)
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
    assert_exact(out, plain_forward(model, ids), 0)
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
    assert_exact(out, plain_forward(model, ids), 0)
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
    assert_exact(out, plain_forward(model, ids), 192)
    prefill.connector.close()


def test_process_b_hits_what_process_a_saved(store_dir):
    """Two fresh interpreters: keys, namespace and weights agree across processes."""
    script = textwrap.dedent(f"""
        import json, sys, torch
        from connector import KVConnector
        from connector.hf import CachedPrefill, namespace_for
        from tests.connector_fixtures import prompt, plain_forward, tiny_model
        model = tiny_model()
        ids = prompt(200, seed=5)
        prefill = CachedPrefill(model, KVConnector("file://{store_dir}", namespace_for(model, 32)))
        out = prefill(ids)
        prefill.connector.close()
        ref = plain_forward(model, ids)
        exact = torch.equal(out.logits, ref.logits[:, prefill.last_hit_tokens:])
        print(json.dumps({{"hit": prefill.last_hit_tokens, "exact": exact}}))
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
    with torch.no_grad():
        ref = model(ids, use_cache=True, **kwargs)
    assert_exact(out, ref, 192)
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
    import time

    import httpx

    from connector.policy import LoadPolicy
    from tests.kvserver_fixtures import running_kvserver

    model = tiny_model()
    ids = prompt(200)
    ref = plain_forward(model, ids)
    where = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    try:
        with running_kvserver("--store", f"file://{store_dir}", "--unix-socket",
                              f"{where}/kv.sock") as server:
            # Every hit loads: the first load (the server verifying each file) is slow enough
            # that the adaptive policy would recompute this tiny model's prefix instead.
            prefill = make_prefill(model, f"http://localhost?unix_socket={where}/kv.sock",
                                   policy=LoadPolicy(adaptive=False))
            warm(prefill, ids)
            time.sleep(1.1)  # the server trusts a file it verified once its ctime is 1 s old
            prefill(ids)  # the server verifies each file as it first sends it ...
            hit = prefill(ids)  # ... and hands the files themselves over after that
            assert prefill.last_hit_tokens == 192
            assert_exact(hit, ref, 192)
            metrics = httpx.get(f"{server.url}/metrics").text
            passed = float(re.search(r"^kvstash_bytes_fd_passed_total (\S+)$", metrics, re.M)[1])
            assert passed >= 6 * prefill.layout.payload_nbytes
            prefill.connector.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)
