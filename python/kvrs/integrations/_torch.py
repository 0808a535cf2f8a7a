"""What the transformers integrations share: the import guard (torch and transformers),
zero-copy views, and a model's dtype and device (its layers: `kvrs.integrations.layout`)."""

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

__all__ = [
    "QUANTIZED_DTYPES",
    "STORAGE_DTYPES",
    "SUPPORTED_TRANSFORMERS",
    "as_torch",
    "model_dtype",
    "model_parts",
    "resolve_device",
    "resolve_dtype",
    "text_config",
    "torch",
]

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
    """`device` as kvrs takes it: None is the model's device (the host without a model).
    A model on torch's ``meta`` device has no weights to run: DeviceError saying so."""
    if device is None:
        if model is not None and model.type == "meta":
            raise kvrs.DeviceError(
                "the model's parameters are on torch's meta device (shapes only, no weights: built under "
                "init_empty_weights or torch.device('meta'), or not loaded yet): load its weights "
                "(from_pretrained, model.to_empty(device=...) and load_state_dict), or pass device="
            )
        return str(model) if model is not None else "cpu"
    return str(device)
