"""The demo's chat workload on a real model ([`kvrs.real_model`][kvrs.real_model]): requests that share
a system prompt and each ask one question, through the model's own chat template."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["QUESTIONS", "SYSTEM_PROMPT", "arrivals", "chat_prompt"]

SYSTEM_PROMPT = (
    "You are a helpful assistant for a school quiz. Answer every question with one short, correct "
    "sentence, and do not add explanations, lists or follow-up questions. If you are not sure of an "
    "answer, say so in one sentence. Be friendly and precise."
)
"""The system prompt every request shares (cached once, attached by every later request)."""

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the largest planet in the solar system?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "What color do you get by mixing blue and yellow?",
    "What is the capital of Japan?",
    "How many days are there in a week?",
    "What gas do plants take in from the air?",
    "What is the chemical symbol for gold?",
    "Which ocean is the largest?",
    "How many continents are there?",
    "What is the freezing point of water in Celsius?",
    "What is the capital of Italy?",
    "Which animal is known as the king of the jungle?",
    "What is the square root of 81?",
]
"""The questions, asked in turn."""


def chat_prompt(tokenizer: Any, question: str) -> list[int]:
    """The token ids of a chat with the shared system prompt and `question`, ending where
    the assistant's answer starts (the model's chat template)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def arrivals(n: int, seed: int) -> list[int]:
    """The step each of `n` requests arrives at: the first at 0, then one every 3 steps
    on average."""
    rng = np.random.default_rng(seed + 1)
    return [0, *np.cumsum(rng.integers(0, 7, n - 1)).tolist()][:n]
