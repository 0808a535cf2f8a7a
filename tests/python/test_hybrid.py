"""Recurrent state beside the blocks (BlockPool state layers) and hybrid models
(Qwen3-Next's gated delta-net, Bamba's Mamba-2) served token-identically to their own
cache."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvrs

SHAPES = {"conv": (6, 4), "recurrent": (2, 3, 5)}


def state_pool(slots=3, **kw):
    args = dict(
        block_size=4, num_blocks=8, dtype="float32", state_layers=2, state_shapes=SHAPES, state_slots=slots
    )
    return kvrs.BlockPool(2, 1, 4, **{**args, **kw})


def test_a_sequence_starts_from_zeros_and_a_fork_copies_its_state():
    pool = state_pool()
    a = pool.new_sequence()
    views = a.state(1)
    assert {k: v.shape for k, v in views.items()} == SHAPES
    assert all(not v.any() for v in views.values())
    views["recurrent"][...] = np.arange(30, dtype=np.float32).reshape(2, 3, 5)
    b = a.fork()
    assert b.state_slot != a.state_slot
    np.testing.assert_array_equal(b.state(1)["recurrent"], views["recurrent"])
    b.state(1)["recurrent"][0] = -1  # the fork's own memory
    assert views["recurrent"][0, 0, 0] == 0
    # A whole layer's view indexes the slots.
    layer = pool.state_cache(1)
    assert layer["recurrent"].shape == (3, 2, 3, 5)
    np.testing.assert_array_equal(layer["recurrent"][a.state_slot], views["recurrent"])
    # A freed slot is zeroed when the next sequence takes it.
    slot = b.state_slot
    b.free()
    c = pool.new_sequence()
    assert c.state_slot == slot and not c.state(1)["recurrent"].any()


def test_slots_are_counted_and_a_full_pool_refuses_with_the_cache_unchanged():
    pool = state_pool(slots=2)
    a, _ = pool.new_sequence(), pool.new_sequence()
    before = pool.stats()
    with pytest.raises(kvrs.CacheFullError, match=r"1 more state slots but 0 of 2 state slots are free"):
        pool.new_sequence()
    with pytest.raises(kvrs.CacheFullError, match="state slots"):
        a.fork()
    assert pool.stats() == before
    slot_bytes = 2 * (6 * 4 + 2 * 3 * 5) * 4
    # Two state slots and, with prefix caching, two checkpoint slots per state slot.
    assert before["state_bytes"] == 6 * slot_bytes and before["state_checkpoints"] == 4
    assert before["state_bytes_used"] == 2 * slot_bytes
    assert before["bytes_total"] == pool.num_blocks * pool.bytes_per_block + 6 * slot_bytes
    assert (pool.state_slots, pool.free_state_slots, pool.state_layers) == (2, 0, 2)
    assert a.memory_bytes() == slot_bytes  # no blocks yet: its state slot
    assert pool.state_shapes == {"conv": ([6, 4], "float32"), "recurrent": ([2, 3, 5], "float32")}


def test_memory_bytes_pays_for_the_states_first():
    plain = kvrs.BlockPool(2, 1, 4, block_size=4, memory_bytes=4096, dtype="float32")
    hybrid = state_pool(slots=2, num_blocks=None, memory_bytes=4096)
    states = (2 + 4) * 2 * (6 * 4 + 2 * 3 * 5) * 4  # state and checkpoint slots
    assert hybrid.num_blocks == (4096 - states) // plain.bytes_per_block < plain.num_blocks
    with pytest.raises(ValueError, match=r"after the \d+ bytes of the state slots"):
        state_pool(slots=2, num_blocks=None, memory_bytes=states)


def test_states_take_their_dtypes_and_export_to_torch_without_a_copy():
    torch = pytest.importorskip("torch")
    pool = state_pool(state_dtype={"conv": "bfloat16"})
    seq = pool.new_sequence()
    conv = torch.from_dlpack(seq.state(0)["conv"])
    assert conv.dtype == torch.bfloat16
    conv.fill_(1.5)
    assert float(np.asarray(seq.state(0)["conv"], np.float32)[0, 0]) == 1.5
    assert pool.state_shapes["recurrent"][1] == "float32"


def test_rollbacks_need_a_checkpoint():
    # Without prefix caching there are no checkpoints: only a rollback to 0 (zeros) is known.
    pool = state_pool(prefix_caching=False)
    assert pool.stats()["state_checkpoints"] == 0
    seq = pool.new_sequence()
    kv = np.ones((3, 1, 4), np.float32)
    for layer in range(2):
        seq.append(layer, kv, kv)
    seq.advance(3)
    for edit in (lambda: seq.truncate(1), lambda: seq.remove(0, 1), lambda: seq.shift(2, None, -6)):
        with pytest.raises(kvrs.NotSupportedError, match="recurrent state"):
            edit()
    assert seq.seq_len == 3
    seq.truncate(3)  # a no-op
    other = pool.new_sequence()
    with pytest.raises(kvrs.NotSupportedError, match="state checkpoint"):
        pool.copy_prefix(seq, other, 2)
    seq.state(0)["conv"][...] = 2
    pool.copy_prefix(seq, other, 3)
    np.testing.assert_array_equal(other.state(0)["conv"], seq.state(0)["conv"])
    seq.truncate(0)
    assert seq.seq_len == 0 and not seq.state(0)["conv"].any()
    with pytest.raises(ValueError, match="state_checkpoints"):
        state_pool(prefix_caching=False, state_checkpoints=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"state_shapes": None}, ValueError, "state_shapes"),
        ({"state_slots": None}, ValueError, "state_slots"),
        ({"state_slots": 0}, ValueError, "state_slots=0"),
        ({"state_shapes": {"conv": (0, 4)}}, ValueError, "every dimension"),
        ({"state_shapes": {"conv": "x"}}, ValueError, "a tuple of ints"),
        ({"state_shapes": {}}, ValueError, "at least one state"),
        ({"state_dtype": "int8"}, ValueError, "float32, float16 or bfloat16"),
        ({"state_layers": -1}, ValueError, "state_layers=-1"),
        ({"state_dtype": "float64"}, ValueError, "state_dtype='float64'"),
        ({"state_dtype": {"cnov": "float16"}}, ValueError, "names no state"),
        ({"state_shapes": [(6, 4)]}, TypeError, "state_shapes must be a dict"),
        ({"state_shapes": {"conv": (2**40, 2**40)}}, ValueError, "address space"),
        (
            {"state_layers": 0, "state_shapes": None, "state_slots": None, "state_dtype": "float16"},
            ValueError,
            "need state_layers",
        ),
    ],
)
def test_bad_state_arguments_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        state_pool(**kwargs)


def test_views_and_packing_check_their_arguments():
    pool = state_pool()
    a, b = pool.new_sequence(), pool.new_sequence()
    with pytest.raises(IndexError, match="layer=2"):
        a.state(2)
    with pytest.raises(IndexError, match="layer=-1"):
        pool.state_cache(-1)
    with pytest.raises(ValueError, match="twice"):
        pool.pack_states([a, a])
    plain = kvrs.BlockPool(1, 1, 4, num_blocks=4)
    with pytest.raises(ValueError, match="no state layers"):
        plain.new_sequence().state(0)
    assert plain.new_sequence().state_slot is None and plain.state_layers == 0
    a.state(0)["conv"][...] = 7
    assert pool.pack_states([b, a]) == 0
    assert (b.state_slot, a.state_slot) == (0, 1)
    assert (a.state(0)["conv"] == 7).all() and not b.state(0)["conv"].any()
    # No run of 2 free-or-own slots: refused, nothing moved.
    c = pool.new_sequence()  # slot 2
    b.free()
    d = pool.new_sequence()  # slot 0, beside a's slot 1
    before = (a.state_slot, c.state_slot, d.state_slot)
    with pytest.raises(kvrs.CacheFullError, match="the longest run is 1"):
        pool.pack_states([c, d])
    assert (a.state_slot, c.state_slot, d.state_slot) == before == (1, 2, 0)


class StateSlots(RuleBasedStateMachine):
    """Sequences started, forked, freed, written and packed: every live sequence's
    states equal the reference's, and the slots are counted exactly."""

    @initialize()
    def setup(self):
        self.pool = state_pool(slots=4)
        self.seqs: list[tuple[kvrs.Sequence, dict]] = []

    def _zeros(self):
        return {(l, k): np.zeros(s, np.float32) for l in range(2) for k, s in SHAPES.items()}  # noqa: E741

    @rule()
    def start(self):
        if len(self.seqs) == 4:
            with pytest.raises(kvrs.CacheFullError):
                self.pool.new_sequence()
        else:
            self.seqs.append((self.pool.new_sequence(), self._zeros()))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        seq, ref = self.seqs[i % len(self.seqs)]
        if len(self.seqs) == 4:
            with pytest.raises(kvrs.CacheFullError):
                seq.fork()
        else:
            self.seqs.append((seq.fork(), {k: v.copy() for k, v in ref.items()}))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        seq, _ = self.seqs.pop(i % len(self.seqs))
        seq.free()

    @precondition(lambda self: self.seqs)
    @rule(
        i=st.integers(0, 99),
        layer=st.integers(0, 1),
        name=st.sampled_from(sorted(SHAPES)),
        v=st.integers(-9, 9),
    )
    def write(self, i, layer, name, v):
        seq, ref = self.seqs[i % len(self.seqs)]
        seq.state(layer)[name][...] = v
        ref[(layer, name)][...] = v

    @precondition(lambda self: self.seqs)
    @rule(picks=st.lists(st.integers(0, 99), max_size=4))
    def pack(self, picks):
        chosen = list(dict.fromkeys(self.seqs[p % len(self.seqs)][0] for p in picks))
        try:
            first = self.pool.pack_states(chosen)
        except kvrs.CacheFullError:
            return
        assert [s.state_slot for s in chosen] == list(range(first, first + len(chosen)))

    @invariant()
    def states_match(self):
        if not hasattr(self, "pool"):
            return
        assert self.pool.free_state_slots == 4 - len(self.seqs)
        assert len({s.state_slot for s, _ in self.seqs}) == len(self.seqs)
        for seq, ref in self.seqs:
            for (layer, name), want in ref.items():
                np.testing.assert_array_equal(seq.state(layer)[name], want)


