"""The canonical chunk payload over real tensors: head-major layer parts, a rank's heads as
one byte range per layer, each range read alone and verified per (layer, head) segment.

The vLLM side (`HeadMajorKv`) is driven here over CPU tensors shaped as vLLM 0.32 hands
them to a worker (`[blocks, heads, block_size, cell]`, in its CPU backend's and
FlashAttention's K/V splits); two worker-side objects holding heads 0-1 and 2-3 of one
cache stand for two tensor-parallel ranks in one process (the real engines at TP=2 are in
tests/test_vllm_tp.py). Stores are real: memory://, file:// on a temporary directory, s3:// (moto) and http:// (a
kvserver subprocess), all on loopback.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from connector import KVConnector
from connector.layout import CANON, CanonLayout
from connector.vllm_cache import HeadMajorKv, HeadShare
from connector.vllm_meta import ChunkRef
from connector.vllm_worker import assemble_heads
from hashing import Namespace, chunk_keys
from storage.codec import ChunkError, decode_chunk, encode_chunk

LAYERS, HEADS, DIM, BLOCK, CHUNK_BLOCKS = 3, 4, 8, 16, 2
CHUNK = BLOCK * CHUNK_BLOCKS
CANONICAL = CanonLayout(((HEADS, 2, DIM),) * LAYERS, CHUNK, "bfloat16")
TOKENS = np.arange(500, 500 + 3 * CHUNK)


def namespace() -> Namespace:
    return Namespace(model="test/canon", dtype="bfloat16", layout=CANONICAL.name,
                     chunk_tokens=CHUNK, salt=uuid.uuid4().hex)


def payload(i: int) -> np.ndarray:
    """Chunk i's canonical payload: bf16 values that differ in every byte position."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 255, CANONICAL.payload_nbytes, dtype=np.uint8)


def head_range(i: int, layer: int, first: int, count: int) -> bytes:
    """What `payload(i)` holds for heads first..first+count-1 of `layer`."""
    off = CANONICAL.layer_offsets[layer] + first * CANONICAL.head_nbytes(layer)
    return payload(i)[off : off + count * CANONICAL.head_nbytes(layer)].tobytes()


class Staging:
    def __init__(self, n: int, nbytes: int):
        self.bufs = [np.zeros(nbytes, dtype=np.uint8) for _ in range(n)]

    def staging(self, i: int) -> np.ndarray:
        return self.bufs[i]

    def place(self, i: int) -> None:
        pass


pytest_plugins = ("tests.ranged_store_fixtures",)  # store_url: memory, file, s3, http


