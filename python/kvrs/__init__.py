"""kvrs: KV-cache storage for LLM inference, with a Rust core.

The contiguous cache (:class:`KVCache`) preallocates K and V for every layer of one
sequence and hands them out as zero-copy NumPy views (bfloat16 and fp8 ones as
:class:`HostArray`, which torch imports through DLPack). The paged pool
(:class:`BlockPool`) shares fixed-size blocks between many :class:`Sequence` objects,
with copy-on-write forks, vLLM slot mappings, FlashInfer page tables and ollama-style
batched forwards (:class:`ForwardBatch`); evicted cached blocks can go to offload tiers
(:class:`HostTier`, :class:`DiskTier`, :class:`RedisTier`) and come back from them;
an inference engine's own pages go to the same tiers through :class:`PageStore`
(``kvrs.integrations.sglang`` plugs it into SGLang's HiCache). Errors derive from
:class:`KvrsError` where they are kvrs-specific (:class:`CacheFullError`,
:class:`NotSupportedError`, :class:`DeviceError`) and are plain ``ValueError`` /
``IndexError`` / ``TypeError`` otherwise.
"""

from typing import TypeAlias

from kvrs._host_array import HostArray
from kvrs._kvrs import (
    BlockPool,
    CacheFullError,
    DeviceError,
    DeviceTensor,
    DiskTier,
    EncoderCache,
    ForwardBatch,
    HostTier,
    KVCache,
    KvrsError,
    NotSupportedError,
    PageStore,
    RedisTier,
    RoPE,
    Sequence,
    __version__,
    attention_simd,
    blocks_per_sequence,
    cuda_available,
)

#: Any offload tier, for annotations: ``tiers: list[kvrs.Tier] = [HostTier(...), RedisTier(...)]``
#: (a list of different tier classes is otherwise inferred as ``list[object]``).
Tier: TypeAlias = HostTier | DiskTier | RedisTier

__all__ = [
    "BlockPool",
    "CacheFullError",
    "DeviceError",
    "DeviceTensor",
    "DiskTier",
    "EncoderCache",
    "ForwardBatch",
    "HostArray",
    "HostTier",
    "KVCache",
    "KvrsError",
    "NotSupportedError",
    "PageStore",
    "RedisTier",
    "RoPE",
    "Sequence",
    "Tier",
    "__version__",
    "attention_simd",
    "blocks_per_sequence",
    "cuda_available",
]
