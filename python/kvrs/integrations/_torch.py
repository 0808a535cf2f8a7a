"""What the transformers integrations share: the import guard (torch and transformers),
zero-copy views, and reading a model config's attention layout."""

from __future__ import annotations

from typing import Any

import numpy as np

import kvrs

try:
    import torch
    import transformers
    from packaging.specifiers import SpecifierSet  # a dependency of transformers
    from packaging.version import Version
except ImportError as e:  # pragma: no cover - exercised in environments without torch
    raise ImportError(
        "kvrs.integrations.transformers needs torch and transformers: pip install torch transformers"
    ) from e

SUPPORTED_TRANSFORMERS = ">=5.15,<6"
"""The transformers versions whose cache contract the integration follows (5.15 made
`crop(n)` take a negative count; 5.23.0 is the version tested)."""

if not SpecifierSet(SUPPORTED_TRANSFORMERS).contains(Version(transformers.__version__)):
    raise ImportError(
        f"kvrs.integrations.transformers supports transformers {SUPPORTED_TRANSFORMERS} "
        f"(5.23.0 tested); found {transformers.__version__}: pip install 'transformers==5.23.0'"
    )

STORAGE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
"""The torch dtypes kvrs stores, by their kvrs names."""

QUANTIZED_DTYPES = frozenset({"fp8_e4m3", "fp8_e5m2", "int8"})
"""kvrs's 8-bit storage dtypes: their reads are codes unless dequantized."""


def as_torch(view: np.ndarray | kvrs.DeviceTensor) -> torch.Tensor:
    """A torch tensor over a kvrs array (host; bfloat16 and fp8 ones export themselves,
    see `kvrs.HostArray`) or DeviceTensor (CUDA), without a copy."""
    return torch.from_dlpack(view)


def text_config(config: Any) -> Any:
    """The decoder's config (`config.get_text_config()` for multimodal models)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_dtype(config: Any) -> str:
    """The kvrs name of the config's dtype, float32 when it has none kvrs stores."""
    dtype = getattr(text_config(config), "dtype", None)
    return STORAGE_DTYPES.get(dtype, "float32") if isinstance(dtype, torch.dtype) else "float32"


def model_parts(model_or_config: Any) -> tuple[Any, torch.dtype | None, torch.device | None]:
    """The config, dtype and device of a transformers model (those of its parameters:
    what its forward computes in, whatever its config says), or a config with the dtype
    it records and no device."""
    config = getattr(model_or_config, "config", None)
    if config is not None and isinstance(model_or_config, torch.nn.Module):
        param = next(model_or_config.parameters(), None)
        if param is not None:
            return config, param.dtype, param.device
        return config, getattr(text_config(config), "dtype", None), None
    dtype = getattr(text_config(model_or_config), "dtype", None)
    return model_or_config, dtype if isinstance(dtype, torch.dtype) else None, None


def resolve_dtype(dtype: Any, model: torch.dtype | None) -> Any:
    """`dtype` as kvrs takes it: None or 'auto' (any case) is the model's dtype (None when
    unknown), anything else (a kvrs name, a torch dtype) as given."""
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        if model is None:
            return None
        if model not in STORAGE_DTYPES:
            raise ValueError(
                f"dtype='auto': the model computes in {model}, which kvrs does not store; "
                f"give dtype= one of {sorted(STORAGE_DTYPES.values())} or an 8-bit dtype"
            )
        return STORAGE_DTYPES[model]
    return dtype


def resolve_device(device: Any, model: torch.device | None) -> str:
    """`device` as kvrs takes it: None is the model's device (the host without a model)."""
    if device is None:
        return str(model) if model is not None else "cpu"
    return str(device)


def attention_layout(config: Any) -> dict[str, Any]:
    """The BlockPool arguments that describe a model's layers: `layer_types` (from the
    config's `layer_types`, else every layer sliding when it sets `sliding_window`, chunked
    when it sets `attention_chunk_size`, full otherwise), `sliding_window`, `chunk_size`."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    chunk = getattr(text, "attention_chunk_size", None)
    types = getattr(text, "layer_types", None)
    if types is None:
        kind = "sliding" if window is not None else "chunked" if chunk is not None else "full"
        types = [kind] * text.num_hidden_layers
    kinds = {kvrs_kind(t) for t in types}
    return {
        "layer_types": [kvrs_kind(t) for t in types],
        "sliding_window": window if "sliding" in kinds else None,
        "chunk_size": chunk if "chunked" in kinds else None,
    }


def kvrs_kind(layer_type: str) -> str:
    """kvrs's name for a Hugging Face layer type ('sliding_attention' -> 'sliding')."""
    return layer_type.removesuffix("_attention")


def cache_heads(config: Any) -> tuple[int, int, int]:
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
    **pool_kwargs: Any,
) -> kvrs.BlockPool:
    """A BlockPool shaped for a transformers model (or its config): its layers (and their
    kinds), KV heads and head sizes (an MLA model's latent: see :func:`cache_heads`).
    `dtype` 'auto' (or None) is the model's: its parameters' dtype for a model, the
    config's `dtype` for a config (float32 when it records none); else a kvrs name or a
    torch dtype. `device` None is the model's (the host for a config). Give `num_blocks`
    or `memory_bytes`; other keywords (prefix_caching, swa_memory, ...) go to BlockPool."""
    config, m_dtype, m_device = model_parts(model_or_config)
    heads, head_dim, v_head_dim = cache_heads(config)
    return kvrs.BlockPool(
        text_config(config).num_hidden_layers,
        heads,
        head_dim,
        v_head_dim=v_head_dim,
        block_size=block_size,
        num_blocks=num_blocks,
        memory_bytes=memory_bytes,
        dtype=resolve_dtype(dtype, m_dtype) or model_dtype(config),
        device=resolve_device(device, m_device),
        **attention_layout(config),
        **pool_kwargs,
    )
