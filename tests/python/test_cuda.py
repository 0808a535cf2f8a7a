"""The CUDA backend on a real GPU (skipped without a CUDA driver and device).

Each test compares the device against the host path on fresh random data, with outputs
poisoned first: copies bitwise, conversions within the dtype's rounding. The same storage
code and kernels run in CI on a simulated device (`cargo test --features cuda-sim`);
these tests add the driver, the PTX JIT, DLPack with torch and CUDA graphs.
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

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def t(x: kvrs.DeviceTensor | np.ndarray) -> torch.Tensor:
    """A torch tensor over a device tensor or a host array (ml_dtypes bfloat16 included)."""
    if isinstance(x, np.ndarray) and x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


@pytest.mark.parametrize("store", list(DTYPES))
@pytest.mark.parametrize("given", list(DTYPES))
def test_kv_cache_append_and_views_match_the_host(store, given):
    g = torch.Generator(device="cuda").manual_seed(1)
    heads, dim = 3, 7  # odd head_dim
    gpu = kvrs.KVCache(2, heads, dim, 40, dtype=store, device="cuda")
    cpu = kvrs.KVCache(2, heads, dim, 40, dtype=store)
    for n in (5, 1, 13):
        for layer in range(2):
            k = torch.randn(n, heads, dim, device="cuda", generator=g).to(DTYPES[given])
            v = torch.randn(n, heads, dim, device="cuda", generator=g).to(DTYPES[given])
            gpu.append(layer, k, v)
            cpu.append(layer, k.float().cpu().numpy(), v.float().cpu().numpy())
        gpu.advance(n)
        cpu.advance(n)
    for layer in range(2):
        kd, vd = gpu.get(layer)
        assert isinstance(kd, kvrs.DeviceTensor) and kd.device == "cuda:0"
        kh, vh = cpu.get(layer)
        tol = 0 if given == store or store == "float32" else 1e-2
        torch.testing.assert_close(
            t(kd).float().cpu(), torch.from_numpy(kh.astype(np.float32)), atol=tol, rtol=tol
        )
        torch.testing.assert_close(
            t(vd).float().cpu(), torch.from_numpy(vh.astype(np.float32)), atol=tol, rtol=tol
        )


def test_views_are_the_same_memory():
    c = kvrs.KVCache(1, 2, 8, 16, dtype="float16", device="cuda")
    c.append(0, torch.ones(4, 2, 8, device="cuda", dtype=torch.float16), torch.zeros(4, 2, 8, device="cuda"))
    c.advance(4)
    k = t(c.get(0)[0])
    assert k.data_ptr() == c.get(0)[0].data_ptr
    assert bool((k == 1).all())


def test_host_tensors_are_refused_for_a_cuda_cache():
    c = kvrs.KVCache(1, 2, 8, 16, device="cuda")
    with pytest.raises(kvrs.DeviceError, match="this cache lives on cuda:0"):
        c.append(0, np.ones((1, 2, 8), np.float32), np.ones((1, 2, 8), np.float32))
    assert c.layer_len(0) == 0


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_pool_write_gather_and_fork_match_the_host(layout):
    g = torch.Generator(device="cuda").manual_seed(2)
    args = dict(num_layers=2, num_kv_heads=2, head_dim=5, block_size=4, num_blocks=16, layout=layout)
    gpu = kvrs.BlockPool(**args, dtype="bfloat16", device="cuda")
    cpu = kvrs.BlockPool(**args, dtype="bfloat16")
    seqs = [gpu.new_sequence(), cpu.new_sequence()]
    k = torch.randn(11, 2, 5, device="cuda", generator=g)
    v = torch.randn(11, 2, 5, device="cuda", generator=g)
    for s, (kk, vv) in ((seqs[0], (k, v)), (seqs[1], (k.cpu().numpy(), v.cpu().numpy()))):
        for layer in range(2):
            s.append(layer, kk, vv)
        s.advance(11)
    forks = [s.fork() for s in seqs]
    # Copy-on-write: the fork's next token lands in a copied block.
    for f, x in ((forks[0], k[:1]), (forks[1], k[:1].cpu().numpy())):
        for layer in range(2):
            f.append(layer, x, x)
        f.advance(1)
    for layer in range(2):
        for a, b in ((seqs[0], seqs[1]), (forks[0], forks[1])):
            kd, vd = a.get(layer)
            kh, vh = b.get(layer)
            assert torch.equal(t(kd).cpu().view(torch.uint16), torch.from_numpy(kh.view(np.uint16)))
            assert torch.equal(t(vd).cpu().view(torch.uint16), torch.from_numpy(vh.view(np.uint16)))
    assert gpu.stats()["used_blocks"] == cpu.stats()["used_blocks"]


def test_kv_cache_tensor_is_flashinfer_shaped_and_shared():
    pool = kvrs.BlockPool(1, 2, 8, block_size=4, num_blocks=8, dtype="float16", device="cuda")
    view = t(pool.kv_cache(0))
    assert tuple(view.shape) == (8, 2, 4, 2, 8)
    s = pool.new_sequence()
    s.append(0, torch.full((3, 2, 8), 2.0, device="cuda"), torch.full((3, 2, 8), 3.0, device="cuda"))
    s.advance(3)
    block = s.block_table[0]
    assert bool((view[block, 0, :3] == 2).all()) and bool((view[block, 1, :3] == 3).all())


def test_captured_decode_loop_replays_without_host_round_trips():
    heads, dim, layers = 2, 16, 3
    c = kvrs.KVCache(layers, heads, dim, 128, dtype="float16", device="cuda")
    k_in = torch.zeros(1, heads, dim, device="cuda", dtype=torch.float16)
    c.gpu_counter_ptr()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    # kvrs launches on the capturing stream.
    c.set_stream(stream.cuda_stream)
    with torch.cuda.graph(graph, stream=stream):
        for layer in range(layers):
            c.append_at_counter(layer, k_in, k_in)
        c.advance_counter(1)
    expected = []
    for step in range(100):
        k_in.fill_(float(step))
        graph.replay()
        expected.append(float(step))
    torch.cuda.synchronize()
    c.set_stream(None)
    assert c.sync_counter_from_gpu() == 100
    # The same 100 appends from the host, on a second cache: equal bit for bit.
    host = kvrs.KVCache(layers, heads, dim, 128, dtype="float16", device="cuda")
    for step in range(100):
        x = torch.full((1, heads, dim), float(step), device="cuda", dtype=torch.float16)
        for layer in range(layers):
            host.append(layer, x, x)
        host.advance(1)
    for layer in range(layers):
        assert torch.equal(t(c.get(layer)[0]), t(host.get(layer)[0]))
        assert torch.equal(t(c.get(layer)[1]), t(host.get(layer)[1]))
    got = t(c.get(0)[0]).float().cpu()[0, :, 0].tolist()
    assert got == expected


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_attention_kernel_matches_the_cpu_core(dtype, layout):
    """ForwardBatch.attention on a CUDA pool (kvrs_paged_attention_*) against the same
    batch on a host pool (the CPU core): sliding layer, GQA, soft-capping and sinks."""
    g = torch.Generator(device="cuda").manual_seed(3)
    kw = dict(block_size=4, num_blocks=64, dtype=dtype, layout=layout, layer_types=["full", "sliding"],
              sliding_window=5)  # fmt: skip
    pools = [kvrs.BlockPool(2, 2, 64, device="cuda", **kw), kvrs.BlockPool(2, 2, 64, **kw)]
    sinks = torch.randn(8).numpy()
    outs = []
    data = [torch.randn(n, 2, 64, device="cuda", generator=g).to(DTYPES[dtype]) for n in (7, 13, 7, 13, 5, 5)]
    q = torch.randn(5, 8, 64, device="cuda", generator=g).to(DTYPES[dtype])
    for pool in pools:
        host = pool.device == "cpu"
        conv = (lambda x: x.cpu()) if host else (lambda x: x)
        a, b = pool.new_sequence(), pool.new_sequence()
        for layer in range(2):
            a.append(layer, conv(data[0]), conv(data[2]))
            b.append(layer, conv(data[1]), conv(data[3]))
        a.advance(7)
        b.advance(13)
        with pool.start_forward([a, b, b, a, b]) as batch:
            per_layer = []
            for layer in range(2):
                batch.put(layer, conv(data[4]), conv(data[5]))
                per_layer.append(t(batch.attention(layer, conv(q), softcap=20.0, sinks=sinks)).float().cpu())
        outs.append(per_layer)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    for gpu_out, cpu_out in zip(outs[0], outs[1], strict=True):
        assert torch.allclose(gpu_out, cpu_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("store", list(DTYPES))
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_write_layers_and_put_layers_equal_the_host(store, layout):
    """write_layers / put_layers on a CUDA pool (one kvrs_scatter launch for every layer,
    inputs sliced from a larger buffer: a layer stride) against the host pool's writes."""
    g = torch.Generator(device="cuda").manual_seed(5)
    kinds = ["full", "sliding", "full"]
    kw = dict(block_size=4, num_blocks=64, dtype=store, layout=layout, layer_types=kinds, sliding_window=8)
    pools = [kvrs.BlockPool(3, 2, 64, device="cuda", **kw), kvrs.BlockPool(3, 2, 64, **kw)]
    buf = torch.randn(2, 3, 7, 2, 64, device="cuda", generator=g).to(torch.float16)
    k, v = buf[0, :, :6], buf[1, :, :6]
    for pool in pools:
        conv = (lambda x: x.cpu()) if pool.device == "cpu" else (lambda x: x)
        a, b = pool.new_sequence(), pool.new_sequence()
        slots = pool.reserve([a, b], [2, 1])
        pool.write_layers(conv(k[:, :3]), conv(v[:, :3]), slots)
        a.advance(2)
        b.advance(1)
        with pool.start_forward([a, b, b]) as batch:
            batch.put_layers(conv(k[:, 3:]), conv(v[:, 3:]))
    for layer in range(3):
        gpu, cpu = t(pools[0].kv_cache(layer)).cpu(), t(pools[1].kv_cache(layer))
        assert torch.equal(gpu.view(torch.uint8), cpu.view(torch.uint8))


