"""Engine pages on disk: store and load throughput of kvrs.PageStore on a DiskTier against
SGLang's own HiCacheFile backend and a raw file copy, on the same directory, in one
process, the three interleaved round by round.

    python benches/bench_engines.py [--pages 128] [--page-mib 2] [--rounds 5] [--dir DIR]

A page is what SGLang's host pool hands its L3 backend: by default 2 MiB, one 16-token
page of a Llama-3-8B-shaped KV cache at TP 1 in bfloat16 (2 x 32 layers x 16 tokens x 8
KV heads x 128 x 2 bytes). Each round stores `--pages` new pages with each method (fresh
keys: no method finds its pages already there), then loads them back into a separate
buffer and checks the bytes; the methods take turns going first, and each store starts
after an `os.sync()`. kvrs seals (keyed BLAKE3) and verifies every page;
HiCacheFile and the raw copy write and read bytes only. Loads read from the page cache
(the files were just written; the cache is not dropped). HiCacheFile is skipped when
SGLang is not installed (`make test-engines` installs it). Median of the rounds.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per round (SGLang's batch is 128)")
    ap.add_argument("--page-mib", type=float, default=2.0, help="bytes of one page, in MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
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


if __name__ == "__main__":
    main()
