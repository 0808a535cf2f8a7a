"""kvrs inside vLLM, loaded by module path with no change to vLLM: `KvrsSecondaryTier`, a
secondary tier of vLLM's KV offloading under its CPU tier (``TieringOffloadingSpec``), and
`KvrsConnector` (``kv_connector_module_path``, see `kvrs.integrations.vllm_connector`), a
whole KV connector.

vLLM moves K/V from the GPU into its CPU tier (the primary), and from there cascades chunks
to its secondary tiers; a lookup that misses the CPU tier asks the secondary tiers and a hit
is promoted back into it. `KvrsSecondaryTier` keeps those chunks in kvrs tiers (host
memory, disk, Redis or Redis Cluster, fastest first) through a [`kvrs.PageStore`][kvrs.PageStore]:
each chunk (one row of the CPU tier's buffer: the bytes vLLM itself stores) is sealed in a
kvrs payload whose header and keyed MAC bind it to the engine's facts (model, KV dtype,
cache layout, tokens per hash, blocks per chunk, the KV groups, TP/PP/PCP/DCP sizes and the
worker rank unless vLLM says the bytes are parallelism-agnostic, the row length), the
namespace and the chunk's key (vLLM's block hash and group), under the secret read from the
environment variable named by ``tier_key_env``. A promotion copies a chunk into the CPU
tier only after every check passed, so a chunk of another model, dtype, layout, rank or
tenant, or a torn, truncated, corrupted or forged one, is a miss (vLLM recomputes it),
never wrong K/V; it is discarded, so the next lookup says MISS instead of failing again.

Like vLLM's own tiers it never blocks the scheduler: stores and loads run on the tier's
I/O threads (the GIL released while kvrs reads, verifies and writes), lookups are answered
asynchronously (``RETRY`` until the probe is back, as vLLM's file-system tier does), and a
failed load reports which chunks did load. A store that fails is never visible.

Configuration (``--kv-transfer-config``)::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{
            "type": "KvrsSecondaryTier", "module_path": "kvrs.integrations.vllm",
            "tiers": [{"type": "disk", "path": "/mnt/nvme/kvrs", "max_bytes": "500GiB"}],
            "tier_key_env": "KVRS_TIER_KEY", "namespace": "",
            "fingerprint": {"revision": "main"}}]}}

Tested with vLLM 0.33.0 (tests/engines).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np

import kvrs
from kvrs.integrations.engine_config import (
    DEFAULT_TIER_KEY_ENV,
    extra_facts,
    make_tiers,
    namespace_arg,
    tier_secret,
)

try:
    from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found,import-untyped]
        Locality,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
    )
    from vllm.v1.kv_offload.tiering.async_lookup import (  # type: ignore[import-not-found,import-untyped]
        AsyncLookupManager,
    )
    from vllm.v1.kv_offload.tiering.base import (  # type: ignore[import-not-found,import-untyped]
        JobResult,
        SecondaryTierManager,
        TransferJob,
    )

    from kvrs.integrations.vllm_connector import KvrsConnector
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvrs.integrations.vllm needs vLLM ({e}): tested with vllm==0.33.0, installed by "
        "`make test-engines` (tests/engines/requirements.txt)"
    ) from e

__all__ = ["TESTED_VLLM", "KvrsConnector", "KvrsSecondaryTier", "offloading_fingerprint"]

_logger = logging.getLogger(__name__)

#: The vLLM version this adapter is tested with.
TESTED_VLLM = "0.33.0"


def offloading_fingerprint(
    offloading_spec: Any, row_bytes: int, extra: Mapping[str, Any] | None = None
) -> dict[str, str | int | bool]:
    """The facts that identify the chunks of the CPU tier of `offloading_spec` (vLLM's
    ``OffloadingSpec``; its ``config`` is an ``OffloadingConfig``) whose rows are
    `row_bytes` long, plus the deployment's `extra` facts."""
    config = offloading_spec.config
    par = config.parallel
    groups = [
        f"{g.tokens_per_block}:{g.sliding_window_size_in_chunks}:{','.join(g.layer_names)}"
        for g in config.groups
    ]
    fp: dict[str, str | int | bool] = {
        "engine": "vllm",
        "model": str(config.model.name),
        "kv_dtype": str(config.model.dtype),
        "kv_cache_layout": str(config.kv_cache_layout),
        "canonical_layout": bool(config.canonical_layout),
        "replicated_layout": bool(config.replicated_layout),
        "tokens_per_hash": int(config.cache.tokens_per_hash),
        "blocks_per_chunk": int(config.cache.blocks_per_chunk),
        "groups": ";".join(groups),
        "row_bytes": int(row_bytes),
        "page_bytes": int(row_bytes),
        "pcp_size": int(par.pcp_size),
        "dcp_size": int(par.dcp_size),
    }
    # The same rule as vLLM's own file-system tier: bytes that are the same under any
    # topology are shared across it; anything else is one worker's shard.
    if not (par.is_parallelism_agnostic or config.replicated_layout):
        fp["rank"] = int(par.rank)
        fp["world_size"] = int(par.world_size)
        fp["tp_size"] = int(par.tp_size)
        fp["pp_size"] = int(par.pp_size)
    fp.update(extra_facts(extra))
    return fp


