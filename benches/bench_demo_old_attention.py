"""The demo's concurrency sweep with the attention kvrs had before it computed attention
itself: `ForwardBatch.get`'s gathered history of every sequence and a dense 0/-inf mask,
then torch SDPA. Same engine, model and admission as `python -m kvrs demo --concurrency`,
so the two tables compare attention alone.

    python benches/bench_demo_old_attention.py 8,32,96
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import AttentionInterface

import kvrs.integrations.paged_attention as paged
from kvrs import demo
from kvrs.integrations._torch import as_torch


def gathered_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over `batch.get`'s history under its dense mask (the former path)."""
    batch = kwargs.pop("kvrs_batch", None)
    if batch is None:
        return paged.paged_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    layer = int(module.layer_idx)  # type: ignore[arg-type]
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


if __name__ == "__main__":
    AttentionInterface.register(paged.ATTN_IMPLEMENTATION, gathered_attention)
    counts = sys.argv[1] if len(sys.argv) > 1 else "8,32,96"
    demo.throughput([int(n) for n in counts.split(",")], plot_path=None)
