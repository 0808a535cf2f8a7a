"""kvrs as an LMCache remote storage plugin: `KvrsRemoteConnector`, loaded by LMCache's own
``remote_storage_plugins`` config with no change to LMCache.

LMCache keeps KV chunks in its local CPU backend and writes them through to its remote
backends; a lookup that misses the CPU backend asks the remote ones. `KvrsRemoteConnector`
keeps those chunks in kvrs tiers (host memory, disk, Redis or Redis Cluster, fastest
first) through a [`kvrs.PageStore`][kvrs.PageStore]. Each chunk is two sealed pages: its
metadata (LMCache's own ``RemoteMetadata``: byte length, shapes, dtypes, memory format, so
a shorter last chunk comes back with its own shape) and its bytes (the chunk's
``MemoryObj``, read and written in place). Both are sealed in kvrs payloads whose header
and keyed MAC bind them to the engine's facts (`lmcache_fingerprint`: model, world size,
worker rank unless the model uses MLA, KV dtypes, LMCache's ``kv_shape`` (heads and head
size: two head splits of one flat chunk shape never meet, LMCache#4463) and the chunk
shapes, chunk size, MLA, memory format, layerwise, remote serde), the namespace and the
chunk's key (LMCache's ``CacheEngineKey``), under the secret read from the environment
variable named by ``tier_key_env``. A get allocates the chunk only after its metadata page verified and
checks it against the engine's shapes, then verifies the data page straight into the
allocation; anything else (another model's, dtype's, rank's or tenant's chunk, a torn,
truncated, corrupted, forged or swapped file, a dead or full tier, a deadline passed) is a
miss, the allocation released, never wrong K/V and never an exception into LMCache. A
refused page is discarded and a chunk whose data page is refused is withdrawn, so the next
lookup says absent.

It never blocks LMCache's event loop: every kvrs call runs on the connector's own I/O
threads (the GIL released while kvrs reads, verifies and writes) under a deadline
(``timeout_s``, default LMCache's ``blocking_timeout_secs``); a load that outlives its
deadline keeps its buffer until the thread is done with it, so a late copy never lands in
memory LMCache has reused. A store writes the data page first and the metadata page only
once the data page is stored, so a store that fails is never visible.

Namespaces: every chunk is filed under the config's ``namespace`` (default: none) and,
where a request carries the tag ``lmcache.tag.cache_salt`` (LMCache's request tags, kept in
``CacheEngineKey.tags``), under that salt as well, so a tenant's chunks fail every other
tenant's MAC and ``drop_namespace`` removes one tenant. LMCache 0.5.6's in-process path
puts no ``cache_salt`` into its keys (only its multiprocess mode does), so without the tag
two tenants with the same prompt share chunks, as they do in LMCache's own backends
(LMCache#4825).

Configuration (LMCache's config file or ``LMCACHE_*`` variables)::

    local_cpu: true
    remote_storage_plugins: ["kvrs"]
    extra_config:
      remote_storage_plugin.kvrs.module_path: kvrs.integrations.lmcache
      remote_storage_plugin.kvrs.class_name: KvrsRemoteConnector
      remote_storage_plugin.kvrs.tiers: [{"type": "disk", "path": "/mnt/nvme/kvrs", "max_bytes": "500GiB"}]
      remote_storage_plugin.kvrs.tier_key_env: KVRS_TIER_KEY
      remote_storage_plugin.kvrs.namespace: ""
      remote_storage_plugin.kvrs.fingerprint: {"revision": "main"}

``tiers`` and ``fingerprint`` may also be JSON strings; ``timeout_s`` (seconds) and
``io_threads`` (default 4) are optional. ``list()`` answers ``[]`` (kvrs tiers file chunks
under MAC'd names, not enumerable) and ``remove_sync`` overwrites a chunk's metadata page
with a tombstone, which every later lookup reads as a miss. Layerwise chunks (3-D shapes)
are not stored (the store fails, so LMCache recomputes them).

Tested with LMCache 0.5.6 (tests/engines/test_lmcache.py).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np

import kvrs
from kvrs.integrations.engine_config import (
    DEFAULT_TIER_KEY_ENV,
    extra_facts,
    make_tiers,
    namespace_arg,
    tier_secret,
)

try:
    from lmcache.integration.vllm.utils import get_size_bytes  # type: ignore[import-not-found,import-untyped]
    from lmcache.utils import CacheEngineKey  # type: ignore[import-not-found,import-untyped]
    from lmcache.v1.memory_management import MemoryObj  # type: ignore[import-not-found,import-untyped]
    from lmcache.v1.protocol import RemoteMetadata  # type: ignore[import-not-found,import-untyped]
    from lmcache.v1.storage_backend.connector.base_connector import (  # type: ignore[import-not-found,import-untyped]
        RemoteConnector,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvrs.integrations.lmcache needs LMCache and torch ({e}): tested with lmcache==0.5.6, "
        "installed by `make test-engines` (tests/engines/requirements.txt)"
    ) from e

__all__ = ["TESTED_LMCACHE", "KvrsRemoteConnector", "lmcache_fingerprint", "plugin_options"]

_logger = logging.getLogger(__name__)

#: The LMCache version this adapter is tested with.
TESTED_LMCACHE = "0.5.6"

#: The request tag whose value kvrs files a chunk's namespace under (a tenant).
SALT_TAG = "cache_salt"

_T = TypeVar("_T")

# A chunk's metadata page is LMCache's RemoteMetadata; remove_sync overwrites it with this
# (a page of another length: every later lookup misses it).
_TOMBSTONE = b"\x00"


def _json_or(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise ValueError(f"{what} must be a list/dict or its JSON text, not {value!r}: {e}") from e
    return value


def plugin_options(config: Any, plugin_name: str | None = None) -> tuple[str, dict[str, Any]]:
    """The plugin name this connector was loaded as and its options (the
    ``remote_storage_plugin.<name>.*`` entries of LMCache's ``extra_config``, prefix
    stripped). LMCache does not tell a plugin class its name: it is the one name in
    ``remote_storage_plugins`` whose ``module_path`` is this module (``"kvrs"`` when the
    connector is built by hand)."""
    extra = dict(getattr(config, "extra_config", None) or {})
    if plugin_name is None:
        names = [
            n
            for n in (getattr(config, "remote_storage_plugins", None) or [])
            if extra.get(f"remote_storage_plugin.{n}.module_path") == __name__
        ]
        if len(names) > 1:
            raise ValueError(
                f"remote_storage_plugins {names} all load {__name__}: LMCache does not tell a plugin "
                "which of them it is, so list kvrs once"
            )
        plugin_name = names[0] if names else "kvrs"
    prefix = f"remote_storage_plugin.{plugin_name}."
    return plugin_name, {k[len(prefix) :]: v for k, v in extra.items() if k.startswith(prefix)}


def lmcache_fingerprint(
    config: Any, metadata: Any, extra: Mapping[str, Any] | None = None
) -> dict[str, str | int | bool]:
    """The facts that identify the chunks of an LMCache engine configured by `config`
    (``LMCacheEngineConfig``) with `metadata` (``LMCacheMetadata``), plus `extra`.

    The worker rank is left out for an MLA model, whose KV every rank shares (LMCache's
    ``remote_enable_mla_worker_id_as0`` reads rank 0's chunks from every rank); the
    ``CacheEngineKey`` still names the worker."""
    use_mla = bool(metadata.use_mla)
    fp: dict[str, str | int | bool] = {
        "engine": "lmcache",
        "model": str(metadata.model_name),
        "world_size": int(metadata.world_size),
        "kv_dtypes": ",".join(str(d) for d in metadata.get_dtypes()),
        # kv_shape as well as the chunk shapes: (heads, head size) (2, 8) and (4, 4) flatten
        # to the same chunk shape, and nothing in the bytes tells them apart (LMCache#4463).
        "kv_shape": "x".join(str(int(n)) for n in metadata.kv_shape),
        "kv_shapes": ";".join("x".join(str(int(n)) for n in s) for s in metadata.get_shapes()),
        "chunk_size": int(metadata.chunk_size),
        "use_mla": use_mla,
        "fmt": "KV_MLA_FMT" if use_mla else "KV_2LTD",
        "use_layerwise": bool(getattr(config, "use_layerwise", False)),
        "remote_serde": str(getattr(config, "remote_serde", None) or "naive"),
    }
    if not use_mla:
        fp["worker_id"] = int(metadata.worker_id)
    fp.update(extra_facts(extra))
    return fp


def _bytes_of(obj: Any) -> np.ndarray:
    """A chunk's bytes (its ``byte_array``: the logical size, not the allocation's), as a
    writable uint8 array over the chunk's own memory."""
    return np.frombuffer(obj.byte_array, dtype=np.uint8)


