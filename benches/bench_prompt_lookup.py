"""Prompt lookup decoding in kvrs's generate_batch on SmolLM2-135M-Instruct
(:mod:`kvrs.real_model`, float32 on the host), greedy: generated tokens per second of

- plain ``generate_batch``;
- ``generate_batch(..., prompt_lookup_num_tokens=K)`` with the default "adaptive" draft
  policy, its acceptance rate (accepted over proposed drafts) and whether its tokens
  equal plain greedy's;
- the same with ``draft_policy="schedule"`` (K drafts whenever an n-gram matches);
- transformers' ``model.generate(prompt_lookup_num_tokens=K)`` on its ``DynamicCache``,
  one request at a time (transformers' assisted generation takes no batches), and
  whether its tokens equal kvrs's plain greedy;
- ``generate_batch(..., speculative_config={"method": "suffix", "num_speculative_tokens": K})``
  (drafts from the pool's suffix index: every earlier and running request's prompt and
  output), with the "adaptive" and the "schedule" draft policy;
- with ``TREE=W`` (default 3; 1 skips them): the same two methods verifying up to W
  candidates as a token tree (``speculative_config={..., "tree_width": W}``), adaptive;
- with ``DRAFT_LAYERS=L``: ``generate_batch(..., assistant_model=draft)``, the draft the
  model's first L layers (a truncated copy), 4 drafts a step, with the "schedule" and
  the "adaptive" draft policy.

Three workloads, through the model's chat template:

- **copy**: prompts whose answer copies from the prompt: repeat, extract or rewrite a
  given text, edit a JSON object;
- **tools**: repeated structure across requests: the same tool call (a weather tool,
  a unit converter) asked for many inputs, so that each answer repeats the earlier
  answers' structure, which is in no prompt;
- **quiz**: the demo's chat quiz (:mod:`kvrs.demo_chat`): one short answer each, where
  prompt lookup has little to copy.

Batch 1 runs the workload's first `B1` prompts (tools: all 16) one call each; batch 8 runs
its first 8 prompts in one call (tools: its 16 in two calls of 8). Every run has a pool of
its own, shared by its calls (so the suffix index and the prefix cache start empty and
learn from the run's earlier calls, for every method alike). Every row of a workload and
batch runs in turn, `REPEAT` rounds, and keeps its fastest run (other work on a shared
host slows some runs, never speeds one up); the speedups over plain are the figures to quote. Run:
``OMP_NUM_THREADS=1 python benches/bench_prompt_lookup.py`` (after ``make install``);
``NEW=48 K=10 NGRAM=2 B1=4 REPEAT=2 HF=1 TREE=3 DRAFT_LAYERS=0 WORKLOADS=copy,tools,quiz BATCHES=1,8
TOOLS_N=16 METHODS=`` change the workload (``HF=0`` skips transformers' rows; ``METHODS="prompt
lookup (adaptive),suffix (adaptive)"`` runs plain and the rows whose names start so).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

import kvrs
from kvrs import demo_chat, real_model
from kvrs.integrations.transformers import block_pool_from_config, generate_batch

NEW = int(os.environ.get("NEW", "48"))
K = int(os.environ.get("K", "10"))
NGRAM = int(os.environ.get("NGRAM", "2"))
B1 = int(os.environ.get("B1", "4"))
REPEAT = int(os.environ.get("REPEAT", "2"))
HF = os.environ.get("HF", "1") != "0"
DRAFT_LAYERS = int(os.environ.get("DRAFT_LAYERS", "0"))
TREE = int(os.environ.get("TREE", "3"))
WORKLOADS = os.environ.get("WORKLOADS", "copy,tools,quiz").split(",")
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,8").split(",")]
TOOLS_N = int(os.environ.get("TOOLS_N", "16"))
METHODS = os.environ.get("METHODS", "")  # comma-separated row-name prefixes to run (plain always runs)

TEXT = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
    "keeper climbed the narrow stairs, cleaned the great lens and lit the lamp, so that the fishing boats "
    "could find their way home through the fog. When the keeper retired, the town voted to keep the light "
    "burning, and volunteers took turns on the stairs."
)
RECORD = {
    "name": "Ada Lovelace",
    "born": 1815,
    "city": "London",
    "languages": ["English", "French"],
    "occupation": "mathematician",
}

COPY = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Here is a JSON object:\n{json.dumps(RECORD)}\nReturn the same JSON object with the city changed to "
    '"Paris". Output only the JSON.',
    f"Rewrite the following text, replacing the word 'keeper' with 'guardian':\n\n{TEXT}",
    f"Extract the second sentence of the following text and repeat it exactly:\n\n{TEXT}",
    f'Copy this JSON object, adding a field "died": 1852. Output only the JSON.\n{json.dumps(RECORD)}',
    f"Correct the spelling in the following text and return it:\n\n{TEXT.replace('narrow', 'narow')}",
    f"Repeat the following sentence three times:\n\n{TEXT.split('. ')[0]}.",
    f"Return the following list of languages as a JSON array, unchanged: {json.dumps(RECORD['languages'])} "
    f"and then repeat the JSON object {json.dumps(RECORD)}",
]


CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Quito", "Seoul"]
AMOUNTS = ["12 miles", "3 pounds", "70 inches", "5 gallons", "180 pounds", "26 miles", "9 ounces", "2 feet"]
WEATHER = (
    'You can call the tool get_weather(city: str, unit: "celsius" or "fahrenheit", days: int). Answer with '
    "a single JSON tool call and nothing else. Request: what will the weather be in {} for the next 3 days, "
    "in celsius?"
)
CONVERT = (
    "You can call the tool convert_units(value: float, from_unit: str, to_unit: str). Answer with a single "
    "JSON tool call and nothing else. Request: convert {} to metric units."
)
TOOLS = [
    t
    for pair in zip(CITIES, AMOUNTS, strict=True)
    for t in (WEATHER.format(pair[0]), CONVERT.format(pair[1]))
]


def chat(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def kvrs_run(model: Any, batches: list[list[list[int]]], eos: Any, **kw: Any) -> tuple[list, float, int, int]:
    """(outputs, seconds, accepted, proposed) of generate_batch over `batches`, one pool
    for all of them (new for each run)."""
    outs: list = []
    accepted = proposed = 0
    need = max(
        sum(kvrs.blocks_per_sequence(len(p) + NEW + K + 1, block_size=16) for p in prompts)
        for prompts in batches
    )
    pool = block_pool_from_config(model, num_blocks=need, block_size=16)
    start = time.perf_counter()
    for prompts in batches:
        last: list = []
        outs += generate_batch(
            model,
            prompts,
            pool=pool,
            max_new_tokens=NEW,
            eos_token_id=eos,
            on_step=lambda s, p, st, last=last: last.__setitem__(slice(None), st),
            **kw,
        )
        accepted += sum(r.accepted for r in last)
        proposed += sum(r.proposed for r in last)
    return outs, time.perf_counter() - start, accepted, proposed


def hf_run(model: Any, batches: list[list[list[int]]], eos: Any) -> tuple[list, float, int, int]:
    """transformers' prompt lookup, one request at a time, on its DynamicCache."""
    outs = []
    start = time.perf_counter()
    with torch.no_grad():
        for prompts in batches:
            for p in prompts:
                ids = torch.tensor([p])
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=NEW,
                    do_sample=False,
                    prompt_lookup_num_tokens=K,
                    max_matching_ngram_size=NGRAM,
                    eos_token_id=eos,
                    pad_token_id=eos[0] if eos else 0,
                )
                outs.append(out[0, len(p) :].tolist())
    return outs, time.perf_counter() - start, 0, 0


