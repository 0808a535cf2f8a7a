"""The demo runs, and its self-check fails when cached attention is wrong."""

from __future__ import annotations

import pytest

import kvrs.demo
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
            keys, values = kv_for_layer(layer, k, v)
            if len(tokens) == 1:  # decode steps lose their oldest position
                keys, values = keys.copy(), values.copy()
                keys[:, 0] = 0
                values[:, 0] = 0
            return keys, values

        return real_forward(self, tokens, positions, drop_oldest)

    monkeypatch.setattr(kvrs.demo.TinyLlama, "forward", forgetful)
    monkeypatch.setattr(kvrs.demo, "recompute", lambda *a: real_recompute(*a))
    assert kvrs.demo.run(16, 8, "float32", 0) == 1
    assert "FAILED" in capsys.readouterr().out


def real_recompute(model, tokens, prompt_len, np_dtype):
    """The reference with the model's original forward (not the patched one)."""
    import numpy as np

    def no_cache(layer, k, v):
        return k.astype(np_dtype).transpose(1, 0, 2), v.astype(np_dtype).transpose(1, 0, 2)

    seq = np.array(tokens)
    return ORIGINAL_FORWARD(model, seq, np.arange(len(seq)), no_cache)[prompt_len - 1 :]


ORIGINAL_FORWARD = kvrs.demo.TinyLlama.forward
