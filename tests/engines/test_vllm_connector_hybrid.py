"""KvrsConnector on a hybrid model (full attention + Mamba/GDN layers in vLLM's
``mamba_cache_mode="align"``), inside vLLM 0.33's real ``Scheduler`` with its hybrid KV
cache manager, the worker side made by ``KVConnectorFactory`` over CPU caches in vLLM's
layouts (a tensor per attention layer, a list of state tensors per Mamba layer).

The forward is a model without weights that reads what a real one reads: the K/V of every
earlier position and the recurrent state after the last computed token, from the blocks
vLLM's block tables name (the state is read from the block of the last computed token and
written to the block of the last scheduled one, as vLLM's align mode does). Before every
step it checks both against the prefix computed from scratch, so a K/V page or a state
restored at the wrong boundary, from another prefix, or without its partner, fails the test
at the step that would have used it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_vllm_connector import BLOCK, PROMPT, SECRET, prompt_request

NUM_BLOCKS = 64
STATE_SIZES = (4, 8)  # each Mamba layer: a conv-like and an ssm-like state tensor
MOD = 65521


@pytest.fixture(autouse=True)
def _tier_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRS_TIER_KEY", SECRET)


def kv_value(tok: int, pos: int, layer: int) -> float:
    return float(tok * 1000 + pos * 10 + layer)


def state_after(tokens: list[int], layer: int, tensor: int) -> np.ndarray:
    """The recurrent state of `layer`'s `tensor` after `tokens`, from scratch."""
    s = np.zeros(STATE_SIZES[tensor], dtype=np.int64)
    k = np.arange(1, STATE_SIZES[tensor] + 1)
    for pos, tok in enumerate(tokens):
        s = (s * 31 + tok * k + pos + layer * 7 + tensor) % MOD
    return s


