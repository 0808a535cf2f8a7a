"""kvrs.integrations.sglang.KvrsHiCacheStorage through SGLang 0.5.23's own classes: loaded by
``StorageBackendFactory.create_backend("dynamic", ...)``, fed by real host pools
(``MHATokenToKVPoolHost`` in both layouts), and compared byte for byte with SGLang's own
``HiCacheFile`` (the "file" backend) on the legacy, v1 and v2 interfaces. Faults (a
corrupted, truncated, forged or swapped page file; another model's, dtype's, TP rank's
or tenant's pages) are misses that leave the host pool untouched, never wrong bytes.

Needs SGLang (``make test-engines`` installs it); skipped without it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import kvrs  # noqa: E402
from kvrs.integrations.sglang import KvrsHiCacheStorage  # noqa: E402

PAGE_SIZE = 4
SECRET = "sglang-test-tier-key-0123456789abcdef"
LAYOUTS = ["layer_first", "page_first"]


def make_host(layout: str, dtype=torch.float16, seed: int = 0) -> MHATokenToKVPoolHost:
    """A real device pool on the CPU and its real host pool, filled with random K/V."""
    dev = MHATokenToKVPool(
        size=64,
        page_size=PAGE_SIZE,
        dtype=dtype,
        head_num=2,
        head_dim=8,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    host = MHATokenToKVPoolHost(
        dev._mha_buffer_info(),
        2.0,
        0,
        PAGE_SIZE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=64,
        start_layer=0,
        end_layer=2,
    )
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(dtype))
    return host


def config(
    layout: str, extra: dict, *, model: str = "org/llama-3-8b", tp_rank: int = 0
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first",
        model_name=model,
        extra_config=extra,
    )


def kvrs_extra(tier_dir: Path, **more) -> dict:
    return {
        "backend_name": "kvrs",
        "module_path": "kvrs.integrations.sglang",
        "class_name": "KvrsHiCacheStorage",
        "interface_v1": 1,
        "tiers": [{"type": "disk", "path": str(tier_dir), "max_bytes": "64MiB"}],
        **more,
    }


def make_kvrs(host, layout: str, tier_dir: Path, *, model="org/llama-3-8b", tp_rank=0, **more):
    backend = StorageBackendFactory.create_backend(
        "dynamic", config(layout, kvrs_extra(tier_dir, **more), model=model, tp_rank=tp_rank), host
    )
    assert isinstance(backend, KvrsHiCacheStorage)
    backend.register_mem_pool_host(host)
    return backend


def make_file(host, layout: str, file_dir: Path) -> HiCacheFile:
    backend = StorageBackendFactory.create_backend(
        "file", config(layout, {"file_storage_path": str(file_dir)}), host
    )
    assert isinstance(backend, HiCacheFile)
    backend.register_mem_pool_host(host)
    return backend


def page_keys(n: int, salt: str = "") -> list[str]:
    """Chained sha256 page hashes, as SGLang's storage keys are."""
    keys, prior = [], salt
    for i in range(n):
        prior = hashlib.sha256(
            f"{prior}:{list(range(i * PAGE_SIZE, (i + 1) * PAGE_SIZE))}".encode()
        ).hexdigest()
        keys.append(prior)
    return keys


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE_SIZE + t for p in pages for t in range(PAGE_SIZE)], dtype=torch.int64)


