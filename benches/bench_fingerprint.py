"""What model_fingerprint costs beside loading a model: SmolLM2-135M-Instruct (kvrs.real_model)
and a 1.5B-parameter Llama config in bfloat16 (random weights saved as safetensors to a
temporary directory and loaded back with from_pretrained). "Loading" includes the first read
of every weight (from_pretrained maps the file lazily; the first forward pays the reads).
Run: `python benches/bench_fingerprint.py`.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvrs import real_model
from kvrs.integrations.fingerprint import model_fingerprint


def loaded(load: Any) -> tuple[Any, float]:
    """`load()`'s model and the seconds it took, its weights read once."""
    start = time.perf_counter()
    model = load()
    for p in model.parameters():
        p.float().sum()
    return model, time.perf_counter() - start


def report(name: str, model: Any, load_s: float) -> None:
    start = time.perf_counter()
    model_fingerprint(model)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model_fingerprint(model)
    again = time.perf_counter() - start
    print(
        f"| {name} | {load_s:.2f} s | {first * 1e3:.1f} ms ({first / load_s:.2%} of loading) | "
        f"{again * 1e3:.2f} ms |"
    )


def main() -> None:
    print("| model | loading (with the first read of every weight) | fingerprint | again (cached) |")
    print("|---|---|---|---|")
    real_model.load()  # the first call converts the GGUF file: not what is timed
    model, seconds = loaded(lambda: real_model.load()[0])
    report("SmolLM2-135M-Instruct, float32", model, seconds)
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    with torch.device("meta"):
        big = LlamaForCausalLM(config)
    big = big.to_empty(device="cpu").to(torch.bfloat16)
    for p in big.parameters():
        torch.nn.init.normal_(p, std=0.02)
    n = sum(p.numel() for p in big.parameters())
    path = tempfile.mkdtemp()
    try:
        big.save_pretrained(path)
        del big
        model, seconds = loaded(lambda: LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
        report(f"Llama {n / 1e9:.1f}B, bfloat16 (safetensors)", model, seconds)
    finally:
        shutil.rmtree(path)


if __name__ == "__main__":
    main()