def test_the_payload_is_head_major_with_one_segment_per_layer_and_head():
    blob = encode_chunk(f"{'0' * 16}/{'1' * 32}", TOKENS[:CHUNK], payload(0),
                        CANONICAL.meta(), segments=CANONICAL.segments)
    header = decode_chunk(blob).header
    assert header.meta["layout"] == CANON
    assert len(header.segments) == LAYERS * HEADS
    head = 2 * CHUNK * DIM * 2  # K and V of one head, bf16
    assert [n for _, n, _ in header.segments] == [head] * (LAYERS * HEADS)
    # a rank's heads of a layer: one run of whole segments; a half head is none
    assert header.span_segments(CANONICAL.layer_offsets[1] + 2 * head, 2 * head) == range(6, 8)
    assert header.span_segments(head // 2, head) is None


def keys_and_tokens(ns: Namespace) -> tuple[list[str], list[list[int]]]:
    """TOKENS' chunk keys under `ns`, and each chunk's token ids."""
    keys = chunk_keys(TOKENS, ns)
    return keys, [TOKENS[i * CHUNK : (i + 1) * CHUNK] for i in range(len(keys))]


def assert_heads_2_3(target: Staging) -> None:
    """Each chunk's staging holds exactly heads 2-3 of every layer, in layer order."""
    for i, buf in enumerate(target.bufs):
        assert buf.tobytes() == b"".join(head_range(i, layer, 2, 2) for layer in range(LAYERS))


def test_a_rank_reads_its_heads_of_every_layer_and_nothing_else(store_url):
    """A reader of heads 2-3 (rank 1 of TP=2) loads chunks a writer of every head saved:
    its staging holds exactly those heads' bytes of each layer, and it counts its share
    of each chunk as read, not the whole chunk."""
    ns = namespace()
    reader_layout = CANONICAL.reader([(2, 2)] * LAYERS)
    assert reader_layout.partial and reader_layout.staging_nbytes * 2 == CANONICAL.payload_nbytes

    keys, tokens = keys_and_tokens(ns)
    with (KVConnector(store_url, ns, layout=CANONICAL.reader()) as writer,
          KVConnector(store_url, ns, layout=reader_layout, partial_reads="ranges") as reader):
        writer.save(TOKENS, payload)
        assert writer.flush(10)
        target = Staging(len(keys), reader_layout.staging_nbytes)
        assert reader.load_async(keys, tokens, target).result(10) == [True] * 3
        assert_heads_2_3(target)
        assert reader.counters()["hit_bytes"] == 3 * reader_layout.staging_nbytes


def test_by_default_a_rank_reads_ranges_on_this_host_and_whole_chunks_over_a_network(
        store_url):
    """`partial_reads="auto"` (the default): a reader of half the heads reads its ranges
    where the chunks are on this host (memory://, file://) and each chunk whole where a
    ranged read is a network request (s3://, http://), keeping its heads either way."""
    ns = namespace()
    layout = CANONICAL.reader([(2, 2)] * LAYERS)
    keys, tokens = keys_and_tokens(ns)
    with (KVConnector(store_url, ns, layout=CANONICAL.reader()) as writer,
          KVConnector(store_url, ns, layout=layout) as reader):
        writer.save(TOKENS, payload)
        assert writer.flush(10)
        target = Staging(len(keys), layout.staging_nbytes)
        assert reader.load_async(keys, tokens, target).result(10) == [True] * 3
        assert_heads_2_3(target)
        local = store_url.startswith(("memory://", "file://"))
        per_chunk = layout.staging_nbytes if local else CANONICAL.payload_nbytes
        assert reader.counters()["hit_bytes"] == 3 * per_chunk


@pytest.mark.parametrize("layered", [False, True])
def test_a_rank_may_read_whole_chunks_and_keep_its_heads(moto_s3_url, layered):
    """`partial_reads="whole"` (for stores whose requests cost more than their bytes): one
    read per chunk, of which the reader keeps its heads' ranges; an async and a layered
    load alike."""
    from tests.s3_fixtures import with_prefix

    url = with_prefix(moto_s3_url)
    ns = namespace()
    layout = CANONICAL.reader([(2, 2)] * LAYERS)
    keys, tokens = keys_and_tokens(ns)
    with (KVConnector(url, ns, layout=CANONICAL.reader()) as writer,
          KVConnector(url, ns, layout=layout, partial_reads="whole") as reader):
        writer.save(TOKENS, payload)
        assert writer.flush(10)
        target = Staging(len(keys), layout.staging_nbytes)
        if layered:
            target.place_segment = lambda i, s: None
            handle = reader.load_segments_async(keys, tokens, target)
        else:
            handle = reader.load_async(keys, tokens, target)
        assert handle.result(10) == [True] * 3
        assert_heads_2_3(target)
        assert reader.counters()["hit_bytes"] == 3 * CANONICAL.payload_nbytes  # all read


def test_a_corrupt_head_fails_the_readers_of_it_and_no_other(tmp_path: Path):
    """One byte of layer 1, head 0 flipped in every chunk file: the readers of heads 0-1
    miss every chunk (they verify that segment), the readers of heads 2-3 load them all
    (their segments are intact and they read nothing else)."""
    ns = namespace()
    url = f"file://{tmp_path}/kv"
    with KVConnector(url, ns, layout=CANONICAL.reader()) as writer:
        writer.save(TOKENS, payload)
        assert writer.flush(10)
    for path in (tmp_path / "kv").rglob("*.kv"):
        data = bytearray(path.read_bytes())
        header_len = len(data) - CANONICAL.payload_nbytes
        data[header_len + CANONICAL.layer_offsets[1] + 5] ^= 0x40
        path.chmod(0o644)
        path.write_bytes(bytes(data))
    keys, tokens = keys_and_tokens(ns)
    results = {}
    for first in (2, 0):  # the intact readers first: the file store quarantines a bad chunk
        layout = CANONICAL.reader([(first, 2)] * LAYERS)
        with KVConnector(url, ns, layout=layout, resident_reads=False) as reader:
            target = Staging(len(keys), layout.staging_nbytes)
            results[first] = reader.load_async(keys, tokens, target).result(10)
            if first == 2:
                assert reader.counters()["verify_failures"] == 0
            else:
                assert reader.counters()["verify_failures"] >= 1
    assert results == {2: [True] * 3, 0: [False] * 3}


def test_a_span_that_is_not_whole_segments_never_verifies():
    blob = encode_chunk(f"{'0' * 16}/{'1' * 32}", TOKENS[:CHUNK], payload(0),
                        CANONICAL.meta(), segments=CANONICAL.segments)
    header = decode_chunk(blob).header
    body = memoryview(blob)[header.header_len :]
    head = CANONICAL.head_nbytes(0)
    header.verify_span(head, body[head : 3 * head])
    with pytest.raises(ChunkError):
        header.verify_span(head + 2, body[head + 2 : 3 * head])
    with pytest.raises(ChunkError):
        header.verify_span(head, bytes(2 * head))


# -- vLLM's paged KV cache <-> the canonical payload ---------------------------------------

NUM_BLOCKS = 8
SPLITS = {"block": "CPU_ATTN (K rows then V rows of a block, per head)",
          "token": "FLASH_ATTN (K then V of each token)"}


def vllm_cache(split: str, nhd: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per layer vLLM's `[blocks, heads, block_size, 2 * head_dim]` of random bf16 values;
    `nhd`: stored token-major (FlashAttention's NHD: vLLM's LBNHC stride order)."""
    torch.manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        if nhd:
            t = torch.randn(NUM_BLOCKS, BLOCK, HEADS, 2 * DIM).to(torch.bfloat16).transpose(1, 2)
        else:
            t = torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM).to(torch.bfloat16)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def canonical_of(cache: dict[str, torch.Tensor], split: str, blocks: list[int]) -> bytes:
    """The canonical payload of the chunk in `blocks`, computed from the definition."""
    parts = []
    for t in cache.values():
        if split == "block":
            kv = t.contiguous().view(NUM_BLOCKS, HEADS, 2, BLOCK, DIM)  # [b, h, kv, n, d]
        else:
            kv = t.unflatten(3, (2, DIM)).permute(0, 1, 3, 2, 4)
        chunk = kv[blocks]  # [k, h, kv, n, d]
        parts.append(chunk.permute(1, 2, 0, 3, 4).reshape(HEADS, 2, CHUNK, DIM).contiguous())
    return b"".join(p.view(torch.uint8).numpy().tobytes() for p in parts)


def rank_kv(cache: dict[str, torch.Tensor], first: int, count: int) -> dict[str, torch.Tensor]:
    """A tensor-parallel rank's cache: heads first..first+count-1 of each layer (a copy)."""
    return {n: t[:, first : first + count].clone() for n, t in cache.items()}


def head_major(cache: dict[str, torch.Tensor], split: str, first: int = 0) -> HeadMajorKv:
    return HeadMajorKv(cache, CHUNK_BLOCKS, BLOCK, "bfloat16",
                       HeadShare(HEADS, first, {n: split for n in cache}))


def gather(kv: HeadMajorKv, blocks: list[int]) -> torch.Tensor:
    """What the worker's save step does: every layer of the chunk into its staging."""
    from connector.vllm_cache import gather_blocks

    buf = torch.zeros(kv.chunk_nbytes, dtype=torch.uint8)
    for i in range(len(kv.layers)):
        if not kv.copy_out(buf, blocks, i):
            for layer, t, view in kv.views(buf, len(blocks), i):
                gather_blocks(t, layer.block_dim, blocks, view)
    return buf


@pytest.mark.parametrize("split, nhd", [("block", False), ("token", False), ("token", True)])
def test_a_chunk_gathered_from_vllms_blocks_is_the_canonical_payload(split, nhd):
    cache = vllm_cache(split, nhd)
    blocks = [5, 2]
    kv = head_major(cache, split)
    assert kv.whole and kv.layout().staging_nbytes == CANONICAL.payload_nbytes
    assert gather(kv, blocks).numpy().tobytes() == canonical_of(cache, split, blocks)


@pytest.mark.parametrize("split", list(SPLITS))
def test_two_ranks_heads_assemble_the_chunk_one_rank_of_every_head_saves(split):
    """Ranks holding heads 0-1 and 2-3 of the same cache: the writer's assembly of their
    staging is bit for bit the chunk a TP=1 worker gathers."""
    cache = vllm_cache(split, seed=3)
    blocks = [1, 2]
    ranks = [head_major(rank_kv(cache, 2 * r, 2), split, first=2 * r) for r in range(2)]
    whole = torch.empty(CANONICAL.payload_nbytes, dtype=torch.uint8)
    assemble_heads(ranks[0], [gather(r, blocks) for r in ranks], whole)
    assert whole.numpy().tobytes() == canonical_of(cache, split, blocks)


def test_ranks_that_replicate_a_head_assemble_each_head_once():
    """TP=8 over 4 KV heads: vLLM gives ranks 2h and 2h+1 head h each; the writer takes
    each head once, from the first rank holding it."""
    cache = vllm_cache("block", seed=7)
    blocks = [0, 7]
    ranks = [head_major(rank_kv(cache, r // 2, 1), "block", first=r // 2) for r in range(8)]
    whole = torch.empty(CANONICAL.payload_nbytes, dtype=torch.uint8)
    assemble_heads(ranks[0], [gather(r, blocks) for r in ranks], whole)
    assert whole.numpy().tobytes() == canonical_of(cache, "block", blocks)


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_chunk_loads_into_a_rank_of_another_tp_degree_bit_for_bit(split, tmp_path):
    """A chunk saved whole (TP=1) is read by rank 1 of TP=2 (its two heads' range of each
    layer, file://) and placed into its own blocks: they equal heads 2-3 of the writer's
    blocks; its other blocks are untouched."""
    writer_cache = vllm_cache(split, seed=5)
    writer = head_major(writer_cache, split)
    blocks = [3, 4]
    ns = namespace()
    keys = chunk_keys(TOKENS[:CHUNK], ns)
    url = f"file://{tmp_path}/kv"
    with KVConnector(url, ns, layout=writer.layout()) as saver:
        saver.write(keys, [TOKENS[:CHUNK]], lambda i: gather(writer, blocks).numpy())
        assert saver.flush(10)
    reader_cache = {n: torch.zeros(NUM_BLOCKS, 2, BLOCK, 2 * DIM, dtype=torch.bfloat16)
                    for n in writer_cache}
    reader = head_major(reader_cache, split, first=2)
    staged = torch.zeros(reader.chunk_nbytes, dtype=torch.uint8)
    ref = ChunkRef(block_hash=b"x" * 32, token_bytes=TOKENS[:CHUNK].astype("<u4").tobytes(),
                   block_ids=[6, 1])

    class Target:
        def staging(self, i: int) -> torch.Tensor:
            return staged

        def place(self, i: int) -> None:
            reader.place(ref, staged)

    for resident in (True, False):
        for t in reader_cache.values():
            t.zero_()
        with KVConnector(url, ns, layout=reader.layout(), resident_reads=resident) as loader:
            assert loader.load_async(keys, [TOKENS[:CHUNK]], Target()).result(10) == [True]
            assert loader.counters()["hit_bytes"] == CANONICAL.payload_nbytes // 2
        for name, t in reader_cache.items():
            assert torch.equal(t[[6, 1]], writer_cache[name][blocks][:, 2:4])
            assert not t[[0, 2, 3, 4, 5, 7]].any()


def test_a_chunk_is_placed_into_a_cpu_cache_with_no_tensor_view_made_per_chunk(monkeypatch):
    """A verified chunk in staging is placed into vLLM's CPU cache (its blocks not
    consecutive, the first one computed locally) bit for bit, other blocks untouched,
    through byte arrays built at registration: no torch view is made per chunk (those
    views, per layer, cost more than the chunk's copy); the same chunk placed whole
    (TP=1 staging, as a chunk read over a network or not in the page cache is). vLLM's
    CPU backend's split: K rows then V rows of a block, per head."""
    split = "block"
    cache = vllm_cache(split, seed=13)
    src_blocks = [3, 4]
    chunk = torch.frombuffer(bytearray(canonical_of(cache, split, src_blocks)), dtype=torch.uint8)
    target = {n: torch.zeros_like(t) for n, t in cache.items()}
    kv = head_major(target, split)

    def no_views(*args, **kwargs):
        raise AssertionError("a torch view made per chunk")

    monkeypatch.setattr(torch.Tensor, "permute", no_views)
    kv.place(ChunkRef(block_hash=b"x" * 32, token_bytes=b"", block_ids=[6, 1]), chunk)
    kv.place(ChunkRef(block_hash=b"x" * 32, token_bytes=b"", block_ids=[5, 7], first=1), chunk)
    monkeypatch.undo()
    for name, t in target.items():
        assert torch.equal(t[[6, 1]].view(torch.int16), cache[name][src_blocks].view(torch.int16))
        assert torch.equal(t[7].view(torch.int16), cache[name][4].view(torch.int16))
        assert not t[[0, 2, 3, 4, 5]].view(torch.int16).any()  # 5: computed locally


def test_the_hf_adapter_stores_and_loads_the_canonical_payload(tmp_path: Path):
    """A transformers model's chunk holds, per layer and KV head, K then V of its tokens
    as the model computed them (the same format the vLLM connector writes); a fresh
    prefill loads it and continues like the model's own forward."""
    from connector.hf import CachedPrefill
    from tests.connector_fixtures import CHUNK as HF_CHUNK
    from tests.connector_fixtures import plain_forward, prompt, test_namespace, tiny_model

    model = tiny_model()
    ns = test_namespace(model)
    ids = prompt(HF_CHUNK + 5)
    url = f"file://{tmp_path}/kv"
    with KVConnector(url, ns) as conn:
        CachedPrefill(model, conn)(ids)
        assert conn.flush(10)
    (path,) = (tmp_path / "kv").rglob("*.kv")
    chunk = decode_chunk(path.read_bytes())
    assert chunk.meta == {"layout": CANON, "dtype": "float32", "tokens": HF_CHUNK,
                          "layers": [[2, 2, 64]] * 2}
    full = plain_forward(model, ids).past_key_values
    payload = np.frombuffer(bytes(chunk.payload), dtype=np.float32).reshape(2, 2, 2, HF_CHUNK, 64)
    for layer in range(2):
        keys, values = full.layers[layer].keys, full.layers[layer].values  # [1, heads, T, D]
        for h in range(2):
            assert np.array_equal(payload[layer, h, 0], keys[0, h, :HF_CHUNK].numpy())
            assert np.array_equal(payload[layer, h, 1], values[0, h, :HF_CHUNK].numpy())
    with KVConnector(url, ns) as conn:
        prefill = CachedPrefill(model, conn)
        out = prefill(ids)
        assert prefill.last_hit_tokens == HF_CHUNK
    # against a full forward: within the kernels' reduction-order noise (contract (3))
    assert np.allclose(out.logits[0, -1].numpy(), plain_forward(model, ids).logits[0, -1].numpy(),
                       atol=1e-4)
