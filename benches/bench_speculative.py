"""Speculative decoding in kvrs's generate_batch: generated tokens per second with and
without a draft model, at acceptance rates from 0 to 1, in one process.

The target is a Llama of `LAYERS` layers of hidden size 512 (random weights, float32 on
the host), so that its forward pass dominates; the draft is a copy of its first layer
(embeddings and head included), one eighth of its cost. To set the acceptance rate
without changing either model's cost, the target's layers after the first add their
output to the residual stream scaled by `eps` (their o_proj and down_proj weights times
`eps`): at `eps` = 0 the target computes exactly the draft's function (acceptance 1), and
larger `eps` makes the two disagree more often. Rows:

- no draft: ``generate_batch`` as it is (the baseline of each `eps`);
- draft = 1-layer copy: ``generate_batch(..., assistant_model=draft,
  num_assistant_tokens=K)``, its acceptance rate (accepted / proposed drafts) measured,
  with K drafts every step ("constant", ``draft_policy="schedule"``), with transformers'
  "heuristic" schedule (2 more drafts after a full acceptance, 1 fewer after a
  rejection, at most K), and with the default "adaptive" draft policy under the
  constant cap (drafts only where they pay, by measured step costs);
- draft = the target itself (acceptance 1, but the draft costs as much as the target);
- draft = a random 1-layer model (acceptance about 0: the overhead of drafting), with the
  same three settings.

Every run is greedy and checked to give the no-draft tokens. Each row prints tokens per
second (the fastest of `REPEAT` rounds that run every row in turn), the acceptance rate
and the speedup over no draft; the speedups (ratios from
one run) are the figures to quote, absolute rates on a shared 2-core VM say little.
Run: `OMP_NUM_THREADS=1 python benches/bench_speculative.py` (after `make install`);
`N=4 PROMPT=32 NEW=64 K=4 LAYERS=8 EPS=0,0.01 REPEAT=3` to change the workload.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvrs.integrations.transformers import generate_batch

N = int(os.environ.get("N", "4"))
PROMPT = int(os.environ.get("PROMPT", "32"))
NEW = int(os.environ.get("NEW", "64"))
K = int(os.environ.get("K", "4"))
LAYERS = int(os.environ.get("LAYERS", "8"))
REPEAT = int(os.environ.get("REPEAT", "3"))
EPS = [float(e) for e in os.environ.get("EPS", "0,0.01,0.03,0.06,0.1").split(",")]

CONFIG = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)


def llama(layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **CONFIG)).eval()


def target_at(base: LlamaForCausalLM, eps: float) -> LlamaForCausalLM:
    """`base` with the residual contributions of its layers after the first times `eps`."""
    model = llama(LAYERS, 0)
    model.load_state_dict(base.state_dict())
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(eps)
            layer.mlp.down_proj.weight.mul_(eps)
    return model


def first_layer(model: LlamaForCausalLM) -> LlamaForCausalLM:
    draft = llama(1, 0)
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft


def timed(model, prompts, **kw):
    """(tokens, seconds, accepted, proposed) of one generate_batch run."""
    last: list = []
    start = time.perf_counter()
    out = generate_batch(
        model,
        prompts,
        max_new_tokens=NEW,
        eos_token_id=[],
        on_step=lambda s, p, st: last.__setitem__(slice(None), st),
        **kw,
    )
    seconds = time.perf_counter() - start
    return out, seconds, sum(r.accepted for r in last), sum(r.proposed for r in last)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, CONFIG["vocab_size"], PROMPT).tolist() for _ in range(N)]
    base = llama(LAYERS, 0)
    random_draft = llama(1, 1)
    print(
        f"target: Llama {LAYERS} layers, hidden 512; draft: 1 layer; {N} requests of {PROMPT} prompt + "
        f"{NEW} new tokens, greedy, {K} draft tokens a step; torch threads {torch.get_num_threads()}"
    )
    header = f"{'eps':>5}  {'draft':<14} {'policy':<9} {'tokens/s':>9} {'acceptance':>10} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    generate_batch(base, prompts[:1], max_new_tokens=4)  # warm-up
    for eps in EPS:
        target = target_at(base, eps)
        copy = first_layer(target)
        drafts = [
            ("1-layer copy", copy, "constant"),
            ("1-layer copy", copy, "heuristic"),
            ("1-layer copy", copy, "adaptive"),
            ("random 1-layer", random_draft, "constant"),
            ("random 1-layer", random_draft, "heuristic"),
            ("random 1-layer", random_draft, "adaptive"),
        ]
        if eps == EPS[0]:
            drafts.append(("target itself", target, "constant"))
        plain, _, _, _ = timed(target, prompts)
        tokens = sum(len(o) for o in plain)
        runs = [("none", None, "")] + drafts
        best: dict[int, float] = {}
        rates: dict[int, float] = {}
        # Rounds of every row in turn, the fastest of each kept: the other work on a
        # shared host slows some runs, never speeds one up.
        for _ in range(REPEAT):
            for i, (name, draft, schedule) in enumerate(runs):
                kw = (
                    {}
                    if draft is None
                    else {
                        "assistant_model": draft,
                        "num_assistant_tokens": K,
                        # "adaptive": the constant cap under the default policy; the
                        # schedules alone draft their cap every step.
                        "num_assistant_tokens_schedule": "constant" if schedule == "adaptive" else schedule,
                        "draft_policy": "adaptive" if schedule == "adaptive" else "schedule",
                    }
                )
                out, seconds, accepted, proposed = timed(target, prompts, **kw)
                if out != plain:
                    raise AssertionError(f"eps={eps}, draft {name}: greedy tokens differ from no draft")
                best[i] = min(best.get(i, float("inf")), seconds)
                rates[i] = accepted / max(proposed, 1)
        for i, (name, draft, schedule) in enumerate(runs):
            rate = "" if draft is None else f"{rates[i]:.2f}"
            print(
                f"{eps:>5}  {name:<14} {schedule:<9} {tokens / best[i]:>9.1f} {rate:>10} "
                f"{best[0] / best[i]:>7.2f}x"
            )


if __name__ == "__main__":
    main()