def test_cupy_arrays_in_and_out_share_memory():
    cp = pytest.importorskip("cupy")
    c = kvrs.KVCache(1, 2, 8, 16, dtype="float32", device="cuda")
    k = cp.arange(3 * 2 * 8, dtype=cp.float32).reshape(3, 2, 8)
    c.append(0, k, -k)
    c.advance(3)
    kd, vd = c.get(0)
    ck = cp.from_dlpack(kd)
    assert ck.data.ptr == kd.data_ptr
    assert bool((ck == k.transpose(1, 0, 2)).all()) and bool((cp.from_dlpack(vd) == -ck).all())
    pool = kvrs.BlockPool(1, 2, 8, block_size=4, num_blocks=4, dtype="float16", device="cuda")
    view = cp.from_dlpack(pool.kv_cache(0))
    assert view.data.ptr == pool.kv_cache(0).data_ptr and view.shape == (4, 2, 4, 2, 8)


def test_appends_follow_the_stream_they_are_given():
    """Work queued on a side stream before the append is seen by it: kvrs launches on
    the stream set_stream names, so stream order alone makes the copy correct."""
    c = kvrs.KVCache(1, 8, 128, 4096, dtype="float16", device="cuda")
    stream = torch.cuda.Stream()
    c.set_stream(stream.cuda_stream)
    with torch.cuda.stream(stream):
        k = torch.zeros(4096, 8, 128, device="cuda", dtype=torch.float16)
        for _ in range(20):  # long enough that a launch on another stream would race it
            k.add_(1)
        c.append(0, k, k)
    c.set_stream(None)
    stream.synchronize()
    c.advance(4096)
    assert bool((t(c.get(0)[0]) == 20).all())


