"""`KvstashTier`: a vLLM (>= 0.33) offloading secondary tier keeping CPU pages in a kvstash store.

vLLM's `OffloadingConnector` with `TieringOffloadingSpec` does the hashing, scheduling,
GPU <-> CPU copies, eviction and hybrid-model bookkeeping; this tier only moves whole
CPU-tier pages (one offload chunk of `blocks_per_chunk` blocks, all layers, all workers)
between vLLM's primary memoryview and any store URL (`file://`, `s3://`, `http://`, tiers).
It is loaded out of tree, with no vLLM patch:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592, "secondary_tiers": [{"type": "KvstashTier",
          "module_path": "connector.vllm_tier", "store": "file:///mnt/nfs/kv"}]}}'

Keys are vLLM's own offload keys (block hash + KV group), never recomputed, moved into our
key space under a `Namespace` built from the offloading config (model, cache dtype, page
bytes, tokens per hash, blocks per chunk, groups, parallel layout); see `tier_namespace`.

The tier runs on the engine core, `connector.KVConnector`: existence checks behind its
circuit breaker, verified loads (key, layout, checksum) through direct reads where the
store has them, write-behind stores, one set of counters (`KvstashTier.stats()`). vLLM's
offloading manager decides what to load, so the core's load-vs-recompute policy does
not apply here; its deadline does (`load_deadline_s`).

Threading contract (vLLM's): every method runs in the scheduler process under the tiering
manager's lock and must not block. `lookup` answers RETRY while an existence check is
pending; the checks of one step go to the store as one batch from vLLM's own
`AsyncLookupManager` thread. `submit_store` / `submit_load` only hand the pages to the
core (`write`, `load_async`); `get_finished_jobs` polls the futures. Any store failure
is a failed job (a store that is not written, a load that vLLM turns into a miss and
recomputes), never an exception into the scheduler.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from typing_extensions import override
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from connector.core import Buffers, KVConnector, LoadHandle
from connector.engine_io import StoreSpec
from connector.layout import EngineLayout
from connector.options import CORE_OPTIONS, CoreOptions, check_known
from hashing import Namespace, keys_from_block_hashes

log = logging.getLogger("vllm.kvstash.tier")  # vLLM shows only loggers under "vllm"

FORMAT = "vllm-offload-v1"

# The tier's own options, besides the core's (connector.options) and vLLM's `type`,
# `module_path` and `backpressure`. `timeout_s`, the former name of both
# `lookup_timeout_s` and `load_deadline_s`, is still read (with a warning).
TIER_OPTIONS = frozenset({"store", "salt", "enable_kv_events", "locality"})
DEPRECATED = {"timeout_s": ("lookup_timeout_s", "load_deadline_s")}


def tier_namespace(spec: OffloadingSpec, page_bytes: int, salt: str = "") -> Namespace:
    """Everything that makes two vLLM CPU pages with equal block hashes incompatible."""
    cfg = spec.config
    par = cfg.parallel
    parallel = (
        "any" if par.is_parallelism_agnostic
        else f"tp{par.tp_size}.pp{par.pp_size}.pcp{par.pcp_size}.dcp{par.dcp_size}"
    )
    groups = ",".join(f"{g.group_id}:{g.tokens_per_block}:{len(g.layer_names)}" for g in cfg.groups)
    layout = (
        f"{FORMAT};page={page_bytes};tph={cfg.cache.tokens_per_hash};"
        f"bpc={cfg.cache.blocks_per_chunk};groups={groups};par={parallel};"
        f"replicated={int(cfg.replicated_layout)};"
        f"canonical={cfg.kv_cache_layout if cfg.canonical_layout else '-'}"
    )
    return Namespace(
        model=cfg.model.name, dtype=cfg.model.dtype, layout=layout,
        chunk_tokens=cfg.groups[0].tokens_per_block * cfg.cache.blocks_per_chunk, salt=salt,
    )


@dataclass
class _Job:
    keys: list[OffloadKey]
    is_load: bool
    future: concurrent.futures.Future[list[bool]] | LoadHandle
    started: float

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> list[bool]:
        return self.future.result()


class _StoreLookups(AsyncLookupManager):
    """vLLM's non-blocking lookup state machine, answered by one batched `store.exists`."""

    def __init__(self, tier: KvstashTier):
        self._tier = tier  # set before the base class starts its thread
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        # Runs on vLLM's lookup thread, so waiting here never blocks the scheduler; a
        # timeout or store error raises, and the base class turns the batch into misses.
        return self._tier.core.exists(self._tier.store_keys(keys))


