"""The demo runs, and its self-check fails when cached attention is wrong."""

from __future__ import annotations

import pytest

import kvrs.demo
import kvrs.serving
from kvrs.__main__ import main


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_demo_passes(dtype, capsys):
    assert main(["demo", "--prompt-len", "24", "--new-tokens", "24", "--dtype", dtype]) == 0
    out = capsys.readouterr().out
    assert "tokens identical" in out and out.rstrip().endswith("OK")


def test_demo_detects_a_cache_that_loses_history(monkeypatch, capsys):
    real_forward = kvrs.demo.TinyLlama.forward

    def forgetful(self, tokens, positions, kv_for_layer):
        def drop_oldest(layer, k, v):
            keys, values, mask = kv_for_layer(layer, k, v)
            if len(tokens) == 1:  # decode steps lose their oldest position
                keys, values = keys.copy(), values.copy()
                keys[:, 0] = 0
                values[:, 0] = 0
            return keys, values, mask

        return real_forward(self, tokens, positions, drop_oldest)

    monkeypatch.setattr(kvrs.demo.TinyLlama, "forward", forgetful)
    monkeypatch.setattr(kvrs.demo, "recompute", lambda *a: real_recompute(*a))
    assert kvrs.demo.run(16, 8, "float32", 0) == 1
    assert "FAILED" in capsys.readouterr().out


def real_recompute(model, tokens, prompt_len, np_dtype):
    """The reference with the model's original forward (not the patched one)."""
    import numpy as np

    positions = np.arange(len(tokens))

    def no_cache(layer, k, v):
        mask = kvrs.demo.causal_mask(positions, len(tokens))
        return k.astype(np_dtype).transpose(1, 0, 2), v.astype(np_dtype).transpose(1, 0, 2), mask

    return ORIGINAL_FORWARD(model, np.array(tokens), positions, no_cache)[prompt_len - 1 :]


ORIGINAL_FORWARD = kvrs.demo.TinyLlama.forward


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_serving_workload_passes(dtype, capsys):
    assert kvrs.serving.run(4, 32, 6, dtype, 1) == 0
    out = capsys.readouterr().out
    assert "tokens identical" in out and "prefix hit rate" in out and out.rstrip().endswith("OK")


class SabotagedBatch:
    """A ForwardBatch whose history loses its first position."""

    def __init__(self, batch):
        self.batch = batch

    def __getattr__(self, name):
        return getattr(self.batch, name)

    def __enter__(self):
        self.batch.__enter__()
        return self

    def __exit__(self, *exc):
        return self.batch.__exit__(*exc)

    def put(self, layer, k, v):
        self.batch.put(layer, k, v)

    def get(self, layer):
        keys, values, mask = self.batch.get(layer)
        keys = keys.copy()
        keys[:, 0] = 0
        return keys, values, mask


class SabotagedPool:
    def __init__(self, pool):
        self.pool = pool

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def start_forward(self, *args, **kwargs):
        return SabotagedBatch(self.pool.start_forward(*args, **kwargs))


def test_serving_check_detects_a_broken_history(monkeypatch, capsys):
    real_serve = kvrs.serving.serve
    monkeypatch.setattr(
        kvrs.serving, "serve", lambda model, pool, reqs: real_serve(model, SabotagedPool(pool), reqs)
    )
    assert kvrs.serving.run(3, 32, 4, "float32", 0) == 1
    assert "FAILED" in capsys.readouterr().out
