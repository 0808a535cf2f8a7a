"""Type stubs for the compiled core, kvrs._kvrs (checked by mypy.stubtest in `make test`)."""

import os
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Sequence_
from types import GenericAlias, TracebackType
from typing import Any, Generic, Literal, TypeVar, final, overload

import numpy as np
import numpy.typing as npt

__all__ = [
    "BlockPool",
    "CacheFullError",
    "DeviceError",
    "DeviceTensor",
    "DiskTier",
    "EncoderCache",
    "ForwardBatch",
    "HostTier",
    "KVCache",
    "KvrsError",
    "NotSupportedError",
    "PageStore",
    "RedisTier",
    "RoPE",
    "Sequence",
    "SuffixIndex",
    "__version__",
    "_flush_tiers_at_exit",
    "_host_array_capsule",
    "_set_attention_simd",
    "attention_simd",
    "blocks_per_sequence",
    "cuda_available",
]

__version__: str

def attention_simd() -> str:
    """The vector instructions the attention core uses on this CPU ("avx512f+bw+vl+dq+bf16",
    "avx512f+bw+vl+dq", "avx2+fma+f16c" or "portable")."""

def _set_attention_simd(level: str | None = None) -> str:
    """Sets the vector level attention runs with ("portable", "avx2", "avx512", "avx512bf16";
    None: the detected one; capped at the CPU's) and returns the level now in use."""

def blocks_per_sequence(
    seq_len: int,
    *,
    block_size: int = 16,
    layer_types: Sequence_[str] | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    swa_memory: int = 0,
    max_chunk: int | None = None,
) -> int:
    """The most blocks one sequence holds in a pool of these layer kinds while it grows to
    `seq_len` positions in forward passes of at most `max_chunk` new tokens (default
    `seq_len`): full tables every block, sliding and chunked tables their window plus one pass."""

def _host_array_capsule(
    array: Any,
    *,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
) -> Any:
    """`kvrs.HostArray.__dlpack__`: a DLPack capsule over a NumPy array of a kvrs storage dtype."""

def _flush_tiers_at_exit() -> bool:
    """Waits (at most 10 s) until every pool of this process wrote what it queued for its tiers."""

def cuda_available() -> bool:
    """Whether a CUDA driver and at least one CUDA device are present."""

_DTypeLike = str | np.dtype[Any] | type | Any
"""'float32' | 'float16' | 'bfloat16' (or 'fp32', 'fp16', 'half', 'bf16'), the 8-bit storage
dtypes 'fp8_e4m3' | 'fp8_e5m2' | 'int8', a NumPy or ml_dtypes dtype, or a torch dtype."""

_ScaleLike = float | Iterable[float] | npt.NDArray[Any] | None
"""An fp8 scale: one float, one per layer, or a [num_layers, num_kv_heads] array."""

_ArrayLike = npt.NDArray[Any] | Any
"""A NumPy array, anything with ``__dlpack__`` (a torch CPU tensor), or anything with the buffer protocol."""

_IntsLike = npt.NDArray[np.integer[Any]] | Iterable[int]
_MaskLike = npt.NDArray[np.bool_] | Iterable[bool] | Any
_PackedMaskLike = npt.NDArray[np.uint8] | Any
# A CUDA stream: a handle, or torch.cuda.Stream, cupy.cuda.Stream, any __cuda_stream__ object.
_StreamLike = int | Any | None
"""A 1-D integer array or a sequence of ints."""

_Key = str | bytes | None

# One float per query head (sinks, ALiBi slopes): a list, an array or a CPU tensor.
_FloatsLike = npt.NDArray[Any] | Iterable[float] | Any
"""A namespace or extra key: text (UTF-8) or bytes."""

class KvrsError(Exception):
    """Base class of every kvrs-specific error."""

class CacheFullError(KvrsError):
    """The cache (or pool) has no room for what was asked."""

class NotSupportedError(KvrsError):
    """The operation is valid but not supported in this configuration."""

class DeviceError(KvrsError):
    """A device is unknown, unavailable or unusable."""

@final
class DeviceTensor:
    """A tensor in CUDA device memory, exported through DLPack without a copy."""

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """DLPack export; kvrs's queued work finishes before `stream` may read."""
    def __dlpack_device__(self) -> tuple[int, int]:
        """(2, ordinal): CUDA and the device ordinal."""
    @property
    def shape(self) -> list[int]:
        """The shape."""
    @property
    def strides(self) -> list[int]:
        """Element strides."""
    @property
    def dtype(self) -> str:
        """Element type: 'float32', 'float16' or 'bfloat16'."""
    @property
    def device(self) -> str:
        """Device name, 'cuda:N'."""
    @property
    def data_ptr(self) -> int:
        """Device address of element 0."""

_View_co = TypeVar("_View_co", bound=npt.NDArray[Any] | DeviceTensor, covariant=True)
"""What a cache's reads return: NumPy arrays on the host, DeviceTensors on a CUDA device.

``KVCache(...)`` is a ``KVCache[np.ndarray]``, ``KVCache(..., device="cuda")`` a
``KVCache[DeviceTensor]``; a device known only at run time gives the union."""

_Either = npt.NDArray[Any] | DeviceTensor
_Cpu = Literal["cpu"]
_Cuda = Literal["cuda", "cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:4", "cuda:5", "cuda:6", "cuda:7"]

