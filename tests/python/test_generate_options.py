"""generate_batch's vLLM-style options (penalties, min_p, minimum lengths, stop token ids
and sequences, logprobs, per-request SamplingParams), checked against transformers' own
logits processors; padded inputs; return_dict; clear errors and warnings; the kvrs
logger's tier reports."""

from __future__ import annotations

import logging
import socket
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import BatchEncoding, DynamicCache, LlamaConfig, LlamaModel  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import kvrs  # noqa: E402
from kvrs import _log  # noqa: E402
from kvrs.demo import make_tiny_model  # noqa: E402
from kvrs.integrations.sampling import Options, Sampler  # noqa: E402
from kvrs.integrations.transformers import (  # noqa: E402
    GenerationResult,
    SamplingParams,
    block_pool_from_config,
    generate_batch,
)

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(3)


@pytest.fixture(scope="module")
def draft():
    return make_tiny_model(5)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, VOCAB, 20).tolist()
    return [shared + rng.integers(3, VOCAB, 5).tolist(), rng.integers(3, VOCAB, 9).tolist(), shared]


def reference(model, prompt, new, **kw):
    """model.generate alone (DynamicCache, greedy unless kw says), its new tokens."""
    ids = torch.tensor([prompt])
    kw.setdefault("eos_token_id", None)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=DynamicCache(config=model.config),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


class VllmPenalties(LogitsProcessor):
    """vLLM's presence and frequency penalties over the generated tokens, written
    plainly (a loop over tokens), for model.generate."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_len :].tolist()):
            for t in set(ids):
                scores[row, t] -= self.frequency * ids.count(t) + self.presence
        return scores


# --- each option against transformers -------------------------------------------------


def test_repetition_penalty_equals_generate(model):
    ps = prompts(1)
    free = generate_batch(model, ps, max_new_tokens=12, eos_token_id=[])
    got = generate_batch(model, ps, max_new_tokens=12, eos_token_id=[], repetition_penalty=1.5)
    want = [reference(model, p, 12, repetition_penalty=1.5) for p in ps]
    assert got == want
    assert got != free  # the penalty changed something: the comparison means something
    # < 1 rewards repetition: also transformers' formula (negative logits multiplied).
    assert generate_batch(model, ps, max_new_tokens=8, eos_token_id=[], repetition_penalty=0.7) == [
        reference(model, p, 8, repetition_penalty=0.7) for p in ps
    ]


def test_presence_and_frequency_penalties_equal_vllms_formula(model):
    ps = prompts(2)
    free = generate_batch(model, ps, max_new_tokens=12, eos_token_id=[])
    got = generate_batch(
        model, ps, max_new_tokens=12, eos_token_id=[], presence_penalty=0.3, frequency_penalty=0.2
    )
    want = [
        reference(model, p, 12, logits_processor=LogitsProcessorList([VllmPenalties(len(p), 0.3, 0.2)]))
        for p in ps
    ]
    assert got == want and got != free


def test_min_new_tokens_holds_the_stop_token_back_as_generate_does(model):
    ps = prompts(3)
    free = generate_batch(model, ps, max_new_tokens=10, eos_token_id=[])
    stop = free[0][2]  # the first request would stop at its third token
    got = generate_batch(model, ps, max_new_tokens=10, eos_token_id=stop, min_new_tokens=6, return_dict=True)
    for res, p in zip(got, ps, strict=True):
        assert res.token_ids == reference(model, p, 10, eos_token_id=stop, min_new_tokens=6)
    assert stop not in got[0].token_ids[:6] and len(got[0].token_ids) >= 6
    short = generate_batch(model, ps[:1], max_new_tokens=10, eos_token_id=stop)
    assert short == [free[0][:3]]


def test_warpers_equal_transformers_per_row():
    """temperature, top_k, top_p and min_p, different on every row, give the
    distributions transformers' warpers give each row alone."""
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB) * 3
    rows = [
        dict(temperature=0.7, top_k=10, top_p=1.0, min_p=0.0),
        dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
        dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.1),
        dict(temperature=0.5, top_k=40, top_p=0.9, min_p=0.05),
        dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        dict(temperature=2.0, top_k=3, top_p=0.5, min_p=0.2),
    ]

    class R:
        def __init__(self, i):
            self.index, self.prompt, self.generated = i, [1], []

    sampler = Sampler([Options(sample=True, **r) for r in rows], VOCAB)
    owners = [R(i) for i in range(len(rows))]
    got = sampler.target(logits, owners, [[] for _ in rows]).softmax(-1)
    for i, r in enumerate(rows):
        procs = [TemperatureLogitsWarper(r["temperature"])]
        if r["top_k"]:
            procs.append(TopKLogitsWarper(r["top_k"]))
        if r["top_p"] < 1:
            procs.append(TopPLogitsWarper(r["top_p"]))
        if r["min_p"]:
            procs.append(MinPLogitsWarper(r["min_p"]))
        want = LogitsProcessorList(procs)(torch.tensor([[1]]), logits[i : i + 1].clone()).softmax(-1)
        assert torch.allclose(got[i], want[0], atol=1e-6), i
        assert ((got[i] > 0) == (want[0] > 0)).all(), i  # the same tokens kept
    # A greedy request beside sampling ones: its row keeps its argmax only.
    mixed = Sampler([Options(sample=True, temperature=0.5), Options()], VOCAB)
    out = mixed.target(logits[:2], [R(0), R(1)], [[], []]).softmax(-1)
    assert out[1].argmax() == logits[1].argmax() and out[1].max() == 1.0
    assert (out[0] > 0).sum() > 1


