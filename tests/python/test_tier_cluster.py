"""RedisTier on a real Redis Cluster (3 masters, 3 replicas on loopback ports): keys spread
over every master, two processes sharing a prompt through it, a master killed mid-workload
(every lookup within its deadline, nothing wrong loaded, hits back once its replica took
over), a slot migrated under a cached slot map (ASK, then MOVED, followed), and a slow node
(only its keys miss)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from test_tiers import HERE, check_contents, check_shared_runs, evict_everything, pool, serve

import kvrs

# What a lookup may take beyond the tier's timeout (the pool's own work, scheduling).
SLACK = 0.3


@pytest.fixture(scope="module")
def redis_cluster():
    """A real Redis Cluster for this module (started here, stopped at the end)."""
    from redis_server import RedisCluster, cli_binary, server_binary

    binary = server_binary()
    cli = binary and cli_binary(binary)
    if binary is None or cli is None:
        pytest.fail("no redis-server or redis-cli: run `make redis` (the tier tests need a real server)")
    cluster = RedisCluster(binary, cli)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(redis_cluster):
    """The module's cluster with every node running (a node killed by a test restarted: it
    rejoins as a replica), every slot served, every master empty."""
    for n in redis_cluster.nodes:
        if not n.running():
            n.start()
    redis_cluster.wait_ok(redis_cluster.nodes)
    for m in redis_cluster.live_masters():
        m.client().flushall()
    return redis_cluster


def prompts(n):
    return [[1000 * (i + 1) + t for t in range(17)] for i in range(n)]


def keys_per_master(cluster):
    return {m.port: m.client().dbsize() for m in cluster.live_masters()}


def test_blocks_spread_over_every_master_and_come_back_bit_for_bit(cluster):
    tier = kvrs.RedisTier(cluster.urls[0], timeout=1.0, cluster=True)
    assert tier.cluster and repr(tier).endswith("cluster=True)")
    assert tier.stats()["name"].startswith("redis-cluster://127.0.0.1:")
    p = pool([tier], num_blocks=64)
    for tokens in prompts(8):
        serve(p, tokens).free()
    evict_everything(p)
    assert tier.stats()["stores"] == 32 and tier.stats()["errors"] == 0
    per_master = keys_per_master(cluster)
    assert len(per_master) == 3 and all(n > 0 for n in per_master.values()), per_master
    assert sum(per_master.values()) == 32
    # The tier reads each key from its master, byte for byte what the master holds.
    keys = [k.decode() for m in cluster.live_masters() for k in m.client().keys("*")]
    raw = tier.get(keys)
    for k, v in zip(keys, raw, strict=True):
        assert v is not None and v == cluster.master_of(k).client().get(k)
    # A fresh pool (a seed list this time) serves every prompt from the cluster.
    tier2 = kvrs.RedisTier([cluster.urls[1], cluster.urls[2]], timeout=1.0)
    assert tier2.cluster
    q = pool([tier2], num_blocks=64)
    for tokens in prompts(8):
        s = q.new_sequence(tokens=tokens)
        assert s.num_cached_tokens == 16
        check_contents(s, tokens)
        s.free()
    assert tier2.stats()["hits"] == 32 and tier2.stats()["errors"] == 0
    # drop_tier_namespace scans every master.
    assert q.drop_tier_namespace() == 32
    assert sum(keys_per_master(cluster).values()) == 0


def test_two_processes_share_a_prompt_through_the_cluster(cluster, tmp_path):
    """As test_tiers.py's two-process test, through the cluster: the second process serves
    the first one's prompt with the first one's K/V, and generates what a run without any
    cache does."""
    pytest.importorskip("transformers")
    outs = []
    for i, flags in enumerate((["--store"], [])):
        out = tmp_path / f"run{i}.npz"
        url = cluster.urls[i]  # each process seeds from another node
        subprocess.run(
            [sys.executable, str(HERE / "tier_worker.py"), url, str(out), "--cluster", *flags],
            check=True,
            timeout=300,
        )
        outs.append(np.load(out))
    stats = check_shared_runs(*outs)
    assert stats["errors"] == 0
    assert sum(keys_per_master(cluster).values()) == 6


def test_a_killed_master_costs_its_keys_until_its_replica_takes_over(cluster):
    timeout = 0.2
    tier = kvrs.RedisTier(cluster.urls[0], timeout=timeout, retry_after=0.3, cluster=True)
    p = pool([tier], num_blocks=64)
    work = prompts(12)
    for tokens in work:
        serve(p, tokens).free()
    evict_everything(p)
    assert tier.stats()["stores"] == 48
    # The victim serves some prompt's blocks; wait until its replica holds all of them.
    victim = max(cluster.live_masters(), key=lambda m: m.client().dbsize())
    replica = next(
        n for n in cluster.nodes if n.client().info("replication").get("master_port") == victim.port
    )
    deadline = time.monotonic() + 5
    while replica.client().dbsize() != victim.client().dbsize():
        assert time.monotonic() < deadline, "the replica did not catch up"
        time.sleep(0.02)
    victim.kill()
    killed = time.monotonic()
    slowest, full, rounds = 0.0, None, 0
    while full is None:
        assert time.monotonic() - killed < 15, "hits did not resume after the failover"
        rounds += 1
        q = pool([tier], num_blocks=64)  # a fresh pool: every lookup goes to the tier
        cached = []
        for tokens in work:
            t0 = time.monotonic()
            s = q.new_sequence(tokens=tokens)
            slowest = max(slowest, time.monotonic() - t0)
            cached.append(s.num_cached_tokens)
            check_contents(s, tokens)  # nothing wrong loaded, whatever the cluster did
            s.free()
        if all(c == 16 for c in cached):
            full = time.monotonic() - killed
        time.sleep(0.05)
    print(f"failover: hits back {full:.2f} s after the kill, {rounds} rounds, slowest {slowest * 1e3:.0f} ms")
    assert slowest < timeout + SLACK, slowest
    assert rounds > 1, "the kill cost nothing: the test saw no failover"
    assert tier.stats()["errors"] > 0
    assert replica.client().info("replication")["role"] == "master"


def slot_owner_ids(cluster):
    """node id by port, of every live node."""
    out = {}
    for n in cluster.nodes:
        if n.running():
            out[n.port] = n.client().execute_command("CLUSTER", "MYID").decode()
    return out


def test_a_migrated_slot_is_followed_through_ask_and_moved(cluster):
    tier = kvrs.RedisTier(cluster.urls[0], timeout=1.0, cluster=True)
    key = "kvrs-test:migrated"
    source = cluster.master_of(key)
    target = next(m for m in cluster.live_masters() if m.port != source.port)
    source.client().set(key, b"payload")
    assert tier.get([key]) == [b"payload"]  # the tier's slot map now says: source
    ids = slot_owner_ids(cluster)
    slot = source.client().execute_command("CLUSTER", "KEYSLOT", key)
    src, dst = source.client(), target.client()
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.port])
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target.port])
    src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", key)
    # Mid-migration the source answers ASK for the key it no longer has.
    assert tier.get([key]) == [b"payload"]
    others = [m for m in cluster.live_masters() if m.port not in (source.port, target.port)]
    for node in (target, source, *others):
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target.port])
    # Done: the source answers MOVED; the tier follows it and updates its map.
    before = target.client().info("commandstats").get("cmdstat_get", {}).get("calls", 0)
    assert tier.get([key, "kvrs-test:absent"]) == [b"payload", None]
    assert tier.get([key]) == [b"payload"]
    after = target.client().info("commandstats").get("cmdstat_get", {}).get("calls", 0)
    assert after - before >= 2
    assert tier.stats()["errors"] == 0
    cluster.wait_ok(cluster.nodes)


def test_a_slow_node_costs_only_its_own_keys(cluster):
    timeout = 0.3
    tier = kvrs.RedisTier(cluster.urls[0], timeout=timeout, retry_after=5.0, cluster=True)
    keys = [f"kvrs-test:{i}" for i in range(60)]
    for k in keys:
        cluster.master_of(k).client().set(k, k.encode())
    assert tier.get(keys) == [k.encode() for k in keys]
    slow = cluster.live_masters()[0]
    on_slow = {k for k in keys if cluster.master_of(k).port == slow.port}
    assert 0 < len(on_slow) < len(keys)
    sleeper = threading.Thread(target=lambda: slow.client().execute_command("DEBUG", "SLEEP", 1.5))
    sleeper.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    got = tier.get(keys)
    took = time.monotonic() - t0
    assert took < timeout + 0.1, took
    assert got == [None if k in on_slow else k.encode() for k in keys]
    assert tier.stats()["errors"] >= 1
    # While that node is marked down, its keys miss at once; the others are still served.
    t0 = time.monotonic()
    assert tier.get(keys) == got
    assert time.monotonic() - t0 < 0.1
    sleeper.join()
