"""How benches/bench_gpu.py times device work: four views of one call, an L2 flush, the copy ceiling.

- `call`: CUDA events around one call, the L2 cache flushed before it. Events are recorded
  on torch's (legacy default) stream, which kvrs's stream orders with, so the host work of
  the call (argument checks, uploads, launches) counts whenever the device waits for it.
- `stream`: events around many back-to-back calls, divided by their number: what a
  serving loop sees; no flush between calls.
- `kernels`: the device time of the kernels one call launches, from CUPTI through
  `torch.profiler` (kvrs's kernels included: CUPTI sees every launch of the process), the
  L2 cache flushed before each call; also the kernel launches and host transfers per call.
- `graph`: the call captured once in a CUDA graph and replayed back to back, where the
  library lets the call be captured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The flush kernel's name marks it in profiles: no timed call launches a bitwise-not.
_FLUSH_KERNEL = "bitwise_not"
L2_FLUSH_BYTES = 256 << 20


@dataclass
class Kernels:
    """Device time and launches per call, from a CUPTI trace."""

    device_us: float
    launches: float
    transfers: float
    names: dict[str, float] = field(default_factory=dict)


class Timer:
    """Times calls on the current CUDA device (see the module's doc for the four views)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        # Written between timed calls, so that no call finds its inputs in the 50 MB L2.
        self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def flush(self) -> None:
        """Evicts the L2 cache by rewriting a buffer five times its size."""
        self._flush.bitwise_not_()

    def _events(self) -> tuple[Any, Any]:
        cuda = self.torch.cuda
        return cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)

    def call(
        self, fn: Callable[[], object], reps: int = 10, setup: Callable[[], object] | None = None
    ) -> float:
        """Median microseconds of one call (host work included), L2 flushed before each;
        `setup` runs before each call, outside the timed span."""
        if setup:
            setup()
        fn()
        times = []
        for _ in range(reps):
            if setup:
                setup()
            self.flush()
            self.torch.cuda.synchronize()
            a, b = self._events()
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return sorted(times)[len(times) // 2]

    def stream(self, fn: Callable[[], object], n: int = 20, reps: int = 3) -> float:
        """Microseconds per call over `n` back-to-back calls (best of `reps` runs)."""
        fn()
        best = float("inf")
        for _ in range(reps):
            self.torch.cuda.synchronize()
            a, b = self._events()
            a.record()
            for _ in range(n):
                fn()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) * 1e3 / n)
        return best

    def kernels(
        self, fn: Callable[[], object], reps: int = 5, setup: Callable[[], object] | None = None
    ) -> Kernels | None:
        """The kernels' device time per call from a CUPTI trace, or None when the profiler
        records no kernel (no CUPTI). `setup` runs before each call and must launch nothing."""
        torch = self.torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        if setup:
            setup()
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                if setup:
                    setup()
                self.flush()
                fn()
            torch.cuda.synchronize()
        names: dict[str, float] = {}
        launches = transfers = 0
        for e in prof.profiler.kineto_results.events():
            if e.device_type() != DeviceType.CUDA:
                continue
            name = e.name()
            if _FLUSH_KERNEL in name:
                continue
            if name.startswith(("Memcpy", "Memset")):
                transfers += 1
                continue
            launches += 1
            names[name] = names.get(name, 0.0) + e.duration_ns() / 1e3 / reps
        if not launches:
            return None
        return Kernels(sum(names.values()), launches / reps, transfers / reps, names)

    def graph(
        self,
        fn: Callable[[], object],
        bind: Callable[[int | None], None] | None = None,
        n: int = 20,
    ) -> float:
        """Microseconds per replay of `fn` captured in a CUDA graph. `bind(handle)` points the
        library's launches at the capturing stream (`bind(None)` restores its own). Raises
        whatever the capture raises when the call cannot be captured."""
        torch = self.torch
        side = torch.cuda.Stream()
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=side):
                if bind is not None:
                    bind(side.cuda_stream)
                fn()
        finally:
            if bind is not None:
                bind(None)
        return self.stream(graph.replay, n)


def copy_ceiling(torch: Any, timer: Timer, nbytes: int = 1 << 30) -> tuple[float, float]:
    """The device-to-device copy of `nbytes` (torch `copy_`, one cudaMemcpyAsync): returns
    (microseconds, GB/s counting the bytes read and the bytes written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    us = timer.stream(lambda: dst.copy_(src), n=10)
    return us, 2 * nbytes / us / 1e3