@final
class KVCache(Generic[_View_co]):
    """A contiguous KV cache for one sequence, preallocated for ``max_seq_len`` positions."""

    @classmethod
    def __class_getitem__(cls, item: Any, /) -> GenericAlias:
        """`KVCache[np.ndarray]` at run time, as in annotations."""
    @overload
    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        *,
        v_head_dim: int | None = None,
        dtype: _DTypeLike = "float16",
        device: _Cpu = "cpu",
        k_scale: _ScaleLike = None,
        v_scale: _ScaleLike = None,
    ) -> KVCache[npt.NDArray[Any]]: ...
    @overload
    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        *,
        v_head_dim: int | None = None,
        dtype: _DTypeLike = "float16",
        device: _Cuda,
        k_scale: _ScaleLike = None,
        v_scale: _ScaleLike = None,
    ) -> KVCache[DeviceTensor]: ...
    @overload
    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        *,
        v_head_dim: int | None = None,
        dtype: _DTypeLike = "float16",
        device: str | Any,
        k_scale: _ScaleLike = None,
        v_scale: _ScaleLike = None,
    ) -> KVCache[_Either]: ...
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
        """Elements per key head vector."""
    @property
    def v_head_dim(self) -> int:
        """Elements per value head vector (head_dim unless made with another)."""
    @property
    def dtype(self) -> str:
        """Storage dtype name: 'float32', 'float16', 'bfloat16', 'fp8_e4m3', 'fp8_e5m2' or 'int8'."""
    @property
    def torch_dtype(self) -> Any:
        """The storage dtype as a torch dtype (`torch.bfloat16`, `torch.float8_e4m3fn`, ...;
        `torch.int8` for int8 codes). Needs torch."""
    @property
    def device(self) -> str:
        """Device name: 'cpu' (or 'cuda:N')."""
    @property
    def k_scale(self) -> npt.NDArray[np.float32] | None:
        """The fp8 key scales, [num_layers, num_kv_heads] (None for other dtypes)."""
    @property
    def v_scale(self) -> npt.NDArray[np.float32] | None:
        """The fp8 value scales, [num_layers, num_kv_heads] (None for other dtypes)."""
    def scales(self, layer: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """(K, V) scales of get(layer)'s codes: int8 [num_kv_heads, length] views ([..., chunks] when
        v_head_dim != head_dim: a scale per gcd(head_dim, v_head_dim) elements), else [num_kv_heads, 1]."""
    def layer_len(self, layer: int) -> int:
        """Positions written into `layer` (committed and appended)."""
    def store_key(self, layer: int, head: int, pos: int, key: _ArrayLike) -> None:
        """Writes one key vector of `head_dim` at (layer, head, pos); the layer holds pos after."""
    def store_value(self, layer: int, head: int, pos: int, value: _ArrayLike) -> None:
        """Writes one value vector of `head_dim` at (layer, head, pos); the layer holds pos after."""
    def append(self, layer: int, k: _ArrayLike, v: _ArrayLike) -> int:
        """Appends `k`, `v` of shape [n_tokens, num_kv_heads, head_dim]; returns the start position."""
    def advance(self, n: int = 1) -> None:
        """Commits `n` tokens: `seq_len += n`. Every layer must hold them already."""
    def gpu_counter_ptr(self) -> int:
        """Device address of the int64 position counter (CUDA caches), set to seq_len now."""
    def append_at_counter(self, layer: int, k: Any, v: Any) -> None:
        """Appends device tensors k, v at the device counter's position (a captured decode step)."""
    def set_stream(self, stream: _StreamLike) -> None:
        """Sends later launches to a CUDA stream (a handle, torch or CuPy stream; None: kvrs's own)."""
    def advance_counter(self, n: int) -> None:
        """Adds n to the device counter, on the device."""
    def sync_counter_from_gpu(self) -> int:
        """Reads the device counter back into seq_len and every layer's length; returns it."""
    def get(self, layer: int, *, dequantize: bool = False, copy: bool = False) -> tuple[_View_co, _View_co]:
        """Zero-copy read-only views (K, V) [num_kv_heads, length, head_dim] (8-bit: codes).

        The views are the cache's memory: torch ignores their read-only flag, so a tensor
        made from one with torch.from_dlpack writes the cache. With copy=True: copies the
        caller owns. With dequantize=True: float32 copies of the values."""
    def attention(
        self,
        layer: int,
        q: _ArrayLike,
        *,
        out: _Either | None = None,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: _FloatsLike | None = None,
        alibi_slopes: _FloatsLike | None = None,
        latent: bool = False,
    ) -> _View_co:
        """Causal attention of the layer's last n positions (q [n, num_q_heads, head_dim]), read in place."""
    def keys_for(self, layer: int, head: int, seq_len: int | None = None, *, copy: bool = False) -> _View_co:
        """Zero-copy read-only view [seq_len, head_dim] of one head's keys (a copy with copy=True)."""
    def values_for(
        self, layer: int, head: int, seq_len: int | None = None, *, copy: bool = False
    ) -> _View_co:
        """Zero-copy read-only view [seq_len, head_dim] of one head's values (a copy with copy=True)."""
    def truncate(self, n: int) -> None:
        """Drops positions >= n from every layer; a no-op when n >= seq_len."""
    def clear(self) -> None:
        """Empties the cache; memory stays allocated."""
    def set_seq_len(self, n: int) -> None:
        """Sets seq_len and every layer's length to min(n, max_seq_len)."""
    def extract_block(self, layer: int, start_pos: int, block_size: int) -> tuple[_View_co, _View_co]:
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

@final
class HostTier:
    """Cached blocks in this process's memory, at most `max_bytes`, least recently used out first."""

    def __new__(cls, max_bytes: int | str) -> HostTier: ...
    @property
    def max_bytes(self) -> int:
        """The size bound in bytes."""
    def used_bytes(self) -> int:
        """Bytes of blocks held now."""
    def get(self, keys: list[str], max_bytes: int = 1 << 30) -> list[bytes | None]:
        """The raw payloads stored under `keys` (None where absent or larger than `max_bytes`)."""
    def stats(self) -> dict[str, Any]:
        """What the tier did, as a dict of counters."""

@final
class DiskTier:
    """A directory of cached blocks bounded to `max_bytes`, least recently used out first."""

    def __new__(cls, path: str | os.PathLike[str], max_bytes: int | str) -> DiskTier: ...
    @property
    def path(self) -> str:
        """The directory."""
    @property
    def max_bytes(self) -> int:
        """The size bound in bytes."""
    def used_bytes(self) -> int:
        """Bytes of block and temporary files in the directory now (every process's), counted afresh."""
    def get(self, keys: list[str], max_bytes: int = 1 << 30) -> list[bytes | None]:
        """The raw payloads stored under `keys` (None where absent or larger than `max_bytes`), in one
        batched request."""
    def stats(self) -> dict[str, Any]:
        """What the tier did, as a dict of counters."""

@final
class RedisTier:
    """A Redis (or Valkey) server holding cached blocks for every process that uses it, or a
    Redis Cluster (``cluster=True``, or a list of seed URLs). A `rediss://` URL is TLS (one
    server), verified against the system's trust roots and `tls_ca`, with an optional
    client certificate (`tls_cert`, `tls_key`); PEM files."""

    def __new__(
        cls,
        url: str | list[str] = "redis://127.0.0.1:6379/0",
        *,
        timeout: float = 0.1,
        ttl: int | None = None,
        max_idle: int = 8,
        retry_after: float = 1.0,
        cluster: bool | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
    ) -> RedisTier: ...
    @property
    def url(self) -> str:
        """The server's URL, with the password (if any) replaced by ``***`` (a cluster's seeds,
        joined by commas)."""
    @property
    def cluster(self) -> bool:
        """Whether the tier is on a Redis Cluster."""
    def get(self, keys: list[str], max_bytes: int = 1 << 30) -> list[bytes | None]:
        """The raw payloads stored under `keys` (None where absent or larger than `max_bytes`), in one
        batched request."""
    def stats(self) -> dict[str, Any]:
        """What the tier did, as a dict of counters."""

@final
class SuffixIndex:
    """Token sequences by namespace, drafting what followed a request's last tokens in any of
    them (SuffixDecoding): bounded to `max_tokens` tokens, least recently written sequences
    evicted first; thread-safe."""

    def __new__(cls, max_tokens: int = 262144, max_depth: int = 24) -> SuffixIndex: ...
    @property
    def max_tokens(self) -> int:
        """The token budget."""
    @property
    def max_depth(self) -> int:
        """The longest window: match plus draft."""
    def add(self, tokens: _IntsLike, *, namespace: _Key = None, extra_key: _Key = None) -> int:
        """Adds `tokens` as a new sequence of `namespace` (and `extra_key`); returns its handle."""
    def extend(self, handle: int, tokens: _IntsLike) -> None:
        """Appends `tokens` to sequence `handle` (KeyError when not retained)."""
    def remove(self, handle: int) -> bool:
        """Removes sequence `handle`; False when it was not retained."""
    def tokens(self, handle: int) -> list[int]:
        """The retained tokens of sequence `handle` (KeyError when not retained)."""
    def handles(self) -> list[int]:
        """Handles of the retained sequences, least recently written first."""
    def __contains__(self, handle: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def speculate(
        self,
        context: _IntsLike,
        *,
        namespace: _Key = None,
        extra_key: _Key = None,
        max_tokens: int = 16,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
    ) -> tuple[list[int], list[float], int]:
        """The draft after `context`: (tokens, probabilities, match length); empty when nothing matches."""
    def clear(self) -> None:
        """Removes every sequence (counters kept)."""
    def stats(self) -> dict[str, int]:
        """Size and counters: sequences, tokens, max_tokens, nodes, bytes, evictions, lookups, hits."""

@final
class PageStore:
    """An inference engine's own KV pages (opaque bytes in the engine's page layout) in kvrs
    tiers (fastest first), each sealed in a kvrs payload whose header and keyed MAC bind it to
    the store's `fingerprint` (the engine's facts: model, KV dtype, layout, page bytes, TP/PP
    ranks, ...), its namespace (a tenant) and its key, under the secret `tier_key`. A lookup
    copies a page into the caller's buffer only after every check passed; anything else is a
    miss. Pages and buffers are NumPy arrays, CPU tensors (DLPack) or bytes-like objects, read
    and written in place."""

    def __new__(
        cls,
        tiers: list[HostTier | DiskTier | RedisTier],
        *,
        fingerprint: Mapping[str, str | int | float | bool],
        tier_key: bytes | str | None = None,
        write: Literal["all", "first"] = "all",
    ) -> PageStore: ...
    @property
    def fingerprint(self) -> dict[str, str]:
        """The engine's facts the store was made with (values as text)."""
    @property
    def page_bytes(self) -> int | None:
        """The length every page has (``fingerprint["page_bytes"]``), or None."""
    def tier_key(self, key: str, namespace: str | None = None) -> str:
        """The name the tiers file page `key` of `namespace` under."""
    def put_many(
        self, keys: Sequence_[str], pages: Sequence_[Any], namespace: str | None = None
    ) -> list[bool]:
        """Seals each page and stores it under its key; per page, whether a tier took it."""
    def get_into(
        self, keys: Sequence_[str], buffers: Sequence_[Any], namespace: str | None = None
    ) -> list[bool]:
        """Copies each key's verified page into its writable buffer, or straight into its segments
        when the buffer is a list or tuple of them (the page's bytes in order); per key, whether it
        was loaded (False: a miss, the buffer untouched)."""
    def exists_prefix(self, keys: Sequence_[str], namespace: str | None = None) -> int:
        """How many of `keys`, from the first, are stored."""
    def exists_many(self, keys: Sequence_[str], namespace: str | None = None) -> list[bool]:
        """Whether each of `keys` is stored; one batched request per tier."""
    def drop_namespace(self, namespace: str) -> int:
        """Removes every page of `namespace` from every tier; how many tier entries were removed."""
    def stats(self) -> dict[str, Any]:
        """The store's counters, and each tier's under ``tiers``."""

@final
class BlockPool(Generic[_View_co]):
    """A pool of fixed-size KV blocks for every layer, allocated once and shared by many sequences."""

    @classmethod
    def __class_getitem__(cls, item: Any, /) -> GenericAlias:
        """`BlockPool[np.ndarray]` at run time, as in annotations."""
    @overload
    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        v_head_dim: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_bytes: int | str | None = None,
        dtype: _DTypeLike = "float16",
        device: _Cpu = "cpu",
        layout: str = "NHD",
        prefix_caching: bool | None = None,
        hash: str = "blake3",
        seed: int | str | None = None,
        partial_hits: bool = True,
        events: bool = False,
        rope: RoPE | None = None,
        layer_types: Sequence_[str] | None = None,
        sliding_window: int | None = None,
        chunk_size: int | None = None,
        swa_memory: int = 0,
        k_scale: _ScaleLike = None,
        v_scale: _ScaleLike = None,
        tiers: list[HostTier | DiskTier | RedisTier] | None = None,
        model_id: str = "",
        tier_queue: int = 1024,
        tier_write: str = "first",
        tier_key: bytes | str | None = None,
        tier_queue_bytes: int | str | None = None,
        tier_write_policy: str | None = None,
        tier_write_hits: int = 2,
        state_layers: int = 0,
        state_shapes: Mapping[str, Sequence_[int]] | None = None,
        state_slots: int | None = None,
        state_dtype: _DTypeLike | Mapping[str, _DTypeLike] | None = None,
        state_checkpoints: int | None = None,
        checkpoint_interval: int | None = None,
    ) -> BlockPool[npt.NDArray[Any]]: ...
    @overload
    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        v_head_dim: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_bytes: int | str | None = None,
        dtype: _DTypeLike = "float16",
        device: _Cuda,
        layout: str = "NHD",
        prefix_caching: bool | None = None,
        hash: str = "blake3",
        seed: int | str | None = None,
        partial_hits: bool = True,
        events: bool = False,
        rope: RoPE | None = None,
        layer_types: Sequence_[str] | None = None,
        sliding_window: int | None = None,
        chunk_size: int | None = None,
        swa_memory: int = 0,
        k_scale: _ScaleLike = None,
        v_scale: _ScaleLike = None,
        tiers: list[HostTier | DiskTier | RedisTier] | None = None,
        model_id: str = "",
        tier_queue: int = 1024,
        tier_write: str = "first",
        tier_key: bytes | str | None = None,
        tier_queue_bytes: int | str | None = None,
        tier_write_policy: str | None = None,
        tier_write_hits: int = 2,
        state_layers: int = 0,
        state_shapes: Mapping[str, Sequence_[int]] | None = None,
        state_slots: int | None = None,
        state_dtype: _DTypeLike | Mapping[str, _DTypeLike] | None = None,
        state_checkpoints: int | None = None,
        checkpoint_interval: int | None = None,
    ) -> BlockPool[DeviceTensor]: ...
    @overload
    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        v_head_dim: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_bytes: int | str | None = None,
        dtype: _DTypeLike = "float16",
        device: str | Any,
        layout: str = "NHD",
        prefix_caching: bool | None = None,
        hash: str = "blake3",
        seed: int | str | None = None,
        partial_hits: bool = True,
        events: bool = False,
        rope: RoPE | None = None,
        layer_types: Sequence_[str] | None = None,
        sliding_window: int | None = None,
        chunk_size: int | None = None,
        swa_memory: int = 0,
        k_scale: _ScaleLike = None,
        v_scale: _ScaleLike = None,
        tiers: list[HostTier | DiskTier | RedisTier] | None = None,
        model_id: str = "",
        tier_queue: int = 1024,
        tier_write: str = "first",
        tier_key: bytes | str | None = None,
        tier_queue_bytes: int | str | None = None,
        tier_write_policy: str | None = None,
        tier_write_hits: int = 2,
        state_layers: int = 0,
        state_shapes: Mapping[str, Sequence_[int]] | None = None,
        state_slots: int | None = None,
        state_dtype: _DTypeLike | Mapping[str, _DTypeLike] | None = None,
        state_checkpoints: int | None = None,
        checkpoint_interval: int | None = None,
    ) -> BlockPool[_Either]: ...
    @property
    def num_layers(self) -> int:
        """Number of layers."""
    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer."""
    @property
    def head_dim(self) -> int:
        """Elements per key head vector."""
    @property
    def v_head_dim(self) -> int:
        """Elements per value head vector (head_dim unless made with another)."""
    @property
    def block_size(self) -> int:
        """Positions per block."""
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
    @property
    def dtype(self) -> str:
        """Storage dtype name."""
    @property
    def torch_dtype(self) -> Any:
        """The storage dtype as a torch dtype (`torch.bfloat16`, `torch.float8_e4m3fn`, ...;
        `torch.int8` for int8 codes). Needs torch."""
    @property
    def device(self) -> str:
        """Device name."""
    @property
    def layout(self) -> str:
        """'NHD' or 'HND'."""
    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id: a block (K and V) of each layer of a layer group."""
    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds."""
    @property
    def rope(self) -> RoPE | None:
        """The rotary embedding used to re-rotate moved keys, or None."""
    @property
    def prefix_caching(self) -> bool:
        """Whether full blocks with known token ids are cached for reuse."""
    @property
    def hash(self) -> str | None:
        """The prefix hash function ('blake3' or 'xxh3'), or None without prefix caching."""
    @property
    def seed(self) -> int | None:
        """The seed of every hash chain, or None without prefix caching."""
    @property
    def layer_types(self) -> list[str]:
        """Kind of each layer: 'full', 'sliding' or 'chunked'."""
    @property
    def sliding_window(self) -> int | None:
        """Window of the sliding layers (positions seen, the token included), or None."""
    @property
    def chunk_size(self) -> int | None:
        """Chunk size of the chunked layers, or None."""
    @property
    def swa_memory(self) -> int:
        """Extra positions sliding layers keep behind their window."""
    @property
    def num_layer_groups(self) -> int:
        """Block tables each sequence has: one per group of equally many layers of one kind."""
    def layer_group(self, layer: int) -> int:
        """The group (row of reserve()'s slot mapping, block table) of `layer`."""
    @property
    def k_scale(self) -> npt.NDArray[np.float32] | None:
        """The fp8 key scales, [num_layers, num_kv_heads] (None for other dtypes)."""
    @property
    def v_scale(self) -> npt.NDArray[np.float32] | None:
        """The fp8 value scales, [num_layers, num_kv_heads] (None for other dtypes)."""
    def scale_cache(self, layer: int) -> npt.NDArray[np.float32]:
        """Zero-copy writable view of an int8 pool's per-token scales: kv_cache's shape minus head_dim
        (one head size; ValueError for v_head_dim != head_dim, whose scales Sequence.scales gives)."""
    def kv_cache(self, layer: int) -> _View_co:
        """Zero-copy writable view of one layer's cache tensor, FlashInfer's paged layout (one head size)."""
    @property
    def state_layers(self) -> int:
        """State layers beside the K/V layers (hybrid models' linear-attention or Mamba
        layers; 0 for a pool of attention layers only)."""
    @property
    def state_slots(self) -> int:
        """Sequences that can hold a recurrent state at once (0 without state layers)."""
    @property
    def free_state_slots(self) -> int:
        """State slots no sequence holds."""
    @property
    def state_shapes(self) -> dict[str, tuple[list[int], str]]:
        """Each state's shape per sequence and layer, and its dtype: {name: (dims, dtype)}."""
    def state_cache(self, layer: int) -> dict[str, _View_co]:
        """Writable views of one state layer's states for every slot: {name: [state_slots, *dims]}."""
    def pack_states(self, seqs: Iterable[Sequence[Any]]) -> int:
        """Moves the states of `seqs` to consecutive slots in their order; returns the first."""
    def kv_cache_parts(self, layer: int) -> tuple[_View_co, _View_co]:
        """Zero-copy writable views (K, V) of one layer: FlashInfer's paged K and V caches (MLA: ckv, kpe)."""
    def stats(self) -> dict[str, Any]:
        """Occupancy as a dict (blocks, bytes, exact token counts, prefix and tier counters).

        ``fp8_saturated``: per layer, the elements fp8 writes rounded past the format's largest
        value and clamped to it (K and V together); None for other dtypes and for CUDA pools
        (not counted). ``suffix_*``: its suffix index's size and counters (see
        `SuffixIndex.stats`).
        """
    @property
    def suffix_index(self) -> SuffixIndex:
        """The pool's suffix index (speculative drafts from the tokens its requests held);
        assign a `SuffixIndex` to resize it."""
    @suffix_index.setter
    def suffix_index(self, index: SuffixIndex) -> None: ...
    def new_sequence(
        self, tokens: _IntsLike | None = None, namespace: _Key = None, extra_key: _Key = None
    ) -> Sequence[_View_co]:
        """Starts a sequence; with `tokens` it attaches the longest cached prefix."""
    def match_prefix(self, tokens: _IntsLike, namespace: _Key = None, extra_key: _Key = None) -> int:
        """Tokens of `tokens` a new sequence would find cached, without attaching anything."""
    def prefetch(
        self, tokens: _IntsLike, namespace: _Key = None, extra_key: _Key = None, wait: bool = True
    ) -> int:
        """Loads what the offload tiers hold of `tokens`' prefix into the cache; returns tokens cached.

        With wait=False, fetches it in the background and returns at once the tokens the pool lacks;
        the next lookup of the prefix loads from what was fetched.
        """
    def store_to_tiers(self, seqs: Iterable[Sequence[Any]]) -> int:
        """Queues the cached blocks `seqs` hold for the offload tiers now (with the cached state
        checkpoints at their ends, in a pool with state layers); returns how many blocks."""
    def flush_tiers(self) -> None:
        """Waits until every block queued for the offload tiers is written (or refused)."""
    def drop_tier_namespace(self, namespace: _Key = None) -> int:
        """Removes every block of `namespace` from the offload tiers; returns how many."""
    def pin(self, tokens: _IntsLike, namespace: _Key = None, extra_key: _Key = None) -> int:
        """Keeps the cached whole blocks of `tokens` from eviction until unpin(); returns tokens pinned."""
    def unpin(self, tokens: _IntsLike, namespace: _Key = None, extra_key: _Key = None) -> int:
        """Undoes one pin() of the same prefix; returns the tokens unpinned."""
    def evict_all(self) -> int:
        """Drops every cached block no sequence holds; returns how many."""
    def drain_events(self) -> list[dict[str, Any]]:
        """Blocks stored in and removed from the prefix cache since the last call."""
    def close(self) -> int:
        """Writes every cached block (and cached checkpoint at a block end) the tiers do not hold
        yet, waits until written and stops the write-back thread; returns the blocks queued.
        Closing twice, or a pool without tiers, is harmless (0)."""
    def __enter__(self) -> BlockPool[_View_co]: ...
    def __exit__(self, *_args: object) -> bool: ...
    @property
    def tier_write_policy(self) -> str | None:
        """When cached blocks reach the tiers: 'write_through', 'write_back' or
        'write_through_selective' (None without tiers)."""
    def bind_model(self, fingerprint: str) -> None:
        """Binds the pool to the model of `fingerprint` (kvrs.model_fingerprint(model)): the
        first binding is kept, the same one again is a no-op, another raises ValueError naming
        both. A pool without model_id takes the fingerprint as its model_id."""
    @property
    def model_fingerprint(self) -> str | None:
        """The fingerprint of the model the pool is bound to (bind_model), or None."""
    @property
    def model_id(self) -> str:
        """The model id that tiers and prefix-cache files key its blocks by ('' for none)."""
    def save_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """Writes every cached block to `path` (safetensors, atomically), with the pool's
        model_id (and, with state layers, every cached state checkpoint whose blocks it holds);
        returns how many blocks. MemoryError when the host cannot hold the copy."""
    def load_prefix_cache(self, path: str | os.PathLike[str]) -> dict[str, int]:
        """Warms the prefix cache from a file written by save_prefix_cache() of a pool with
        the same seed, configuration and model_id; returns {'loaded': n, 'skipped': m}, and in a
        pool with state layers 'checkpoints': the state checkpoints loaded. Any other file (of
        another state layout too) raises ValueError and loads nothing."""
    def copy_prefix(self, src: Sequence[Any], dst: Sequence[Any], n: int) -> None:
        """Makes `dst` hold the first `n` committed positions of `src`, sharing blocks. `dst` keeps its
        namespace and extra_key, which must equal src's when n > 0 (ValueError)."""
    def keep(self, seqs: Iterable[Sequence[Any]]) -> None:
        """Frees every sequence of the pool not in `seqs`."""
    def reserve(self, seqs: Iterable[Sequence[Any]], counts: _IntsLike) -> npt.NDArray[np.int64]:
        """Reserves room for counts[i] new tokens in each sequence; returns the int64 slot mapping
        ([n], or [num_layer_groups, n] when layers have several block tables). The positions
        read as zeros until written; advance(tokens=...) states they hold those tokens' K/V."""
    def write(self, layer: int, k: _ArrayLike, v: _ArrayLike, slot_mapping: _IntsLike) -> None:
        """Scatters k, v [n_tokens, num_kv_heads, head_dim] into slot_mapping (-1 skips)."""
    def set_stream(self, stream: _StreamLike) -> None:
        """Sends the pool's later launches (writes, attention, block copies, state updates) to a
        CUDA stream, in order on it with no host synchronisation: None (kvrs's own stream), an
        int handle, torch.cuda.Stream, cupy.cuda.Stream or any __cuda_stream__ object. CUDA pools."""
    def write_layers(self, k: _ArrayLike, v: _ArrayLike, slot_mapping: _IntsLike) -> None:
        """write() of every layer in one call (one launch on a CUDA pool): k, v
        [num_layers, n_tokens, num_kv_heads, head_dim] (any layer stride); slot_mapping
        [n_tokens] or [num_layer_groups, n_tokens] as reserve() returns it (-1 skips)."""
    def page_table(
        self, seqs: Iterable[Sequence[Any]], layer: int | None = None
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """FlashInfer's int32 page table (indptr, indices, last_page_len) of `seqs` for `layer`'s group."""
    def block_tables(
        self, seqs: Iterable[Sequence[Any]], pad: int = -1, layer: int | None = None
    ) -> npt.NDArray[np.int32]:
        """Block tables of `seqs` (`layer`'s group) as int32 [batch, max_blocks], padded with `pad`."""
    def start_forward(
        self,
        seqs: Iterable[Sequence[Any]],
        positions: _IntsLike | None = None,
        tokens: _IntsLike | None = None,
        *,
        draft: bool = False,
    ) -> ForwardBatch[_View_co]:
        """Places a batch of tokens (token i: seqs[i] at positions[i]) and reserves their slots.
        draft=True: speculative tokens; finish() commits them but the prefix cache takes none
        until Sequence.accept keeps them (a batch attending with a custom mask is marked so)."""
    def check_invariants(self) -> None:
        """Verifies internal consistency; raises AssertionError naming the first broken invariant."""

@final
class Sequence(Generic[_View_co]):
    """One sequence's view of a pool: its block table and lengths."""

    @classmethod
    def __class_getitem__(cls, item: Any, /) -> GenericAlias:
        """`Sequence[np.ndarray]` at run time, as in annotations."""
    @property
    def pool(self) -> BlockPool[_View_co]:
        """The pool this sequence lives in."""
    @property
    def seq_len(self) -> int:
        """Committed length."""
    @property
    def num_blocks(self) -> int:
        """Blocks the sequence holds (every layer group)."""
    @property
    def block_table(self) -> npt.NDArray[np.int32]:
        """The block ids, in position order (an int32 copy), of a pool with one layer group."""
    def layer_blocks(self, layer: int) -> npt.NDArray[np.int32]:
        """`layer`'s block table: entry i covers positions i * block_size..; -1 where released."""
    @property
    def pos_min(self) -> int:
        """Lowest position every layer holds (-1 when empty)."""
    def layer_start(self, layer: int) -> int:
        """First position `layer` holds (get() returns positions layer_start..layer_len)."""
    def can_resume(self, pos: int) -> bool:
        """Whether the cache still holds everything needed to continue at `pos`, for every layer."""
    @property
    def pos_max(self) -> int:
        """Highest committed position (-1 when empty)."""
    @property
    def is_freed(self) -> bool:
        """Whether free() has been called (or the pool's keep() dropped it)."""
    def layer_len(self, layer: int) -> int:
        """Positions written into `layer` (committed and appended)."""
    def memory_bytes(self) -> int:
        """Bytes of the blocks this sequence holds (shared blocks count in full)."""
    def append(self, layer: int, k: _ArrayLike, v: _ArrayLike) -> int:
        """Appends k, v [n_tokens, num_kv_heads, head_dim]; returns the start position."""
    def advance(self, n: int = 1, tokens: _IntsLike | None = None) -> None:
        """Commits n tokens (with their token ids when given). Every layer must hold them already."""
    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache when the sequence started."""
    @property
    def cached_tokens_by_tier(self) -> dict[str, int]:
        """Of num_cached_tokens, what the pool ("pool") and each offload tier (by name) served."""
    @property
    def token_ids(self) -> npt.NDArray[np.uint32]:
        """The token ids the sequence knows (its prompt and committed tokens)."""
    def set_seq_len(self, n: int) -> None:
        """Sets seq_len and every layer's length to n, growing or shrinking the block table;
        positions gained without a write read as zeros and are never cached."""
    def extract_block(self, layer: int, start_pos: int, block_size: int) -> tuple[_View_co, _View_co]:
        """Copies [num_kv_heads, block_size, head_dim] keys and values of `layer` from start_pos."""
    def inject_block(
        self, layer: int, start_pos: int, block_size: int, keys: _ArrayLike, values: _ArrayLike
    ) -> None:
        """Writes [num_kv_heads, block_size, head_dim] keys and values of `layer` at start_pos."""
    def copy_to_cache(self, cache: KVCache[Any]) -> None:
        """Replaces `cache`'s content with this sequence's (lengths included)."""
    def copy_from_cache(self, cache: KVCache[Any]) -> None:
        """Fills this empty sequence from `cache`."""
    def get(
        self, layer: int, out: tuple[_Either, _Either] | None = None, *, dequantize: bool = False
    ) -> tuple[_View_co, _View_co]:
        """The layer's K and V gathered into contiguous [num_kv_heads, length, head_dim] arrays."""
    def scales(self, layer: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """(K, V) scales of get(layer)'s codes: int8 [num_kv_heads, length] ([..., chunks] when
        v_head_dim != head_dim: a scale per gcd(head_dim, v_head_dim) elements), else [num_kv_heads, 1]."""
    def attention(
        self,
        layer: int,
        q: _ArrayLike,
        *,
        out: _Either | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: _FloatsLike | None = None,
        alibi_slopes: _FloatsLike | None = None,
        latent: bool = False,
    ) -> _View_co:
        """Attention of the newest n positions (q [n, num_q_heads, head_dim]) over the layer, in place."""
    def views(self, layer: int, *, copy: bool = False) -> list[tuple[int, int, _View_co, _View_co]]:
        """Zero-copy read-only per-block views: a list of (start, length, K, V) (copies with copy=True)."""
    @property
    def state_slot(self) -> int | None:
        """Its recurrent-state slot in a pool with state layers, else None."""
    def state(self, layer: int) -> dict[str, _View_co]:
        """Writable views of its states in state layer `layer`: {name: array of the state's shape}."""
    def checkpoint(self) -> bool:
        """Checkpoints its recurrent state at its committed length (pools with state layers that
        cache prefixes); returns whether it holds one there."""
    @property
    def checkpoints(self) -> list[int]:
        """Positions of the state checkpoints it holds (ascending)."""
    @property
    def checkpoint_due(self) -> int | None:
        """Where its next prefill chunk should end for the state there to be checkpointed: the
        first of its branch point, the next multiple of checkpoint_interval and its prompt's last
        block boundary, past seq_len and before the prompt's end; else None."""
    def fork(self) -> Sequence[_View_co]:
        """A new sequence sharing every block of this one (copy-on-write on first write)."""
    def truncate(self, n: int) -> None:
        """Drops positions >= n, returning freed blocks; a no-op when n >= seq_len."""
    def accept(self, start: int, keep: _IntsLike) -> None:
        """Keeps the draft positions start + keep[i] (keep strictly increasing), moved to
        start + i in every layer, and cuts the rest; every layer then holds start + len(keep)."""
    def remove(self, begin: int, end: int | None = None) -> None:
        """llama.cpp's seq_rm: removes positions [begin, end); a middle span needs the pool's rope."""
    def shift(self, p0: int, p1: int | None, delta: int) -> None:
        """llama.cpp's seq_add over a tail: positions p0.. move down by -delta, keys re-rotated."""
    def free(self) -> None:
        """Returns every block to the pool; the sequence cannot be used afterwards."""
    def __enter__(self) -> Sequence[_View_co]: ...
    def __exit__(self, *_args: object) -> None: ...

@final
class ForwardBatch(Generic[_View_co]):
    """A batch of tokens placed in a pool by BlockPool.start_forward. It keeps its sequences
    alive and refuses every use once one of them was freed, truncated or forked since."""

    @classmethod
    def __class_getitem__(cls, item: Any, /) -> GenericAlias:
        """`ForwardBatch[np.ndarray]` at run time, as in annotations."""
    @property
    def num_tokens(self) -> int:
        """Tokens in the batch."""
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """Each token's slot (int64, vLLM's convention): [n_tokens], or [num_layer_groups, n_tokens]."""
    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """Each token's position in its sequence."""
    @property
    def sequences(self) -> tuple[Sequence[_View_co], ...]:
        """The batch's sequences, each once, in order of first appearance."""
    @property
    def qo_indptr(self) -> npt.NDArray[np.int32]:
        """Where each sequence's tokens start in the batch, then the number of tokens
        (FlashInfer's and vLLM's qo_indptr); ValueError unless each sequence's tokens are
        one contiguous run."""
    @property
    def last_token_indices(self) -> npt.NDArray[np.int64]:
        """The batch index of each sequence's last token, in `sequences` order: the rows
        a sampler reads."""
    @property
    def token_ids(self) -> npt.NDArray[np.int64]:
        """Each token's id as the pool records it (given to start_forward, else known from the
        sequence's prompt); -1 where none is known. Compute the batch's K/V from these ids."""
    def history_len(self, layer: int = 0) -> int:
        """Positions of history that get(layer) returns."""
    def put(self, layer: int, k: _ArrayLike, v: _ArrayLike) -> None:
        """Writes this layer's K and V for the batch's tokens ([n_tokens, heads, head_dim])."""
    def put_layers(self, k: _ArrayLike, v: _ArrayLike) -> None:
        """put() of every layer in one call (one launch on a CUDA pool): k, v
        [num_layers, n_tokens, num_kv_heads, head_dim] (any layer stride)."""
    def get(
        self,
        layer: int,
        *,
        custom_mask: _MaskLike | None = None,
        packed_custom_mask: _PackedMaskLike | None = None,
    ) -> tuple[_View_co, _View_co, npt.NDArray[np.float32]]:
        """(K, V, mask) over every sequence of the batch; mask: 0 where a token may attend (and the
        custom mask allows it), else -inf. Prefer attention(), which reads the blocks in place."""
    def attention(
        self,
        layer: int,
        q: _ArrayLike,
        *,
        out: _Either | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: _FloatsLike | None = None,
        alibi_slopes: _FloatsLike | None = None,
        latent: bool = False,
        custom_mask: _MaskLike | None = None,
        packed_custom_mask: _PackedMaskLike | None = None,
    ) -> _View_co:
        """Attention of the batch's tokens (q [n_tokens, num_q_heads, head_dim]) over `layer`, in place.
        custom_mask: FlashInfer's flattened bool [q_len x kv_len] per sequence (True = may attend);
        packed_custom_mask: its segment_packbits(..., bitorder='little') form."""
    def finish(self) -> None:
        """Commits the batch: each sequence's seq_len moves past its new tokens. Refused (ValueError)
        when put() wrote some layers but not all."""
    def cancel(self) -> None:
        """Abandons the batch: the reserved positions are dropped again (a stale batch cuts nothing)."""
    def __enter__(self) -> ForwardBatch[_View_co]: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        _exc: BaseException | None = None,
        _tb: TracebackType | None = None,
    ) -> None: ...

@final
class RoPE:
    """A rotary position embedding (theta, rotated dimensions, 'neox' or 'gptj' pairing, scaling)."""

    def __new__(
        cls,
        theta: float = 10000.0,
        rotary_dim: int | None = None,
        style: str = "neox",
        scaling: tuple[str, float] | None = None,
    ) -> RoPE: ...
    @property
    def theta(self) -> float:
        """Base of the rotation frequencies."""
    @property
    def rotary_dim(self) -> int | None:
        """Rotated leading dimensions (None: all of head_dim)."""
    @property
    def style(self) -> str:
        """'neox' or 'gptj'."""
    @property
    def scaling(self) -> tuple[str, float] | None:
        """('linear', factor), or None."""
    def apply(self, x: _ArrayLike, positions: _IntsLike) -> npt.NDArray[np.float32]:
        """Rotates x ([n, head_dim] or [n, heads, head_dim]) to `positions`; returns a new float32 array."""

@final
class EncoderCache(Generic[_View_co]):
    """Position-independent K/V of one encoder input (cross-attention), written once per layer."""

    @classmethod
    def __class_getitem__(cls, item: Any, /) -> GenericAlias:
        """`EncoderCache[np.ndarray]` at run time, as in annotations."""
    @overload
    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        v_head_dim: int | None = None,
        dtype: _DTypeLike = "float16",
        device: _Cpu = "cpu",
        k_scale: _ScaleLike = None,
        v_scale: _ScaleLike = None,
    ) -> EncoderCache[npt.NDArray[Any]]: ...
    @overload
    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        v_head_dim: int | None = None,
        dtype: _DTypeLike = "float16",
        device: _Cuda,
        k_scale: _ScaleLike = None,
        v_scale: _ScaleLike = None,
    ) -> EncoderCache[DeviceTensor]: ...
    @overload
    def __new__(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        v_head_dim: int | None = None,
        dtype: _DTypeLike = "float16",
        device: str | Any,
        k_scale: _ScaleLike = None,
        v_scale: _ScaleLike = None,
    ) -> EncoderCache[_Either]: ...
    @property
    def length(self) -> int | None:
        """Encoder positions every layer holds (None before the first set)."""
    @property
    def max_len(self) -> int:
        """Encoder positions the cache can hold."""
    @property
    def num_layers(self) -> int:
        """Number of layers."""
    @property
    def dtype(self) -> str:
        """Storage dtype name."""
    @property
    def device(self) -> str:
        """Device name."""
    @property
    def k_scale(self) -> npt.NDArray[np.float32] | None:
        """The fp8 key scales, [num_layers, num_kv_heads] (None for other dtypes)."""
    @property
    def v_scale(self) -> npt.NDArray[np.float32] | None:
        """The fp8 value scales, [num_layers, num_kv_heads] (None for other dtypes)."""
    @property
    def is_complete(self) -> bool:
        """Whether every layer holds its K/V."""
    def is_set(self, layer: int) -> bool:
        """Whether `layer` holds its K/V."""
    def set(self, layer: int, k: _ArrayLike, v: _ArrayLike) -> None:
        """Writes `layer`'s K and V ([n, num_kv_heads, head_dim], the same n for every layer)."""
    def get(self, layer: int, *, dequantize: bool = False, copy: bool = False) -> tuple[_View_co, _View_co]:
        """Zero-copy read-only views (K, V) [num_kv_heads, length, head_dim] of a set layer
        (copies with copy=True)."""
    def scales(self, layer: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """(K, V) scales of get(layer)'s codes: int8 [num_kv_heads, length] views ([..., chunks] when
        v_head_dim != head_dim: a scale per gcd(head_dim, v_head_dim) elements), else [num_kv_heads, 1]."""
    def attention(
        self,
        layer: int,
        q: _ArrayLike,
        *,
        out: _Either | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: _FloatsLike | None = None,
        alibi_slopes: _FloatsLike | None = None,
        latent: bool = False,
    ) -> _View_co:
        """Cross-attention of q [n, num_q_heads, head_dim] over every encoder position of `layer`."""
    def clear(self) -> None:
        """Forgets the input; the memory stays allocated for the next one."""
    def memory_bytes(self) -> int:
        """Bytes of storage held."""
