"""kvrs as SGLang's HiCache L3 storage: `KvrsHiCacheStorage`, loaded by SGLang's
``--hicache-storage-backend dynamic``.

Each host pool SGLang registers (the KV pool, and with the v2 interface its other pools:
Mamba, SWA, indexer, ...) gets a [`kvrs.PageStore`][kvrs.PageStore] over the configured tiers, whose
fingerprint is built from the engine's facts: model, pool, host-pool class, KV dtype,
layout, tokens per page, page bytes, layers, heads, TP/PP/CP ranks (TP left out for an MLA
model's KV pool, which every TP rank shares, as SGLang's own file backend does), plus any
facts the deployment adds (``"fingerprint": {"revision": ...}``). A page is one flat page
of the host pool (``get_data_page(index, flat=True)``: the bytes ``HiCacheFile`` writes),
sealed with that fingerprint, its namespace and its key under the secret read from the
environment variable named by ``tier_key_env``. A lookup loads a page only when all of
them match, so a page of another model, dtype, layout, rank or tenant, or a torn,
corrupted or forged one, is a miss (SGLang recomputes it), never wrong K/V.

Interfaces: the legacy one (``get``/``set``/``batch_get``/``batch_set``/``exists``/
``batch_exists``), v1 (``batch_get_v1``/``batch_set_v1``, turned on with
``"interface_v1": 1``) and v2 (``batch_exists_v2``/``batch_get_v2``/``batch_set_v2`` with
``ALL_PAGES`` and ``TRAILING_PAGES`` pools; ``BLOCK_GROUPS`` pools are never reported
present).

Namespaces: SGLang 0.5.23 passes no tenant to a storage backend; it seeds each request's
page-hash chain with ``cache_salt`` and ``extra_key`` itself
(``sglang.srt.mem_cache.utils.storage_namespace_seed``), so salted requests already use
disjoint keys. kvrs files every page under the ``namespace`` of the backend's config
(default: none), and, where a caller passes one in
``HiCacheStorageExtraInfo.extra_info["cache_salt"]``, under that salt as well, so that
``drop_namespace`` removes one tenant and a tenant's pages fail every other's MAC.

Configuration (``--hicache-storage-backend-extra-config``)::

    {"backend_name": "kvrs", "module_path": "kvrs.integrations.sglang",
     "class_name": "KvrsHiCacheStorage", "interface_v1": 1,
     "tiers": [{"type": "disk", "path": "/mnt/nvme/kvrs", "max_bytes": "500GiB"}],
     "tier_key_env": "KVRS_TIER_KEY", "namespace": "", "fingerprint": {"revision": "main"}}

Tested with SGLang 0.5.23 (``make test-engines``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
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
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found,import-untyped]
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvrs.integrations.sglang needs SGLang and torch ({e}): tested with sglang==0.5.23, "
        "installed by `make test-engines` (tests/engines/requirements.txt)"
    ) from e

__all__ = ["TESTED_SGLANG", "KvrsHiCacheStorage", "make_tiers", "pool_fingerprint"]

_logger = logging.getLogger(__name__)

#: The SGLang version this adapter is tested with.
TESTED_SGLANG = "0.5.23"


def _page_bytes(pool: Any) -> int:
    page = pool.get_dummy_flat_data_page()
    return int(page.numel() * page.element_size())


def pool_fingerprint(
    config: Any, pool: Any, pool_name: str, extra: Mapping[str, Any] | None = None
) -> dict[str, str | int | bool]:
    """The facts that identify the pages of host pool `pool` (registered as `pool_name`)
    of an engine configured by `config` (a ``HiCacheStorageConfig``), plus `extra`."""
    name = str(pool_name)
    fp: dict[str, str | int | bool] = {
        "engine": "sglang",
        "model": config.model_name or "",
        "pool": name,
        "pool_class": type(pool).__name__,
        "kv_dtype": str(pool.dtype),
        "layout": str(pool.layout),
        "page_size": int(pool.page_size),
        "page_bytes": _page_bytes(pool),
        "pp_rank": int(config.pp_rank),
        "pp_size": int(config.pp_size),
        "attn_cp_rank": int(config.attn_cp_rank),
        "attn_cp_size": int(config.attn_cp_size),
    }
    for attr in ("layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim"):
        v = getattr(pool, attr, None)
        if isinstance(v, int):
            fp[attr] = v
    # An MLA model's KV is the same on every TP rank (one copy shared, as HiCacheFile
    # does); everything else is a TP shard.
    if not (config.is_mla_model and name == str(PoolName.KV)):
        fp["tp_rank"] = int(config.tp_rank)
        fp["tp_size"] = int(config.tp_size)
    if getattr(config, "dcp_size", 1) > 1:
        fp["dcp_rank"] = int(config.dcp_rank)
        fp["dcp_size"] = int(config.dcp_size)
        fp["logical_page_size"] = int(config.logical_page_size)
    fp.update(extra_facts(extra))
    return fp


def _runs(t: torch.Tensor) -> list[torch.Tensor]:
    """`t`'s elements, in order, as the fewest contiguous tensors that split it along
    its leading dimensions."""
    if t.is_contiguous():
        return [t]
    return [run for sub in t.unbind(0) for run in _runs(sub)]


class _Pool:
    """A registered host pool and the page store of its pages."""

    def __init__(self, host: Any, store: kvrs.PageStore) -> None:
        self.host = host
        self.store = store
        self.page_size = int(host.page_size)
        self.page_bytes = _page_bytes(host)
        buffers = getattr(host, "kv_buffer", None)
        buffers = buffers if isinstance(buffers, (list, tuple)) else [buffers]
        # The memory the pool's pages live in: a page view outside it is a copy.
        self.storages = {b.untyped_storage().data_ptr() for b in buffers if isinstance(b, torch.Tensor)}

    def read(self, offsets: list[int]) -> torch.Tensor:
        """The flat pages at host `offsets`, one uint8 row each (one copy)."""
        out = torch.empty((len(offsets), self.page_bytes), dtype=torch.uint8)
        for row, at in zip(out, offsets, strict=True):
            page = self.host.get_data_page(at, flat=False)
            row.view(page.dtype).view(page.shape).copy_(page)
        return out

    def offsets(self, host_indices: torch.Tensor, count: int) -> list[int] | None:
        """The first host index of each of `count` pages, or None when the indices do
        not cover exactly `count` pages."""
        if host_indices is None or host_indices.numel() != count * self.page_size:
            return None
        return [int(i) for i in host_indices[:: self.page_size].tolist()]

    def put(self, keys: list[str], offsets: list[int], ns: str) -> list[bool]:
        pages = self.read(offsets).numpy()
        return self.store.put_many(keys, list(pages), namespace=ns)

    def segments(self, offset: int) -> list[Any] | None:
        """The page at host `offset` as its contiguous runs in the host pool, in the
        order of its flat bytes (page_first: the K run and the V run; layer_first: one
        per layer and K/V), each a writable uint8 view; None when the pool hands out a
        copy rather than a view of its memory."""
        runs = _runs(self.host.get_data_page(offset, flat=False))
        if any(r.untyped_storage().data_ptr() not in self.storages for r in runs):
            return None
        return [r.view(torch.uint8).reshape(-1).numpy() for r in runs]

    def write(self, offset: int, row: torch.Tensor) -> None:
        """Writes one flat page (a uint8 row) at host `offset`."""
        self.host.set_from_flat_data_page(offset, row.view(self.host.dtype))

    def get(self, keys: list[str], offsets: list[int], ns: str) -> list[bool]:
        """Loads each verified page straight into its runs in the host pool (through a
        staging row where the pool gives no view of a page); a miss touches nothing."""
        dests: list[Any] = []
        staged: dict[int, torch.Tensor] = {}
        for j, at in enumerate(offsets):
            segs = self.segments(at)
            if segs is None:
                staged[j] = torch.empty(self.page_bytes, dtype=torch.uint8)
            dests.append(segs if segs is not None else staged[j].numpy())
        got = list(self.store.get_into(keys, dests, namespace=ns))
        for j, row in staged.items():
            if got[j]:
                self.write(offsets[j], row)
        return got

    def present(self, keys: list[str], ns: str) -> list[bool]:
        return self.store.exists_many(keys, namespace=ns)


class KvrsHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang HiCache L3 storage in kvrs tiers, with every page sealed and verified (see
    the module docs for the configuration)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.tiers = make_tiers(extra.get("tiers") or [])
        self._secret = tier_secret(extra.get("tier_key_env", DEFAULT_TIER_KEY_ENV), _logger)
        self.namespace = namespace_arg(extra.get("namespace", ""))
        self._extra_facts = extra.get("fingerprint") or {}
        extra_facts(self._extra_facts)  # checked here, at start-up
        self._pools: dict[str, _Pool] = {}
        self._namespaces: set[str] = {self.namespace}
        self.registered_pools: dict[Any, Any] = {}

    # -- pools ---------------------------------------------------------------------------

    def _attach(self, host: Any, name: str) -> _Pool:
        known = self._pools.get(name)
        if known is not None and known.host is host:
            return known
        fp = pool_fingerprint(self.storage_config, host, name, self._extra_facts)
        store = kvrs.PageStore(self.tiers, fingerprint=fp, tier_key=self._secret)
        pool = _Pool(host, store)
        self._pools[name] = pool
        return pool

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._attach(mem_pool_host, str(PoolName.KV))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._attach(host_pool, str(host_pool_name))

    def _kv(self) -> _Pool:
        pool = self._pools.get(str(PoolName.KV))
        if pool is None:
            raise RuntimeError("KvrsHiCacheStorage: no KV host pool registered yet")
        return pool

    def store_of(self, pool_name: Any = "kv") -> kvrs.PageStore:
        """The page store of a registered pool (for tools and tests)."""
        return self._pools[str(pool_name)].store

    def _ns(self, extra_info: Any = None) -> str:
        info = getattr(extra_info, "extra_info", None)
        salt = info.get("cache_salt") if isinstance(info, Mapping) else None
        if salt is None:
            return self.namespace
        ns = f"{self.namespace}\x00{salt}"
        self._namespaces.add(ns)
        return ns

    # -- legacy interface ------------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        got = self.batch_get([key], [target_location])
        return got[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        pool = self._kv()
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        bufs = [t if t is not None else pool.host.get_dummy_flat_data_page() for t in targets]
        views = [b.view(torch.uint8).numpy() for b in bufs]
        got = pool.store.get_into(keys, views, namespace=self._ns())
        return [b if ok else None for b, ok in zip(bufs, got, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        pool = self._kv()
        pages = [v.contiguous().view(torch.uint8).numpy() for v in values]
        return all(pool.store.put_many(keys, pages, namespace=self._ns()))

    def exists(self, key: str) -> bool:
        return self._kv().store.exists_prefix([key], namespace=self._ns()) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self._kv().store.exists_prefix(keys, namespace=self._ns(extra_info))

    # -- v1 (zero-copy interface: host indices) ---------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        pool = self._kv()
        offsets = pool.offsets(host_indices, len(keys))
        if offsets is None:
            _logger.error("kvrs batch_get_v1: %d keys for %s host indices", len(keys), host_indices.numel())
            return [False] * len(keys)
        return pool.get(keys, offsets, self._ns(extra_info))

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        pool = self._kv()
        offsets = pool.offsets(host_indices, len(keys))
        if offsets is None:
            _logger.error("kvrs batch_set_v1: %d keys for %s host indices", len(keys), host_indices.numel())
            return [False] * len(keys)
        return pool.put(keys, offsets, self._ns(extra_info))

    # -- v2 (several pools per page) ---------------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        ns = self._ns(extra_info)
        kv_pages = self._kv().store.exists_prefix(keys, namespace=ns)
        hits: dict[str, int] = {str(PoolName.KV): kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            pool = self._pools.get(name)
            have = pool.present(keys[:kv_pages], ns) if pool is not None else [False] * kv_pages
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = have.index(False) if False in have else kv_pages
                ok = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                ok = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - trailing) : n])}
                boundary = max(ok, default=0)
            else:
                # BLOCK_GROUPS: not supported by this adapter: never claimed.
                ok, boundary = set(), 0
            if boundary:
                hits[name] = boundary
            restorable = [p for p in restorable if p in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _batch_v2(self, transfers: list[PoolTransfer], extra_info: Any, load: bool) -> dict[str, list[bool]]:
        ns = self._ns(extra_info)
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            pool = self._pools.get(str(transfer.name))
            offsets = pool.offsets(transfer.host_indices, len(keys)) if pool is not None else None
            if pool is None or offsets is None:
                _logger.error(
                    "kvrs %s: pool %s not registered or indices mismatched",
                    "get" if load else "set",
                    transfer.name,
                )
                results[transfer.name] = [False] * len(keys)
                continue
            results[transfer.name] = pool.get(keys, offsets, ns) if load else pool.put(keys, offsets, ns)
        return results

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, extra_info, load=True)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, extra_info, load=False)

    # -- housekeeping -------------------------------------------------------------------------

    def clear(self) -> bool:
        """Removes this backend's pages (every registered pool's, in the namespaces it
        used) from the tiers."""
        for pool in self._pools.values():
            for ns in self._namespaces:
                pool.store.drop_namespace(ns)
        return True

    def kvrs_stats(self) -> dict[str, dict[str, Any]]:
        """Each registered pool's `kvrs.PageStore.stats`."""
        return {name: pool.store.stats() for name, pool in self._pools.items()}