def truncated(model: Any, layers: int) -> Any:
    """The model's first `layers` layers with its embeddings and head."""
    import copy

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    draft = type(model)(config).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, tokenizer = real_model.load()
    eos = [int(tokenizer.eos_token_id)]
    workloads = {
        "copy": [chat(tokenizer, t) for t in COPY],
        "tools": [chat(tokenizer, t) for t in TOOLS],
        "quiz": [demo_chat.chat_prompt(tokenizer, q) for q in demo_chat.QUESTIONS[:8]],
    }
    print(
        f"{real_model.NAME}, float32, {torch.get_num_threads()} torch threads; greedy, {NEW} new tokens "
        f"(stopping at EOS), prompt_lookup_num_tokens={K}, max_matching_ngram_size={NGRAM}; "
        f"batch 1: {B1} prompts (tools: {TOOLS_N}) one call each, batch 8: calls of 8; "
        f"fastest of {REPEAT} interleaved rounds"
    )
    header = (
        f"{'workload':<8} {'batch':>5}  {'method':<28} {'tokens/s':>9} {'vs plain':>8} "
        f"{'acceptance':>10} {'= plain':>7}"
    )
    print(header)
    print("-" * len(header))
    generate_batch(model, workloads["quiz"][:1], max_new_tokens=4)  # warm-up
    draft = truncated(model, DRAFT_LAYERS) if DRAFT_LAYERS else None
    for name in WORKLOADS:
        prompts = workloads[name]
        for batch in BATCHES:
            if name == "tools":
                tools = prompts[:TOOLS_N]
                batches = (
                    [[p] for p in tools]
                    if batch == 1
                    else [tools[i : i + 8] for i in range(0, len(tools), 8)]
                )
            else:
                batches = [[p] for p in prompts[:B1]] if batch == 1 else [prompts[:8]]
            rows: list[tuple[str, Any]] = [
                ("plain", lambda b=batches: kvrs_run(model, b, eos)),
                (
                    "prompt lookup (adaptive)",
                    lambda b=batches: kvrs_run(
                        model, b, eos, prompt_lookup_num_tokens=K, max_matching_ngram_size=NGRAM
                    ),
                ),
                (
                    "prompt lookup (schedule)",
                    lambda b=batches: kvrs_run(
                        model,
                        b,
                        eos,
                        prompt_lookup_num_tokens=K,
                        max_matching_ngram_size=NGRAM,
                        draft_policy="schedule",
                    ),
                ),
            ]
            for policy in ("adaptive", "schedule"):
                rows.append(
                    (
                        f"suffix ({policy})",
                        lambda b=batches, policy=policy: kvrs_run(
                            model,
                            b,
                            eos,
                            speculative_config={"method": "suffix", "num_speculative_tokens": K},
                            draft_policy=policy,
                        ),
                    )
                )
            if TREE > 1:
                for method in ("ngram", "suffix"):
                    label = "prompt lookup" if method == "ngram" else "suffix"
                    rows.append(
                        (
                            f"{label} tree {TREE} (adaptive)",
                            lambda b=batches, method=method: kvrs_run(
                                model,
                                b,
                                eos,
                                speculative_config={
                                    "method": method,
                                    "num_speculative_tokens": K,
                                    "tree_width": TREE,
                                    **({"prompt_lookup_max": NGRAM} if method == "ngram" else {}),
                                },
                            ),
                        )
                    )
            if draft is not None:
                for policy in ("schedule", "adaptive"):
                    rows.append(
                        (
                            f"{DRAFT_LAYERS}-layer draft ({policy})",
                            lambda b=batches, policy=policy: kvrs_run(
                                model,
                                b,
                                eos,
                                assistant_model=draft,
                                num_assistant_tokens=4,
                                draft_policy=policy,
                            ),
                        )
                    )
            if HF:
                rows.append(("transformers prompt lookup", lambda b=batches: hf_run(model, b, eos)))
            if METHODS:
                wanted = METHODS.split(",")
                rows = [
                    row for i, row in enumerate(rows) if i == 0 or any(row[0].startswith(w) for w in wanted)
                ]
            best: dict[int, float] = {}
            results: dict[int, tuple[list, int, int]] = {}
            for _ in range(REPEAT):
                for i, (_, fn) in enumerate(rows):
                    outs, seconds, accepted, proposed = fn()
                    best[i] = min(best.get(i, float("inf")), seconds)
                    results[i] = (outs, accepted, proposed)
            plain = results[0][0]
            for i, (method, _) in enumerate(rows):
                outs, accepted, proposed = results[i]
                tokens = sum(len(o) for o in outs)
                rate = (
                    f"{accepted / proposed:.2f}"
                    if proposed
                    else ("" if i == 0 or "transformers" in method else "0 drafts")
                )
                same = "" if i == 0 else ("yes" if outs == plain else "no")
                print(
                    f"{name:<8} {batch:>5}  {method:<28} {tokens / best[i]:>9.1f} "
                    f"{best[0] / best[i] * tokens / sum(len(o) for o in plain):>7.2f}x {rate:>10} {same:>7}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
