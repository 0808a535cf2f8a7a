"""kvrs.integrations.lmcache.KvrsRemoteConnector through LMCache 0.5.6's own classes: loaded
by LMCache's config only (``remote_storage_plugins``), driven through its real
``StorageManager`` (``LocalCPUBackend`` + ``RemoteBackend-kvrs``): a batched put reaches
kvrs with the chunks' exact bytes; once the CPU backend has evicted them, gets and batched
gets are served by kvrs, equal bytes, a shorter last chunk with its own shape; a new
StorageManager on the same disk tier (a restart) hits. Faults (a corrupted, truncated,
forged or swapped file; another model's, dtype's, shape's or tenant's chunks; a wrong tier
key; a dead Redis; a tier too small; a tier slower than the deadline) are misses, never
wrong bytes and never a hang. The same faults on LMCache's own file-system connector
(``remote_storage_plugins: ["fs"]``, the same harness) are recorded: which of them it turns
into wrong bytes. LMCache's own plugin tests run as a regression gate.

Needs LMCache (``make test-engines`` installs it); skipped without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache.v1.storage_backend.storage_manager")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

import kvrs  # noqa: E402
from kvrs.integrations.lmcache import KvrsRemoteConnector, lmcache_fingerprint  # noqa: E402

SECRET = "lmcache-test-tier-key-0123456789abcdef"
CHUNK = 16
MODEL = "org/llama-3-8b"
DEADLINE_S = 10.0
# (layers, 2, chunk tokens, kv heads, head dim): a chunk of 2 * 2 * 16 * 16 bf16 = 2 KiB.
KV_SHAPE = (2, 2, CHUNK, 2, 8)


@pytest.fixture(autouse=True)
def _tier_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRS_TIER_KEY", SECRET)


def metadata(
    model: str = MODEL,
    dtype: Any = torch.bfloat16,
    worker_id: int = 0,
    world_size: int = 1,
    kv_shape=KV_SHAPE,
) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=dtype,
        kv_shape=kv_shape,
        chunk_size=CHUNK,
    )


def kvrs_plugin(tiers: list[dict[str, Any]] | str, name: str = "kvrs", **opts: Any) -> dict[str, Any]:
    """LMCache ``extra_config`` entries that load kvrs as remote storage plugin `name`."""
    p = f"remote_storage_plugin.{name}."
    return {
        p + "module_path": "kvrs.integrations.lmcache",
        p + "class_name": "KvrsRemoteConnector",
        p + "tiers": tiers,
        **{p + k: v for k, v in opts.items()},
    }


def disk(path: Path, max_bytes: int | str = "64MiB") -> list[dict[str, Any]]:
    return [{"type": "disk", "path": str(path), "max_bytes": max_bytes}]


def config(plugin: str, extra: dict[str, Any]) -> LMCacheEngineConfig:
    """LMCache's config: the CPU backend and remote plugin `plugin`, or (``"disk"``) the
    CPU backend and LMCache's own local disk backend at ``extra["path"]``."""
    disk_opts: dict[str, Any] = {}
    if plugin == "disk":
        disk_opts = {"local_disk": str(extra["path"]), "max_local_disk_size": 0.01}
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.05,
        lmcache_instance_id="kvrs-test",
        **disk_opts,
    )
    if plugin != "disk":
        cfg.remote_storage_plugins = [plugin]
        cfg.extra_config = extra
    cfg.blocking_timeout_secs = int(DEADLINE_S)
    return cfg