def test_min_p_and_sampling_end_to_end(model):
    ps = prompts(4)
    greedy = generate_batch(model, ps, max_new_tokens=8, eos_token_id=[])
    # min_p=1 keeps only the most likely token: sampling becomes greedy.
    assert (
        generate_batch(model, ps, max_new_tokens=8, eos_token_id=[], do_sample=True, min_p=1.0, seed=3)
        == greedy
    )
    kw = dict(max_new_tokens=8, eos_token_id=[], do_sample=True, temperature=1.5, min_p=0.05, seed=3)
    a = generate_batch(model, ps, **kw)
    assert a == generate_batch(model, ps, **kw) and a != greedy


def test_options_with_a_draft_model_stay_exact(model, draft):
    ps = prompts(5)
    kw = dict(max_new_tokens=10, eos_token_id=[], repetition_penalty=1.4, frequency_penalty=0.5)
    alone = generate_batch(model, ps, **kw)
    assert alone == [
        reference(
            model,
            p,
            10,
            repetition_penalty=1.4,
            logits_processor=LogitsProcessorList([VllmPenalties(len(p), 0.0, 0.5)]),
        )
        for p in ps
    ]
    seen = []
    spec = generate_batch(
        model,
        ps,
        assistant_model=draft,
        num_assistant_tokens=3,
        on_step=lambda s, p, st: seen.append(st),
        **kw,
    )
    assert spec == alone
    assert sum(r.proposed for r in seen[-1]) > 0
    # Sampling through the draft: min_p=1 is greedy, so speculative sampling must give
    # the greedy tokens, each row's penalties counting the drafts before it.
    sampled = generate_batch(model, ps, assistant_model=draft, do_sample=True, min_p=1.0, seed=2, **kw)
    assert sampled == alone
    # min_new_tokens holding a stop token back, and a stop sequence, decided inside a
    # verified run of drafts.
    stop = alone[0][2]
    kw = dict(kw, eos_token_id=stop, min_new_tokens=4, stop_sequences=[alone[1][5:7]])
    want = generate_batch(model, ps, **kw)
    assert want[0] != alone[0][:3] and len(want[1]) <= 5
    assert generate_batch(model, ps, assistant_model=draft, **kw) == want
    # Log-probabilities of tokens accepted from drafts are the model's rows for them.
    lp = dict(max_new_tokens=6, eos_token_id=[], logprobs=2, return_dict=True)
    for a, b in zip(
        generate_batch(model, ps, **lp),
        generate_batch(model, ps, assistant_model=draft, **lp),
        strict=True,
    ):
        assert a.token_ids == b.token_ids and len(b.logprobs) == 6
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_stop_sequences_end_requests_and_are_left_out(model, draft):
    ps = prompts(6)
    free = generate_batch(model, ps, max_new_tokens=12, eos_token_id=[])
    seq = free[0][3:5]
    got = generate_batch(
        model, ps, max_new_tokens=12, eos_token_id=[], stop_sequences=[seq], return_dict=True
    )
    for res, full in zip(got, free, strict=True):
        ends = [i for i in range(2, len(full) + 1) if full[i - 2 : i] == seq]
        if ends:
            assert res.token_ids == full[: ends[0] - 2]
            assert res.finish_reason == "stop" and res.stop_reason == seq
        else:
            assert res.token_ids == full and res.finish_reason == "length" and res.stop_reason is None
    assert got[0].token_ids == free[0][:3]
    # Not before min_new_tokens (vLLM's min_tokens): the first match is skipped.
    later = generate_batch(
        model, ps[:1], max_new_tokens=12, eos_token_id=[], stop_sequences=[seq], min_new_tokens=6
    )
    assert later[0] != free[0][:3] and later[0] == free[0][: len(later[0])]
    # The same with a draft model proposing past the stop sequence.
    assert [r.token_ids for r in got] == generate_batch(
        model, ps, max_new_tokens=12, eos_token_id=[], stop_sequences=[seq], assistant_model=draft
    )


