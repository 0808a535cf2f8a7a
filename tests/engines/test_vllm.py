"""kvrs.integrations.vllm.KvrsSecondaryTier through vLLM 0.33's own classes: built by
vLLM's ``SecondaryTierFactory`` from a ``TieringOffloadingSpec`` config (module path, no
registration), driven by the real ``TieringOffloadingManager`` over a real
``CPUPrimaryTierOffloadingManager`` (cascade, asynchronous lookup, promotion, restart),
compared byte for byte with vLLM's own file-system tier. Faults (a corrupted, truncated,
forged or swapped chunk file; another model's, dtype's, rank's, key's or tenant's chunks;
a dead Redis; a full tier; a writer killed mid-write) are misses or failed jobs that leave
the CPU tier's rows untouched, never wrong bytes, never a hang or a livelock.

Needs vLLM (tests/engines/requirements.txt); skipped without it."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

import kvrs
from kvrs.integrations.vllm import KvrsSecondaryTier, offloading_fingerprint

SECRET = "vllm-test-tier-key-0123456789abcdef"
ROW = 4096  # bytes per chunk (one row of the CPU tier)
CHUNKS = 8
DEADLINE_S = 10.0


@pytest.fixture(autouse=True)
def _tier_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRS_TIER_KEY", SECRET)


def spec(model: str = "facebook/opt-125m", dtype: str = "float16", rank: int = 0, tp: int = 1) -> Any:
    """What a ``TieringOffloadingSpec`` hands its tiers: vLLM's real ``OffloadingConfig``."""
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=ROW,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="test-engine",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        kv_cache_layout="NHD",
    )
    events = OffloadingKVEventsConfig(enable_kv_cache_events=False, self_describing_kv_events=False)
    return SimpleNamespace(config=config, kv_events_config=events, blocks_per_chunk=1)


class Region:
    """The CPU tier's buffer (vLLM's ``SharedOffloadRegion`` role): rows of chunk bytes."""

    def __init__(self, chunks: int = CHUNKS) -> None:
        # Page-aligned, as vLLM's region is (its fs tier reads and writes with O_DIRECT).
        self._map = mmap.mmap(-1, chunks * ROW)
        self.rows = np.frombuffer(self._map, dtype=np.uint8).reshape(chunks, ROW)

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.rows)

    def cleanup(self) -> None:
        """vLLM unmaps its region here; this one goes with its last reference."""


def key(n: int) -> Any:
    return make_offload_key(n.to_bytes(8, "big"), 0)


def job(job_id: int, keys: list[Any], chunk_ids: list[int], promotion: bool = False) -> TransferJob:
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunk_ids, dtype=np.int64),
        is_promotion=promotion,
        req_context=ReqContext(req_id="r"),
    )


def disk(path: Path, max_bytes: int | str = "64MiB") -> list[dict[str, Any]]:
    return [{"type": "disk", "path": str(path), "max_bytes": max_bytes}]


def make_tier(region: Region, tiers: list[dict[str, Any]], **kw: Any) -> KvrsSecondaryTier:
    """The tier as vLLM's factory builds it from a ``secondary_tiers`` entry."""
    cls = SecondaryTierFactory.get_tier_class(
        {"type": "KvrsSecondaryTier", "module_path": "kvrs.integrations.vllm"}
    )
    assert cls is KvrsSecondaryTier
    return cls(
        offloading_spec=kw.pop("offloading_spec", None) or spec(),
        primary_kv_view=region.create_kv_memoryview(),
        tier_type="KvrsSecondaryTier",
        tiers=tiers,
        **kw,
    )


def finish(tier: Any) -> list[Any]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def probe(tier: Any, keys: list[Any], ctx: ReqContext | None = None) -> list[LookupResult]:
    """A whole asynchronous lookup: RETRY until the tier's probe is back (within a deadline)."""
    ctx = ctx or ReqContext(req_id="probe")
    end = time.monotonic() + DEADLINE_S
    while True:
        got = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in got:
            return got
        assert time.monotonic() < end, "lookup never resolved"
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.005)


def fill(region: Region, seed: int) -> np.ndarray:
    region.rows[:] = np.random.default_rng(seed).integers(0, 256, region.rows.shape, dtype=np.uint8)
    return region.rows.copy()


