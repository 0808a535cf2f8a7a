"""Attention over the cache: kvrs's paged attention (read in place) against torch SDPA over
contiguous K/V, against today's gather + SDPA, and against a NumPy copy of the same bytes
(the bandwidth floor), in one process.

    python benches/bench_attention.py            # the README's table
    python benches/bench_attention.py --quick    # smaller sizes, seconds

Cases (float16 storage unless named):
- decode over one sequence of 32k tokens, 32 query heads, 8 KV heads x 128, in float16,
  bfloat16 and float32: kvrs `Sequence.attention` vs SDPA on contiguous K/V (the best a
  gather-free peer does on CPU) vs `Sequence.get` + SDPA;
- 32 and 256 sequences x 2k tokens, one decode token each: `ForwardBatch.attention` vs
  `Sequence.get` + SDPA per sequence and vs `ForwardBatch.get` + SDPA under its dense mask
  (where that fits in memory);
- prefill of one 2k-token prompt (causal) and extend (512 new tokens over 2k cached) in
  float32, float16 and bfloat16: `ForwardBatch.attention` reading the pages in place vs
  SDPA on contiguous K/V (`is_causal`, or the extend's mask), in interleaved rounds (best
  of each), with both GFLOP/s against the machine's float32 FMA peak
  (`benches/peak/fma_peak.rs`, compiled with rustc, on as many threads as torch uses).

    python benches/bench_attention.py --only prefill   # the prefill and extend rows alone

On a CPU with AVX-512 the prefill and extend rounds also time kvrs's AVX2 kernel (the
level set per call), so both kernels' ratios to SDPA come from the same rounds.
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np
import torch

import kvrs

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
NUMPY = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


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


def long_decode(dtype: str, n: int, repeat: int) -> dict[str, float]:
    hkv, hq, d = 8, 32, 128
    rng = np.random.default_rng(0)
    pool = kvrs.BlockPool(1, hkv, d, block_size=16, num_blocks=n // 16 + 1, dtype=dtype, prefix_caching=False)
    seq = pool.new_sequence()
    chunk = 4096
    for i in range(0, n, chunk):
        seq.append(0, *rng.standard_normal((2, min(chunk, n - i), hkv, d), dtype=np.float32))
    q = rng.standard_normal((1, hq, d), dtype=np.float32).astype(NUMPY[dtype])
    k_contig, v_contig = (as_torch(x)[None] for x in seq.get(0))  # [1, hkv, n, d]
    tq = as_torch(q).transpose(0, 1)[None]  # [1, hq, 1, d]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kv_bytes = 2 * n * hkv * d * np.dtype(NUMPY[dtype]).itemsize
    src = np.empty(kv_bytes, np.uint8)
    dst = np.empty_like(src)
    src.fill(1)

    def gather_sdpa():
        k, v = seq.get(0)
        sdpa(tq, as_torch(k)[None], as_torch(v)[None], enable_gqa=True)

    out = {
        "kvrs": best(lambda: seq.attention(0, q), repeat),
        "sdpa_contiguous": best(lambda: sdpa(tq, k_contig, v_contig, enable_gqa=True), repeat),
        "gather_sdpa": best(gather_sdpa, repeat),
        "numpy_copy": best(lambda: np.copyto(dst, src), repeat),
        "bytes": kv_bytes,
    }
    got = seq.attention(0, q).astype(np.float32)
    want = sdpa(tq.float(), k_contig.float(), v_contig.float(), enable_gqa=True)[0, :, 0].numpy()
    assert np.abs(got[0] - want).max() < 2e-2, "kvrs and SDPA disagree"
    return out


def many_sequences(num_seqs: int, length: int, repeat: int) -> dict[str, float]:
    """One decode token for each of `num_seqs` sequences of `length` tokens: kvrs's
    ForwardBatch.attention against today's two ways, gathering each sequence's history
    and running SDPA per sequence, and ForwardBatch.get + SDPA under its dense mask (run
    only where its [heads x tokens x history] scores fit in 2 GiB: it grows with the
    square of the batch)."""
    hkv, hq, d = 8, 32, 128
    rng = np.random.default_rng(1)
    pool = kvrs.BlockPool(
        1,
        hkv,
        d,
        block_size=16,
        num_blocks=num_seqs * (length // 16 + 2),
        dtype="float16",
        prefix_caching=False,
    )
    seqs = [pool.new_sequence() for _ in range(num_seqs)]
    kv = rng.standard_normal((2, length, hkv, d), dtype=np.float32)
    for s in seqs:
        s.append(0, kv[0], kv[1])
        s.advance(length)
    batch = pool.start_forward(seqs)
    batch.put(0, *rng.standard_normal((2, num_seqs, hkv, d), dtype=np.float32))
    q = rng.standard_normal((num_seqs, hq, d), dtype=np.float32).astype(np.float16)
    tq = torch.from_numpy(q)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def per_sequence():
        for i, s in enumerate(seqs):
            k, v = s.get(0)
            sdpa(tq[i : i + 1].transpose(0, 1)[None], as_torch(k)[None], as_torch(v)[None], enable_gqa=True)

    def get_sdpa():
        k, v, mask = batch.get(0)
        sdpa(
            tq.transpose(0, 1)[None],
            as_torch(k)[None],
            as_torch(v)[None],
            attn_mask=torch.from_numpy(mask).to(torch.float16),
            enable_gqa=True,
        )

    out = {
        "kvrs": best(lambda: batch.attention(0, q), repeat),
        "per_sequence": best(per_sequence, max(1, repeat // 3)),
    }
    scores = hq * num_seqs * num_seqs * (length + 1) * 2
    out["get_sdpa"] = best(get_sdpa, max(1, repeat // 3)) if scores < 2**31 else float("nan")
    batch.cancel()
    return out


def kvrs_decode_only(dtype: str, n: int, repeat: int) -> float:
    """Seconds of kvrs's decode over one sequence of `n` tokens (as in `long_decode`)."""
    rng = np.random.default_rng(0)
    pool = kvrs.BlockPool(1, 8, 128, block_size=16, num_blocks=n // 16 + 1, dtype=dtype, prefix_caching=False)
    seq = pool.new_sequence()
    for i in range(0, n, 4096):
        seq.append(0, *rng.standard_normal((2, min(4096, n - i), 8, 128), dtype=np.float32))
    q = rng.standard_normal((1, 32, 128), dtype=np.float32).astype(NUMPY[dtype])
    return best(lambda: seq.attention(0, q), repeat)


def portable_times(n: int, repeat: int) -> dict[str, float]:
    """kvrs's decode times with the portable kernel (KVRS_SIMD=portable), in a child process."""
    import json
    import os
    import subprocess
    import sys

    dtypes = ("float16", "bfloat16", "float32")
    code = (
        "import json, sys; sys.path.insert(0, 'benches'); import bench_attention as b; "
        f"print(json.dumps({{d: b.kvrs_decode_only(d, {n}, {repeat}) for d in {dtypes!r}}}))"
    )
    env = dict(os.environ, KVRS_SIMD="portable")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def prefill_case(dtype: str, history: int, new: int):
    """`new` tokens over `history` cached ones (a prefill when 0) in one sequence, 32 query /
    8 KV heads x 128: the kvrs call, the SDPA call on contiguous K/V, their flops (the
    causal half counted once) and the largest difference of their outputs."""
    hkv, hq, d = 8, 32, 128
    n = history + new
    rng = np.random.default_rng(2)
    k, v = (x.astype(NUMPY[dtype]) for x in rng.standard_normal((2, n, hkv, d), dtype=np.float32))
    q = rng.standard_normal((new, hq, d), dtype=np.float32).astype(NUMPY[dtype])
    pool = kvrs.BlockPool(1, hkv, d, block_size=16, num_blocks=n // 16 + 1, dtype=dtype, prefix_caching=False)
    seq = pool.new_sequence()
    if history:
        seq.append(0, k[:history], v[:history])
        seq.advance(history)
    batch = pool.start_forward([seq] * new)
    batch.put(0, k[history:], v[history:])
    tq = as_torch(q).transpose(0, 1)[None]  # [1, hq, new, d]
    tk, tv = (as_torch(x).transpose(0, 1)[None].contiguous() for x in (k, v))  # [1, hkv, n, d]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if history:
        # Row i sees positions 0..=history + i (SDPA's is_causal aligns to the top left).
        mask = torch.arange(n)[None, :] <= (history + torch.arange(new))[:, None]
        torch_call = lambda: sdpa(tq, tk, tv, attn_mask=mask, enable_gqa=True)  # noqa: E731
    else:
        torch_call = lambda: sdpa(tq, tk, tv, is_causal=True, enable_gqa=True)  # noqa: E731
    kvrs_call = lambda: batch.attention(0, q)  # noqa: E731
    seen = new * history + new * (new + 1) // 2
    flops = 4 * hq * d * seen
    got = np.asarray(kvrs_call()).astype(np.float32)
    want = torch_call().float()[0].transpose(0, 1).numpy()
    return kvrs_call, torch_call, flops, float(np.abs(got - want).max()), batch


def fma_peak(threads: int) -> float | None:
    """GFLOP/s of float32 AVX2 FMAs on `threads` threads (None without rustc or AVX2)."""
    import os
    import shutil
    import subprocess
    import tempfile

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak", "fma_peak.rs")
    if shutil.which("rustc") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "fma_peak")
        subprocess.run(["rustc", "-O", "-C", "target-cpu=native", src, "-o", exe], check=True)
        run = subprocess.run([exe, str(threads)], capture_output=True, text=True)
    return float(run.stdout.split()[1]) if run.returncode == 0 else None


def prefill_rows(n: int, new: int, rounds: int) -> None:
    """Prefill of `n` tokens and extend of `new` over `n`, each dtype, interleaved rounds."""
    peak = fma_peak(torch.get_num_threads())
    peak_text = f"{peak:.0f} GFLOP/s" if peak else "not measured (no rustc or AVX2+FMA)"
    print(f"\nprefill and extend, 32 query / 8 KV heads x 128, causal; float32 FMA peak of "
          f"{torch.get_num_threads()} threads: {peak_text}")  # fmt: skip
    cases = {}
    for dtype in ("float32", "float16", "bfloat16"):
        cases[("prefill", dtype)] = prefill_case(dtype, 0, n)
        cases[("extend", dtype)] = prefill_case(dtype, n, new)
    # Where this CPU has AVX-512, the same kvrs call on the AVX2 kernel joins the rounds
    # (the level set before each call): the two kernels' ratio from the same rounds.
    level = kvrs.attention_simd()
    wide = level.startswith("avx512")
    times = {key: [float("inf")] * 3 for key in cases}
    for _ in range(rounds):
        for key, (kvrs_call, torch_call, *_rest) in cases.items():
            for i, call in enumerate((kvrs_call, torch_call, kvrs_call)[: 3 if wide else 2]):
                if wide:
                    kvrs._kvrs._set_attention_simd("avx2" if i == 2 else None)
                t0 = time.perf_counter()
                call()
                times[key][i] = min(times[key][i], time.perf_counter() - t0)
    if wide:
        kvrs._kvrs._set_attention_simd(None)
    head = f"{'work':<26} {'storage':<9} {'kvrs':>9} {'SDPA contig':>12} {'kvrs/SDPA':>10} "
    head += f"{'kvrs GFLOP/s':>13} {'SDPA GFLOP/s':>13} {'kvrs of peak':>13} {'max |diff|':>11}"
    print(head + (f" {'kvrs avx2':>10} {'avx2/SDPA':>10}" if wide else ""))
    for (kind, dtype), (_k, _t, flops, diff, batch) in cases.items():
        ours, theirs, avx2 = times[(kind, dtype)]
        work = f"prefill {n}" if kind == "prefill" else f"extend {new} over {n}"
        of_peak = f"{flops / ours / 1e9 / peak:>12.0%}" if peak else f"{'-':>12}"
        extra = f" {avx2:>9.3f}s {avx2 / theirs:>9.2f}x" if wide else ""
        print(
            f"{work:<26} {dtype:<9} {ours:>8.3f}s {theirs:>11.3f}s {ours / theirs:>9.2f}x "
            f"{flops / ours / 1e9:>13.1f} {flops / theirs / 1e9:>13.1f} {of_peak} {diff:>11.2e}{extra}"
        )
        batch.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (seconds)")
    parser.add_argument("--only", choices=("decode", "prefill"), help="run one part")
    args = parser.parse_args()
    n = 4096 if args.quick else 32768
    repeat = 3 if args.quick else 7
    ours: dict[str, float] = {}
    print(f"kvrs attention benchmark (torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
          f"kvrs SIMD: {kvrs.attention_simd()})")  # fmt: skip
    if args.only != "decode":
        prefill_rows(512 if args.quick else 2048, 128 if args.quick else 512, 2 if args.quick else 3)
    if args.only == "prefill":
        return
    print(f"\ndecode, one sequence of {n} tokens, 32 query / 8 KV heads x 128")
    print(f"{'storage':<9} {'kvrs':>9} {'SDPA contig':>12} {'gather+SDPA':>12} {'kvrs vs SDPA':>13} "
          f"{'vs gather':>10} {'kvrs GB/s':>10} {'copy GB/s':>10} {'of copy':>8}")  # fmt: skip
    for dtype in ("float16", "bfloat16", "float32"):
        r = long_decode(dtype, n, repeat)
        ours[dtype] = r["kvrs"]
        gbs, copy = r["bytes"] / r["kvrs"] / 1e9, r["bytes"] / r["numpy_copy"] / 1e9
        print(
            f"{dtype:<9} {r['kvrs'] * 1e3:>7.2f}ms {r['sdpa_contiguous'] * 1e3:>10.2f}ms "
            f"{r['gather_sdpa'] * 1e3:>10.2f}ms {r['sdpa_contiguous'] / r['kvrs']:>12.1f}x "
            f"{r['gather_sdpa'] / r['kvrs']:>9.1f}x {gbs:>10.2f} {copy:>10.2f} {gbs / copy:>8.0%}"
        )
    if kvrs.attention_simd() != "portable":
        portable = portable_times(n, repeat)
        print("\nthe same kvrs decode with the portable kernel (KVRS_SIMD=portable: loops the compiler")
        print("vectorises for the baseline x86-64, SSE2) against the AVX2 + FMA + F16C build:")
        for dtype, t in portable.items():
            avx2 = ours[dtype]
            print(f"{dtype:<9} portable {t * 1e3:>7.2f}ms   avx2 {avx2 * 1e3:>7.2f}ms   {t / avx2:.1f}x")
    for seqs, length in [(32, 512)] if args.quick else [(32, 2048), (256, 2048)]:
        r = many_sequences(seqs, length, repeat)
        print(f"\ndecode, {seqs} sequences x {length} tokens, one token each (float16)")
        print(f"{'kvrs ForwardBatch.attention':<40} {r['kvrs'] * 1e3:>9.2f} ms")
        print(f"{'Sequence.get + SDPA, per sequence':<40} {r['per_sequence'] * 1e3:>9.2f} ms"
              f"   kvrs {r['per_sequence'] / r['kvrs']:.1f}x faster")  # fmt: skip
        if np.isnan(r["get_sdpa"]):
            print(f"{'ForwardBatch.get + SDPA (dense mask)':<40} not run: its scores need over 2 GiB")
        else:
            print(f"{'ForwardBatch.get + SDPA (dense mask)':<40} {r['get_sdpa'] * 1e3:>9.2f} ms"
                  f"   kvrs {r['get_sdpa'] / r['kvrs']:.1f}x faster")  # fmt: skip


if __name__ == "__main__":
    main()