def test_logprobs_are_the_models_raw_log_probabilities(model):
    ps = prompts(7)[:2]
    res = generate_batch(
        model, ps, max_new_tokens=4, eos_token_id=[], logprobs=3, repetition_penalty=1.3, return_dict=True
    )
    for r, p in zip(res, ps, strict=True):
        assert len(r.logprobs) == len(r.token_ids) == 4
        with torch.no_grad():
            full = torch.log_softmax(model(torch.tensor([p + r.token_ids])).logits[0].float(), -1)
        for j, (entry, token) in enumerate(zip(r.logprobs, r.token_ids, strict=True)):
            row = full[len(p) - 1 + j]
            top = torch.topk(row, 3).indices.tolist()
            assert set(top) <= set(entry) and token in entry and len(entry) <= 4
            for t, lp in entry.items():
                assert abs(lp - float(row[t])) < 1e-4
        assert r.cumulative_logprob == pytest.approx(
            sum(e[t] for e, t in zip(r.logprobs, r.token_ids, strict=True))
        )
    plain = generate_batch(model, ps, max_new_tokens=4, eos_token_id=[], logprobs=0, return_dict=True)
    assert all(list(e) == [t] for r in plain for e, t in zip(r.logprobs, r.token_ids, strict=True))


def test_per_request_sampling_params(model):
    ps = prompts(8)
    greedy = generate_batch(model, ps, max_new_tokens=8, eos_token_id=[])
    penalized = generate_batch(model, ps, max_new_tokens=8, eos_token_id=[], repetition_penalty=1.5)
    stop = greedy[1][2]
    params = [
        SamplingParams(temperature=0),
        {"temperature": 0, "repetition_penalty": 1.5, "max_tokens": 5},
        SamplingParams(temperature=0, stop_token_ids=[stop], logprobs=1),
    ]
    got = generate_batch(
        model, ps, max_new_tokens=8, eos_token_id=[], sampling_params=params, return_dict=True
    )
    assert got[0].token_ids == greedy[0]
    assert got[1].token_ids == penalized[1][:5] and got[1].finish_reason == "length"
    cut = greedy[2][: greedy[2].index(stop) + 1] if stop in greedy[2] else greedy[2]
    assert got[2].token_ids == cut and got[2].logprobs is not None and got[0].logprobs is None
    # Sampling requests beside greedy ones; a request's own seed fixes its draws
    # whatever shares its batch (vLLM's per-request seed).
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.2, seed=9), SamplingParams(seed=4)]
    a = generate_batch(model, ps, max_new_tokens=8, eos_token_id=[], sampling_params=mixed)
    assert a[0] == greedy[0] and a[1] != greedy[1]
    alone = generate_batch(model, ps[1:2], max_new_tokens=8, eos_token_id=[], sampling_params=mixed[1:2])
    assert alone[0] == a[1]
    # One SamplingParams for every input; ignore_eos.
    eos = greedy[0][1]
    one = generate_batch(model, ps, max_new_tokens=8, eos_token_id=eos,
                         sampling_params=SamplingParams(temperature=0, ignore_eos=True))  # fmt: skip
    assert one == greedy