def test_sequence_attention_on_the_gpu_matches_torch_sdpa():
    g = torch.Generator(device="cuda").manual_seed(4)
    pool = kvrs.BlockPool(1, 2, 64, block_size=16, num_blocks=64, dtype="float16", device="cuda")
    s = pool.new_sequence()
    k = torch.randn(300, 2, 64, device="cuda", generator=g).half()
    v = torch.randn(300, 2, 64, device="cuda", generator=g).half()
    s.append(0, k, v)
    s.advance(300)
    q = torch.randn(1, 8, 64, device="cuda", generator=g).half()
    # The last position attends over the whole history (a decode step re-run).
    out = t(s.attention(0, q)).float()
    kk = k.float().permute(1, 0, 2).repeat_interleave(4, 0)
    vv = v.float().permute(1, 0, 2).repeat_interleave(4, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float().permute(1, 0, 2), kk, vv)
    torch.testing.assert_close(out, ref.permute(1, 0, 2), atol=2e-3, rtol=2e-3)


def raw(x: kvrs.DeviceTensor | np.ndarray) -> torch.Tensor:
    """The bytes of 8-bit codes (a device view or a host array) as a host uint8 tensor."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8))
    return torch.from_dlpack(x).contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_eight_bit_pool_on_the_device_equals_the_host(dtype, layout):
    """The quantize-on-write kernels against the host codecs: codes, scales and
    dequantized values bit for bit (float32 and float16 inputs on the device, per-head
    fp8 scales), through forks with copy-on-write and slot writes; attention over the
    codes within float rounding."""
    g = torch.Generator(device="cuda").manual_seed(5)
    scales = {"k_scale": [[0.5, 2.0], [1.0, 0.25]], "v_scale": 3.0} if dtype != "int8" else {}
    kw = dict(block_size=4, num_blocks=32, dtype=dtype, layout=layout, **scales)
    pools = [kvrs.BlockPool(2, 2, 64, device="cuda", **kw), kvrs.BlockPool(2, 2, 64, **kw)]
    sizes = (9, 9, 3, 3, 2, 2)
    data = [
        (torch.randn(n, 2, 64, device="cuda", generator=g) * 40).to(torch.float16 if i % 2 else torch.float32)
        for i, n in enumerate(sizes)
    ]
    q = torch.randn(2, 8, 64, device="cuda", generator=g)
    results = []
    for pool in pools:
        conv = (lambda x: x.cpu()) if pool.device == "cpu" else (lambda x: x)
        a = pool.new_sequence()
        for layer in range(2):
            a.append(layer, conv(data[0]), conv(data[1]))
        a.advance(9)
        b = a.fork()
        for layer in range(2):  # copy-on-write of the shared last block
            b.append(layer, conv(data[2]), conv(data[3]))
        b.advance(3)
        with pool.start_forward([a, b]) as batch:
            outs = []
            for layer in range(2):
                batch.put(layer, conv(data[4]), conv(data[5]))
                outs.append(t(batch.attention(layer, conv(q))).float().cpu())
        reads = []
        for s in (a, b):
            for layer in range(2):
                reads += [raw(x) for x in s.get(layer)]
                reads += [t(x).cpu() for x in s.get(layer, dequantize=True)]
                reads += [torch.from_numpy(np.asarray(x)) for x in s.scales(layer)]
        results.append((outs, reads))
    (gpu_outs, gpu_reads), (cpu_outs, cpu_reads) = results
    assert len(gpu_reads) == len(cpu_reads) == 2 * 2 * 6  # (a, b) x layers x (K, V) raw, dequantized, scales
    for got, want in zip(gpu_reads, cpu_reads, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(gpu_outs, cpu_outs, strict=True):
        # Outputs reach ~100 here: float32 sums in another order differ by ~1e-6 of that.
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)
    assert pools[0].stats()["bytes_total"] == pools[1].stats()["bytes_total"]


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_cuda_pools_swap_blocks_through_a_host_tier(dtype):
    """Evicted blocks of a CUDA pool go to a HostTier (kvrs_save_blocks, one copy) and
    load into another CUDA pool (kvrs_load_blocks), bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(6)
    host = kvrs.HostTier("64MiB")
    kw = dict(block_size=16, num_blocks=32, dtype=dtype, device="cuda", seed=5, tiers=[host], model_id="m")
    src = kvrs.BlockPool(4, 2, 64, **kw)
    prompt = list(range(70))
    s = src.new_sequence(tokens=prompt)
    for layer in range(4):
        x = torch.randn(70, 2, 64, device="cuda", generator=g).half()
        s.append(layer, x, -x)
    s.advance(70)
    want = [[t(x).cpu() for x in s.get(layer, dequantize=True)] for layer in range(4)]
    s.free()
    src.evict_all()
    src.flush_tiers()
    dst = kvrs.BlockPool(4, 2, 64, **kw)
    again = dst.new_sequence(tokens=prompt)
    assert again.cached_tokens_by_tier == {"pool": 0, "host": 64}
    for layer in range(4):
        for got, w in zip(again.get(layer, dequantize=True), want[layer], strict=True):
            assert torch.equal(t(got).cpu(), w[:, :64])
