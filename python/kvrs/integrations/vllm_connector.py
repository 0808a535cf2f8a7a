"""kvrs as a whole vLLM KV connector: `KvrsConnector`, loaded by ``kv_connector_module_path``.

Where `KvrsSecondaryTier` sits under vLLM's CPU offloading tier, `KvrsConnector` is the
connector itself (``KVConnectorBase_V1`` with ``SupportsHMA``), the place LMCache's
connector takes: the scheduler side asks kvrs how many leading blocks of a prompt it holds
(vLLM's block hashes are the keys; the prompt's last token is always left to compute), and
the worker side copies those blocks from kvrs into vLLM's paged KV cache before the forward
(``start_load_kv``) and every newly filled block out of it after the forward
(``wait_for_save``). Pages are sealed in kvrs payloads whose header and keyed MAC bind them
to the engine's facts (model, KV dtype, geometry of every group and layer, TP/PP ranks,
extra facts), the namespace and vLLM's block hash (`kvrs.integrations.vllm_blocks`).

Full-attention models (one KV cache group): a block that fails to load (missing, torn,
corrupted, forged, another model's) is written nowhere and reported through
``get_block_ids_with_load_errors``, so vLLM recomputes from it with
``kv_load_failure_policy="recompute"`` (or fails the request with ``"fail"``, its default).

Hybrid models (full attention with Mamba/GDN groups in ``mamba_cache_mode="align"``, the
mode vLLM's prefix caching gives them): a prefix of ``n`` blocks is matched only where
kvrs holds its ``n`` K/V pages *and* the recurrent state after its last token (saved from
the exact state blocks vLLM hands its connectors, ``boundary_state_offloads``), and it is
loaded as a whole or not at all: the loads are asynchronous as vLLM requires for several
groups, and a failure is reported per request (``failed_recving``), so vLLM recomputes the
prompt; never K/V without its state, never a state without its K/V. Other groups (sliding
window, Mamba without ``align``) get no external hits and nothing is saved (a warning says
so once).

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
from kvrs.integrations.engine_config import DEFAULT_TIER_KEY_ENV, make_tiers, namespace_arg, tier_secret
from kvrs.integrations.vllm_blocks import BlockLayout, PagedCaches, connector_fingerprint

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found,import-untyped]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorTransferResults,
        SupportsHMA,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvrs.integrations.vllm needs vLLM and torch ({e}): tested with vllm==0.33.0, installed by "
        "`make test-engines` (tests/engines/requirements.txt)"
    ) from e

__all__ = ["MAX_LOADS", "KvrsConnector", "KvrsConnectorMetadata", "connector_fingerprint"]

_logger = logging.getLogger(__name__)

MAX_LOADS = 2
"""Asynchronous (hybrid) loads one request may be issued: after a failed load vLLM asks
again, and the retry finds only what still verifies (a failed page is discarded); a
bound keeps a page that fails without going away from making it ask forever."""


@dataclass
class _Transfer:
    """Pages of one request to move: their keys (vLLM's block hashes, hex) and, per page,
    its block in each group the page is cut from."""

    req_id: str
    keys: list[str]
    blocks: list[tuple[int, ...]]


@dataclass
class _Load:
    """A prefix to load: its K/V pages and, on a hybrid model, the state at its end (loaded
    together or not at all). `failed`: an asynchronous load the scheduler side could not
    place (the workers report it failed at once, so the request never waits for it)."""

    kv: _Transfer
    state: _Transfer | None = None
    failed: bool = False


@dataclass
class KvrsConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side tells the workers each step: prefixes to load before the
    forward, and K/V and state pages to save after it."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)
    state_saves: list[_Transfer] = field(default_factory=list)


@dataclass
class _Request:
    """The scheduler side's view of one running request."""

    request: Any
    block_ids: list[int] = field(default_factory=list)  # its one group's (single-group models)
    saved: int = 0  # leading blocks known to be in kvrs
    computed: int = 0  # tokens computed once this step's forward is done
    load: tuple[int, int] | None = None  # (first block, blocks) kvrs matched
    pending: _Load | None = None  # a hybrid load allocated, not yet sent to the workers
    loads: int = 0  # hybrid loads issued (a request gets at most MAX_LOADS)


class KvrsConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector whose external cache is kvrs tiers, every page sealed and
    verified (see the module docs for the configuration)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.tiers = make_tiers(extra.get("tiers") or [])
        self.namespace = namespace_arg(extra.get("namespace", ""))
        self.layout = BlockLayout.of(kv_cache_config)
        self.supported = self.layout.unsupported is None
        if not self.supported:
            _logger.warning(
                "KvrsConnector: the KV cache has %s: no block is loaded from or saved to kvrs (the "
                "model's state is recomputed, never restored in part)",
                self.layout.unsupported,
            )
        self.block_size = self.layout.block_size
        fp = connector_fingerprint(vllm_config, kv_cache_config, extra.get("fingerprint"))
        secret = tier_secret(extra.get("tier_key_env", DEFAULT_TIER_KEY_ENV), _logger)
        self.store = kvrs.PageStore(self.tiers, fingerprint=fp, tier_key=secret)
        self.state_store = (
            kvrs.PageStore(
                self.tiers,
                fingerprint={**fp, "page": "state", "page_bytes": self.layout.state_page_bytes},
                tier_key=secret,
            )
            if self.layout.hybrid and self.supported
            else None
        )
        # Scheduler side.
        self._requests: dict[str, _Request] = {}
        # Worker side.
        self._kv: PagedCaches | None = None
        self._states: PagedCaches | None = None
        self._load_errors: set[int] = set()
        self._recved: set[str] = set()
        self._failed: set[str] = set()

    # -- scheduler side -----------------------------------------------------------------

    def _keys(self, request: Any, first: int, end: int) -> list[str]:
        return [bytes(h).hex() for h in request.block_hashes[first:end]]

    def _hashed_whole(self, request: Any) -> bool:
        """Whether `request`'s block hashes are one per `block_size` tokens (the keys'
        meaning); a request hashed otherwise is neither loaded nor saved."""
        return len(request.block_hashes) == request.num_tokens // self.block_size

    def _state_hit(self, request: Any, first: int, hit: int) -> int:
        """The longest prefix of at most `hit` blocks, past block `first`, ending on an
        aligned boundary whose state kvrs holds (0 if none)."""
        assert self.state_store is not None
        step = self.layout.align // self.block_size
        ends = list(range(hit - hit % step, first, -step))  # longest first, one batched ask
        keys = [bytes(request.block_hashes[n - 1]).hex() for n in ends]
        held = self.state_store.exists_many(keys, namespace=self.namespace)
        return next((n for n, h in zip(ends, held, strict=True) if h), 0)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.setdefault(request.request_id, _Request(request))
        state.load = None
        if not self.supported or self.block_size <= 0 or not self._hashed_whole(request):
            return 0, False
        # Whole blocks of the prompt, leaving its last token to compute.
        blocks = min((request.num_prompt_tokens - 1) // self.block_size, len(request.block_hashes))
        hit = self.store.exists_prefix(self._keys(request, 0, blocks), namespace=self.namespace)
        state.saved = max(state.saved, hit)
        first = num_computed_tokens // self.block_size
        if num_computed_tokens % self.layout.align:
            return 0, False
        if self.layout.hybrid:
            if state.loads >= MAX_LOADS:
                return 0, False
            hit = self._state_hit(request, first, hit)
        if hit <= first:
            return 0, False
        state.load = (first, hit - first)
        # Several groups: vLLM takes per-request failures only from asynchronous loads.
        return (hit - first) * self.block_size, self.layout.hybrid

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens <= 0 or state.load is None:
            state.load = None
            return
        first, n = state.load
        state.load = (first, min(n, num_external_tokens // self.block_size))
        if self.layout.hybrid:
            state.pending = self._hybrid_load(state, blocks.get_block_ids())
            state.loads += 1
            state.load = None

    def _hybrid_load(self, state: _Request, block_ids: tuple[list[int], ...]) -> _Load:
        """The load of a hybrid request's matched prefix into the blocks vLLM allocated
        (one marked failed when they do not hold it: vLLM is waiting for it either way)."""
        assert state.load is not None
        first, n = state.load
        end = first + n
        kv = self.layout.kv_blocks(first, end, block_ids)
        states = self.layout.state_blocks(end * self.block_size, block_ids)
        req = state.request
        if kv is None or states is None or (end * self.block_size) % self.layout.align:
            return _Load(_Transfer(req.request_id, [], []), failed=True)
        return _Load(
            _Transfer(req.request_id, self._keys(req, first, end), kv),
            _Transfer(req.request_id, self._keys(req, end - 1, end), [states]),
        )

    def build_connector_meta(self, scheduler_output: Any) -> KvrsConnectorMetadata:
        meta = KvrsConnectorMetadata()
        if not self.supported:
            return meta
        if self.layout.hybrid:
            self._hybrid_meta(scheduler_output, meta)
        else:
            self._single_group_meta(scheduler_output, meta)
        return meta

    def _single_group_meta(self, scheduler_output: Any, meta: KvrsConnectorMetadata) -> None:
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
                    keys = self._keys(state.request, first, first + n)
                    meta.loads.append(_Load(_Transfer(new.req_id, keys, [(b,) for b in ids])))
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
        for req_id in scheduled:
            state = self._requests.get(req_id)
            if state is None:
                continue
            hashes = len(state.request.block_hashes)
            full = min(state.computed // self.block_size, hashes, len(state.block_ids))
            if full > state.saved:
                keys = self._keys(state.request, state.saved, full)
                blocks: list[tuple[int, ...]] = [(b,) for b in state.block_ids[state.saved : full]]
                meta.saves.append(_Transfer(req_id, keys, blocks))
                state.saved = full

    def _hybrid_meta(self, scheduler_output: Any, meta: KvrsConnectorMetadata) -> None:
        """Loads allocated since the last step; the K/V blocks filled by this step's
        forward and the states vLLM hands off at block boundaries, read from the exact
        block ids vLLM's block state gives (never tracked positionally)."""
        for waiting in self._requests.values():
            if waiting.pending is not None:
                meta.loads.append(waiting.pending)
                waiting.pending = None
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is None:
            return
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, n_tokens in scheduled.items():
            state = self._requests.get(req_id)
            ids = block_state.get_block_ids(req_id)
            if state is None or ids is None or not self._hashed_whole(state.request):
                continue
            req = state.request
            full = min((req.num_computed_tokens + n_tokens) // self.block_size, len(req.block_hashes))
            if full > state.saved:
                kv = self.layout.kv_blocks(state.saved, full, ids)
                if kv is not None:
                    meta.saves.append(_Transfer(req_id, self._keys(req, state.saved, full), kv))
                    state.saved = full
        for req_id, entries in block_state.boundary_state_offloads.items():
            state = self._requests.get(req_id)
            if state is None or not self._hashed_whole(state.request):
                continue
            self._state_saves(state.request, entries, meta)

    def _state_saves(
        self, request: Any, entries: list[tuple[int, int, int]], meta: KvrsConnectorMetadata
    ) -> None:
        """State pages for the boundaries at which every state group handed off its block."""
        by_boundary: dict[int, dict[int, int]] = {}
        for group, block, boundary in entries:
            by_boundary.setdefault(int(boundary), {})[int(group)] = int(block)
        for boundary, blocks in sorted(by_boundary.items()):
            n = boundary // self.block_size
            if boundary % self.layout.align or not 0 < n <= len(request.block_hashes):
                continue
            if any(blocks.get(g, 0) == 0 for g in self.layout.state_groups):
                continue
            row = tuple(blocks[g] for g in self.layout.state_groups)
            meta.state_saves.append(_Transfer(request.request_id, self._keys(request, n - 1, n), [row]))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if not self.supported:
            return
        cfg = self._kv_cache_config
        layout = self.layout
        self._kv = PagedCaches.register(kv_caches, cfg, layout.kv_groups, layout.kv_page_bytes, False)
        if self.layout.hybrid:
            self._states = PagedCaches.register(
                kv_caches, cfg, self.layout.state_groups, self.layout.state_page_bytes, True
            )

    def _fetch(self, store: Any, caches: PagedCaches, t: _Transfer) -> tuple[Any, list[bool]]:
        rows = caches.staging(len(t.keys))
        got = store.get_into(t.keys, list(rows.numpy()), namespace=self.namespace)
        return rows, got

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvrsConnectorMetadata) or self._kv is None:
            return
        for load in meta.loads:
            if load.failed:
                self._recved.add(load.kv.req_id)
                self._failed.add(load.kv.req_id)
            elif load.state is None:
                self._load_blocks(load.kv)
            else:
                self._load_prefix(load)

    def _load_blocks(self, t: _Transfer) -> None:
        """Single group: every verified block is written; a failed one is a load error."""
        assert self._kv is not None
        rows, got = self._fetch(self.store, self._kv, t)
        for ok, blocks, row in zip(got, t.blocks, rows, strict=True):
            if ok:
                self._kv.scatter(row, blocks)
            else:
                self._load_errors.update(blocks)

    def _load_prefix(self, load: _Load) -> None:
        """Hybrid: the K/V pages and the state are written only if every one verified;
        otherwise nothing is and the request's receive failed."""
        assert self._kv is not None and self._states is not None and load.state is not None
        assert self.state_store is not None
        rows, got = self._fetch(self.store, self._kv, load.kv)
        ok = all(got)
        if ok:
            state_rows, state_got = self._fetch(self.state_store, self._states, load.state)
            ok = all(state_got)
        req_id = load.kv.req_id
        self._recved.add(req_id)
        if not ok:
            self._failed.add(req_id)
            return
        for row, blocks in zip(rows, load.kv.blocks, strict=True):
            self._kv.scatter(row, blocks)
        self._states.scatter(state_rows[0], load.state.blocks[0])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def _save(self, store: Any, caches: PagedCaches, t: _Transfer, what: str) -> None:
        rows = caches.staging(len(t.keys))
        for blocks, row in zip(t.blocks, rows, strict=True):
            caches.gather(blocks, row)
        stored = store.put_many(t.keys, list(rows.numpy()), namespace=self.namespace)
        if not all(stored):
            _logger.warning(
                "KvrsConnector: stored %d of %d %s pages of request %s (see the tiers' stats)",
                sum(stored),
                len(stored),
                what,
                t.req_id,
            )

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvrsConnectorMetadata) or self._kv is None:
            return
        for save in meta.saves:
            self._save(self.store, self._kv, save, "K/V")
        if self._states is not None and self.state_store is not None:
            for save in meta.state_saves:
                self._save(self.state_store, self._states, save, "state")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The hybrid loads done since the last call, the failed ones among them (a failed
        receive is also a finished one, as vLLM expects)."""
        recved, self._recved = self._recved, set()
        failed, self._failed = self._failed, set()
        return KVConnectorTransferResults(finished_recving=recved, failed_recving=failed)

    def kvrs_stats(self) -> dict[str, Any]:
        """The K/V page store's counters and each kvrs tier's (for tools and tests)."""
        return self.store.stats()
