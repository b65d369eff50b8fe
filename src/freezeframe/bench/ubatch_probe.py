"""The model and measurements of the ``ubatch`` probe (:func:`gpu_probes.probe_ubatch`).

A toy step, matmul compute, then a spin kernel standing in for an all-to-all, then compute
again, runs through :class:`MicroBatchWrapper` so that each micro-batch's communication can
overlap the other's compute. What the probe times is the *captured* split step: the threaded
step captured whole as one FULL graph (the wrapper's graph backend), then replayed with no host
in the loop. The eager threaded step is timed beside it for reference only: its Python
hand-offs are slower than a short step (the H100 run of 2026-11-26 measured 3.99 ms split
against 1.73 ms unsplit, one of two overlaps missing).

On a CPU the same code runs on the emulated backend, without the spin kernel (a copy stands in
for the communication): that checks the probe, not overlap. This module imports torch at the
top, so :mod:`gpu_probes` (whose ``environment`` probe must run without torch) imports it only
inside the probe.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import forward_context
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan, plan_micro_batches
from freezeframe.stats import Stats

__all__ = ["MicroBatchedToy", "ToyModel", "kernel_timeline", "median_ms", "spin_cycles_per_ms"]


def spin_cycles_per_ms() -> float:
    """How many cycles of the spin kernel (``torch.cuda._sleep``) take a millisecond here."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def median_ms(fn: Callable[[], Any], n: int, cuda: bool) -> float:
    """Median time of ``n`` calls of ``fn`` after one untimed call (CUDA events on a GPU, the
    wall clock on a CPU)."""
    fn()
    times = []
    for _ in range(n):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


class ToyModel(nn.Module):
    """Compute, a simulated all-to-all, compute. ``comm_cycles`` of the spin kernel make the
    communication last (on CUDA; 0 on a CPU, where a copy alone stands in)."""

    def __init__(self, hidden: int, gen: torch.Generator, device: torch.device) -> None:
        super().__init__()
        dtype = torch.float16 if device.type == "cuda" else torch.float32

        def weight() -> nn.Parameter:
            w = torch.randn(hidden, hidden, generator=gen) / hidden**0.5
            return nn.Parameter(w.to(device, dtype), requires_grad=False)

        self.w1, self.w2 = weight(), weight()
        self.comm_cycles = 0

    def _comm(self, h: torch.Tensor) -> torch.Tensor:
        if self.comm_cycles:
            torch.cuda._sleep(self.comm_cycles)  # the latency of a simulated all-to-all
        received = torch.empty_like(h)
        received.copy_(h)
        return received

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ self.w1) @ self.w2
        ff.ubatch.yield_to_comm()
        h = self._comm(h)
        ff.ubatch.yield_to_compute()
        return torch.relu(h @ self.w1) @ self.w2


def _backend(device: torch.device) -> Any:
    if device.type == "cuda":
        from freezeframe.graphs.cuda import CudaBackend

        return CudaBackend()
    from freezeframe.graphs.emulated import EmulatedBackend

    return EmulatedBackend()


@dataclasses.dataclass
class MicroBatchedToy:
    """The toy model, its micro-batching wrapper (with a graph backend, so a FULL split step
    is captured), a uniform decode step of ``tokens`` tokens and the plan that splits it."""

    model: ToyModel
    wrapper: MicroBatchWrapper
    plan: MicroBatchPlan
    x: torch.Tensor
    tokens: int

    @classmethod
    def build(cls, tokens: int, hidden: int, gen: torch.Generator,
              device: torch.device) -> MicroBatchedToy | None:
        """None when the planner does not split the step."""
        model = ToyModel(hidden, gen, device)
        wrapper = MicroBatchWrapper(model, backend=_backend(device), stats=Stats(),
                                    timeout_s=120)
        cfg = CompilationConfig(micro_batching=True, micro_batch_decode_threshold=2,
                                micro_batch_prefill_threshold=2)
        plan = plan_micro_batches(cfg, [1] * tokens, tokens, tokens, uniform_decode=True,
                                  sync=False)
        if plan is None:
            return None
        x = torch.randn(tokens, hidden, generator=gen).to(device, model.w1.dtype)
        return cls(model, wrapper, plan, x, tokens)

    @property
    def cuda(self) -> bool:
        return self.x.device.type == "cuda"

    def split(self, mode: CUDAGraphMode = CUDAGraphMode.NONE) -> torch.Tensor:
        """One split step: eager threads (NONE), or the captured graph (FULL: the first such
        step captures it, later ones replay it)."""
        with torch.inference_mode(), forward_context(
                BatchDescriptor(num_tokens=self.tokens), mode=mode, micro_batches=self.plan):
            return self.wrapper(self.x)  # type: ignore[no-any-return]

    def replay(self) -> torch.Tensor:
        return self.split(CUDAGraphMode.FULL)

    def unsplit(self) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(self.x)  # type: ignore[no-any-return]

    def match_comm_to_compute(self, cycles_per_ms: float) -> float:
        """Make the communication take about as long as half a micro-batch's compute phase;
        returns that target in ms."""
        model, half = self.model, self.tokens // 2
        compute_ms = median_ms(lambda: torch.relu(self.x[:half] @ model.w1) @ model.w2, 5,
                               True)
        model.comm_cycles = max(1, int(cycles_per_ms * compute_ms / 2))
        return compute_ms / 2

    def capture(self) -> float:
        """Warm up eagerly (handles, allocator blocks), then capture the split step; seconds."""
        self.split()
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.replay()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def check_replay(self, gen: torch.Generator) -> float:
        """Fresh inputs through the captured graph against the unsplit model: the largest
        absolute difference over the largest unsplit output (fp16 rounding on a GPU)."""
        self.x.copy_(torch.randn(self.x.shape, generator=gen).to(self.x))
        got = self.replay().float().clone()
        want = self.unsplit().float()
        return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-12)

    def profile_replays(self, trace_path: Path, replays: int = 2) -> None:
        """A ``torch.profiler`` Chrome trace of ``replays`` replays of the split graph."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(replays):
                self.replay()
            if self.cuda:
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace_path))


def kernel_timeline(trace: dict[str, Any]) -> dict[str, Any]:
    """The device kernels of a Chrome trace in time order (ms from the first; the spin kernels
    are the simulated communication), and for each spin kernel whether a compute kernel ran
    at the same time: the overlap a captured split step must show, read from the replay."""
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", "")))
                     for e in trace.get("traceEvents", [])
                     if e.get("cat") == "kernel" and "dur" in e)
    if not kernels:
        return {"kernels": [], "comm_overlaps": []}
    origin = kernels[0][0]
    comm = [k for k in kernels if "spin" in k[2] or "sleep" in k[2]]
    compute = [k for k in kernels if k not in comm]
    overlaps = [any(c0 < e and s < c1 for c0, c1, _ in compute) for s, e, _ in comm]
    return {"kernels": [[round((s - origin) / 1e3, 4), round((e - origin) / 1e3, 4), n[:60]]
                        for s, e, n in kernels[:200]],
            "comm_overlaps": overlaps}