class Engine:
    """A real StorageManager (LocalCPUBackend + one remote plugin) and helpers around it."""

    def __init__(self, plugin: str, extra: dict[str, Any], md: LMCacheMetadata | None = None) -> None:
        self.md = md or metadata()
        self.plugin = plugin
        self.sm = StorageManager(config(plugin, extra), self.md, EventManager())
        name = "LocalDiskBackend" if plugin == "disk" else f"RemoteBackend-{plugin}"
        try:
            assert list(self.sm.storage_backends) == ["LocalCPUBackend", name]
            self.local = self.sm.storage_backends["LocalCPUBackend"]
            self.remote = self.sm.storage_backends[name]
            assert plugin == "disk" or self.remote.connection is not None, "the plugin did not load"
        except BaseException:
            self.sm.close()
            raise

    @property
    def connector(self) -> Any:
        return self.remote.connection._connector  # LMCache wraps it (InstrumentedRemoteConnector)

    def chunk(self, seed: int, tokens: int = CHUNK) -> tuple[Any, bytes]:
        """A freshly allocated chunk of `tokens` tokens filled with random K/V, and its bytes."""
        obj = self.sm.allocate(self.md.get_shapes(tokens), self.md.get_dtypes(), MemoryFormat.KV_2LTD)
        assert obj is not None
        g = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=g).to(obj.tensor.dtype))
        return obj, bytes(obj.byte_array)

    def put(self, keys: list[Any], tokens: list[int] | None = None, seed: int = 0) -> list[bytes]:
        """Stores one chunk per key through ``StorageManager.batched_put``; their bytes."""
        tokens = tokens or [CHUNK] * len(keys)
        made = [self.chunk(seed * 1000 + i, t) for i, t in enumerate(tokens)]
        self.asked = self.connector.counters["put_chunks"] + len(keys) if self.plugin == "kvrs" else 0
        self.sm.batched_put(keys, [o for o, _ in made])
        self.wait_puts(keys)
        return [b for _, b in made]

    def wait_puts(self, keys: list[Any]) -> None:
        """Waits for the remote stores: LMCache does not (its RemoteBackend tracks no batched
        put, and closing a StorageManager frees the CPU memory a store may still read)."""
        if self.plugin == "kvrs":
            end = time.monotonic() + DEADLINE_S
            while self.connector.counters["put_chunks"] < self.asked:
                assert time.monotonic() < end, "the remote put never started"
                time.sleep(0.005)
            assert self.connector.wait_idle(DEADLINE_S), "the remote put never finished"
            return
        end = time.monotonic() + DEADLINE_S
        while not all(self.remote.contains(k) and not self.remote.exists_in_put_tasks(k) for k in keys):
            assert time.monotonic() < end, "the remote put never finished"
            time.sleep(0.005)

    def evict(self, keys: list[Any]) -> None:
        for k in keys:
            self.local.remove(k)
        assert not any(self.local.contains(k) for k in keys)

    def get(self, key: Any) -> bytes | None:
        obj = self.sm.get(key)
        return None if obj is None else bytes(obj.byte_array)

    def close(self) -> None:
        self.sm.close()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def key(n: int, model: str = MODEL, dtype: Any = torch.bfloat16, salt: str | None = None) -> CacheEngineKey:
    tags = {"lmcache.tag.cache_salt": salt} if salt is not None else {}
    return CacheEngineKey(model, 1, 0, 0x5EED0000 + n, dtype, request_configs=tags)


# -- round trips --------------------------------------------------------------------------


def test_loaded_by_config_only_and_served_after_local_eviction(tmp_path: Path, engines: list[Engine]) -> None:
    eng = Engine("kvrs", kvrs_plugin(json.dumps(disk(tmp_path)), fingerprint={"revision": "r1"}))
    engines.append(eng)
    conn = eng.connector
    assert isinstance(conn, KvrsRemoteConnector)
    assert conn.fingerprint == lmcache_fingerprint(eng.sm.config, eng.md, {"revision": "r1"})
    keys = [key(i) for i in range(4)]
    # Three full chunks and a shorter last one (5 tokens).
    want = eng.put(keys, [CHUNK, CHUNK, CHUNK, 5])
    assert all(eng.local.contains(k) for k in keys)
    # The bytes kvrs sealed are the chunks' own: read back through a PageStore of the same facts.
    store = kvrs.PageStore(
        [kvrs.DiskTier(str(tmp_path), "64MiB")], fingerprint=conn.fingerprint, tier_key=SECRET
    )
    for k, w in zip(keys, want, strict=True):
        buf = bytearray(len(w))
        assert store.get_into([k.to_string() + "#data"], [buf]) == [True]
        assert bytes(buf) == w
    eng.evict(keys)
    assert eng.remote.contains(keys[0])
    assert eng.remote.batched_contains(keys + [key(99)]) == 4
    # StorageManager.get: served by kvrs, equal bytes, the short chunk with its own shape.
    for k, w in zip(keys, want, strict=True):
        assert eng.get(k) == w
    obj = eng.sm.get(keys[3])
    assert obj is not None and list(obj.get_shape()) == [2, 2, 5, 16]
    # Batched get, after another eviction, from the tier `StorageManager.batched_contains`
    # names (as LMCache's engine asks; without a location 0.5.6 returns the CPU backend's
    # list of misses, which is not empty).
    eng.evict(keys)
    hit, where = eng.sm.batched_contains(keys)
    assert hit == 4 and where == {"RemoteBackend-kvrs": keys}
    got = eng.sm.batched_get(keys, location="RemoteBackend-kvrs")
    assert [bytes(o.byte_array) for o in got] == want
    assert eng.get(key(99)) is None