class HybridEngine:
    """vLLM's scheduler with KvrsConnector over a hybrid KV cache, stepped like vLLM's
    engine; `errors` lists every step that read K/V or state other than its prefix's."""

    def __init__(self, path: Path, extra: dict[str, Any] | None = None) -> None:
        import torch
        from tests.v1.kv_connector.unit.utils import create_scheduler, create_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

        self.cfg = create_vllm_config(
            kv_connector="KvrsConnector",
            kv_connector_module_path="kvrs.integrations.vllm",
            kv_role="kv_both",
            block_size=BLOCK,
            kv_load_failure_policy="recompute",
            disable_hybrid_kv_cache_manager=False,
            kv_connector_extra_config={
                "tiers": [{"type": "disk", "path": str(path), "max_bytes": "64MiB"}],
                **(extra or {}),
            },
        )
        self.cfg.cache_config.mamba_cache_mode = "align"
        self.cfg.cache_config.enable_prefix_caching = True
        attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=4, dtype=torch.float32)
        mamba = MambaSpec(
            block_size=BLOCK,
            shapes=tuple((n,) for n in STATE_SIZES),
            dtypes=(torch.float32,) * len(STATE_SIZES),
            mamba_cache_mode="align",
        )
        self.kv_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["layer.0", "layer.1"], attn),
                KVCacheGroupSpec(["mamba.0", "mamba.1"], mamba),
            ],
        )
        self.sched = create_scheduler(
            self.cfg, num_blocks=NUM_BLOCKS, kv_cache_config=self.kv_config, hash_block_size=BLOCK
        )
        self.worker = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kv_config)
        self.kv = {n: torch.zeros((2, NUM_BLOCKS, BLOCK, 2, 4)) for n in ("layer.0", "layer.1")}
        self.states = {n: [torch.zeros((NUM_BLOCKS, s)) for s in STATE_SIZES] for n in ("mamba.0", "mamba.1")}
        self.worker.register_kv_caches({**self.kv, **self.states})
        self.errors: list[str] = []
        self.failed: set[str] = set()
        self.loaded: set[str] = set()

    def forward(self, out: Any) -> None:
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n in out.num_scheduled_tokens.items():
            self._compute(req_id, starts[req_id], starts[req_id] + n)

    def _compute(self, req_id: str, start: int, end: int) -> None:
        import torch

        req = self.sched.requests[req_id]
        tokens = list(req.all_token_ids)
        attn_ids, mamba_ids = self.sched.kv_cache_manager.get_block_ids(req_id)
        # What the model reads: every earlier position's K/V and the state after `start`.
        for pos in range(start):
            for li, t in enumerate(self.kv.values()):
                got = float(t[0, attn_ids[pos // BLOCK], pos % BLOCK, 0, 0])
                if got != kv_value(tokens[pos], pos, li):
                    self.errors.append(f"{req_id}: K/V of position {pos} read at {start}")
                    break
        src = mamba_ids[-(-start // BLOCK) - 1] if start else None
        dst = mamba_ids[-(-end // BLOCK) - 1]
        for li, tensors in enumerate(self.states.values()):
            for ti, t in enumerate(tensors):
                s = np.zeros(STATE_SIZES[ti], dtype=np.int64)
                if src is not None:
                    s = t[src].numpy().astype(np.int64)
                if src is not None and not np.array_equal(s, state_after(tokens[:start], li, ti)):
                    self.errors.append(f"{req_id}: state read at {start} (block {src})")
                k = np.arange(1, STATE_SIZES[ti] + 1)
                for pos in range(start, end):
                    s = (s * 31 + tokens[pos] * k + pos + li * 7 + ti) % MOD
                t[dst] = torch.from_numpy(s.astype(np.float32))
        for pos in range(start, end):
            for li, t in enumerate(self.kv.values()):
                t[:, attn_ids[pos // BLOCK], pos % BLOCK] = kv_value(tokens[pos], pos, li)

    def step(self) -> Any:
        from tests.v1.kv_connector.unit.utils import create_model_runner_output
        from vllm.v1.outputs import KVConnectorOutput

        out = self.sched.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        self.forward(out)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(set())
        assert not self.worker.get_block_ids_with_load_errors(), "hybrid failures are per request"
        self.worker.clear_connector_metadata()
        self.loaded |= results.finished_recving
        self.failed |= results.failed_recving
        running = [self.sched.requests[r] for r in out.num_scheduled_tokens]
        mro = create_model_runner_output(reqs=running)
        if results.finished_recving:
            mro.kv_connector_output = KVConnectorOutput(
                finished_recving=results.finished_recving, failed_recving=results.failed_recving
            )
        self.sched.update_from_output(out, mro)
        return out

    def run(self, request: Any, max_steps: int = 60) -> list[Any]:
        """Steps until `request` finishes; every step's scheduler output."""
        self.sched.add_request(request)
        outs = []
        for _ in range(max_steps):
            outs.append(self.step())
            if request.request_id not in self.sched.requests:
                assert not self.errors, self.errors
                return outs
        raise AssertionError("the request never finished")


def first_computed(outs: list[Any], req_id: str) -> int:
    """Tokens the request had computed (loaded) when first scheduled for a forward."""
    for out in outs:
        for new in out.scheduled_new_reqs:
            if new.req_id == req_id:
                return int(new.num_computed_tokens)
    raise AssertionError(f"{req_id} was never scheduled")


def state_files(path: Path, boundary: int) -> list[Path]:
    """The tier files that hold the state of PROMPT after `boundary` tokens."""
    marker = state_after(PROMPT[:boundary], 0, 0).astype(np.float32).tobytes()
    files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return [p for p in files if marker in p.read_bytes()]


def test_a_restarted_hybrid_engine_loads_k_v_and_state_together(vllm_tests: Path, tmp_path: Path) -> None:
    first = HybridEngine(tmp_path)
    first.run(prompt_request("a", PROMPT))
    # vLLM splits the prefill at 64 (the token budget) and 80 (aligned): states there.
    assert len(state_files(tmp_path, 64)) == 1 and len(state_files(tmp_path, 80)) == 1

    second = HybridEngine(tmp_path)
    outs = second.run(prompt_request("b", PROMPT))
    assert second.loaded == {"b"} and not second.failed
    assert first_computed(outs, "b") == 5 * BLOCK, "kvrs should supply 5 blocks and the state after them"


def test_k_v_without_its_state_is_never_a_hit(vllm_tests: Path, tmp_path: Path) -> None:
    HybridEngine(tmp_path).run(prompt_request("a", PROMPT))
    for b in (64, 80):
        for p in state_files(tmp_path, b):
            p.unlink()
    second = HybridEngine(tmp_path)
    outs = second.run(prompt_request("b", PROMPT))
    assert first_computed(outs, "b") == 0 and not second.loaded


def test_the_longest_prefix_with_a_state_is_the_hit(vllm_tests: Path, tmp_path: Path) -> None:
    HybridEngine(tmp_path).run(prompt_request("a", PROMPT))
    for p in state_files(tmp_path, 80):
        p.unlink()
    second = HybridEngine(tmp_path)
    outs = second.run(prompt_request("b", PROMPT))
    assert second.loaded == {"b"} and first_computed(outs, "b") == 4 * BLOCK


@pytest.mark.parametrize(("damage", "retried"), [("state", 4 * BLOCK), ("k/v", 0)])
def test_a_damaged_page_fails_the_whole_load_and_the_retry_takes_what_verifies(
    vllm_tests: Path, tmp_path: Path, damage: str, retried: int
) -> None:
    HybridEngine(tmp_path).run(prompt_request("a", PROMPT))
    if damage == "state":
        (victim,) = state_files(tmp_path, 80)
        at = victim.read_bytes().index(state_after(PROMPT[:80], 0, 0).astype(np.float32).tobytes())
    else:
        marker = np.full(8, kv_value(PROMPT[40], 40, 1), np.float32).tobytes()
        (victim,) = [p for p in tmp_path.rglob("*") if p.is_file() and marker in p.read_bytes()]
        at = victim.read_bytes().index(marker)
    blob = bytearray(victim.read_bytes())
    blob[at + 1] ^= 1
    victim.write_bytes(bytes(blob))

    second = HybridEngine(tmp_path)
    outs = second.run(prompt_request("b", PROMPT))
    # Nothing of the failed load was written; the damaged page was discarded, so vLLM's
    # retry matched only what is whole: the state at 64 and its 4 blocks (state damaged), or
    # nothing (block 2's K/V damaged: no state before it). Every step read the right K/V
    # and state (run() asserts it).
    assert second.failed == {"b"}
    assert first_computed(outs, "b") == retried
    assert second.worker.state_store.stats()["rejected"] + second.worker.kvrs_stats()["rejected"] == 1


def test_another_tenant_matches_nothing(vllm_tests: Path, tmp_path: Path) -> None:
    HybridEngine(tmp_path).run(prompt_request("a", PROMPT))
    second = HybridEngine(tmp_path, extra={"namespace": "tenant-b"})
    outs = second.run(prompt_request("b", PROMPT))
    assert first_computed(outs, "b") == 0 and not second.loaded


def test_a_load_that_cannot_be_placed_fails_at_once_and_is_not_retried_forever(
    vllm_tests: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If vLLM's blocks cannot take the matched prefix (here: no state block found), the
    load is reported failed in the same step (vLLM waits for it otherwise) and a request
    is issued at most MAX_LOADS loads: then it computes its prompt itself."""
    from kvrs.integrations.vllm_blocks import BlockLayout
    from kvrs.integrations.vllm_connector import MAX_LOADS

    HybridEngine(tmp_path).run(prompt_request("a", PROMPT))
    monkeypatch.setattr(BlockLayout, "state_blocks", lambda self, boundary, block_ids: None)
    second = HybridEngine(tmp_path)
    outs = second.run(prompt_request("b", PROMPT))
    assert second.failed == {"b"} and first_computed(outs, "b") == 0
    assert second.sched.connector._requests == {}
    assert MAX_LOADS == 2
