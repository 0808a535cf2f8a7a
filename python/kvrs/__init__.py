"""kvrs: KV-cache storage for LLM inference, with a Rust core.

The contiguous cache ([`KVCache`][kvrs.KVCache]) preallocates K and V for every layer of one
sequence and hands them out as zero-copy NumPy views (bfloat16 and fp8 ones as
[`HostArray`][kvrs.HostArray], which torch imports through DLPack). The paged pool
([`BlockPool`][kvrs.BlockPool]) shares fixed-size blocks between many [`Sequence`][kvrs.Sequence] objects,
with copy-on-write forks, vLLM slot mappings, FlashInfer page tables and ollama-style
batched forwards ([`ForwardBatch`][kvrs.ForwardBatch]); evicted cached blocks can go to offload tiers
([`HostTier`][kvrs.HostTier], [`DiskTier`][kvrs.DiskTier], [`RedisTier`][kvrs.RedisTier]) and come back from
them; an inference engine's own pages go to the same tiers through [`PageStore`][kvrs.PageStore]
(``kvrs.integrations.sglang`` plugs it into SGLang's HiCache). Errors derive from
[`KvrsError`][kvrs.KvrsError] where they are kvrs-specific ([`CacheFullError`][kvrs.CacheFullError],
[`NotSupportedError`][kvrs.NotSupportedError], [`DeviceError`][kvrs.DeviceError]) and are plain
``ValueError`` / ``IndexError`` / ``TypeError`` otherwise.

kvrs logs to the ``kvrs`` logger (``logging.getLogger("kvrs")``, silent until the
application configures logging): tier failures, dropped write-backs.
"""

import atexit
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
    SuffixIndex,
    __version__,
    _flush_tiers_at_exit,
    attention_simd,
    blocks_per_sequence,
    cuda_available,
)
from kvrs._log import logger as _logger  # noqa: F401  (the "kvrs" logger, with its NullHandler)

# Blocks written through to a persistent tier reach it even when the process exits without
# closing its pools (which Python may never drop): at most 10 s.
atexit.register(_flush_tiers_at_exit)

Tier: TypeAlias = HostTier | DiskTier | RedisTier
"""Any offload tier, for annotations: ``tiers: list[kvrs.Tier] = [HostTier(...), RedisTier(...)]``
(a list of different tier classes is otherwise inferred as ``list[object]``)."""

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
    "SuffixIndex",
    "Tier",
    "__version__",
    "attention_simd",
    "blocks_per_sequence",
    "cuda_available",
]
