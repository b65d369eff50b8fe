"""How each mode of the bench is built and started: ``eager``, ``compile`` (``torch.compile``),
``reduce-overhead`` (``torch.compile(mode="reduce-overhead")``), and freezeframe's ``none``,
``piecewise``, ``full`` and ``full_and_piecewise`` (``ff.compile`` + GraphRunner: compiled on
the largest mixed step, then captured), and ``breakable`` and ``full_and_breakable``: the same
graph modes without a trace or a compiler (mode NONE: the forward as written, its PIECEWISE
graphs captured breakable at the attention op), whose startup is the capture alone. The Hugging
Face modes (``HF_MODES``) time ``generate`` on a Hugging Face Llama instead (``hf_modes``).

Every freezeframe mode steps through its GraphRunner the way a plan covers
(:class:`PlannedForward`: positional inputs, no forward-context extras), so its timed steps run
from the runner's plans. ``full_and_piecewise`` captures the default ladder of capture sizes
(its capture is the report of that ladder); the other graph modes capture only the sizes the
bench's steps use, which is all they replay.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from freezeframe.bench.measure import StepBuilder, StepShapes, full_decode_launches, logits_of, sync
from freezeframe.models import ATTENTION_OP, LlamaModel
from freezeframe.models.attention import ATTN_METADATA_KEY
from freezeframe.models.inputs import StepInputs
from freezeframe.models.llama_tp import TPLlamaModel
from freezeframe.models.serving import EagerForward, llama_runner_inputs

if TYPE_CHECKING:
    from freezeframe.bench.progress import Progress
    from freezeframe.compilation.model import CompiledModel
    from freezeframe.config import CompilationConfig
    from freezeframe.runtime.runner import CaptureReport, GraphRunner

__all__ = ["ALL_MODES", "DEFAULT_MODES", "FF_MODES", "HF_MODES", "LADDER_MODE", "TORCH_MODES",
           "TP_MODES", "CaptureTimes", "CompiledLlama", "PlannedForward", "Started",
           "compile_with_runner", "graph_config", "modes_from", "start_mode"]

TORCH_MODES = ("eager", "compile", "reduce-overhead")
FF_MODES = ("none", "piecewise", "full", "full_and_piecewise", "breakable", "full_and_breakable")
#: ``generate`` of a Hugging Face Llama: HF eager, HF with a static cache and torch.compile,
#: ``ff.hf.compile``, and ``ff.hf`` with prompt-lookup decoding (see hf_modes)
HF_MODES = ("hf-eager", "hf-compile", "ff-hf", "ff-hf-lookup")
# the breakable modes: (cudagraph_mode, compilation mode)
_BREAKABLE = {"breakable": ("PIECEWISE", "none"),
              "full_and_breakable": ("FULL_AND_PIECEWISE", "none")}
#: what ``freezeframe bench`` runs without ``--modes`` (the HF modes need transformers and
#: compile a second model: they run when named)
DEFAULT_MODES = TORCH_MODES + FF_MODES
ALL_MODES = DEFAULT_MODES + HF_MODES
#: the mode whose capture is the default ladder's, with a graph-memory prediction made first
LADDER_MODE = "full_and_piecewise"
#: the modes ``--tp`` runs: eager and freezeframe's traced ones, whose graphs are captured in
#: lockstep (torch.compile's own graphs and the breakable capture are not)
TP_MODES = ("eager", "none", "piecewise", "full", "full_and_piecewise")


def parse_list(text: str, kind: type = int) -> tuple[Any, ...]:
    return tuple(kind(part.strip()) for part in text.split(",") if part.strip())


def modes_from(text: str | Sequence[str]) -> tuple[str, ...]:
    parts = parse_list(text, str) if isinstance(text, str) else tuple(text)
    dashed = TORCH_MODES + HF_MODES
    return tuple(p.lower().replace("_", "-") if p.lower().replace("_", "-") in dashed
                 else p.lower().replace("-", "_") for p in parts)


def graph_config(shapes: StepShapes, cudagraph_mode: str, compiler: str,
                 on_cuda: bool, mode: str = "piecewise",
                 capture_sizes: Sequence[int] | None = None) -> CompilationConfig:
    """The freezeframe configuration of a graph mode sized for the steps of ``shapes``
    (``mode``: the compilation mode; ``none`` for the breakable modes; ``capture_sizes``: the
    default ladder when None)."""
    import freezeframe as ff

    return ff.CompilationConfig(
        mode=mode, backend=compiler, splitting_ops=[ATTENTION_OP],
        cudagraph_mode=cudagraph_mode, graph_backend="cuda" if on_cuda else "emulated",
        max_num_seqs=shapes.max_num_seqs, max_num_tokens=shapes.max_num_tokens,
        cudagraph_capture_sizes=None if capture_sizes is None else sorted(set(capture_sizes)),
    )


class PlannedForward:
    """A step through a GraphRunner built with ``llama_runner_inputs``, called the way a plan
    covers: the inputs by position (each step's argument tuple built once and kept), and no
    forward-context extras. The host-side request layout (``attn_metadata``) is passed only
    where an attention path reads it: the pure-torch path of a CUDA step that is not a uniform
    decode (where it saves a device-to-host copy per layer; such steps are not planned). The
    Triton kernel reads the layout from the device, and on a CPU that copy costs nothing."""

    def __init__(self, runner: GraphRunner, max_num_seqs: int, host_layout: bool) -> None:
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.host_layout = host_layout
        self._args: dict[int, tuple[StepInputs, tuple[torch.Tensor, ...]]] = {}

    def arguments(self, step: StepInputs) -> tuple[torch.Tensor, ...]:
        """The runner's positional inputs for ``step``: each cut to the step's tokens or
        requests, ``query_start_loc`` padded to ``max_num_seqs + 1`` entries."""
        known = self._args.get(id(step))
        if known is not None and known[0] is step:
            return known[1]
        t = step.tensors
        qsl = t["query_start_loc"][: step.num_reqs + 1]
        pad = self.max_num_seqs + 1 - qsl.shape[0]
        qsl = torch.cat([qsl, qsl[-1:].expand(pad)]) if pad > 0 else qsl
        args = (t["input_ids"][: step.num_tokens], t["positions"][: step.num_tokens],
                t["slot_mapping"][: step.num_tokens], qsl, t["seq_lens"][: step.num_reqs],
                t["block_tables"][: step.num_reqs])
        self._args[id(step)] = (step, args)
        return args

    def __call__(self, step: StepInputs) -> torch.Tensor:
        args = self.arguments(step)
        if self.host_layout and not step.uniform_decode:
            return self.runner(*args, uniform_decode=False,  # type: ignore[no-any-return]
                               extras={ATTN_METADATA_KEY: step.host})
        return self.runner(*args, uniform_decode=step.uniform_decode)  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class CompiledLlama:
    """``ff.compile`` of the Llama, the GraphRunner around it, and a step through the runner."""

    compiled: CompiledModel
    runner: GraphRunner
    forward: PlannedForward


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
    # the torch attention path on a GPU reads the host layout of a mixed step (see
    # PlannedForward); the Triton kernel and any CPU step do without it
    from freezeframe.models.attention import resolve_attention_kernel

    device = base.lm_head.weight.device
    host_layout = device.type == "cuda" and resolve_attention_kernel(
        base.cache_config.attention_kernel, device) == "torch"
    return CompiledLlama(compiled, runner,
                         PlannedForward(runner, shapes.max_num_seqs, host_layout))


@dataclasses.dataclass(frozen=True)
class CaptureTimes:
    """Startup of a graph mode (the JSON keys of a mode entry, in this order)."""

    compile_s: float
    capture_s: float
    graphs_captured: int


@dataclasses.dataclass(frozen=True)
class Started:
    """A mode ready to time: its forward, the runner and compiled model of the freezeframe
    modes and, for those that capture graphs, how long compiling and capturing took and the
    capture's report."""

    forward: Callable[[StepInputs], torch.Tensor]
    runner: GraphRunner | None = None
    capture: CaptureTimes | None = None
    full_decode_launches: int | None = None  # of one FULL decode replay, where there is one
    compiled: CompiledModel | None = None
    report: CaptureReport | None = None


def start_mode(mode: str, base: LlamaModel, steps: StepBuilder, *, compiler: str,
               launch_bs: int, progress: Progress, t0: float,
               batch_sizes: Sequence[int] = ()) -> Started:
    """``mode`` built around ``base`` and ready to time. ``compiler``: the torch.compile and
    ff.compile backend; ``launch_bs``: the decode batch size whose FULL replay's launches are
    counted; ``t0``: when the mode's startup began; ``batch_sizes``: the decode batch sizes
    timed (a graph mode other than the ladder's captures the sizes their steps use)."""
    if mode == "eager":
        return Started(EagerForward(base))
    if mode == "compile":
        return Started(EagerForward(torch.compile(base, backend=compiler)))
    if mode == "reduce-overhead":
        return Started(EagerForward(torch.compile(base, mode="reduce-overhead",
                                                  dynamic=False)))
    sizes = None if mode == LADDER_MODE or not batch_sizes else \
        [n for bs in batch_sizes for n in (bs, bs + steps.shapes.mixed_chunk)]
    return _start_freezeframe(mode, base, steps, compiler, launch_bs, progress, t0, sizes)


def _start_freezeframe(mode: str, base: LlamaModel, steps: StepBuilder, compiler: str,
                       launch_bs: int, progress: Progress, t0: float,
                       capture_sizes: Sequence[int] | None) -> Started:
    """Compile ``base`` with freezeframe and, unless ``mode`` is ``none``, capture its
    graphs; ``t0`` is when the mode's startup began. The ladder's mode captures with a graph
    memory budget (the whole device), so the runner measures its probes first and predicts
    the rest, as a budgeted capture does."""
    shapes = steps.shapes
    on_cuda = steps.device.type == "cuda"
    graph_mode, compile_mode = _BREAKABLE.get(mode, (mode.upper(), "piecewise"))
    budget = int(torch.cuda.get_device_properties(steps.device).total_memory) \
        if on_cuda and mode == LADDER_MODE and not isinstance(base, TPLlamaModel) else None
    llama = compile_with_runner(
        base, graph_config(shapes, graph_mode, compiler, on_cuda, compile_mode, capture_sizes),
        shapes, graph_memory_budget=budget)
    progress.phase("first step, eager (no trace, no compiler)" if mode in _BREAKABLE
                   else f"compiling (trace, split, {compiler} compiler)")
    # compile first, on a step of several tokens: Dynamo specialises a dynamic dim that it
    # first sees with size 1
    logits_of(llama.forward, steps.mixed(shapes.max_bs), base)()
    if mode == "none":
        return Started(llama.forward, llama.runner, compiled=llama.compiled)
    sync(steps.device)
    compile_s = time.perf_counter() - t0
    progress.phase(f"capturing graphs ({'CUDA' if on_cuda else 'emulated'})")
    t1 = time.perf_counter()
    report = llama.runner.capture()
    sync(steps.device)
    capture = CaptureTimes(compile_s, time.perf_counter() - t1, report.num_graphs)
    launches = full_decode_launches(llama.compiled, launch_bs)
    return Started(llama.forward, llama.runner, capture, launches, llama.compiled, report)
