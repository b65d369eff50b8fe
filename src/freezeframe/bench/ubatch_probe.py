"""The model and measurements of the ``ubatch`` GPU probe (:func:`gpu_probes.probe_ubatch`).

A toy step, matmul compute then a spin kernel standing in for an all-to-all then compute
again, runs through :class:`MicroBatchWrapper` so that each micro-batch's communication can
overlap the other's compute. This module imports torch at the top, so :mod:`gpu_probes` (whose
``environment`` probe must run without torch) imports it only inside the probe.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import forward_context, get_forward_context
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan, plan_micro_batches

__all__ = ["EventTimeline", "MicroBatchedToy", "OutputCheck", "ToyModel", "median_ms",
           "spin_cycles_per_ms"]

# the phases that must overlap: each micro-batch's communication with the other's compute
MUST_OVERLAP = (("ubatch0:comm", "ubatch1:compute1"), ("ubatch1:comm", "ubatch0:compute2"))


def spin_cycles_per_ms() -> float:
    """How many cycles of the spin kernel (``torch.cuda._sleep``) take a millisecond here."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def median_ms(fn: Callable[[], torch.Tensor], n: int) -> float:
    """Median CUDA-event time of ``n`` calls of ``fn``, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _weight(hidden: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(hidden, hidden, generator=gen) / hidden**0.5).cuda().half()


class ToyModel(nn.Module):
    """Compute, a simulated all-to-all, compute; ``events`` holds the CUDA events around each
    phase, keyed by micro-batch index (-1 outside micro-batching) and phase name."""

    def __init__(self, hidden: int, gen: torch.Generator) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(_weight(hidden, gen)), nn.Parameter(_weight(hidden, gen))
        self.comm_cycles = 0
        self.events: dict[tuple[int, str], tuple[torch.cuda.Event, torch.cuda.Event]] = {}

    def _phase(self, name: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        ctx = get_forward_context()
        index = -1 if ctx is None or ctx.micro_batch_index is None \
            else ctx.micro_batch_index
        begin = torch.cuda.Event(enable_timing=True)
        finish = torch.cuda.Event(enable_timing=True)
        begin.record()
        out = fn()
        finish.record()
        self.events[(index, name)] = (begin, finish)
        return out

    def _comm(self, h: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.comm_cycles)  # the latency of a simulated all-to-all
        received = torch.empty_like(h)
        received.copy_(h)
        return received

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._phase("compute1", lambda: torch.relu(x @ self.w1) @ self.w2)
        ff.ubatch.yield_to_comm()
        h = self._phase("comm", lambda: self._comm(h))
        ff.ubatch.yield_to_compute()
        return self._phase("compute2", lambda: torch.relu(h @ self.w1) @ self.w2)


@dataclasses.dataclass(frozen=True)
class OutputCheck:
    """The micro-batched output against the unsplit model's."""

    max_abs_diff: float
    scale: float  # the largest unsplit output
    finite: bool

    def problems(self) -> list[str]:
        # each row goes through the same ops split or not, but a matmul over half the rows may
        # pick another kernel, so the comparison allows fp16 rounding and no more
        if not self.finite or self.max_abs_diff > 1e-2 * max(self.scale, 1.0):
            return [f"the micro-batched output differs from the unsplit model's: max abs diff "
                    f"{self.max_abs_diff:.3g} with outputs up to {self.scale:.3g}"]
        return []


@dataclasses.dataclass(frozen=True)
class EventTimeline:
    """Start and end (ms) of each ``ubatch<index>:<phase>`` of one split step."""

    phases_ms: dict[str, tuple[float, float]]

    def overlaps(self) -> dict[str, bool]:
        return {f"{a} with {b}": self._overlap(a, b) for a, b in MUST_OVERLAP}

    def problems(self) -> list[str]:
        return [f"no overlap of {name} (CUDA event timeline)"
                for name, seen in self.overlaps().items() if not seen]

    def _overlap(self, a: str, b: str) -> bool:
        t = self.phases_ms
        return a in t and b in t and t[a][0] < t[b][1] and t[b][0] < t[a][1]


@dataclasses.dataclass(frozen=True)
class MicroBatchedToy:
    """The toy model, its micro-batching wrapper, and a uniform decode step of ``tokens``
    tokens with the plan that splits it."""

    model: ToyModel
    wrapper: MicroBatchWrapper
    plan: MicroBatchPlan
    x: torch.Tensor
    tokens: int

    @classmethod
    def build(cls, tokens: int, hidden: int, gen: torch.Generator) -> MicroBatchedToy | None:
        """None when the planner does not split the step."""
        model = ToyModel(hidden, gen)
        wrapper = MicroBatchWrapper(model, timeout_s=120)  # no graph backend: runs the threads
        cfg = CompilationConfig(micro_batching=True, micro_batch_decode_threshold=2,
                                micro_batch_prefill_threshold=2)
        plan = plan_micro_batches(cfg, [1] * tokens, tokens, tokens, uniform_decode=True,
                                  sync=False)
        if plan is None:
            return None
        x = torch.randn(tokens, hidden, generator=gen).cuda().half()
        return cls(model, wrapper, plan, x, tokens)

    def split(self) -> torch.Tensor:
        with torch.inference_mode(), forward_context(
                BatchDescriptor(num_tokens=self.tokens), mode=CUDAGraphMode.NONE,
                micro_batches=self.plan):
            return self.wrapper(self.x)  # type: ignore[no-any-return]

    def unsplit(self) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(self.x)  # type: ignore[no-any-return]

    def match_comm_to_compute(self, cycles_per_ms: float) -> float:
        """Make the communication take about as long as half a micro-batch's compute phase;
        returns that target in ms."""
        model, half = self.model, self.tokens // 2
        compute_ms = median_ms(lambda: torch.relu(self.x[:half] @ model.w1) @ model.w2, 5)
        model.comm_cycles = max(1, int(cycles_per_ms * compute_ms / 2))
        return compute_ms / 2

    def compare_with_unsplit(self) -> OutputCheck:
        expected = self.unsplit()
        got = self.split()
        torch.cuda.synchronize()
        max_diff = float((got.float() - expected.float()).abs().max())
        scale = float(expected.float().abs().max())
        return OutputCheck(max_diff, scale, bool(torch.isfinite(got).all()))

    def event_timeline(self) -> EventTimeline:
        """Run one split step and read its phases from the CUDA events."""
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()
        self.model.events.clear()
        self.split()
        torch.cuda.synchronize()
        return EventTimeline({f"ubatch{k[0]}:{k[1]}": (origin.elapsed_time(s),
                                                       origin.elapsed_time(e))
                              for k, (s, e) in sorted(self.model.events.items())})

    def profile_split(self, trace_path: Path) -> None:
        """Write a ``torch.profiler`` Chrome trace of two split steps to ``trace_path``."""
        from torch.profiler import ProfilerActivity, profile

        self.model.events.clear()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                self.split()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace_path))
