"""kvrs: KV-cache storage for LLM inference, with a Rust core.

The contiguous cache (:class:`KVCache`) preallocates K and V for every layer and hands
them out as zero-copy NumPy views. Errors derive from :class:`KvrsError` where they are
kvrs-specific (:class:`CacheFullError`, :class:`NotSupportedError`, :class:`DeviceError`)
and are plain ``ValueError`` / ``IndexError`` / ``TypeError`` otherwise.
"""

from kvrs._kvrs import (
    CacheFullError,
    DeviceError,
    KVCache,
    KvrsError,
    NotSupportedError,
    __version__,
)

__all__ = [
    "CacheFullError",
    "DeviceError",
    "KVCache",
    "KvrsError",
    "NotSupportedError",
    "__version__",
]
