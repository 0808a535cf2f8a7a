"""Offload tiers: evicted blocks written to a DiskTier or a real Redis server and served
back to later prompts, in this process, after a restart and in another process; and the
faults a tier meets (a server killed or slow, stale, truncated or corrupted payloads, a
full disk), none of which may fail generation or load wrong K/V."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvrs

L, H, D, BS = 2, 2, 8, 4
HERE = Path(__file__).resolve().parent


def kv_of(tokens, start, n):
    """K/V of positions start..start+n: a function of the token ids up to each position,
    as a model's would be."""
    out = np.empty((n, H, D), np.float32)
    for i, p in enumerate(range(start, start + n)):
        out[i] = np.random.default_rng(hash(tuple(tokens[: p + 1])) % 2**32).standard_normal((H, D))
    return out


def pool(tiers, num_blocks=8, **kw):
    kw.setdefault("seed", 11)
    kw.setdefault("dtype", "float32")
    if tiers:
        kw.setdefault("model_id", "model-a")
        # These tests follow blocks written when evicted (test_tier_write_policy.py: the rest).
        kw.setdefault("tier_write_policy", "write_back")
    return kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=num_blocks, tiers=tiers, **kw)


def serve(p, tokens, **kw):
    """Starts a sequence for `tokens`, computes what was not cached, commits; returns it."""
    s = p.new_sequence(tokens=tokens, **kw)
    n = len(tokens) - s.seq_len
    k = kv_of(tokens, s.seq_len, n)
    for layer in range(L):
        s.append(layer, k, -k * (layer + 1))
    s.advance(n, tokens=tokens[s.seq_len :])
    return s


def check_contents(s, tokens):
    """The sequence holds the K/V its tokens determine (whatever served them)."""
    want = kv_of(tokens, 0, s.seq_len).transpose(1, 0, 2)
    for layer in range(L):
        k, v = s.get(layer)
        np.testing.assert_array_equal(k, want)
        np.testing.assert_array_equal(v, -want * (layer + 1))


def evict_everything(p):
    """Pushes every cached block out of the pool (to the tiers) and waits for the writes."""
    p.evict_all()
    p.flush_tiers()


PROMPT = list(range(1, 18))  # 4 whole blocks and one token


def tier_stats(p, i=0):
    return p.stats()["tiers"][i]


def test_disk_tier_takes_evictions_and_a_restart_finds_them(tmp_path):
    disk = kvrs.DiskTier(tmp_path / "tier", "1MiB")
    p = pool([disk])
    s = serve(p, PROMPT)
    s.free()
    # Memory pressure: other prompts take the pool's blocks and evict the cached ones.
    for i in range(3):
        serve(p, [1000 * (i + 1) + t for t in range(17)]).free()
    p.flush_tiers()  # writes are asynchronous
    assert tier_stats(p)["stores"] >= 4
    again = p.new_sequence(tokens=PROMPT)
    assert again.num_cached_tokens == 16
    assert again.cached_tokens_by_tier == {"pool": 0, disk.stats()["name"]: 16}
    check_contents(again, PROMPT)
    again.free()
    evict_everything(p)
    del p, again
    # A restart: a new tier object over the same directory, a new pool.
    fresh = pool([kvrs.DiskTier(tmp_path / "tier", "1MiB")])
    s = fresh.new_sequence(tokens=PROMPT)
    assert s.num_cached_tokens == 16
    check_contents(s, PROMPT)
    assert tier_stats(fresh)["hits"] == 4


def test_disk_tier_stays_in_its_bound_least_recently_used_out(tmp_path):
    disk = kvrs.DiskTier(tmp_path, 10_000)
    p = pool([disk], num_blocks=8)
    for i in range(12):
        serve(p, [100 * (i + 1) + t for t in range(9)]).free()
        evict_everything(p)
    assert disk.used_bytes() <= 10_000
    assert disk.stats()["evictions"] > 0
    # The most recent prompt is still there; the first is gone.
    assert pool([disk]).new_sequence(tokens=[1200 + t for t in range(9)]).num_cached_tokens == 8
    assert pool([disk]).new_sequence(tokens=[100 + t for t in range(9)]).num_cached_tokens == 0


