"""Copy rows of benches/bench_gpu.py: prefill scatter (FlashInfer's append beside it),
gather, copy-on-write of forks, the multi-layer decode write and the tiers' swap-in."""

from __future__ import annotations

import sys
from typing import Any

import flashinfer_peer
from gpu_report import BS, DIM, HEADS, STORAGE, Bench, kv_bytes

import kvrs


def scatter_gather(bench: Bench, cases: set[str], n: int = 32768) -> None:
    """Prefill scatter of n tokens into one sequence (every storage dtype; FlashInfer's
    append beside the float16 one), then the gather of that sequence."""
    torch = bench.torch
    g = torch.Generator(device="cuda").manual_seed(4)
    k, v = (torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    for dtype in STORAGE if "scatter" in cases else ("float16",):
        pool = kvrs.BlockPool(
            1,
            HEADS,
            DIM,
            block_size=BS,
            num_blocks=n // BS + 8,
            dtype=dtype,
            device="cuda",
            prefix_caching=False,
        )
        seq = pool.new_sequence()
        slots = pool.reserve([seq], [n])
        moved = kv_bytes("float16", n) + kv_bytes(dtype, n)
        case = f"prefill scatter {n // 1024}k"
        if "scatter" in cases:
            bench.add(
                case,
                "kvrs pool.write",
                moved,
                lambda p=pool, s=slots: p.write(0, k, v, s),
                storage=dtype,
            )
        pool.write(0, k, v, slots)
        seq.advance(n)
        if dtype != "float16":
            continue
        if "scatter" in cases and bench.peer.fi is not None:
            flashinfer_append(bench, case, pool, seq, k, v, moved)
        if "gather" in cases:
            out = tuple(torch.empty(HEADS, n, DIM, device="cuda", dtype=torch.float16) for _ in range(2))
            seq.get(0, out=out)
            ok = torch.equal(out[0], k.transpose(0, 1)) and torch.equal(out[1], v.transpose(0, 1))
            bench.add(
                f"gather {n // 1024}k",
                "kvrs Sequence.get(out=)",
                2 * kv_bytes("float16", n),
                lambda s=seq, o=out: s.get(0, out=o),
                check="equal" if ok else "DIFFERS",
            )


def flashinfer_append(bench: Bench, case: str, pool: Any, seq: Any, k: Any, v: Any, moved: int) -> None:
    """FlashInfer's append of the same tokens into the same pages; the pages it writes must
    equal kvrs's bit for bit."""
    torch = bench.torch
    try:
        app = flashinfer_peer.Append(bench.peer, torch, pool, seq, k, v)
        pages = app.pages[app.indices.long()]
        app.pages[app.indices.long()] = 0
        app.run()
        ok = torch.equal(app.pages[app.indices.long()], pages)
        bench.add(
            case,
            "FlashInfer append_paged_kv_cache",
            moved,
            app.run,
            check="pages equal kvrs's" if ok else "DIFFERS",
        )
    except Exception as e:
        print(f"FlashInfer append failed: {type(e).__name__}: {e}", file=sys.stderr)


def cow(bench: Bench, forks: int = 256, layers: int = 32) -> None:
    """Copy-on-write: `forks` parents, each with a partial last block (9 tokens), forked once;
    start_forward gives every fork its own copy of a different parent block in each layer."""
    torch = bench.torch
    pool = kvrs.BlockPool(
        layers, HEADS, DIM, block_size=BS, num_blocks=2 * forks + 16, device="cuda", prefix_caching=False
    )
    parents = [pool.new_sequence() for _ in range(forks)]
    slots = pool.reserve(parents, [9] * forks)
    x = torch.randn(forks * 9, HEADS, DIM, device="cuda", dtype=torch.float16)
    for layer in range(layers):
        pool.write(layer, x, x, slots)
    for p in parents:
        p.advance(9)
    state: dict[str, Any] = {"forks": [], "fwd": None}

    def setup() -> None:
        """Drops the last step's batch and forks (host work only), forks the parents again."""
        if state["fwd"] is not None:
            state["fwd"].cancel()
        for f in state["forks"]:
            f.free()
        state["forks"], state["fwd"] = [p.fork() for p in parents], None

    def step() -> None:
        state["fwd"] = pool.start_forward(state["forks"])

    bench.add(
        f"copy-on-write {forks} forks x {layers} layers",
        "kvrs start_forward",
        2 * forks * pool.bytes_per_block,
        step,
        setup=setup,
    )


def decode_write(bench: Bench, nseq: int = 256, layers: int = 32) -> None:
    """The K/V of one decode token of each of `nseq` sequences into every layer: 32 calls of
    pool.write, and pool.write_layers in one call where kvrs has it."""
    torch = bench.torch
    pool = kvrs.BlockPool(
        layers, HEADS, DIM, block_size=BS, num_blocks=nseq + 16, device="cuda", prefix_caching=False
    )
    seqs = [pool.new_sequence() for _ in range(nseq)]
    slots = pool.reserve(seqs, [1] * nseq)
    ka, va = (torch.randn(layers, nseq, HEADS, DIM, device="cuda", dtype=torch.float16) for _ in range(2))
    moved = 2 * kv_bytes("float16", nseq, layers)
    bind = getattr(pool, "set_stream", False)
    idx = torch.as_tensor(slots, device="cuda")

    def written() -> bool:
        """Every layer's pages hold the layer's K and V at the slots."""
        for layer in range(layers):
            pages = flashinfer_peer.kv_cache_tensor(torch, pool, layer)[idx // BS, :, idx % BS]
            if not (torch.equal(pages[:, 0], ka[layer]) and torch.equal(pages[:, 1], va[layer])):
                return False
        return True

    def per_layer() -> None:
        for layer in range(layers):
            pool.write(layer, ka[layer], va[layer], slots)

    per_layer()
    case = f"decode write {nseq} x {layers} layers"
    bench.add(
        case,
        f"kvrs pool.write x{layers}",
        moved,
        per_layer,
        check="written" if written() else "DIFFERS",
        graph_bind=bind,
    )
    if hasattr(pool, "write_layers"):
        for layer in range(layers):
            flashinfer_peer.kv_cache_tensor(torch, pool, layer).zero_()
        pool.write_layers(ka, va, slots)
        ok = written()
        bench.add(
            case,
            "kvrs pool.write_layers",
            moved,
            lambda: pool.write_layers(ka, va, slots),
            check="written" if ok else "DIFFERS",
            graph_bind=bind,
        )
    else:
        print(f"{case}: this kvrs has no BlockPool.write_layers", file=sys.stderr)


def swap(bench: Bench) -> None:
    """A 4k-token prefix of 32 layers (512 MiB) loaded from a HostTier into a CUDA pool,
    against torch's pinned host-to-device copy of the same bytes."""
    torch = bench.torch
    layers, n = 32, 4096
    host = kvrs.HostTier("2GiB")
    kw: dict[str, Any] = dict(
        block_size=BS, num_blocks=n // BS + 16, device="cuda", seed=3, tiers=[host], model_id="bench"
    )
    src = kvrs.BlockPool(layers, HEADS, DIM, **kw)
    prompt = list(range(n + 1))
    s = src.new_sequence(tokens=prompt)
    x = torch.randn(n + 1, HEADS, DIM, device="cuda", dtype=torch.float16)
    for layer in range(layers):
        s.append(layer, x, x)
    s.advance(n + 1)
    s.free()
    src.evict_all()
    src.flush_tiers()
    dst = kvrs.BlockPool(layers, HEADS, DIM, **kw)
    nbytes = kv_bytes("float16", n, layers)

    held: list[Any] = []

    def drop() -> None:
        """Frees the last load's sequence and evicts its blocks (untimed)."""
        for seq in held:
            assert seq.cached_tokens_by_tier["host"] == n
            seq.free()
        held.clear()
        dst.evict_all()
        dst.flush_tiers()

    case = f"swap-in {n // 1024}k x {layers} layers"
    bench.add(case, "kvrs HostTier", nbytes, lambda: held.append(dst.new_sequence(tokens=prompt)), setup=drop)
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    bench.add(case, "torch pinned H2D copy", nbytes, lambda: pinned.to("cuda", non_blocking=True))
