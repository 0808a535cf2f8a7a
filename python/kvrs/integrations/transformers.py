"""A Hugging Face ``transformers`` cache backed by kvrs, and continuous batching of a
transformers model over a [`BlockPool`][kvrs.BlockPool].

``KvrsCache`` subclasses ``transformers.Cache`` with one
[`KvrsLayer`][kvrs.integrations.transformers.KvrsLayer] per model
layer. Each layer keeps its keys and values in a [`KVCache`][kvrs.KVCache] allocated once, on
first use, for the batch it sees: ``batch * num_kv_heads`` heads of ``max_seq_len``
positions, so the tensors handed back to the model are zero-copy views of kvrs's memory
(``[batch, heads, seq_len, head_dim]``), cast to the model's dtype only when the storage
dtype differs. ``KvrsPagedCache`` keeps one pool sequence per batch row instead, and
releases what sliding-window layers no longer see. Both work with
``model.generate(..., past_key_values=cache)`` and with manual forward loops (greedy,
sampling, beam search, assisted decoding, cropping).

``calibrate_kv_scales`` (from `kvrs.integrations.calibration`) computes fp8 K/V scales
from calibration prompts, in the form both caches and [`BlockPool`][kvrs.BlockPool] take.

``use_paged_attention`` and ``forward_batch`` (from `kvrs.integrations.paged_attention`)
run ragged batches of many sequences through one forward pass; ``generate_batch`` (from
`kvrs.integrations.generation`) serves a list of prompts with continuous batching.

Needs ``torch`` and ``transformers`` (5.x); importing this module without them raises an
``ImportError`` that says what to install.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvrs
from kvrs.integrations import hybrid
from kvrs.integrations._torch import (
    QUANTIZED_DTYPES,
    STORAGE_DTYPES,
    as_torch,
    model_parts,
    resolve_device,
    resolve_dtype,
    text_config,
    torch,
)
from kvrs.integrations.calibration import KvScales, calibrate_kv_scales
from kvrs.integrations.fingerprint import model_fingerprint
from kvrs.integrations.generation import GenerationResult, RequestState, SamplingParams, generate_batch
from kvrs.integrations.layout import LayerPlan, _attention_layout, block_pool_from_config, layer_plan
from kvrs.integrations.paged_attention import (
    ATTN_IMPLEMENTATION,
    forward_batch,
    restore_attention,
    use_paged_attention,
)

from transformers.cache_utils import (  # isort: skip
    Cache,
    CacheLayerMixin,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "GenerationResult",
    "KvScales",
    "KvrsCache",
    "KvrsLayer",
    "KvrsPagedCache",
    "KvrsPagedLayer",
    "KvrsStateLayer",
    "RequestState",
    "SamplingParams",
    "block_pool_from_config",
    "calibrate_kv_scales",
    "forward_batch",
    "generate_batch",
    "model_fingerprint",
    "restore_attention",
    "use_paged_attention",
]


def __dir__() -> list[str]:
    """The public names only (not the modules and helpers this module imports)."""
    return sorted(__all__)


def _check_storage(dtype: Any, device: str) -> None:
    """Raises now, rather than at the first forward, for a dtype kvrs does not store
    (ValueError, TypeError) or a device it cannot store on (kvrs.DeviceError)."""
    kvrs.KVCache(1, 1, 1, 1, dtype=dtype or "float32", device=device)


def _check_same_device(tensor: torch.Tensor, device: str, what: str) -> None:
    """The model's tensors must live where the cache stores (no silent copies)."""
    if tensor.device.type == "meta":
        raise kvrs.DeviceError(
            f"the model runs on torch's meta device (shapes only, no weights): load its weights before "
            f"generating with a {what}"
        )
    if torch.device(tensor.device) != torch.device(device):
        raise kvrs.DeviceError(f"{what} stores on {device}; got key_states on {tensor.device}")


@contextmanager
def _naming(setting: Callable[[], str]) -> Iterator[None]:
    """Re-raises a CacheFullError from kvrs with `setting()`, the setting to raise, added."""
    try:
        yield
    except kvrs.CacheFullError as e:
        raise kvrs.CacheFullError(f"{e}: {setting()}") from e


class _CheckedLayers(Cache):
    """A transformers cache that refuses, by name, a model with more layers than it holds
    (transformers' own lookup would raise a bare IndexError)."""

    def _layer(self, layer_idx: int) -> None:
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"the model writes layer {layer_idx}, but this {type(self).__name__} holds "
                f"{len(self.layers)} layers: make it for the model with "
                f"{type(self).__name__}.from_config(model, ...)"
            )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._layer(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self._layer(layer_idx)
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ):
        self._layer(layer_idx)
        return super().update_recurrent_state(recurrent_states, layer_idx, *args, **kwargs)

    def get_conv_state(self, layer_idx: int, *args: Any, **kwargs: Any):
        self._layer(layer_idx)
        return super().get_conv_state(layer_idx, *args, **kwargs)


