"""MLA rows of benches/bench_gpu.py: absorbed latent attention (DeepSeek-V3's shapes: 128
query heads over one 512-element latent and 64-element rotary part per position, bfloat16,
pages of 64) decoding one token per sequence, on kvrs's tensor-core MLA kernel and on
FlashInfer's `BatchMLAPagedAttentionWrapper` over the same pages."""

from __future__ import annotations

import math
import sys

import flashinfer_peer
from gpu_report import Bench, max_diff

import kvrs

LATENT, ROPE, MLA_HEADS, MLA_BS = 512, 64, 128, 64


def mla_decode(bench: Bench, batch: int, hist: int) -> None:
    """One decode token for each of `batch` sequences of `hist` latent positions."""
    torch = bench.torch
    case = f"MLA decode {batch} x {hist // 1024}k"
    pool = kvrs.BlockPool(
        1,
        1,
        LATENT,
        v_head_dim=ROPE,
        block_size=MLA_BS,
        num_blocks=batch * (hist // MLA_BS + 1) + 8,
        dtype="bfloat16",
        device="cuda",
        prefix_caching=False,
    )
    g = torch.Generator(device="cuda").manual_seed(7)
    c, r = (torch.randn(hist, 1, d, device="cuda", generator=g).bfloat16() for d in (LATENT, ROPE))
    seqs = [pool.new_sequence() for _ in range(batch)]
    for s in seqs:
        s.append(0, c, r)
        s.advance(hist)
    nc, nr = (torch.randn(batch, 1, d, device="cuda", generator=g).bfloat16() for d in (LATENT, ROPE))
    q = torch.randn(batch, MLA_HEADS, LATENT + ROPE, device="cuda", generator=g).bfloat16()
    out = torch.empty(batch, MLA_HEADS, LATENT, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(128 + ROPE)  # DeepSeek-V3's qk_nope_head_dim + qk_rope_head_dim
    fwd = pool.start_forward(seqs)
    fwd.put(0, nc, nr)

    def run() -> object:
        return fwd.attention(0, q, out=out, scale=scale, latent=True)

    run()
    nbytes = batch * (hist + 1) * (LATENT + ROPE) * 2
    flops = 2.0 * batch * MLA_HEADS * (hist + 1) * (LATENT + ROPE + LATENT)
    bench.add(case, "kvrs", nbytes, run, storage="bfloat16", flops=flops)
    fwd.finish()
    peer = bench.prefill_peer
    if peer is None or peer.fi is None:
        return
    try:
        mla = flashinfer_peer.Mla(peer, torch, pool, 0, seqs, q, scale)
        diff = max_diff(torch, out, mla.run())
        check = f"|kvrs-FI| {diff:.1e} ({'ok' if diff < 3e-2 else 'DIFFERS'}), plan {mla.plan_us:.0f} us"
        bench.add(case, "FlashInfer", nbytes, mla.run, storage="bfloat16", check=check, flops=flops)
    except Exception as e:  # FlashInfer's failure drops its row, says why
        print(f"{case}: FlashInfer MLA failed: {type(e).__name__}: {e}", file=sys.stderr)
