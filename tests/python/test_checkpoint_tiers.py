"""Hybrid prefixes through tiers and files: a pool with state layers writes its recurrent-state
checkpoints at block ends to a DiskTier or a real Redis server with their blocks, and a restarted
pool (a new tier object) hits the prefix with the state restored; prefix-cache files carry every
cached checkpoint, token-granular, and refuse a pool of another state layout."""

from __future__ import annotations

import numpy as np
import pytest

import kvrs

BS, D = 4, 2


def h_of(tokens):
    """The recurrent state after `tokens`: a function of all of them, as a model's is."""
    return np.random.default_rng(hash(tuple(tokens)) % 2**32).standard_normal(3).astype(np.float32)


def kv_of(tokens, start, n):
    """K/V of positions start..start+n ([n, 1, D]): a function of the token ids up to each."""
    rows = [np.full((1, D), hash(tuple(tokens[: p + 1])) % 1000, np.float32) for p in range(start, start + n)]
    return np.stack(rows)


def pool(tiers=None, shape=(3,)):
    return kvrs.BlockPool(
        1,
        1,
        D,
        block_size=BS,
        num_blocks=8,
        dtype="float32",
        seed=3,
        state_layers=1,
        state_shapes={"h": shape},
        state_slots=2,
        tiers=tiers,
        model_id="toy",
    )


def run(seq, tokens, n):
    """Computes the next `n` positions of `tokens` as a hybrid model does: K/V appended, the
    state written in place, then committed with their token ids."""
    start = seq.seq_len
    k = kv_of(tokens, start, n)
    seq.append(0, k, -k)
    seq.state(0)["h"][...] = h_of(tokens[: start + n])
    seq.advance(n, tokens=tokens[start : start + n])


PROMPT = [5 * i + 1 for i in range(10)]


def write_prompt(p):
    """Runs PROMPT in prefill chunks of 4, 4 and 2 (checkpoints at 4, 8 and 10), then decodes two
    tokens (block 2 fills, so the checkpoint at 10 is cached too); returns the sequence."""
    s = p.new_sequence(tokens=PROMPT)
    tokens = PROMPT + [70, 71]
    for n in (4, 4, 2, 1, 1):
        run(s, tokens, n)
    return s


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_a_restarted_pool_restores_a_hybrid_prefix_state_from_a_tier(kind, tmp_path, request):
    if kind == "disk":
        tier = lambda: kvrs.DiskTier(tmp_path, "1MiB")  # noqa: E731 (a new object: a restart)
    else:
        url = request.getfixturevalue("redis_url")
        tier = lambda: kvrs.RedisTier(url)  # noqa: E731
    p = pool([tier()])
    write_prompt(p).free()
    p.evict_all()
    p.flush_tiers()
    del p
    fresh = pool([tier()])
    q = fresh.new_sequence(tokens=PROMPT[:8] + [50, 51])
    # Tiers hold whole blocks and the checkpoints at their ends: the hit is 8 (the file below
    # carries the one at 10).
    assert (q.seq_len, q.num_cached_tokens) == (8, 8)
    np.testing.assert_array_equal(q.state(0)["h"], h_of(PROMPT[:8]))
    np.testing.assert_array_equal(q.get(0)[0], kv_of(PROMPT, 0, 8).transpose(1, 0, 2))
    assert fresh.stats()["tiers"][0]["hits"] == 3  # two blocks and one checkpoint
    # A pool of another state layout never reads them.
    other = pool([tier()], shape=(4,))
    assert other.new_sequence(tokens=PROMPT[:8] + [50, 51]).seq_len == 0


def test_prefix_cache_files_carry_token_granular_checkpoints(tmp_path):
    p = pool()
    write_prompt(p).free()
    path = tmp_path / "cache.kvc"
    assert p.save_prefix_cache(path) == 3
    fresh = pool()
    assert fresh.load_prefix_cache(path) == {"loaded": 3, "skipped": 0, "checkpoints": 3}
    q = fresh.new_sequence(tokens=PROMPT + [60, 61])
    assert q.seq_len == 10  # inside block 2
    np.testing.assert_array_equal(q.state(0)["h"], h_of(PROMPT))
    with pytest.raises(ValueError, match="state_layout is"):
        pool(shape=(4,)).load_prefix_cache(path)
    with pytest.raises(ValueError, match="this pool has none"):
        kvrs.BlockPool(
            1, 1, D, block_size=BS, num_blocks=8, dtype="float32", seed=3, model_id="toy"
        ).load_prefix_cache(path)
