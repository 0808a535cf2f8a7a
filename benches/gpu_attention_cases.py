"""Attention rows of benches/bench_gpu.py: decode (float16, fp8, int8 storage) over one long
sequence and over a batch, chunked prefill (extend) and a long prefill, both on kvrs's
tensor-core kernel; SDPA and FlashInfer beside kvrs."""

from __future__ import annotations

import sys
from typing import Any

import flashinfer_peer
from gpu_report import BS, DIM, HEADS, QHEADS, Bench, kv_bytes, max_diff

import kvrs


def sdpa_rows(
    bench: Bench,
    case: str,
    q: Any,
    k: Any,
    v: Any,
    nbytes: int,
    ref: Any,
    mask: Any = None,
    flops: float | None = None,
) -> None:
    """SDPA over contiguous [b, heads, s, d] K and V: enable_gqa, and transformers' repeat_kv
    (the repeat timed too, as transformers runs it on every call)."""
    torch = bench.torch
    sdpa = torch.nn.functional.scaled_dot_product_attention
    group = q.shape[1] // k.shape[1]

    def gqa() -> Any:
        return sdpa(q, k, v, attn_mask=mask, enable_gqa=True)

    def repeat() -> Any:
        return sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask)

    for impl, fn in (("SDPA enable_gqa", gqa), ("SDPA repeat_kv", repeat)):
        try:
            check = f"|kvrs-SDPA| {max_diff(torch, ref, fn()):.1e}" if ref is not None else ""
            graph = impl == "SDPA enable_gqa" or None
            bench.add(case, impl, nbytes, fn, check=check, graph_bind=graph, flops=flops)
        except Exception as e:  # a variant this torch refuses drops its row, says why
            print(f"{case}: {impl} failed: {type(e).__name__}: {e}", file=sys.stderr)