def test_other_models_and_configurations_never_read_the_blocks(tmp_path):
    disk = kvrs.DiskTier(tmp_path, "1MiB")
    p = pool([disk], model_id="model-a")
    serve(p, PROMPT).free()
    evict_everything(p)
    for other in (
        pool([disk], model_id="model-b"),
        pool([disk], model_id="model-a", dtype="float16"),
        pool([disk], model_id="model-a", seed=12),
        kvrs.BlockPool(
            L, H, D, block_size=BS, num_blocks=8, layout="HND", tiers=[disk], seed=11, model_id="model-a"
        ),
    ):
        assert other.new_sequence(tokens=PROMPT).num_cached_tokens == 0
        assert other.stats()["tiers"][0]["hits"] == 0
    assert pool([disk], model_id="model-a").new_sequence(tokens=PROMPT).num_cached_tokens == 16


def test_namespaces_and_extra_keys_stay_apart_and_a_namespace_can_be_dropped(redis_url):
    tier = kvrs.RedisTier(redis_url)
    p = pool([tier])
    for ns in ("tenant-a", "tenant-b"):
        serve(p, PROMPT, namespace=ns).free()
    evict_everything(p)
    q = pool([tier])
    assert q.new_sequence(tokens=PROMPT).num_cached_tokens == 0  # no namespace: another chain
    assert q.new_sequence(tokens=PROMPT, namespace="tenant-a", extra_key="lora").num_cached_tokens == 0
    assert q.drop_tier_namespace("tenant-a") == 4
    r = pool([tier])
    assert r.new_sequence(tokens=PROMPT, namespace="tenant-a").num_cached_tokens == 0
    s = r.new_sequence(tokens=PROMPT, namespace="tenant-b")
    assert s.num_cached_tokens == 16
    check_contents(s, PROMPT)


def test_store_now_and_prefetch(redis_url):
    tier = kvrs.RedisTier(redis_url)
    p = pool([tier])
    s = serve(p, PROMPT)
    assert p.store_to_tiers([s]) == 4  # the prompt's whole, cached blocks
    p.flush_tiers()
    q = pool([tier])
    assert q.match_prefix(PROMPT) == 0
    assert q.prefetch(PROMPT) == 16  # loaded into q's cache without a sequence
    assert q.match_prefix(PROMPT) == 16
    t = q.new_sequence(tokens=PROMPT)
    assert t.cached_tokens_by_tier == {"pool": 16, tier.stats()["name"]: 0}
    check_contents(t, PROMPT)
    with pytest.raises(kvrs.NotSupportedError, match="tiers"):
        pool(None).prefetch(PROMPT)


def test_prefetch_in_the_background_overlaps_a_slow_server(redis_server, redis_url):
    """prefetch(wait=False) returns while the server is busy; the lookup then loads from
    the prefetch buffer (waiting for the fetch), without asking the server again."""
    tier = kvrs.RedisTier(redis_url, timeout=3.0)
    p = pool([tier])
    p.store_to_tiers([serve(p, PROMPT)])
    p.flush_tiers()
    asked = tier.stats()["lookups"]
    q = pool([tier])
    blocker = threading.Thread(target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "0.6"))
    blocker.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    assert q.prefetch(PROMPT, wait=False) == 16  # the 4 whole blocks q lacks
    assert time.monotonic() - t0 < 0.3
    assert q.prefetch(PROMPT, wait=False) == 16  # asked once: the keys are pending
    s = q.new_sequence(tokens=PROMPT)  # waits for the fetch under way
    took = time.monotonic() - t0
    blocker.join()
    assert 0.3 < took < 2.5, took
    assert s.cached_tokens_by_tier == {"pool": 0, tier.stats()["name"]: 16}
    check_contents(s, PROMPT)
    st = q.stats()
    assert st["prefetch"] == {
        "requested": 4,
        "fetched": 4,
        "used": 4,
        "discarded": 0,
        "buffered": 0,
        "buffered_bytes": 0,
    }
    assert st["tiers"][0]["lookups"] == asked + 4 and st["tiers"][0]["hits"] == 4
    assert q.prefetch(PROMPT, wait=False) == 0  # cached now: nothing to fetch


