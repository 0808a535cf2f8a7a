"""8-bit K/V: capacity, decode attention and the demo workload against float16 storage,
and the accuracy of each dtype, in one process.

    python benches/bench_quantized.py            # the README's tables
    python benches/bench_quantized.py --quick    # smaller sizes, seconds

- capacity: tokens a 1 GiB pool holds (Llama-3-8B's shape: 32 layers, 8 KV heads x 128,
  blocks of 16), scales included;
- decode attention over one sequence of 32k tokens (32 query / 8 KV heads x 128): kvrs
  reading each storage dtype in place, against float16 storage, torch SDPA on
  contiguous float16 K/V, and a NumPy copy of the bytes each dtype stores; once more
  with K/V of magnitude 0.005, where most E4M3 codes are subnormal;
- prefill writes: 4k float16 tokens appended, quantized on the way in, against float16
  storage and a NumPy copy of the input;
- the demo workload (24 chat requests sharing a 1024-token system prompt): a float16
  pool of a given size against 8-bit pools of the same bytes and of half the bytes;
- accuracy: the relative L2 error of decode logits against DynamicCache (float32) on the
  demo's model and a tiny random Llama, and the demo's greedy agreement;
- calibration: fp8 with scales from ``calibrate_kv_scales`` against scale 1.0, on the same
  models and on the tiny Llama made loud (layer 1's K/V past E4M3's 448), with the
  elements each saturates, and how flat each model's logits are (the gap between the two
  largest, which a greedy pick needs the error to stay under).

    python benches/bench_quantized.py --only calibration   # that part alone
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from bench_attention import best

import kvrs
from kvrs import demo

DTYPES = ("float16", "fp8_e4m3", "fp8_e5m2", "int8")


def capacity() -> None:
    print("capacity of a 1 GiB pool (32 layers, 8 KV heads x 128, blocks of 16)")
    print(f"{'storage':<9} {'bytes/token':>12} {'tokens':>9} {'vs float16':>11}")
    base = 0
    for dtype in DTYPES:
        pool = kvrs.BlockPool(
            32, 8, 128, block_size=16, memory_bytes="1GiB", dtype=dtype, prefix_caching=False
        )
        tokens = pool.num_blocks * pool.block_size
        base = base or tokens
        print(f"{dtype:<9} {pool.bytes_per_block // 16:>12,} {tokens:>9,} {tokens / base:>10.2f}x")


def decode(n: int, repeat: int, magnitude: float = 1.0) -> None:
    hkv, hq, d = 8, 32, 128
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, n, hkv, d), dtype=np.float32) * np.float32(magnitude)
    q = rng.standard_normal((1, hq, d), dtype=np.float32)
    seqs, outs, stored = {}, {}, {}
    for dtype in DTYPES:
        pool = kvrs.BlockPool(
            1, hkv, d, block_size=16, num_blocks=n // 16 + 1, dtype=dtype, prefix_caching=False
        )
        seq = pool.new_sequence()
        for i in range(0, n, 4096):
            seq.append(0, k[i : i + 4096], v[i : i + 4096])
        seq.advance(n)
        seqs[dtype] = seq
        outs[dtype] = seq.attention(0, q)
        stored[dtype] = seq.memory_bytes()
    # Rounds that time every dtype once each, so that the machine's drift (a shared VM)
    # falls on all of them alike; the best of the rounds is kept.
    times = dict.fromkeys(DTYPES, float("inf"))
    for _ in range(3 * repeat):
        for dtype in DTYPES:
            t0 = time.perf_counter()
            seqs[dtype].attention(0, q)
            times[dtype] = min(times[dtype], time.perf_counter() - t0)
    tk = torch.from_numpy(k.astype(np.float16)).transpose(0, 1)[None]
    tv = torch.from_numpy(v.astype(np.float16)).transpose(0, 1)[None]
    tq = torch.from_numpy(q.astype(np.float16)).transpose(0, 1)[None]
    sdpa = best(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True), repeat)
    print(f"\ndecode attention, one sequence of {n:,} tokens, 32 query / 8 KV heads x 128, "
          f"K/V of magnitude {magnitude} (kvrs SIMD: {kvrs.attention_simd()}, "
          f"{torch.get_num_threads()} torch threads)")  # fmt: skip
    print(f"{'storage':<9} {'kvrs':>9} {'vs float16':>11} {'SDPA f16':>9} {'vs SDPA':>8} "
          f"{'K/V MiB':>8} {'copy':>8} {'max |out - f16 out|':>20}")  # fmt: skip
    for dtype in DTYPES:
        src = np.ones(stored[dtype], np.uint8)
        dst = np.empty_like(src)
        copy = best(lambda src=src, dst=dst: np.copyto(dst, src), repeat)
        diff = np.abs(outs[dtype] - outs["float16"]).max()
        print(
            f"{dtype:<9} {times[dtype] * 1e3:>7.2f}ms {times['float16'] / times[dtype]:>10.2f}x "
            f"{sdpa * 1e3:>7.2f}ms {sdpa / times[dtype]:>7.2f}x {stored[dtype] / 2**20:>8.1f} "
            f"{copy * 1e3:>6.2f}ms {diff:>20.4f}"
        )


def writes(n: int, repeat: int) -> None:
    """Prefill writes: `n` float16 tokens appended to one layer (quantized on the way in)."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((n, 8, 128), dtype=np.float32).astype(np.float16)
    src = np.ones(2 * k.nbytes, np.uint8)
    dst = np.empty_like(src)
    copy = best(lambda: np.copyto(dst, src), repeat)
    print(f"\nprefill write: {n:,} float16 tokens (8 KV heads x 128), K and V, into one layer "
          f"(NumPy copy of the input bytes: {copy * 1e3:.2f} ms)")  # fmt: skip
    print(f"{'storage':<9} {'append':>9} {'vs float16':>11} {'input GB/s':>11}")
    appends = {}
    for dtype in DTYPES:
        pool = kvrs.BlockPool(
            1, 8, 128, block_size=16, num_blocks=n // 16 + 1, dtype=dtype, prefix_caching=False
        )

        def append(pool=pool):
            seq = pool.new_sequence()
            seq.append(0, k, k)
            seq.free()

        append()  # warm-up
        appends[dtype] = append
    # Rounds that time every dtype once each (as `decode` does), so that the machine's
    # drift falls on all of them alike; the best of the rounds is kept.
    times = dict.fromkeys(DTYPES, float("inf"))
    for _ in range(repeat):
        for dtype in DTYPES:
            t0 = time.perf_counter()
            appends[dtype]()
            times[dtype] = min(times[dtype], time.perf_counter() - t0)
    base = times["float16"]
    for dtype in DTYPES:
        t = times[dtype]
        print(f"{dtype:<9} {t * 1e3:>7.2f}ms {base / t:>10.2f}x {2 * k.nbytes / t / 1e9:>11.2f}")


