"""KvrsConnector as vLLM 0.33 loads it (``kv_connector_module_path``): the scheduler side
inside vLLM's real ``Scheduler``, the worker side made by vLLM's ``KVConnectorFactory`` over
CPU KV cache tensors, stepped by hand as vLLM's engine steps them (schedule, bind the
metadata, load, forward, save, update), with vLLM's own test utilities. An engine that
computed a prompt saves its blocks; a restarted engine matches them, loads the exact bytes
into the blocks vLLM allocated and computes only the last token; a damaged block is
reported as a load error and recomputed (``kv_load_failure_policy="recompute"``), never
loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

SECRET = "vllm-test-tier-key-0123456789abcdef"
BLOCK = 16
NUM_BLOCKS = 64


@pytest.fixture(autouse=True)
def _tier_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRS_TIER_KEY", SECRET)


class Engine:
    """A vLLM engine without a model: the real scheduler with KvrsConnector, the worker's
    connector over a CPU KV cache, and a forward that writes each computed token's K/V as
    a function of the token id and its position (so the bytes of a block tell what was
    computed into it)."""

    def __init__(self, path: Path, policy: str = "recompute", extra: dict[str, Any] | None = None) -> None:
        import torch
        from tests.v1.kv_connector.unit.utils import create_scheduler, create_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        self.cfg = create_vllm_config(
            kv_connector="KvrsConnector",
            kv_connector_module_path="kvrs.integrations.vllm",
            kv_role="kv_both",
            block_size=BLOCK,
            kv_load_failure_policy=policy,
            kv_connector_extra_config={
                "tiers": [{"type": "disk", "path": str(path), "max_bytes": "64MiB"}],
                **(extra or {}),
            },
        )
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=4, dtype=torch.float32)
        self.kv_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0", "layer.1"], spec)],
        )
        self.sched = create_scheduler(self.cfg, num_blocks=NUM_BLOCKS, kv_cache_config=self.kv_config)
        self.worker = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kv_config)
        # vLLM's attention layout: (2, num_blocks, block_size, kv_heads, head_size) per layer.
        self.kv = {n: torch.zeros((2, NUM_BLOCKS, BLOCK, 2, 4)) for n in ("layer.0", "layer.1")}
        self.worker.register_kv_caches(self.kv)
        self.load_errors: set[int] = set()

    def forward(self, out: Any) -> None:
        """Writes the K/V of every token scheduled this step (a function of its id and position)."""
        for new in out.scheduled_new_reqs:
            self._write(new.req_id, new.block_ids[0], new.num_computed_tokens, out)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self.sched.requests[req_id]
            ids = self.sched.kv_cache_manager.get_block_ids(req_id)[0]
            self._write(req_id, ids, cached.num_computed_tokens[i], out, req)

    def _write(self, req_id: str, block_ids: list[int], start: int, out: Any, req: Any = None) -> None:
        req = req or self.sched.requests[req_id]
        for pos in range(start, start + out.num_scheduled_tokens[req_id]):
            tok = req.all_token_ids[pos]
            b, off = block_ids[pos // BLOCK], pos % BLOCK
            for li, t in enumerate(self.kv.values()):
                t[:, b, off] = float(tok * 1000 + pos * 10 + li)

    def step(self) -> Any:
        from tests.v1.kv_connector.unit.utils import create_model_runner_output

        out = self.sched.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        self.forward(out)
        self.worker.wait_for_save()
        errors = self.worker.get_block_ids_with_load_errors()
        self.load_errors |= errors
        self.worker.clear_connector_metadata()
        running = [self.sched.requests[r] for r in out.num_scheduled_tokens]
        mro = create_model_runner_output(reqs=running, invalid_block_ids=errors or None)
        self.sched.update_from_output(out, mro)
        return out

    def run(self, request: Any, max_steps: int = 40) -> list[Any]:
        """Steps until `request` finishes; every step's scheduler output."""
        self.sched.add_request(request)
        outs = []
        for _ in range(max_steps):
            outs.append(self.step())
            if request.request_id not in self.sched.requests:
                return outs
        raise AssertionError("the request never finished")