class KvrsLayer(CacheLayerMixin):
    """One model layer's keys and values in a [`KVCache`][kvrs.KVCache]."""

    is_sliding = False
    is_croppable = True

    def __init__(
        self,
        max_seq_len: int,
        dtype: str | None = None,
        device: str = "cpu",
        scales: tuple[Any, Any] = (None, None),
    ):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.storage_dtype = dtype
        self.storage_device = device
        self.scales = scales  # this layer's fp8 (k_scale, v_scale): floats or one per KV head
        self.cache: kvrs.KVCache | None = None
        self.batch = self.heads = self.head_dim = self.v_head_dim = 0
        self.in_place = False

    @property
    def store(self) -> kvrs.KVCache:
        """The layer's KVCache (allocated by the first update)."""
        if self.cache is None:
            raise RuntimeError("this cache layer has not seen any keys yet")
        return self.cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _check_same_device(key_states, self.storage_device, "KvrsCache")
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, head_dim = key_states.shape
        self._allocate(batch, heads, head_dim, value_states.shape[-1])
        self.is_initialized = True

    def _allocate(self, batch: int, heads: int, head_dim: int, v_head_dim: int) -> None:
        self.batch, self.heads, self.head_dim, self.v_head_dim = batch, heads, head_dim, v_head_dim
        dtype = self.storage_dtype or STORAGE_DTYPES.get(self.dtype, "float32")

        # The cache's heads are the batch's rows times the KV heads: per-head scales repeat.
        def tiled(x: Any) -> Any:
            if x is None or np.ndim(x) == 0:
                return x
            return np.tile(np.asarray(x, np.float32), batch)[None]  # [1, batch * heads]

        k_scale, v_scale = tiled(self.scales[0]), tiled(self.scales[1])
        self.cache = kvrs.KVCache(
            1,
            batch * heads,
            head_dim,
            self.max_seq_len,
            v_head_dim=v_head_dim,
            dtype=dtype,
            device=self.storage_device,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        """[batch, heads, q, head_dim] as kvrs's [q, batch * heads, head_dim] (a view)."""
        b, h, q, d = x.shape
        return x.detach().permute(2, 0, 1, 3).reshape(q, b * h, d)

    def _tensors(self, copy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V as [batch, heads, len, dim] tensors in the model's dtype:
        views of the cache (what attention reads), or with `copy`, tensors of their own."""
        dequantize = self.store.dtype in QUANTIZED_DTYPES
        keys, values = self.store.get(0, dequantize=dequantize, copy=copy and not dequantize)
        out = []
        for view, dim in ((keys, self.head_dim), (values, self.v_head_dim)):
            t = as_torch(view).view(self.batch, self.heads, view.shape[1], dim)
            out.append(t if t.dtype == self.dtype else t.to(self.dtype))
        return out[0], out[1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch or key_states.shape[1] != self.heads:
            raise ValueError(
                f"key_states has batch {key_states.shape[0]} x {key_states.shape[1]} heads; "
                f"this cache holds {self.batch} x {self.heads}"
            )
        with _naming(
            lambda: (
                f"this KvrsCache holds max_seq_len={self.max_seq_len} positions per layer; make it "
                "with a larger max_seq_len"
            )
        ):
            self.store.append(0, self._rows(key_states), self._rows(value_states))
        self.store.advance(key_states.shape[2])
        if self.in_place and self.store.dtype in QUANTIZED_DTYPES:
            # Attention reads the 8-bit blocks in place; dequantized copies of the whole
            # history would cost a pass over it at every step, so none is made.
            self.keys = self.values = None
        else:
            self.keys, self.values = self._tensors()
        if self.in_place:
            # The attention function reads the cache itself (see KvrsCache.attend_in_place).
            key_states._kvrs_source = self  # type: ignore[attr-defined]  # read by the attention function
            return key_states, value_states
        return self.keys, self.values

    def attend(
        self, layer: int, query: torch.Tensor, options: dict[str, Any], window: int | None
    ) -> torch.Tensor:
        """Attention of the newest tokens' `query` ([batch, heads, n, head_dim]) over this
        layer's cache, read in place; returns [batch, n, heads, head_dim]."""
        b, h, n, d = query.shape
        q = query.permute(2, 0, 1, 3).reshape(n, b * h, d)
        out = as_torch(self.store.attention(0, q, window=window, **options))
        return out.view(n, b, h, out.shape[-1]).transpose(0, 1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.seq_len if self.cache is not None else 0

    def get_max_length(self) -> int:
        return self.max_seq_len

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.clear()
        self.keys = self.values = None

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last `-tokens_to_remove` positions (transformers >= 5.15 semantics)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove")
        if tokens_to_remove == 0 or self.cache is None:
            return
        self.store.truncate(max(0, self.store.seq_len + tokens_to_remove))
        self.keys, self.values = self._tensors()

    def _rewrite(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replaces the content with `keys`, `values` ([batch, heads, len, head_dim]), which
        must not alias the cache (read them with ``_tensors(copy=True)``)."""
        self._allocate(keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
        if keys.shape[2]:
            self.store.append(0, self._rows(keys), self._rows(values))
            self.store.advance(keys.shape[2])
        self.keys, self.values = self._tensors()

    def __deepcopy__(self, memo: dict) -> KvrsLayer:
        """A copy with its own storage (for reusing a prompt cache across calls)."""
        copy = KvrsLayer(self.max_seq_len, self.storage_dtype, self.storage_device, self.scales)
        if self.is_initialized:
            copy.dtype, copy.device, copy.is_initialized = self.dtype, self.device, True
            copy._rewrite(*self._tensors(copy=True))
        return copy

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            keys, values = self._tensors()
            idx = beam_idx.to(keys.device)
            self._rewrite(keys.index_select(0, idx), values.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.cache is not None:
            keys, values = self._tensors()
            self._rewrite(keys.repeat_interleave(repeats, dim=0), values.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.cache is not None:
            keys, values = self._tensors()
            self._rewrite(keys[indices], values[indices])


def _per_layer(scale: Any, name: str, num_layers: int) -> list[Any]:
    """`scale` (None, a float, one per layer, or [num_layers, num_kv_heads]) as one entry
    per layer: None, a float, or that layer's per-head scales."""
    if scale is None:
        return [None] * num_layers
    arr = np.asarray(scale, np.float32)
    if arr.ndim == 0:
        return [float(arr)] * num_layers
    if arr.ndim > 2 or arr.shape[0] != num_layers:
        raise ValueError(
            f"{name} has shape {list(arr.shape)}: give a float, [{num_layers}] (per layer) or "
            f"[{num_layers}, num_kv_heads]"
        )
    return [arr[i] if arr.ndim == 2 else float(arr[i]) for i in range(num_layers)]


class KvrsCache(_CheckedLayers):
    """A ``transformers`` cache whose keys and values live in kvrs (one KVCache per layer).

    Every layer stores all ``max_seq_len`` positions, sliding-window layers included (the
    model's mask restricts what they see); [`KvrsPagedCache`][kvrs.integrations.transformers.KvrsPagedCache]
    releases what windows
    no longer see. Under [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention] the model
    attends over the cache in
    place (``attend_in_place``, set for each forward)."""

    @property
    def attend_in_place(self) -> bool:
        """Whether `update` leaves attention to kvrs (set by
        [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention]'s
        hook for each forward of an unpadded batch)."""
        return any(getattr(layer, "in_place", False) for layer in self.layers)

    @attend_in_place.setter
    def attend_in_place(self, value: bool) -> None:
        for layer in self.layers:
            if isinstance(layer, KvrsLayer):
                layer.in_place = value

    def __init__(
        self,
        num_layers: int,
        max_seq_len: int,
        dtype: Any = None,
        device: Any = "cpu",
        *,
        k_scale: Any = None,
        v_scale: Any = None,
        linear_layers: Any = (),
    ):
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len={max_seq_len}: must be >= 1")
        dtype, device = resolve_dtype(dtype, None), str(device)
        _check_storage(dtype, device)
        k, v = _per_layer(k_scale, "k_scale", num_layers), _per_layer(v_scale, "v_scale", num_layers)
        linear = set(linear_layers)
        if any(not 0 <= i < num_layers for i in linear):
            raise IndexError(f"linear_layers={sorted(linear)}: each must lie in [0, {num_layers})")
        # A hybrid model's linear layers keep their fixed-size state in transformers' own
        # layer (a few tensors per layer); K/V of the attention layers live in kvrs.
        layers: list[Any] = [
            LinearAttentionLayer() if i in linear else KvrsLayer(max_seq_len, dtype, device, (k[i], v[i]))
            for i in range(num_layers)
        ]
        super().__init__(layers=layers)

    @classmethod
    def from_config(
        cls,
        model_or_config: Any,
        max_seq_len: int,
        dtype: Any = "auto",
        device: Any = None,
        *,
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> KvrsCache:
        """A cache for a transformers model or its config (its `num_hidden_layers`),
        `max_seq_len` positions per layer, stored in `dtype` on `device`. `dtype` is 'auto'
        (the model's: its parameters' dtype, or for a config the dtype of the K/V the
        first forward writes), 'float32', 'float16', 'bfloat16' (or the torch dtype), or
        8-bit 'fp8_e4m3', 'fp8_e5m2', 'int8'. `device` None is the model's (the host for a
        config). fp8 takes a checkpoint's `k_scale` and `v_scale`: a float, one per layer,
        or [num_layers, num_kv_heads] (see
        [`calibrate_kv_scales`][kvrs.integrations.transformers.calibrate_kv_scales])."""
        config, m_dtype, m_device = model_parts(model_or_config)
        layers = text_config(config).num_hidden_layers
        dtype = resolve_dtype(dtype, m_dtype if isinstance(model_or_config, torch.nn.Module) else None)
        device = resolve_device(device, m_device)
        linear = layer_plan(config, with_shapes=False).state_of  # transformers' layers hold them
        return cls(layers, max_seq_len, dtype, device, k_scale=k_scale, v_scale=v_scale, linear_layers=linear)


class KvrsPagedLayer(CacheLayerMixin):
    """One model layer of a [`KvrsPagedCache`][kvrs.integrations.transformers.KvrsPagedCache]: its keys and
    values live in the
    cache's pool, in the sequences of the batch rows."""

    is_croppable = True

    def __init__(self, owner: KvrsPagedCache, layer: int):
        super().__init__()
        self.owner, self.layer = owner, layer
        self.is_sliding = owner.pool.layer_types[layer] != "full"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _check_same_device(key_states, self.owner.pool.device, "KvrsPagedCache")
        pool = self.owner.pool
        want = (pool.num_kv_heads, pool.head_dim, pool.v_head_dim)
        got = (key_states.shape[1], key_states.shape[-1], value_states.shape[-1])
        if got != want:
            raise ValueError(
                f"this pool does not match the model: the model writes {got[0]} KV heads of {got[1]} "
                f"(values {got[2]}), the pool holds {want[0]} of {want[1]} (values {want[2]}); make the "
                "cache with KvrsPagedCache.from_config(model, ...) or the pool with "
                "block_pool_from_config(model)"
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.owner.attend_in_place:
            # The attention function reads the pool itself: nothing is gathered.
            self.owner.write(self.layer, key_states, value_states, None)
            key_states._kvrs_source = self.owner  # type: ignore[attr-defined]  # read by the attention function
            return key_states, value_states
        self.keys, self.values = self.owner.write(self.layer, key_states, value_states, self.dtype)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The keys `update` returns: from the first position this layer holds (past a
        sliding window's released blocks) through the new tokens."""
        start = self.owner.layer_start(self.layer)
        return self.get_seq_length() - start + query_length, start

    def get_seq_length(self) -> int:
        return self.owner.seq_len()

    def get_max_length(self) -> int:
        return -1


class KvrsStateLayer(LinearAttentionCacheLayerMixin):
    """One linear-attention or Mamba layer of a
    [`KvrsPagedCache`][kvrs.integrations.transformers.KvrsPagedCache]: its convolution
    window and recurrent state live in the pool's state slots of the batch rows, updated
    in place as transformers' ``LinearAttentionLayer`` updates its own tensors."""

    def __init__(self, owner: KvrsPagedCache, index: int):
        self.owner, self.index = owner, index
        self.number_of_states = 1
        self.written = False  # whether the rows' states hold the tokens seen so far
        self.record_past = False
        self.device: Any = None
        self.dtype: Any = None
        shape = owner.pool.state_shapes["conv"][0]
        self.conv_kernel_size = {0: shape[-1]}

    @property
    def has_previous_state(self) -> dict[int, bool]:  # type: ignore[override]  # read-only here
        return {0: self.written}

    @property
    def conv_states(self) -> dict[int, torch.Tensor | None]:  # type: ignore[override]
        return {0: self.owner.state_view(self.index, "conv") if self.owner.rows else None}

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor | None]:  # type: ignore[override]
        return {0: self.owner.state_view(self.index, "recurrent") if self.owner.rows else None}

    @property
    def is_conv_states_initialized(self) -> dict[int, bool]:  # type: ignore[override]
        return {0: self.written}

    @property
    def is_recurrent_states_initialized(self) -> dict[int, bool]:  # type: ignore[override]
        return {0: self.written}

    def lazy_initialization(
        self, conv_states: Any = None, recurrent_states: Any = None, state_idx: int = 0, **kwargs: Any
    ) -> None:
        """Nothing to allocate: the pool holds the states."""

    def _views(self, states: torch.Tensor, name: str) -> torch.Tensor:
        self.owner.ensure_rows(states.shape[0], f"the {name} state")
        if self.device is None:
            self.dtype, self.device = states.dtype, states.device
        view = self.owner.state_view(self.index, name)
        hybrid.check_state(name, view, states, self.index)
        return view

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        _check_state_index(state_idx)
        view = self._views(conv_states, "conv")
        full = hybrid.conv_window(view, conv_states, self.written, view.shape[-1])
        self.written = True
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any):
        _check_state_index(state_idx)
        view = self._views(recurrent_states, "recurrent")
        view.copy_(recurrent_states)
        self.written = True
        return view

    def activate_past_recording(self) -> None:
        """From now on the owner keeps what a crop needs to roll this layer's state back
        (see `KvrsPagedCache.crop`)."""
        self.record_past = True

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return not self.written or self.record_past

    def reset(self) -> None:
        self.written = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """The owner reorders the rows (forks copy their states)."""

    def crop(self, tokens_to_remove: int) -> None:
        """The owner crops (restoring and replaying the states it recorded)."""


def _check_state_index(state_idx: int) -> None:
    if state_idx != 0:
        raise kvrs.NotSupportedError(
            f"state_idx={state_idx}: kvrs keeps one conv and one recurrent state per layer"
        )


@dataclass
class _StateRecord:
    """One linear layer of a [`KvrsPagedCache`][kvrs.integrations.transformers.KvrsPagedCache] since its last
    crop: its states
    before (None: it held none), and its inputs since, with its forward's arguments."""

    own: Any
    saved: dict[str, torch.Tensor] | None
    inputs: list[torch.Tensor]
    args: tuple
    kwargs: dict[str, Any]


class KvrsPagedCache(_CheckedLayers):
    """A ``transformers`` cache whose keys and values live in a [`BlockPool`][kvrs.BlockPool],
    one pool sequence per batch row.

    Blocks are allocated as sequences grow; sliding-window layers release the blocks their
    window has left. Beam search reorders rows by forking sequences (blocks are shared,
    copied on write), and ``copy.deepcopy`` forks every row, so a reused prompt cache
    shares its blocks. Under [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention] each
    layer attends over the
    pool's blocks in place (``attend_in_place``, set for each forward); otherwise the
    attended K/V are gathered from the blocks at every step (one copy per layer and step).
    """

    def __init__(self, pool: kvrs.BlockPool, plan: LayerPlan | None = None):
        self.pool = pool
        self.attend_in_place = False
        # How the pool was sized (from_config records its settings), for CacheFullError.
        self.sizing: dict[str, Any] = {}
        self.rows: list[kvrs.Sequence] = []
        if plan is None:
            plan = LayerPlan({i: i for i in range(pool.num_layers)}, {}, list(pool.layer_types))
        if len(plan.kv_of) != pool.num_layers or len(plan.state_of) != pool.state_layers:
            raise ValueError(
                f"the model has {len(plan.kv_of)} attention and {len(plan.state_of)} linear layers; "
                f"the pool holds {pool.num_layers} K/V and {pool.state_layers} state layers"
            )
        self.plan = plan
        self.paged_layers = [KvrsPagedLayer(self, kv) for kv in plan.kv_of.values()]
        self.state_layers = [KvrsStateLayer(self, j) for j in plan.state_of.values()]
        # The rows' states of each state layer, as [batch, ...] torch views (the rows'
        # slots are consecutive: see _rows_changed).
        self._state_views: dict[int, dict[str, torch.Tensor]] = {}
        self._state_first: int | None = None  # the rows' first slot
        # While recording past states (assisted decoding): the positions written but not
        # committed yet, and per state layer the states before them with the layer's
        # inputs since (see crop).
        self._pending = 0
        self._records: dict[int, _StateRecord] = {}
        self._replaying = False
        layers: list[Any] = [None] * plan.num_layers
        for i, kv in plan.kv_of.items():
            layers[i] = self.paged_layers[kv]
        for i, j in plan.state_of.items():
            layers[i] = self.state_layers[j]
        super().__init__(layers=layers)

    @classmethod
    def from_config(
        cls,
        model_or_config: Any,
        *,
        max_seq_len: int | None = None,
        max_batch_size: int = 1,
        max_prompt_len: int | None = None,
        num_blocks: int | None = None,
        memory_bytes: int | str | None = None,
        block_size: int = 16,
        dtype: Any = "auto",
        device: Any = None,
        swa_memory: int = 0,
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> KvrsPagedCache:
        """A cache with a new pool shaped for a transformers model or its config (its layer
        types included; a hybrid model's linear layers as state layers with
        `max_batch_size` state slots).

        Its size: room for `max_batch_size` rows of `max_seq_len` positions, counted per
        block table ([`blocks_per_sequence`][kvrs.blocks_per_sequence]): a full-attention table needs every
        block of `max_seq_len`, a sliding-window or chunked table only its window plus
        what one forward pass adds, at most `max_prompt_len` tokens (the longest prompt
        ``generate()`` prefills at once; default `max_seq_len`). Or exactly `num_blocks`
        blocks or `memory_bytes` bytes; given beside `max_seq_len`, the pool must hold
        those rows (ValueError otherwise). `dtype` and `device` as for
        [`block_pool_from_config`][kvrs.integrations.transformers.block_pool_from_config] ('auto' and None:
        the model's; 8-bit dtypes as for
        [`KvrsCache`][kvrs.integrations.transformers.KvrsCache], with fp8 `k_scale` / `v_scale`). `swa_memory`
        positions are
        kept beyond sliding windows so that `crop` (assisted decoding) can roll back that
        far from the longest length reached.

        A write the pool has no room for raises ``kvrs.CacheFullError`` naming the
        setting to raise."""
        if num_blocks is not None and memory_bytes is not None:
            raise ValueError("give num_blocks or memory_bytes, not both")
        if max_seq_len is None and num_blocks is None and memory_bytes is None:
            raise ValueError("give max_seq_len (with max_batch_size), num_blocks or memory_bytes")
        if max_prompt_len is not None and max_seq_len is None:
            raise ValueError(f"max_prompt_len={max_prompt_len} needs max_seq_len beside it")
        for name, value in (
            ("max_seq_len", max_seq_len),
            ("max_batch_size", max_batch_size),
            ("max_prompt_len", max_prompt_len),
            ("block_size", block_size),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        config = model_parts(model_or_config)[0]
        plan = layer_plan(config)
        need = None
        if max_seq_len is not None:
            per_row = kvrs.blocks_per_sequence(
                max_seq_len,
                block_size=block_size,
                max_chunk=min(max_prompt_len or max_seq_len, max_seq_len),
                swa_memory=swa_memory,
                **_attention_layout(config),
            )
            need = max_batch_size * per_row
        slots = {"state_slots": max_batch_size} if plan.is_hybrid else {}
        pool = block_pool_from_config(
            model_or_config,
            num_blocks=need if num_blocks is None and memory_bytes is None else num_blocks,
            memory_bytes=memory_bytes,
            block_size=block_size,
            dtype=dtype,
            device=device,
            swa_memory=swa_memory,
            prefix_caching=False,
            k_scale=k_scale,
            v_scale=v_scale,
            **slots,
        )
        sizing: dict[str, Any] = {"max_seq_len": max_seq_len, "max_batch_size": max_batch_size}
        if max_prompt_len is not None:
            sizing["max_prompt_len"] = max_prompt_len
        given = (
            "num_blocks" if num_blocks is not None else "memory_bytes" if memory_bytes is not None else None
        )
        if given is not None:
            sizing[given] = num_blocks if num_blocks is not None else memory_bytes
            if need is not None and pool.num_blocks < need:
                raise ValueError(
                    f"{given}={sizing[given]} makes {pool.num_blocks} blocks; max_batch_size="
                    f"{max_batch_size} rows of max_seq_len={max_seq_len} need {need} "
                    "(see kvrs.blocks_per_sequence)"
                )
        cache = cls(pool, plan)
        cache.sizing = {k: v for k, v in sizing.items() if v is not None}
        return cache

    def _full(self, new_tokens: int = 0, rows: int | None = None) -> str:
        """What to raise when the pool has no room, for a CacheFullError: the setting
        this cache's size came from that the rows' use has passed."""
        made = ", ".join(f"{k}={v}" for k, v in self.sizing.items())
        if not self.sizing:
            return (
                f"this KvrsPagedCache's pool has {self.pool.num_blocks} blocks: give it a larger pool "
                "(block_pool_from_config(model, num_blocks=...)) or use fewer rows"
            )
        rows = len(self.rows) if rows is None else rows
        end = self.seq_len() + new_tokens
        for name, used in (("max_seq_len", end), ("max_batch_size", rows), ("max_prompt_len", new_tokens)):
            limit = self.sizing.get(name)
            if limit is not None and used > limit:
                return f"the cache was made with {made}; this needs {name}={used}: raise {name}"
        setting = "num_blocks" if "memory_bytes" not in self.sizing else "memory_bytes"
        return (
            f"the cache was made with {made} ({self.pool.num_blocks} blocks); forks (beam search) or "
            f"other holders need more: raise {setting} or max_batch_size"
        )

    def seq_len(self) -> int:
        """Positions held (the same for every row): committed, and those a hybrid model
        wrote since the last crop while recording past states."""
        return self.rows[0].seq_len + self._pending if self.rows else 0

    @property
    def rolls_back_states(self) -> bool:
        """Whether a crop can roll the model's recurrent states back: a cache of a
        hybrid model recording past states (transformers' assisted generation turns it
        on) whose linear layers run under
        [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention]."""
        return bool(self.state_layers) and self._recording()

    def _recording(self) -> bool:
        return any(layer.record_past for layer in self.state_layers)

    def record_mixer(
        self, module: torch.nn.Module, own: Any, hidden: torch.Tensor, args: tuple, kwargs: dict[str, Any]
    ) -> None:
        """Called by a linear layer switched by
        [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention] before it
        runs on this cache: while recording past states, the first call since the last
        crop copies the layer's states, and every call keeps its inputs, so that
        `crop` can restore the states and replay the tokens it keeps."""
        if self._replaying or not self._recording():
            return
        j = self.plan.state_of[int(module.layer_idx)]  # type: ignore[arg-type]  # an int on every mixer
        record = self._records.get(j)
        if record is None:
            saved = None
            if self.rows and self.state_layers[j].written:
                saved = {name: self.state_view(j, name).clone() for name in ("conv", "recurrent")}
            record = self._records[j] = _StateRecord(own, saved, [], args, kwargs)
        record.inputs.append(hidden.detach())

    def _roll_back_states(self, keep: int) -> None:
        """Every state layer back to its state before the recorded tokens, then over the
        first `keep` of them again."""
        self._replaying = True
        try:
            for j, record in self._records.items():
                layer = self.state_layers[j]
                if record.saved is None:
                    layer.written = False
                else:
                    for name, saved in record.saved.items():
                        self.state_view(j, name).copy_(saved)
                    layer.written = True
                if keep > 0:
                    hidden = torch.cat(record.inputs, dim=1)[:, :keep]
                    kwargs = {
                        k: v for k, v in record.kwargs.items() if k not in ("cache_params", "attention_mask")
                    }
                    record.own(hidden, *record.args, cache_params=self, attention_mask=None, **kwargs)
        finally:
            self._replaying = False

    def layer_start(self, layer: int) -> int:
        """The first position `layer` holds (the same for every row)."""
        return self.rows[0].layer_start(layer) if self.rows else 0

    def write(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, dtype: torch.dtype | None
    ):
        """Appends one layer's new K/V for every row; returns the layer's held K/V as
        [batch, heads, len, head_dim] in `dtype` (None: gathers nothing, returns None).
        The last layer commits the step."""
        batch, _, q, _ = key_states.shape
        self.ensure_rows(batch, "key_states")
        keys, values = [], []
        for row, seq in enumerate(self.rows):
            with _naming(lambda: self._full(q)):
                seq.append(
                    layer,
                    key_states[row].detach().transpose(0, 1),
                    value_states[row].detach().transpose(0, 1),
                )
            if dtype is not None:
                k, v = seq.get(layer, dequantize=self.pool.dtype in QUANTIZED_DTYPES)
                keys.append(as_torch(k))
                values.append(as_torch(v))
        if layer == self.pool.num_layers - 1:
            if self.state_layers and self._recording():
                self._pending += q  # committed by the next crop, which may reject some
            else:
                for seq in self.rows:
                    seq.advance(q)
        if dtype is None:
            return None
        return torch.stack(keys).to(dtype), torch.stack(values).to(dtype)

    def ensure_rows(self, batch: int, what: str) -> None:
        """Starts one pool sequence per batch row on the first write of any layer."""
        if not self.rows:
            rows: list[kvrs.Sequence] = []
            try:
                with _naming(lambda: self._full(0, batch)):
                    for _ in range(batch):
                        rows.append(self.pool.new_sequence())
                self.rows = rows
                self._rows_changed()
            except BaseException:
                for seq in rows:
                    seq.free()
                self.rows = []
                raise
        if batch != len(self.rows):
            raise ValueError(f"{what} has batch {batch}; this cache holds {len(self.rows)} rows")

    def _rows_changed(self) -> None:
        """After the rows changed: their state slots are made consecutive, so that each
        state layer's states of the batch are one [batch, ...] view."""
        self._state_views = {}
        self._state_first = None
        if self.state_layers and self.rows:
            with _naming(self._full):
                self._state_first = self.pool.pack_states(self.rows)

    def state_view(self, layer: int, name: str) -> torch.Tensor:
        """State `name` of state layer `layer` for every row: [batch, *dims], in place."""
        views = self._state_views.get(layer)
        if views is None:
            if self._state_first is None:
                self._rows_changed()  # an earlier packing failed: again (CacheFullError)
            first, n = self._state_first, len(self.rows)
            if first is None or [seq.state_slot for seq in self.rows] != list(range(first, first + n)):
                # Never a view over slots the rows do not hold (another sequence's state).
                raise RuntimeError(
                    f"the cache's {n} rows do not hold the consecutive state slots from {first}"
                )
            views = {k: as_torch(v)[first : first + n] for k, v in self.pool.state_cache(layer).items()}
            self._state_views[layer] = views
        return views[name]

    def attend(
        self, layer: int, query: torch.Tensor, options: dict[str, Any], window: int | None = None
    ) -> torch.Tensor:
        """Attention of the newest tokens' `query` ([batch, heads, n, head_dim]) over each
        row's blocks of model layer `layer`, read in place (the pool applies the layer's
        window); returns [batch, n, heads, head_dim]."""
        layer = self.plan.kv_of[layer]
        rows = [
            as_torch(seq.attention(layer, query[i].transpose(0, 1), **options))
            for i, seq in enumerate(self.rows)
        ]
        return torch.stack(rows)

    def _replace_rows(self, sources: list[int]) -> None:
        """Rows become the current rows at `sources`: a row's first use keeps it, a
        repeat forks it (blocks shared, no copy; states copied), rows no source names are
        freed first, so a reorder needs no more sequences (or state slots) than it keeps."""
        used = set(sources)
        for i, seq in enumerate(self.rows):
            if i not in used:
                seq.free()
        new: list[kvrs.Sequence] = []
        forks: list[kvrs.Sequence] = []
        kept: set[int] = set()
        try:
            for i in sources:
                if i in kept:
                    with _naming(lambda: self._full(0, len(sources))):
                        forks.append(self.rows[i].fork())
                    new.append(forks[-1])
                else:
                    kept.add(i)
                    new.append(self.rows[i])
        except BaseException:
            for seq in forks:
                seq.free()
            self.rows = [self.rows[i] for i in sorted(used)]
            self._rows_changed()
            raise
        self.rows = new
        self._rows_changed()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.rows:
            self._replace_rows([int(i) for i in beam_idx])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows:
            self._replace_rows([i for i in range(len(self.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.rows:
            self._replace_rows([int(i) for i in torch.as_tensor(indices).flatten()])

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last `-tokens_to_remove` positions (transformers >= 5.15 semantics).
        Sliding-window layers must still hold what the next token sees: the pool keeps
        `swa_memory` positions beyond the window of the longest length reached (released
        blocks do not come back), so a crop to that length minus `swa_memory` or later
        always succeeds.

        A hybrid model's recurrent states hold every token, so they are rolled back
        only while recording past states (``activate_past_recording``, which
        transformers' assisted generation calls) with the model switched by
        [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention]: the tokens written since
        the last crop stay
        uncommitted, each linear layer's states before them are copied and its inputs
        kept, and a crop restores the copies and replays the kept tokens (the pool never
        holds a rejected token's K/V or state). ``crop(0)`` commits them."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove")
        if not self.rows:
            return
        n = max(0, self.seq_len() + tokens_to_remove)
        committed = self.rows[0].seq_len
        if any(layer.written for layer in self.state_layers) and n < self.seq_len():
            recorded = min((sum(x.shape[1] for x in r.inputs) for r in self._records.values()), default=0)
            if len(self._records) < len(self.state_layers) or self.seq_len() - n > recorded:
                raise ValueError(
                    f"crop({tokens_to_remove}): the model's linear layers keep a recurrent state of every "
                    f"token, which cannot be rolled back past the tokens written since the cache's last crop "
                    f"while recording past states ({recorded}): call activate_past_recording() before "
                    "the forward (assisted generation does), with the model switched by "
                    "use_paged_attention(model)"
                )
        elif n < committed and not all(seq.can_resume(n) for seq in self.rows):
            raise ValueError(
                f"crop({tokens_to_remove}): the sliding-window layers released positions that "
                f"position {n} sees; a crop may go back swa_memory={self.pool.swa_memory} positions "
                "from the longest length the cache reached: make the cache with a larger swa_memory"
            )
        if self._records and n < self.seq_len():
            self._roll_back_states(
                n - (self.seq_len() - sum(x.shape[1] for x in next(iter(self._records.values())).inputs))
            )
        for seq in self.rows:
            if n >= committed:
                if n > committed:
                    seq.advance(n - committed)
                if self._pending and n < committed + self._pending:
                    seq.set_seq_len(n)  # drops the rejected positions: n is committed, no state restored
            else:
                seq.truncate(n)
        self._pending = 0
        self._records = {}

    def reset(self) -> None:
        for seq in self.rows:
            seq.free()
        self.rows = []
        self._pending = 0
        self._records = {}
        self._state_views = {}
        for layer in self.state_layers:
            layer.written = False

    def __deepcopy__(self, memo: dict) -> KvrsPagedCache:
        """A cache on the same pool whose rows are forks of these (blocks shared, states
        copied)."""
        if self._pending:
            raise ValueError(
                f"this cache holds {self._pending} positions written since its last crop while "
                "recording past states (assisted decoding): crop first (crop(0) keeps them all)"
            )
        copy = KvrsPagedCache(self.pool, self.plan)
        copy.rows = [seq.fork() for seq in self.rows]
        copy._rows_changed()
        for mine, theirs in zip(copy.paged_layers, self.paged_layers, strict=True):
            if theirs.is_initialized:
                mine.dtype, mine.device, mine.is_initialized = theirs.dtype, theirs.device, True
        for s_mine, s_theirs in zip(copy.state_layers, self.state_layers, strict=True):
            s_mine.written = s_theirs.written
        return copy
