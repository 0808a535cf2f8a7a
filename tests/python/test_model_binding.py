"""A pool, a tier and a prefix-cache file serve one model: another model of the same shape
(other weights, a fine-tuned twin) is refused the pool and never reads its blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvrs  # noqa: E402
from kvrs.demo import make_tiny_model  # noqa: E402
from kvrs.integrations.transformers import (  # noqa: E402
    KvrsPagedCache,
    block_pool_from_config,
    generate_batch,
    model_fingerprint,
)

PROMPTS = [list(range(1, 41)) + [7, 9, 11], list(range(1, 41)) + [50, 60]]


@pytest.fixture(scope="module")
def models():
    return make_tiny_model(3), make_tiny_model(4)


def run(model, pool=None, prompts=PROMPTS):
    return generate_batch(model, prompts, pool=pool, max_new_tokens=6)


def twin(model):
    """A fine-tuned twin: the same config and weights but for one layer's projection."""
    other = make_tiny_model(3)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.model.layers[1].self_attn.k_proj.weight.mul_(1.01)
    return other


def test_fingerprints_tell_models_apart(models):
    a, b = models
    fa = model_fingerprint(a)
    assert fa == model_fingerprint(a) == model_fingerprint(make_tiny_model(3))
    assert fa.startswith("LlamaForCausalLM-") and len(fa.split("-")[1]) == 32
    assert model_fingerprint(b) != fa
    assert model_fingerprint(twin(a)) != fa
    # The attention implementation is how the model runs, not what it computes.
    a.config._attn_implementation_internal = "sdpa"
    try:
        assert model_fingerprint(a) == fa
    finally:
        a.config._attn_implementation_internal = "kvrs_paged"


def test_an_update_in_place_changes_the_fingerprint():
    m = make_tiny_model(5)
    before = model_fingerprint(m)
    with torch.no_grad():
        m.lm_head.weight.add_(0.5)
    assert model_fingerprint(m) != before


def test_a_pool_made_for_one_model_refuses_another_of_the_same_shape(models):
    a, b = models
    alone = run(b)
    pool = block_pool_from_config(a, num_blocks=64)
    assert pool.model_fingerprint == model_fingerprint(a) == pool.model_id
    run(a, pool)
    before = pool.stats()
    with pytest.raises(ValueError, match=r"holds the K/V of model LlamaForCausalLM-\w+, not of model"):
        run(b, pool)
    assert pool.stats() == before
    # Model B on its own pool: its own tokens.
    assert run(b, block_pool_from_config(b, num_blocks=64)) == alone


def test_a_bare_pool_binds_to_its_first_model(models):
    a, b = models
    pool = kvrs.BlockPool(2, 2, 16, block_size=16, num_blocks=64, dtype="float32")
    assert pool.model_fingerprint is None and pool.model_id == ""
    run(a, pool)
    assert pool.model_fingerprint == model_fingerprint(a) == pool.model_id
    with pytest.raises(ValueError, match="Give each model its own pool"):
        run(b, pool)
    with pytest.raises(ValueError, match="K/V of model"):
        run(twin(a), pool)


def test_an_explicit_model_id_wins_and_the_pool_still_binds(models):
    a, b = models
    pool = block_pool_from_config(a, num_blocks=64, model_id="org/tiny@v1")
    assert pool.model_id == "org/tiny@v1"
    assert pool.model_fingerprint == model_fingerprint(a)
    with pytest.raises(ValueError):
        run(b, pool)


def test_a_paged_cache_refuses_another_model(models):
    a, b = models
    ids = torch.tensor([PROMPTS[0]])
    cache = KvrsPagedCache.from_config(a, max_seq_len=64)
    with torch.no_grad():
        a(input_ids=ids, past_key_values=cache)
        with pytest.raises(ValueError, match="K/V of model"):
            b(input_ids=ids, past_key_values=cache)


def test_a_prefix_file_of_one_model_does_not_load_into_anothers_pool(models, tmp_path):
    a, b = models
    pool = block_pool_from_config(a, num_blocks=64, seed=9)
    run(a, pool)
    path = tmp_path / "a.kvrs"
    assert pool.save_prefix_cache(path) > 0
    with pytest.raises(ValueError, match="same model_id"):
        block_pool_from_config(b, num_blocks=64, seed=9).load_prefix_cache(path)
    assert block_pool_from_config(a, num_blocks=64, seed=9).load_prefix_cache(path)["loaded"] > 0


WORKER = textwrap.dedent(
    """
    import json, sys
    import kvrs
    from kvrs.demo import make_tiny_model
    from kvrs.integrations.transformers import block_pool_from_config, generate_batch

    seed, path = int(sys.argv[1]), sys.argv[2]
    model = make_tiny_model(seed)
    pool = block_pool_from_config(model, num_blocks=64, seed=2026, tiers=[kvrs.DiskTier(path, "64MiB")])
    cached = []
    out = generate_batch(model, json.loads(sys.argv[3]), pool=pool, max_new_tokens=6,
                         on_step=lambda step, pool, reqs: cached.extend(
                             r.cached for r in reqs if r.admitted == step))
    pool.evict_all()
    pool.flush_tiers()
    print(json.dumps({"out": out, "cached": cached}))
    """
)


def worker(seed: int, path, prompts) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="0")
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(seed), str(path), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_disk_tier_shared_by_two_models_in_two_processes(models, tmp_path):
    """Process 1 serves model A and leaves its blocks on disk; process 2 serves model B (same
    shape) on the same directory and gets model B's own tokens, hitting nothing of A's;
    process 3 serves model A again and hits A's blocks (so the tier does carry them)."""
    a, b = models
    prompt = [PROMPTS[0]]
    first = worker(3, tmp_path, prompt)
    assert first["cached"] == [0]
    second = worker(4, tmp_path, prompt)
    assert second["cached"] == [0]
    assert second["out"] == run(b, prompts=prompt)
    third = worker(3, tmp_path, prompt)
    assert third["cached"] == [32]
    assert third["out"] == first["out"] == run(a, prompts=prompt)
    assert np.array_equal(third["out"], first["out"])