def wait_until(done, seconds=10.0):
    """Waits until `done()` holds (fails the test after `seconds`, never hangs it)."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_prefetched_payloads_are_checked_bounded_and_dropped_with_their_namespace(tmp_path):
    tier = kvrs.DiskTier(tmp_path / "d", "1MiB")
    p = pool([tier], num_blocks=16)
    long = list(range(1, 42))  # 10 whole blocks
    p.store_to_tiers([serve(p, long), serve(p, PROMPT, namespace="other")])
    p.flush_tiers()
    files = sorted((tmp_path / "d").rglob("*.kvb"))
    assert len(files) == 14
    q = pool([tier])  # 8 blocks: a buffer of 8 payloads
    # The pool lacks 10 blocks; at most the buffer's size is fetched ahead.
    assert q.prefetch(long, wait=False) == 40
    wait_until(lambda: q.stats()["prefetch"]["fetched"] == 8)
    st = q.stats()["prefetch"]
    assert (st["requested"], st["buffered"], st["discarded"]) == (8, 8, 0)
    assert st["buffered_bytes"] == 8 * files[0].stat().st_size
    s = q.new_sequence(tokens=long)
    # The pool's room: 8 blocks, all from the buffer.
    assert s.num_cached_tokens == 32
    check_contents(s, long)
    st = q.stats()["prefetch"]
    assert (st["used"], st["buffered"]) == (8, 0)
    # A payload corrupted before its fetch is refused when a lookup uses it.
    r = pool([tier])
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 1
        f.write_bytes(bytes(raw))
    assert r.prefetch(PROMPT, namespace="other", wait=False) == 16
    s = r.new_sequence(tokens=PROMPT, namespace="other")
    assert s.num_cached_tokens == 0
    assert r.stats()["tiers"][0]["rejected"] == 4  # and removed from the disk
    assert r.stats()["prefetch"]["used"] == 4
    # Dropping a namespace drops its fetched payloads too.
    r.prefetch(long, wait=False)
    wait_until(lambda: r.stats()["prefetch"]["fetched"] == 12)
    assert r.stats()["prefetch"]["buffered"] == 8
    assert r.drop_tier_namespace() == 10
    assert r.stats()["prefetch"]["buffered"] == 0


def check_shared_runs(first, second):
    """Two `tier_worker.py` runs, the second after the first stored its prompt: the second
    found the 6 whole blocks of the 100-token prompt in the tier with the first one's K/V,
    and generated what both runs and a run without any cache generate. Returns the
    second run's tier stats."""
    assert int(first["cached"]) == 0
    assert int(second["cached"]) == 96
    assert list(json.loads(str(second["by_tier"])).values()) == [0, 96]
    for layer in range(2):
        for kv in "kv":
            np.testing.assert_array_equal(second[f"{kv}{layer}"][:, :96], first[f"{kv}{layer}"][:, :96])
    np.testing.assert_array_equal(second["generated"], first["generated"])
    np.testing.assert_array_equal(second["generated"], second["plain"])
    stats = json.loads(str(second["stats"]))[0]
    assert stats["hits"] == 6
    return stats


def test_two_processes_share_a_prompt_through_redis(redis_url, tmp_path):
    """Two separate Python processes with separate pools and one Redis: the second serves
    the first one's prompt from Redis, with the first one's K/V, and its model output
    equals a run without any cache (the demo's model)."""
    pytest.importorskip("transformers")
    outs = []
    for i, flags in enumerate((["--store"], [])):
        out = tmp_path / f"run{i}.npz"
        subprocess.run(
            [sys.executable, str(HERE / "tier_worker.py"), redis_url, str(out), *flags],
            check=True,
            timeout=300,
        )
        outs.append(np.load(out))
    check_shared_runs(*outs)


