"""Set-up shared by the engine adapter tests: the engines run on the CPU and offline, and
vLLM's test utilities (from its source package, see sources.py) find the model config they
name, generated here rather than downloaded."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sources import CACHE, engine_tests

# vLLM's CPU platform (its own CPU-only CI reuses the accelerator wheel the same way), and
# nothing fetched from the Hub: read before the engines are imported.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
HF_HOME = CACHE / "hf"
os.environ["HF_HOME"] = str(HF_HOME)

#: The Hub id vLLM's test utilities build their ModelConfig from.
OPT_MODEL = "facebook/opt-125m"


def _write_opt_config() -> None:
    """facebook/opt-125m's config.json in a Hub cache layout (no weights: none are read)."""
    snap = "0" * 40
    repo = HF_HOME / "hub" / ("models--" + OPT_MODEL.replace("/", "--"))
    target = repo / "snapshots" / snap / "config.json"
    if target.exists():
        return
    from transformers import OPTConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(snap)
    OPTConfig(
        vocab_size=50272,
        hidden_size=768,
        num_hidden_layers=12,
        ffn_dim=3072,
        num_attention_heads=12,
        max_position_embeddings=2048,
        word_embed_proj_dim=768,
        dtype="float16",
    ).to_json_file(str(target))


@pytest.fixture(scope="session")
def vllm_tests() -> Path:
    """vLLM's own ``tests`` package importable (``tests.v1.kv_connector.unit.utils``)."""
    pytest.importorskip("vllm")
    root = engine_tests("vllm")
    _write_opt_config()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return root
