"""KvstashConnector's worker side on a GPU: vLLM's paged KV cache as CUDA tensors.

Skipped without CUDA. The test plays vLLM's model runner around each step (bind the
scheduler's metadata, the attention layers' hooks, `get_finished`) and builds that metadata
by hand, as the scheduler side would. The GPU is kept busy with a spin kernel (its work
queued on the stream the forward uses) while saves gather and loads place, so a copy that
is not ordered with the engine's stream, or a staging buffer reused before its copy ran,
shows up as wrong bits. Where vLLM is not installed (the GPU hosts these checks ran on have
no package registry, and its CUDA build is too large to carry), the connector is imported
against bench/vllm_standin.py; where it is, against vLLM itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bench import vllm_standin

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK = 16
CHUNK_BLOCKS = 4
LAYERS, HEADS, HEAD_DIM = 4, 8, 128
NUM_BLOCKS = 64
SPIN_CYCLES = 200_000_000  # ~0.1 s of one spinning GPU thread at ~2 GHz


def connector_module():
    return vllm_standin.import_connector()


def make_worker(store: str, layout: str, load_mode: str = "async", **extra):
    """A worker-role connector and its paged KV cache on the GPU: `flash` is vLLM's
    FlashAttention shape per layer `(2, blocks, block_size, heads, head_dim)`, `blocks` the
    newer `(blocks, 2, block_size, heads, head_dim)`."""
    mod = connector_module()
    cfg = vllm_standin.worker_config(store, BLOCK, model="test/cuda-llama",
                                     chunk_tokens=CHUNK_BLOCKS * BLOCK, load_mode=load_mode,
                                     adaptive=False, **extra)
    worker = mod.KvstashConnector(cfg, mod.KVConnectorRole.WORKER, SimpleNamespace(num_blocks=NUM_BLOCKS))
    shape = ((2, NUM_BLOCKS) if layout == "flash" else (NUM_BLOCKS, 2)) + (BLOCK, HEADS, HEAD_DIM)
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.bfloat16,
                                                          device="cuda")
          for i in range(LAYERS)}
    worker.register_kv_caches(kv)
    return worker, kv


def block_dim(layout: str) -> int:
    return 1 if layout == "flash" else 0


def chunks_of(mod, seed: int, block_ids: list[list[int]], first: int = 0):
    """ChunkRefs of a prompt (its tokens and vLLM-like block hashes from `seed`)."""
    out = []
    for i, ids in enumerate(block_ids):
        tokens = np.arange(len(ids) * BLOCK, dtype="<u4") + seed * 100_000 + i * 1000
        out.append(mod.ChunkRef(block_hash=f"{seed}:{i}".encode().ljust(32, b"."),
                                token_bytes=tokens.tobytes(), block_ids=list(ids),
                                first=first if i == 0 else 0))
    return out


def blocks(kv: dict, layout: str, ids: list[int]) -> list[torch.Tensor]:
    """Every layer's `ids` blocks, copied to the host, as int16 (bits, not values)."""
    idx = torch.tensor(ids, device="cuda")
    return [t.index_select(block_dim(layout), idx).view(torch.int16).cpu() for t in kv.values()]


