"""FlashInfer beside kvrs: its paged decode, prefill, MLA and append kernels over kvrs's pages.

benches/bench_gpu.py runs FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` (NHD, float16
and fp8 E4M3 storage, float16 queries) and `append_paged_kv_cache` on the tensor of
`pool.kv_cache(layer)` with the page table of `pool.page_table(seqs)`, so both libraries
read the same bytes through the same table; `BatchPrefillWithPagedKVCacheWrapper` (float16,
causal, its backend's choice: FA3 on sm_90) for the extend and prefill rows, and
`BatchMLAPagedAttentionWrapper` (bfloat16, 512 + 64) over a latent pool's ckv and kpe views
(`pool.kv_cache_parts`) for the MLA rows. The decode and append modules ("decode" group)
and the prefill and MLA ones ("prefill" group) build in separate children, so a slow
prefill build drops only the rows that need it.

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


GROUPS = ("decode", "prefill")


def prefill_backend(torch: Any) -> str:
    """The prefill and MLA backend FlashInfer's "auto" picks here: FA3 on sm_90, else FA2."""
    try:
        return "fa3" if torch.cuda.get_device_capability()[0] == 9 else "fa2"
    except Exception:  # no device: building the sm_90a modules
        return "fa3"


def _specs(torch: Any, group: str = "decode") -> list[Any]:
    """The JIT specs of the modules the benchmark loads. "decode": append, and decode per
    dtype pair; "prefill": paged prefill (float16, head_dim 128) and MLA (bfloat16, 512 + 64)."""
    from flashinfer.jit.attention.modules import (
        gen_batch_decode_module,
        gen_batch_mla_module,
        gen_batch_prefill_module,
    )
    from flashinfer.jit.page import gen_page_module

    if group == "prefill":
        be, f16, bf16 = prefill_backend(torch), torch.float16, torch.bfloat16
        return [
            gen_batch_prefill_module(
                be, f16, f16, f16, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False, False
            ),
            gen_batch_mla_module(be, bf16, bf16, bf16, torch.int32, 512, 64, False),
        ]
    specs = [gen_page_module()]
    for q, kv in DECODE_DTYPES:
        dq, dkv = getattr(torch, q), getattr(torch, kv)
        specs.append(gen_batch_decode_module(dq, dkv, dq, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False))
    return specs


def build(pack: str | None, group: str = "decode") -> dict[str, Any]:
    """Builds (or finds precompiled) every module of `group`; with `pack`, writes their
    libraries to a .tar.gz laid out as flashinfer/data/aot. Returns seconds per module."""
    _env_defaults()
    import flashinfer
    import torch

    out: dict[str, Any] = {"version": flashinfer.__version__, "modules": {}}
    specs = _specs(torch, group)
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


def load(timeout_s: float, group: str = "decode") -> Peer:
    """Imports FlashInfer and builds the modules of `group` in a child process limited to
    `timeout_s`. Peer.fi is None when either fails; Peer.info says why, or how long each
    module took."""
    _env_defaults()
    try:
        import flashinfer
    except Exception as e:  # any import failure only drops the FlashInfer rows
        return Peer(None, {"error": f"import flashinfer: {type(e).__name__}: {e}"})
    t0 = time.perf_counter()
    try:
        child = subprocess.run(
            [sys.executable, __file__, "--build", "--group", group],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return Peer(None, {"error": f"building FlashInfer's {group} modules took over {timeout_s:.0f} s"})
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


class Prefill:
    """FlashInfer's causal batch prefill over a kvrs pool's layer: `new` query tokens at the
    end of each sequence (tokens of a sequence consecutive in q), on kvrs's page table."""

    def __init__(
        self, peer: Peer, torch: Any, pool: Any, layer: int, seqs: list[Any], new: list[int], q: Any
    ) -> None:
        self.workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        self.wrapper = peer.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self.pages = kv_cache_tensor(torch, pool, layer)
        indptr, indices, last = (torch.from_numpy(a).cuda() for a in pool.page_table(seqs, layer))
        qo = torch.tensor([0, *new], dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
        self.q, self.out = q, torch.empty_like(q)
        t0 = time.perf_counter()
        self.wrapper.plan(
            qo, indptr, indices, last, q.shape[1], pool.num_kv_heads, pool.head_dim, pool.block_size,
            causal=True, q_data_type=q.dtype, kv_data_type=self.pages.dtype,
        )  # fmt: skip
        torch.cuda.synchronize()
        self.plan_us = (time.perf_counter() - t0) * 1e6

    def run(self) -> Any:
        return self.wrapper.run(self.q, self.pages, out=self.out)


class Mla:
    """FlashInfer's MLA attention (absorbed, decode) over a kvrs latent pool's ckv and kpe
    views, on kvrs's page table."""

    def __init__(
        self, peer: Peer, torch: Any, pool: Any, layer: int, seqs: list[Any], q: Any, scale: float
    ) -> None:
        self.workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        self.wrapper = peer.fi.mla.BatchMLAPagedAttentionWrapper(self.workspace)
        ckv, kpe = (torch.from_dlpack(x) for x in pool.kv_cache_parts(layer))
        self.ckv, self.kpe = ckv.squeeze(2), kpe.squeeze(2)  # [pages, page_size, 1, d] -> [.., d]
        indptr, indices, _ = (torch.from_numpy(a).cuda() for a in pool.page_table(seqs, layer))
        lens = torch.tensor([s.seq_len for s in seqs], dtype=torch.int32).cuda()
        qo = torch.arange(len(seqs) + 1, dtype=torch.int32).cuda()
        self.q_nope, self.q_pe = q[..., :512].contiguous(), q[..., 512:].contiguous()
        self.out = torch.empty_like(self.q_nope)
        t0 = time.perf_counter()
        self.wrapper.plan(
            qo, indptr, indices, lens, q.shape[1], 512, 64, pool.block_size, False, scale, q.dtype, ckv.dtype
        )  # fmt: skip
        torch.cuda.synchronize()
        self.plan_us = (time.perf_counter() - t0) * 1e6

    def run(self) -> Any:
        return self.wrapper.run(self.q_nope, self.q_pe, self.ckv, self.kpe, out=self.out)


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
    args = sys.argv[1:]
    if args[:1] == ["--build"]:
        opts = dict(zip(args[1::2], args[2::2], strict=False))
        group = opts.get("--group", "decode")
        if group not in GROUPS:
            print(f"--group must be one of {GROUPS}", file=sys.stderr)
            sys.exit(2)
        print(json.dumps(build(opts.get("--pack"), group)))
    else:
        print(f"usage: {sys.argv[0]} --build [--group decode|prefill] [--pack FILE.tar.gz]", file=sys.stderr)
        sys.exit(2)
