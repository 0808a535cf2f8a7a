"""Mistakes a new user of the transformers integration makes, each refused by a message
that names the argument and what to do (rather than an error from deep inside the model
or the pool), leaving nothing changed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvrs  # noqa: E402
from kvrs.integrations.transformers import (  # noqa: E402
    KvrsCache,
    KvrsPagedCache,
    block_pool_from_config,
    generate_batch,
)

CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def generate(model, cache, n=4):
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n, do_sample=False
        )


def test_a_batch_given_another_token_count_names_k_and_both_counts():
    pool = kvrs.BlockPool(1, 2, 4, num_blocks=4, block_size=4, dtype="float32")
    seq = pool.new_sequence()
    with pool.start_forward([seq, seq], tokens=[1, 2]) as batch:
        three = np.ones((3, 2, 4), np.float32)
        with pytest.raises(
            ValueError, match=r"k has shape \[3, 2, 4\], expected \[2, 2, 4\]: the batch has 2 tokens"
        ):
            batch.put(0, three, three)
        with pytest.raises(
            ValueError, match=r"v has shape \[3, 2, 4\], expected \[2, 2, 4\]: the batch has 2"
        ):
            batch.put(0, three[:2], three)
        with pytest.raises(ValueError, match=r"k has shape \[3, 2, 4\], expected \[2, 2, 4\]"):
            batch.put_layers(three[None], three[None])
        batch.cancel()
    assert seq.seq_len == 0
    pool.check_invariants()


def test_a_cache_with_fewer_layers_than_the_model_says_how_to_make_one(model):
    with pytest.raises(
        ValueError,
        match=r"the model writes layer 1, but this KvrsCache holds 1 layers: make it for the model with "
        r"KvrsCache.from_config\(model",
    ):
        generate(model, KvrsCache(1, 64))
    pool = kvrs.BlockPool(1, 2, 16, num_blocks=8, dtype="float32")
    with pytest.raises(ValueError, match="this KvrsPagedCache holds 1 layers"):
        generate(model, KvrsPagedCache(pool))


def test_text_instead_of_token_ids_says_tokenize_first(model):
    with pytest.raises(TypeError, match=r"inputs\[0\] is a str \('hello'\): generate_batch takes token ids"):
        generate_batch(model, ["hello"])
    with pytest.raises(TypeError, match=r"inputs is a string.*tokenize first"):
        generate_batch(model, "hello")
    with pytest.raises(TypeError, match=r"inputs\[0\]\[1\] is 2.5: token ids are ints"):
        generate_batch(model, [[1, 2.5]])
    assert generate_batch(model, [np.array([5, 6, 7]), torch.tensor([5, 6])], max_new_tokens=1)


def test_a_model_on_the_meta_device_is_named_as_such():
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**CONFIG))
    for make in (
        lambda: KvrsCache.from_config(meta, 32),
        lambda: KvrsPagedCache.from_config(meta, max_seq_len=32),
        lambda: block_pool_from_config(meta, num_blocks=4),
        lambda: generate_batch(meta, [[1, 2]]),
    ):
        with pytest.raises(kvrs.DeviceError, match="the model's parameters are on torch's meta device"):
            make()


def test_a_pool_of_another_shape_than_the_model_says_which_and_what_to_use(model):
    pool = kvrs.BlockPool(2, 2, 8, num_blocks=16, dtype="float32")
    with pytest.raises(
        ValueError,
        match=r"this pool does not match the model \(LlamaConfig\): it has head_dim 8 \(the model: 16\), "
        r"v_head_dim 8 \(the model: 16\); make it with block_pool_from_config\(model",
    ):
        generate_batch(model, [[1, 2, 3]], pool=pool)
    assert pool.stats()["used_blocks"] == 0
    with pytest.raises(
        ValueError, match=r"this pool does not match the model: the model writes 2 KV heads of 16"
    ):
        generate(model, KvrsPagedCache(pool))
