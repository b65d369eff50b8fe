"""The steps the bench times for one mode, and how: decode by batch size and by context (and,
with ``grid``, at every context and batch size), a mixed step per batch size and a prefill;
each decode row with its share of the bandwidth floor and its host time, and for a mode that
runs through a GraphRunner how many of its timed steps ran from a plan.

Each distinct (context, batch size) decode step is timed once and shared by the tables that
show it. A mode may time only some rows (:data:`ROW_LIMITS`): ``reduce-overhead`` compiles once
per batch size, so it times the decode steps a comparison needs and nothing else.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch

from freezeframe.bench.measure import StepBuilder, Timer, Timing, logits_of
from freezeframe.models import LlamaModel
from freezeframe.models.inputs import StepInputs

__all__ = ["ROW_LIMITS", "RowLimit", "RowTimer", "rows_of"]


@dataclasses.dataclass(frozen=True)
class RowLimit:
    """The rows a mode times: decode at the default context for batch sizes up to
    ``max_batch`` only, and nothing else."""

    max_batch: int


#: modes that time fewer rows: reduce-overhead compiles a graph per batch size (two compiles
#: at batch 1 and 4 answer issue 44's comparison; each more would cost a compile)
ROW_LIMITS = {"reduce-overhead": RowLimit(max_batch=4)}


def rows_of(mode: str, batch_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The decode batch sizes ``mode`` runs (its first call and its decode rows)."""
    limit = ROW_LIMITS.get(mode)
    return tuple(b for b in batch_sizes if limit is None or b <= limit.max_batch)


@dataclasses.dataclass
class RowTimer:
    """Times the rows of one mode; counts its timed steps and those a runner ran from a plan.

    ``read_planned`` reads the runner's ``steps_planned`` counter (None for a mode without a
    runner); warm-up steps are never counted, so with a warm-up per row every timed step of a
    graph step's shape can run from its plan."""

    steps: StepBuilder
    base: LlamaModel
    forward: Callable[[StepInputs], torch.Tensor]
    floor_ms: Callable[[int, int | None], float]  # (batch, context) -> ms at the floor
    n_steps: int
    warmup: int
    read_planned: Callable[[], int] | None = None
    timed: int = 0
    planned: int = 0
    _decode: dict[tuple[int, int], dict[str, float]] = dataclasses.field(default_factory=dict)

    def time(self, step: StepInputs, steps: int, warmup: int) -> Timing:
        """``steps`` timed calls of ``step`` after ``warmup`` untimed ones."""
        fn = logits_of(self.forward, step, self.base)
        for _ in range(warmup):
            fn()
        before = self.read_planned() if self.read_planned is not None else 0
        timing = Timer(self.steps.device).timing(fn, steps, 0)
        if self.read_planned is not None:
            self.planned += self.read_planned() - before
        self.timed += steps
        return timing

    def decode(self, bs: int, context: int | None = None) -> dict[str, float]:
        """The decode row at ``bs`` requests of ``context`` tokens (default: the shapes'),
        timed on its first request: median ms, the floor and its share, median host ms."""
        ctx = context or self.steps.shapes.context
        row = self._decode.get((ctx, bs))
        if row is None:
            timing = self.time(self.steps.decode(bs, ctx), self.n_steps, self.warmup)
            ms = statistics.median(timing.device_ms)
            floor = self.floor_ms(bs, ctx)
            row = self._decode[(ctx, bs)] = {
                "median_ms": ms, "floor_ms": floor, "floor_share": floor / ms,
                "host_ms": statistics.median(timing.host_ms)}
        return row

    def median_ms(self, step: StepInputs, steps: int, warmup: int) -> float:
        return statistics.median(self.time(step, steps, warmup).device_ms)

    def counts(self) -> dict[str, Any]:
        """``timed_steps`` and ``planned_steps`` (None without a runner)."""
        return {"timed_steps": self.timed,
                "planned_steps": self.planned if self.read_planned is not None else None}