TestStateSlots = StateSlots.TestCase
TestStateSlots.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


# --- hybrid models through transformers -------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybrid_models import bamba, granite_hybrid, qwen3_next  # noqa: E402  (after the skips)


@pytest.fixture(
    scope="module", params=[qwen3_next, bamba, granite_hybrid], ids=["qwen3_next", "bamba", "granite_hybrid"]
)
def hybrid_model(request):
    return request.param()


def _generate(model, ids, cache, **kw):
    mask = torch.ones_like(ids)
    return model.generate(
        ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False, **kw
    )


def test_the_pool_holds_each_linear_layer_as_a_state_layer(hybrid_model):
    from transformers import DynamicCache

    from kvrs.integrations.layout import layer_plan
    from kvrs.integrations.transformers import KvrsPagedCache

    cfg, model = hybrid_model
    plan = layer_plan(cfg)
    cache = KvrsPagedCache.from_config(cfg, max_seq_len=32, max_batch_size=2)
    pool = cache.pool
    linear = [i for i, t in enumerate(cfg.layer_types) if t in ("linear_attention", "mamba")]
    assert sorted(plan.state_of) == linear and pool.state_layers == len(linear)
    assert pool.num_layers == len(plan.kv_of) == cfg.num_hidden_layers - len(linear)
    # The config's shapes are the ones the model's own cache allocates.
    ref = DynamicCache(config=cfg)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), past_key_values=ref)
    layer = ref.layers[next(iter(plan.state_of))]
    assert pool.state_shapes["conv"][0] == list(layer.conv_states[0].shape[1:])
    assert pool.state_shapes["recurrent"][0] == list(layer.recurrent_states[0].shape[1:])


