"""Tensor-core attention and caller streams on a real GPU (skipped without a CUDA driver).

Extend and prefill rows in float16 and bfloat16 with head sizes 64, 128 and 256 run on
`kvrs_paged_attention_mma_*` (mma.sync, ldmatrix, cp.async); CI runs the same kernels on
the simulated device (`cargo test --features cuda-sim --test cuda_sim_attention`), with the
tensor-core instructions emulated from the PTX ISA's fragment layouts. These tests check
that the GPU agrees: against the host core over the same pages, and against torch's SDPA.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvrs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not kvrs.cuda_available(), reason="needs a CUDA driver and device"),
]

torch = pytest.importorskip("torch")

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def t(x: kvrs.DeviceTensor | np.ndarray) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype.name == "bfloat16":
            return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(x)
    return torch.from_dlpack(x)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 8), (128, 4), (256, 1)])
def test_extend_on_tensor_cores_equals_the_host(dtype, head_dim, group):
    """A sequence extends 77 tokens after 300 (a full and a sliding layer, sinks and
    soft-capping) beside a decoding one, on a CUDA pool and a host pool with the same
    contents: the outputs agree within the dtype's rounding."""
    g = torch.Generator(device="cuda").manual_seed(11)
    kv_heads, hist, n = 2, 300, 77
    kw = dict(block_size=16, num_blocks=96, dtype=dtype, layer_types=["full", "sliding"], sliding_window=100)
    pools = [
        kvrs.BlockPool(2, kv_heads, head_dim, device="cuda", **kw),
        kvrs.BlockPool(2, kv_heads, head_dim, **kw),
    ]
    hq = kv_heads * group
    data = [
        torch.randn(m, kv_heads, head_dim, device="cuda", generator=g).to(TORCH[dtype])
        for m in (hist, 5, n + 1)
    ]
    q = torch.randn(n + 1, hq, head_dim, device="cuda", generator=g).to(TORCH[dtype])
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(2)).tolist()
    outs = []
    for pool in pools:
        conv = (lambda x: x.cpu()) if pool.device == "cpu" else (lambda x: x)
        a, b = pool.new_sequence(), pool.new_sequence()
        for s, x in ((a, data[0]), (b, data[1])):
            for layer in range(2):
                s.append(layer, conv(x), conv(-x))
            s.advance(len(x))
        with pool.start_forward([a] * n + [b]) as batch:
            got = []
            for layer in range(2):
                batch.put(layer, conv(data[2]), conv(data[2] * 0.5))
                got.append(t(batch.attention(layer, conv(q), softcap=30.0, sinks=sinks)).float().cpu())
        outs.append(got)
    tol = 2e-3 if dtype == "float16" else 1.6e-2
    for gpu, cpu in zip(*outs, strict=True):
        torch.testing.assert_close(gpu, cpu, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prefill_equals_causal_sdpa(dtype):
    """A 1,000-token prompt (GQA 4) written and attended in one step: torch's causal SDPA
    on the same K/V within the dtype's rounding."""
    g = torch.Generator(device="cuda").manual_seed(12)
    n, kv_heads, hq, d = 1000, 2, 8, 128
    pool = kvrs.BlockPool(1, kv_heads, d, block_size=16, num_blocks=80, dtype=dtype, device="cuda")
    s = pool.new_sequence()
    k, v, q = (
        torch.randn(n, h, d, device="cuda", generator=g).to(TORCH[dtype]) for h in (kv_heads, kv_heads, hq)
    )
    with pool.start_forward([s] * n) as batch:
        batch.put(0, k, v)
        out = t(batch.attention(0, q)).float()
    kk = k.float().permute(1, 0, 2).repeat_interleave(hq // kv_heads, 0)
    vv = v.float().permute(1, 0, 2).repeat_interleave(hq // kv_heads, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float().permute(1, 0, 2), kk, vv, is_causal=True)
    tol = 2e-3 if dtype == "float16" else 1.6e-2
    torch.testing.assert_close(out, ref.permute(1, 0, 2), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_latent_attention_on_the_gpu_equals_the_host(dtype):
    """MLA over a latent pool (512 + 64 per position, DeepSeek's shapes): 128 query heads
    decoding over 1,500 positions (split across blocks and merged) beside a sequence
    extending 5 tokens, on kvrs_paged_attention_mla_* and on the host core."""
    g = torch.Generator(device="cuda").manual_seed(13)
    kw = dict(block_size=64, num_blocks=64, dtype=dtype)
    pools = [
        kvrs.BlockPool(1, 1, 512, v_head_dim=64, device="cuda", **kw),
        kvrs.BlockPool(1, 1, 512, v_head_dim=64, **kw),
    ]
    hist = [1500, 200]
    cs = [torch.randn(n, 1, 512, device="cuda", generator=g).to(TORCH[dtype]) for n in hist + [6]]
    rs = [torch.randn(n, 1, 64, device="cuda", generator=g).to(TORCH[dtype]) for n in hist + [6]]
    q = torch.randn(6, 128, 576, device="cuda", generator=g).to(TORCH[dtype])
    outs = []
    for pool in pools:
        conv = (lambda x: x.cpu()) if pool.device == "cpu" else (lambda x: x)
        seqs = [pool.new_sequence() for _ in hist]
        for s, c, r, n in zip(seqs, cs, rs, hist, strict=False):
            s.append(0, conv(c), conv(r))
            s.advance(n)
        with pool.start_forward([seqs[0]] + [seqs[1]] * 5) as batch:
            batch.put(0, conv(cs[2]), conv(rs[2]))
            outs.append(t(batch.attention(0, conv(q), scale=0.07, latent=True)).float().cpu())
    tol = 2e-3 if dtype == "float16" else 1.6e-2
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


def test_pool_launches_follow_the_stream_they_are_given():
    """Work queued on a side stream before a pool's write and attention is seen by them:
    with set_stream (a torch stream object, then an integer handle) the pool launches on
    that stream, so stream order alone makes the step correct."""
    pool = kvrs.BlockPool(1, 8, 128, block_size=16, num_blocks=300, dtype="float16", device="cuda")
    s = pool.new_sequence()
    for given in ("object", "handle"):
        stream = torch.cuda.Stream()
        pool.set_stream(stream if given == "object" else stream.cuda_stream)
        with torch.cuda.stream(stream), pool.start_forward([s] * 2048) as batch:
            k = torch.zeros(2048, 8, 128, device="cuda", dtype=torch.float16)
            q = torch.zeros(2048, 8, 128, device="cuda", dtype=torch.float16)
            for _ in range(20):  # long enough that a launch on another stream would race it
                k.add_(1)
            batch.put(0, k, k)
            out = t(batch.attention(0, q))
        stream.synchronize()
        pool.set_stream(None)
        # Uniform scores: every output is the mean of the values, 20.
        assert bool((out == 20).all()), given
        s.truncate(0)
