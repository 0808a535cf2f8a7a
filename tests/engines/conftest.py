"""Set-up shared by the engine adapter tests: the engines run on the CPU and offline, and
vLLM's test utilities (from its source package, see sources.py) find the model config they
name, generated here rather than downloaded."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from sources import HF_HOME, engine_tests, write_opt_config

# vLLM's CPU platform (its own CPU-only CI reuses the accelerator wheel the same way), and
# nothing fetched from the Hub: read before the engines are imported.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(HF_HOME)


@pytest.fixture(scope="session")
def vllm_tests() -> Path:
    """vLLM's own ``tests`` package importable (``tests.v1.kv_connector.unit.utils``)."""
    pytest.importorskip("vllm")
    root = engine_tests("vllm")
    write_opt_config()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return root


@pytest.fixture(scope="session")
def lmcache_tests() -> Path:
    """LMCache's own ``tests`` package importable (``tests.v1.storage_backend...``)."""
    pytest.importorskip("lmcache")
    root = engine_tests("lmcache")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return root