def test_hybrid_models_generate_as_with_their_own_cache(hybrid_model):
    """The issue's failing example: KvrsCache raised 'Cannot get conv state for non linear
    attention layer 0' and KvrsPagedCache.from_config refused layer_types 'linear'."""
    from transformers import DynamicCache

    from kvrs.integrations.transformers import KvrsCache, KvrsPagedCache, use_paged_attention

    cfg, model = hybrid_model
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("sdpa")
    ref = _generate(model, ids, DynamicCache(config=cfg))
    assert torch.equal(_generate(model, ids, KvrsCache.from_config(cfg, max_seq_len=64)), ref)
    paged = KvrsPagedCache.from_config(cfg, max_seq_len=64, max_batch_size=2)
    assert torch.equal(_generate(model, ids, paged), ref)
    use_paged_attention(model)
    try:
        assert torch.equal(_generate(model, ids, KvrsCache.from_config(cfg, max_seq_len=64)), ref)
        paged = KvrsPagedCache.from_config(cfg, max_seq_len=64, max_batch_size=2)
        assert torch.equal(_generate(model, ids, paged), ref)
    finally:
        model.set_attn_implementation("sdpa")
    # Beam search forks rows: the forks copy their states.
    beams = _generate(model, ids, DynamicCache(config=cfg), num_beams=3)
    paged = KvrsPagedCache.from_config(cfg, max_seq_len=64, max_batch_size=6)
    assert torch.equal(_generate(model, ids, paged, num_beams=3), beams)
    assert paged.pool.free_state_slots == paged.pool.state_slots - 6


