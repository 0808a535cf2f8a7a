"""A model's layers as kvrs holds them: K/V layers of each attention kind (full,
sliding, chunked) and head sizes (an MLA model's latent), and for hybrid models the
state layers of their linear-attention or Mamba layers; and the BlockPool that holds
them ([`block_pool_from_config`][kvrs.integrations.transformers.block_pool_from_config])."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import kvrs
from kvrs.integrations._torch import (
    model_dtype,
    model_parts,
    resolve_device,
    resolve_dtype,
    text_config,
    torch,
)
from kvrs.integrations.fingerprint import model_fingerprint

__all__ = ["LayerPlan", "bind_pool", "block_pool_from_config", "check_pool", "is_model", "layer_plan"]

_LINEAR_TYPES = frozenset({"linear_attention", "mamba", "mamba2", "linear"})
"""The Hugging Face layer types whose layers keep recurrent state instead of K/V."""


@dataclass(frozen=True)
class LayerPlan:
    """Where each model layer lives in a pool: K/V layer `kv_of[i]` or state layer
    `state_of[i]`."""

    kv_of: dict[int, int]
    """Model layer -> the pool's K/V layer, for attention layers."""
    state_of: dict[int, int]
    """Model layer -> the pool's state layer, for linear-attention / Mamba layers."""
    attention_types: list[str]
    """The kvrs kind ('full', 'sliding', 'chunked') of each K/V layer, in order."""
    state_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Each state's shape per sequence and layer (empty without state layers)."""

    @property
    def is_hybrid(self) -> bool:
        """Whether the model has state layers."""
        return bool(self.state_of)

    @property
    def num_layers(self) -> int:
        """Model layers."""
        return len(self.kv_of) + len(self.state_of)


def _layer_types(config: Any) -> list[str]:
    """The config's per-layer types as transformers names them (`layer_types`, or
    `layers_block_type`), or [] when the config names none."""
    text = text_config(config)
    types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    return list(types) if types is not None else []


def _state_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The per-sequence states of one linear layer of `config`'s model: a gated
    delta-net (Qwen3-Next) or a Mamba-2 mixer (Bamba, GraniteMoeHybrid) keeps a
    convolution window ``conv`` [conv_dim, kernel] and a ``recurrent`` matrix ([value
    heads, key dim, value dim], or [heads, head dim, state size])."""
    text = text_config(config)
    if hasattr(text, "linear_num_value_heads"):
        keys = text.linear_num_key_heads * text.linear_key_head_dim
        values = text.linear_num_value_heads * text.linear_value_head_dim
        return {
            "conv": (2 * keys + values, text.linear_conv_kernel_dim),
            "recurrent": (text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim),
        }
    if all(hasattr(text, a) for a in ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state")):
        heads, head_dim = text.mamba_n_heads, text.mamba_d_head
        conv = heads * head_dim + 2 * text.mamba_n_groups * text.mamba_d_state
        return {"conv": (conv, text.mamba_d_conv), "recurrent": (heads, head_dim, text.mamba_d_state)}
    raise kvrs.NotSupportedError(
        f"{type(text).__name__} has linear layers whose states kvrs does not know: it serves "
        "gated delta-net (Qwen3-Next) and Mamba-2 (Bamba, GraniteMoeHybrid) layers"
    )


def layer_plan(config: Any, with_shapes: bool = True) -> LayerPlan:
    """Splits `config`'s layers into the pool's K/V layers and state layers, with the
    states' shapes (`with_shapes`; NotSupportedError for linear layers kvrs cannot hold)."""
    text = text_config(config)
    types = _layer_types(config) or ["full_attention"] * text.num_hidden_layers
    kv_of: dict[int, int] = {}
    state_of: dict[int, int] = {}
    kinds: list[str] = []
    for i, t in enumerate(types[: text.num_hidden_layers]):
        if t in ("hybrid", "hybrid_sliding"):
            raise kvrs.NotSupportedError(
                f"{type(text).__name__} layer {i} is {t!r}: attention and a linear mixer in one "
                "layer, which kvrs does not serve yet (use transformers' DynamicCache)"
            )
        if t in _LINEAR_TYPES:
            state_of[i] = len(state_of)
        else:
            kv_of[i] = len(kv_of)
            kinds.append(_kvrs_kind(t))
    if state_of and not kv_of:
        raise kvrs.NotSupportedError(
            "a model of linear layers only has no K/V: kvrs pools hold K/V beside the state"
        )
    return LayerPlan(kv_of, state_of, kinds, _state_shapes(config) if state_of and with_shapes else {})