def write_chunks(path: Path, keys: list[Any], seed: int = 1, **kw: Any) -> np.ndarray:
    """A writer's run: chunks 0.. of a filled CPU tier stored under `keys`; their bytes."""
    region = Region()
    want = fill(region, seed)
    tier = make_tier(region, disk(path), **kw)
    tier.submit_store(job(1, keys, list(range(len(keys)))))
    assert [r.success for r in finish(tier)] == [True]
    tier.shutdown()
    return want[: len(keys)]


# -- round trips --------------------------------------------------------------------------


def test_store_then_load_round_trip_in_a_fresh_tier(tmp_path: Path) -> None:
    keys = [key(i) for i in range(4)]
    want = write_chunks(tmp_path, keys)
    region = Region()
    tier = make_tier(region, disk(tmp_path))
    assert probe(tier, keys + [key(99)]) == [LookupResult.HIT] * 4 + [LookupResult.MISS]
    tier.submit_load(job(2, keys, [7, 5, 3, 1], promotion=True))
    (res,) = finish(tier)
    assert res.success and res.transfer_bytes == 4 * ROW
    assert np.array_equal(region.rows[[7, 5, 3, 1]], want)
    assert not region.rows[[0, 2, 4, 6]].any()
    tier.shutdown()


def test_same_bytes_as_vllms_own_fs_tier(tmp_path: Path) -> None:
    """vLLM's ``FileSystemTierManager`` as the byte oracle: the same chunks stored by both
    tiers and loaded back into fresh CPU tiers are identical."""
    keys = [key(i) for i in range(3)]
    src = Region()
    fill(src, 7)
    ours = make_tier(src, disk(tmp_path / "kvrs"))
    theirs = FileSystemTierManager(spec(), src.create_kv_memoryview(), "fs", root_dir=str(tmp_path / "fs"))
    for t in (ours, theirs):
        t.submit_store(job(1, keys, [0, 1, 2]))
        assert [r.success for r in finish(t)] == [True]
    a, b = Region(), Region()
    ours2 = make_tier(a, disk(tmp_path / "kvrs"))
    theirs2 = FileSystemTierManager(spec(), b.create_kv_memoryview(), "fs", root_dir=str(tmp_path / "fs"))
    for t in (ours2, theirs2):
        assert probe(t, keys) == [LookupResult.HIT] * 3
        t.submit_load(job(2, keys, [4, 5, 6], promotion=True))
        assert [r.success for r in finish(t)] == [True]
    assert np.array_equal(a.rows, b.rows) and a.rows[4:7].any()
    for t in (ours, theirs, ours2, theirs2):
        t.shutdown()


def test_through_the_tiering_manager_with_a_restart(tmp_path: Path) -> None:
    """vLLM's real ``TieringOffloadingManager``: chunks stored into the CPU tier cascade to
    kvrs; after a restart (a new CPU tier, empty, and a new tier on the same disk) the
    lookups promote them back, and the CPU tier's slots hold the original bytes."""
    keys = [key(i) for i in range(3)]
    ctx = ReqContext(req_id="a")
    region = Region()
    primary = CPUPrimaryTierOffloadingManager(num_chunks=CHUNKS, mmap_region=region)
    tier = make_tier(region, disk(tmp_path))
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    ids = [int(c) for c in out.store_spec.chunk_ids]
    rng = np.random.default_rng(3)
    want = rng.integers(0, 256, (3, ROW), dtype=np.uint8)
    region.rows[ids] = want  # the GPU -> CPU copy
    manager.complete_store(keys, ctx)  # cascades to kvrs
    end = time.monotonic() + DEADLINE_S
    while tier.kvrs_stats()["stored"] < 3:
        assert time.monotonic() < end, "the cascade never finished"
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.005)
    manager.on_request_finished(ctx)
    manager.shutdown()

    region2 = Region()
    primary2 = CPUPrimaryTierOffloadingManager(num_chunks=CHUNKS, mmap_region=region2)
    tier2 = make_tier(region2, disk(tmp_path))
    manager2 = TieringOffloadingManager(primary_tier=primary2, secondary_tiers=[tier2])
    ctx2 = ReqContext(req_id="b")
    manager2.on_new_request(ctx2)
    end = time.monotonic() + DEADLINE_S
    while True:
        got = [manager2.lookup(k, ctx2) for k in keys]
        if got == [LookupResult.HIT] * 3:
            break
        assert LookupResult.MISS not in got, got
        assert time.monotonic() < end, f"promotion never finished: {got}"
        manager2.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.005)
    spec_load = manager2.prepare_load(keys, ctx2)
    assert np.array_equal(region2.rows[[int(c) for c in spec_load.chunk_ids]], want)
    manager2.complete_load(keys, ctx2)
    manager2.on_request_finished(ctx2)
    manager2.shutdown()