def page_bytes(host, page: int) -> bytes:
    return host.get_data_page(page * PAGE_SIZE, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(autouse=True)
def tier_key(monkeypatch):
    monkeypatch.setenv("KVRS_TIER_KEY", SECRET)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interface", ["legacy", "v1", "v2"])
def test_pages_match_hicache_file_byte_for_byte(tmp_path, layout, interface):
    host = make_host(layout)
    ours = make_kvrs(host, layout, tmp_path / "kvrs")
    theirs = make_file(host, layout, tmp_path / "file")
    if interface == "v2":
        for b in (ours, theirs):
            b.register_mem_host_pool_v2(host, PoolName.KV)
    keys = page_keys(5)
    src = [1, 2, 3, 4, 5]
    original = [page_bytes(host, p) for p in src]

    # HiCacheFile has no v1 methods (SGLang drives it through the legacy ones).
    def legacy(b) -> bool:
        return interface == "legacy" or (interface == "v1" and b is theirs)

    def store(b):
        if legacy(b):
            data = [host.get_data_page(p * PAGE_SIZE, flat=True) for p in src]
            assert b.batch_set(keys, data) is True
        elif interface == "v1":
            assert b.batch_set_v1(keys, indices(src)) == [True] * 5
        else:
            t = PoolTransfer(name=PoolName.KV, host_indices=indices(src), keys=keys)
            assert b.batch_set_v2([t]) == {PoolName.KV: [True] * 5}

    def load(b, dst: list[int]) -> list[bool]:
        if legacy(b):
            got = b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
            for p, page in zip(dst, got, strict=True):
                if page is not None:
                    host.set_from_flat_data_page(p * PAGE_SIZE, page)
            return [g is not None for g in got]
        if interface == "v1":
            return b.batch_get_v1(keys, indices(dst))
        t = PoolTransfer(name=PoolName.KV, host_indices=indices(dst), keys=keys)
        return b.batch_get_v2([t])[PoolName.KV]

    for b in (ours, theirs):
        store(b)
        assert b.batch_exists(keys + page_keys(1, salt="absent")) == 5
    if interface == "v2":
        r_ours, r_theirs = ours.batch_exists_v2(keys), theirs.batch_exists_v2(keys)
        assert (r_ours.kv_hit_pages, r_ours.restorable_prefix_pages) == (
            r_theirs.kv_hit_pages,
            r_theirs.restorable_prefix_pages,
        )
    # The bytes kvrs sealed are HiCacheFile's file, page for page.
    store_kv = ours.store_of("kv")
    disk = store_kv.stats()["tiers"][0]["name"].removeprefix("disk:")
    tier = kvrs.DiskTier(disk, "64MiB")
    for key, want in zip(keys, original, strict=True):
        env = tier.get([store_kv.tier_key(key)])[0]
        assert env is not None and env[-32 - len(want) : -32] == want
        assert (tmp_path / "file" / f"{key}{theirs.config_suffix}.bin").read_bytes() == want
    # Loaded into other host pages, by each backend: the original bytes.
    for b, dst in ((theirs, [8, 9, 10, 11, 12]), (ours, [20, 21, 22, 23, 24])):
        assert load(b, dst) == [True] * 5
        assert [page_bytes(host, p) for p in dst] == original


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fault", ["flip", "truncate", "forge", "swap"])
def test_bad_page_files_are_misses_and_leave_the_host_pool(tmp_path, fault, layout):
    """v1 loads verify each page and copy it straight into its runs in the host pool
    (page_first: K and V; layer_first: one per layer and K/V): a bad one touches none."""
    host = make_host(layout)
    ours = make_kvrs(host, layout, tmp_path / "kvrs")
    keys = page_keys(3)
    assert ours.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
    store = ours.store_of()
    tier = kvrs.DiskTier(tmp_path / "kvrs", "64MiB")

    def path(s, key):
        *dirs, last = s.tier_key(key).removeprefix("kvrs:").split(":")
        return Path(tier.path, *dirs, f"{last}.kvb")

    target = path(store, keys[1])
    data = bytearray(target.read_bytes())
    if fault == "flip":
        data[-40] ^= 0x01  # one bit of K/V
    elif fault == "truncate":
        data = data[: len(data) // 2]
    elif fault == "forge":  # sealed by a writer without the secret
        forger = kvrs.PageStore([tier], fingerprint=store.fingerprint, tier_key=b"not-the-deployment-secret")
        forger.put_many([keys[1]], [bytes(len(page_bytes(host, 0)))])
        data = bytearray(path(forger, keys[1]).read_bytes())
    else:  # another page's sealed bytes under this page's name
        data = bytearray(path(store, keys[2]).read_bytes())
    target.write_bytes(bytes(data))
    before = page_bytes(host, 30)
    assert ours.batch_get_v1(keys, indices([29, 30, 31])) == [True, False, True]
    assert page_bytes(host, 29) == page_bytes(host, 1) and page_bytes(host, 31) == page_bytes(host, 3)
    assert page_bytes(host, 30) == before, "a bad page never reaches the host pool"
    # Discarded (or, cut short, never counted as present): the prefix stops before it.
    assert ours.batch_exists(keys) == 1


def test_a_pool_that_hands_out_copies_loads_through_a_staging_row(tmp_path, monkeypatch):
    """Where a host pool's page is a copy, not a view of its memory, writing into it would
    lose the page while reporting it loaded: kvrs sees that and stages the page instead."""
    host = make_host("page_first")
    ours = make_kvrs(host, "page_first", tmp_path / "kvrs")
    keys = page_keys(2)
    assert ours.batch_set_v1(keys, indices([1, 2])) == [True, True]
    original = host.get_data_page
    monkeypatch.setattr(host, "get_data_page", lambda index, flat=True: original(index, flat).clone())
    assert ours.batch_get_v1(keys, indices([20, 21])) == [True, True]
    assert page_bytes(host, 20) == page_bytes(host, 1) and page_bytes(host, 21) == page_bytes(host, 2)


@pytest.mark.parametrize(
    "other",
    [
        {"model": "org/qwen-7b"},
        {"dtype": torch.bfloat16},  # same page bytes: only the fingerprint tells them apart
        {"tp_rank": 1},
        {"namespace": "tenant-b"},
        {"secret": "another-deployments-secret-0123"},
        {"fingerprint": {"revision": "v2"}},
    ],
    ids=["model", "dtype", "tp_rank", "namespace", "secret", "revision"],
)
def test_other_models_dtypes_ranks_and_tenants_miss(tmp_path, monkeypatch, other):
    host = make_host("layer_first")
    writer = make_kvrs(host, "layer_first", tmp_path / "kvrs")
    keys = page_keys(3)
    assert writer.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
    reader_host = make_host("layer_first", dtype=other.get("dtype", torch.float16), seed=7)
    if "secret" in other:
        monkeypatch.setenv("KVRS_TIER_KEY", other["secret"])
    more = {k: other[k] for k in ("namespace", "fingerprint") if k in other}
    reader = make_kvrs(
        reader_host,
        "layer_first",
        tmp_path / "kvrs",
        model=other.get("model", "org/llama-3-8b"),
        tp_rank=other.get("tp_rank", 0),
        **more,
    )
    before = reader_host.kv_buffer.clone()
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, indices([5, 6, 7])) == [False] * 3
    assert reader.batch_get(keys, [reader_host.get_dummy_flat_data_page() for _ in keys]) == [None] * 3
    assert torch.equal(reader_host.kv_buffer, before)
    # The writer's own view is intact.
    assert writer.batch_exists(keys) == 3


def test_a_salt_passed_in_extra_info_is_a_namespace(tmp_path):
    host = make_host("page_first")
    b = make_kvrs(host, "page_first", tmp_path / "kvrs")
    keys = page_keys(2)
    a = HiCacheStorageExtraInfo(extra_info={"cache_salt": "tenant-a"})
    assert b.batch_set_v1(keys, indices([1, 2]), a) == [True, True]
    assert b.batch_exists(keys, a) == 2
    assert b.batch_exists(keys) == 0
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(extra_info={"cache_salt": "tenant-b"})) == 0
    assert b.batch_get_v1(keys, indices([5, 6])) == [False, False]
    b.clear()
    assert b.batch_exists(keys, a) == 0


