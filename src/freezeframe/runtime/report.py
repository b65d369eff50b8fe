"""What a runner reports: the capture report, each graph's entry in it, and why a step ran
without a graph.

A :class:`CaptureReport` is what :meth:`~freezeframe.runtime.GraphRunner.capture` returns (and
keeps as ``runner.report``): every graph captured, with its time and memory, the whole capture's
time and memory, and the graph-memory prediction where one was made. :data:`FALLBACK_REASONS`
names every reason a step can run without a graph, with the log level and the sentence a runner
logs (once per reason) and the counter it bumps (``fallback_<reason>``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from freezeframe.batch import BatchDescriptor
from freezeframe.config import CUDAGraphMode
from freezeframe.runtime.graph_memory import GraphMemoryPrediction, format_bytes

__all__ = ["FALLBACK_REASONS", "CaptureReport", "GraphCapture"]

_PIECEWISE, _FULL = CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL

# Why a step ran without a graph -> (log level, explanation). The counter is fallback_<reason>.
FALLBACK_REASONS: Mapping[str, tuple[int, str]] = {
    "graphs_off": (logging.INFO, "cudagraph_mode is NONE, so every step runs eagerly"),
    "graphs_unavailable": (logging.WARNING,
                           "no graph backend is available (graph_backend={backend} and no CUDA); "
                           "set graph_backend='emulated' to test graphs on CPU"),
    "too_large": (logging.INFO,
                  "a step of {num_tokens} tokens is above the largest capture size {max_size}; "
                  "such steps run eagerly and unpadded (raise max_cudagraph_capture_size to "
                  "capture them)"),
    "mode_invalid": (logging.INFO,
                     "the graph for this step is excluded by invalid_modes={invalid}"),
    "mode_off": (logging.INFO,
                 "cudagraph_mode {mode} captures no graph for this kind of batch "
                 "(uniform_decode={uniform}); use FULL_AND_PIECEWISE to cover mixed batches"),
    "not_captured": (logging.INFO,
                     "the graph for this step ({desc}) is not captured yet (capture_policy="
                     "{policy}); the step runs without a graph until it is"),
    "capture_failed": (logging.WARNING,
                       "capturing the graph for this step ({desc}) failed earlier (the error "
                       "was raised then); such steps run without a graph until a capture of "
                       "it succeeds"),
    "compile_disabled": (logging.INFO,
                         "compiling is disabled for the process (TORCH_COMPILE_DISABLE=1 or "
                         "torch._dynamo.config.disable), so capture() captured nothing and "
                         "every step runs eagerly"),
    "no_key": (logging.WARNING,
               "no captured graph matches the step ({desc}); check the LoRA settings "
               "(max_loras, cudagraph_specialize_lora)"),
}


@dataclasses.dataclass(frozen=True)
class GraphCapture:
    """One captured graph: its key, the wall time of its warm-ups and capture, and the memory
    it took: on CUDA the growth of the graph pool's segments over its capture, read from the
    caching allocator (graphs share one pool, so a graph captured after a larger one may take
    almost nothing); where the graphs account for their own memory (``emulated``: the tensors
    each one keeps), the bytes it added; 0 where neither applies.

    ``predicted_bytes`` is what the graph-memory prediction said for it (None when no
    prediction was made), and ``probe`` whether it was one of the measured sizes the prediction
    was fitted on (captured first when the runner has a budget; see
    :mod:`freezeframe.runtime.graph_memory`)."""

    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    seconds: float
    memory_bytes: int
    predicted_bytes: int | None = None
    probe: bool = False
    # a breakable graph's segments and the breaks between them (0 and () for any other graph)
    segments: int = 0
    breaks: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class CaptureReport:
    """What :meth:`GraphRunner.capture` did. ``memory_bytes`` is the graph memory of the whole
    capture: the growth of the graph pool on CUDA (the allocator's segments of that pool; a
    model whose graphs the runner cannot see falls back to the free-memory delta), the sum of
    the graphs' own accounting on ``emulated``.

    ``prediction`` is the graph-memory prediction (made before the capture when the runner has a
    ``graph_memory_budget``, from the same measured sizes after it on ``emulated`` otherwise),
    ``budget_bytes`` the budget it was checked against."""

    graphs: tuple[GraphCapture, ...] = ()
    seconds: float = 0.0
    memory_bytes: int = 0
    device: str = "cpu"
    prediction: GraphMemoryPrediction | None = None
    budget_bytes: int | None = None

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def count(self, mode: CUDAGraphMode) -> int:
        return sum(1 for g in self.graphs if g.mode is mode)

    @property
    def predicted_bytes(self) -> int | None:
        """The predicted graph memory of the whole capture, or None."""
        return self.prediction.total_bytes if self.prediction is not None else None

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured for the whole capture, or None without a
        prediction or with nothing measured."""
        if self.prediction is None or self.memory_bytes <= 0:
            return None
        return (self.prediction.total_bytes - self.memory_bytes) / self.memory_bytes

    @property
    def worst_graph_error(self) -> float | None:
        """The largest |predicted - measured| / measured over the graphs that were predicted
        (not measured) and took memory, or None."""
        errors = [abs(g.predicted_bytes - g.memory_bytes) / g.memory_bytes
                  for g in self.graphs
                  if g.predicted_bytes is not None and not g.probe and g.memory_bytes > 0]
        return max(errors) if errors else None

    def summary(self) -> str:
        text = (f"captured {self.num_graphs} graphs ({self.count(_PIECEWISE)} piecewise, "
                f"{self.count(_FULL)} full) in {self.seconds:.2f} s, using "
                f"{format_bytes(self.memory_bytes)} of {self.device} memory")
        error = self.prediction_error
        if self.prediction is not None and error is not None:
            worst = self.worst_graph_error
            text += (f"; predicted {format_bytes(self.prediction.total_bytes)} (error "
                     f"{error:+.1%}" + (f", worst graph {worst:.1%}" if worst is not None
                                        else "") + ")")
        if self.budget_bytes is not None:
            text += f", budget {format_bytes(self.budget_bytes)}"
        breakable = [g for g in self.graphs if g.segments]
        if breakable:
            text += (f"; {len(breakable)} breakable graphs of "
                     f"{sum(g.segments for g in breakable)} segments around "
                     f"{sum(len(g.breaks) for g in breakable)} breaks")
        return text