def decode_single(bench: Bench, dtype: str, n: int = 32768) -> None:
    """Decode of one query token over one sequence of n tokens."""
    torch = bench.torch
    case = f"decode 1 x {n // 1024}k"
    pool = kvrs.BlockPool(
        1, HEADS, DIM, block_size=BS, num_blocks=n // BS + 8, dtype=dtype, device="cuda", prefix_caching=False
    )
    seq = pool.new_sequence()
    g = torch.Generator(device="cuda").manual_seed(1)
    k, v = (torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    seq.append(0, k, v)
    seq.advance(n)
    q = torch.randn(1, QHEADS, DIM, device="cuda", dtype=torch.float16, generator=g)
    out = torch.empty_like(q)
    seq.attention(0, q, out=out)
    ref = out.clone()
    bench.add(
        case,
        "kvrs",
        kv_bytes(dtype, n),
        lambda: seq.attention(0, q, out=out),
        storage=dtype,
        graph_bind=getattr(pool, "set_stream", False),
    )
    if dtype == "float16":
        kc, vc = (x.transpose(0, 1)[None].contiguous() for x in (k, v))
        sdpa_rows(
            bench, case, q.transpose(0, 1)[None], kc, vc, kv_bytes(dtype, n), ref.view(1, QHEADS, 1, DIM)
        )
    flashinfer_decode(bench, case, pool, [seq], q, ref, dtype, kv_bytes(dtype, n))


def decode_batch(bench: Bench, dtype: str, batch: int = 256, hist: int = 2048) -> None:
    """One decode token for each of `batch` sequences of `hist` tokens, written in rounds of
    256 tokens so that the sequences' pages interleave in the pool."""
    torch = bench.torch
    case = f"decode {batch} x {hist // 1024}k"
    pool = kvrs.BlockPool(
        1,
        HEADS,
        DIM,
        block_size=BS,
        num_blocks=batch * (hist // BS + 1) + 8,
        dtype=dtype,
        device="cuda",
        prefix_caching=False,
    )
    g = torch.Generator(device="cuda").manual_seed(2)
    hk, hv = (
        torch.randn(hist, HEADS, DIM, device="cuda", dtype=torch.float16, generator=g) for _ in range(2)
    )
    seqs = [pool.new_sequence() for _ in range(batch)]
    for r in range(0, hist, 256):
        for s in seqs:
            s.append(0, hk[r : r + 256], hv[r : r + 256])
            s.advance(256)
    nk, nv = (
        torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.float16, generator=g) for _ in range(2)
    )
    q = torch.randn(batch, QHEADS, DIM, device="cuda", dtype=torch.float16, generator=g)
    out = torch.empty_like(q)
    fwd = pool.start_forward(seqs)
    fwd.put(0, nk, nv)
    fwd.attention(0, q, out=out)
    ref = out.clone()
    nbytes = kv_bytes(dtype, batch * (hist + 1))
    bench.add(
        case,
        "kvrs",
        nbytes,
        lambda: fwd.attention(0, q, out=out),
        storage=dtype,
        graph_bind=getattr(pool, "set_stream", False),
    )
    fwd.finish()
    if dtype == "float16":
        kc, vc = (
            torch.cat([h[None].expand(batch, -1, -1, -1), x[:, None]], 1).transpose(1, 2).contiguous()
            for h, x in ((hk, nk), (hv, nv))
        )
        sdpa_rows(bench, case, q[:, :, None], kc, vc, nbytes, ref[:, :, None])
        del kc, vc
    flashinfer_decode(bench, case, pool, seqs, q, ref, dtype, nbytes)


def flashinfer_decode(
    bench: Bench, case: str, pool: Any, seqs: list[Any], q: Any, ref: Any, dtype: str, nbytes: int
) -> None:
    """FlashInfer's batch decode over the pool's pages and page table (float16 and fp8)."""
    if bench.peer.fi is None or dtype == "int8":
        return
    torch = bench.torch
    try:
        dec = flashinfer_peer.Decode(bench.peer, torch, pool, 0, seqs, q)
        scales = {}
        if dtype != "float16":
            scales = {"k_scale": float(pool.k_scale[0, 0]), "v_scale": float(pool.v_scale[0, 0])}
            if len({*pool.k_scale[0].tolist()}) != 1 or len({*pool.v_scale[0].tolist()}) != 1:
                raise ValueError("per-head fp8 scales differ; FlashInfer takes one scale per tensor")
        out = dec.wrapper.run(q, dec.pages, out=dec.out, **scales)
        diff = max_diff(torch, ref, out)
        check = f"|kvrs-FI| {diff:.1e} ({'ok' if diff < 2e-2 else 'DIFFERS'}), plan {dec.plan_us:.0f} us"
        bench.add(
            case,
            "FlashInfer",
            nbytes,
            lambda: dec.wrapper.run(q, dec.pages, out=dec.out, **scales),
            storage=dtype,
            check=check,
        )
    except Exception as e:  # FlashInfer's failure drops its row, says why
        print(f"{case} [{dtype}]: FlashInfer decode failed: {type(e).__name__}: {e}", file=sys.stderr)


def extend(bench: Bench, nseq: int = 16, hist: int = 2048, new: int = 512) -> None:
    """Chunked prefill: `new` causal query tokens per sequence over `hist` + `new` positions."""
    torch = bench.torch
    case = f"extend {nseq} x ({hist // 1024}k+{new})"
    pool = kvrs.BlockPool(
        1,
        HEADS,
        DIM,
        block_size=BS,
        num_blocks=nseq * ((hist + new) // BS + 1) + 8,
        device="cuda",
        prefix_caching=False,
    )
    g = torch.Generator(device="cuda").manual_seed(3)
    total = hist + new
    ks, vs = (
        torch.randn(nseq, total, HEADS, DIM, device="cuda", dtype=torch.float16, generator=g)
        for _ in range(2)
    )
    seqs = [pool.new_sequence() for _ in range(nseq)]
    for i, s in enumerate(seqs):
        s.append(0, ks[i, :hist], vs[i, :hist])
        s.advance(hist)
    fwd = pool.start_forward(
        [s for s in seqs for _ in range(new)], [hist + j for _ in seqs for j in range(new)]
    )
    fwd.put(0, ks[:, hist:].reshape(-1, HEADS, DIM), vs[:, hist:].reshape(-1, HEADS, DIM))
    q = torch.randn(nseq * new, QHEADS, DIM, device="cuda", dtype=torch.float16, generator=g)
    out = torch.empty_like(q)
    fwd.attention(0, q, out=out)
    ref = out.view(nseq, new, QHEADS, DIM).transpose(1, 2).clone()
    nbytes = kv_bytes("float16", nseq * total)
    # Q K^T and P V over each query's causal window.
    flops = 4.0 * QHEADS * DIM * nseq * sum(hist + j + 1 for j in range(new))
    bench.add(case, "kvrs", nbytes, lambda: fwd.attention(0, q, out=out), flops=flops)
    fwd.finish()  # the sequences now end with the step's tokens, as FlashInfer's table must
    flashinfer_prefill(bench, case, pool, seqs, [new] * nseq, q, out, nbytes, flops)
    from torch.nn.attention.bias import causal_lower_right

    qs = q.view(nseq, new, QHEADS, DIM).transpose(1, 2)
    kc, vc = (x.transpose(1, 2).contiguous() for x in (ks, vs))
    sdpa_rows(bench, case, qs, kc, vc, nbytes, ref, mask=causal_lower_right(new, total), flops=flops)


def prefill(bench: Bench, n: int = 32768) -> None:
    """One n-token prompt written and attended in one step (causal)."""
    torch = bench.torch
    case = f"prefill 1 x {n // 1024}k"
    pool = kvrs.BlockPool(
        1, HEADS, DIM, block_size=BS, num_blocks=n // BS + 8, device="cuda", prefix_caching=False
    )
    g = torch.Generator(device="cuda").manual_seed(4)
    k, v = (torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    q = torch.randn(n, QHEADS, DIM, device="cuda", dtype=torch.float16, generator=g)
    seq = pool.new_sequence()
    fwd = pool.start_forward([seq] * n)
    fwd.put(0, k, v)
    out = torch.empty_like(q)
    fwd.attention(0, q, out=out)
    ref = out.transpose(0, 1)[None].clone()
    nbytes = kv_bytes("float16", n)
    flops = 4.0 * QHEADS * DIM * n * (n + 1) / 2
    bench.add(case, "kvrs", nbytes, lambda: fwd.attention(0, q, out=out), flops=flops)
    fwd.finish()
    flashinfer_prefill(bench, case, pool, [seq], [n], q, out, nbytes, flops)
    kc, vc = (x.transpose(0, 1)[None].contiguous() for x in (k, v))
    qs = q.transpose(0, 1)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # SDPA's flash kernel takes is_causal with enable_gqa; a [n, n] mask would be 2 GiB.
    fn = lambda: sdpa(qs, kc, vc, is_causal=True, enable_gqa=True)  # noqa: E731
    try:
        check = f"|kvrs-SDPA| {max_diff(torch, ref, fn()):.1e}"
        bench.add(case, "SDPA enable_gqa", nbytes, fn, check=check, graph_bind=True, flops=flops)
    except Exception as e:  # a variant this torch refuses drops its row, says why
        print(f"{case}: SDPA failed: {type(e).__name__}: {e}", file=sys.stderr)


def flashinfer_prefill(
    bench: Bench,
    case: str,
    pool: Any,
    seqs: list[Any],
    new: list[int],
    q: Any,
    ref: Any,
    nbytes: int,
    flops: float,
) -> None:
    """FlashInfer's causal batch prefill over the pool's pages and page table (the step's
    tokens already written, so each sequence's table ends with them)."""
    peer = bench.prefill_peer
    if peer is None or peer.fi is None:
        return
    torch = bench.torch
    try:
        pre = flashinfer_peer.Prefill(peer, torch, pool, 0, seqs, new, q)
        diff = max_diff(torch, ref, pre.run())
        check = f"|kvrs-FI| {diff:.1e} ({'ok' if diff < 2e-2 else 'DIFFERS'}), plan {pre.plan_us:.0f} us"
        bench.add(case, "FlashInfer", nbytes, pre.run, check=check, flops=flops)
    except Exception as e:  # FlashInfer's failure drops its row, says why
        print(f"{case}: FlashInfer prefill failed: {type(e).__name__}: {e}", file=sys.stderr)
