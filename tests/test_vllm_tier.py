"""KvstashTier under vLLM's real TieringOffloadingManager (CPU primary tier + our secondary tier).

Fake only what needs CUDA: the GPU -> CPU copy that fills a primary-tier page is a write of
known bytes into vLLM's shared CPU region, and reading a loaded page back stands in for the
CPU -> GPU copy. Everything else is vLLM's own code (0.32 or 0.33): the spec, the tier factory
(out-of-tree `type` + `module_path`), the manager's cascades, promotions and lookups.
"""

from __future__ import annotations

import contextlib
import os

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (scripts/install-engines.sh)")

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from connector.vllm_tier import KvstashTier  # noqa: E402
from tests.engines_fixtures import (  # noqa: E402
    corrupt_chunks,
    engine_store_url,
    make_request,
    offloading_config,
    wait_until,
)

pytest_plugins = ("tests.s3_fixtures",)  # moto_s3_url, for the s3 store cases

NO_CHANGES = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def locked(manager):
    """The manager's lock where vLLM has one (0.33); 0.32's manager is single-threaded by
    ownership (its scheduler thread alone calls it), so there is nothing to hold."""
    return getattr(manager, "lock", None) or contextlib.nullcontext()


def new_manager(store, **kw):
    spec = TieringOffloadingSpec(offloading_config(store, **kw))
    manager = spec.get_manager()
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, KvstashTier)
    return manager


def page_rows(manager, chunk_ids):
    """The bytes of primary-tier pages, as the CPU -> GPU copy would read them."""
    view = manager.primary_tier.get_kv_memoryview()
    row = view.strides[0]
    with view.cast("B") as flat:
        return [bytes(flat[int(c) * row : (int(c) + 1) * row]) for c in chunk_ids]


def offload(manager, keys, req_id="writer"):
    """One request computes `keys`: vLLM stores them to CPU, then cascades to our tier."""
    ctx = ReqContext(req_id=req_id)
    with locked(manager):
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
    view = manager.primary_tier.get_kv_memoryview()
    row = view.strides[0]
    pages = {}
    with view.cast("B") as flat:
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            pages[key] = os.urandom(row)  # the GPU -> CPU copy of vLLM's CUDA worker
            flat[int(chunk) * row : (int(chunk) + 1) * row] = pages[key]
    with locked(manager):
        manager.complete_store(keys, ctx)
        manager.on_request_finished(ctx)

    def step():
        with locked(manager):
            manager.on_schedule_end(NO_CHANGES)
            return not manager.has_pending_work()

    wait_until(step)
    return pages


def lookup_until_settled(manager, keys, req_id="reader"):
    """Step a scheduler that asks for `keys` until every lookup is HIT or MISS."""
    ctx = ReqContext(req_id=req_id)
    with locked(manager):
        manager.on_new_request(ctx)
    seen = set()
    answers = []

    def step():
        nonlocal answers
        with locked(manager):
            answers = [manager.lookup(k, ctx) for k in keys]
            seen.update(answers)
            manager.on_schedule_end(NO_CHANGES)
        return all(a in (LookupResult.HIT, LookupResult.MISS) for a in answers)

    wait_until(step)
    return ctx, answers, seen


@pytest.fixture(params=["memory", "file", "s3"])
def store_url(request, tmp_path):
    return engine_store_url(request, tmp_path)


def test_pages_saved_by_one_engine_load_into_another(store_url):
    keys = [make_offload_key(h, 0) for h in make_request(list(range(100))).block_hashes]
    writer = new_manager(store_url)
    try:
        saved = offload(writer, keys)
        # vLLM's hashes are the keys; the store holds one chunk per page
        tier = writer.secondary_tiers[0]
        stored = tier.core.run(tier.core.store.exists(tier.store_keys(keys)), 10)
        # The reader starts before the writer shuts down (a second engine on the same store).
        reader = new_manager(store_url)
    finally:
        writer.shutdown()
    assert stored == [True] * len(keys)
    try:
        ctx, answers, seen = lookup_until_settled(reader, keys)
        assert answers == [LookupResult.HIT] * len(keys)
        assert LookupResult.RETRY in seen, "the first lookup must not block on the store"
        with locked(reader):
            spec = reader.prepare_load(keys, ctx)
        assert page_rows(reader, spec.chunk_ids) == [saved[k] for k in keys]
    finally:
        reader.shutdown()


