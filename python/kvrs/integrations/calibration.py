"""fp8 K/V scales from calibration prompts, as vLLM's ``calculate_kv_scales`` computes them.

[`calibrate_kv_scales`][kvrs.integrations.transformers.calibrate_kv_scales] runs a transformers model over a
few prompts and records, for
every layer and KV head, the largest magnitude of the keys and values the layer would
store (K after the rotary embedding: what ``Cache.update`` receives), over the prompts'
real tokens only. Each scale is that amax divided by the fp8 format's largest finite
value (448 for E4M3, 57344 for E5M2), so the calibration K/V fill the format's range
without saturating. The result plugs into [`KvrsCache`][kvrs.integrations.transformers.KvrsCache],
[`KvrsPagedCache`][kvrs.integrations.transformers.KvrsPagedCache] and [`BlockPool`][kvrs.BlockPool].
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvrs
from kvrs.integrations._torch import torch

from transformers.cache_utils import DynamicCache  # isort: skip

__all__ = ["FP8_MAX", "KvScales", "calibrate_kv_scales", "scale_for"]

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
"""The largest finite value of each fp8 storage dtype, by its kvrs name."""


@dataclass(frozen=True)
class KvScales:
    """fp8 K and V scales for a model, in the shapes kvrs's caches take.

    ``k_scale`` and ``v_scale`` hold one entry per layer: a list of one float per KV head
    (``per_head=True``: ``[num_layers][num_kv_heads]``), or one float
    (``per_head=False``: ``[num_layers]``). ``k_amax`` and ``v_amax`` are the
    ``[num_layers][num_kv_heads]`` magnitudes they came from (0.0 where a head saw no
    value but zeros), ``dtype`` the fp8 dtype they are for, ``tokens`` the calibration
    tokens seen (padding excluded).

    ``KvrsCache.from_config(config, 256, **scales.as_kwargs())``,
    ``KvrsPagedCache.from_config(config, max_seq_len=256, **scales.as_kwargs())`` and
    ``kvrs.BlockPool(..., **scales.as_kwargs())`` take them with their dtype; or pass
    ``k_scale=scales.k_scale, v_scale=scales.v_scale`` with ``dtype=scales.dtype``.
    """

    k_scale: list[list[float]] | list[float]
    v_scale: list[list[float]] | list[float]
    dtype: str
    k_amax: list[list[float]]
    v_amax: list[list[float]]
    tokens: int

    def as_kwargs(self) -> dict[str, Any]:
        """``{"dtype": ..., "k_scale": ..., "v_scale": ...}``: the keyword arguments of
        ``KvrsCache``, ``KvrsCache.from_config``, ``KvrsPagedCache.from_config`` and
        ``kvrs.BlockPool``."""
        return {"dtype": self.dtype, "k_scale": self.k_scale, "v_scale": self.v_scale}


def _fp8_dtype(dtype: Any) -> str:
    """kvrs's name of an fp8 storage dtype given in any spelling kvrs accepts ('fp8',
    'e4m3', 'float8_e4m3fn', torch.float8_e5m2, ...); ValueError for other dtypes."""
    try:
        name = kvrs.KVCache(1, 1, 1, 1, dtype=dtype).dtype  # kvrs's own parsing
    except (TypeError, ValueError) as e:
        raise ValueError(f"dtype={dtype!r}: give an fp8 dtype ('fp8_e4m3' or 'fp8_e5m2'): {e}") from None
    if name not in FP8_MAX:
        raise ValueError(
            f"dtype={dtype!r} is {name}: k_scale and v_scale apply to fp8 caches ('fp8_e4m3', "
            "'fp8_e5m2'); int8 computes a scale per token and head, float dtypes take none"
        )
    return name


def scale_for(amax: float, fmt_max: float, margin: float = 1.0) -> float:
    """The float32 scale that maps `amax` to ``fmt_max / margin``: ``amax / (fmt_max /
    margin)`` in float32; 1.0 for an amax of 0 (a head that stored only zeros keeps
    kvrs's default scale rather than one that would saturate any later value); never
    below float32's smallest normal number."""
    if not np.isfinite(amax) or amax < 0:
        raise ValueError(f"amax={amax}: the model's keys or values are not finite")
    if amax == 0:
        return 1.0
    target = fmt_max / margin  # a float64: finite for any margin the caller validated
    with np.errstate(over="ignore", divide="ignore", under="ignore", invalid="ignore"):
        target32 = np.float32(target)
        scale = np.float32(amax) / target32
    if not (np.isfinite(scale) and np.isfinite(target32) and target32 > 0):
        raise ValueError(
            f"margin={margin}: amax {amax} maps to a scale float32 cannot hold ({scale}); "
            "give a margin near 1 (vLLM's runtime constants are 448/200 for K, 448/100 for V)"
        )
    return float(max(scale, np.finfo(np.float32).tiny))


def _batches(prompts: Any, batch_size: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """`prompts` as (input_ids, attention_mask) pairs of at most `batch_size` rows (lists
    right-padded with 0 under a mask of 0), and the number of real tokens."""
    if isinstance(prompts, Mapping):
        ids = torch.as_tensor(prompts["input_ids"])
        mask = prompts.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
    elif isinstance(prompts, torch.Tensor | np.ndarray):
        ids = torch.as_tensor(prompts)
        mask = torch.ones_like(ids)
    elif isinstance(prompts, Sequence) and not isinstance(prompts, str | bytes):
        rows = list(prompts)
        if rows and isinstance(rows[0], int | np.integer):
            rows = [rows]  # one prompt's ids
        lists = [torch.as_tensor(r).flatten().tolist() for r in rows]
        width = max((len(r) for r in lists), default=0)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in lists], dtype=torch.long)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in lists], dtype=torch.long)
        ids, mask = ids.reshape(len(lists), width), mask.reshape(len(lists), width)
    else:
        raise TypeError(
            "prompts must be token ids: a list of lists of ints, a 2-D tensor, or a mapping with "
            f"'input_ids' (and 'attention_mask'), such as a tokenizer's output; got {type(prompts).__name__}"
        )
    if ids.ndim == 1:
        ids, mask = ids[None], mask.reshape(1, -1)
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(
            f"input_ids has shape {list(ids.shape)} and attention_mask {list(mask.shape)}: "
            "give [batch, seq_len] for both"
        )
    if ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"input_ids must be integer token ids; got {ids.dtype}")
    mask = mask.to(torch.bool)
    tokens = int(mask.sum())
    if tokens == 0:
        raise ValueError("the calibration prompts hold no tokens (every position is padding)")
    ids = ids.to(torch.long)
    pairs = [
        (ids[i : i + batch_size], mask[i : i + batch_size])
        for i in range(0, ids.shape[0], batch_size)
        if bool(mask[i : i + batch_size].any())
    ]
    return pairs, tokens


