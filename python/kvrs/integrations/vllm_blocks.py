"""How `KvrsConnector` cuts kvrs pages out of vLLM's KV cache groups, and copies them.

Two kinds of page, each in its own `kvrs.PageStore` (its own fingerprint, so one is never
read as the other):

- a **K/V page** per block of ``block_size`` tokens: the block's bytes in every layer of
  every full-attention group, group by group, layer by layer, keyed by vLLM's hash of the
  block (which chains every token before it);
- a **state page** per block boundary of a hybrid model: the recurrent state (Mamba, GDN:
  vLLM's ``MambaSpec`` groups in ``mamba_cache_mode="align"``) after the boundary's last
  token, in every layer of every state group, keyed by the hash of the block that ends
  there.

A prefix of ``n`` blocks is restored only as a whole: its ``n`` K/V pages and, on a hybrid
model, the state page at its end. Groups of any other kind (sliding window, cross
attention, Mamba without ``align`` caching) make the layout unsupported: no block is
loaded or saved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

try:
    import torch
    from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found,import-untyped]
        FullAttentionSpec,
        MambaSpec,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvrs.integrations.vllm needs vLLM and torch ({e}): tested with vllm==0.33.0, installed by "
        "`make test-engines` (tests/engines/requirements.txt)"
    ) from e

from kvrs.integrations.engine_config import extra_facts

__all__ = ["BlockLayout", "PagedCaches", "connector_fingerprint"]


def _describe(spec: Any, layers: list[str]) -> str:
    """One group's geometry as the fingerprint records it."""
    kind = type(spec).__name__
    if isinstance(spec, MambaSpec):
        dtypes = ",".join(str(d) for d in spec.dtypes)
        return (
            f"{kind}:{spec.block_size}:{spec.shapes}:{dtypes}:{spec.mamba_type}:{spec.mamba_cache_mode}:"
            f"{spec.state_content_size_bytes}:{','.join(layers)}"
        )
    return (
        f"{kind}:{spec.block_size}:{getattr(spec, 'num_kv_heads', '')}:{getattr(spec, 'head_size', '')}:"
        f"{getattr(spec, 'head_size_v', '')}:{getattr(spec, 'dtype', '')}:{spec.page_size_bytes}:"
        f"{','.join(layers)}"
    )


@dataclass(frozen=True)
class BlockLayout:
    """Which of an engine's KV cache groups make K/V pages and which make state pages.

    Invariant (when `unsupported` is None): at least one full-attention group; every
    full-attention group has `block_size` tokens per block; every state group's block
    size is a multiple of it, and `align` (their least common multiple, or `block_size`)
    divides the length of every prefix that is loaded or whose state is saved."""

    block_size: int
    kv_groups: tuple[int, ...]
    state_groups: tuple[int, ...]
    state_block_sizes: tuple[int, ...]
    align: int
    kv_page_bytes: int
    state_page_bytes: int
    unsupported: str | None

    @property
    def hybrid(self) -> bool:
        """Whether a prefix needs a state page beside its K/V pages."""
        return bool(self.state_groups)

    @classmethod
    def of(cls, kv_cache_config: Any) -> BlockLayout:
        """The layout of an engine whose KV cache is configured by `kv_cache_config`."""
        groups = kv_cache_config.kv_cache_groups
        kv, state, others = [], [], []
        for i, g in enumerate(groups):
            s = g.kv_cache_spec
            if type(s) is FullAttentionSpec:
                kv.append(i)
            elif isinstance(s, MambaSpec) and s.mamba_cache_mode == "align":
                state.append(i)
            else:
                mode = f"({s.mamba_cache_mode})" if isinstance(s, MambaSpec) else ""
                others.append(f"{type(s).__name__}{mode}")
        block_sizes = {int(groups[i].kv_cache_spec.block_size) for i in kv}
        block_size = min(block_sizes) if block_sizes else 0
        state_sizes = tuple(int(groups[i].kv_cache_spec.block_size) for i in state)
        unsupported = None
        if others:
            unsupported = (
                f"groups of kinds {others} (only full attention and Mamba/GDN with mamba_cache_mode='align')"
            )
        elif not kv:
            unsupported = "no full-attention group"
        elif len(block_sizes) > 1:
            unsupported = f"full-attention groups of block sizes {sorted(block_sizes)}"
        elif any(b % block_size for b in state_sizes):
            unsupported = f"state block sizes {state_sizes} that are not multiples of {block_size}"
        align = math.lcm(block_size, *state_sizes) if block_size else 0

        def page(ids: list[int], size: Any) -> int:
            return sum(size(groups[i].kv_cache_spec) * len(groups[i].layer_names) for i in ids)

        return cls(
            block_size=block_size,
            kv_groups=tuple(kv),
            state_groups=tuple(state),
            state_block_sizes=state_sizes,
            align=align,
            kv_page_bytes=page(kv, lambda s: s.page_size_bytes),
            state_page_bytes=page(state, lambda s: s.state_content_size_bytes),
            unsupported=unsupported,
        )

    def state_blocks(self, boundary: int, block_ids: tuple[list[int], ...]) -> tuple[int, ...] | None:
        """The block of each state group that holds the state after `boundary` tokens,
        given a request's block ids per group; None if one is missing or the null block."""
        out = []
        for g, size in zip(self.state_groups, self.state_block_sizes, strict=True):
            i = boundary // size - 1
            ids = block_ids[g]
            if i < 0 or i >= len(ids) or ids[i] == 0:
                return None
            out.append(int(ids[i]))
        return tuple(out)

    def kv_blocks(
        self, first: int, end: int, block_ids: tuple[list[int], ...]
    ) -> list[tuple[int, ...]] | None:
        """Blocks `first..end` of every full-attention group, per block; None if a group
        holds fewer or one of them is the null block."""
        out = []
        for b in range(first, end):
            row = []
            for g in self.kv_groups:
                ids = block_ids[g]
                if b >= len(ids) or ids[b] == 0:
                    return None
                row.append(int(ids[b]))
            out.append(tuple(row))
        return out