class KvstashTier(SecondaryTierManager):
    """Secondary tier over a kvstash store. Tier options (besides vLLM's `type`,
    `module_path`, `backpressure`): `store` (a URL or a list of URLs, fastest first),
    `salt` (isolates tenants sharing one store), `enable_kv_events` (publish BlockStored
    with medium STORAGE for pages this tier wrote, so KV-aware routers index storage hits;
    needs vLLM's --kv-events-config too), `locality` (LOCAL or REMOTE, as for vLLM's own
    tiers), and the core's options every adapter takes (connector.options:
    `lookup_timeout_s`, `load_deadline_s`, `max_in_flight`, `breaker_*`)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        store: StoreSpec = "",
        salt: str = "",
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ):
        where = f"secondary tier {tier_type!r}"
        check_known(options, CORE_OPTIONS | TIER_OPTIONS | set(DEPRECATED), where)
        core_options = CoreOptions.parse(options, where, aliases=DEPRECATED)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        if not store:
            raise ValueError(
                f"secondary tier {tier_type!r} needs a 'store' URL (e.g. file:///mnt/kv)"
            )
        self.ns = tier_namespace(offloading_spec, self.block_size_bytes, salt)
        self._pages = primary_kv_view.cast("B")
        self._jobs: dict[JobId, _Job] = {}
        self._events: list[OffloadingEvent] | None = (
            [] if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
            else None
        )
        self.core = KVConnector(
            store, self.ns, layout=EngineLayout.of(self.block_size_bytes, engine=FORMAT),
            **core_options.core_kwargs(),
        )
        self._lookups = _StoreLookups(self)
        log.info("vLLM offloading tier %s on %s, namespace %s",
                 tier_type, self.core.store, self.ns.id)

    def stats(self) -> dict[str, Any]:
        """The engine core's counters and state (connector.core.COUNTERS)."""
        return self.core.stats()

    def store_keys(self, keys: Sequence[OffloadKey]) -> list[str]:
        return keys_from_block_hashes([bytes(k) for k in keys], self.ns)

    def _page(self, slot: Any) -> memoryview:
        start = int(slot) * self.block_size_bytes
        return self._pages[start : start + self.block_size_bytes]

    # -- lookups -------------------------------------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    # -- transfers -----------------------------------------------------------------------

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        # The slots stay pinned until this job is reported, so they are read in place.
        keys = list(job_metadata.keys)
        pages = [self._page(c) for c in job_metadata.chunk_ids]
        future = self.core.write(self.store_keys(keys), None, pages.__getitem__)
        self._jobs[job_metadata.job_id] = _Job(keys, False, future, time.monotonic())

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        pages = [self._page(c) for c in job_metadata.chunk_ids]
        store_keys = self.store_keys(keys)
        handle = self.core.load_async(store_keys, [()] * len(keys), Buffers(pages))
        self._jobs[job_metadata.job_id] = _Job(keys, True, handle, time.monotonic())

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id in [j for j, job in self._jobs.items() if job.done()]:
            job = self._jobs.pop(job_id)
            try:
                ok = job.result()
            except Exception as exc:  # noqa: BLE001 - e.g. cancelled at shutdown
                log.warning("vLLM tier job %s on %s failed: %s", job_id, self.core.store, exc)
                ok = [False] * len(job.keys)
            done = [k for k, good in zip(job.keys, ok, strict=True) if good]
            success = len(done) == len(job.keys)
            if job.is_load and not success:
                # Without this the scheduler would see the cached HIT again and retry
                # the same doomed promotion forever.
                self._lookups.mark_miss(
                    [k for k, good in zip(job.keys, ok, strict=True) if not good]
                )
            if self._events is not None and done and not job.is_load:
                self._events.append(OffloadingEvent(
                    keys=done, medium=self.medium, removed=False, locality=self.locality,
                ))
            results.append(JobResult(
                job_id=job_id, success=success,
                successful_keys=tuple(done) if job.is_load and done and not success else None,
                transfer_time=time.monotonic() - job.started,
                transfer_bytes=len(done) * self.block_size_bytes,
            ))
        return results

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        events, self._events = self._events, []
        return events

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    @override
    def drain_jobs(self) -> None:
        for job in self._jobs.values():
            try:
                job.future.result()
            except Exception:  # noqa: BLE001 - reported by get_finished_jobs
                pass

    @override
    def shutdown(self) -> None:
        self._lookups.shutdown()
        self.drain_jobs()
        self._jobs.clear()
        # vLLM unmaps the primary region after its tiers shut down; an export left on
        # it would keep the shared-memory file mapped.
        self._pages.release()
        self.core.close()