# -- faults: misses, never wrong bytes ------------------------------------------------------


def chunk_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def corrupt(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x40
    p.write_bytes(bytes(b))


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-100])


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "swap"])
def test_damaged_chunks_fail_their_load_and_then_miss(tmp_path: Path, damage: str) -> None:
    keys = [key(i) for i in range(4)]
    want = write_chunks(tmp_path, keys)
    files = chunk_files(tmp_path)
    assert len(files) == 4
    # Which file is which chunk is kvrs's business: damage two of them.
    if damage == "corrupt":
        corrupt(files[0])
        corrupt(files[2])
    elif damage == "truncate":
        truncate(files[0])
        truncate(files[2])
    else:  # two chunks' payloads swapped: each is a valid payload of another key
        a, b = files[0].read_bytes(), files[2].read_bytes()
        files[0].write_bytes(b)
        files[2].write_bytes(a)
    region = Region()
    tier = make_tier(region, disk(tmp_path))
    ctx = ReqContext(req_id="x")
    found = probe(tier, keys, ctx)
    # A truncated file is already a miss (its length is not a payload's); every other
    # damaged chunk is found, then refused when it is read.
    hits = [k for k, f in zip(keys, found, strict=True) if f is LookupResult.HIT]
    assert len(hits) == (2 if damage == "truncate" else 4)
    slots = list(range(len(hits)))
    tier.submit_load(job(2, hits, slots, promotion=True))
    (res,) = finish(tier)
    ok = set(hits) if res.success else set(res.successful_keys or ())
    assert len(ok) == 2 and res.success == (damage == "truncate")
    for k, slot in zip(hits, slots, strict=True):
        row = region.rows[slot]
        if k in ok:
            assert np.array_equal(row, want[keys.index(k)])
        else:
            assert not row.any(), "a refused chunk reached the CPU tier"
    # The damaged chunks are misses from now on, for this request and the next: no livelock.
    bad = [k for k in keys if k not in ok]
    assert probe(tier, bad, ctx) == [LookupResult.MISS] * 2
    tier.on_request_finished(ctx)
    assert probe(tier, bad, ReqContext(req_id="y")) == [LookupResult.MISS] * 2
    if damage != "truncate":
        assert tier.kvrs_stats()["rejected"] == 2
    tier.shutdown()


@pytest.mark.parametrize(
    "reader",
    [
        {"offloading_spec": spec(model="facebook/opt-350m")},
        {"offloading_spec": spec(dtype="bfloat16")},
        {"offloading_spec": spec(rank=1, tp=2)},
        {"namespace": "tenant-b"},
        {"fingerprint": {"revision": "v2"}},
        {"tier_key": "another-tier-key-0123456789abcdef"},
    ],
    ids=["model", "dtype", "rank", "tenant", "revision", "tier_key"],
)
def test_another_configurations_chunks_are_never_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: dict[str, Any]
) -> None:
    keys = [key(i) for i in range(3)]
    write_chunks(tmp_path, keys)
    reader = dict(reader)
    if "tier_key" in reader:
        monkeypatch.setenv("KVRS_TIER_KEY", reader.pop("tier_key"))
    region = Region()
    tier = make_tier(region, disk(tmp_path), **reader)
    assert probe(tier, keys) == [LookupResult.MISS] * 3
    # Even asked to load them (a stale verdict), nothing reaches the CPU tier.
    tier.submit_load(job(2, keys, [0, 1, 2], promotion=True))
    (res,) = finish(tier)
    assert not res.success and not res.successful_keys
    assert not region.rows.any()
    tier.shutdown()


