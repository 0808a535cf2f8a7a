"""Serving chat requests on a real model: kvrs's generate_batch against transformers' own
ways of running the same requests, in one process, on SmolLM2-135M-Instruct
(:mod:`kvrs.real_model`, float32 on the host).

The requests are the demo's (:mod:`kvrs.demo_chat`): `N` quiz questions sharing a system
prompt through the model's chat template, all arriving at once, greedy, up to `NEW`
tokens each, ending at the model's end-of-turn token. Rows:

- kvrs ``generate_batch``: continuous batching over a BlockPool with prefix caching (the
  system prompt computed once), paged attention read in place.
- transformers ``model.generate``, one request at a time (DynamicCache): what the demo
  checks against.
- transformers ``model.generate``, all requests in one left-padded batch.
- transformers ``model.generate_batch``: its own continuous batching (paged cache, SDPA),
  with a cache of as many 256-token pages as the requests need (left to size itself, it
  takes most of the host's memory).

Each row prints its wall time, generated tokens per second, its ratio to kvrs, and how
many requests gave exactly the one-at-a-time tokens (padding changes a batch's float
rounding, so the padded batch may differ). The ratios are the figures to quote: absolute
times on a shared 2-core VM say little. Run: `OMP_NUM_THREADS=1 python
benches/bench_generate.py` (after `make install`, which installs the model; one torch
thread, as on a VM shared with other work two threads wait on each other at every op);
`N=24 NEW=48` to change the workload.
"""

from __future__ import annotations

import os
import time

import torch
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig

from kvrs import demo_chat, real_model
from kvrs.integrations.transformers import generate_batch

N = int(os.environ.get("N", "16"))
NEW = int(os.environ.get("NEW", "32"))


def one_at_a_time(model, prompts, stop):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=DynamicCache(config=model.config),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=stop,
        )
        out.append(gen[0, len(p) :].tolist())
    return out


def padded_batch(model, prompts, stop, pad):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=stop)
    out = []
    for row in gen[:, width:].tolist():
        # Rows that stopped early are padded after their stop token.
        out.append(row[: row.index(stop) + 1] if stop in row else row)
    return out


def transformers_batch(model, prompts, stop, pad):
    pages = sum(-(-(len(p) + NEW) // 256) for p in prompts)
    config = ContinuousBatchingConfig(num_blocks=pages + 1, max_batch_tokens=2048)
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=stop, pad_token_id=pad)
    results = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=config)
    return [list(r.generated_tokens) for r in results.values()]


def main() -> None:
    model, tokenizer = real_model.load()
    stop = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id or stop
    prompts = [
        demo_chat.chat_prompt(tokenizer, demo_chat.QUESTIONS[i % len(demo_chat.QUESTIONS)]) for i in range(N)
    ]
    print(
        f"{real_model.NAME}, float32, {torch.get_num_threads()} torch threads; {N} requests, "
        f"{sum(map(len, prompts))} prompt tokens, up to {NEW} new tokens each, greedy"
    )
    rows = [
        (
            "kvrs generate_batch (BlockPool, prefix caching)",
            lambda: generate_batch(model, prompts, max_new_tokens=NEW),
        ),
        ("transformers generate, one at a time", lambda: one_at_a_time(model, prompts, stop)),
        ("transformers generate, one padded batch", lambda: padded_batch(model, prompts, stop, pad)),
        (
            "transformers generate_batch (its paged cache)",
            lambda: transformers_batch(model, prompts, stop, pad),
        ),
    ]
    runs = []
    with torch.no_grad():
        for name, run in rows:
            t0 = time.perf_counter()
            out = run()
            runs.append((name, time.perf_counter() - t0, out))
    reference = runs[1][2]
    ours = runs[0][1]
    print(f"\n| {'how':<48} | wall time | generated tokens/s | time / kvrs | same tokens as one at a time |")
    print(f"|{'-' * 50}|----------:|-------------------:|------------:|-----------------------------:|")
    for name, seconds, out in runs:
        generated = sum(map(len, out))
        same = sum(a == b for a, b in zip(out, reference, strict=True))
        print(
            f"| {name:<48} | {seconds:8.1f}s | {generated / seconds:18.1f} | {seconds / ours:10.2f}x "
            f"| {f'{same} of {len(out)}':>28} |"
        )


if __name__ == "__main__":
    main()