def workload(quick: bool) -> None:
    layers, blocks = (4, 64) if quick else (8, 128)
    n, system_len, new = (8, 256, 16) if quick else (24, 1024, 64)
    model = demo.make_model(0, layers)
    requests = demo.make_requests(n, system_len, new, model.config.vocab_size, 0)
    expected, _ = demo.serve_with_dynamic_cache(model, requests)
    f16_bytes = kvrs.BlockPool(layers, 2, 32, num_blocks=1, dtype="float16").bytes_per_block * blocks
    print(f"\nthe demo workload: {n} requests, {system_len}-token system prompt, {layers} layers; "
          f"float16 pool of {blocks} blocks ({f16_bytes / 2**20:.2f} MiB)")  # fmt: skip
    print(f"{'storage':<9} {'pool MiB':>9} {'blocks':>7} {'admitted on arrival':>20} {'waited':>7} "
          f"{'mean wait':>10} {'tokens/s':>9} {'same tokens':>12}")  # fmt: skip
    cases = [("float16", 1.0)] + [(d, f) for d in DTYPES[1:] for f in (1.0, 0.5)]
    for dtype, fraction in cases:
        pool = kvrs.BlockPool(
            layers, 2, 32, block_size=16, memory_bytes=int(f16_bytes * fraction), dtype=dtype
        )
        for r in requests:
            r.tokens, r.admitted, r.finished, r.cached = [], -1, -1, 0
        trace = demo.serve(model, pool, requests, _Quiet())
        waits = [r.admitted - r.arrival for r in requests]
        same, total = demo.agreement([r.generated for r in requests], expected)
        generated = sum(len(r.generated) for r in requests)
        print(
            f"{dtype:<9} {pool.num_blocks * pool.bytes_per_block / 2**20:>9.2f} {pool.num_blocks:>7} "
            f"{sum(w == 0 for w in waits):>20} {sum(w > 0 for w in waits):>7} {np.mean(waits):>8.1f} st "
            f"{generated / trace.seconds:>9,.0f} {same / total:>11.1%}"
        )


class _Quiet:
    """A progress bar that shows nothing."""

    def update(self, _n: int) -> None:
        pass

    def set_postfix(self, **_kw: object) -> None:
        pass