def test_a_dead_redis_fails_jobs_without_hanging() -> None:
    region = Region()
    fill(region, 5)
    tier = make_tier(region, [{"type": "redis", "url": "redis://127.0.0.1:1/0", "timeout": 0.2}])
    keys = [key(i) for i in range(3)]
    start = time.monotonic()
    tier.submit_store(job(1, keys, [0, 1, 2]))
    assert [r.success for r in finish(tier)] == [False]
    assert probe(tier, keys) == [LookupResult.MISS] * 3
    before = region.rows.copy()
    tier.submit_load(job(2, keys, [3, 4, 5], promotion=True))
    assert [r.success for r in finish(tier)] == [False]
    assert np.array_equal(region.rows, before)
    assert time.monotonic() - start < DEADLINE_S
    tier.shutdown()


def test_a_tier_too_small_for_a_chunk_stores_nothing_visible(tmp_path: Path) -> None:
    region = Region()
    fill(region, 6)
    tier = make_tier(region, disk(tmp_path, max_bytes=ROW // 2))
    keys = [key(i) for i in range(2)]
    tier.submit_store(job(1, keys, [0, 1]))
    assert [r.success for r in finish(tier)] == [False]
    assert probe(tier, keys) == [LookupResult.MISS] * 2
    tier.shutdown()


def test_a_writer_killed_mid_write_leaves_nothing_wrong(tmp_path: Path) -> None:
    """A process storing chunks in a loop is killed (SIGKILL); every chunk a reader then
    finds loads the writer's exact bytes, and every other one is a miss."""
    region = Region()
    probe_tier = make_tier(region, disk(tmp_path))
    fp = probe_tier.store.fingerprint
    probe_tier.shutdown()
    script = textwrap.dedent(
        f"""
        import json, sys, numpy as np, kvrs
        tiers = [kvrs.DiskTier({str(tmp_path)!r}, "64MiB")]
        store = kvrs.PageStore(tiers, fingerprint=json.loads(sys.argv[1]), tier_key={SECRET!r})
        i = 0
        while True:
            page = np.full({ROW}, i % 251, dtype=np.uint8)
            store.put_many([(i % 64).to_bytes(8, "big").hex() + "00000000"], [page])
            if i == 20:
                print("writing", flush=True)
            i += 1
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(fp)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=DEADLINE_S)
    keys = [key(i) for i in range(64)]
    tier = make_tier(region, disk(tmp_path))
    found = probe(tier, keys)
    hits = [k for k, f in zip(keys, found, strict=True) if f is LookupResult.HIT]
    assert hits
    tier.submit_load(job(2, hits[:CHUNKS], list(range(min(CHUNKS, len(hits)))), promotion=True))
    (res,) = finish(tier)
    loaded = set(hits[:CHUNKS]) if res.success else set(res.successful_keys or ())
    for slot, k in enumerate(hits[:CHUNKS]):
        row = region.rows[slot]
        if k in loaded:
            assert (row == row[0]).all(), "a torn chunk was loaded"
        else:
            assert not row.any()
    tier.shutdown()


def test_fingerprint_names_the_engines_facts() -> None:
    fp = offloading_fingerprint(spec(), ROW, {"revision": "abc"})
    assert fp["engine"] == "vllm" and fp["model"] == "facebook/opt-125m" and fp["kv_dtype"] == "float16"
    assert fp["rank"] == 0 and fp["page_bytes"] == ROW and fp["extra.revision"] == "abc"
    with pytest.raises(TypeError, match="fingerprint"):
        offloading_fingerprint(spec(), ROW, {"revision": [1]})


def test_bad_configuration_is_refused_by_name(tmp_path: Path) -> None:
    region = Region()
    with pytest.raises(ValueError, match="tiers"):
        make_tier(region, [])
    with pytest.raises(ValueError, match="type="):
        make_tier(region, [{"type": "s3"}])
    with pytest.raises(ValueError, match="io_threads"):
        make_tier(region, disk(tmp_path), io_threads=0)
    os.environ["KVRS_TIER_KEY"] = "short"
    with pytest.raises(ValueError, match="at least 16"):
        make_tier(region, disk(tmp_path))
    assert isinstance(kvrs.PageStore, type)