# --- inputs and results ---------------------------------------------------------------


def test_padded_batches_left_and_right(model):
    ps = prompts(9)
    want = generate_batch(model, ps, max_new_tokens=5, eos_token_id=[])
    width = max(map(len, ps))
    for side in ("left", "right"):
        ids = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros(len(ps), width, dtype=torch.long)
        for i, p in enumerate(ps):
            sl = slice(width - len(p), width) if side == "left" else slice(0, len(p))
            ids[i, sl], mask[i, sl] = torch.tensor(p), 1
        enc = BatchEncoding({"input_ids": ids, "attention_mask": mask})
        assert generate_batch(model, enc, max_new_tokens=5, eos_token_id=[]) == want, side
        assert generate_batch(model, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=[]) == want
        assert (
            generate_batch(model, ids.numpy(), attention_mask=mask.numpy(), max_new_tokens=5, eos_token_id=[])
            == want
        )
        # A tokenizer's padded lists (no return_tensors).
        lists = {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}
        assert generate_batch(model, lists, max_new_tokens=5, eos_token_id=[]) == want
    with pytest.raises(ValueError, match="2-D tensor and attention_mask was not given: pass attention_mask="):
        generate_batch(model, ids)
    with pytest.raises(ValueError, match="1-D tensor"):
        generate_batch(model, ids[0])
    holes = mask.clone()
    holes[0, 1] = 0
    holes[0, 0] = 1
    with pytest.raises(ValueError, match=r"attention_mask\[0\] has holes"):
        generate_batch(model, ids, attention_mask=holes)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        generate_batch(model, ids, attention_mask=mask[:1])
    with pytest.raises(ValueError, match="give it once"):
        generate_batch(model, BatchEncoding({"input_ids": ids, "attention_mask": mask}), attention_mask=mask)
    with pytest.raises(TypeError, match=r"inputs is one list of token ids.*give \[ids\] for one prompt"):
        generate_batch(model, [5, 6, 7])  # one prompt, not wrapped in a list


def test_return_dict(model):
    ps = prompts(10)
    pool = block_pool_from_config(model.config, num_blocks=64, block_size=4)
    plain = generate_batch(model, ps, pool=pool, max_new_tokens=6, eos_token_id=[])
    stop = plain[1][2]
    res = generate_batch(model, ps, pool=pool, max_new_tokens=6, eos_token_id=stop, return_dict=True)
    assert all(isinstance(r, GenerationResult) for r in res)
    assert [r.index for r in res] == [0, 1, 2] and [r.prompt_token_ids for r in res] == ps
    assert res[1].token_ids == plain[1][:3] and res[1].finish_reason == "stop" and res[1].stop_reason == stop
    assert all(r.finish_reason == "length" and r.stop_reason is None for r in res if stop not in r.token_ids)
    assert res[0].num_cached_tokens >= 20  # the pool kept the first call's blocks
    assert all(r.logprobs is None and r.cumulative_logprob is None for r in res)
    zero = generate_batch(model, ps[:1], max_new_tokens=0, return_dict=True)
    assert zero[0].token_ids == [] and zero[0].finish_reason == "length"


