"""Type stubs for the compiled core, kvrs._kvrs (checked by mypy.stubtest in `make test`)."""

from typing import Any, final

import numpy as np
import numpy.typing as npt

__all__ = ["CacheFullError", "DeviceError", "KVCache", "KvrsError", "NotSupportedError", "__version__"]

__version__: str

_DTypeLike = str | np.dtype[Any] | type | Any
"""'float32' | 'float16' | 'bfloat16' (or 'fp32', 'fp16', 'half', 'bf16'), a NumPy dtype, or a torch dtype."""

_ArrayLike = npt.NDArray[Any] | Any
"""A NumPy array, anything with ``__dlpack__`` (a torch CPU tensor), or anything with the buffer protocol."""

class KvrsError(Exception):
    """Base class of every kvrs-specific error."""

class CacheFullError(KvrsError):
    """The cache (or pool) has no room for what was asked."""

class NotSupportedError(KvrsError):
    """The operation is valid but not supported in this configuration."""

class DeviceError(KvrsError):
    """A device is unknown, unavailable or unusable."""

@final
class KVCache:
    """A contiguous KV cache for one sequence, preallocated for ``max_seq_len`` positions."""

    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        *,
        dtype: _DTypeLike = "float16",
        device: str | Any = "cpu",
    ) -> KVCache: ...
    @property
    def seq_len(self) -> int:
        """Committed length."""
    @property
    def max_seq_len(self) -> int:
        """Positions each layer can hold."""
    @property
    def num_layers(self) -> int:
        """Number of layers."""
    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer."""
    @property
    def head_dim(self) -> int:
        """Elements per head vector."""
    @property
    def dtype(self) -> str:
        """Storage dtype name: 'float32', 'float16' or 'bfloat16'."""
    @property
    def device(self) -> str:
        """Device name: 'cpu' (or 'cuda:N')."""
    def layer_len(self, layer: int) -> int:
        """Positions written into `layer` (committed and appended)."""
    def store_key(self, layer: int, head: int, pos: int, key: _ArrayLike) -> None:
        """Writes one key vector of `head_dim` at (layer, head, pos); lengths do not move."""
    def store_value(self, layer: int, head: int, pos: int, value: _ArrayLike) -> None:
        """Writes one value vector of `head_dim` at (layer, head, pos); lengths do not move."""
    def append(self, layer: int, k: _ArrayLike, v: _ArrayLike) -> int:
        """Appends `k`, `v` of shape [n_tokens, num_kv_heads, head_dim]; returns the start position."""
    def advance(self, n: int = 1) -> None:
        """Commits `n` tokens: `seq_len += n`. Every layer must hold them already."""
    def get(self, layer: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Zero-copy read-only views (K, V) of shape [num_kv_heads, length, head_dim]."""
    def keys_for(self, layer: int, head: int, seq_len: int | None = None) -> npt.NDArray[Any]:
        """Zero-copy read-only view [seq_len, head_dim] of one head's keys."""
    def values_for(self, layer: int, head: int, seq_len: int | None = None) -> npt.NDArray[Any]:
        """Zero-copy read-only view [seq_len, head_dim] of one head's values."""
    def truncate(self, n: int) -> None:
        """Drops positions >= n from every layer; a no-op when n >= seq_len."""
    def clear(self) -> None:
        """Empties the cache; memory stays allocated."""
    def set_seq_len(self, n: int) -> None:
        """Sets seq_len and every layer's length to min(n, max_seq_len)."""
    def extract_block(
        self, layer: int, start_pos: int, block_size: int
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Copies [num_kv_heads, block_size, head_dim] keys and values from start_pos."""
    def inject_block(
        self, layer: int, start_pos: int, block_size: int, keys: _ArrayLike, values: _ArrayLike
    ) -> None:
        """Writes [num_kv_heads, block_size, head_dim] keys and values at start_pos."""
    def memory_bytes(self) -> int:
        """Bytes of storage held."""
    def utilization_ratio(self) -> float:
        """seq_len / max_seq_len, in [0, 1]."""
    def __len__(self) -> int: ...