def _key_name(key: bytes) -> str:
    return bytes(key).hex()


class _Lookups(AsyncLookupManager):  # type: ignore[misc]
    """vLLM's asynchronous lookup state machine, probing the page store off the scheduler."""

    def __init__(self, tier: KvrsSecondaryTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.present(keys)


class KvrsSecondaryTier(SecondaryTierManager):  # type: ignore[misc]
    """A secondary tier of vLLM's ``TieringOffloadingSpec`` in kvrs tiers, every chunk sealed
    and verified (see the module docs for the configuration)."""

    medium: ClassVar[Any] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        tiers: Sequence[Mapping[str, Any]] = (),
        tier_key_env: str = DEFAULT_TIER_KEY_ENV,
        namespace: str = "",
        fingerprint: Mapping[str, Any] | None = None,
        io_threads: int = 4,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: Any = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not isinstance(io_threads, int) or isinstance(io_threads, bool) or not 1 <= io_threads <= 256:
            raise ValueError(f"io_threads={io_threads!r}: must be an int in [1, 256]")
        self.tiers = make_tiers(tiers)
        self.namespace = namespace_arg(namespace)
        self.locality = Locality(locality) if locality is not None else None
        rows = np.asarray(primary_kv_view)
        if rows.ndim < 1 or rows.shape[0] == 0 or not rows.flags.c_contiguous:
            raise ValueError(
                f"primary_kv_view must be a C-contiguous (chunks, bytes) buffer, not shape {rows.shape}"
            )
        self._rows = rows.reshape(rows.shape[0], -1).view(np.uint8)
        if self._rows.shape[1] != self.block_size_bytes:
            raise ValueError(
                f"primary_kv_view rows hold {self._rows.shape[1]} bytes but its stride is "
                f"{self.block_size_bytes}"
            )
        fp = offloading_fingerprint(offloading_spec, self.block_size_bytes, fingerprint)
        self.store = kvrs.PageStore(self.tiers, fingerprint=fp, tier_key=tier_secret(tier_key_env, _logger))
        self.events: list[Any] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                _logger.warning(
                    "enable_kv_events is set on secondary tier %r but KV cache events are disabled "
                    "globally; the tier will not emit events.",
                    tier_type,
                )
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvrs_vllm_tier")
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._inflight: dict[int, Future[None]] = {}
        self._inflight_lock = threading.Lock()
        # Per submitted job not yet reported: whether it loads, and its keys (scheduler thread).
        self._job_keys: dict[int, tuple[bool, list[Any]]] = {}
        self._lookups = _Lookups(self)

    # -- the page store, on I/O threads -----------------------------------------------------

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of `keys` is stored (a probe of the tiers; runs off the scheduler)."""
        ns = self.namespace
        return self.store.exists_many([_key_name(k) for k in keys], namespace=ns)

    def _store(self, job: TransferJob, keys: list[Any]) -> JobResult:
        start = time.monotonic()
        todo = [i for i, has in enumerate(self.present(keys)) if not has]
        names = [_key_name(keys[i]) for i in todo]
        pages = [self._rows[int(job.chunk_ids[i])] for i in todo]
        stored = self.store.put_many(names, pages, namespace=self.namespace) if todo else []
        ok = all(stored)
        if not ok:
            _logger.warning(
                "kvrs tier %r stored %d of %d chunks of job %d (see the tiers' stats)",
                self.tier_type,
                sum(stored),
                len(stored),
                job.job_id,
            )
        return JobResult(
            job_id=job.job_id,
            success=ok,
            transfer_time=time.monotonic() - start,
            transfer_bytes=sum(stored) * self.block_size_bytes,
        )

    def _load(self, job: TransferJob, keys: list[Any]) -> JobResult:
        start = time.monotonic()
        bufs = [self._rows[int(c)] for c in job.chunk_ids]
        got = self.store.get_into([_key_name(k) for k in keys], bufs, namespace=self.namespace)
        loaded = [k for k, ok in zip(keys, got, strict=True) if ok]
        elapsed = time.monotonic() - start
        if len(loaded) == len(keys):
            return JobResult(
                job_id=job.job_id,
                success=True,
                transfer_time=elapsed,
                transfer_bytes=len(keys) * self.block_size_bytes,
            )
        return JobResult(
            job_id=job.job_id,
            success=False,
            successful_keys=tuple(loaded) if loaded else None,
            transfer_time=elapsed,
            transfer_bytes=len(loaded) * self.block_size_bytes,
        )

    def _run(self, job: TransferJob, keys: list[Any], work: Any) -> None:
        try:
            result = work(job, keys)
        except Exception as e:  # reported as a failed job, never lost
            _logger.warning("kvrs tier %r: job %d failed: %s", self.tier_type, job.job_id, e)
            result = JobResult(job_id=job.job_id, success=False)
        self._finished.put(result)

    def _submit(self, job: TransferJob, is_load: bool) -> None:
        keys: list[Any] = [bytes(k) for k in job.keys]
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(job.chunk_ids)} chunk_ids")
        self._job_keys[job.job_id] = (is_load, keys)
        work = self._load if is_load else self._store
        fut = self._pool.submit(self._run, job, keys, work)
        with self._inflight_lock:
            self._inflight[job.job_id] = fut
        fut.add_done_callback(functools.partial(self._forget, job.job_id))

    def _forget(self, job_id: int, _done: Future[None]) -> None:
        with self._inflight_lock:
            self._inflight.pop(job_id, None)

    # -- vLLM's SecondaryTierManager --------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                results.append(self._finished.get_nowait())
            except queue.Empty:
                break
        for r in results:
            keys = self._job_keys.pop(r.job_id, None)
            if keys is None:
                continue
            is_load, job_keys = keys
            if is_load and not r.success:
                ok = set(r.successful_keys or ())
                self._lookups.mark_miss([k for k in job_keys if k not in ok])
            elif not is_load and r.success and self.events is not None and job_keys:
                self.events.append(
                    OffloadingEvent(
                        keys=list(job_keys), medium=self.medium, removed=False, locality=self.locality
                    )
                )
        return results

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def has_pending_work(self) -> bool:
        with self._inflight_lock:
            return bool(self._inflight) or not self._finished.empty()

    def take_events(self) -> Iterable[Any]:
        if self.events:
            out, self.events = self.events, []
            return out
        return ()

    def drain_jobs(self) -> None:
        while True:
            with self._inflight_lock:
                pending = list(self._inflight.values())
            if not pending:
                return
            for fut in pending:
                fut.result()

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)

    def kvrs_stats(self) -> dict[str, Any]:
        """The page store's counters and each kvrs tier's (for tools and tests)."""
        return self.store.stats()
