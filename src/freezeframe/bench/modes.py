"""How each mode of the bench is built and started: ``eager``, ``compile`` (``torch.compile``),
``reduce-overhead`` (``torch.compile(mode="reduce-overhead")``), and freezeframe's ``none``,
``piecewise``, ``full`` and ``full_and_piecewise`` (``ff.compile`` + GraphRunner: compiled on
the largest mixed step, then captured), and ``breakable`` and ``full_and_breakable``: the same
graph modes without a trace or a compiler (mode NONE: the forward as written, its PIECEWISE
graphs captured breakable at the attention op), whose startup is the capture alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from freezeframe.bench.measure import StepBuilder, StepShapes, full_decode_launches, logits_of, sync
from freezeframe.models import ATTENTION_OP, LlamaModel
from freezeframe.models.inputs import StepInputs
from freezeframe.models.llama_tp import TPLlamaModel
from freezeframe.models.serving import EagerForward, RunnerForward, llama_runner_inputs

if TYPE_CHECKING:
    from freezeframe.bench.progress import Progress
    from freezeframe.compilation.model import CompiledModel
    from freezeframe.config import CompilationConfig
    from freezeframe.runtime.runner import GraphRunner

__all__ = ["ALL_MODES", "FF_MODES", "TORCH_MODES", "TP_MODES", "CaptureTimes", "CompiledLlama",
           "Started", "compile_with_runner", "graph_config", "modes_from", "start_mode"]

TORCH_MODES = ("eager", "compile", "reduce-overhead")
FF_MODES = ("none", "piecewise", "full", "full_and_piecewise", "breakable", "full_and_breakable")
# the breakable modes: (cudagraph_mode, compilation mode)
_BREAKABLE = {"breakable": ("PIECEWISE", "none"),
              "full_and_breakable": ("FULL_AND_PIECEWISE", "none")}
ALL_MODES = TORCH_MODES + FF_MODES
#: the modes ``--tp`` runs: eager and freezeframe's traced ones, whose graphs are captured in
#: lockstep (torch.compile's own graphs and the breakable capture are not)
TP_MODES = ("eager", "none", "piecewise", "full", "full_and_piecewise")


def parse_list(text: str, kind: type = int) -> tuple[Any, ...]:
    return tuple(kind(part.strip()) for part in text.split(",") if part.strip())


def modes_from(text: str | Sequence[str]) -> tuple[str, ...]:
    parts = parse_list(text, str) if isinstance(text, str) else tuple(text)
    return tuple(p.lower().replace("_", "-") if p.lower().replace("_", "-") in TORCH_MODES
                 else p.lower().replace("-", "_") for p in parts)


def graph_config(shapes: StepShapes, cudagraph_mode: str, compiler: str,
                 on_cuda: bool, mode: str = "piecewise") -> CompilationConfig:
    """The freezeframe configuration of a graph mode sized for the steps of ``shapes``
    (``mode``: the compilation mode; ``none`` for the breakable modes)."""
    import freezeframe as ff

    return ff.CompilationConfig(
        mode=mode, backend=compiler, splitting_ops=[ATTENTION_OP],
        cudagraph_mode=cudagraph_mode, graph_backend="cuda" if on_cuda else "emulated",
        max_num_seqs=shapes.max_num_seqs, max_num_tokens=shapes.max_num_tokens,
    )


@dataclasses.dataclass(frozen=True)
class CompiledLlama:
    """``ff.compile`` of the Llama, the GraphRunner around it, and a step through the runner."""

    compiled: CompiledModel
    runner: GraphRunner
    forward: RunnerForward


def compile_with_runner(base: LlamaModel, config: CompilationConfig,
                        shapes: StepShapes, graph_memory_budget: int | None = None
                        ) -> CompiledLlama:
    """Wrap ``base`` for ``config``; it compiles on its first step, captures on ``capture()``
    (measuring and predicting graph memory first when a ``graph_memory_budget`` is given; in
    lockstep with the other ranks when ``base`` is a tensor-parallel shard)."""
    import freezeframe as ff

    compiled = ff.compile(base, config, dynamic_arg_dims=dict(
        LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
    runner = ff.GraphRunner(compiled, config,
                            inputs=llama_runner_inputs(base, shapes.max_num_seqs),
                            progress=False, graph_memory_budget=graph_memory_budget,
                            lockstep=isinstance(base, TPLlamaModel))
    return CompiledLlama(compiled, runner, RunnerForward(runner, shapes.max_num_seqs))


@dataclasses.dataclass(frozen=True)
class CaptureTimes:
    """Startup of a graph mode (the JSON keys of a mode entry, in this order)."""

    compile_s: float
    capture_s: float
    graphs_captured: int


@dataclasses.dataclass(frozen=True)
class Started:
    """A mode ready to time: its forward, the runner of the freezeframe modes and, for those
    that capture graphs, how long compiling and capturing took."""

    forward: Callable[[StepInputs], torch.Tensor]
    runner: GraphRunner | None = None
    capture: CaptureTimes | None = None
    full_decode_launches: int | None = None  # of one FULL decode replay, where there is one


def start_mode(mode: str, base: LlamaModel, steps: StepBuilder, *, compiler: str,
               launch_bs: int, progress: Progress, t0: float) -> Started:
    """``mode`` built around ``base`` and ready to time. ``compiler``: the torch.compile and
    ff.compile backend; ``launch_bs``: the decode batch size whose FULL replay's launches are
    counted; ``t0``: when the mode's startup began."""
    if mode == "eager":
        return Started(EagerForward(base))
    if mode == "compile":
        return Started(EagerForward(torch.compile(base, backend=compiler)))
    if mode == "reduce-overhead":
        return Started(EagerForward(torch.compile(base, mode="reduce-overhead",
                                                  dynamic=False)))
    return _start_freezeframe(mode, base, steps, compiler, launch_bs, progress, t0)


def _start_freezeframe(mode: str, base: LlamaModel, steps: StepBuilder, compiler: str,
                       launch_bs: int, progress: Progress, t0: float) -> Started:
    """Compile ``base`` with freezeframe and, unless ``mode`` is ``none``, capture its
    graphs; ``t0`` is when the mode's startup began."""
    shapes = steps.shapes
    on_cuda = steps.device.type == "cuda"
    graph_mode, compile_mode = _BREAKABLE.get(mode, (mode.upper(), "piecewise"))
    llama = compile_with_runner(
        base, graph_config(shapes, graph_mode, compiler, on_cuda, compile_mode), shapes)
    progress.phase("first step, eager (no trace, no compiler)" if mode in _BREAKABLE
                   else f"compiling (trace, split, {compiler} compiler)")
    # compile first, on a step of several tokens: Dynamo specialises a dynamic dim that it
    # first sees with size 1
    logits_of(llama.forward, steps.mixed(shapes.max_bs), base)()
    if mode == "none":
        return Started(llama.forward, llama.runner)
    sync(steps.device)
    compile_s = time.perf_counter() - t0
    progress.phase(f"capturing graphs ({'CUDA' if on_cuda else 'emulated'})")
    t1 = time.perf_counter()
    report = llama.runner.capture()
    sync(steps.device)
    capture = CaptureTimes(compile_s, time.perf_counter() - t1, report.num_graphs)
    launches = full_decode_launches(llama.compiled, launch_bs)
    return Started(llama.forward, llama.runner, capture, launches)
