"""A Hugging Face ``transformers`` cache backed by kvrs.

``KvrsCache`` subclasses ``transformers.Cache`` with one :class:`KvrsLayer` per model
layer. Each layer keeps its keys and values in a :class:`kvrs.KVCache` allocated once, on
first use, for the batch it sees: ``batch * num_kv_heads`` heads of ``max_seq_len``
positions, so the tensors handed back to the model are zero-copy views of kvrs's memory
(``[batch, heads, seq_len, head_dim]``), cast to the model's dtype only when the storage
dtype differs. Works with ``model.generate(..., past_key_values=cache)`` and with manual
forward loops (greedy, sampling, beam search, cropping).

Needs ``torch`` and ``transformers`` (5.x); importing this module without them raises an
``ImportError`` that says what to install.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

import kvrs

try:
    import torch
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:  # pragma: no cover - exercised in environments without torch
    raise ImportError(
        "kvrs.integrations.transformers needs torch and transformers: pip install torch transformers"
    ) from e

_STORAGE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _as_torch(view: np.ndarray) -> torch.Tensor:
    """A torch tensor over a kvrs view, without a copy."""
    if view.dtype.name == "bfloat16":
        # NumPy cannot export bfloat16 through DLPack: reinterpret its bits.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the view is read-only; torch only reads it
            return torch.from_numpy(view.view(np.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(view)


class KvrsLayer(CacheLayerMixin):
    """One model layer's keys and values in a :class:`kvrs.KVCache`."""

    is_sliding = False
    is_croppable = True

    def __init__(self, max_seq_len: int, dtype: str | None = None):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.storage_dtype = dtype
        self.cache: kvrs.KVCache | None = None
        self.batch = self.heads = self.head_dim = 0

    @property
    def store(self) -> kvrs.KVCache:
        """The layer's KVCache (allocated by the first update)."""
        if self.cache is None:
            raise RuntimeError("this cache layer has not seen any keys yet")
        return self.cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.device.type != "cpu":
            raise kvrs.DeviceError(
                f"KvrsCache keeps its storage on the host for now; got tensors on {self.device}"
            )
        batch, heads, _, head_dim = key_states.shape
        self._allocate(batch, heads, head_dim)
        self.is_initialized = True

    def _allocate(self, batch: int, heads: int, head_dim: int) -> None:
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        dtype = self.storage_dtype or _STORAGE_DTYPES.get(self.dtype, "float32")
        self.cache = kvrs.KVCache(1, batch * heads, head_dim, self.max_seq_len, dtype=dtype)

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        """[batch, heads, q, head_dim] as kvrs's [q, batch * heads, head_dim] (a view)."""
        b, h, q, d = x.shape
        return x.detach().permute(2, 0, 1, 3).reshape(q, b * h, d)

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.store.get(0)
        out = []
        for view in (keys, values):
            t = _as_torch(view).view(self.batch, self.heads, view.shape[1], self.head_dim)
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
        self.store.append(0, self._rows(key_states), self._rows(value_states))
        self.store.advance(key_states.shape[2])
        self.keys, self.values = self._tensors()
        return self.keys, self.values

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
        """Replaces the content with `keys`, `values` ([batch, heads, len, head_dim])."""
        keys, values = keys.contiguous(), values.contiguous()  # copies: the sources alias the cache
        self._allocate(keys.shape[0], keys.shape[1], keys.shape[3])
        if keys.shape[2]:
            self.store.append(0, self._rows(keys), self._rows(values))
            self.store.advance(keys.shape[2])
        self.keys, self.values = self._tensors()

    def __deepcopy__(self, memo: dict) -> KvrsLayer:
        """A copy with its own storage (for reusing a prompt cache across calls)."""
        copy = KvrsLayer(self.max_seq_len, self.storage_dtype)
        if self.is_initialized:
            copy.dtype, copy.device, copy.is_initialized = self.dtype, self.device, True
            copy._rewrite(*self._tensors())
        return copy

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            keys, values = self._tensors()
            self._rewrite(keys.index_select(0, beam_idx.cpu()), values.index_select(0, beam_idx.cpu()))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.cache is not None:
            keys, values = self._tensors()
            self._rewrite(keys.repeat_interleave(repeats, dim=0), values.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.cache is not None:
            keys, values = self._tensors()
            self._rewrite(keys[indices], values[indices])


class KvrsCache(Cache):
    """A ``transformers`` cache whose keys and values live in kvrs (one KVCache per layer)."""

    def __init__(self, num_layers: int, max_seq_len: int, dtype: str | None = None):
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len={max_seq_len}: must be >= 1")
        super().__init__(layers=[KvrsLayer(max_seq_len, dtype) for _ in range(num_layers)])

    @classmethod
    def from_config(cls, config: Any, max_seq_len: int, dtype: str | None = None) -> KvrsCache:
        """A cache for a model config (its `num_hidden_layers`), `max_seq_len` positions per layer,
        stored in `dtype` ('float32', 'float16', 'bfloat16'; default: the model's dtype)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(text.num_hidden_layers, max_seq_len, dtype)


class KvrsPagedLayer(CacheLayerMixin):
    """One model layer of a :class:`KvrsPagedCache`: its keys and values live in the
    cache's pool, in the sequences of the batch rows."""

    is_sliding = False
    is_croppable = True

    def __init__(self, owner: KvrsPagedCache, layer: int):
        super().__init__()
        self.owner, self.layer = owner, layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.device.type != "cpu":
            raise kvrs.DeviceError(
                f"KvrsPagedCache keeps its storage on the host for now; got tensors on {self.device}"
            )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.owner.write(self.layer, key_states, value_states, self.dtype)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.seq_len()

    def get_max_length(self) -> int:
        return -1


class KvrsPagedCache(Cache):
    """A ``transformers`` cache whose keys and values live in a :class:`kvrs.BlockPool`,
    one pool sequence per batch row.

    Blocks are allocated as sequences grow. Beam search reorders rows by forking
    sequences (blocks are shared, copied on write), and ``copy.deepcopy`` forks every
    row, so a reused prompt cache shares its blocks. The attended K/V are gathered from
    the pool's blocks at every step (one copy per layer and step).
    """

    def __init__(self, pool: kvrs.BlockPool):
        self.pool = pool
        self.rows: list[kvrs.Sequence] = []
        self.paged_layers = [KvrsPagedLayer(self, i) for i in range(pool.num_layers)]
        super().__init__(layers=list(self.paged_layers))

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        num_blocks: int | None = None,
        memory_bytes: int | str | None = None,
        block_size: int = 16,
        dtype: str = "float32",
    ) -> KvrsPagedCache:
        """A cache with a new pool sized for the model config (give `num_blocks` or `memory_bytes`)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        pool = kvrs.BlockPool(
            text.num_hidden_layers,
            heads,
            head_dim,
            block_size=block_size,
            num_blocks=num_blocks,
            memory_bytes=memory_bytes,
            dtype=dtype,
        )
        return cls(pool)

    def seq_len(self) -> int:
        """Committed positions (the same for every row)."""
        return self.rows[0].seq_len if self.rows else 0

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, dtype: torch.dtype):
        """Appends one layer's new K/V for every row; returns the layer's whole K/V as
        [batch, heads, len, head_dim]. The last layer commits the step."""
        batch, _, q, _ = key_states.shape
        if not self.rows:
            self.rows = [self.pool.new_sequence() for _ in range(batch)]
        if batch != len(self.rows):
            raise ValueError(f"key_states has batch {batch}; this cache holds {len(self.rows)} rows")
        keys, values = [], []
        for row, seq in enumerate(self.rows):
            seq.append(
                layer, key_states[row].detach().transpose(0, 1), value_states[row].detach().transpose(0, 1)
            )
            k, v = seq.get(layer)
            keys.append(_as_torch(k))
            values.append(_as_torch(v))
        if layer == self.pool.num_layers - 1:
            for seq in self.rows:
                seq.advance(q)
        return torch.stack(keys).to(dtype), torch.stack(values).to(dtype)

    def _replace_rows(self, sources: list[int]) -> None:
        """Rows become forks of the current rows at `sources` (blocks shared, no copy)."""
        new = [self.rows[i].fork() for i in sources]
        for seq in self.rows:
            seq.free()
        self.rows = new

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
        """Removes the last `-tokens_to_remove` positions (transformers >= 5.15 semantics)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove")
        for seq in self.rows:
            seq.truncate(max(0, seq.seq_len + tokens_to_remove))

    def reset(self) -> None:
        for seq in self.rows:
            seq.free()
        self.rows = []

    def __deepcopy__(self, memo: dict) -> KvrsPagedCache:
        """A cache on the same pool whose rows are forks of these (blocks shared)."""
        copy = KvrsPagedCache(self.pool)
        copy.rows = [seq.fork() for seq in self.rows]
        for mine, theirs in zip(copy.paged_layers, self.paged_layers, strict=True):
            if theirs.is_initialized:
                mine.dtype, mine.device, mine.is_initialized = theirs.dtype, theirs.device, True
        return copy