def connector_fingerprint(vllm_config: Any, kv_cache_config: Any, extra: Any = None) -> dict[str, Any]:
    """The facts that identify the K/V pages of an engine configured by `vllm_config` whose KV
    cache is laid out by `kv_cache_config`, plus the deployment's `extra` facts (state pages
    add ``"page": "state"`` and their own ``page_bytes``)."""
    par = vllm_config.parallel_config
    # vLLM's global rank: TP innermost, then PP.
    rank, tp = int(getattr(par, "rank", 0)), max(int(par.tensor_parallel_size), 1)
    layout = BlockLayout.of(kv_cache_config)
    groups = kv_cache_config.kv_cache_groups
    fp: dict[str, Any] = {
        "engine": "vllm-connector",
        "model": str(vllm_config.model_config.model),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "kv_cache_layout": str(kv_cache_config.kv_cache_layout),
        "groups": ";".join(_describe(g.kv_cache_spec, list(g.layer_names)) for g in groups),
        "page_bytes": layout.kv_page_bytes,
        "tp_rank": rank % tp,
        "tp_size": tp,
        "pp_rank": rank // tp,
        "pp_size": int(par.pipeline_parallel_size),
        "dcp_size": int(getattr(par, "decode_context_parallel_size", 1)),
    }
    fp.update(extra_facts(extra))
    return fp


_Slot = tuple[torch.Tensor, int]
"""A layer's tensor and the dimension that indexes its blocks."""


class PagedCaches:
    """The worker's KV cache tensors of the groups that make one kind of page, and the
    copies between their blocks and a page's bytes."""

    def __init__(self, groups: list[list[_Slot]], page_bytes: int) -> None:
        self.groups = groups
        self.page_bytes = page_bytes

    @classmethod
    def register(
        cls,
        kv_caches: dict[str, Any],
        kv_cache_config: Any,
        group_ids: tuple[int, ...],
        page_bytes: int,
        state: bool,
    ) -> PagedCaches:
        """The tensors of `group_ids`' layers in `kv_caches` (vLLM's registered caches: one
        tensor per attention layer with its blocks in dimension 0 or 1, a list of tensors
        per Mamba layer with their blocks in dimension 0), checked to hold `page_bytes` per
        block in all."""
        num_blocks = int(kv_cache_config.num_blocks)
        groups: list[list[_Slot]] = []
        total = 0
        for gi in group_ids:
            slots: list[_Slot] = []
            for name in kv_cache_config.kv_cache_groups[gi].layer_names:
                entry = kv_caches.get(name)
                if entry is None:
                    raise ValueError(f"KvrsConnector: no KV cache registered for layer {name!r}")
                tensors = list(entry) if isinstance(entry, (list, tuple)) else [entry]
                for t in tensors:
                    where = (0,) if state else (0, 1)
                    dims = [d for d in where if t.dim() > d and t.shape[d] == num_blocks]
                    if len(dims) != 1:
                        why = "no dimension" if not dims else "two dimensions (which holds the blocks?)"
                        raise ValueError(
                            f"KvrsConnector: layer {name!r}'s cache {tuple(t.shape)} has {why} of "
                            f"num_blocks={num_blocks} where vLLM puts it"
                        )
                    total += t.select(dims[0], 0).numel() * t.element_size()
                    slots.append((t, dims[0]))
            groups.append(slots)
        if total != page_bytes:
            raise ValueError(
                f"KvrsConnector: a {'state' if state else 'K/V'} page holds {total} bytes in the "
                f"registered caches but the KV cache config says {page_bytes}"
            )
        return cls(groups, page_bytes)

    def staging(self, n: int) -> torch.Tensor:
        """Rows for `n` pages."""
        return torch.empty((n, self.page_bytes), dtype=torch.uint8)

    def gather(self, blocks: tuple[int, ...], row: torch.Tensor) -> None:
        """Copies block `blocks[g]` of each group `g` into the page `row`."""
        at = 0
        for slots, block in zip(self.groups, blocks, strict=True):
            for t, dim in slots:
                src = t.select(dim, block)
                n = src.numel() * t.element_size()
                row[at : at + n].view(t.dtype).view(src.shape).copy_(src)
                at += n

    def scatter(self, row: torch.Tensor, blocks: tuple[int, ...]) -> None:
        """Copies the page `row` into block `blocks[g]` of each group `g`."""
        at = 0
        for slots, block in zip(self.groups, blocks, strict=True):
            for t, dim in slots:
                dst = t.select(dim, block)
                n = dst.numel() * t.element_size()
                dst.copy_(row[at : at + n].view(t.dtype).view(dst.shape))
                at += n
