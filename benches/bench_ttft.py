"""Time to first token: kvrs's ``generate_batch`` against transformers' ``generate`` with
SDPA attention, the same model and prompts, in one process, in interleaved rounds (best
of each) after one untimed call of each. Both generate one token (greedy), so the time is
the prompt's prefill, the first token's logits and everything around them (kvrs: building
the pool, writing the K/V into its pages, its paged attention; transformers: its cache
and SDPA over it).

Rows:
- SmolLM2-135M-Instruct (:mod:`kvrs.real_model`, float32 on the host; 30 layers, 9 query /
  3 KV heads of 64): one 1k-token and one 4k-token prompt;
- a wide tiny Llama (2 layers, hidden 2048, 16 heads of 128, intermediate 5632, random
  weights, float32): 8 requests x 2k tokens at once (transformers: one batch of 8, no
  padding needed).

Each row prints both times, their ratio, whether the first tokens agree, and kvrs's time
in its attention layers (K/V written into the pages and attention read from them). Run:
``python benches/bench_ttft.py`` (after ``make install``, which installs the model);
torch and kvrs each run on ``OMP_NUM_THREADS`` threads (default: the CPUs), as the
attention benchmark does; ``ROUNDS=3`` for more rounds, ``ONLY=1024`` for the rows whose
name contains that text, ``QUICK=1`` for 256- and 512-token prompts (seconds).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

THREADS = int(os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
os.environ.setdefault("RAYON_NUM_THREADS", str(THREADS))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvrs  # noqa: E402
from kvrs import real_model  # noqa: E402
from kvrs.integrations import paged_attention as paged  # noqa: E402
from kvrs.integrations.transformers import generate_batch  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "2"))
QUICK = os.environ.get("QUICK") == "1"
ONLY = os.environ.get("ONLY", "")


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn from the first `vocab` ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, length).tolist() for _ in range(count)]


def wide_tiny() -> Any:
    """The 2-layer Llama of hidden 2048 and 16 heads, random weights, float32, SDPA."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def calls(model: Any, batch: list[list[int]]) -> tuple[Callable[[], list[int]], Callable[[], list[int]]]:
    """The kvrs call and the transformers call generating one token for each prompt of
    `batch`; each returns the first tokens."""

    def ours() -> list[int]:
        return [out[0] for out in generate_batch(model, batch, max_new_tokens=1)]

    def theirs() -> list[int]:
        ids = torch.tensor(batch)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1, do_sample=False
        )
        return out[:, -1].tolist()

    return ours, theirs


class AttentionTimer:
    """Adds up the wall time of kvrs's attention layers (the K/V written into the pages and
    the attention read from them: ``paged_attention``) while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> AttentionTimer:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return paged.paged_attention(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        AttentionInterface.register(paged.ATTN_IMPLEMENTATION, timed)
        return self

    def __exit__(self, *args: object) -> None:
        AttentionInterface.register(paged.ATTN_IMPLEMENTATION, paged.paged_attention)


def main() -> None:
    torch.set_num_threads(THREADS)
    smol, _tokenizer = real_model.load()
    smol.set_attn_implementation("sdpa")
    wide = wide_tiny()
    short, long_, many = (256, 512, 256) if QUICK else (1024, 4096, 2048)
    vocab = smol.config.vocab_size
    cases = {
        f"{real_model.NAME}, 1 prompt x {short} tokens": (smol, prompts(vocab, 1, short, 1)),
        f"{real_model.NAME}, 1 prompt x {long_} tokens": (smol, prompts(vocab, 1, long_, 2)),
        f"wide tiny Llama (2 layers, hidden 2048, 16 heads), 8 prompts x {many} tokens": (
            wide,
            prompts(wide.config.vocab_size, 8, many, 3),
        ),
    }
    cases = {name: case for name, case in cases.items() if ONLY in name}
    print(
        f"time to first token, float32, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"kvrs {kvrs.__version__} (attention {kvrs.attention_simd()}, "
        f"RAYON_NUM_THREADS={os.environ['RAYON_NUM_THREADS']}), {ROUNDS} interleaved rounds, best of each"
    )
    best: dict[str, list[float]] = {name: [float("inf")] * 3 for name in cases}
    agree: dict[str, bool] = {}
    with torch.no_grad():
        # A first call of each (not timed): one-time costs (allocations, torch's kernels'
        # set-up, the model's fingerprint) are not the time to first token of a server.
        for model, batch in cases.values():
            for call in calls(model, batch):
                call()
        for _ in range(ROUNDS):
            for name, (model, batch) in cases.items():
                ours, theirs = calls(model, batch)
                with AttentionTimer() as timer:
                    t0 = time.perf_counter()
                    got = ours()
                    t_ours = time.perf_counter() - t0
                t0 = time.perf_counter()
                want = theirs()
                t_theirs = time.perf_counter() - t0
                row = best[name]
                if t_ours < row[0]:
                    row[0], row[2] = t_ours, timer.seconds
                row[1] = min(row[1], t_theirs)
                agree[name] = got == want
    print(
        "\n| work | kvrs generate_batch | transformers generate (SDPA) | kvrs / transformers "
        "| kvrs attention | same first tokens |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name, (ours_s, theirs_s, attn_s) in best.items():
        print(
            f"| {name} | {ours_s:.2f}s | {theirs_s:.2f}s | {ours_s / theirs_s:.2f}x "
            f"| {attn_s:.2f}s ({attn_s / ours_s:.0%}) | {'yes' if agree[name] else 'no'} |"
        )


if __name__ == "__main__":
    main()