class _AmaxCache(DynamicCache):
    """A DynamicCache that records, as each layer stores its K/V, the largest magnitude
    per KV head over the unmasked tokens: every token that reaches the cache, including
    those a sliding-window layer would drop later."""

    def __init__(self, config: Any, mask: torch.Tensor, amax: dict[int, list[torch.Tensor]]):
        super().__init__(config=config)
        self.token_mask = mask  # [batch, seq_len], True for real tokens
        self.amax = amax

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mask = self.token_mask.to(key_states.device)[:, None, -key_states.shape[2] :, None]
        seen = []
        for x in (key_states, value_states):
            masked = torch.where(mask, x.detach().abs().float(), 0.0)
            seen.append(masked.amax(dim=(0, 2, 3)).cpu())  # [num_kv_heads]
        if layer_idx in self.amax:
            self.amax[layer_idx] = [
                torch.maximum(a, b) for a, b in zip(self.amax[layer_idx], seen, strict=True)
            ]
        else:
            self.amax[layer_idx] = seen
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def calibrate_kv_scales(
    model: Any,
    prompts: Any,
    *,
    dtype: Any = "fp8_e4m3",
    per_head: bool = True,
    margin: float | tuple[float, float] = 1.0,
    batch_size: int = 8,
) -> KvScales:
    """fp8 K and V scales for `model`'s layers from calibration `prompts`, as vLLM's
    ``calculate_kv_scales``: ``scale = amax(|K|) / fp8_max`` (and the same for V) per
    layer and, with `per_head`, per KV head.

    Runs the model (under ``torch.no_grad``, in eval mode; its training mode is restored
    afterwards) over `prompts`: a list of token-id lists (any lengths; padded
    internally), one list of ids, a ``[batch, seq_len]`` tensor or array, or a mapping
    with ``input_ids`` and optionally ``attention_mask`` (a tokenizer's
    ``BatchEncoding``), in chunks of `batch_size` rows. Padding (``attention_mask == 0``)
    is excluded, and positions count from each row's first real token (left padding
    works). The amax is taken over the K and V every layer's ``Cache.update`` receives:
    keys after the rotary embedding, which is what a cache stores.

    `dtype` is the fp8 format the scales are for, in any spelling kvrs accepts
    (``"fp8_e4m3"``: max 448, the default; ``"fp8_e5m2"``: 57344). `margin` (> 0; one
    number, or ``(k_margin, v_margin)``) multiplies the scales: the calibration amax
    maps to ``fp8_max / margin``, so values up to `margin` times larger than any the
    prompts produced still fit. ``margin=1`` is the offline calibrators' ``amax / 448``
    (the checkpoint scales vLLM loads); vLLM's runtime ``calculate_kv_scales`` divides
    by the constants 200 (K) and 100 (V) instead, which is ``margin=(448 / 200, 448 /
    100)`` for E4M3 (its scales are also one per layer: ``per_head=False``). With an
    fp8 cache, each layer after the first sees inputs that differ from this float run
    by the earlier layers' fp8 error, so its largest K/V can come out a little past the
    calibrated amax; E4M3 rounds values up to 464 (3.6% past 448) to 448 without
    saturating, and prompts unlike the calibration ones are what a margin is for
    (``pool.stats()["fp8_saturated"]`` counts what saturates). The division is in
    float32. A head whose K (or V) were all zero gets scale 1.0, kvrs's default: any
    smaller scale would saturate whatever it stores later. Non-finite K/V are a
    ``ValueError``.

    Returns a [`KvScales`][kvrs.integrations.transformers.KvScales]; ``scales.as_kwargs()`` gives ``dtype``,
    ``k_scale`` and
    ``v_scale`` for ``KvrsCache``, ``KvrsPagedCache.from_config`` and ``kvrs.BlockPool``.
    """
    name = _fp8_dtype(dtype)
    margins = tuple(margin) if isinstance(margin, tuple | list) else (margin, margin)
    if len(margins) != 2 or not all(
        isinstance(m, int | float) and not isinstance(m, bool) and np.isfinite(m) and m > 0 for m in margins
    ):
        raise ValueError(f"margin={margin!r}: must be a finite number > 0, or a (k, v) pair of them")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    batches, tokens = _batches(prompts, batch_size)
    device = _device(model)
    forward_args = inspect.signature(model.forward).parameters
    amax: dict[int, list[torch.Tensor]] = {}
    training = bool(getattr(model, "training", False))
    model.eval()
    try:
        with torch.no_grad():
            for ids, mask in batches:
                ids, mask = ids.to(device), mask.to(device)
                cache = _AmaxCache(model.config, mask, amax)
                kwargs: dict[str, Any] = {
                    "input_ids": ids,
                    "attention_mask": mask.to(torch.long),
                    # Positions from each row's first real token, as generate() numbers them.
                    "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0),
                    "past_key_values": cache,
                    "use_cache": True,
                }
                if "logits_to_keep" in forward_args:
                    kwargs["logits_to_keep"] = 1  # the logits are not needed
                model(**kwargs)
    finally:
        model.train(training)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_layers = int(config.num_hidden_layers)
    missing = [i for i in range(num_layers) if i not in amax]
    if missing:
        raise ValueError(
            f"layers {missing} stored no keys or values during calibration (shared or absent K/V); "
            "calibrate_kv_scales needs every layer to write its cache"
        )
    k_amax = [[float(x) for x in amax[i][0]] for i in range(num_layers)]
    v_amax = [[float(x) for x in amax[i][1]] for i in range(num_layers)]
    fmt_max = FP8_MAX[name]

    def scales(per_layer: list[list[float]], margin: float) -> list[list[float]] | list[float]:
        if per_head:
            return [[scale_for(a, fmt_max, margin) for a in heads] for heads in per_layer]
        return [scale_for(max(heads), fmt_max, margin) for heads in per_layer]

    return KvScales(
        k_scale=scales(k_amax, float(margins[0])),
        v_scale=scales(v_amax, float(margins[1])),
        dtype=name,
        k_amax=k_amax,
        v_amax=v_amax,
        tokens=tokens,
    )
