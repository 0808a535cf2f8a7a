"""The methods `bench_engines.py` compares, each storing and loading engine pages (and
answering a prefix lookup) through one engine's tier or kvrs's adapter for it: kvrs's
PageStore, SGLang's HiCacheFile, vLLM's file-system tier and kvrs's vLLM tier, LMCache's
LocalDiskBackend and kvrs's LMCache connector, a raw file copy, and the Redis pair (see
the bench's docs for what each row measures)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import kvrs

SECRET = b"bench-engines-tier-key-0123456789"
TOKENS = 16  # tokens per page (vLLM's block, LMCache's chunk here, SGLang's page)
POLL_S = 50e-6  # how often an asynchronous store or lookup is polled

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")


@dataclass
class Method:
    """One way to store and load pages. `put(keys, pages)`; `get(keys, out)` raises when a
    page is not loaded; `lookup(native(keys))`: how many leading pages of `keys` are stored
    (`native` makes the engine's own keys, not timed); `scrub(n)` before the fault loads;
    `close()` at the end."""

    put: Callable[[list[str], np.ndarray], None]
    get: Callable[[list[str], np.ndarray], None]
    lookup: Callable[[Any], int] | None = None
    native: Callable[[list[str]], Any] = list
    scrub: Callable[[int], None] | None = None
    close: Callable[[], None] | None = None


def kvrs_method(root: Path, page_bytes: int) -> Method:
    store = kvrs.PageStore(
        [kvrs.DiskTier(root / "kvrs", "1TiB")],
        fingerprint={"model": "bench", "kv_dtype": "bfloat16", "page_bytes": page_bytes},
        tier_key=SECRET,
    )

    def put(keys: list[str], pages: np.ndarray) -> None:
        assert all(store.put_many(keys, list(pages)))

    def get(keys: list[str], out: np.ndarray) -> None:
        assert all(store.get_into(keys, list(out)))

    return Method(put, get, lookup=store.exists_prefix)


def hicache_file_method(root: Path, page_bytes: int) -> Method | None:
    try:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    except ImportError:
        return None
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench",
        extra_config={"file_storage_path": str(root / "hicache")},
    )
    backend = HiCacheFile(config)

    def put(keys: list[str], pages: np.ndarray) -> None:
        values = [torch.from_numpy(p) for p in pages]
        assert backend.batch_set(keys, values)

    def get(keys: list[str], out: np.ndarray) -> None:
        got = backend.batch_get(keys, [torch.from_numpy(o) for o in out])
        assert all(g is not None for g in got)

    return Method(put, get, lookup=backend.batch_exists)


class _Region:
    """vLLM's CPU tier for its secondary tiers: a page-aligned buffer of chunk rows (its
    file-system tier reads and writes them with O_DIRECT)."""

    def __init__(self, rows: int, row_bytes: int) -> None:
        import mmap

        self._map = mmap.mmap(-1, rows * row_bytes)
        self.rows = np.frombuffer(self._map, dtype=np.uint8).reshape(rows, row_bytes)


def _vllm_spec(page_bytes: int) -> object:
    from types import SimpleNamespace

    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    par = OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=False,
    )
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=TOKENS, layer_names=("layers",), group_id=0),),
        worker_kv_bytes_per_block=page_bytes,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="bench",
        model=OffloadingModelConfig(name="bench", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS, blocks_per_chunk=1),
        parallel=par,
        kv_cache_layout="NHD",
    )
    events = OffloadingKVEventsConfig(enable_kv_cache_events=False, self_describing_kv_events=False)
    return SimpleNamespace(config=config, kv_events_config=events, blocks_per_chunk=1)


def vllm_tier_methods(root: Path, page_bytes: int, pages: int, job: int) -> dict[str, Method]:
    """kvrs's and vLLM's own file-system secondary tier, each over its own CPU tier of
    `2 * pages` rows (the stored pages in the first half, loads into the second)."""
    try:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        from kvrs.integrations.vllm import KvrsSecondaryTier
    except ImportError:
        return {}
    os.environ.setdefault("KVRS_TIER_KEY", SECRET.decode())
    spec = _vllm_spec(page_bytes)
    ctx = ReqContext(req_id="bench")
    out: dict[str, Method] = {}

    def native(keys: list[str]) -> list[Any]:
        return [make_offload_key(bytes.fromhex(k)[:16], 0) for k in keys]

    def method(tier: Any, region: _Region) -> Method:
        counter = iter(range(1, 1 << 62))

        def run(keys: list[str], first_row: int, load: bool) -> list[bool]:
            ok: list[bool] = []
            ids = {}
            for at in range(0, len(keys), job):
                part = keys[at : at + job]
                j = TransferJob(
                    job_id=next(counter),
                    keys=native(part),
                    chunk_ids=np.arange(first_row + at, first_row + at + len(part), dtype=np.int64),
                    is_promotion=load,
                    req_context=ctx,
                )
                ids[j.job_id] = len(part)
                (tier.submit_load if load else tier.submit_store)(j)
            tier.drain_jobs()
            done = {r.job_id: r.success for r in tier.get_finished_jobs()}
            for jid, n in ids.items():
                ok.extend([done.get(jid, False)] * n)
            return ok

        def put(keys: list[str], pgs: np.ndarray) -> None:
            region.rows[: len(keys)] = pgs
            assert all(run(keys, 0, load=False))

        def get(keys: list[str], dst: np.ndarray) -> None:
            base = region.rows.shape[0] // 2
            got = run(keys, base, load=True)
            dst[:] = region.rows[base : base + len(keys)]
            assert all(got)

        def lookup(keys: list[Any]) -> int:
            """vLLM's scheduler (`_maximal_prefix_lookup`) against the tier alone, its steps
            back to back: every key looked up (a RETRY does not stop the scan, a MISS does)
            until no verdict is pending."""
            req = ReqContext(req_id=uuid.uuid4().hex)
            try:
                while True:
                    hits, pending = 0, False
                    for k in keys:
                        r = tier.lookup(k, req)
                        if r is LookupResult.HIT:
                            hits += 1
                        elif r is LookupResult.RETRY:
                            pending = True
                        else:
                            break
                    if not pending:
                        return hits
                    tier.on_schedule_end(None)
                    time.sleep(POLL_S)
            finally:
                tier.on_request_finished(req)

        return Method(put, get, lookup=lookup, native=native, close=tier.shutdown)

    r1 = _Region(2 * pages, page_bytes)
    ours = KvrsSecondaryTier(
        spec,
        memoryview(r1.rows),
        "kvrs",
        tiers=[{"type": "disk", "path": str(root / "vllm-kvrs"), "max_bytes": "1TiB"}],
        io_threads=4,
    )
    out["kvrs KvrsSecondaryTier (vLLM)"] = method(ours, r1)
    r2 = _Region(2 * pages, page_bytes)
    theirs = FileSystemTierManager(spec, memoryview(r2.rows), "fs", root_dir=str(root / "vllm-fs"))
    out["vLLM fs tier"] = method(theirs, r2)
    return out


def _lmcache_kv_shape(page_bytes: int) -> tuple[int, ...] | None:
    """LMCache's (layers, 2, chunk tokens, KV heads, head dim) of a bfloat16 chunk of
    `page_bytes`: Llama-3-8B's 32 layers and 8 KV heads where they divide it."""
    unit = 2 * TOKENS * 2  # K and V, 16 tokens, 2 bytes
    if page_bytes % (unit * 32 * 8) == 0:
        return (32, 2, TOKENS, 8, page_bytes // (unit * 32 * 8))
    if page_bytes % unit == 0:
        return (1, 2, TOKENS, 1, page_bytes // unit)
    return None


def lmcache_methods(root: Path, page_bytes: int, pages: int) -> dict[str, Method]:
    """kvrs as LMCache's remote storage plugin and LMCache's own local disk backend, each in
    a StorageManager of its own, driven at the storage-backend level (see the module docs)."""
    try:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager
    except ImportError:
        return {}
    shape = _lmcache_kv_shape(page_bytes)
    if shape is None:
        print(f"no LMCache rows: a page of {page_bytes} bytes is no whole bfloat16 chunk", flush=True)
        return {}
    os.environ.setdefault("KVRS_TIER_KEY", SECRET.decode())
    md = LMCacheMetadata(
        model_name="bench/model",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=shape,
        chunk_size=TOKENS,
    )
    shapes, dtypes = md.get_shapes(TOKENS), md.get_dtypes()
    # The CPU backend holds a round's chunks while they are stored, then while they load.
    cpu_gib = (2 * pages * page_bytes + (64 << 20)) / (1 << 30)
    rng = np.random.default_rng(7)

    def native(keys: list[str]) -> list[Any]:
        return [CacheEngineKey("bench/model", 1, 0, int(k[:16], 16), torch.bfloat16, {}) for k in keys]

    def engine(disk: bool) -> tuple[Any, Any]:
        opts: dict[str, Any] = {}
        if disk:
            opts = {"local_disk": str(root / "lmcache-disk"), "max_local_disk_size": 1024.0}
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=TOKENS, local_cpu=True, max_local_cpu_size=cpu_gib, lmcache_instance_id="bench", **opts
        )
        if not disk:
            p = "remote_storage_plugin.kvrs."
            cfg.remote_storage_plugins = ["kvrs"]
            cfg.extra_config = {
                p + "module_path": "kvrs.integrations.lmcache",
                p + "class_name": "KvrsRemoteConnector",
                p + "tiers": [{"type": "disk", "path": str(root / "lmcache-kvrs"), "max_bytes": "1TiB"}],
            }
        cfg.blocking_timeout_secs = 120
        sm = StorageManager(cfg, md, EventManager())
        name = "LocalDiskBackend" if disk else "RemoteBackend-kvrs"
        assert list(sm.storage_backends) == ["LocalCPUBackend", name], list(sm.storage_backends)
        backend = sm.storage_backends[name]
        assert disk or backend.connection is not None, "the kvrs plugin did not load"
        return sm, backend

    def method(
        sm: Any, backend: Any, mark: Callable[[], int], wait: Callable[[list[Any], int], None]
    ) -> Method:
        def alloc() -> Any:
            obj = sm.allocate(shapes, dtypes, MemoryFormat.KV_2LTD)
            assert obj is not None, "LMCache's CPU backend is full"
            return obj

        def put(keys: list[str], pgs: np.ndarray) -> None:
            ks = native(keys)
            objs = [alloc() for _ in ks]
            for o, p in zip(objs, pgs, strict=True):
                np.frombuffer(o.byte_array, np.uint8)[:] = p
            before = mark()
            backend.batched_submit_put_task(ks, objs)
            for o in objs:
                o.ref_count_down()
            wait(ks, before)

        def get(keys: list[str], out: np.ndarray) -> None:
            objs = backend.batched_get_blocking(native(keys))
            try:
                for o, dst in zip(objs, out, strict=True):
                    assert o is not None
                    dst[:] = np.frombuffer(o.byte_array, np.uint8)
            finally:
                for o in objs:
                    if o is not None:
                        o.ref_count_down()

        def scrub(n: int) -> None:
            objs = [alloc() for _ in range(n)]
            for o in objs:
                b = np.frombuffer(o.byte_array, np.uint8)
                b[:] = rng.integers(0, 256, b.size, dtype=np.uint8)
            for o in objs:
                o.ref_count_down()

        return Method(put, get, lookup=backend.batched_contains, native=native, scrub=scrub, close=sm.close)

    out: dict[str, Method] = {}
    sm, remote = engine(disk=False)
    conn = remote.connection._connector  # LMCache wraps it (InstrumentedRemoteConnector)

    def kvrs_mark() -> int:
        return conn.counters["put_chunks"]

    def kvrs_wait(keys: list[Any], before: int) -> None:
        end = time.monotonic() + 120
        while conn.counters["put_chunks"] < before + len(keys):  # the put starts on LMCache's loop
            assert time.monotonic() < end, "the put never started"
            time.sleep(POLL_S)
        assert conn.wait_idle(120), "the put never finished"

    out["kvrs KvrsRemoteConnector (LMCache)"] = method(sm, remote, kvrs_mark, kvrs_wait)
    try:
        sm2, disk = engine(disk=True)
    except BaseException:
        sm.close()
        raise

    def disk_wait(keys: list[Any], _before: int) -> None:
        end = time.monotonic() + 120
        while not all(disk.contains(k) and not disk.exists_in_put_tasks(k) for k in keys):
            assert time.monotonic() < end, "the put never finished"
            time.sleep(POLL_S)

    out["LMCache LocalDiskBackend"] = method(sm2, disk, lambda: 0, disk_wait)
    return out


def raw_method(root: Path, page_bytes: int) -> Method:
    d = root / "raw"
    d.mkdir(parents=True, exist_ok=True)

    def put(keys: list[str], pages: np.ndarray) -> None:
        for k, p in zip(keys, pages, strict=True):
            tmp = d / f".{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(memoryview(p))
            os.replace(tmp, d / f"{k}.bin")

    def get(keys: list[str], out: np.ndarray) -> None:
        for k, o in zip(keys, out, strict=True):
            with open(d / f"{k}.bin", "rb", buffering=0) as f:
                assert f.readinto(memoryview(o)) == o.nbytes

    def lookup(keys: list[str]) -> int:
        for i, k in enumerate(keys):
            if not os.path.exists(d / f"{k}.bin"):
                return i
        return len(keys)

    return Method(put, get, lookup=lookup)


def make_methods(root: Path, page_bytes: int, pages: int, job: int) -> dict[str, Method]:
    """Every method available here, each engine's row beside kvrs's row through it."""
    methods: dict[str, Method] = {"kvrs PageStore (DiskTier)": kvrs_method(root, page_bytes)}
    hf = hicache_file_method(root, page_bytes)
    if hf is not None:
        methods["SGLang HiCacheFile"] = hf
    methods.update(vllm_tier_methods(root, page_bytes, pages, job))
    try:
        methods.update(lmcache_methods(root, page_bytes, pages))
    except BaseException:
        close(methods)
        raise
    methods["raw file copy"] = raw_method(root, page_bytes)
    return methods


def close(methods: dict[str, Method]) -> None:
    for m in methods.values():
        if m.close is not None:
            m.close()


def redis_methods(pages: int, page_bytes: int) -> tuple[dict[str, tuple[Callable, Callable]], object] | None:
    """kvrs on a RedisTier and a raw redis-py pipeline, on a fresh loopback server."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
    try:
        from redis_server import RedisServer, server_binary
    except ImportError:
        return None
    binary = server_binary()
    if binary is None:
        return None
    server = RedisServer(binary)
    server.extra = ["--maxmemory", f"{max(512, 4 * pages * page_bytes >> 20)}mb"]
    server.start()
    store = kvrs.PageStore(
        [kvrs.RedisTier(server.url, timeout=10.0)],
        fingerprint={"model": "bench", "kv_dtype": "bfloat16", "page_bytes": page_bytes},
        tier_key=SECRET,
    )
    client = server.client()

    def kput(keys: list[str], pgs: np.ndarray) -> None:
        assert all(store.put_many(keys, list(pgs)))

    def kget(keys: list[str], out: np.ndarray) -> None:
        assert all(store.get_into(keys, list(out)))

    def rput(keys: list[str], pgs: np.ndarray) -> None:
        pipe = client.pipeline(transaction=False)
        for k, p in zip(keys, pgs, strict=True):
            pipe.set(k, memoryview(p))
        assert all(pipe.execute())

    def rget(keys: list[str], out: np.ndarray) -> None:
        for o, v in zip(out, client.mget(keys), strict=True):
            assert v is not None
            o[:] = np.frombuffer(v, np.uint8)

    methods = {
        "kvrs PageStore (RedisTier)": (kput, kget),
        "raw pipelined SET / MGET (redis-py)": (rput, rget),
    }
    return methods, server
