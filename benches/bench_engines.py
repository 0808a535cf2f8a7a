"""Engine pages on disk: store and load throughput of kvrs through each engine adapter
against the engine's own tier beside it (SGLang's HiCacheFile, vLLM's file-system
secondary tier) and a raw file copy, on the same directory, in one process, interleaved
round by round; then the same faults injected into every method's files, counting the
loads that return wrong bytes.

    python benches/bench_engines.py [--pages 128] [--page-mib 2] [--rounds 5] [--dir DIR]

A page is what SGLang's host pool hands its L3 backend: by default 2 MiB, one 16-token
page of a Llama-3-8B-shaped KV cache at TP 1 in bfloat16 (2 x 32 layers x 16 tokens x 8
KV heads x 128 x 2 bytes). Each round stores `--pages` new pages with each method (fresh
keys: no method finds its pages already there), then loads them back into a separate
buffer and checks the bytes; the methods take turns going first, and each store starts
after an `os.sync()`. kvrs seals (keyed BLAKE3) and verifies every page;
HiCacheFile and the raw copy write and read bytes only. Loads read from the page cache
(the files were just written; the cache is not dropped). HiCacheFile is skipped when
SGLang is not installed (`make test-engines` installs it), and the vLLM rows without vLLM.
vLLM's tiers move chunks between their files and vLLM's CPU tier (a page-aligned buffer
they address by row) in jobs of `--job` chunks, asynchronously; a round submits every job
and waits for all of them. Median of the rounds.

Redis (`--redis-pages`, when a redis-server is installed: `make redis`): the same pages
through kvrs.PageStore on a RedisTier against a raw pipelined SET/MGET of the same bytes
with redis-py, on a server started on a loopback port.

Faults (`--fault-pages` pages per method and fault, after a clean store): a byte flipped in
the middle of every file, every file truncated by 100 bytes, and every file's contents
swapped with the next key's (a valid file of another key at this key's name). A load
either returns the stored bytes, refuses (a miss or an error), or returns wrong bytes.
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
from pathlib import Path

import numpy as np

import kvrs

SECRET = b"bench-engines-tier-key-0123456789"


def kvrs_method(root: Path, page_bytes: int) -> tuple[Callable, Callable]:
    store = kvrs.PageStore(
        [kvrs.DiskTier(root / "kvrs", "1TiB")],
        fingerprint={"model": "bench", "kv_dtype": "bfloat16", "page_bytes": page_bytes},
        tier_key=SECRET,
    )

    def put(keys: list[str], pages: np.ndarray) -> None:
        assert all(store.put_many(keys, list(pages)))

    def get(keys: list[str], out: np.ndarray) -> None:
        assert all(store.get_into(keys, list(out)))

    return put, get


def hicache_file_method(root: Path, page_bytes: int) -> tuple[Callable, Callable] | None:
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

    return put, get


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
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers",), group_id=0),),
        worker_kv_bytes_per_block=page_bytes,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="bench",
        model=OffloadingModelConfig(name="bench", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=par,
        kv_cache_layout="NHD",
    )
    events = OffloadingKVEventsConfig(enable_kv_cache_events=False, self_describing_kv_events=False)
    return SimpleNamespace(config=config, kv_events_config=events, blocks_per_chunk=1)


def vllm_tier_methods(
    root: Path, page_bytes: int, pages: int, job: int
) -> dict[str, tuple[Callable, Callable]]:
    """kvrs's and vLLM's own file-system secondary tier, each over its own CPU tier of
    `2 * pages` rows (the stored pages in the first half, loads into the second)."""
    try:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        from kvrs.integrations.vllm import KvrsSecondaryTier
    except ImportError:
        return {}
    os.environ.setdefault("KVRS_TIER_KEY", SECRET.decode())
    spec = _vllm_spec(page_bytes)
    ctx = ReqContext(req_id="bench")
    out: dict[str, tuple[Callable, Callable]] = {}

    def method(tier: object, region: _Region) -> tuple[Callable, Callable]:
        counter = iter(range(1, 1 << 62))

        def run(keys: list[str], first_row: int, load: bool) -> list[bool]:
            ok: list[bool] = []
            ids = {}
            for at in range(0, len(keys), job):
                part = keys[at : at + job]
                j = TransferJob(
                    job_id=next(counter),
                    keys=[make_offload_key(bytes.fromhex(k)[:16], 0) for k in part],
                    chunk_ids=np.arange(first_row + at, first_row + at + len(part), dtype=np.int64),
                    is_promotion=load,
                    req_context=ctx,
                )
                ids[j.job_id] = len(part)
                (tier.submit_load if load else tier.submit_store)(j)  # type: ignore[attr-defined]
            tier.drain_jobs()  # type: ignore[attr-defined]
            done = {r.job_id: r.success for r in tier.get_finished_jobs()}  # type: ignore[attr-defined]
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

        return put, get

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


def raw_method(root: Path, page_bytes: int) -> tuple[Callable, Callable]:
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

    return put, get


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


def _files(d: Path, since: set[Path]) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p not in since and not p.name.endswith(".json"))


def inject_faults(
    root: Path, methods: dict[str, tuple[Callable, Callable]], pages: np.ndarray
) -> dict[str, dict[str, tuple[int, int]]]:
    """Per method and fault: (loads that returned wrong bytes, loads refused)."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for name, (put, get) in methods.items():
        out[name] = {}
        for fault, how in FAULTS.items():
            before = set(p for p in root.rglob("*") if p.is_file())
            keys = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(len(pages))]
            put(keys, pages)
            files = _files(root, before)
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
            wrong = refused = 0
            for i, k in enumerate(keys):
                buf = np.zeros((1, pages.shape[1]), np.uint8)
                try:
                    get([k], buf)
                except (AssertionError, OSError, RuntimeError, ValueError):
                    refused += 1
                    continue
                if not np.array_equal(buf[0], pages[i]):
                    wrong += 1
            out[name][fault] = (wrong, refused)
    return out


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per round (SGLang's batch is 128)")
    ap.add_argument("--page-mib", type=float, default=2.0, help="bytes of one page, in MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--job", type=int, default=8, help="chunks per vLLM tier job")
    ap.add_argument("--fault-pages", type=int, default=16, help="pages per method and fault")
    ap.add_argument("--redis-pages", type=int, default=32, help="pages per round on Redis (0: no Redis rows)")
    args = ap.parse_args()
    page_bytes = int(args.page_mib * (1 << 20))
    root = Path(tempfile.mkdtemp(prefix="kvrs-bench-engines-", dir=args.dir))
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 256, (args.pages, page_bytes), dtype=np.uint8)
    out = np.empty_like(pages)
    methods: dict[str, tuple[Callable, Callable]] = {}
    methods["kvrs PageStore (DiskTier)"] = kvrs_method(root, page_bytes)
    hf = hicache_file_method(root, page_bytes)
    if hf is not None:
        methods["SGLang HiCacheFile"] = hf
    methods.update(vllm_tier_methods(root, page_bytes, args.pages, args.job))
    methods["raw file copy"] = raw_method(root, page_bytes)
    times: dict[str, dict[str, list[float]]] = {m: {"store": [], "load": []} for m in methods}
    total = pages.nbytes
    try:
        for r in range(args.rounds):
            keys = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(args.pages)]
            names = list(methods)
            # Each round starts with another method, and each store starts with no dirty
            # pages of the previous one left to write back (os.sync), so that no method
            # pays for another's writes.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                put, get = methods[name]
                os.sync()
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
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        faults = inject_faults(root, methods, pages[: args.fault_pages])
        redis_times = run_redis(args, pages[: args.redis_pages]) if args.redis_pages else {}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{args.pages} pages of {page_bytes / (1 << 20):g} MiB per round, {args.rounds} rounds "
        f"(median), directory on {args.dir or tempfile.gettempdir()}\n"
    )
    print("| method | store GB/s | load GB/s |")
    print("|---|---:|---:|")
    for name, t in times.items():
        store = total / statistics.median(t["store"]) / 1e9
        load = total / statistics.median(t["load"]) / 1e9
        print(f"| {name} | {store:.2f} | {load:.2f} |")
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