def test_a_restart_on_the_same_disk_tier_hits(tmp_path: Path, engines: list[Engine]) -> None:
    eng = Engine("kvrs", kvrs_plugin(disk(tmp_path)))
    keys = [key(i) for i in range(3)]
    want = eng.put(keys, [CHUNK, CHUNK, 7])
    eng.close()
    again = Engine("kvrs", kvrs_plugin(disk(tmp_path)))
    engines.append(again)
    assert not any(again.local.contains(k) for k in keys)
    assert again.remote.batched_contains(keys) == 3
    assert [again.get(k) for k in keys] == want


def test_async_contains_and_non_blocking_get(tmp_path: Path, engines: list[Engine]) -> None:
    import asyncio

    eng = Engine("kvrs", kvrs_plugin(disk(tmp_path)))
    engines.append(eng)
    keys = [key(i) for i in range(3)]
    want = eng.put(keys)
    eng.evict(keys)
    conn = eng.connector
    probe = keys[:2] + [key(50), keys[2]]

    async def both() -> tuple[int, list[Any]]:
        n = await conn.batched_async_contains("L", probe)
        objs = await conn.batched_get_non_blocking("L", probe)
        return n, objs

    n, objs = asyncio.run_coroutine_threadsafe(both(), eng.sm.loop).result(DEADLINE_S)
    assert n == 2
    assert [bytes(o.byte_array) for o in objs] == want[:2]
    for o in objs:
        o.ref_count_down()
    assert asyncio.run_coroutine_threadsafe(conn.list(), eng.sm.loop).result(DEADLINE_S) == []
    # remove_sync: the chunk is gone for every later lookup.
    assert eng.remote.remove(keys[0]) is True
    assert not eng.remote.contains(keys[0])
    assert eng.get(keys[0]) is None
    assert eng.get(keys[1]) == want[1]


# -- faults: misses, never wrong bytes ------------------------------------------------------


