"""The forward context: what the current step is, visible to every graph wrapper it reaches.

A :class:`contextvars.ContextVar` rather than vLLM's module global, so that each micro-batch
thread (and each asyncio task) sees its own step without locks.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from freezeframe.batch import (
    BatchDescriptor,
    DPMicroBatchMetadata,
    MicroBatchPlan,
    MicroBatchSlice,
)
from freezeframe.config import CUDAGraphMode

__all__ = ["ForwardContext", "entered", "forward_context", "get_forward_context"]

_RUNTIME_MODES = CUDAGraphMode.valid_runtime_modes()


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """One step as the graph wrappers and the model's ops see it.

    ``mode`` and ``batch_descriptor`` say which graph (if any) the step replays. The typed
    fields below are the library's own step data; ``extras`` is the caller's alone (attention
    metadata, a tag...), read-only, and the library never puts anything there.
    """

    mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None
    extras: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    #: the step's real token and request counts, before padding (set by ``GraphRunner``)
    num_tokens_unpadded: int | None = None
    num_reqs_unpadded: int | None = None
    #: a warm-up or capture dummy step of ``GraphRunner.capture()``: every row is padding
    capturing: bool = False
    #: how a CUDA capture in this step treats other threads' CUDA calls: ``"global"`` (they
    #: fail) or ``"thread_local"`` (they run; a background capture's setting)
    capture_error_mode: str = "global"
    #: the step's micro-batch plan, for the micro-batch wrapper to split
    micro_batches: MicroBatchPlan | None = None
    #: inside one micro-batch's thread: its ``MicroBatchSlice``, its index and, with data
    #: parallelism, its per-rank token counts
    micro_batch: MicroBatchSlice | None = None
    micro_batch_index: int | None = None
    dp_metadata: DPMicroBatchMetadata | None = None
    #: whose buffers the step's tensors are (a ``GraphRunner`` sets its static buffers; None
    #: for a low-level call): a graph captured in the step is stamped with it, so a runner
    #: replays only graphs captured on its own buffers
    owner: object | None = None

    def __post_init__(self) -> None:
        if self.mode not in _RUNTIME_MODES:
            raise ValueError(
                f"forward context mode must be a runtime mode (NONE, PIECEWISE or FULL), got "
                f"{self.mode.name}; dispatch a config mode such as FULL_AND_PIECEWISE to a "
                "runtime mode first (Dispatcher.dispatch does this)"
            )
        if self.mode is not CUDAGraphMode.NONE and self.batch_descriptor is None:
            raise ValueError(
                f"forward context mode {self.mode.name} needs a batch descriptor: graphs are "
                "stored per descriptor; pass batch_descriptor=BatchDescriptor(num_tokens=...)"
            )


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "freezeframe_forward_context", default=None
)


def get_forward_context() -> ForwardContext | None:
    """The context of the step being run in this thread/task, or ``None`` outside any step."""
    return _CURRENT.get()


@contextlib.contextmanager
def forward_context(
    batch_descriptor: BatchDescriptor | int | None = None,
    mode: CUDAGraphMode | str = CUDAGraphMode.NONE,
    *,
    num_tokens_unpadded: int | None = None,
    num_reqs_unpadded: int | None = None,
    capturing: bool = False,
    capture_error_mode: str = "global",
    micro_batches: Any = None,
    owner: object | None = None,
    **extras: Any,
) -> Iterator[ForwardContext]:
    """Run the ``with`` block as one step with the given runtime mode and descriptor.

    ``batch_descriptor`` may be an int, meaning ``BatchDescriptor(num_tokens=n)``. The keyword
    arguments named here set the context's typed fields; any other keyword is the caller's and
    goes to ``extras``. Contexts nest: the inner one wins until it exits, then the outer one is
    back.
    """
    desc: BatchDescriptor | None
    if owner is not None:
        try:
            weakref.ref(owner)
        except TypeError:
            raise TypeError(
                f"owner: the graph wrappers hold it weakly, but {type(owner).__name__} "
                "objects cannot be weakly referenced; pass an instance of a plain class (a "
                "runner passes its static buffers) or None") from None
    if isinstance(batch_descriptor, bool):
        raise TypeError(
            f"batch_descriptor: expected a BatchDescriptor or int, got {batch_descriptor!r}")
    if isinstance(batch_descriptor, int):
        desc = BatchDescriptor(num_tokens=batch_descriptor)
    else:
        desc = batch_descriptor
    ctx = ForwardContext(
        mode=CUDAGraphMode.parse(mode),
        batch_descriptor=desc,
        extras=MappingProxyType(dict(extras)),
        num_tokens_unpadded=num_tokens_unpadded,
        num_reqs_unpadded=num_reqs_unpadded,
        capturing=capturing,
        capture_error_mode=capture_error_mode,
        micro_batches=micro_batches,
        owner=owner,
    )
    with entered(ctx):
        yield ctx


class entered:  # lower case: it is used like a function, ``with entered(ctx):``
    """Make ``ctx`` (built whole, e.g. with :func:`dataclasses.replace`) the current context
    for the ``with`` block. A class rather than a generator: a runner's planned step enters
    one on every step, and this costs a third of a ``contextlib.contextmanager``."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: ForwardContext) -> None:
        self._ctx = ctx

    def __enter__(self) -> ForwardContext:
        self._token = _CURRENT.set(self._ctx)
        return self._ctx

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)
