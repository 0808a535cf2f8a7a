"""Absorbed multi-head latent attention (DeepSeek-V2/V3's MLA) over kvrs's latent cache.

transformers' DeepSeek attention caches the compressed latent (``kv_nope``:
``kv_lora_rank`` values, and the rotary key ``k_rot``: ``qk_rope_head_dim`` values; one
shared head), then expands the whole history into per-head keys and values with
``kv_b_proj`` at every step. Under [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention]
kvrs instead absorbs ``kv_b_proj`` into the queries and the output, as vLLM's and
FlashInfer's MLA kernels do: with ``W_UK`` and ``W_UV`` the key and value halves of
``kv_b_proj``, each head's score is ``(q_nope W_UK) . c + q_rope . k_rot`` and its output
``W_UV (sum_j p_j c_j)``, so attention reads the latent in place (``latent=True``) and
nothing of size ``[heads x history]`` is expanded.
"""

from __future__ import annotations

import sys
from typing import Any

from kvrs.integrations._torch import as_torch, torch

__all__ = ["is_mla", "wrap_forward"]


def is_mla(module: torch.nn.Module) -> bool:
    """Whether `module` is a DeepSeek-style MLA attention layer (it has the latent
    projections kvrs absorbs)."""
    return all(hasattr(module, name) for name in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_lora_rank"))


def wrap_forward(module: torch.nn.Module) -> None:
    """Makes `module` (an MLA layer) attend in absorbed form over a kvrs ForwardBatch or a
    kvrs cache that attends in place; any other call runs its own forward."""
    if getattr(module, "_kvrs_mla", False):
        return
    own = module.forward

    def forward(
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        batch = kwargs.get("kvrs_batch")
        in_place = bool(getattr(past_key_values, "attend_in_place", False))
        if batch is None and not in_place:
            return own(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        return _absorbed_forward(module, hidden_states, position_embeddings, past_key_values, batch), None

    module.forward = forward  # type: ignore[method-assign]  # an instance attribute, per module
    module._kvrs_mla = True  # type: ignore[assignment]  # marks the wrapped module


def _absorbed_forward(
    module: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    cache: Any,
    batch: Any,
) -> torch.Tensor:
    """DeepSeek attention with the latent cache read in place: the module's projections
    and rotary embedding as its own forward applies them, the cache written with the
    latent, attention over it in absorbed form."""
    b, s = hidden_states.shape[:-1]
    heads, nope, rope = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim
    rank, v_dim = module.kv_lora_rank, module.v_head_dim
    if module.q_lora_rank is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(b, s, heads, nope + rope).transpose(1, 2)
    q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv_nope, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    kv_nope = module.kv_a_layernorm(kv_nope).view(b, 1, s, rank)
    k_rot = k_rot.view(b, 1, s, rope)
    modeling = sys.modules[type(module).__module__]
    cos, sin = position_embeddings
    if getattr(module.config, "rope_interleave", False):
        q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    else:
        q_rot, k_rot = modeling.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    # kv_b_proj maps a latent to each head's [k_nope, v]: W_UK [heads, nope, rank] and
    # W_UV [heads, v_dim, rank].
    w = module.kv_b_proj.weight.view(heads, nope + v_dim, rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_latent = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)
    query = torch.cat([q_latent, q_rot], dim=-1).detach()  # [b, heads, s, rank + rope]
    options = {"scale": module.scaling, "latent": True}
    layer = int(module.layer_idx)
    if batch is not None:
        # One packed row: the pool takes [tokens, heads, dim].
        batch.put(layer, kv_nope[0].transpose(0, 1), k_rot[0].transpose(0, 1))
        out = as_torch(batch.attention(layer, query[0].transpose(0, 1), **options))[None]
    else:
        kv_nope, _ = cache.update(kv_nope, k_rot, layer)
        out = kv_nope._kvrs_source.attend(layer, query, options, None)  # [b, s, heads, rank]
    out = torch.einsum("bshr,hvr->bshv", out.to(w.dtype), w_uv)
    return module.o_proj(out.reshape(b, s, heads * v_dim))