def accuracy(quick: bool) -> None:
    demo_model = demo.make_model(0, 8)
    tiny = demo.make_tiny_model(0)
    g = torch.Generator().manual_seed(1)
    prompts = {
        "demo model (8 layers, demo prompt)": (demo_model, demo.make_requests(1, 1024, 8, 2048, 0)[0].prompt),
        "tiny Llama (2 layers, 200 random tokens)": (
            tiny,
            torch.randint(3, 128, (200,), generator=g).tolist(),
        ),
    }
    steps = 8 if quick else 32
    print(f"\naccuracy: relative L2 error of {steps} decode steps' logits against DynamicCache (float32), "
          "and the steps whose argmax agrees")  # fmt: skip
    unit = {"float16": 2**-11, "bfloat16": 2**-8, "int8": 1 / 254, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}
    for name, (model, prompt) in prompts.items():
        print(name)
        for dtype, u in unit.items():
            err, agree = demo.logits_error(model, dtype, prompt, steps)
            print(
                f"  {dtype:<9} error {err:.2e} ({err / u:.2f} x its unit roundoff {u:.2e}), "
                f"argmax agrees {agree:.0%}"
            )


def logit_gaps(model: torch.nn.Module, prompt: list[int], steps: int) -> np.ndarray:
    """At each greedy decode step (DynamicCache, float32): the gap between the two largest
    logits, relative to the logits' L2 norm (the error a greedy pick survives is about
    half of it)."""
    from transformers import DynamicCache

    cache, ids, gaps = DynamicCache(config=model.config), torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(steps + 1):
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
            top = logits.topk(2).values
            gaps.append(float((top[0] - top[1]) / logits.norm()))
            ids = logits.argmax().reshape(1, 1)
    return np.array(gaps)


def saturated(model: torch.nn.Module, prompt: list[int], **cache_kwargs: object) -> int:
    """Elements an fp8 KvrsPagedCache clamps while `prompt` runs through `model`."""
    from kvrs.integrations.transformers import KvrsPagedCache

    cache = KvrsPagedCache.from_config(model.config, max_seq_len=len(prompt), **cache_kwargs)
    with torch.no_grad():
        model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    return sum(cache.pool.stats()["fp8_saturated"])


def calibration(quick: bool) -> None:
    from kvrs.integrations.transformers import calibrate_kv_scales

    g = torch.Generator().manual_seed(1)
    tiny_prompt = torch.randint(3, 128, (200,), generator=g).tolist()
    demo_prompt = demo.make_requests(1, 256 if quick else 1024, 8, 2048, 0)[0].prompt
    models = {
        "demo model (8 layers, demo prompt)": (demo.make_model(0, 8), demo_prompt),
        "tiny Llama (2 layers, 200 random tokens)": (demo.make_tiny_model(0), tiny_prompt),
        "tiny Llama, layer 1's K/V x2000": (demo.make_loud_model(0), tiny_prompt),
    }
    steps = 8 if quick else 32
    print(f"\ncalibration: fp8 scales from calibrate_kv_scales (the prompt itself, per KV head, "
          f"margin 1) against 1.0; relative L2 error of {steps} decode steps' logits, "
          "elements saturated while the prompt is stored")  # fmt: skip
    for name, (model, prompt) in models.items():
        gaps = logit_gaps(model, prompt, steps)
        print(f"{name}: gap between the two largest logits / |logits|: median {np.median(gaps):.2e}, "
              f"smallest {gaps.min():.2e}")  # fmt: skip
        vocab = model.config.vocab_size
        for dtype in ("fp8_e4m3", "fp8_e5m2"):
            exact = calibrate_kv_scales(model, [prompt], dtype=dtype)
            wide = calibrate_kv_scales(model, [prompt], dtype=dtype, margin=1.1)
            amax = max(max(map(max, exact.k_amax)), max(map(max, exact.v_amax)))
            for label, kw in (
                ("scale 1.0", {}),
                ("calibrated", {"k_scale": exact.k_scale, "v_scale": exact.v_scale}),
                ("margin 1.1", {"k_scale": wide.k_scale, "v_scale": wide.v_scale}),
            ):
                err, agree = demo.logits_error(model, dtype, prompt, steps, **kw)
                sat = saturated(model, prompt, dtype=dtype, **kw)
                print(
                    f"  {dtype:<9} {label:<10} error {err:.2e} (about {err / vocab**0.5:.1e} of "
                    f"|logits| per logit), argmax agrees {agree:.0%}, {sat:,} saturated "
                    f"(K/V amax {amax:.3g})"
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (seconds)")
    parts = ("capacity", "decode", "writes", "workload", "accuracy", "calibration")
    parser.add_argument("--only", choices=parts, action="append", help="run only these parts")
    args = parser.parse_args()
    only = set(args.only or parts)
    if "capacity" in only:
        capacity()
    if "decode" in only:
        decode(4096 if args.quick else 32768, 3 if args.quick else 7)
        # Most E4M3 codes subnormal (below 2^-6): their float16s are subnormal too.
        decode(4096 if args.quick else 32768, 3 if args.quick else 7, magnitude=0.005)
    if "writes" in only:
        writes(1024 if args.quick else 4096, 3 if args.quick else 7)
    if "workload" in only:
        workload(args.quick)
    if "accuracy" in only:
        accuracy(args.quick)
    if "calibration" in only:
        calibration(args.quick)


if __name__ == "__main__":
    main()