def test_unknown_prefix_is_a_miss_after_one_retry(store_url):
    keys = [make_offload_key(h, 0) for h in make_request(list(range(7, 71))).block_hashes]
    reader = new_manager(store_url)
    try:
        _, answers, seen = lookup_until_settled(reader, keys)
    finally:
        reader.shutdown()
    assert answers == [LookupResult.MISS] * len(keys)
    assert LookupResult.RETRY in seen


def test_corrupt_pages_become_misses_not_errors(tmp_path):
    url = f"file://{tmp_path}/kv"
    keys = [make_offload_key(h, 0) for h in make_request(list(range(64))).block_hashes]
    writer = new_manager(url)
    try:
        offload(writer, keys)
    finally:
        writer.shutdown()
    assert corrupt_chunks(tmp_path / "kv") == len(keys)

    reader = new_manager(url)
    try:
        _, answers, seen = lookup_until_settled(reader, keys)
    finally:
        reader.shutdown()
    # exists() said yes, the promotion failed verification, and the tier marked them missing
    assert LookupResult.RETRY in seen
    assert answers == [LookupResult.MISS] * len(keys)


def test_other_namespace_never_sees_the_pages(tmp_path):
    url = f"file://{tmp_path}/kv"
    keys = [make_offload_key(h, 0) for h in make_request(list(range(48))).block_hashes]
    writer = new_manager(url, salt="tenant-a")
    try:
        offload(writer, keys)
    finally:
        writer.shutdown()
    for other in (dict(salt="tenant-b"), dict(salt="tenant-a", page_bytes_per_block=4096)):
        reader = new_manager(url, **other)
        try:
            _, answers, _ = lookup_until_settled(reader, keys)
        finally:
            reader.shutdown()
        assert answers == [LookupResult.MISS] * len(keys)


def test_written_pages_are_announced_as_storage_events(tmp_path):
    keys = [make_offload_key(h, 0) for h in make_request(list(range(48))).block_hashes]
    writer = new_manager(f"file://{tmp_path}/kv", kv_events=True)
    try:
        offload(writer, keys)
        with locked(writer):
            events = [e for e in writer.take_events() if e.medium is Medium.STORAGE]
    finally:
        writer.shutdown()
    assert [k for e in events for k in e.keys] == keys
    assert not any(e.removed for e in events)


def test_store_url_is_required():
    with pytest.raises(ValueError, match="needs a 'store' URL"):
        new_manager("")


@pytest.mark.parametrize("option, message", [
    ({"max_in_flight": 0}, "max_in_flight=0 must be a positive whole number"),
    ({"lookup_timeout_s": "soon"}, "lookup_timeout_s='soon' must be a positive number"),
    ({"lookup_timeout": 2}, r"unknown option 'lookup_timeout' \(did you mean 'lookup_timeout_s'\?\)"),
])
def test_bad_options_are_refused_at_start_in_the_line_every_adapter_gives(option, message):
    """The tier takes the core's options under the names the vLLM connector and SGLang use
    (connector.options), checked the same way."""
    config = offloading_config("memory://")
    config.extra_config["secondary_tiers"][0].update(option)
    with pytest.raises(ValueError, match=f"^secondary tier 'KvstashTier': {message}") as err:
        TieringOffloadingSpec(config).get_manager()
    assert "\n" not in str(err.value)


def test_timeout_s_still_sets_the_lookup_timeout_and_the_load_deadline(caplog):
    """`timeout_s`, the tier's former name for both, is read with a deprecation warning."""
    manager = new_manager("memory://")  # offloading_config sets timeout_s=10
    (tier,) = manager.secondary_tiers
    try:
        assert (tier.core.lookup_timeout_s, tier.core.load_deadline_s) == (10, 10)
        assert "timeout_s is deprecated" in caplog.text
    finally:
        manager.shutdown()
