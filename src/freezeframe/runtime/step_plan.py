"""What a runner step of one input shape needs, worked out once and kept.

The first step of a shape goes the whole way through :class:`~freezeframe.runtime.GraphRunner`:
bind and check the inputs, dispatch, stage, run the model in its forward context, detect the
inputs it wrote, slice the outputs. When that step replayed captured graphs and touched nothing
but their buffers, everything it worked out depends only on the inputs' shapes, dtypes and
devices and on the step options, so the runner keeps it as a :class:`StepPlan`::

    first step of a shape                         later steps of that shape
    ---------------------                         -------------------------
    bind, check every input                       one dict lookup: the key holds each input's
                                                    class, shape, dtype and device
    dispatch -> (mode, descriptor)                (planned)
    staging views, padding rows                   copy the inputs (one launch); the padding
                                                    only when another shape was staged since
    route the call through the model              (planned)
    module-state check                            module-state check
    FULL: replay the graph                        replay the graph
    PIECEWISE: Dynamo's code, the stitching       the stitching graph on the recorded flat
      graph, each piece's wrapper and checks        inputs, each piece a planned replay, the
                                                    splitting ops called as before
    which inputs were written?                    FULL: none (a replay repeats the writes of
                                                    the step that made the plan, which wrote
                                                    none); PIECEWISE: the version counters are
                                                    compared (a splitting op runs its Python)
    slice the outputs                             FULL: (planned: the same views of the same
                                                    static outputs); PIECEWISE: slice again

A PIECEWISE step is planned only when the code Dynamo generated for ``forward`` does nothing
but call the graph (no Python side effect a plan would skip: see
``CompiledModel.plan_piecewise``). A later step whose inputs differ in anything the plan
assumed misses it and takes the whole way; so does any step with options the plan does not
cover (keyword inputs, ``extras``, ``invalid_modes``, LoRA, micro-batching, data-parallel
agreement). A plan ends when a graph of it is dropped (the replay raises
:class:`~freezeframe.graphs.StaleReplay` before anything runs) or when a step of it sees an
input written (a version counter moved): that step finishes the whole way and the plan is
forgotten (PIECEWISE only: a FULL replay runs exactly the recorded work, and the step that
made the plan wrote no input).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from freezeframe.batch import BatchDescriptor
from freezeframe.context import ForwardContext
from freezeframe.stats import Tally

__all__ = ["Padding", "Staging", "StepPlan", "plan_key"]

@dataclasses.dataclass(frozen=True, slots=True)
class Padding:
    """The padded tail ``[start, stop)`` of one input's buffer at one step shape."""

    name: str
    view: torch.Tensor
    fill: Any
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class Staging:
    """Where a step of one shape goes: per input (in spec order) its name, the buffer view its
    real rows are copied into and how many leading buffer rows that copy overwrites; and the
    padded tails to reset."""

    names: tuple[str, ...]
    targets: list[torch.Tensor]
    padding: tuple[Padding, ...]
    rows: tuple[int, ...]


@dataclasses.dataclass(eq=False, slots=True)
class StepPlan:
    """A step of one input shape, planned (see the module docstring). What each input must be
    (class, shape, dtype, device) is the plan's key (:func:`plan_key`).

    ``output`` is a FULL step's answer: views of the graph's static outputs, the same every
    replay. ``counts`` are the runner's counter increments of such a step, each a tally of the
    runner's stats and the amount one step adds."""

    staging: Staging
    replay: Callable[[], Any]
    replay_key: tuple[BatchDescriptor, int | None]
    output: Any
    counts: tuple[tuple[Tally, int], ...]
    num_tokens: int
    num_reqs: int | None
    #: None for a FULL step (``output`` is its answer); for a PIECEWISE step, the forward
    #: context its splitting ops read, and ``output`` is unused (each step's outputs are cut
    #: to the real rows anew: a splitting op may return fresh tensors)
    context: ForwardContext | None = None
    #: PIECEWISE: the tensor the last step returned (before cutting) and its cut to the real
    #: rows; a step that returns the same tensor (a piece's static output) reuses the cut
    last_out: torch.Tensor | None = None
    last_cut: Any = None


# What a plan requires of each positional input. The class rules out tensor subclasses (and
# anything that is not a tensor: it has no ``shape``), which take the whole way and its checks.
_input_key = operator.attrgetter("__class__", "shape", "dtype", "device")


def plan_key(args: Sequence[Any], num_reqs: int | None, uniform_decode: bool
             ) -> tuple[Any, ...] | None:
    """The key of a step's plan: the step options a plan depends on and, per positional
    input, its class, shape, dtype and device; None when an input is no tensor (the step
    takes the whole way and fails there with a clear error). One dict lookup of this key is
    the whole input check of a planned step."""
    try:
        return (num_reqs, uniform_decode, *map(_input_key, args))
    except AttributeError:
        return None
