"""`HostArray`: the NumPy array kvrs returns for bfloat16 and fp8 data, which exports
itself through DLPack (NumPy refuses to for ml_dtypes' dtypes), so that
``torch.from_dlpack(view)`` works for every view and copy kvrs hands out."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from kvrs import _kvrs

_KVRS_ONLY = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})
"""The ml_dtypes dtypes NumPy will not export through DLPack: kvrs exports them."""


class HostArray(np.ndarray):  # type: ignore[type-arg]  # the dtype varies per array
    """A NumPy array of a kvrs storage dtype (bfloat16, float8_e4m3fn, float8_e5m2)
    whose ``__dlpack__`` exports its memory without a copy. Slices and views of it are
    HostArrays too; everything else is NumPy's own behaviour."""

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule over this array's memory (versioned when `max_version` >=
        (1, 0); a read-only array is exported only as such). `stream` is unused on the
        host. Arrays of NumPy's own dtypes (what `view > 0` or `.astype` make of a
        HostArray) are exported by NumPy."""
        if self.dtype.name not in _KVRS_ONLY:
            return super().__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)
        return _kvrs._host_array_capsule(self, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[Literal[1], Literal[0]]:
        """``(1, 0)``: DLPack's CPU device."""
        return (1, 0)
