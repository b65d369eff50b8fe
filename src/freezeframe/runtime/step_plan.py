"""What a runner step of one input shape needs, worked out once and kept.

The first step of a shape goes the whole way through :class:`~freezeframe.runtime.GraphRunner`:
bind and check the inputs, dispatch, stage, run the model in its forward context, detect the
inputs it wrote, slice the outputs. When that step replayed captured graphs and touched nothing
but their buffers, everything it worked out depends only on the inputs' shapes, dtypes and
devices and on the step options, so the runner keeps it as a :class:`StepPlan`::

    first step of a shape                         later steps of that shape
    ---------------------                         -------------------------
    bind, check every input                       same shapes/dtypes/devices? (one pass)
    dispatch -> (mode, descriptor)                (planned)
    staging views, padding rows                   copy the inputs (one launch), reset padding
    route the call through the model              (planned)
    module-state check                            module-state check
    FULL: replay the graph                        replay the graph
    PIECEWISE: Dynamo's code, the stitching       the stitching graph on the recorded flat
      graph, each piece's wrapper and checks        inputs, each piece a planned replay, the
                                                    splitting ops called as before
    which inputs were written?                    none were (version counters unchanged)
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
forgotten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from freezeframe.batch import BatchDescriptor
from freezeframe.context import ForwardContext
from freezeframe.stats import Tally

__all__ = ["Padding", "Staging", "StepPlan", "plan_key"]

_Tensor = torch.Tensor


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
    """A FULL step of one input shape, planned (see the module docstring).

    ``dtypes``/``devices``: what each positional input must have (``Tensor.get_device()``
    numbers, -1 for the CPU); the shapes are in the plan's key. ``output`` is the step's
    answer: views of the graph's static outputs, the same every replay. ``counts`` are the
    runner's counter increments of such a step, each a tally of the runner's stats and the
    amount one step adds."""

    dtypes: tuple[torch.dtype, ...]
    devices: tuple[int, ...]
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

    def accepts(self, args: Sequence[Any]) -> bool:
        """Whether ``args`` (positional, one per input, shapes already matched by the key) are
        plain tensors of the planned dtypes and devices."""
        for arg, dtype, device in zip(args, self.dtypes, self.devices, strict=True):
            if arg.__class__ is not _Tensor or arg.dtype is not dtype \
                    or arg.get_device() != device:
                return False
        return True


def plan_key(args: Sequence[Any], num_reqs: int | None, uniform_decode: bool
             ) -> tuple[Any, ...] | None:
    """The key of a step's plan: the step options a plan depends on and every input's shape;
    None when an input has no shape (not a tensor: the step takes the whole way and fails
    there with a clear error)."""
    try:
        return (num_reqs, uniform_decode, *[arg.shape for arg in args])
    except AttributeError:
        return None
