"""The table of benches/bench_gpu.py: rows measured with benches/gpu_timing.py, their bytes,
GB/s, share of the copy ceiling and ratios to SDPA and FlashInfer, printed and saved as JSON."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flashinfer_peer
from gpu_timing import Timer, copy_ceiling

import kvrs

HEADS, QHEADS, DIM, BS = 8, 32, 128, 16
STORAGE = {"float16": 2, "fp8_e4m3": 1, "int8": 1}


def kv_bytes(dtype: str, tokens: int, layers: int = 1) -> int:
    """Bytes of K and V for `tokens` positions in a pool of `dtype` (int8: + f32 scales)."""
    per = HEADS * DIM * STORAGE[dtype] + (HEADS * 4 if dtype == "int8" else 0)
    return 2 * tokens * layers * per


class Bench:
    """Measures rows, keeps them, prints each as it comes and writes the JSON after each.

    With `ncu`, no row is timed: each kvrs call runs once between cudaProfilerStart and
    cudaProfilerStop, in an NVTX range named after its row, for `ncu --profile-from-start
    off` to profile those kernels alone (setup launches and peers stay outside)."""

    def __init__(
        self, torch: Any, json_path: str | None, peer: flashinfer_peer.Peer, ncu: bool = False
    ) -> None:
        self.torch = torch
        self.ncu = ncu
        self.timer = Timer(torch)
        self.json_path = json_path
        self.peer = peer
        # FlashInfer with its prefill and MLA modules (bench_gpu.py loads it apart).
        self.prefill_peer: flashinfer_peer.Peer | None = None
        self.rows: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "kvrs": getattr(kvrs, "__version__", "?"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "flashinfer": peer.info,
        }
        self.ceiling = 0.0
        if not ncu:
            us, self.ceiling = copy_ceiling(torch, self.timer)
            self.meta["copy_ceiling_gbps"] = round(self.ceiling, 1)
            print(HEADER, flush=True)
            self.add("device copy 1 GiB", "torch copy_", 2 << 30, None, stream_us=us)

    def add(
        self,
        case: str,
        impl: str,
        nbytes: int,
        fn: Callable[[], object] | None,
        *,
        setup: Callable[[], object] | None = None,
        storage: str = "float16",
        check: str = "",
        graph_bind: Any = None,
        flops: float | None = None,
        **times: float | None,
    ) -> dict[str, Any] | None:
        """Times `fn` (or takes the given times), records and prints the row. `setup` runs
        before each call, untimed (no back-to-back time then). `graph_bind` asks for a CUDA
        graph replay too: True for torch's own calls, a pool's set_stream for kvrs's, False
        where the pool has none (the row says it cannot be captured). `flops`: the
        call's floating-point operations (compute-bound rows: TFLOP/s beside GB/s)."""
        if self.ncu:
            self._profile_once(f"{case} | {impl} [{storage}]", fn, setup)
            return None
        t, k = self.timer, None
        if fn is not None:
            times.setdefault("call_us", t.call(fn, setup=setup))
            if setup is None:
                times.setdefault("stream_us", t.stream(fn))
            k = t.kernels(fn, setup=setup)
            times.setdefault("kernel_us", k.device_us if k else None)
            if k:
                times.update(launches=k.launches, transfers=k.transfers)
        row: dict[str, Any] = {"case": case, "impl": impl, "storage": storage, "bytes": nbytes}
        row.update({key: v for key, v in times.items() if v is not None})
        dev = row.get("kernel_us") or row.get("stream_us")
        if dev:
            row["gbps"] = nbytes / dev / 1e3
            row["pct_copy"] = 100 * row["gbps"] / self.ceiling
            if flops:
                row["tflops"] = flops / dev / 1e6
        if check:
            row["check"] = check
        if k is not None:
            row["kernels"] = {n: round(v, 2) for n, v in k.names.items()}
        if graph_bind is not None and fn is not None:
            self._graph(row, fn, graph_bind)
        self.rows.append(row)
        print(line(row), flush=True)
        self.save()
        return row

    def _profile_once(
        self, name: str, fn: Callable[[], object] | None, setup: Callable[[], object] | None
    ) -> None:
        """One call of a kvrs row inside the profiled span (ncu mode); peers are skipped."""
        if fn is None or not name.split(" | ")[1].startswith("kvrs"):
            return
        cuda = self.torch.cuda
        if setup:
            setup()
        cuda.synchronize()
        cuda.profiler.start()
        cuda.nvtx.range_push(name)
        fn()
        cuda.synchronize()
        cuda.nvtx.range_pop()
        cuda.profiler.stop()
        print(f"profiled: {name}", flush=True)

    def save(self) -> None:
        """Writes every row so far (a run cut short keeps what it measured)."""
        if self.json_path:
            Path(self.json_path).write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1))

    def _graph(self, row: dict[str, Any], fn: Callable[[], object], bind: Any) -> None:
        """Adds the row's CUDA-graph replay time, or why the call could not be captured."""
        if bind is False:
            row["graph"] = "not capturable: BlockPool has no set_stream"
            return
        try:
            row["graph_us"] = self.timer.graph(fn, None if bind is True else bind)
        except Exception as e:  # report why, keep the row
            row["graph"] = f"capture failed: {type(e).__name__}: {str(e)[:160]}"
            self.torch.cuda.synchronize()


def line(row: dict[str, Any]) -> str:
    """One row of the table."""

    def f(key: str, fmt: str = "{:9.1f}") -> str:
        v = row.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else f"{'-':>{len(fmt.format(0.0))}}"

    impl = row["impl"] if row["storage"] == "float16" else f"{row['impl']} [{row['storage']}]"
    return (
        f"{row['case']:36s} {impl:32s} {f('call_us')} {f('stream_us')} {f('kernel_us')} "
        f"{f('launches', '{:6.1f}')} {f('graph_us')} {f('gbps', '{:7.0f}')} {f('pct_copy', '{:5.0f}')} "
        f"{f('x_sdpa', '{:6.2f}')} {f('x_flashinfer', '{:6.2f}')}  "
        + (f"{row['tflops']:.0f} TFLOP/s " if "tflops" in row else "")
        + f"{row.get('check', '')} {row.get('graph', '')}"
    )


HEADER = (
    f"{'case':36s} {'impl':32s} {'call us':>9} {'stream us':>9} {'kernel us':>9} {'launch':>6} "
    f"{'graph us':>9} {'GB/s':>7} {'%copy':>5} {'xSDPA':>6} {'xFI':>6}  check"
)


def ratios(rows: list[dict[str, Any]]) -> None:
    """kvrs's device time over SDPA's (float16, enable_gqa) and FlashInfer's (same storage)."""

    def dev(r: dict[str, Any]) -> float | None:
        return r.get("kernel_us") or r.get("stream_us")

    for r in rows:
        if not r["impl"].startswith("kvrs") or not dev(r):
            continue
        for key, prefix, same_storage in (
            ("x_sdpa", "SDPA enable_gqa", False),
            ("x_flashinfer", "FlashInfer", True),
        ):
            peers = [
                p
                for p in rows
                if p["case"] == r["case"]
                and p["impl"].startswith(prefix)
                and (not same_storage or p["storage"] == r["storage"])
                and dev(p)
            ]
            if peers:
                r[key] = dev(r) / dev(peers[0])


def max_diff(torch: Any, a: Any, b: Any) -> float:
    """Largest absolute difference, in float32."""
    return float((torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs().max())