def test_v2_extra_pools_follow_hicache_files_hit_policies(tmp_path):
    host, state = make_host("page_first"), make_host("page_first", seed=3)
    ours = make_kvrs(host, "page_first", tmp_path / "kvrs")
    theirs = make_file(host, "page_first", tmp_path / "file")
    keys = page_keys(4)
    for b in (ours, theirs):
        b.register_mem_host_pool_v2(host, PoolName.KV)
        b.register_mem_host_pool_v2(state, PoolName.MAMBA)
        kv = PoolTransfer(name=PoolName.KV, host_indices=indices([1, 2, 3, 4]), keys=keys)
        # The state pool holds only the last two pages of the prefix.
        st = PoolTransfer(name=PoolName.MAMBA, host_indices=indices([5, 6]), keys=keys[2:])
        assert b.batch_set_v2([kv, st]) == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True, True]}
    for policy, trailing in [(PoolHitPolicy.TRAILING_PAGES, keys[2:]), (PoolHitPolicy.ALL_PAGES, keys)]:
        probe = [PoolTransfer(name=PoolName.MAMBA, keys=trailing, hit_policy=policy)]
        r_ours, r_theirs = ours.batch_exists_v2(keys, probe), theirs.batch_exists_v2(keys, probe)
        assert r_ours.kv_hit_pages == r_theirs.kv_hit_pages
        assert r_ours.restorable_prefix_pages == r_theirs.restorable_prefix_pages
        assert {str(k): v for k, v in r_ours.extra_pool_hit_pages.items()} == {
            str(k): v for k, v in r_theirs.extra_pool_hit_pages.items()
        }
    # The state pool's pages are their own: read back into other slots, byte-equal.
    got = ours.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=indices([9, 10]), keys=keys[2:])])
    assert got == {PoolName.MAMBA: [True, True]}
    assert [page_bytes(state, p) for p in (9, 10)] == [page_bytes(state, p) for p in (5, 6)]
    # A KV key is not a state page: the pools' fingerprints differ.
    assert ours.store_of(PoolName.MAMBA).exists_prefix(keys[:2]) == 0


