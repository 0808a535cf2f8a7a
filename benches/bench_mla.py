"""MLA (DeepSeek-V3) decode attention over a latent cache, in one process: kvrs's absorbed
attention read in place from a paged latent pool (``Sequence.attention(..., latent=True)``)
against torch doing the same absorbed attention on contiguous tensors, and a NumPy copy of
the latent's bytes (the bandwidth floor). Then the memory per token of the latent cache
against decompressed K/V.

    python benches/bench_mla.py            # the README's table
    python benches/bench_mla.py --quick    # 4k tokens, seconds

8k and 32k tokens, bfloat16 and float16; kvrs, torch and the copy timed in interleaved
rounds (best of each; on a CPU with AVX-512, kvrs on its AVX2 kernel too, the last
column), with both GFLOP/s (scores and output, 2 flops a multiply-add).

DeepSeek-V3 sizes: 128 query heads, kv_lora_rank 512, qk_rope_head_dim 64 (one shared
latent head of 512 + 64 values per token and layer), qk_nope_head_dim 128, v_head_dim 128,
61 layers. The query is already absorbed (``q_nope W_UK``: 512 values) and the output is
the latent (512 values), as FlashInfer's and vLLM's MLA decode kernels take and give them.
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np
import torch

import kvrs

HEADS, RANK, ROPE, NOPE, V_DIM, LAYERS = 128, 512, 64, 128, 128, 61
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}
NUMPY = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def best(f, repeat: int) -> float:
    """Best wall time of `repeat` calls (after one warm-up)."""
    f()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def as_torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def decode(dtype: str, n: int, repeat: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    pool = kvrs.BlockPool(
        1, 1, RANK, v_head_dim=ROPE, block_size=64, num_blocks=n // 64 + 1, dtype=dtype, prefix_caching=False
    )
    seq = pool.new_sequence()
    for i in range(0, n, 4096):
        m = min(4096, n - i)
        seq.append(
            0,
            rng.standard_normal((m, 1, RANK), dtype=np.float32),
            rng.standard_normal((m, 1, ROPE), dtype=np.float32),
        )
    seq.advance(n)
    scale = (NOPE + ROPE) ** -0.5
    q = (rng.standard_normal((1, HEADS, RANK + ROPE), dtype=np.float32) * 0.05).astype(NUMPY[dtype])
    ckv, kpe = (as_torch(x)[0] for x in seq.get(0))  # contiguous [n, 512], [n, 64]
    tq = as_torch(q)[0]  # [heads, 576]
    q_nope, q_pe = tq[:, :RANK], tq[:, RANK:]

    def torch_absorbed() -> torch.Tensor:
        scores = (q_nope @ ckv.T + q_pe @ kpe.T).float() * scale  # [heads, n]
        return (torch.softmax(scores, dim=-1).to(ckv.dtype) @ ckv).float()

    ours = np.asarray(seq.attention(0, q, latent=True, scale=scale), np.float32)[0]
    err = float((torch.from_numpy(ours) - torch_absorbed()).abs().max())
    latent_bytes = n * (RANK + ROPE) * np.dtype(NUMPY[dtype]).itemsize
    src = np.concatenate([np.asarray(x).reshape(n, -1) for x in seq.get(0)], axis=1)
    dst = np.empty_like(src)
    # Interleaved rounds (kvrs, torch, the copy, and on an AVX-512 CPU kvrs again on the
    # AVX2 kernel), the best of each: the VM's drift falls on all of them alike.
    wide = kvrs.attention_simd().startswith("avx512")
    kvrs_call = lambda: seq.attention(0, q, latent=True, scale=scale)  # noqa: E731
    calls = (kvrs_call, torch_absorbed, lambda: np.copyto(dst, src), kvrs_call)[: 4 if wide else 3]
    times = [float("inf")] * 4
    for _ in range(repeat + 1):
        for i, call in enumerate(calls):
            if wide:
                kvrs._kvrs._set_attention_simd("avx2" if i == 3 else None)
            t0 = time.perf_counter()
            call()
            times[i] = min(times[i], time.perf_counter() - t0)
    if wide:
        kvrs._kvrs._set_attention_simd(None)
    t_ours, t_torch, t_copy, t_avx2 = times
    # Scores [heads x 576] . [576 x n] and output [heads x n] . [n x 512]: 2 flops a term.
    flops = 2 * HEADS * n * (RANK + ROPE + RANK)
    return {
        "kvrs_gflops": flops / t_ours / 1e9,
        "torch_gflops": flops / t_torch / 1e9,
        "kvrs_ms": t_ours * 1e3,
        "torch_ms": t_torch * 1e3,
        "avx2_ms": t_avx2 * 1e3,
        "speedup": t_torch / t_ours,
        "kvrs_gbs": latent_bytes / t_ours / 1e9,
        "copy_gbs": latent_bytes / t_copy / 1e9,
        "max_abs_err": err,
    }


def memory_rows() -> list[tuple[str, int]]:
    """Bytes per token (all 61 layers, bfloat16) of what each cache holds."""
    latent = kvrs.BlockPool(LAYERS, 1, RANK, v_head_dim=ROPE, block_size=64, num_blocks=1, dtype="bfloat16")
    per_latent = latent.stats()["bytes_total"] // 64
    full = kvrs.BlockPool(
        LAYERS, HEADS, NOPE + ROPE, v_head_dim=V_DIM, block_size=64, num_blocks=1, dtype="bfloat16"
    )
    per_full = full.stats()["bytes_total"] // 64
    return [("latent (kv_lora_rank + qk_rope_head_dim)", per_latent), ("decompressed K and V", per_full)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4k tokens instead of 32k")
    args = parser.parse_args()
    sizes, repeat = ((4096,), 3) if args.quick else ((8192, 32768), 5)
    print(f"MLA decode, 1 sequence, {HEADS} query heads, latent {RANK} + {ROPE}")
    print(f"SIMD: {kvrs.attention_simd()}, torch threads: {torch.get_num_threads()}")
    print(
        "| tokens | storage | kvrs (ms) | torch absorbed (ms) | kvrs vs torch | kvrs GFLOP/s "
        "| torch GFLOP/s | kvrs GB/s | NumPy copy GB/s | max abs err | kvrs AVX2 (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        for dtype in ("bfloat16", "float16"):
            r = decode(dtype, n, repeat)
            print(
                f"| {n:,} | {dtype} | {r['kvrs_ms']:.2f} | {r['torch_ms']:.2f} | {r['speedup']:.1f}x | "
                f"{r['kvrs_gflops']:.1f} | {r['torch_gflops']:.1f} | "
                f"{r['kvrs_gbs']:.2f} | {r['copy_gbs']:.2f} | {r['max_abs_err']:.1e} | {r['avx2_ms']:.2f} |"
            )
    print()
    print("| DeepSeek-V3 cache (61 layers, bfloat16) | bytes per token |")
    print("|---|---|")
    for name, b in memory_rows():
        print(f"| {name} | {b:,} |")


if __name__ == "__main__":
    main()