def prompt_request(request_id: str, tokens: list[int], max_tokens: int = 2) -> Any:
    from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


PROMPT = [7 + (i * 13) % 97 for i in range(5 * BLOCK + 4)]


def expected_block(tokens: list[int], b: int) -> np.ndarray:
    """What the forward wrote for block `b` of a prompt, per layer: (layers, 2, BLOCK)."""
    return np.array(
        [
            [[tokens[p] * 1000 + p * 10 + li for p in range(b * BLOCK, (b + 1) * BLOCK)]] * 2
            for li in range(2)
        ],
        dtype=np.float32,
    )


def blocks_of(engine: Engine, req_id: str, outs: list[Any]) -> list[int]:
    for out in outs:
        for new in out.scheduled_new_reqs:
            if new.req_id == req_id:
                return list(new.block_ids[0])
    raise AssertionError(f"{req_id} was never scheduled")


def test_a_restarted_engine_loads_the_prompt_and_computes_one_token(vllm_tests: Path, tmp_path: Path) -> None:
    first = Engine(tmp_path)
    first.run(prompt_request("a", PROMPT))
    assert first.worker.kvrs_stats()["stored"] >= 5

    second = Engine(tmp_path)
    req = prompt_request("b", PROMPT)
    outs = second.run(req)
    new = outs[0].scheduled_new_reqs[0]
    assert new.num_computed_tokens == 5 * BLOCK, "kvrs should supply the five full prompt blocks"
    assert outs[0].num_scheduled_tokens["b"] == len(PROMPT) - 5 * BLOCK
    ids = blocks_of(second, "b", outs)
    for b in range(5):
        got = np.stack([t[:, ids[b], :, 0, 0].numpy() for t in second.kv.values()])
        assert np.array_equal(got, expected_block(PROMPT, b)), f"block {b}"
    assert not second.load_errors


def test_a_damaged_block_is_a_load_error_and_is_recomputed(vllm_tests: Path, tmp_path: Path) -> None:
    first = Engine(tmp_path)
    first.run(prompt_request("a", PROMPT))
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    # Block 2's first token in layer 0: its K, 2 heads x 4 values, all the same.
    marker = np.full(8, expected_block(PROMPT, 2)[0, 0, 0], np.float32).tobytes()
    damaged = [p for p in files if marker in p.read_bytes()]
    assert len(damaged) == 1
    blob = bytearray(damaged[0].read_bytes())
    blob[blob.index(marker) + 8] ^= 1
    damaged[0].write_bytes(bytes(blob))

    second = Engine(tmp_path)
    req = prompt_request("b", PROMPT)
    outs = second.run(req)
    ids = blocks_of(second, "b", outs)
    assert second.load_errors == {ids[2]}
    # vLLM recomputed from the damaged block on: every block now holds the right K/V.
    for b in range(5):
        got = np.stack([t[:, ids[b], :, 0, 0].numpy() for t in second.kv.values()])
        assert np.array_equal(got, expected_block(PROMPT, b)), f"block {b}"
    assert second.worker.kvrs_stats()["rejected"] == 1


@pytest.mark.parametrize("extra", [{"fingerprint": {"revision": "v2"}}, {"namespace": "tenant-b"}])
def test_another_revision_or_tenant_matches_nothing(
    vllm_tests: Path, tmp_path: Path, extra: dict[str, Any]
) -> None:
    Engine(tmp_path).run(prompt_request("a", PROMPT))
    second = Engine(tmp_path, extra=extra)
    outs = second.run(prompt_request("b", PROMPT))
    assert outs[0].scheduled_new_reqs[0].num_computed_tokens == 0
    assert second.worker.kvrs_stats()["hits"] == 0
