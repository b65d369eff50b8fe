"""The model called over the runner's static buffers, inside a forward context.

Every forward a runner makes (a step, a warm-up, a capture pass, a lazy capture) is the same
call: the buffer views of the padded size, the forward context that tells the graph wrappers
which graph to capture or replay (mode and padded descriptor, the real token and request
counts, the micro-batch split), the model called by name or by position. This object makes
that call; the runner's steps and its capture transaction both use it.

On CUDA the call runs with the runner's device current (:func:`device_current`): a capture
records the kernels launched on the current device's capture stream, so a ``cuda:1`` runner
called from a thread whose current device is 0 (any thread starts there, the background
capture's too) would otherwise capture an empty graph while its kernels ran eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from freezeframe.batch import BatchDescriptor
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import forward_context
from freezeframe.runtime.buffers import StaticBuffers
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan, plan_for_step

__all__ = ["ModelForward", "device_current"]


def device_current(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` made the current CUDA device for the ``with`` block when it is not already
    (nothing to do for a CPU device, or when it is current)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


class ModelForward:
    """``model`` (or the micro-batch wrapper around it) run on ``static``'s buffer views."""

    def __init__(self, model: Callable[..., Any], static: StaticBuffers,
                 config: CompilationConfig, *, call_positional: bool,
                 ubatch: MicroBatchWrapper | None, query_len: int, dp_sync: bool,
                 dp_group: Any) -> None:
        self.model = model
        self.static = static
        self.config = config
        self.call_positional = call_positional
        self.ubatch = ubatch  # split steps run through it (it calls the model unsplit too)
        self._query_len = query_len  # tokens per request of a uniform decode step
        self._dp_sync, self._dp_group = dp_sync, dp_group

    def __call__(self, mode: CUDAGraphMode, desc: BatchDescriptor, padded_tokens: int,
                 padded_reqs: int | None, num_tokens: int, reqs: int | None,
                 extras: Mapping[str, Any], plan: MicroBatchPlan | None, *,
                 capturing: bool = False, error_mode: str = "global") -> Any:
        views = self.static.views(padded_tokens, padded_reqs)
        model = self.ubatch if self.ubatch is not None else self.model
        # Inference only: no autograd graph may hang on the static buffers or graph outputs.
        with device_current(self.static.device), torch.no_grad(), forward_context(
                desc, mode=mode, num_tokens_unpadded=num_tokens, num_reqs_unpadded=reqs,
                capturing=capturing, capture_error_mode=error_mode, micro_batches=plan,
                owner=self.static, **extras):
            if self.call_positional:
                return model(*views.values())
            return model(**views)

    def arguments(self, padded_tokens: int, padded_reqs: int | None
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The model's arguments at this padded size, as the call passes them."""
        views = self.static.views(padded_tokens, padded_reqs)
        return (tuple(views.values()), {}) if self.call_positional else ((), views)

    def micro_batches(self, num_scheduled_tokens: Sequence[int] | None, num_tokens: int,
                      reqs: int | None, padded_tokens: int, padded_reqs: int | None,
                      uniform: bool) -> MicroBatchPlan | None:
        """This step's micro-batch split, or None: run unsplit."""
        if self.ubatch is None:
            return None
        return plan_for_step(
            self.config, num_tokens, reqs, padded_tokens, padded_reqs, uniform_decode=uniform,
            query_len=self._query_len, num_scheduled_tokens=num_scheduled_tokens,
            dp_group=self._dp_group, sync=self._dp_sync)