# --- errors and warnings --------------------------------------------------------------


def test_clear_errors_name_the_argument(model):
    with pytest.raises(TypeError, match=r"eos_token_id='</s>'.*token ids.*convert_tokens_to_ids\('</s>'\)"):
        generate_batch(model, [[1, 2]], eos_token_id="</s>")
    with pytest.raises(TypeError, match=r"convert_tokens_to_ids\('<eos>'\)"):
        generate_batch(model, [[1, 2]], eos_token_id=[2, "<eos>"])
    with pytest.raises(TypeError, match=r"assistant_model='tiny-draft' is a name: .*loaded model"):
        generate_batch(model, [[1, 2]], assistant_model="tiny-draft")
    with pytest.raises(TypeError, match=r"model='gpt2' is a name"):
        generate_batch("gpt2", [[1, 2]])
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    base = r"model is a LlamaModel, a base model without a language-modeling head.*LlamaForCausalLM"
    with pytest.raises(TypeError, match=base):
        generate_batch(LlamaModel(config), [[1, 2]])
    with pytest.raises(
        TypeError, match=r"stop_sequences=\[13, 13\]: give a list of token-id lists.*\[\[13, 13\]\]"
    ):
        generate_batch(model, [[1, 2]], stop_sequences=[13, 13])
    with pytest.raises(TypeError, match="stop_sequences takes token-id sequences, not text"):
        generate_batch(model, [[1, 2]], stop_sequences=["\n\n"])
    with pytest.raises(ValueError, match=r"stop_sequences: an empty stop sequence"):
        generate_batch(model, [[1, 2]], stop_sequences=[[]])
    with pytest.raises(ValueError, match=r"sampling_params and temperature= were both given"):
        generate_batch(model, [[1, 2]], sampling_params=SamplingParams(), temperature=0.5)
    with pytest.raises(ValueError, match=r"sampling_params: 1 values for 2 inputs"):
        generate_batch(model, [[1], [2]], sampling_params=[SamplingParams()])
    with pytest.raises(TypeError, match=r"sampling_params\[1\]: unknown option 'max_new_tokens'"):
        generate_batch(model, [[1], [2]], sampling_params=[{}, {"max_new_tokens": 3}])
    with pytest.raises(ValueError, match=r"sampling_params.top_p=0: give a value in \(0.0, 1.0\]"):
        generate_batch(model, [[1]], sampling_params={"top_p": 0})
    with pytest.raises(ValueError, match=r"min_p=1.5: give a value in \[0.0, 1.0\]"):
        generate_batch(model, [[1]], do_sample=True, min_p=1.5)
    with pytest.raises(ValueError, match=r"presence_penalty=3: give a value in \[-2.0, 2.0\]"):
        generate_batch(model, [[1]], presence_penalty=3)
    with pytest.raises(ValueError, match=r"repetition_penalty=0.0: give a value in \(0.0, inf\]"):
        generate_batch(model, [[1]], repetition_penalty=0.0)
    with pytest.raises(ValueError, match=r"min_new_tokens=5 is more than max_new_tokens=3"):
        generate_batch(model, [[1]], min_new_tokens=5, max_new_tokens=3, eos_token_id=2)
    with pytest.raises(ValueError, match=r"logprobs=-1: give an int >= 0"):
        generate_batch(model, [[1]], logprobs=-1)