def test_a_killed_server_makes_misses_and_dropped_writes_then_recovers(redis_server, redis_url):
    tier = kvrs.RedisTier(redis_url, timeout=0.2, retry_after=0.3)
    p = pool([tier])
    serve(p, PROMPT).free()
    evict_everything(p)
    redis_server.kill()
    q = pool([tier])
    t0 = time.monotonic()
    s = serve(q, PROMPT)  # the lookup fails: computed from scratch
    assert time.monotonic() - t0 < 2.0
    assert s.num_cached_tokens == 0
    check_contents(s, PROMPT)
    s.free()
    evict_everything(q)  # written while the server is down: dropped, counted
    st = q.stats()
    assert st["tiers"][0]["errors"] >= 2
    assert st["tier_queue"]["unstored"] >= 4
    redis_server.start()  # the same port, empty (no persistence)
    time.sleep(0.35)
    serve(q, PROMPT).free()
    evict_everything(q)
    s = pool([tier]).new_sequence(tokens=PROMPT)
    assert s.num_cached_tokens == 16
    check_contents(s, PROMPT)


def test_a_slow_server_costs_one_timeout(redis_server, redis_url):
    tier = kvrs.RedisTier(redis_url, timeout=0.1, retry_after=5.0)
    p = pool([tier])
    serve(p, PROMPT).free()
    evict_everything(p)
    blocker = threading.Thread(target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "1.5"))
    blocker.start()
    time.sleep(0.1)
    q = pool([tier])
    t0 = time.monotonic()
    s = q.new_sequence(tokens=PROMPT)
    again = q.new_sequence(tokens=PROMPT)  # the tier is skipped for retry_after
    took = time.monotonic() - t0
    blocker.join()
    assert took < 0.8, took
    assert s.num_cached_tokens == 0 and again.num_cached_tokens == 0
    assert q.stats()["tiers"][0]["errors"] >= 2


def test_a_full_write_queue_drops_instead_of_waiting(redis_server, redis_url):
    tier = kvrs.RedisTier(redis_url, timeout=1.0)
    p = pool([tier], num_blocks=64, tier_queue=1)
    for i in range(12):
        serve(p, [100 * (i + 1) + t for t in range(17)]).free()
    blocker = threading.Thread(target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "0.5"))
    blocker.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    p.evict_all()  # 48 blocks; the thread is stuck on the first batch
    took = time.monotonic() - t0
    blocker.join()
    p.flush_tiers()
    q = p.stats()["tier_queue"]
    assert took < 0.4, took
    assert q["dropped"] > 0 and q["queued"] + q["dropped"] == 48


def stored_keys(client):
    return sorted(client.keys("kvrs:*"))


@pytest.mark.parametrize(
    "fault", ["truncated", "bit flip in K/V", "bit flip in tokens", "another configuration"]
)
def test_bad_payloads_are_refused_counted_and_discarded(redis_server, redis_url, fault):
    tier = kvrs.RedisTier(redis_url)
    p = pool([tier])
    serve(p, PROMPT).free()
    evict_everything(p)
    client = redis_server.client()
    keys = stored_keys(client)
    assert len(keys) == 4
    if fault == "another configuration":
        # A payload written for another model sits under this pool's key.
        other = pool([tier], model_id="other")
        serve(other, PROMPT).free()
        evict_everything(other)
        foreign = [k for k in stored_keys(client) if k not in keys]
        client.set(keys[2], client.get(foreign[2]))
    else:
        raw = bytearray(client.get(keys[2]))
        if fault == "truncated":
            raw = raw[: len(raw) // 2]
        else:
            at = len(raw) - 100 if fault == "bit flip in K/V" else 128
            raw[at] ^= 0x10
        client.set(keys[2], bytes(raw))
    q = pool([tier])
    s = serve(q, PROMPT)
    st = q.stats()["tiers"][0]
    assert st["rejected"] == 1
    # Loads stop at the bad block: the chain's first blocks come from Redis.
    assert s.cached_tokens_by_tier[tier.stats()["name"]] == s.num_cached_tokens
    assert s.num_cached_tokens < 16
    check_contents(s, PROMPT)
    if fault == "truncated":
        # A value of the wrong length is refused before it is buffered, and left alone
        # (deleting by what a reply seemed to hold could delete valid blocks): the pool
        # that computed the block writes the genuine payload over it.
        assert len(client.get(keys[2])) == len(raw)
        s.free()
        evict_everything(q)
        assert len(client.get(keys[2])) == len(client.get(keys[1]))
    else:
        assert client.exists(keys[2]) == 0  # discarded, not read again


def test_a_corrupted_disk_file_is_refused_and_removed(tmp_path):
    disk = kvrs.DiskTier(tmp_path, "1MiB")
    p = pool([disk])
    serve(p, PROMPT).free()
    evict_everything(p)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) == 4
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-40] ^= 1
        f.write_bytes(bytes(raw))
    s = serve(pool([disk]), PROMPT)
    assert s.num_cached_tokens == 0
    check_contents(s, PROMPT)
    assert disk.stats()["rejected"] == 4  # one batched lookup reads all four
    assert not any(f.exists() for f in files)