def test_bad_configs_are_refused_by_name(tmp_path, monkeypatch):
    host = make_host("page_first")
    monkeypatch.setenv("KVRS_TIER_KEY", "short")
    with pytest.raises(ValueError, match=r"\$KVRS_TIER_KEY holds 5 bytes"):
        StorageBackendFactory.create_backend("dynamic", config("page_first", kvrs_extra(tmp_path)), host)
    monkeypatch.setenv("KVRS_TIER_KEY", SECRET)
    with pytest.raises(ValueError, match="tiers"):
        StorageBackendFactory.create_backend(
            "dynamic", config("page_first", {**kvrs_extra(tmp_path), "tiers": []}), host
        )
    with pytest.raises(ValueError, match=r"tiers\[0\].*type='nvme'"):
        StorageBackendFactory.create_backend(
            "dynamic", config("page_first", {**kvrs_extra(tmp_path), "tiers": [{"type": "nvme"}]}), host
        )
    with pytest.raises(TypeError, match=r"tiers\[0\]"):
        StorageBackendFactory.create_backend(
            "dynamic",
            config("page_first", {**kvrs_extra(tmp_path), "tiers": [{"type": "disk", "size": 1}]}),
            host,
        )


@pytest.fixture(scope="module")
def controller_env(tmp_path_factory):
    """What SGLang's HiCacheController needs on the CPU: a gloo group of one process, the
    parallel widths published, and ninja on PATH for its page-hash extension (built on
    first use by torch, with g++ and OpenSSL's headers)."""
    import os
    import shutil
    import sys

    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    if shutil.which("ninja") is None or shutil.which("g++") is None:
        pytest.skip("SGLang's page-hash extension needs ninja (tests/engines/requirements.txt) and g++")
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_sglangs_controller_backs_up_and_prefetches_through_kvrs(tmp_path, controller_env):
    """SGLang's own HiCacheController threads: the backup thread stores pages through
    batch_set_v1 (interface_v1), the prefetch thread finds them with batch_exists, and the
    prefetch I/O path loads them with batch_get_v1 into other host pages, byte-equal; a
    corrupted page stops the prefetch there, its host page untouched."""
    import threading
    import time

    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.utils import get_hash_str

    dev = MHATokenToKVPool(
        size=64,
        page_size=PAGE_SIZE,
        dtype=torch.float16,
        head_num=2,
        head_dim=8,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    host = MHATokenToKVPoolHost(
        dev._mha_buffer_info(),
        2.0,
        0,
        PAGE_SIZE,
        "page_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=64,
        start_layer=0,
        end_layer=2,
    )
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=torch.Generator().manual_seed(5)).half())
    alloc = PagedTokenToKVPoolAllocator(64, PAGE_SIZE, torch.float16, "cpu", dev, need_sort=False)
    ctl = HiCacheController(
        alloc,
        host,
        PAGE_SIZE,
        tp_group=controller_env,
        load_cache_event=threading.Event(),
        write_policy="write_through",
        storage_backend="dynamic",
        storage_backend_extra_config=kvrs_extra(tmp_path / "kvrs"),
        model_name="org/llama-3-8b",
    )
    backend = ctl.storage_backend
    assert isinstance(backend, KvrsHiCacheStorage)
    assert ctl.page_get_func == ctl._page_get_zero_copy  # SGLang calls the v1 methods

    def wait(cond, what: str) -> None:
        deadline = time.monotonic() + 30
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    tokens = list(range(4 * PAGE_SIZE))
    hashes = get_hash_str(tokens, None, page_size=PAGE_SIZE)
    written = host.alloc(len(tokens))
    ctl.write_storage(written, tokens, hash_value=hashes)
    wait(lambda: backend.batch_exists(hashes) == 4, "the backup thread stores 4 pages")

    # Page 2's file is corrupted: the prefetch stops before it.
    store = backend.store_of()
    *dirs, last = store.tier_key(hashes[2]).removeprefix("kvrs:").split(":")
    bad = Path(tmp_path / "kvrs", *dirs, f"{last}.kvb")
    data = bytearray(bad.read_bytes())
    data[-100] ^= 0x40
    bad.write_bytes(bytes(data))

    op = ctl.prefetch("req-1", tokens + [7] * PAGE_SIZE)
    wait(lambda: op.hash_value, "the prefetch thread's hit query")
    assert len(op.hash_value) == 4  # present at the right length: the MAC is checked on load
    op.host_indices = host.alloc(len(op.hash_value) * PAGE_SIZE)
    before = page_bytes(host, int(op.host_indices[2 * PAGE_SIZE]) // PAGE_SIZE)
    assert ctl._page_transfer(op) == 2
    for p in range(2):
        assert page_bytes(host, int(op.host_indices[p * PAGE_SIZE]) // PAGE_SIZE) == page_bytes(
            host, int(written[p * PAGE_SIZE]) // PAGE_SIZE
        )
    assert page_bytes(host, int(op.host_indices[2 * PAGE_SIZE]) // PAGE_SIZE) == before
    assert backend.batch_exists(hashes) == 2, "the bad page was discarded"
    assert store.stats()["rejected"] == 1
