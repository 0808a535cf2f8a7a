"""What [`generate_batch`][kvrs.integrations.transformers.generate_batch] takes and gives beyond lists
of token ids: padded batches (a tokenizer's ``BatchEncoding``, or a 2-D tensor or array
with its ``attention_mask``) in, and [`GenerationResult`][kvrs.integrations.transformers.GenerationResult] out
(``return_dict=True``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["GenerationResult", "prompt_lists"]


@dataclass
class GenerationResult:
    """One input's outcome (``generate_batch(..., return_dict=True)``), with vLLM's
    ``RequestOutput`` / ``CompletionOutput`` names."""

    index: int
    """The input's position in `inputs`."""
    prompt_token_ids: list[int]
    """Its prompt (padding removed)."""
    token_ids: list[int]
    """What it generated (what the plain list return holds)."""
    finish_reason: Literal["stop", "length"]
    """"stop" (a stop token or stop sequence ended it) or "length" (its max_new_tokens)."""
    stop_reason: int | list[int] | None
    """What stopped it: the stop token's id, or the stop sequence (left out of
    token_ids); None when it ran to its length."""
    num_cached_tokens: int
    """Prompt tokens the pool's prefix cache (or its tiers) served instead of computing."""
    logprobs: list[dict[int, float]] | None = None
    """With logprobs=n: per generated token, {token id: log-probability} of the n most
    likely tokens and the generated one (from the model's raw logits); else None."""
    cumulative_logprob: float | None = None
    """The sum of the generated tokens' log-probabilities (with logprobs), else None."""


def _rows(value: Any, name: str) -> list[list[Any]]:
    """A 2-D tensor, array or list of lists as lists of Python values."""
    if hasattr(value, "tolist") and hasattr(value, "ndim"):
        if value.ndim != 2:
            raise ValueError(
                f"{name} has {value.ndim} dimensions: give a 2-D [batch, length] tensor (one row per prompt)"
            )
        out = value.tolist()
        return [list(r) for r in out]
    return [list(r) if not hasattr(r, "tolist") else list(r.tolist()) for r in value]


def prompt_lists(inputs: Any, attention_mask: Any = None) -> Any:
    """`inputs` as one token list per prompt: a ``BatchEncoding`` (or any mapping with
    ``input_ids``, and ``attention_mask`` when padded), a 2-D tensor or array with its
    `attention_mask` (padding on either side removed per row), or lists as they are
    (checked by the caller). A 2-D tensor without a mask is a ValueError: its padding
    cannot be told from tokens."""
    if isinstance(inputs, Mapping) or (hasattr(inputs, "keys") and hasattr(inputs, "__getitem__")):
        if "input_ids" not in inputs:
            raise ValueError(
                f"inputs is a mapping without input_ids (keys: {sorted(inputs.keys())}): give "
                "tokenizer(texts, padding=True, return_tensors='pt'), or lists of token ids"
            )
        mask = inputs.get("attention_mask")
        if attention_mask is not None and mask is not None:
            raise ValueError(
                "attention_mask= was given and inputs holds one too: give it once (the BatchEncoding's "
                "attention_mask is used when the argument is left out)"
            )
        ids = inputs["input_ids"]
        mask = attention_mask if attention_mask is not None else mask
        if mask is None:
            if hasattr(ids, "ndim") and hasattr(ids, "shape") and ids.ndim == 2 and ids.shape[0] > 1:
                raise ValueError(
                    "inputs['input_ids'] is a 2-D tensor without an attention_mask: pass attention_mask= "
                    "(the tokenizer's) so that padding is removed, or lists of token ids"
                )
            return _rows(ids, "inputs['input_ids']") if hasattr(ids, "ndim") else ids
        return _unpad(_rows(ids, "inputs['input_ids']"), _rows(mask, "attention_mask"))
    is_array = hasattr(inputs, "ndim") and hasattr(inputs, "tolist")
    if is_array and inputs.ndim == 1:
        raise ValueError(
            "inputs is a 1-D tensor: generate_batch takes a batch; give a 2-D [batch, length] tensor with "
            "attention_mask=, or a list of token-id lists ([ids.tolist()] for one prompt)"
        )
    if (
        not is_array
        and isinstance(inputs, (list, tuple))
        and inputs
        and hasattr(inputs[0], "__index__")
        and not hasattr(inputs[0], "__len__")  # an int, not an array of ids
        and not isinstance(inputs[0], bool)
    ):
        raise TypeError(
            f"inputs is one list of token ids ({list(inputs[:5])}...): generate_batch takes a batch, "
            "one list per prompt; give [ids] for one prompt"
        )
    if attention_mask is None:
        if is_array:
            raise ValueError(
                "inputs is a 2-D tensor and attention_mask was not given: pass attention_mask= (e.g. "
                "tokenizer(texts, padding=True, return_tensors='pt').attention_mask) so that each row's "
                "padding is removed, or give lists of token ids (one per prompt, unpadded)"
            )
        return inputs
    return _unpad(_rows(inputs, "inputs"), _rows(attention_mask, "attention_mask"))


def _unpad(ids: list[list[Any]], mask: list[list[Any]]) -> list[list[Any]]:
    """Each row's tokens where its mask is 1: one run (left or right padding)."""
    if len(ids) != len(mask) or any(len(a) != len(m) for a, m in zip(ids, mask, strict=False)):
        shape_ids = (len(ids), len(ids[0]) if ids else 0)
        shape_mask = (len(mask), len(mask[0]) if mask else 0)
        raise ValueError(
            f"attention_mask has shape {shape_mask}, inputs {shape_ids}: give the mask of these inputs"
        )
    out = []
    for i, (row, m) in enumerate(zip(ids, mask, strict=True)):
        keep = [j for j, v in enumerate(m) if v]
        if keep and keep[-1] - keep[0] + 1 != len(keep):
            raise ValueError(
                f"attention_mask[{i}] has holes (0s between 1s): generate_batch removes padding on the left "
                "or the right of each row; give each prompt's tokens as one run, or lists of token ids"
            )
        out.append([row[j] for j in keep])
    return out
