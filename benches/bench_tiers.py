"""Offload tiers: what loading a cached prefix from a tier costs, against recomputing it
and against the raw transfer of the same bytes; and a shared-prefix workload served by
two processes, with and without a Redis tier between them.

    python benches/bench_tiers.py

Starts its own Redis server on a loopback port (`make redis` installs one). The model is
the demo's (8 layers, 2 KV heads x 32, float32 K/V, random weights), on the CPU.
Ratios come from one run on one machine; the disk tier reads from the page cache.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

import kvrs
from kvrs.demo import make_model
from kvrs.integrations.transformers import block_pool_from_config, forward_batch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))
from redis_server import RedisCluster, RedisServer, cli_binary, server_binary  # noqa: E402

PREFIX = 4096
SEED = 2026
SECRET = b"bench-tiers-secret-shared-by-the-pools"


def median_time(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def new_pool(model, tiers=None, blocks: int = PREFIX // 16 + 16):
    kw = dict(seed=SEED, model_id="kvrs-demo", tiers=tiers, tier_key=SECRET) if tiers else {}
    return block_pool_from_config(model.config, num_blocks=blocks, block_size=16, **kw)


def prefill(model, pool, prompt):
    seq = pool.new_sequence(tokens=prompt)
    todo = prompt[seq.seq_len :]
    with torch.no_grad(), pool.start_forward([seq] * len(todo), tokens=todo) as batch:
        forward_batch(model, batch, todo)
    return seq


def load_benchmark(model, server: RedisServer, disk_dir: str) -> list[tuple[str, str]]:
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, PREFIX + 1).tolist()
    rows = []
    t_compute = median_time(lambda: prefill(model, new_pool(model), prompt), reps=3)
    rows.append(("recompute the 4k-token prefix (demo model, CPU)", f"{t_compute * 1e3:.0f} ms"))
    tiers = {
        "host": kvrs.HostTier("2GiB"),
        "disk": kvrs.DiskTier(disk_dir, "2GiB"),
        "redis": kvrs.RedisTier(server.url, timeout=5.0),
    }
    for name, tier in tiers.items():
        src = new_pool(model, [tier])
        seq = prefill(model, src, prompt)
        src.store_to_tiers([seq])
        src.flush_tiers()
        nbytes = src.stats()["tiers"][0]["store_bytes"]

        def load(tier=tier, pool=None):
            """A lookup of the whole prefix into `pool` (then emptied again, its blocks
            written back and flushed, so the next lookup finds the tier alone), or into
            a fresh pool."""
            p = pool if pool is not None else new_pool(model, [tier])
            t0 = time.perf_counter()
            s = p.new_sequence(tokens=prompt)
            took = time.perf_counter() - t0
            assert s.num_cached_tokens == PREFIX, s.num_cached_tokens
            del s
            p.evict_all()
            p.flush_tiers()
            return took

        # A serving pool is long-lived: its memory was touched before. A fresh pool
        # pays the kernel's first-touch page faults once, on top of the lookup.
        t_cold = statistics.median(load() for _ in range(5))
        warm = new_pool(model, [tier])
        load(pool=warm)
        if name != "redis":
            t_load = statistics.median(load(pool=warm) for _ in range(5))
        else:
            # The load and the raw transfer of the same keys, interleaved (the server
            # shares the machine's cores, so runs drift): medians of 15 each.
            client = server.client()
            keys = sorted(k.decode() for k in client.keys("kvrs:*"))
            loads, raws = [], []
            for _ in range(15):
                loads.append(load(pool=warm))
                t0 = time.perf_counter()
                tier.get(keys)
                raws.append(time.perf_counter() - t0)
            t_load, t_raw = statistics.median(loads), statistics.median(raws)
        rows.append(
            (f"load it from the {name} tier", f"{t_load * 1e3:.1f} ms ({nbytes / t_load / 1e9:.2f} GB/s)")
        )
        rows.append((f"  {name} load vs recompute", f"{t_compute / t_load:.0f}x faster"))
        rows.append((f"  the first load into a fresh pool ({name})", f"{t_cold * 1e3:.1f} ms"))
        if name == "redis":
            pipe_keys = [keys[i : i + 256] for i in range(0, len(keys), 256)]
            t_py = median_time(lambda client=client, pipe_keys=pipe_keys: [client.mget(k) for k in pipe_keys])
            raw = f"{t_raw * 1e3:.1f} ms ({nbytes / t_raw / 1e9:.2f} GB/s)"
            rows.append(("  raw pipelined MGET, same client, unchecked", raw))
            rows.append(("  load / raw GET bandwidth", f"{t_raw / t_load:.0%}"))
            rows.append(("  raw MGET from redis-py (for reference)", f"{t_py * 1e3:.1f} ms"))

            def after_prefetch(tier=tier, work=0.05):
                """The lookup when prefetch(wait=False) ran at the request's arrival and
                50 ms of other work (the running batch's decode steps) came between."""
                p = new_pool(model, [tier])
                p.prefetch(prompt, wait=False)
                time.sleep(work)
                t0 = time.perf_counter()
                s = p.new_sequence(tokens=prompt)
                took = time.perf_counter() - t0
                assert s.num_cached_tokens == PREFIX and p.stats()["prefetch"]["used"] > 0
                return took

            t_pre = statistics.median(after_prefetch() for _ in range(9))
            rows.append(("  lookup after prefetch(wait=False), 50 ms earlier", f"{t_pre * 1e3:.1f} ms"))
            rows.extend(stall_rows(model, tier, prompt))
    return rows


def longest_gap(stop: threading.Event, pool=None) -> float:
    """The longest time between two iterations of a loop in another Python thread (a
    call on `pool` each time, or pure Python), until `stop` is set."""
    worst, last = 0.0, time.perf_counter()
    while not stop.is_set():
        if pool is not None:
            pool.stats()
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    return worst


def stall_rows(model, tier, prompt) -> list[tuple[str, str]]:
    """How long other Python threads stop while a Redis lookup of the prefix runs: one
    that runs pure Python, one that calls the same pool; against the same loops while
    the main thread only sleeps (scheduling noise)."""
    rows = []
    for who in ("pure-Python thread", "thread calling the same pool"):
        gaps = {}
        for case in ("idle", "lookup"):
            p = new_pool(model, [tier])
            stop, out = threading.Event(), []
            watched = p if "pool" in who else None
            t = threading.Thread(
                target=lambda stop=stop, out=out, w=watched: out.append(longest_gap(stop, w))
            )
            t.start()
            time.sleep(0.02)
            t0 = time.perf_counter()
            if case == "lookup":
                assert p.new_sequence(tokens=prompt).num_cached_tokens == PREFIX
            else:
                time.sleep(0.02)
            took = time.perf_counter() - t0
            stop.set()
            t.join()
            gaps[case] = (out[0], took)
        (idle, _), (busy, took) = gaps["idle"], gaps["lookup"]
        rows.append(
            (
                f"  longest stall of a {who}",
                f"{busy * 1e3:.1f} ms during a {took * 1e3:.0f} ms lookup (idle: {idle * 1e3:.1f} ms)",
            )
        )
    return rows


def cluster_benchmark(binary: str, cli: str) -> list[tuple[str, str]]:
    """A lookup of 256 keys of 64 KiB on a 3-master cluster: RedisTier (one pipeline per
    master, all at once) against raw per-master pipelines of GETs from redis-py, in turn."""
    cluster = RedisCluster(binary, cli)
    cluster.start()
    try:
        keys = [f"kvrs-bench:{i}" for i in range(256)]
        value = np.random.default_rng(0).bytes(64 << 10)
        by_master: dict[int, list[str]] = {}
        for k in keys:
            m = cluster.master_of(k)
            m.client().set(k, value)
            by_master.setdefault(m.port, []).append(k)
        tier = kvrs.RedisTier(cluster.urls[0], timeout=5.0, cluster=True)
        assert all(v == value for v in tier.get(keys))
        clients = {m.port: m.client() for m in cluster.live_masters()}

        def raw():
            for port, ks in by_master.items():
                pipe = clients[port].pipeline(transaction=False)
                for k in ks:
                    pipe.get(k)
                pipe.execute()

        t_tier = median_time(lambda: tier.get(keys), reps=9)
        t_raw = median_time(raw, reps=9)
        mb = len(keys) * len(value) / 1e6
        return [
            (
                "cluster lookup, 256 x 64 KiB over 3 masters",
                f"{t_tier * 1e3:.1f} ms ({mb / t_tier / 1e3:.2f} GB/s)",
            ),
            (
                "  raw per-master GET pipelines, redis-py",
                f"{t_raw * 1e3:.1f} ms ({t_raw / t_tier:.1f}x the tier's time)",
            ),
        ]
    finally:
        cluster.stop()


def workload(url: str | None, seed: int, out: Path) -> dict:
    subprocess.run(
        [sys.executable, str(HERE / "tier_serve.py"), url or "none", str(seed), str(out)], check=True
    )
    return json.loads(out.read_text())


def main() -> int:
    binary = server_binary()
    if binary is None:
        print("bench_tiers: no redis-server; run `make redis`", file=sys.stderr)
        return 1
    torch.set_num_threads(max(1, torch.get_num_threads()))
    server = RedisServer(binary)
    server.start()
    try:
        with tempfile.TemporaryDirectory(prefix="kvrs-bench-tier-") as d:
            model = make_model(0, 8)
            rows = load_benchmark(model, server, d)
        print(f"\n4k-token prefix ({PREFIX} tokens, 8 layers x 2 KV heads x 32, float32 K/V):")
        for name, value in rows:
            print(f"  {name:50s} {value}")
        cli = cli_binary(binary)
        if cli is not None:
            print("\nRedis Cluster (3 masters, 3 replicas, loopback):")
            for name, value in cluster_benchmark(binary, cli):
                print(f"  {name:50s} {value}")
        server.client().flushall()
        print("\nshared-prefix workload over two processes (16 requests each, one 1024-token system prompt):")
        print(f"  {'':28s} {'process':>8} {'prompt tokens computed':>23} {'wall':>8}")
        with tempfile.TemporaryDirectory() as d:
            for label, url in (("without a tier", None), ("with a Redis tier", server.url)):
                for i in (0, 1):
                    r = workload(url, i, Path(d) / f"{label}-{i}.json")
                    print(f"  {label:28s} {i + 1:>8} {r['computed']:>23} {r['seconds']:>7.1f}s")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
