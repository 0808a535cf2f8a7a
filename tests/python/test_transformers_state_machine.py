"""Hypothesis state machine: kvrs's transformers caches against recomputation.

Random interleavings of forward passes of 1 to 6 tokens, crops (assisted decoding's
rollback; the paged sliding cache must allow a crop to the longest length reached minus
swa_memory, and may refuse a deeper one, changing nothing), beam reorders and deep copies, on a tiny
sliding-window Mistral (window 6) and a Llama, for both the contiguous and the paged
cache. The reference is each row's token history: after every forward, the new tokens'
logits equal those of the whole history run through the model without a cache (within
1e-5). (DynamicCache is no reference here: once its sliding layers have been trimmed to
the window, cropping below the window miscounts their length.) After every step the
lengths agree and the pool's invariants hold.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from kvrs.integrations.transformers import KvrsCache, KvrsPagedCache  # noqa: E402

ROWS, MAX_LEN, MAX_CROP = 2, 48, 4
SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
torch.manual_seed(0)
MODELS = {
    "llama": LlamaForCausalLM(LlamaConfig(**SIZES)).eval(),
    "mistral": MistralForCausalLM(MistralConfig(**SIZES, sliding_window=6)).eval(),
}


def machine(model_name: str, paged: bool):
    model = MODELS[model_name]

    class CacheAgainstDynamicCache(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            if paged:
                self.cache = KvrsPagedCache.from_config(
                    model.config, max_seq_len=MAX_LEN, max_batch_size=3 * ROWS, block_size=4,
                    swa_memory=MAX_CROP,
                )  # fmt: skip
            else:
                self.cache = KvrsCache.from_config(model.config, max_seq_len=MAX_LEN)
            self.tokens = torch.zeros(ROWS, 0, dtype=torch.long)  # each row's history
            self.longest = 0  # the longest length reached: released blocks do not come back

        @property
        def length(self):
            return self.tokens.shape[1]

        @precondition(lambda self: self.length < MAX_LEN - 6)
        @rule(n=st.integers(1, 6), seed=st.integers(0, 2**16))
        def forward(self, n, seed):
            ids = torch.randint(0, 64, (ROWS, n), generator=torch.Generator().manual_seed(seed))
            self.tokens = torch.cat([self.tokens, ids], dim=1)
            self.longest = max(self.longest, self.length)
            with torch.no_grad():
                ours = model(ids, past_key_values=self.cache, use_cache=True).logits
                theirs = model(self.tokens, use_cache=False).logits[:, -n:]
            assert torch.allclose(ours, theirs, atol=1e-5), float((ours - theirs).abs().max())

        @precondition(lambda self: self.length > 0)
        @rule(k=st.integers(1, MAX_CROP))
        def crop(self, k):
            k = min(k, self.length)
            try:
                self.cache.crop(-k)
            except ValueError as e:
                # Only a paged sliding cache refuses, and only a crop below the longest
                # length reached minus swa_memory (rounding to blocks may keep more).
                assert paged and model_name == "mistral" and self.length - k < self.longest - MAX_CROP, e
                assert self.cache.get_seq_length() == self.length
                return
            self.tokens = self.tokens[:, : self.length - k]

        @precondition(lambda self: self.length > 0)
        @rule(beams=st.lists(st.integers(0, ROWS - 1), min_size=ROWS, max_size=ROWS))
        def reorder(self, beams):
            idx = torch.tensor(beams)
            self.cache.reorder_cache(idx)
            self.tokens = self.tokens[idx]

        @rule()
        def deep_copy(self):
            # Continue on a copy; the original must stay usable and untouched.
            original, original_len = self.cache, self.cache.get_seq_length()
            self.cache = copy.deepcopy(original)
            assert original.get_seq_length() == original_len
            if paged:
                original.reset()  # returns its forks' blocks

        @invariant()
        def lengths_agree(self):
            assert self.cache.get_seq_length() == self.length
            if paged:
                self.cache.pool.check_invariants()

    CacheAgainstDynamicCache.TestCase.settings = settings(
        max_examples=25, stateful_step_count=20, deadline=None
    )
    return CacheAgainstDynamicCache.TestCase


TestLlamaContiguous = machine("llama", paged=False)
TestLlamaPaged = machine("llama", paged=True)
TestMistralSlidingContiguous = machine("mistral", paged=False)
TestMistralSlidingPaged = machine("mistral", paged=True)