def test_a_full_disk_drops_writes_and_generation_goes_on(tmp_path):
    """A process whose files may not grow past 1 KiB (RLIMIT_FSIZE: writes fail as on a
    full disk): every store fails and is counted; serving goes on."""
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        sys.path.insert(0, {str(HERE)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
        import kvrs
        from test_tiers import pool, serve, check_contents, PROMPT
        disk = kvrs.DiskTier({str(tmp_path)!r}, "1MiB")
        p = pool([disk])
        for i in range(3):
            serve(p, [t + 100 * i for t in PROMPT]).free()
        p.evict_all()
        p.flush_tiers()
        st = p.stats()
        assert st["tiers"][0]["errors"] >= 8, st
        assert st["tiers"][0]["stores"] == 0, st
        assert st["tier_queue"]["unstored"] >= 8, st
        s = serve(p, PROMPT)
        check_contents(s, PROMPT)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert not list(tmp_path.rglob("*.kvb"))
    assert not [f for f in tmp_path.rglob("*") if f.is_file()], "no temporary file left behind"


def test_tier_arguments_are_checked(tmp_path, redis_url):
    disk = kvrs.DiskTier(tmp_path, "1MiB")
    with pytest.raises(ValueError, match="seed"):
        kvrs.BlockPool(L, H, D, num_blocks=4, tiers=[disk], model_id="m")
    with pytest.raises(ValueError, match="tiers"):
        kvrs.BlockPool(L, H, D, num_blocks=4, tiers=[disk], seed=1, prefix_caching=False, model_id="m")
    with pytest.raises(TypeError, match="tiers"):
        kvrs.BlockPool(L, H, D, num_blocks=4, tiers=["disk"], seed=1, model_id="m")
    # A tier keys blocks by the model: a pool must name its model to use one.
    with pytest.raises(ValueError, match=r"model_id.*must name the model.*block_pool_from_config"):
        kvrs.BlockPool(L, H, D, num_blocks=4, tiers=[disk], seed=1)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="max_bytes"):
            kvrs.DiskTier(tmp_path, bad)
    with pytest.raises(ValueError, match="url"):
        kvrs.RedisTier("http://example.com")
    with pytest.raises(ValueError, match="timeout"):
        kvrs.RedisTier(redis_url, timeout=0)
    with pytest.raises(ValueError, match="ttl"):
        kvrs.RedisTier(redis_url, ttl=0)
    assert repr(kvrs.RedisTier(redis_url)) == f"RedisTier({redis_url!r})"
    assert disk.max_bytes == 1 << 20 and Path(disk.path) == tmp_path


def test_ttl_expires_blocks(redis_server, redis_url):
    tier = kvrs.RedisTier(redis_url, ttl=60)
    p = pool([tier])
    serve(p, PROMPT).free()
    evict_everything(p)
    client = redis_server.client()
    ttls = [client.ttl(k) for k in stored_keys(client)]
    assert ttls and all(0 < t <= 60 for t in ttls)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "fp8_e4m3", "int8"])
