"""A runner step's plan: everything one step does, as data, and the key it is kept under.

Every step of a :class:`~freezeframe.runtime.GraphRunner` runs a :class:`StepPlan` through
one function, :meth:`Stepper.run(plan, inputs) <freezeframe.runtime.steps.Stepper.run>`.
A plan says::

    staging     where each input is copied in the static buffers, the padding rows to reset
    check       the model's every-call state check, run first (replays only: a model call
                checks itself)
    work        what runs, one of:
                  GraphReplay    a graph of the whole forward on the captured buffers (FULL;
                                 a breakable model's PIECEWISE graph)
                  PieceReplays   the piece chain: each capturable piece's replay and each
                                 splitting op, in the order the stitching graph calls them
                  ModelCall      the model's Python in the step's forward context (the step
                                 of a shape nothing is planned for yet, an unplannable step,
                                 graphs off); with ``slices``, micro-batches run on threads
    context     the forward context the work runs in (mode, padded descriptor, real sizes,
                owner; the step's ``extras`` added per step)
    watch       whether the inputs' version counters are compared around the work (a write
                is copied back to the caller's tensor)
    cut         which rows of the outputs the step answers with (a FULL replay's answer is
                cut once: the same static tensors every step)

How a plan is made (:meth:`Stepper.plan`, once per shape; every step of a shape that cannot be
kept makes one)::

    bind and check the inputs -> dispatch (mode, padded descriptor; fallbacks counted)
      -> staging -> the work: FULL with its graph captured on the buffers: GraphReplay;
         PIECEWISE: ModelCall recording the stitching graph's calls, whose chain becomes
         the kept plan (PieceReplays) once the step ran; anything else: ModelCall
      -> run(plan, inputs)

A plan is kept, under its key, for the later steps of its shape when its step replayed
captured graphs on the buffers and wrote no input. A plan ends when a graph of it is dropped
(its replay raises :class:`~freezeframe.graphs.StaleReplay` before anything runs: the step is
planned again) or when a PIECEWISE step of it sees an input written (that step copies the
write back, and the plan is forgotten).

What a plan's key holds (:func:`plan_key`): what makes a step's work different. Per input in
the runner's order, given by position or by name alike (the model is called the same way
either way), its class, shape, dtype and device: a tensor subclass, another dtype, device or
size is another plan (or the whole way's clear error). The step options that change the
dispatch: ``num_reqs``, ``uniform_decode``, and ``has_lora``/``num_active_loras``/
``invalid_modes`` when given. Not the inputs' values or addresses: they are staged, copied
into the buffers the graphs read.

``extras`` (the caller's values of the forward context) are not in the key: they are staged
too, into the forward context of each step. They cannot change a graph: graphs were captured
in capture()'s dummy steps, without any extras, and a replay re-runs exactly what was
captured, so a FULL replay reads none (as a step through the model, which reaches the same
replay, reads none). The splitting ops of a PIECEWISE step run eagerly and read the
context: each planned step enters its plan's context with this step's extras, so an op reads
this step's values, whatever their type (a host object, a tensor, a number). A value the
model's Python read from the context when it was traced is baked into the trace for every
step, planned or not (as any Python value a trace reads).

Not planned (an eager plan every step): a model with forward hooks (they run in
``nn.Module.__call__``, which a replay skips), data-parallel agreement (the size is agreed
each step), micro-batched steps (their cut depends on ``num_scheduled_tokens``), a step whose
graph writes an input, a plain callable (no graphs of its own), graphs off.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from freezeframe.batch import BatchDescriptor, GraphKey
from freezeframe.config import CUDAGraphMode
from freezeframe.context import ForwardContext
from freezeframe.graphs.capturable import Chain, PieceRecording
from freezeframe.graphs.replay import Replay
from freezeframe.runtime.buffers import Staging
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan
from freezeframe.stats import Tally

__all__ = ["GraphReplay", "ModelCall", "PieceReplays", "Route", "StepCall", "StepOptions",
           "StepPlan", "plan_key", "step_options"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepCall:
    """One call of the runner as it was made: its inputs and step options (see
    ``GraphRunner.__call__``)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    uniform_decode: bool = False
    has_lora: bool = False
    num_active_loras: int = 0
    num_reqs: int | None = None
    invalid_modes: Collection[CUDAGraphMode] = frozenset()
    extras: Mapping[str, Any] | None = None
    num_scheduled_tokens: Sequence[int] | None = None

    @property
    def options(self) -> tuple[Any, ...] | None:
        """The dispatch options of the key (:func:`step_options`)."""
        return step_options(self.has_lora, self.num_active_loras, self.invalid_modes)


