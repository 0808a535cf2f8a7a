"""kvrs as a whole vLLM KV connector: `KvrsConnector`, loaded by ``kv_connector_module_path``.

Where `KvrsSecondaryTier` sits under vLLM's CPU offloading tier, `KvrsConnector` is the
connector itself (``KVConnectorBase_V1`` with ``SupportsHMA``), the place LMCache's
connector takes: the scheduler side asks kvrs how many leading blocks of a prompt it holds
(vLLM's block hashes are the keys; the prompt's last token is always left to compute), and
the worker side copies those blocks from kvrs into vLLM's paged KV cache before the forward
(``start_load_kv``) and every newly filled block out of it after the forward
(``wait_for_save``). A block is one page: its bytes in every layer of the KV cache group,
layer by layer, sealed in a kvrs payload whose header and keyed MAC bind it to the engine's
facts (model, KV dtype and block geometry of every layer, TP/PP ranks, extra facts), the
namespace and vLLM's block hash. A block that fails to load (missing, torn, corrupted,
forged, another model's) is written nowhere and reported through
``get_block_ids_with_load_errors``, so vLLM recomputes it with
``kv_load_failure_policy="recompute"`` (or fails the request with ``"fail"``, its default).

Hybrid models (a KV cache group that is not full attention: sliding window, Mamba, linear
attention) are served no external hits and nothing is saved: their state is not restored
without its K/V, so they recompute, never load a partial state. A warning says so once.

Configuration (``--kv-transfer-config``)::

    {"kv_connector": "KvrsConnector", "kv_connector_module_path": "kvrs.integrations.vllm",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {
        "tiers": [{"type": "disk", "path": "/mnt/nvme/kvrs", "max_bytes": "500GiB"}],
        "tier_key_env": "KVRS_TIER_KEY", "namespace": "", "fingerprint": {"revision": "main"}}}

Tested with vLLM 0.33.0 (tests/engines).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import kvrs
from kvrs.integrations.engine_config import (
    DEFAULT_TIER_KEY_ENV,
    extra_facts,
    make_tiers,
    namespace_arg,
    tier_secret,
)

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found,import-untyped]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        SupportsHMA,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # type: ignore[import-not-found,import-untyped]
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvrs.integrations.vllm needs vLLM and torch ({e}): tested with vllm==0.33.0, installed by "
        "`make test-engines` (tests/engines/requirements.txt)"
    ) from e

__all__ = ["KvrsConnector", "KvrsConnectorMetadata", "connector_fingerprint"]

_logger = logging.getLogger(__name__)


def connector_fingerprint(vllm_config: Any, kv_cache_config: Any, extra: Any = None) -> dict[str, Any]:
    """The facts that identify the blocks of an engine configured by `vllm_config` whose KV
    cache is laid out by `kv_cache_config`, plus the deployment's `extra` facts."""
    par = vllm_config.parallel_config
    # vLLM's global rank: TP innermost, then PP.
    rank, tp = int(getattr(par, "rank", 0)), max(int(par.tensor_parallel_size), 1)
    groups = []
    page = 0
    for g in kv_cache_config.kv_cache_groups:
        s = g.kv_cache_spec
        groups.append(
            f"{type(s).__name__}:{s.block_size}:{getattr(s, 'num_kv_heads', '')}:"
            f"{getattr(s, 'head_size', '')}:{getattr(s, 'head_size_v', '')}:{s.dtype}:"
            f"{s.page_size_bytes}:{','.join(g.layer_names)}"
        )
        page += s.page_size_bytes * len(g.layer_names)
    fp: dict[str, Any] = {
        "engine": "vllm-connector",
        "model": str(vllm_config.model_config.model),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "kv_cache_layout": str(kv_cache_config.kv_cache_layout),
        "groups": ";".join(groups),
        "page_bytes": page,
        "tp_rank": rank % tp,
        "tp_size": tp,
        "pp_rank": rank // tp,
        "pp_size": int(par.pipeline_parallel_size),
        "dcp_size": int(getattr(par, "decode_context_parallel_size", 1)),
    }
    fp.update(extra_facts(extra))
    return fp


@dataclass
class _Transfer:
    """Blocks of one request to move: vLLM's block hashes (hex) and their block ids."""

    req_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class KvrsConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side tells the workers each step: blocks to load before the
    forward and blocks to save after it."""

    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class _Request:
    """The scheduler side's view of one running request."""

    request: Any
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading blocks known to be in kvrs
    computed: int = 0  # tokens computed once this step's forward is done
    load: tuple[int, int] | None = None  # (first block, blocks) kvrs matched


class KvrsConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector whose external cache is kvrs tiers, every block sealed and
    verified (see the module docs for the configuration)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.tiers = make_tiers(extra.get("tiers") or [])
        self.namespace = namespace_arg(extra.get("namespace", ""))
        groups = kv_cache_config.kv_cache_groups
        self.supported = len(groups) == 1 and type(groups[0].kv_cache_spec) is FullAttentionSpec
        if not self.supported:
            _logger.warning(
                "KvrsConnector: KV cache groups %s are not one full-attention group: no block is "
                "loaded from or saved to kvrs (the model's state is recomputed, never restored in part)",
                [type(g.kv_cache_spec).__name__ for g in groups],
            )
        self.block_size = int(groups[0].kv_cache_spec.block_size) if groups else 0
        self.layers = list(groups[0].layer_names) if groups else []
        fp = connector_fingerprint(vllm_config, kv_cache_config, extra.get("fingerprint"))
        self.page_bytes = int(fp["page_bytes"])
        self.store = kvrs.PageStore(
            self.tiers,
            fingerprint=fp,
            tier_key=tier_secret(extra.get("tier_key_env", DEFAULT_TIER_KEY_ENV), _logger),
        )
        # Scheduler side.
        self._requests: dict[str, _Request] = {}
        # Worker side: each layer's tensor and the dimension that indexes blocks.
        self._caches: list[tuple[torch.Tensor, int]] = []
        self._load_errors: set[int] = set()

    # -- scheduler side -----------------------------------------------------------------

    def _keys(self, request: Any, first: int, end: int) -> list[str]:
        return [bytes(h).hex() for h in request.block_hashes[first:end]]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.setdefault(request.request_id, _Request(request))
        state.load = None
        if not self.supported or self.block_size <= 0:
            return 0, False
        # Whole blocks of the prompt, leaving its last token to compute.
        blocks = min((request.num_prompt_tokens - 1) // self.block_size, len(request.block_hashes))
        hit = self.store.exists_prefix(self._keys(request, 0, blocks), namespace=self.namespace)
        state.saved = max(state.saved, hit)
        first = num_computed_tokens // self.block_size
        if hit <= first or num_computed_tokens % self.block_size:
            return 0, False
        state.load = (first, hit - first)
        return (hit - first) * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens <= 0 or state.load is None:
            state.load = None
            return
        first, n = state.load
        state.load = (first, min(n, num_external_tokens // self.block_size))

    def build_connector_meta(self, scheduler_output: Any) -> KvrsConnectorMetadata:
        meta = KvrsConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0]) if new.block_ids else []
            state.computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            if state.load is not None:
                first, n = state.load
                ids = state.block_ids[first : first + n]
                if len(ids) == n:
                    meta.loads.append(_Transfer(new.req_id, self._keys(state.request, first, first + n), ids))
                state.load = None
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            state.computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
        if self.supported:
            for req_id in scheduled:
                state = self._requests.get(req_id)
                if state is None:
                    continue
                full = min(
                    state.computed // self.block_size,
                    len(state.request.block_hashes),
                    len(state.block_ids),
                )
                if full > state.saved:
                    meta.saves.append(
                        _Transfer(
                            req_id,
                            self._keys(state.request, state.saved, full),
                            state.block_ids[state.saved : full],
                        )
                    )
                    state.saved = full
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.supported:
            return
        num_blocks = int(self._kv_cache_config.num_blocks)
        caches: list[tuple[torch.Tensor, int]] = []
        total = 0
        for name in self.layers:
            t = kv_caches.get(name)
            if t is None:
                raise ValueError(f"KvrsConnector: no KV cache registered for layer {name!r}")
            dims = [d for d in (0, 1) if t.dim() > d and t.shape[d] == num_blocks]
            if not dims:
                raise ValueError(
                    f"KvrsConnector: layer {name!r}'s KV cache {tuple(t.shape)} has no dimension of "
                    f"num_blocks={num_blocks} in its first two"
                )
            dim = dims[0]
            total += t.select(dim, 0).numel() * t.element_size()
            caches.append((t, dim))
        if total != self.page_bytes:
            raise ValueError(
                f"KvrsConnector: a block holds {total} bytes in the registered KV caches but the KV "
                f"cache config says {self.page_bytes}"
            )
        self._caches = caches

    def _staging(self, n: int) -> torch.Tensor:
        return torch.empty((n, self.page_bytes), dtype=torch.uint8)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvrsConnectorMetadata) or not self._caches:
            return
        for load in meta.loads:
            rows = self._staging(len(load.keys))
            got = self.store.get_into(load.keys, list(rows.numpy()), namespace=self.namespace)
            for ok, block, row in zip(got, load.block_ids, rows, strict=True):
                if not ok:
                    self._load_errors.add(int(block))
                    continue
                at = 0
                for t, dim in self._caches:
                    dst = t.select(dim, int(block))
                    n = dst.numel() * t.element_size()
                    dst.copy_(row[at : at + n].view(t.dtype).view(dst.shape))
                    at += n

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvrsConnectorMetadata) or not self._caches:
            return
        for save in meta.saves:
            rows = self._staging(len(save.keys))
            for block, row in zip(save.block_ids, rows, strict=True):
                at = 0
                for t, dim in self._caches:
                    src = t.select(dim, int(block))
                    n = src.numel() * t.element_size()
                    row[at : at + n].view(t.dtype).view(src.shape).copy_(src)
                    at += n
            stored = self.store.put_many(save.keys, list(rows.numpy()), namespace=self.namespace)
            if not all(stored):
                _logger.warning(
                    "KvrsConnector: stored %d of %d blocks of request %s (see the tiers' stats)",
                    sum(stored),
                    len(stored),
                    save.req_id,
                )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def kvrs_stats(self) -> dict[str, Any]:
        """The page store's counters and each kvrs tier's (for tools and tests)."""
        return self.store.stats()