def test_ignored_arguments_warn(model):
    transformers_wording = (
        r"`do_sample` is not set to `True`. However, `temperature` is set to `0.7` -- this flag"
    )
    with pytest.warns(
        UserWarning, match=transformers_wording + r".*to sample as vLLM does, pass do_sample=True"
    ):
        generate_batch(model, [[1, 2]], max_new_tokens=1, temperature=0.7)
    for kw in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}):
        name = next(iter(kw))
        with pytest.warns(UserWarning, match=f"`{name}` is set to"):
            generate_batch(model, [[1, 2]], max_new_tokens=1, **kw)
    with pytest.warns(UserWarning, match=r"seed=3 is ignored.*do_sample=True"):
        generate_batch(model, [[1, 2]], max_new_tokens=1, seed=3)
    with pytest.warns(UserWarning, match=r"num_assistant_tokens=3 is ignored.*assistant_model="):
        generate_batch(model, [[1, 2]], max_new_tokens=1, num_assistant_tokens=3)
    with pytest.warns(UserWarning, match=r"num_assistant_tokens_schedule='heuristic' is ignored"):
        generate_batch(model, [[1, 2]], max_new_tokens=1, num_assistant_tokens_schedule="heuristic")
    with pytest.warns(UserWarning, match="min_new_tokens=2 is ignored: there are no stop tokens"):
        generate_batch(model, [[1, 2]], max_new_tokens=3, min_new_tokens=2, eos_token_id=[])
    with pytest.warns(UserWarning) as caught:  # the warning points at the caller's line
        generate_batch(model, [[1, 2]], max_new_tokens=1, temperature=0.5)
    assert caught[0].filename == __file__


