"""The shapes of a step: the batch descriptor (the key a captured graph is stored under) and,
for a step run as micro-batches, its plan and slices."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from freezeframe.config import CUDAGraphMode

__all__ = ["BatchDescriptor", "DPMicroBatchMetadata", "GraphKey", "MicroBatchPlan",
           "MicroBatchSlice", "mixed_step_reqs"]

# What one captured graph is stored under: its runtime mode and padded descriptor.
GraphKey: TypeAlias = "tuple[CUDAGraphMode, BatchDescriptor]"


def mixed_step_reqs(num_tokens: int, max_num_seqs: int) -> int:
    """The request rows of a mixed (not uniform-decode) step padded to ``num_tokens``: a graph
    key of such steps is captured with the most requests that many tokens can hold (one
    token each), up to ``max_num_seqs``, so every step of that size fits it."""
    return min(num_tokens, max_num_seqs)


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """Describes the (padded) shape of one forward step.

    ``num_tokens`` is the padded size of the dynamic dimension. ``num_reqs`` and ``uniform``
    matter only to FULL graphs, whose attention metadata depends on the request layout;
    :meth:`relax_for_piecewise` drops them because piecewise graphs never contain attention.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False
    num_active_loras: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool):
            raise TypeError(f"BatchDescriptor.num_tokens must be an int, got {self.num_tokens!r}")
        if self.num_tokens < 0:
            raise ValueError(f"BatchDescriptor.num_tokens must be >= 0, got {self.num_tokens}")
        if self.num_reqs is not None and self.num_reqs < 0:
            raise ValueError(f"BatchDescriptor.num_reqs must be >= 0 or None, got {self.num_reqs}")

    def relax_for_piecewise(self) -> BatchDescriptor:
        """The key a PIECEWISE graph uses: request count and uniformity do not matter there."""
        return BatchDescriptor(
            num_tokens=self.num_tokens,
            num_reqs=None,
            uniform=False,
            has_lora=self.has_lora,
            num_active_loras=self.num_active_loras,
        )


@dataclasses.dataclass(frozen=True)
class MicroBatchSlice:
    """One micro-batch: half-open token range ``[token_start, token_stop)`` of the (padded) batch
    and half-open request range ``[req_start, req_stop)``.

    Ints rather than ``slice`` objects so the record is hashable on every Python we support.
    """

    token_start: int
    token_stop: int
    req_start: int
    req_stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.token_start <= self.token_stop:
            raise ValueError(
                f"MicroBatchSlice: token range [{self.token_start}, {self.token_stop}) must "
                "satisfy 0 <= start <= stop"
            )
        if not 0 <= self.req_start <= self.req_stop:
            raise ValueError(
                f"MicroBatchSlice: request range [{self.req_start}, {self.req_stop}) must satisfy "
                "0 <= start <= stop"
            )

    @property
    def token_slice(self) -> slice:
        return slice(self.token_start, self.token_stop)

    @property
    def request_slice(self) -> slice:
        return slice(self.req_start, self.req_stop)

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start

    @property
    def num_reqs(self) -> int:
        return self.req_stop - self.req_start

    def is_empty(self) -> bool:
        return self.num_tokens == 0 or self.num_reqs == 0


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
    """The outcome of planning one step.

    ``slices`` cover only the scheduled tokens (what each micro-batch really computes);
    ``padded_slices`` are the same except the last one, which reaches the padded token and request
    counts; the wrapper slices model inputs with ``padded_slices``. ``dp`` holds the per-micro-batch
    data-parallel metadata when a process group took part in the decision.
    """

    slices: tuple[MicroBatchSlice, ...]
    padded_slices: tuple[MicroBatchSlice, ...]
    num_tokens: int  # scheduled (unpadded) tokens
    num_tokens_padded: int
    dp: tuple[DPMicroBatchMetadata, ...] | None = None

    @property
    def num_micro_batches(self) -> int:
        return len(self.padded_slices)


@dataclasses.dataclass(frozen=True)
class DPMicroBatchMetadata:
    """What one micro-batch looks like on every data-parallel rank.

    ``num_tokens_across_dp[r]`` is the token count of this micro-batch on rank ``r``; collectives
    inside the micro-batch (all-to-all dispatch/combine) size their buffers from it.
    """

    num_tokens_across_dp: tuple[int, ...]

    @property
    def max_tokens_across_dp(self) -> int:
        return max(self.num_tokens_across_dp)

    @property
    def dp_size(self) -> int:
        return len(self.num_tokens_across_dp)