def step_options(has_lora: bool, num_active_loras: int,
                 invalid_modes: Collection[CUDAGraphMode]) -> tuple[Any, ...] | None:
    """The step options beside the size that change its dispatch, as part of a plan key:
    None when none is given (most steps)."""
    if not (has_lora or num_active_loras or invalid_modes):
        return None
    return (bool(has_lora), num_active_loras, frozenset(invalid_modes))


# What a plan requires of each input. The class rules out tensor subclasses (and anything
# that is not a tensor: it has no ``shape``), which take the whole way and its checks.
input_key = operator.attrgetter("__class__", "shape", "dtype", "device")


def plan_key(inputs: Sequence[Any], num_reqs: int | None, uniform_decode: bool,
             options: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """The key of a step's plan (see the module docstring); None when an input is no tensor
    (the step takes the whole way and fails there with a clear error). One dict lookup of
    this key is the whole input check of a planned step. The step options come last, and
    only when given (a runner's inputs are as many at every step, so a key with options is
    one element longer)."""
    try:
        key = (num_reqs, uniform_decode, *map(input_key, inputs))
    except AttributeError:
        return None
    return key if options is None else (*key, options)


@dataclasses.dataclass(frozen=True, slots=True)
class StepOptions:
    """The runner's options the steps read (see GraphRunner)."""

    strict: bool
    copy_outputs: bool
    dp_sync: bool
    dp_group: Any
    invalid_modes: frozenset[CUDAGraphMode]
    policy_name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Where a step goes: its runtime mode and descriptor, the padded sizes it runs at."""

    mode: CUDAGraphMode
    desc: BatchDescriptor
    padded_tokens: int
    padded_reqs: int | None
    uniform: bool


# -- the work of a plan --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class GraphReplay:
    """A graph of the whole forward, replayed on the buffers it was captured reading."""

    replay: Replay


@dataclasses.dataclass(frozen=True, slots=True)
class PieceReplays:
    """A PIECEWISE step without the model's Python: calling ``chain`` runs each capturable
    piece's replay and each splitting op, in the stitching graph's order
    (:class:`~freezeframe.compilation.graph_steps.PieceChain`)."""

    chain: Chain


@dataclasses.dataclass(frozen=True, slots=True)
class ModelCall:
    """The model (or the micro-batch wrapper around it) called on the buffer views in the
    step's forward context. ``slices``: the micro-batches it runs on threads. ``recording``:
    the stitching graph's calls are recorded, and their chain is the shape's plan from the
    next step on."""

    slices: MicroBatchPlan | None = None
    recording: PieceRecording | None = None


Work = GraphReplay | PieceReplays | ModelCall


@dataclasses.dataclass(eq=False, slots=True)
class StepPlan:
    """One step's plan (see the module docstring)."""

    route: Route
    num_tokens: int
    num_reqs: int | None
    staging: Staging
    work: Work
    #: the model's every-call state check, run before a replay (None: a model call)
    check: Callable[[], None] | None
    #: the forward context the work runs in (None: a FULL replay, which reads none)
    context: ForwardContext | None
    #: compare the inputs' version counters around the work
    watch: bool
    #: the inputs a replay of this step's graph writes that no version counter shows (a CUDA
    #: replay writes without the dispatcher), from capture; None when not known
    graph_writes: frozenset[str] | None
    #: the runner's counters the step adds to (name, by); a kept plan counts with tallies
    counters: tuple[tuple[str, int], ...]
    #: the plan's key while it may be kept (None: made for this step only)
    key: tuple[Any, ...] | None = None
    tallies: tuple[tuple[Tally, int], ...] = ()
    #: a GraphReplay's answer: the cut of the graph's static outputs, the same every replay
    output: Any = None
    #: a PieceReplays plan: the tensor the last step returned (before cutting) and its cut to
    #: the real rows; a step that returns the same tensor (a piece's static output) reuses it
    last_out: torch.Tensor | None = None
    last_cut: Any = None

    @property
    def mode(self) -> CUDAGraphMode:
        return self.route.mode

    @property
    def graph_key(self) -> GraphKey:
        """The graph key the step runs (its verify key)."""
        return (self.route.mode, self.route.desc)

    @property
    def kept(self) -> bool:
        """Whether the plan serves later steps of its shape (it counts with tallies)."""
        return bool(self.tallies)