def test_a_prompt_cache_copy_continues_like_the_original(hybrid_model):
    from transformers import DynamicCache

    from kvrs.integrations.transformers import KvrsPagedCache

    cfg, model = hybrid_model
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    cache = KvrsPagedCache.from_config(cfg, max_seq_len=32, max_batch_size=4)
    ref = DynamicCache(config=cfg)
    with torch.no_grad():
        model(ids[:, :6], past_key_values=cache)
        model(ids[:, :6], past_key_values=ref)
        twin = copy.deepcopy(cache)
        want = model(ids[:, 6:], past_key_values=ref).logits
        assert torch.equal(model(ids[:, 6:], past_key_values=twin).logits, want)
        assert torch.equal(model(ids[:, 6:], past_key_values=cache).logits, want)
    with pytest.raises(ValueError, match="cannot be rolled back"):
        cache.crop(-1)


def test_ragged_batches_and_chunked_prefill_match_one_sequence_at_a_time(hybrid_model):
    from transformers import DynamicCache

    from kvrs.integrations.transformers import forward_batch, generate_batch, use_paged_attention

    cfg, model = hybrid_model
    prompts = [[5, 9, 33, 2, 71, 8, 100], [3, 4], [120, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    use_paged_attention(model)
    try:
        outs = generate_batch(model, prompts, max_new_tokens=5)
        # A prompt in two chunks beside another sequence's whole prompt.
        from kvrs.integrations.layout import block_pool_from_config

        pool = block_pool_from_config(model, num_blocks=16, block_size=4, state_slots=2)
        a, b = pool.new_sequence(tokens=prompts[2]), pool.new_sequence(tokens=prompts[0])
        with torch.no_grad():
            with pool.start_forward([a] * 6 + [b] * 7) as batch:
                forward_batch(model, batch)
            with pool.start_forward([a] * 5) as batch:
                chunked = forward_batch(model, batch)[-1]
    finally:
        model.set_attn_implementation("sdpa")
    for prompt, out in zip(prompts, outs, strict=True):
        ref = model.generate(
            torch.tensor([prompt]),
            past_key_values=DynamicCache(config=cfg),
            max_new_tokens=5,
            do_sample=False,
        )
        assert ref[0, len(prompt) :].tolist() == out
    with torch.no_grad():
        whole = model(torch.tensor([prompts[2]])).logits[0, -1]
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)


def test_rows_that_cannot_take_consecutive_slots_leave_other_states_alone(hybrid_model):
    from kvrs.integrations.layout import block_pool_from_config, layer_plan
    from kvrs.integrations.transformers import KvrsPagedCache

    cfg, model = hybrid_model
    pool = block_pool_from_config(cfg, num_blocks=32, block_size=4, state_slots=5)
    held = [pool.new_sequence() for _ in range(5)]
    for seq in held[1], held[3], held[4]:
        for layer in range(pool.state_layers):
            for view in seq.state(layer).values():
                view[...] = 42
    held[0].free()
    held[2].free()  # free slots 0 and 2: no two consecutive
    cache = KvrsPagedCache(pool, layer_plan(cfg))
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), pytest.raises(kvrs.CacheFullError, match="consecutive"):
        model(ids, past_key_values=cache)
    assert cache.rows == [] and pool.free_state_slots == 2
    pool.check_invariants()
    for seq in held[1], held[3], held[4]:
        for layer in range(pool.state_layers):
            assert all((np.asarray(v, np.float32) == 42).all() for v in seq.state(layer).values())


def test_jamba_runs_on_kvrs_cache_and_the_pool_names_what_it_lacks():
    """Jamba's Mamba-1 layers: KvrsCache keeps their states in transformers' own layers;
    a pool cannot shape them yet, and FalconH1's attention-and-Mamba layers neither."""
    from transformers import DynamicCache, FalconH1Config, JambaConfig, JambaForCausalLM

    from kvrs.integrations.transformers import KvrsCache, KvrsPagedCache

    torch.manual_seed(0)
    cfg = JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, mamba_d_state=8, use_mamba_kernels=False,
    )  # fmt: skip
    model = JambaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    ref = _generate(model, ids, DynamicCache(config=cfg))
    assert torch.equal(_generate(model, ids, KvrsCache.from_config(cfg, max_seq_len=64)), ref)
    with pytest.raises(kvrs.NotSupportedError, match="Mamba-2"):
        KvrsPagedCache.from_config(cfg, max_seq_len=64)
    falcon = FalconH1Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, mamba_n_heads=4, mamba_d_ssm=32,
    )  # fmt: skip
    with pytest.raises(kvrs.NotSupportedError, match="'hybrid'"):
        KvrsPagedCache.from_config(falcon, max_seq_len=64)
