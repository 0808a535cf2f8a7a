"""KvrsSecondaryTier inside a real vLLM 0.33 engine's scheduler: vLLM's ``Scheduler`` and
``OffloadingConnector`` with a ``TieringOffloadingSpec`` whose secondary tier is
``kvrs.integrations.vllm``, built from the config line docs/engines.md gives by vLLM's own
test utilities (``create_vllm_config``, ``create_scheduler``, ``create_request``; from its
source package). A request whose prompt an earlier engine stored is matched from kvrs after
a restart, and the load the scheduler hands the worker reads the stored bytes; damaged
chunks shorten the match instead of loading wrong K/V.

(The GPU side, vLLM's CPU -> GPU copy worker, needs CUDA: these tests stop at the load the
scheduler hands it.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

SECRET = "vllm-test-tier-key-0123456789abcdef"
BLOCK = 16


@pytest.fixture(autouse=True)
def _tier_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRS_TIER_KEY", SECRET)


def kvrs_offloading(path: Path) -> dict[str, Any]:
    """``kv_connector_extra_config`` of vLLM's OffloadingConnector with kvrs under its CPU tier."""
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 64 * 4096 * 4,
        "secondary_tiers": [
            {
                "type": "KvrsSecondaryTier",
                "module_path": "kvrs.integrations.vllm",
                "tiers": [{"type": "disk", "path": str(path), "max_bytes": "64MiB"}],
            }
        ],
    }


def engine(vllm_tests: Path, path: Path) -> Any:
    from tests.v1.kv_connector.unit.utils import create_scheduler, create_vllm_config

    cfg = create_vllm_config(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        block_size=BLOCK,
        kv_connector_extra_config=kvrs_offloading(path),
    )
    return create_scheduler(cfg)


def store_prompt(sched: Any, request: Any, path: Path, seed: int) -> np.ndarray:
    """What an earlier engine cascaded to kvrs for `request`'s prompt: one chunk per full
    block, under vLLM's own keys, through a tier made like the engine's; the chunks' bytes."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvrs.integrations.vllm import KvrsSecondaryTier

    reader = sched.connector.connector_scheduler.manager.secondary_tiers[0]
    keys = [make_offload_key(h, 0) for h in request.block_hashes]
    rows = np.random.default_rng(seed).integers(0, 256, (len(keys), reader.block_size_bytes), dtype=np.uint8)
    writer = KvrsSecondaryTier(
        reader._offloading_spec,
        memoryview(rows),
        "KvrsSecondaryTier",
        tiers=[{"type": "disk", "path": str(path), "max_bytes": "64MiB"}],
    )
    job = TransferJob(
        job_id=1,
        keys=keys,
        chunk_ids=np.arange(len(keys)),
        is_promotion=False,
        req_context=ReqContext(req_id="writer"),
    )
    writer.submit_store(job)
    writer.drain_jobs()
    assert [r.success for r in writer.get_finished_jobs()] == [True]
    writer.shutdown()
    return rows


def cpu_rows(sched: Any) -> np.ndarray:
    """The engine's CPU tier: one row of bytes per chunk."""
    view = np.asarray(sched.connector.connector_scheduler.manager.primary_tier.get_kv_memoryview())
    return view.reshape(view.shape[0], -1).view(np.uint8)


def first_load(sched: Any, request: Any, deadline_s: float = 10.0) -> tuple[int, Any]:
    """Steps the scheduler until it hands the worker a load for `request` (or schedules
    it to compute); the tokens it took from the connector and that load (or None)."""
    from tests.v1.kv_connector.unit.utils import create_model_runner_output

    sched.add_request(request)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        out = sched.schedule()
        jobs = list(out.kv_connector_metadata.load_jobs.values())
        if jobs or out.num_scheduled_tokens:
            scheduled = out.num_scheduled_tokens.get(request.request_id, 0)
            return request.num_computed_tokens - scheduled, (jobs[0] if jobs else None)
        sched.update_from_output(out, create_model_runner_output(reqs=list(sched.running)))
        time.sleep(0.01)  # the tier's lookups and promotions run on its own threads
    raise AssertionError("the scheduler never resolved the request's lookup")


def test_a_restarted_engine_loads_the_prompt_from_kvrs(vllm_tests: Path, tmp_path: Path) -> None:
    from tests.v1.kv_connector.unit.utils import create_request

    sched = engine(vllm_tests, tmp_path)
    request = create_request(request_id=1, num_tokens=5 * BLOCK + 4, block_size=BLOCK)
    want = store_prompt(sched, request, tmp_path, seed=0)
    tokens, load = first_load(sched, request)
    assert tokens == 5 * BLOCK
    assert load is not None and len(load.src_spec.chunk_ids) == 5
    assert np.array_equal(cpu_rows(sched)[load.src_spec.chunk_ids], want)


def test_a_damaged_chunk_shortens_the_match(vllm_tests: Path, tmp_path: Path) -> None:
    from tests.v1.kv_connector.unit.utils import create_request

    sched = engine(vllm_tests, tmp_path)
    request = create_request(request_id=2, num_tokens=5 * BLOCK + 4, block_size=BLOCK)
    want = store_prompt(sched, request, tmp_path, seed=1)
    # Corrupt every stored chunk but one byte's worth: find the third chunk by its bytes.
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    third = [p for p in files if want[2].tobytes() in p.read_bytes()]
    assert len(third) == 1
    b = bytearray(third[0].read_bytes())
    at = bytes(b).index(want[2].tobytes()) + 100
    b[at] ^= 1
    third[0].write_bytes(bytes(b))
    tokens, load = first_load(sched, request)
    assert tokens == 2 * BLOCK, "the match must stop before the damaged chunk"
    primary = np.asarray(sched.connector.connector_scheduler.manager.primary_tier.get_kv_memoryview())
    assert load is not None
    assert np.array_equal(
        primary.reshape(primary.shape[0], -1).view(np.uint8)[load.src_spec.chunk_ids], want[:2]
    )


def test_another_tenants_prompt_is_not_matched(vllm_tests: Path, tmp_path: Path) -> None:
    """vLLM folds ``cache_salt`` into the block hashes; kvrs's keys are those hashes, so a
    salted tenant never matches another's chunks, even for the same prompt."""
    from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID, create_request
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sched = engine(vllm_tests, tmp_path)
    a = create_request(request_id=3, num_tokens=3 * BLOCK + 4, block_size=BLOCK)
    store_prompt(sched, a, tmp_path, seed=2)
    params = SamplingParams(max_tokens=16)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    b = Request(
        request_id="id-tenant-b",
        prompt_token_ids=list(a.prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        cache_salt="tenant-b",
    )
    assert b.block_hashes and b.block_hashes[0] != a.block_hashes[0]
    tokens, load = first_load(sched, b)
    assert tokens == 0 and load is None
