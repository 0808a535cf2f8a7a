"""Tiers that persist without ceremony: a pool with a persistent tier writes its blocks
through as they become cached, so a process that serves requests and exits with no extra
call leaves them for the next process; `close()` and the pool as a context manager store
what is cached; a writer killed mid-write leaves nothing a reader accepts wrongly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvrs

L, H, D, BS = 2, 2, 8, 4


def pool(tiers, **kw):
    return kvrs.BlockPool(
        L, H, D, block_size=BS, num_blocks=16, dtype="float32", seed=3, model_id="m", tiers=tiers, **kw
    )


def fill(p, tokens):
    s = p.new_sequence(tokens=tokens)
    n = len(tokens) - s.seq_len
    kv = np.arange(n * H * D, dtype=np.float32).reshape(n, H, D)
    for layer in range(L):
        s.append(layer, kv, kv)
    s.advance(n, tokens=tokens[s.seq_len :])
    return s


def stores(p):
    return p.stats()["tiers"][0]["stores"]


def test_the_policy_defaults_to_write_through_with_a_persistent_tier(tmp_path):
    assert pool([kvrs.DiskTier(tmp_path, "1MiB")]).tier_write_policy == "write_through"
    assert pool([kvrs.HostTier("1MiB")]).tier_write_policy == "write_back"
    assert pool(None).tier_write_policy is None
    p = pool([kvrs.HostTier("1MiB")], tier_write_policy="write_through_selective", tier_write_hits=3)
    assert p.tier_write_policy == "write_through_selective"
    with pytest.raises(ValueError, match=r"tier_write_policy.*write_through"):
        pool([kvrs.HostTier("1MiB")], tier_write_policy="eager")
    for hits in (0, -1, 2**40):
        with pytest.raises(ValueError, match=rf"tier_write_hits={hits}: must be in \[1, "):
            pool([kvrs.HostTier("1MiB")], tier_write_policy="write_through_selective", tier_write_hits=hits)


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_each_policy_writes_a_block_once(policy):
    p = pool([kvrs.HostTier("1MiB")], tier_write_policy=policy, tier_write_hits=2)
    prompt = list(range(1, 10))  # two whole blocks
    fill(p, prompt).free()
    p.flush_tiers()
    assert stores(p) == {"write_through": 2, "write_back": 0, "write_through_selective": 0}[policy]
    for _ in range(2):  # two prefix hits
        fill(p, prompt).free()
    p.flush_tiers()
    assert stores(p) == {"write_through": 2, "write_back": 0, "write_through_selective": 2}[policy]
    p.evict_all()
    p.flush_tiers()
    assert stores(p) == 2  # whatever the policy, each block once


def test_close_and_the_context_manager_store_what_is_cached(tmp_path):
    with pool([kvrs.DiskTier(tmp_path, "1MiB")], tier_write_policy="write_back") as p:
        fill(p, list(range(1, 10)))
        assert stores(p) == 0
    assert stores(p) == 2
    assert p.close() == 0  # twice is harmless
    fresh = pool([kvrs.DiskTier(tmp_path, "1MiB")])
    assert fresh.new_sequence(tokens=list(range(1, 10))).num_cached_tokens == 8


WRITER = textwrap.dedent(
    """
    import json, sys
    import kvrs
    from kvrs.demo import make_tiny_model
    from kvrs.integrations.transformers import block_pool_from_config, generate_batch

    path, prompts = sys.argv[1], json.loads(sys.argv[2])
    model = make_tiny_model(3)
    pool = block_pool_from_config(model, num_blocks=256, seed=2026, tiers=[kvrs.DiskTier(path, "64MiB")])
    cached = []
    print("started", flush=True)
    out = generate_batch(model, prompts, pool=pool, max_new_tokens=int(sys.argv[3]),
                         on_step=lambda step, pool, reqs: cached.extend(
                             r.cached for r in reqs if r.admitted == step))
    print(json.dumps({"out": out, "cached": cached}), flush=True)
    """
)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 128, 40).tolist()
    return [shared + rng.integers(1, 128, 5).tolist() for _ in range(n)]


def serve(path, ps, new_tokens: int = 6) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", WRITER, str(path), json.dumps(ps), str(new_tokens)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_naive_writer_and_reader_share_a_prefix_through_a_disk_tier(tmp_path):
    """A process serves one request and exits, with no call to flush or evict; the next
    process on the same directory hits the shared prefix from disk and generates the
    same tokens as without it."""
    first = serve(tmp_path, prompts(1))
    assert first["cached"] == [0]
    second = serve(tmp_path, prompts(1))
    assert second["cached"] == [32]  # two whole blocks of the 45-token prompt
    assert second["out"] == first["out"]


def test_a_writer_killed_mid_write_leaves_nothing_a_reader_accepts_wrongly(tmp_path):
    """SIGKILL a writer while it serves many requests: its partial files are never under a
    key, and a reader gets exactly the tokens of a process without the tier."""
    ps = prompts(24, seed=1)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), json.dumps(ps), "40"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 120
        while not any(f.is_file() for f in tmp_path.rglob("*")) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    ps = ps[:4]
    reader = serve(tmp_path, ps)
    plain = serve(tmp_path / "empty", ps)
    assert plain["cached"][0] == 0
    assert reader["out"] == plain["out"]