def _is_hybrid(config: Any) -> bool:
    """Whether `config`'s model has linear-attention or Mamba layers (state layers)."""
    return any(t in _LINEAR_TYPES for t in _layer_types(config))


def _state_dtypes(model_dtype: torch.dtype | None) -> dict[str, str]:
    """Storage dtypes of the states: the convolution window in the model's dtype (what
    it computes the window in), the recurrent matrix in float32 (it accumulates over
    every token)."""
    conv = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(model_dtype, "float32")  # type: ignore[arg-type]
    return {"conv": conv, "recurrent": "float32"}


def _attention_layout(config: Any) -> dict[str, Any]:
    """The BlockPool arguments that describe a model's attention layers: `layer_types`
    (from the config's `layer_types`, else every layer sliding when it sets
    `sliding_window`, chunked when it sets `attention_chunk_size`, full otherwise; a
    hybrid model's linear layers are left out: they are state layers), `sliding_window`,
    `chunk_size`."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    chunk = getattr(text, "attention_chunk_size", None)
    if _layer_types(config):
        types = layer_plan(config).attention_types
    else:
        kind = "sliding" if window is not None else "chunked" if chunk is not None else "full"
        types = [kind] * text.num_hidden_layers
    return {
        "layer_types": types,
        "sliding_window": window if "sliding" in types else None,
        "chunk_size": chunk if "chunked" in types else None,
    }


def _kvrs_kind(layer_type: str) -> str:
    """kvrs's name for a Hugging Face layer type ('sliding_attention' -> 'sliding')."""
    return layer_type.removesuffix("_attention")


def _cache_heads(config: Any) -> tuple[int, int, int]:
    """What a model's cache holds per token and layer: (KV heads, key head size, value
    head size). An MLA model (DeepSeek-V2/V3: a config with `kv_lora_rank`) caches its
    compressed latent, one shared head whose "key" is the `kv_lora_rank` latent and whose
    "value" the `qk_rope_head_dim` rotary key, as transformers' own cache does."""
    text = text_config(config)
    rank = getattr(text, "kv_lora_rank", None)
    if rank is not None:
        return 1, rank, text.qk_rope_head_dim
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return heads, head_dim, head_dim


def block_pool_from_config(
    model_or_config: Any,
    *,
    num_blocks: int | None = None,
    memory_bytes: int | str | None = None,
    block_size: int = 16,
    dtype: Any = "auto",
    device: Any = None,
    state_slots: int | None = None,
    **pool_kwargs: Any,
) -> kvrs.BlockPool:
    """A BlockPool shaped for a transformers model (or its config): its attention layers
    (and their kinds), KV heads and head sizes (an MLA model's latent: see
    `_cache_heads`), and for a hybrid model its linear layers as state layers
    (`layer_plan`) with `state_slots` slots (default 8: sequences that can run at
    once) and, with prefix caching (the default), ``state_checkpoints`` checkpoint
    slots (default two per state slot) so that prefix hits restore the recurrent
    state. `dtype` 'auto' (or None) is the model's: its parameters'
    dtype for a model, the config's `dtype` for a config (float32 when it records none);
    else a kvrs name or a torch dtype. `device` None is the model's (the host for a
    config). Give `num_blocks` or `memory_bytes` (the states' bytes come out of it);
    other keywords (prefix_caching, swa_memory, tiers, ...) go to BlockPool.

    Made from a model, the pool is bound to it (``BlockPool.bind_model`` with
    [`model_fingerprint`][kvrs.integrations.transformers.model_fingerprint]: its configuration and
    weights), and its ``model_id``, which keys its blocks in tiers and prefix-cache
    files, is that fingerprint unless `model_id` is given: another model, even one of the
    same shape, is refused the pool and never reads its blocks from a shared tier. Made
    from a config, the pool binds to the first model that uses it; give `model_id` to
    use tiers."""
    config, m_dtype, m_device = model_parts(model_or_config)
    fingerprint = model_fingerprint(model_or_config) if is_model(model_or_config) else None
    if fingerprint is not None and not pool_kwargs.get("model_id"):
        pool_kwargs["model_id"] = fingerprint
    heads, head_dim, v_head_dim = _cache_heads(config)
    layout = _attention_layout(config)
    plan = layer_plan(config) if _layer_types(config) else None
    if plan is not None and plan.is_hybrid:
        pool_kwargs = {
            "state_layers": len(plan.state_of),
            "state_shapes": plan.state_shapes,
            "state_slots": 8 if state_slots is None else state_slots,
            "state_dtype": _state_dtypes(m_dtype),
            **pool_kwargs,
        }
    elif state_slots is not None:
        raise ValueError(
            f"state_slots={state_slots}: {type(text_config(config)).__name__} has no state layers"
        )
    pool = kvrs.BlockPool(
        len(layout["layer_types"]),
        heads,
        head_dim,
        v_head_dim=v_head_dim,
        block_size=block_size,
        num_blocks=num_blocks,
        memory_bytes=memory_bytes,
        dtype=resolve_dtype(dtype, m_dtype) or model_dtype(config),
        device=resolve_device(device, m_device),
        **layout,
        **pool_kwargs,
    )
    if fingerprint is not None:
        pool.bind_model(fingerprint)
    return pool