def test_the_happy_path_is_silent(model, draft, caplog):
    caplog.set_level(logging.DEBUG, logger="kvrs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate_batch(model, prompts(), max_new_tokens=3)
        generate_batch(model, prompts(), max_new_tokens=3, do_sample=True, temperature=0.7, top_p=0.9, seed=1)
        generate_batch(model, prompts(), max_new_tokens=3, assistant_model=draft, num_assistant_tokens=2)
        generate_batch(model, prompts(), max_new_tokens=3, sampling_params=SamplingParams(temperature=0.8))
    assert not caplog.records


# --- the logger -----------------------------------------------------------------------


def test_the_kvrs_logger_is_a_librarys():
    log = logging.getLogger("kvrs")
    assert any(isinstance(h, logging.NullHandler) for h in log.handlers)
    assert log.level == logging.NOTSET


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.setattr(_log, "_last", {})
    return _log


def dead_url() -> str:
    """A loopback URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_a_redis_tier_with_nothing_listening_is_logged_once_a_minute(model, caplog, fresh_log, monkeypatch):
    url = dead_url()
    tier = kvrs.RedisTier(url, timeout=0.05, retry_after=0.001)
    pool = block_pool_from_config(model, num_blocks=64, block_size=4, tiers=[tier], seed=11)
    caplog.set_level(logging.WARNING, logger="kvrs")
    generate_batch(model, prompts(11), pool=pool, max_new_tokens=2)
    assert pool.stats()["tiers"][0]["errors"] > 0

    def tier_records():
        return [r for r in caplog.records if r.name == "kvrs" and url in r.getMessage()]

    records = tier_records()
    assert len(records) == 1, [r.getMessage() for r in records]
    msg = records[0].getMessage()
    # The tier's own error text: nothing listens there.
    assert "failed requests" in msg and "refused" in msg.lower(), msg
    assert records[0].levelno == logging.WARNING
    # Within the minute: counted, not repeated.
    generate_batch(model, prompts(12), pool=pool, max_new_tokens=2)
    assert len(tier_records()) == 1
    # A minute later the next record carries what the suppressed one would have said.
    monkeypatch.setattr(_log, "INTERVAL", 0.0)
    before = pool.stats()["tiers"][0]["errors"]
    generate_batch(model, prompts(13), pool=pool, max_new_tokens=2)
    later = tier_records()
    # One record at the end of the call at least (one a second while a slow call runs).
    assert len(later) >= 2
    counts = [int(r.getMessage().split(": ")[1].split()[0]) for r in later[1:]]
    assert sum(counts) >= pool.stats()["tiers"][0]["errors"] - before + 1


class FakePool:
    def __init__(self):
        self.s = {
            "tiers": [{"name": "disk:/tmp/t", "errors": 0, "rejected": 0}, {"name": "host", "errors": 0}],
            "tier_queue": {"dropped": 0, "unstored": 0},
        }

    def stats(self):
        return self.s


def test_tier_watch_reports_each_cause(caplog, fresh_log):
    caplog.set_level(logging.WARNING, logger="kvrs")
    pool = FakePool()
    watch = _log.TierWatch(pool)
    watch.check(force=True)
    assert not caplog.records
    pool.s["tiers"][0].update(errors=2, rejected=1)
    pool.s["tier_queue"].update(dropped=5, unstored=1)
    pool.s["tiers"][1]["last_error"] = "out of memory"
    pool.s["tiers"][1]["errors"] = 1
    watch.check()  # within `every` of the last look: not read
    assert not caplog.records
    watch.check(force=True)
    msgs = sorted(r.getMessage() for r in caplog.records)
    failed = "failed requests (lookups missed, stores went to the next tier or were dropped)"
    assert msgs == sorted(
        [
            f"kvrs tier disk:/tmp/t: 2 {failed}: an I/O error or a full disk",
            "kvrs tier disk:/tmp/t: 1 payloads failed their checks and were discarded (another pool's "
            "secret or model, or corrupted data)",
            f"kvrs tier host: 1 {failed}: out of memory",
            "kvrs tiers: 5 evicted blocks were dropped, not offloaded: the write-back queue was full; give "
            "the pool a larger tier_queue / tier_queue_bytes, or a faster tier",
            "kvrs tiers: 1 blocks written to the tiers were stored by no tier (each refused or failed "
            "them); see the tiers' errors, or give a disk tier more room",
        ]
    )
    # Only growth is reported: the same counts again say nothing.
    watch.check(force=True)
    assert len(caplog.records) == 5


def test_a_row_after_drafts_is_processed_as_if_they_were_generated():
    """Speculative rows: processing a row with drafts `extras` equals processing it for a
    request that already generated them (penalties, minimum length, warpers)."""
    import dataclasses

    torch.manual_seed(1)
    logits = (torch.randn(1, VOCAB) * 2).repeat(3, 1)
    opts = Options(
        sample=True,
        temperature=0.9,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.6,
        min_new_tokens=3,
        stop_ids=frozenset({7, 9}),
    )

    class R:
        def __init__(self, generated):
            self.index, self.prompt, self.generated = 0, [4, 5, 6], list(generated)

    drafts = [[], [11], [11, 11]]
    for o in (opts, dataclasses.replace(opts, sample=False)):
        spec = Sampler([o], VOCAB).target(logits, [R([8])] * 3, drafts)
        for j, d in enumerate(drafts):
            alone = Sampler([o], VOCAB).target(logits[j : j + 1], [R([8, *d])], [[]])
            assert torch.equal(spec[j : j + 1].isinf(), alone.isinf()), j
            assert torch.allclose(spec[j : j + 1].softmax(-1), alone.softmax(-1), atol=1e-6), j
    # Processors alone (greedy): the stop tokens are held back until the third token
    # (rows 0 and 1, not row 2), and repeated drafts count (11 penalized more after two).
    assert spec[0, 7].isinf() and spec[1, 9].isinf() and not spec[2, 7].isinf() and not spec[2, 9].isinf()
    assert spec[2, 11] < spec[1, 11] < spec[0, 11] == logits[0, 11]


def test_the_generation_config_supplies_the_new_options(model):
    from transformers import GenerationConfig

    ps = prompts(14)
    gc = GenerationConfig(max_new_tokens=8, repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
    assert generate_batch(model, ps, generation_config=gc) == generate_batch(
        model, ps, max_new_tokens=8, eos_token_id=[], repetition_penalty=1.5
    )
