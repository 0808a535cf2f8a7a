"""FlashInfer beside kvrs: its paged decode and append kernels over kvrs's own pages.

benches/bench_gpu.py runs FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` (NHD, float16
and fp8 E4M3 storage, float16 queries) and `append_paged_kv_cache` on the tensor of
`pool.kv_cache(layer)` with the page table of `pool.page_table(seqs)`, so both libraries
read the same bytes through the same table.

FlashInfer's wheels on PyPI ship no compiled kernel: each module is built with nvcc and
ninja on first use (JIT), or loaded from `flashinfer/data/aot/<name>/<name>.so` when that
file exists. `benches/gpu_wheels.sh` builds the three modules here with the pinned nvcc
(`python benches/flashinfer_peer.py --build --pack FILE`) and packs them, so a GPU machine
without a toolkit needs no compiler. Building runs in a child process under a time limit
(`--build` is that child), so a slow or failing build costs its limit and no more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEAD_DIM = 128
# (query dtype, KV storage dtype) of the decode modules the benchmark runs.
DECODE_DTYPES = (("float16", "float16"), ("float16", "float8_e4m3fn"))


def _env_defaults() -> None:
    """A JIT cache under /tmp, sm_90a when no device answers, and the ninja the `ninja`
    wheel installs beside flashinfer on PATH."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/flashinfer-ws")
    try:
        import ninja

        bin_dir = Path(ninja.__file__).resolve().parent.parent / "bin"
        if (bin_dir / "ninja").exists():
            os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass


def _specs(torch: Any) -> list[Any]:
    """The JIT specs of the modules the benchmark loads: append, and decode per dtype pair."""
    from flashinfer.jit.attention.modules import gen_batch_decode_module
    from flashinfer.jit.page import gen_page_module

    specs = [gen_page_module()]
    for q, kv in DECODE_DTYPES:
        dq, dkv = getattr(torch, q), getattr(torch, kv)
        specs.append(gen_batch_decode_module(dq, dkv, dq, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False))
    return specs


def build(pack: str | None) -> dict[str, Any]:
    """Builds (or finds precompiled) every module; with `pack`, writes their libraries to a
    .tar.gz laid out as flashinfer/data/aot. Returns seconds per module."""
    _env_defaults()
    import flashinfer
    import torch

    out: dict[str, Any] = {"version": flashinfer.__version__, "modules": {}}
    specs = _specs(torch)
    for spec in specs:
        t0 = time.perf_counter()
        how = "aot" if spec.is_aot else "jit"
        if not spec.is_aot:
            spec.build(verbose=False)
        out["modules"][spec.name] = {"how": how, "seconds": round(time.perf_counter() - t0, 1)}
    if pack:
        with tarfile.open(pack, "w:gz") as tar:
            for spec in specs:
                tar.add(spec.get_library_path(), arcname=f"{spec.name}/{spec.name}.so")
    return out


@dataclass
class Peer:
    """FlashInfer, imported and with its modules built, or the reason it is not."""

    fi: Any
    info: dict[str, Any]


def load(timeout_s: float) -> Peer:
    """Imports FlashInfer and builds its modules in a child process limited to `timeout_s`.
    Peer.fi is None when either fails; Peer.info says why, or how long each module took."""
    _env_defaults()
    try:
        import flashinfer
    except Exception as e:  # any import failure only drops the FlashInfer rows
        return Peer(None, {"error": f"import flashinfer: {type(e).__name__}: {e}"})
    t0 = time.perf_counter()
    try:
        child = subprocess.run(
            [sys.executable, __file__, "--build"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return Peer(None, {"error": f"building FlashInfer's modules took over {timeout_s:.0f} s"})
    if child.returncode != 0:
        tail = (child.stdout + child.stderr).strip().splitlines()[-15:]
        return Peer(None, {"error": "building FlashInfer's modules failed:\n" + "\n".join(tail)})
    info = json.loads(child.stdout.strip().splitlines()[-1])
    info["build_seconds"] = round(time.perf_counter() - t0, 1)
    return Peer(flashinfer, info)


class Decode:
    """FlashInfer's batch decode over a kvrs pool's layer, planned on kvrs's page table."""

    def __init__(self, peer: Peer, torch: Any, pool: Any, layer: int, seqs: list[Any], q: Any) -> None:
        fi = peer.fi
        self.torch = torch
        self.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self.pages = kv_cache_tensor(torch, pool, layer)
        indptr, indices, last = (torch.from_numpy(a) for a in pool.page_table(seqs, layer))
        self.q = q
        self.out = torch.empty_like(q)
        t0 = time.perf_counter()
        self.wrapper.plan(
            indptr,
            indices,
            last,
            q.shape[1],
            pool.num_kv_heads,
            pool.head_dim,
            pool.block_size,
            q_data_type=q.dtype,
            kv_data_type=self.pages.dtype,
        )
        torch.cuda.synchronize()
        self.plan_us = (time.perf_counter() - t0) * 1e6

    def run(self) -> Any:
        """One decode over the planned table into the reused output."""
        return self.wrapper.run(self.q, self.pages, out=self.out)


def kv_cache_tensor(torch: Any, pool: Any, layer: int) -> Any:
    """The pool's layer tensor [num_blocks, 2, block_size, heads, head_dim] as torch, no copy."""
    return torch.from_dlpack(pool.kv_cache(layer))


class Append:
    """FlashInfer's append of n tokens of K/V to one sequence's pages of a kvrs pool."""

    def __init__(self, peer: Peer, torch: Any, pool: Any, seq: Any, k: Any, v: Any) -> None:
        self.fi = peer.fi
        self.k, self.v = k, v
        self.pages = kv_cache_tensor(torch, pool, 0)
        indptr, indices, last = (torch.from_numpy(a).cuda() for a in pool.page_table([seq], 0))
        self.indptr, self.indices, self.last = indptr, indices, last
        n = k.shape[0]
        self.batch = torch.zeros(n, dtype=torch.int32, device="cuda")
        self.positions = torch.arange(n, dtype=torch.int32, device="cuda")

    def run(self) -> None:
        """Writes every token at its position of the sequence (batch_indices all 0)."""
        self.fi.append_paged_kv_cache(
            self.k,
            self.v,
            self.batch,
            self.positions,
            self.pages,
            self.indices,
            self.indptr,
            self.last,
            kv_layout="NHD",
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build"]:
        pack = sys.argv[3] if sys.argv[2:3] == ["--pack"] else None
        print(json.dumps(build(pack)))
    else:
        print(f"usage: {sys.argv[0]} --build [--pack FILE.tar.gz]", file=sys.stderr)
        sys.exit(2)