def is_model(model_or_config: Any) -> bool:
    """Whether `model_or_config` is a model (a torch module with a config), not a config."""
    return isinstance(model_or_config, torch.nn.Module) and hasattr(model_or_config, "config")


def bind_pool(pool: kvrs.BlockPool, model: Any, *, recheck: bool = True) -> None:
    """Binds `pool` to `model` (its first model), or raises ValueError when it serves
    another model: the one place that keeps one model's cached K/V from another.
    `recheck=False` (every forward pass) trusts the model's kept fingerprint instead of
    checking its parameters for changes (done when a pool is made or given to
    generate_batch)."""
    if is_model(model):
        pool.bind_model(model_fingerprint(model, recheck=recheck))


def _pool_layout(pool: kvrs.BlockPool) -> dict[str, Any]:
    """The layer kinds of `pool` as [`blocks_per_sequence`][kvrs.blocks_per_sequence] takes them (what
    `_attention_layout` gives for a config, with `swa_memory`)."""
    return {
        "layer_types": pool.layer_types,
        "sliding_window": pool.sliding_window,
        "chunk_size": pool.chunk_size,
        "swa_memory": pool.swa_memory,
    }


def check_pool(pool: kvrs.BlockPool, model_or_config: Any, *, recheck: bool = True) -> None:
    """Raises ValueError unless `pool` holds what the model's layers write: its attention
    layers (their kinds and windows), KV heads, head sizes and state layers, as
    [`block_pool_from_config`][kvrs.integrations.transformers.block_pool_from_config] makes them (a mismatch
    would otherwise surface as a
    shape error deep inside a forward pass), and, given a model, unless the pool serves
    that model (`bind_pool`: a pool not yet bound binds to it)."""
    config = model_parts(model_or_config)[0]
    heads, head_dim, v_head_dim = _cache_heads(config)
    layout = _attention_layout(config)
    plan = layer_plan(config, with_shapes=False) if _layer_types(config) else None
    want = {
        "K/V layers": len(layout["layer_types"]),
        "KV heads": heads,
        "head_dim": head_dim,
        "v_head_dim": v_head_dim,
        "layer kinds": layout["layer_types"],
        "sliding_window": layout["sliding_window"],
        "chunk_size": layout["chunk_size"],
        "state layers": len(plan.state_of) if plan is not None else 0,
    }
    got = {
        "K/V layers": pool.num_layers,
        "KV heads": pool.num_kv_heads,
        "head_dim": pool.head_dim,
        "v_head_dim": pool.v_head_dim,
        "layer kinds": pool.layer_types,
        "sliding_window": pool.sliding_window,
        "chunk_size": pool.chunk_size,
        "state layers": pool.state_layers,
    }
    differ = [f"{k} {got[k]} (the model: {v})" for k, v in want.items() if got[k] != v]
    if differ:
        raise ValueError(
            f"this pool does not match the model ({type(text_config(config)).__name__}): it has "
            f"{', '.join(differ)}; make it with block_pool_from_config(model, ...)"
        )
    bind_pool(pool, model_or_config, recheck=recheck)
