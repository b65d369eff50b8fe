"""What a runner step of one input shape needs, worked out once and kept.

The first step of a shape goes the whole way through :class:`~freezeframe.runtime.GraphRunner`:
bind and check the inputs, dispatch, stage, run the model in its forward context, detect the
inputs it wrote, slice the outputs. When that step replayed a FULL graph and touched nothing
but the graph's own buffers, everything it worked out depends only on the inputs' shapes,
dtypes and devices and on the step options, so the runner keeps it as a :class:`StepPlan`::

    first step of a shape                         later steps of that shape
    ---------------------                         -------------------------
    bind, check every input                       same shapes/dtypes/devices? (one pass)
    dispatch -> (FULL, descriptor)                (planned)
    staging views, padding rows                   copy the inputs (one launch), reset padding
    route the call, check the graph's inputs      (planned)
    module-state check, replay                    module-state check, replay
    which inputs were written?                    none were (version counters unchanged)
    slice the outputs                             (planned: the same views of the same
                                                   static outputs)

A later step whose inputs differ in anything the plan assumed misses it and takes the whole
way; so does any step with options the plan does not cover (keyword inputs, ``extras``,
``invalid_modes``, LoRA, micro-batching, data-parallel agreement). A plan ends when its graph
is dropped (the replay raises :class:`~freezeframe.graphs.StaleReplay`) or when a step of it
sees an input written (a version counter moved): that step finishes the whole way and the plan
is forgotten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from freezeframe.batch import BatchDescriptor
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
