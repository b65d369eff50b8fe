"""Yield points for micro-batched models: ``ff.ubatch.yield_to_comm()`` and friends.

A model that communicates (all-to-all, all-reduce) calls these around its communication so
that, when the step runs as micro-batches (``config.micro_batching``), one micro-batch's
communication overlaps another's compute. Outside a micro-batched step every call is a no-op,
so the same model code runs unsplit. See :mod:`freezeframe.runtime.ubatch.schedule` for the
mechanism.
"""

from __future__ import annotations

from freezeframe.runtime.ubatch.schedule import (
    MicroBatchContext,
    comm_section,
    current_micro_batch,
    in_micro_batch,
    yield_,
    yield_to_comm,
    yield_to_compute,
)

__all__ = [
    "MicroBatchContext",
    "comm_section",
    "current_micro_batch",
    "in_micro_batch",
    "yield_",
    "yield_to_comm",
    "yield_to_compute",
]