def test_every_dtype_round_trips_through_a_tier(tmp_path, dtype):
    disk = kvrs.DiskTier(tmp_path, "1MiB")
    p = pool([disk], dtype=dtype)
    s = serve(p, PROMPT)
    want = [tuple(np.array(x) for x in s.get(layer, dequantize=True)) for layer in range(L)]
    scales = [s.scales(layer) for layer in range(L)]
    s.free()
    evict_everything(p)
    t = pool([disk], dtype=dtype).new_sequence(tokens=PROMPT)
    assert t.num_cached_tokens == 16
    for layer in range(L):
        got = t.get(layer, dequantize=True)
        np.testing.assert_array_equal(got[0], want[layer][0][:, :16])
        np.testing.assert_array_equal(got[1], want[layer][1][:, :16])
        if dtype == "int8":
            np.testing.assert_array_equal(t.scales(layer)[0], scales[layer][0][:, :16])


def test_sliding_window_pools_use_tiers(tmp_path):
    disk = kvrs.DiskTier(tmp_path, "1MiB")
    kw = dict(layer_types=["full", "sliding"], sliding_window=6)
    p = pool([disk], num_blocks=16, **kw)
    serve(p, PROMPT).free()
    evict_everything(p)
    s = pool([disk], num_blocks=16, **kw).new_sequence(tokens=PROMPT)
    assert s.num_cached_tokens == 16
    for layer in range(L):
        k, _ = s.get(layer)
        want = kv_of(PROMPT, 0, 16).transpose(1, 0, 2)
        np.testing.assert_array_equal(k, want[:, 16 - k.shape[1] :])


def test_a_host_tier_in_front_and_write_all_share_through_redis(redis_url):
    """A HostTier for this process, and Redis for the others: with tier_write="all" an
    evicted block goes to both; the host copy serves this process, Redis another pool."""
    host = kvrs.HostTier("1MiB")
    redis_tier = kvrs.RedisTier(redis_url)
    p = pool([host, redis_tier], tier_write="all")
    serve(p, PROMPT).free()
    evict_everything(p)
    assert host.stats()["stores"] == 4 and redis_tier.stats()["stores"] == 4
    s = p.new_sequence(tokens=PROMPT)
    assert s.cached_tokens_by_tier == {"pool": 0, "host": 16, redis_tier.stats()["name"]: 0}
    check_contents(s, PROMPT)
    other = pool([redis_tier]).new_sequence(tokens=PROMPT)
    assert other.cached_tokens_by_tier[redis_tier.stats()["name"]] == 16
    check_contents(other, PROMPT)
    # The default writes each block once, to the first tier that takes it.
    first = pool([kvrs.HostTier("1MiB"), redis_tier], seed=12)
    serve(first, PROMPT).free()
    evict_everything(first)
    assert first.stats()["tiers"][0]["stores"] == 4 and redis_tier.stats()["stores"] == 4
    assert host.used_bytes() <= host.max_bytes and repr(host) == "HostTier(max_bytes=1048576)"
    with pytest.raises(ValueError, match="tier_write"):
        pool([host], tier_write="some")
    with pytest.raises(ValueError, match="max_bytes"):
        kvrs.HostTier(0)


def test_two_processes_share_a_disk_directory_at_once(tmp_path):
    """Two processes write and read one small directory at the same time (each evicting
    the other's files to stay in the bound): no crash, no torn file read, the bound holds,
    and what is left serves a third pool with the right K/V."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import kvrs
        from test_tiers import pool, serve, check_contents
        disk = kvrs.DiskTier({str(tmp_path)!r}, 40_000)
        p = pool([disk], num_blocks=12)
        for i in range(40):
            tokens = [(i % 7) * 100 + t for t in range(17)]
            s = serve(p, tokens)
            check_contents(s, tokens)
            s.free()
            p.evict_all()
        p.flush_tiers()
        print(p.stats()["tiers"][0]["hits"])
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(int(o.strip()) for o in outs) > 0, "the processes served blocks from the directory"
    disk = kvrs.DiskTier(tmp_path, 40_000)
    assert disk.used_bytes() <= 40_000
    for i in range(7):
        tokens = [i * 100 + t for t in range(17)]
        check_contents(serve(pool([disk]), tokens), tokens)