def _release(objs: Sequence[Any]) -> None:
    for obj in objs:
        if obj is not None:
            try:
                obj.ref_count_down()
            except Exception:  # pragma: no cover - LMCache's allocator
                _logger.exception("kvrs: releasing a chunk buffer failed")


class KvrsRemoteConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache remote storage in kvrs tiers, every chunk sealed and verified (see the module
    docs for the configuration)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any = None,
        plugin_name: str | None = None,
    ) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        cfg = config if config is not None else local_cpu_backend.config
        self.plugin_name, opts = plugin_options(cfg, plugin_name)
        self.tiers = make_tiers(_json_or(opts.get("tiers") or [], "tiers"))
        secret = tier_secret(opts.get("tier_key_env", DEFAULT_TIER_KEY_ENV), _logger)
        self.namespace = namespace_arg(opts.get("namespace", ""))
        facts = _json_or(opts.get("fingerprint") or {}, "fingerprint")
        self.fingerprint = lmcache_fingerprint(cfg, local_cpu_backend.metadata, facts)
        self.store = kvrs.PageStore(self.tiers, fingerprint=self.fingerprint, tier_key=secret)
        timeout = opts.get("timeout_s", getattr(cfg, "blocking_timeout_secs", 10))
        self.timeout_s = float(timeout)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout!r}")
        threads = int(opts.get("io_threads", 4))
        if threads < 1:
            raise ValueError(f"io_threads must be >= 1, not {threads}")
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"kvrs-lmcache-{self.plugin_name}")
        self._closed = False
        self._lock = threading.Lock()
        self._inflight: set[Future[Any]] = set()
        self._busy = 0  # batched_put calls under way
        #: Chunks asked for (``put_chunks``, ``get_chunks``), stored, loaded, and the
        #: stores and loads that failed or ran late (misses counted as ``get_misses``).
        self.counters = dict.fromkeys(
            ("put_chunks", "stored", "put_failed", "get_chunks", "loaded", "get_misses"), 0
        )
        self.namespaces: set[str] = {self.namespace}
        _logger.info(
            "kvrs: LMCache remote plugin %r over %s, fingerprint %s",
            self.plugin_name,
            [t["name"] for t in self.store.stats()["tiers"]],
            self.fingerprint,
        )

    # -- keys ------------------------------------------------------------------------------

    def _ns(self, key: Any) -> str:
        for name, value in getattr(key, "tags", None) or ():
            if name == SALT_TAG:
                ns = f"{self.namespace}\x00{value}"
                self.namespaces.add(ns)
                return ns
        return self.namespace

    @staticmethod
    def _names(key: Any) -> tuple[str, str]:
        """The kvrs keys of a chunk's metadata page and data page."""
        s = key.to_string()
        return f"{s}#meta", f"{s}#data"

    def _groups(self, keys: Sequence[Any]) -> dict[str, list[int]]:
        """The indices of `keys` by namespace."""
        out: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            out.setdefault(self._ns(key), []).append(i)
        return out

    # -- off the event loop ----------------------------------------------------------------

    async def _run(
        self, fn: Callable[[], _T], default: _T, on_abandon: Callable[[_T], None] | None = None
    ) -> _T:
        """`fn()` on the I/O threads under the deadline; `default` when it fails or runs
        late. A result nobody waits for any more goes to `on_abandon` once it is there."""
        if self._closed:
            return default
        fut: Future[_T] = self._submit(fn)

        def abandon() -> None:
            if on_abandon is None:
                return

            def done(f: Future[_T]) -> None:
                if not f.cancelled() and f.exception() is None:
                    on_abandon(f.result())

            fut.add_done_callback(done)

        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
        except asyncio.TimeoutError:
            _logger.warning("kvrs: a tier call ran past %.3gs: a miss", self.timeout_s)
            abandon()
            return default
        except asyncio.CancelledError:
            abandon()
            raise
        except Exception as e:
            _logger.warning("kvrs: tier call failed (%s: %s): a miss", type(e).__name__, e)
            return default

    def _submit(self, fn: Callable[[], _T]) -> Future[_T]:
        fut = self._executor.submit(fn)
        with self._lock:
            self._inflight.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(fut)

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self.counters[name] += n

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until no kvrs call of this connector is running (stores included: LMCache
        does not wait for remote stores); whether that happened within `timeout` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending, busy = list(self._inflight), self._busy
            if not pending and not busy:
                return True
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            if pending:
                wait(pending, timeout=left)
            else:
                time.sleep(0.001)

    # -- the work, on an I/O thread ----------------------------------------------------------

    def _meta_ok(self, meta: Any) -> bool:
        """Whether a (verified) metadata page describes a chunk of this engine's geometry."""
        if meta.fmt != self.meta_fmt or list(meta.dtypes) != list(self.meta_dtypes):
            return False
        if len(meta.shapes) != len(self.meta_shapes):
            return False
        for got, full in zip(meta.shapes, self.meta_shapes, strict=True):
            got, full = list(got), list(full)
            if len(got) != len(full) or len(full) != 4:
                return False
            if got[:2] != full[:2] or got[3:] != full[3:] or not 0 < got[2] <= full[2]:
                return False
        return int(meta.length) == get_size_bytes(meta.shapes, meta.dtypes)

    def _load(self, keys: Sequence[Any]) -> list[Any]:
        """The chunks of `keys` (None: a miss), each verified into a fresh allocation."""
        out: list[Any] = [None] * len(keys)
        try:
            for ns, idx in self._groups(keys).items():
                names = [self._names(keys[i]) for i in idx]
                bufs = [bytearray(self.remote_metadata_bytes) for _ in idx]
                ok = self.store.get_into([m for m, _ in names], bufs, namespace=ns)
                want: list[int] = []
                for j, i in enumerate(idx):
                    if not ok[j]:
                        continue
                    try:
                        meta = RemoteMetadata.deserialize(bytes(bufs[j]))
                    except Exception:
                        continue
                    if not self._meta_ok(meta):
                        _logger.warning("kvrs: chunk %s has metadata of another geometry: a miss", keys[i])
                        continue
                    obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt, busy_loop=False)
                    if obj is None:
                        continue
                    if obj.get_size() != meta.length:
                        _release([obj])
                        continue
                    out[i] = obj
                    want.append(j)
                if not want:
                    continue
                views = [_bytes_of(out[idx[j]]) for j in want]
                got = self.store.get_into([names[j][1] for j in want], views, namespace=ns)
                lost = []
                for j, hit in zip(want, got, strict=True):
                    if not hit:
                        _release([out[idx[j]]])
                        out[idx[j]] = None
                        lost.append(names[j][0])
                if lost:
                    # Metadata without its data (a torn, truncated or refused data page): the
                    # chunk is withdrawn, so that lookups stop reporting it.
                    self.store.put_many(lost, [_TOMBSTONE] * len(lost), namespace=ns)
        except BaseException:
            _release(out)
            raise
        return out

    def _save(self, keys: Sequence[Any], objs: Sequence[Any]) -> list[bool]:
        """Stores each chunk, data page first; per chunk, whether both pages were stored."""
        done = [False] * len(keys)
        for ns, idx in self._groups(keys).items():
            names, datas, metas, which = [], [], [], []
            for i in idx:
                obj = objs[i]
                shapes, dtypes, fmt = obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format()
                meta = RemoteMetadata(obj.get_size(), shapes, dtypes, fmt)
                if not self._meta_ok(meta):
                    _logger.warning("kvrs: chunk %s is not of this engine's geometry: not stored", keys[i])
                    continue
                names.append(self._names(keys[i]))
                datas.append(_bytes_of(obj))
                metas.append(meta.serialize())
                which.append(i)
            if not which:
                continue
            stored = self.store.put_many([d for _, d in names], datas, namespace=ns)
            ready = [j for j, ok in enumerate(stored) if ok]
            if not ready:
                continue
            sealed = self.store.put_many(
                [names[j][0] for j in ready], [metas[j] for j in ready], namespace=ns
            )
            for j, ok in zip(ready, sealed, strict=True):
                done[which[j]] = ok
        return done

    def _present(self, keys: Sequence[Any]) -> list[bool]:
        """Per key, whether its metadata page verifies and its data page is stored."""
        out = [False] * len(keys)
        for ns, idx in self._groups(keys).items():
            names = [self._names(keys[i]) for i in idx]
            bufs = [bytearray(self.remote_metadata_bytes) for _ in idx]
            ok = self.store.get_into([m for m, _ in names], bufs, namespace=ns)
            verified = [j for j, good in enumerate(ok) if good]
            has_data = self.store.exists_many([names[j][1] for j in verified], namespace=ns)
            for j, has in zip(verified, has_data, strict=True):
                out[idx[j]] = has
        return out

    def _prefix(self, keys: Sequence[Any]) -> int:
        """How many of `keys`, from the first, are present: asked in windows of 32 keys
        growing fourfold, so an early miss reads no metadata after it."""
        at, window = 0, 32
        while at < len(keys):
            present = self._present(keys[at : at + window])
            lead = present.index(False) if False in present else len(present)
            at += lead
            if lead < len(present):
                break
            window *= 4
        return at

    def _sync(self, fn: Callable[[], _T], default: _T) -> _T:
        """`fn()` on the I/O threads, waited for from a caller's thread under the deadline."""
        if self._closed:
            return default
        try:
            return self._submit(fn).result(self.timeout_s)
        except Exception as e:
            _logger.warning("kvrs: tier call failed or ran late (%s: %s): a miss", type(e).__name__, e)
            return default

    # -- RemoteConnector ---------------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return (await self._run(lambda: self._present([key]), [False]))[0]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._sync(lambda: self._present([key]), [False])[0]

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    async def list(self) -> builtins.list[str]:
        return []

    async def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: builtins.list[CacheEngineKey]) -> builtins.list[MemoryObj | None]:
        self._count("get_chunks", len(keys))
        got = await self._run(lambda: self._load(keys), [None] * len(keys), _release)
        hits = sum(o is not None for o in got)
        self._count("loaded", hits)
        self._count("get_misses", len(got) - hits)
        return got

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: builtins.list[CacheEngineKey]
    ) -> builtins.list[MemoryObj]:
        got = await self.batched_get(list(keys))
        n = got.index(None) if None in got else len(got)
        _release(got[n:])
        return got[:n]

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(
        self, keys: builtins.list[CacheEngineKey], memory_objs: builtins.list[MemoryObj]
    ) -> None:
        # LMCache (InstrumentedRemoteConnector) releases the objects as soon as this
        # returns; the store holds its own reference until its thread is done with them,
        # so a store that runs past the deadline never reads reused memory.
        objs = list(memory_objs)
        with self._lock:
            self.counters["put_chunks"] += len(objs)
            self._busy += 1
        try:
            await self._put(keys, objs)
        finally:
            with self._lock:
                self._busy -= 1

    async def _put(self, keys: builtins.list[CacheEngineKey], objs: builtins.list[MemoryObj]) -> None:
        if self._closed:
            raise RuntimeError("kvrs: the connector is closed: nothing stored")
        for obj in objs:
            obj.ref_count_up()

        def save() -> builtins.list[bool]:
            try:
                return self._save(keys, objs)
            finally:
                _release(objs)

        done = await self._run(save, [False] * len(keys))
        self._count("stored", sum(done))
        self._count("put_failed", len(done) - sum(done))
        if not all(done):
            failed = [str(k) for k, ok in zip(keys, done, strict=True) if not ok]
            raise RuntimeError(
                f"kvrs: {len(failed)} of {len(keys)} chunks not stored (not visible): {failed[:4]}"
            )

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: builtins.list[CacheEngineKey], pin: bool = False
    ) -> int:
        return await self._run(lambda: self._prefix(keys), 0)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: builtins.list[CacheEngineKey]) -> int:
        return self._sync(lambda: self._prefix(keys), 0)

    def remove_sync(self, key: CacheEngineKey) -> bool:
        meta, _ = self._names(key)
        ns = self._ns(key)
        return self._sync(lambda: self.store.put_many([meta], [_TOMBSTONE], namespace=ns)[0], False)

    def __repr__(self) -> str:
        return f"<KvrsRemoteConnector {self.plugin_name}>"