def files(path: Path) -> list[Path]:
    return sorted(
        (p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")),
        key=lambda p: (p.stat().st_size, str(p)),
    )


def corrupt(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x40
    p.write_bytes(bytes(b))


def truncate(p: Path) -> None:
    b = p.read_bytes()
    p.write_bytes(b[: max(1, len(b) - 100)])


def plugin_extra(plugin: str, path: Path, **opts: Any) -> dict[str, Any]:
    if plugin == "kvrs":
        return kvrs_plugin(disk(path), **opts)
    return {"path": path}


def damage(path: Path, how: str, forged: Path | None = None) -> None:
    """Damages every chunk file under `path` (those of kvrs: the data pages, the larger);
    ``"forge"`` replaces every file by one of the same length from `forged` (random bytes
    where there is none)."""
    fs = files(path)
    big = [p for p in fs if p.stat().st_size == fs[-1].stat().st_size]
    if how == "corrupt":
        for p in big:
            corrupt(p)
    elif how == "truncate":
        for p in big:
            truncate(p)
    elif how == "swap":  # each file holds another chunk's valid bytes
        blobs = [p.read_bytes() for p in big]
        for p, b in zip(big, blobs[1:] + blobs[:1], strict=True):
            p.write_bytes(b)
    elif how == "forge":  # each file replaced by one an attacker wrote (or chose) for it
        theirs = files(forged) if forged is not None else []
        for i, p in enumerate(fs):
            mine = [q for q in theirs if q.stat().st_size == p.stat().st_size]
            p.write_bytes(mine[i % len(mine)].read_bytes() if mine else os.urandom(p.stat().st_size))
    else:
        raise AssertionError(how)


def outcome(eng: Engine, keys: list[Any], want: list[bytes]) -> tuple[int, int, int]:
    """(hits with the right bytes, wrong bytes, misses) of a get per key, each within the deadline."""
    right = wrong = miss = 0
    for k, w in zip(keys, want, strict=True):
        start = time.monotonic()
        got = eng.get(k)
        assert time.monotonic() - start < DEADLINE_S, "a get hung"
        if got is None:
            miss += 1
        elif got == w:
            right += 1
        else:
            wrong += 1
    return right, wrong, miss


@pytest.mark.parametrize("plugin", ["kvrs", "disk"])
@pytest.mark.parametrize("how", ["corrupt", "truncate", "swap", "forge"])
def test_damaged_files(
    tmp_path: Path, engines: list[Engine], monkeypatch: pytest.MonkeyPatch, plugin: str, how: str
) -> None:
    """kvrs: every damaged chunk a miss (after a restart). LMCache's own local disk backend
    (the peer, same harness; its index lives in memory, so no restart): recorded. A forged
    kvrs file is a valid payload of the same keys and facts, sealed by an attacker who
    lacks the deployment's secret; a forged LMCache file holds bytes the attacker chose."""
    keys = [key(i) for i in range(4)]
    forged = None
    if how == "forge" and plugin == "kvrs":
        forged = tmp_path / "attacker"
        monkeypatch.setenv("KVRS_TIER_KEY", "attacker-tier-key-not-the-secret!")
        attacker = Engine(plugin, plugin_extra(plugin, forged))
        attacker.put(keys, seed=66)
        attacker.close()
        monkeypatch.setenv("KVRS_TIER_KEY", SECRET)
    path = tmp_path / "tier"
    writer = Engine(plugin, plugin_extra(plugin, path))
    want = writer.put(keys, seed=7)
    if plugin == "kvrs":
        writer.close()
        damage(path, how, forged)
        eng = Engine(plugin, plugin_extra(plugin, path))
    else:
        eng = writer
        eng.evict(keys)
        # The freed CPU memory is reused by other chunks meanwhile (here: random ones).
        for obj, _ in [eng.chunk(900 + i) for i in range(4)]:
            obj.ref_count_down()
        damage(path, how)
    engines.append(eng)
    right, wrong, miss = outcome(eng, keys, want)
    if plugin == "kvrs":
        assert (right, wrong, miss) == (0, 0, 4)
        # A chunk whose data page was refused is withdrawn: the next lookup says absent.
        assert eng.remote.batched_contains(keys) == 0
    else:
        # LMCache 0.5.6's LocalDiskBackend reads whatever the file holds into the chunk
        # (readinto, no length or checksum check): every fault is served as K/V, wrong bytes
        # (a truncated file leaves the allocation's tail as it was).
        assert (right, wrong, miss) == (0, 4, 0)


@pytest.mark.parametrize("what", ["model", "dtype", "shape", "tenant", "tier_key"])
def test_another_configurations_chunks_are_never_served(
    tmp_path: Path, engines: list[Engine], monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """The same keys (same served model name, chunk hashes and key dtype) read by an engine
    that differs in one fact: a miss. (LMCache's own disk backend keeps its index in memory,
    so no other engine ever reads its files; its fs connector names files by the key alone.)"""
    keys = [key(i) for i in range(3)]
    writer = Engine("kvrs", kvrs_plugin(disk(tmp_path), namespace="tenant-a"))
    want = writer.put(keys, seed=3)
    writer.close()
    opts: dict[str, Any] = {"namespace": "tenant-a"}
    md = metadata()
    if what == "model":  # another model behind the same served name
        md = metadata(model="org/other-model")
    elif what == "dtype":
        md = metadata(dtype=torch.float16)
    elif what == "shape":  # (4 heads, 4 dims) and (2, 8): the same flat chunk shape
        md = metadata(kv_shape=(2, 2, CHUNK, 4, 4))
        assert md.get_shapes() == metadata().get_shapes()
    elif what == "tenant":
        opts["namespace"] = "tenant-b"
    else:
        monkeypatch.setenv("KVRS_TIER_KEY", "another-tier-key-fedcba9876543210")
    eng = Engine("kvrs", kvrs_plugin(disk(tmp_path), **opts), md)
    engines.append(eng)
    assert outcome(eng, keys, want) == (0, 0, 3)
    assert eng.remote.batched_contains(keys) == 0


def test_a_salted_tenants_chunks_are_filed_apart(tmp_path: Path, engines: list[Engine]) -> None:
    eng = Engine("kvrs", kvrs_plugin(disk(tmp_path)))
    engines.append(eng)
    alice = [key(i, salt="alice") for i in range(2)]
    want = eng.put(alice)
    eng.evict(alice)
    assert [eng.get(k) for k in alice] == want
    assert "\x00alice" in eng.connector.namespaces
    # drop_namespace removes one tenant.
    assert eng.connector.store.drop_namespace("\x00alice") > 0
    eng.evict(alice)
    assert [eng.get(k) for k in alice] == [None, None]


def test_a_dead_redis_is_a_miss_without_hanging(engines: list[Engine]) -> None:
    eng = Engine("kvrs", kvrs_plugin([{"type": "redis", "url": "redis://127.0.0.1:1/0", "timeout": 0.2}]))
    engines.append(eng)
    keys = [key(i) for i in range(2)]
    start = time.monotonic()
    eng.put(keys)
    eng.evict(keys)
    assert eng.remote.batched_contains(keys) == 0
    assert [eng.get(k) for k in keys] == [None, None]
    assert time.monotonic() - start < DEADLINE_S


def test_a_tier_too_small_for_a_chunk_stores_nothing_visible(tmp_path: Path, engines: list[Engine]) -> None:
    eng = Engine("kvrs", kvrs_plugin(disk(tmp_path, max_bytes=1024)))
    engines.append(eng)
    keys = [key(i) for i in range(2)]
    eng.put(keys)
    eng.evict(keys)
    assert eng.remote.batched_contains(keys) == 0
    assert [eng.get(k) for k in keys] == [None, None]


class SlowStore:
    """A page store whose loads take `delay` seconds (a stalled tier)."""

    def __init__(self, store: Any, delay: float) -> None:
        self._store, self.delay, self.finished = store, delay, 0

    def get_into(self, *a: Any, **kw: Any) -> Any:
        time.sleep(self.delay)
        try:
            return self._store.get_into(*a, **kw)
        finally:
            self.finished += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_load_past_the_deadline_is_a_miss_and_keeps_its_buffer_until_done(
    tmp_path: Path, engines: list[Engine]
) -> None:
    eng = Engine("kvrs", kvrs_plugin(disk(tmp_path), timeout_s=0.3))
    engines.append(eng)
    keys = [key(i) for i in range(2)]
    eng.put(keys)
    eng.evict(keys)
    conn = eng.connector
    allocator = eng.local.memory_allocator
    slow = SlowStore(conn.store, 0.5)
    conn.store = slow
    start = time.monotonic()
    assert eng.get(keys[0]) is None
    assert time.monotonic() - start < 2.0
    # The abandoned load finishes, then its allocation is released (nothing leaks).
    end = time.monotonic() + DEADLINE_S
    while slow.finished < 2:
        assert time.monotonic() < end
        time.sleep(0.01)
    time.sleep(0.1)
    assert allocator.memcheck()
    conn.store = slow._store
    assert eng.get(keys[0]) is not None


def test_bad_configuration_is_refused_by_name(tmp_path: Path) -> None:
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: F401

    eng = Engine("kvrs", kvrs_plugin(disk(tmp_path)))
    try:
        local = eng.local
        for extra, err in [
            (kvrs_plugin("not json"), "tiers"),
            (kvrs_plugin([{"type": "tape"}]), "tape"),
            (kvrs_plugin(disk(tmp_path), fingerprint={"x": [1]}), "fingerprint"),
            (kvrs_plugin(disk(tmp_path), timeout_s=0), "timeout_s"),
            ({**kvrs_plugin(disk(tmp_path)), **kvrs_plugin(disk(tmp_path), name="kvrs2")}, "list kvrs once"),
        ]:
            cfg = config("kvrs", extra)
            if "kvrs2" in str(extra):
                cfg.remote_storage_plugins = ["kvrs", "kvrs2"]
            with pytest.raises((ValueError, TypeError), match=err):
                KvrsRemoteConnector(loop=eng.sm.loop, local_cpu_backend=local, config=cfg)
    finally:
        eng.close()


def test_fingerprint_names_the_engines_facts() -> None:
    cfg = config("kvrs", {})
    fp = lmcache_fingerprint(cfg, metadata(worker_id=1, world_size=2), {"revision": "abc"})
    assert fp == {
        "engine": "lmcache",
        "model": MODEL,
        "world_size": 2,
        "worker_id": 1,
        "kv_dtypes": "torch.bfloat16",
        "kv_shape": f"2x2x{CHUNK}x2x8",
        "kv_shapes": f"2x2x{CHUNK}x16",
        "chunk_size": CHUNK,
        "use_mla": False,
        "fmt": "KV_2LTD",
        "use_layerwise": False,
        "remote_serde": "naive",
        "extra.revision": "abc",
    }
    mla = metadata(worker_id=1, world_size=2)
    mla.use_mla = True
    assert "worker_id" not in lmcache_fingerprint(cfg, mla)


# -- LMCache's own plugin tests: a regression gate ----------------------------------------


def test_lmcaches_own_plugin_tests_pass(lmcache_tests: Path) -> None:
    files = [
        "tests/v1/storage_backend/test_remote_storage_plugin.py",
        "tests/v1/storage_backend/test_storage_plugin.py",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(lmcache_tests), *files],
        cwd=lmcache_tests,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(lmcache_tests), *sys.path])},
    )
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert "20 passed" in r.stdout, tail
