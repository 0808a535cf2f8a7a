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
from pathlib import Path
from typing import Any

import numpy as np
from engine_methods import TOKENS, Method, close, make_methods, redis_methods


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
