"""Engine pages on disk: store and load throughput of kvrs through each engine adapter
against the engine's own tier beside it (SGLang's HiCacheFile, vLLM's file-system
secondary tier, LMCache's local disk backend) and a raw file copy, on the same directory,
in one process, interleaved round by round; the time each method takes to look up a
4096-token prefix through its own lookup API; then the same faults injected into every
method's files, counting the loads that return wrong bytes.

    python benches/bench_engines.py [--pages 128] [--page-mib 2] [--rounds 5] [--dir DIR]
        [--lookup-pages 256] [--lookup-page-kib 64] [--lookup-rounds 20]

A page is what SGLang's host pool hands its L3 backend: by default 2 MiB, one 16-token
page of a Llama-3-8B-shaped KV cache at TP 1 in bfloat16 (2 x 32 layers x 16 tokens x 8
KV heads x 128 x 2 bytes). Each round stores `--pages` new pages with each method (fresh
keys: no method finds its pages already there), then loads them back into a separate
buffer and checks the bytes; the methods take turns going first, and each store starts
after an `os.sync()`. Loads read from the page cache (the files were just written; the
cache is not dropped). Median of the rounds. The rows:

- kvrs PageStore (DiskTier): `put_many` / `get_into` on a DiskTier; every page sealed
  (keyed BLAKE3) and verified.
- SGLang HiCacheFile: its `batch_set` / `batch_get`, bytes only. Skipped when SGLang is
  not installed (`make test-engines` installs it).
- kvrs KvrsSecondaryTier (vLLM) and vLLM fs tier: vLLM's secondary tiers move chunks
  between their files and vLLM's CPU tier (a page-aligned buffer they address by row) in
  jobs of `--job` chunks, asynchronously; a round submits every job and waits for all of
  them. The times include copying the pages into the CPU tier and out of it. Skipped
  without vLLM.
- kvrs KvrsRemoteConnector (LMCache) and LMCache LocalDiskBackend: LMCache 0.5.6's real
  StorageManager (its LocalCPUBackend, plus kvrs loaded by configuration as remote storage
  plugin `kvrs`, or plus LMCache's own LocalDiskBackend), one page per 16-token chunk
  (bfloat16 K/V of `--page-mib`; a `MemoryObj` allocated from LMCache's CPU backend).
  Measured at the storage-backend level, the same `StorageBackendInterface` calls for
  both: `batched_submit_put_task`, then waiting until the writes are done (LMCache does not
  wait for them: until the disk backend's index holds every key and no put task is left,
  or the kvrs connector is idle), and `batched_get_blocking`. Not through
  `StorageManager.batched_put` / `batched_get`, which would also keep every chunk in the
  CPU backend, where a load would find it without reaching the disk. The times include
  allocating the chunks and copying the pages into them, and copying the loaded chunks
  out (as the vLLM rows do). Skipped without LMCache.
- raw file copy: each page written to a temporary file and renamed into place, read back
  with `readinto`; the floor: no engine, no checks.

Lookup (`--lookup-pages` pages of 16 tokens, 256 by default: a 4096-token prefix; 0: no
lookup columns): a second set of the same methods, in a directory of its own, stores the
prefix once on small pages (`--lookup-page-kib`: a lookup reads no page data, only names,
indexes or metadata pages); then, round by round in turns, each method answers "how many
leading pages of the prefix are stored" through its own lookup API, for the stored prefix
(all present: every page is checked) and for a prefix never stored (all missing: the
first page misses); median microseconds of `--lookup-rounds`. The engines' keys are made
beforehand (not timed). kvrs: `PageStore.exists_prefix`. HiCacheFile: `batch_exists`
(SGLang's own: `exists` per key, a stat each, until the first miss). vLLM's tiers: the
scheduler's maximal-prefix protocol against the tier's asynchronous lookup (`lookup` each
key: RETRY until answered; `on_schedule_end` hands the batch to the tier's lookup thread
and collects its verdicts, called every 50 us as if scheduler steps ran back to back;
a new request each round, so no verdicts are cached), the polling included. LMCache:
the backend's `batched_contains` (LocalDiskBackend: its in-memory index, which a restart
loses; kvrs: each chunk's metadata page read and verified and its data page checked, on
the connector's I/O thread). Raw: `os.path.exists` per key until the first miss.

Redis (`--redis-pages`, when a redis-server is installed: `make redis`): the same pages
through kvrs.PageStore on a RedisTier against a raw pipelined SET/MGET of the same bytes
with redis-py, on a server started on a loopback port.

Faults (`--fault-pages` pages per method and fault, after a clean store): a byte flipped in
the middle of every file, every file truncated by 100 bytes, and every file's contents
swapped with the next key's (a valid file of another key at this key's name). kvrs through
LMCache writes a small metadata page and a data page per chunk: the data pages are
damaged. Before LMCache's loads, its freed CPU buffers are reused by other chunks (random
bytes), as in a running engine, so that a load that leaves part of its buffer unwritten
returns what the buffer held. A load either returns the stored bytes, refuses (a miss or
an error), or returns wrong bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
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


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x5A
    p.write_bytes(bytes(b))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-100])


FAULTS = {"byte flipped": "flip", "truncated": "truncate", "another key's file": "swap"}


def _files(d: Path, since: set[Path], n: int) -> list[Path]:
    """The `n` page files written under `d` since `since` (of a method that writes more
    files per page, such as kvrs through LMCache's metadata pages: the largest)."""
    new = [p for p in d.rglob("*") if p.is_file() and p not in since and not p.name.endswith(".json")]
    if len(new) > n:
        big = max(p.stat().st_size for p in new)
        new = [p for p in new if p.stat().st_size == big]
    return sorted(new)


def inject_faults(
    root: Path, methods: dict[str, Method], pages: np.ndarray
) -> dict[str, dict[str, tuple[int, int]]]:
    """Per method and fault: (loads that returned wrong bytes, loads refused)."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for name, m in methods.items():
        out[name] = {}
        for fault, how in FAULTS.items():
            before = set(p for p in root.rglob("*") if p.is_file())
            keys = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(len(pages))]
            m.put(keys, pages)
            files = _files(root, before, len(pages))
            assert len(files) == len(pages), (name, len(files))
            if how == "flip":
                for f in files:
                    _flip(f)
            elif how == "truncate":
                for f in files:
                    _truncate(f)
            else:
                blobs = [f.read_bytes() for f in files]
                for f, b in zip(files, blobs[1:] + blobs[:1], strict=True):
                    f.write_bytes(b)
            if m.scrub is not None:
                m.scrub(len(pages))
            wrong = refused = 0
            for i, k in enumerate(keys):
                buf = np.zeros((1, pages.shape[1]), np.uint8)
                try:
                    m.get([k], buf)
                except (AssertionError, OSError, RuntimeError, ValueError):
                    refused += 1
                    continue
                if not np.array_equal(buf[0], pages[i]):
                    wrong += 1
            out[name][fault] = (wrong, refused)
    return out


def run_lookups(args: argparse.Namespace, root: Path) -> dict[str, dict[str, list[float]]]:
    """Per method: lookup times of the stored prefix ("hit") and of one never stored
    ("miss"), on a set of methods of their own over small pages, interleaved round by round."""
    n, page_bytes = args.lookup_pages, int(args.lookup_page_kib * 1024)
    methods = make_methods(root, page_bytes, n, args.job)
    try:
        pages = np.random.default_rng(1).integers(0, 256, (n, page_bytes), dtype=np.uint8)
        stored = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(n)]
        never = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(n)]
        keys: dict[str, tuple[Any, Any]] = {}
        for name, m in methods.items():
            if m.lookup is not None:
                m.put(stored, pages)
                keys[name] = (m.native(stored), m.native(never))
        times: dict[str, dict[str, list[float]]] = {name: {"hit": [], "miss": []} for name in keys}
        names = list(keys)
        for r in range(args.lookup_rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                lookup = methods[name].lookup
                assert lookup is not None
                for case, ks, want in (("hit", keys[name][0], n), ("miss", keys[name][1], 0)):
                    t0 = time.perf_counter()
                    got = lookup(ks)
                    t1 = time.perf_counter()
                    assert got == want, (name, case, got, want)
                    times[name][case].append(t1 - t0)
    finally:
        close(methods)
    return times


def run_redis(args: argparse.Namespace, pages: np.ndarray) -> dict[str, dict[str, list[float]]]:
    """Store and load times per method on Redis, interleaved round by round."""
    made = redis_methods(len(pages), pages.shape[1])
    if made is None:
        print("no redis-server: run `make redis` for the Redis rows", flush=True)
        return {}
    methods, server = made
    out = np.empty_like(pages)
    times: dict[str, dict[str, list[float]]] = {m: {"store": [], "load": []} for m in methods}
    try:
        for r in range(args.rounds):
            keys = [uuid.uuid4().hex for _ in range(len(pages))]
            names = list(methods)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                put, get = methods[name]
                t0 = time.perf_counter()
                put(keys, pages)
                t1 = time.perf_counter()
                out.fill(0)
                t2 = time.perf_counter()
                get(keys, out)
                t3 = time.perf_counter()
                assert np.array_equal(out, pages), name
                times[name]["store"].append(t1 - t0)
                times[name]["load"].append(t3 - t2)
    finally:
        server.stop()  # type: ignore[attr-defined]
    return times


def main() -> None:
    class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    assert __doc__ is not None
    summary, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(description=summary, epilog=rest, formatter_class=Help)
    ap.add_argument("--pages", type=int, default=128, help="pages per round (SGLang's batch is 128)")
    ap.add_argument("--page-mib", type=float, default=2.0, help="bytes of one page, in MiB")
    ap.add_argument("--rounds", type=int, default=5, help="store and load rounds")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (None: a temp dir)")
    ap.add_argument("--job", type=int, default=8, help="chunks per vLLM tier job")
    ap.add_argument(
        "--lookup-pages",
        type=int,
        default=256,
        help=f"pages of {TOKENS} tokens in the prefix each method looks up (256: 4096 tokens; 0: no lookups)",
    )
    ap.add_argument(
        "--lookup-page-kib",
        type=float,
        default=64,
        help="bytes of one page of the lookup prefix, in KiB (a lookup reads no page data)",
    )
    ap.add_argument("--lookup-rounds", type=int, default=20, help="lookup rounds (the median is reported)")
    ap.add_argument("--fault-pages", type=int, default=16, help="pages per method and fault")
    ap.add_argument("--redis-pages", type=int, default=32, help="pages per round on Redis (0: no Redis rows)")
    args = ap.parse_args()
    page_bytes = int(args.page_mib * (1 << 20))
    root = Path(tempfile.mkdtemp(prefix="kvrs-bench-engines-", dir=args.dir))
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 256, (args.pages, page_bytes), dtype=np.uint8)
    out = np.empty_like(pages)
    lookups: dict[str, dict[str, list[float]]] = {}
    try:
        methods = make_methods(root / "pages", page_bytes, args.pages, args.job)
        times: dict[str, dict[str, list[float]]] = {m: {"store": [], "load": []} for m in methods}
        try:
            for r in range(args.rounds):
                keys = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(args.pages)]
                names = list(methods)
                # Each round starts with another method, and each store starts with no
                # dirty pages of the previous one left to write back (os.sync), so that no
                # method pays for another's writes.
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    m = methods[name]
                    os.sync()
                    t0 = time.perf_counter()
                    m.put(keys, pages)
                    t1 = time.perf_counter()
                    out.fill(0)
                    t2 = time.perf_counter()
                    m.get(keys, out)
                    t3 = time.perf_counter()
                    assert np.array_equal(out, pages), name
                    times[name]["store"].append(t1 - t0)
                    times[name]["load"].append(t3 - t2)
                print(f"round {r + 1}/{args.rounds} done", flush=True)
            faults = inject_faults(root / "pages", methods, pages[: args.fault_pages])
        finally:
            close(methods)
        if args.lookup_pages and args.lookup_rounds:
            lookups = run_lookups(args, root / "lookup")
        redis_times = run_redis(args, pages[: args.redis_pages]) if args.redis_pages else {}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = pages.nbytes
    print(
        f"\n{args.pages} pages of {page_bytes / (1 << 20):g} MiB per round, {args.rounds} rounds "
        f"(median), directory on {args.dir or tempfile.gettempdir()}"
    )
    if lookups:
        print(
            f"lookup: how many leading pages of a {args.lookup_pages}-page prefix "
            f"({args.lookup_pages * TOKENS} tokens) are stored, all stored / none stored, on "
            f"{args.lookup_page_kib:g} KiB pages, median of {args.lookup_rounds} rounds"
        )
    print("\n| method | store GB/s | load GB/s | lookup, all stored (us) | lookup, none stored (us) |")
    print("|---|---:|---:|---:|---:|")
    for name, t in times.items():
        store = total / statistics.median(t["store"]) / 1e9
        load = total / statistics.median(t["load"]) / 1e9
        lk = lookups.get(name)
        hit = f"{statistics.median(lk['hit']) * 1e6:.0f}" if lk else "-"
        miss = f"{statistics.median(lk['miss']) * 1e6:.0f}" if lk else "-"
        print(f"| {name} | {store:.2f} | {load:.2f} | {hit} | {miss} |")
    if redis_times:
        n = min(args.redis_pages, args.pages) * page_bytes
        print(f"\nRedis on loopback: {min(args.redis_pages, args.pages)} pages per round\n")
        print("| method | store GB/s | load GB/s |")
        print("|---|---:|---:|")
        for name, t in redis_times.items():
            print(
                f"| {name} | {n / statistics.median(t['store']) / 1e9:.2f} | "
                f"{n / statistics.median(t['load']) / 1e9:.2f} |"
            )
    print(f"\nFaults: {args.fault_pages} pages per method and fault; loads returning wrong bytes / refused\n")
    kinds = list(FAULTS)
    print("| method | " + " | ".join(kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    for name, row in faults.items():
        print(f"| {name} | " + " | ".join(f"{row[k][0]} wrong / {row[k][1]} refused" for k in kinds) + " |")


if __name__ == "__main__":
    main()