def save_step(mod, worker, kv: dict, layout: str, saves: list) -> None:
    """One step whose forward writes the chunks' blocks and saves them: the blocks are
    written by kernels queued behind a spin, so only a gather ordered after them (and a
    writer that waits for its copies) saves these bits."""
    worker.bind_connector_metadata(mod.KvstashMetadata(saves=saves))
    torch.cuda._sleep(SPIN_CYCLES)
    gen = torch.Generator(device="cuda").manual_seed(len(saves[0].chunks))
    for name, t in kv.items():  # each attention layer writes its K/V, then the hook
        for req in saves:
            for chunk in req.chunks:
                idx = torch.tensor(chunk.block_ids, device="cuda")
                shape = list(t.shape)
                shape[block_dim(layout)] = len(idx)
                fill = torch.randn(shape, device="cuda", generator=gen).to(t.dtype)
                t.index_copy_(block_dim(layout), idx, fill)
        worker.save_kv_layer(name, t, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def load_step(mod, worker, kv: dict, loads: list, sync: bool) -> set:
    """One step with `loads` (vLLM's order: start_load_kv before the forward for layerwise
    loads, after it otherwise), the GPU kept busy meanwhile; then steps, each read back
    before the next as vLLM reads back its sampled tokens, until every load is reported
    done. Returns the block ids reported as failed."""
    worker.bind_connector_metadata(mod.KvstashMetadata(loads=loads))
    if sync:
        worker.start_load_kv(None)
    for name in kv:
        worker.wait_for_layer_load(name)
        torch.cuda._sleep(SPIN_CYCLES // LAYERS)  # the layer's kernels
    if not sync:
        worker.start_load_kv(None)
    worker.wait_for_save()
    pending = set() if sync else {req.req_id for req in loads}  # sync: done in the step
    errors: set = set()
    for _ in range(2000):
        _, done = worker.get_finished(set())
        errors |= worker.get_block_ids_with_load_errors()
        pending -= done or set()
        worker.clear_connector_metadata()
        if not pending:
            break
        worker.bind_connector_metadata(mod.KvstashMetadata())
        torch.cuda._sleep(SPIN_CYCLES // 10)  # other requests' steps
        worker.wait_for_save()
        torch.cuda.current_stream().synchronize()  # the step's sampled tokens are read back
    assert not pending, f"loads never reported done: {pending}"
    return errors


def saved(tmp_path, layout: str, prompts: dict[int, list[list[int]]]):
    """A store holding each prompt's chunks, saved from a first worker's GPU blocks, and
    the bits of those blocks."""
    mod = connector_module()
    store = f"file://{tmp_path}/kv"
    worker, kv = make_worker(store, layout)
    expected = {}
    try:
        for seed, ids in prompts.items():
            save_step(mod, worker, kv, layout, [mod.ReqChunks(f"w{seed}", chunks_of(mod, seed, ids))])
            assert worker.flush(), "saves not written"
            expected[seed] = [blocks(kv, layout, c) for c in ids]
        assert worker.counters["save_drops"] == 0
    finally:
        worker.shutdown()
    return store, expected


@pytest.mark.parametrize("layout", ["flash", "blocks"])
@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_chunks_saved_from_gpu_blocks_load_bit_identical_into_other_blocks(
        tmp_path, layout, load_mode):
    mod = connector_module()
    store, expected = saved(tmp_path, layout, {1: [[1, 2, 3, 4], [5, 6, 7, 8]]})
    worker, kv = make_worker(store, layout, load_mode)
    try:
        target = [[40, 41, 42, 43], [20, 9, 33, 11]]  # one run, one scattered
        sync = load_mode == "layerwise"
        req = mod.ReqChunks("r", chunks_of(mod, 1, target), deadline_s=30.0, sync=sync)
        assert load_step(mod, worker, kv, [req], sync) == set()
        for want, ids in zip(expected[1], target, strict=True):
            for a, b in zip(want, blocks(kv, layout, ids), strict=True):
                assert torch.equal(a, b)
        print(f"staging kind: {worker.core.staging_kind(torch.device('cuda'))}, "
              f"backend: {getattr(worker.core.chunk_io, 'cuda_backend', None)}")
    finally:
        worker.shutdown()


@pytest.mark.parametrize("layout", ["flash"])
def test_back_to_back_loads_reusing_staging_while_the_gpu_is_busy_each_get_their_own_bits(
        tmp_path, layout):
    """Three prompts loaded one step after another through one worker's staging pool, the
    GPU busy behind each: a buffer handed to the next load before the last one's copy out
    of it ran would leave the next prompt's bits in the last one's blocks."""
    mod = connector_module()
    prompts = {s: [[4 * s + 1 + b for b in range(4)]] for s in range(3)}
    store, expected = saved(tmp_path, layout, prompts)
    worker, kv = make_worker(store, layout, "async", max_in_flight=1)
    try:
        targets = {0: [[50, 51, 52, 53]], 1: [[30, 31, 32, 33]], 2: [[60, 61, 62, 63]]}
        for seed in prompts:
            req = mod.ReqChunks(f"r{seed}", chunks_of(mod, seed, targets[seed]), deadline_s=30.0)
            assert load_step(mod, worker, kv, [req], sync=False) == set()
        torch.cuda.synchronize()
        for seed, ids in targets.items():
            for a, b in zip(expected[seed][0], blocks(kv, layout, ids[0]), strict=True):
                assert torch.equal(a, b), f"prompt {seed}'s blocks hold other bits"
    finally:
        worker.shutdown()


def test_blocks_computed_locally_and_the_null_block_are_left_alone(tmp_path):
    """A load that starts past the chunk's first block (vLLM's own cache held it) and a
    chunk with the null block (0, outside a sliding window): only the other blocks are
    written."""
    layout = "flash"
    mod = connector_module()
    store, expected = saved(tmp_path, layout, {7: [[1, 2, 3, 4], [5, 6, 7, 8]]})
    worker, kv = make_worker(store, layout)
    try:
        for t in kv.values():
            t.fill_(1.5)
        target = [[10, 11, 12, 13], [0, 15, 16, 17]]
        req = mod.ReqChunks("r", chunks_of(mod, 7, target, first=1), deadline_s=30.0)
        assert load_step(mod, worker, kv, [req], sync=False) == set()
        untouched = blocks(kv, layout, [10, 0])
        for layer in untouched:
            assert torch.equal(layer, torch.full_like(layer, torch.tensor(1.5, dtype=torch.bfloat16)
                                                      .view(torch.int16).item()))
        for want, got in zip(expected[7][0], blocks(kv, layout, [10, 11, 12, 13]), strict=True):
            assert torch.equal(want.narrow(block_dim(layout), 1, 3),
                               got.narrow(block_dim(layout), 1, 3))
        for want, got in zip(expected[7][1], blocks(kv, layout, [0, 15, 16, 17]), strict=True):
            assert torch.equal(want.narrow(block_dim(layout), 1, 3),
                               got.narrow(block_dim(layout), 1, 3))
    finally:
        worker.shutdown()


def test_a_corrupt_chunk_is_reported_by_its_blocks_and_the_others_load(tmp_path):
    layout = "flash"
    mod = connector_module()
    store, expected = saved(tmp_path, layout, {3: [[1, 2, 3, 4]], 4: [[5, 6, 7, 8]]})
    second = chunks_of(mod, 4, [[24, 25, 26, 27]])
    hit = [p for p in (tmp_path / "kv").rglob("*.kv")
           if second[0].token_bytes in p.read_bytes()]
    assert len(hit) == 1
    data = bytearray(hit[0].read_bytes())
    data[-1] ^= 0xFF  # one payload bit: the header stays valid
    hit[0].chmod(0o644)
    hit[0].write_bytes(bytes(data))
    worker, kv = make_worker(store, layout)
    try:
        req = mod.ReqChunks("r", chunks_of(mod, 3, [[20, 21, 22, 23]]) + second,
                            deadline_s=30.0)
        assert load_step(mod, worker, kv, [req], sync=False) == {24, 25, 26, 27}
        for want, got in zip(expected[3][0], blocks(kv, layout, [20, 21, 22, 23]), strict=True):
            assert torch.equal(want, got)
    finally:
        worker.shutdown()


def test_a_load_is_placed_after_work_queued_on_the_engines_stream_before_its_step(tmp_path):
    """Work the engine queued before the step that starts a load (a forward that last wrote
    those blocks, still running behind a busy GPU) happens before the load's copies: the
    blocks end up with the loaded bits, not with what that work wrote."""
    layout = "flash"
    mod = connector_module()
    store, expected = saved(tmp_path, layout, {5: [[1, 2, 3, 4]]})
    worker, kv = make_worker(store, layout)
    try:
        target = [[30, 31, 32, 33]]
        idx = torch.tensor(target[0], device="cuda")
        torch.cuda._sleep(SPIN_CYCLES)
        for t in kv.values():  # queued behind the spin, before the step's metadata is bound
            t.index_fill_(block_dim(layout), idx, 7.0)
        req = mod.ReqChunks("r", chunks_of(mod, 5, target), deadline_s=30.0)
        assert load_step(mod, worker, kv, [req], sync=False) == set()
        for want, got in zip(expected[5][0], blocks(kv, layout, target[0]), strict=True):
            assert torch.equal(want, got)
    finally:
        worker.shutdown()


def test_a_layerwise_load_is_placed_on_the_engines_own_stream(tmp_path, monkeypatch):
    """vLLM computes on a stream of its own (vllm.utils.torch_utils.current_stream: a CUDA
    graph cannot be captured on the default stream), created non-blocking as every torch
    stream: it does not wait for the default stream of the I/O threads that place a
    layerwise load's layers. Each layer is queued on the engine's stream, so what each
    attention layer reads there, as it runs, is the chunk's bits."""
    layout = "flash"
    mod = connector_module()
    store, expected = saved(tmp_path, layout, {5: [[1, 2, 3, 4], [5, 6, 7, 8]]})
    worker, kv = make_worker(store, layout, "layerwise")
    engine = torch.cuda.Stream()
    streams = []
    place = mod.place_blocks

    def recording(*args, **kwargs):
        streams.append(torch.cuda.current_stream())
        return place(*args, **kwargs)

    monkeypatch.setattr(mod, "place_blocks", recording)
    target = [[40, 41, 42, 43], [20, 9, 33, 11]]
    seen = {}
    try:
        req = mod.ReqChunks("r", chunks_of(mod, 5, target), deadline_s=30.0, sync=True)
        with torch.cuda.stream(engine):
            idx = torch.tensor([b for ids in target for b in ids], device="cuda")
            worker.bind_connector_metadata(mod.KvstashMetadata(loads=[req]))
            worker.start_load_kv(None)
            for name, t in kv.items():  # each attention layer reads its blocks
                worker.wait_for_layer_load(name)
                torch.cuda._sleep(SPIN_CYCLES // LAYERS)
                seen[name] = t.index_select(block_dim(layout), idx)
            worker.wait_for_save()
            worker.get_finished(set())
            assert worker.get_block_ids_with_load_errors() == set()
            worker.clear_connector_metadata()
        torch.cuda.synchronize()
    finally:
        worker.shutdown()
    assert streams and all(s == engine for s in streams)
    for li, name in enumerate(kv):
        want = torch.cat([expected[5][c][li] for c in range(2)], dim=block_dim(layout))
        assert torch.equal(seen[name].view(torch.int16).cpu(), want), f"layer {name}"
