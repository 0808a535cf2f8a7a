"""Continuous batching of a transformers model over a :class:`kvrs.BlockPool`.

``use_paged_attention(model)`` switches a model's attention to ``"kvrs_paged"``: when a
forward pass carries a :class:`kvrs.ForwardBatch` (``forward_batch`` passes it), every
attention layer writes its new K/V into the pool with ``batch.put`` and attends over
``batch.get``'s history and mask, so one forward pass serves a ragged batch of many
sequences (prefill chunks beside decode tokens, each at its own position). Without a
batch the layer is plain SDPA, so the same model still runs ``generate()`` with any cache.
"""

from __future__ import annotations

from typing import Any

import kvrs
from kvrs.integrations._torch import as_torch, torch

from transformers import AttentionInterface  # isort: skip
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # isort: skip
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # isort: skip

ATTN_IMPLEMENTATION = "kvrs_paged"
"""The attention implementation name kvrs registers with transformers."""


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention: through ``kwargs["kvrs_batch"]`` when given, else SDPA."""
    batch: kvrs.ForwardBatch | None = kwargs.pop("kvrs_batch", None)
    if batch is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise kvrs.NotSupportedError(
            f"{type(module).__name__} uses logit soft-capping or attention sinks; "
            "kvrs's paged attention computes plain softmax attention"
        )
    # query [1, heads, n, d]; key, value [1, kv_heads, n, d]; the pool takes [n, kv_heads, d].
    layer = int(module.layer_idx)  # type: ignore[arg-type]  # an int on every attention module
    batch.put(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
    keys, values, mask = batch.get(layer)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        as_torch(keys)[None].to(query.dtype),
        as_torch(values)[None].to(query.dtype),
        attn_mask=torch.from_numpy(mask).to(query.dtype),
        scale=scaling,
        enable_gqa=True,
    )
    return out.transpose(1, 2), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def use_paged_attention(model: Any) -> Any:
    """Switches `model`'s attention to kvrs's paged attention (SDPA when no batch is given)."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def forward_batch(model: Any, batch: kvrs.ForwardBatch, token_ids: Any) -> torch.Tensor:
    """Runs one ForwardBatch through `model` (switched by :func:`use_paged_attention`):
    `token_ids` are the batch's tokens in order; returns their logits [num_tokens, vocab].
    Does not commit: call ``batch.finish()`` (or leave the ``with`` block) afterwards."""
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"model uses attn_implementation={model.config._attn_implementation!r}; "
            "call kvrs.integrations.transformers.use_paged_attention(model) first"
        )
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.ndim != 1 or ids.shape[0] != batch.num_tokens:
        raise ValueError(
            f"token_ids has shape {tuple(ids.shape)}; the batch needs [{batch.num_tokens}] (1-D)"
        )
    vocab = model.config.get_text_config().vocab_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token_ids must lie in [0, {vocab}) (the model's vocab_size)")
    ids = ids.reshape(1, -1)
    positions = torch.from_numpy(batch.positions).reshape(1, -1)
    out = model(input_ids=ids, position_ids=positions, kvrs_batch=batch, use_cache=False)
    return out.logits[0]
