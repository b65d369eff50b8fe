"""The turn-taking a micro-batched step runs by: the baton its threads pass, and the yield
points a model calls to pass it.

Only the thread holding the baton runs; the others wait, so kernel launches happen in one
well-defined order (which also keeps a CUDA graph capture legal). :class:`_Schedule` is the
baton, :class:`MicroBatchContext` what one micro-batch thread knows about itself, and the
module-level yield points (public as :mod:`freezeframe.ubatch`) find that context through a
context variable, so outside a micro-batched step every one of them is a no-op. Who starts the
threads and hands out the first turn is :mod:`freezeframe.runtime.ubatch.threads`.

Streams. On CUDA every micro-batch computes on the caller's current stream (the *compute*
stream) and communicates on the wrapper's *comm* stream. ``yield_to_comm()`` records "my compute
is done", passes the baton, and on resuming makes the comm stream wait for that event before the
communication kernels are launched; ``yield_to_compute()`` is the mirror image. On CPU there are
no streams: the baton alone orders the work.

Model side. A model calls the yield points through :mod:`freezeframe.ubatch`::

    h = self.mlp_in(x)
    ff.ubatch.yield_to_comm()        # my compute is queued; let the next micro-batch compute
    h = all_to_all(h)                # launched on the comm stream
    ff.ubatch.yield_to_compute()     # let the next micro-batch communicate; back to compute
    y = self.mlp_out(h)

Yield points must not be traced: inside a compiled model, call them from the Python body of a
custom op (the communication op itself, or a splitting op), which Dynamo records as one call and
which runs, and yields, at execution time. A tensor allocated on the comm stream and read later
on the compute stream belongs to the comm stream's allocator pool; call
``t.record_stream(torch.cuda.current_stream())`` after switching back if it may be freed while
the compute stream still reads it (the usual PyTorch multi-stream rule). freezeframe does that
for every tensor an op *dispatched through torch* reads or writes while a micro-batch is on the
comm stream (a custom op, a c10d collective, an ATen op): inputs are marked as used by the comm
stream and outputs as used by the compute stream (see :class:`_CommStreamUses`), so the other
micro-batch's allocations cannot take their memory while the comm kernels still read it. A
kernel launched without going through torch's dispatcher (a raw Triton or CUDA-extension call)
is invisible there: wrap it in a custom op, or call ``record_stream`` yourself.

Deadlines. If one micro-batch fails, the schedule is aborted and every thread waiting for the
baton unwinds (:class:`_Aborted`); every wait has a deadline, so a thread that never yields
again becomes a :class:`~freezeframe.errors.MicroBatchError` naming the micro-batch, never a
hang.

SM partitioning. ``sm_partition`` is an optional callable ``(micro_batch_index) ->
context manager``, entered when a micro-batch switches to communication and exited when it
switches back (or finishes).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from freezeframe.errors import MicroBatchError
from freezeframe.runtime.ubatch.slicing import MicroBatchSlice

__all__ = [
    "MicroBatchContext",
    "comm_section",
    "current_micro_batch",
    "in_micro_batch",
    "yield_",
    "yield_to_comm",
    "yield_to_compute",
]

_POLL_S = 0.05  # how often a waiting thread re-checks the abort flag


class _Aborted(BaseException):
    """Raised inside a waiting micro-batch thread when a sibling failed; unwinds it quietly.

    A ``BaseException`` so that a model's ``except Exception`` cannot swallow it."""


# -- the baton ----------------------------------------------------------------------------------


class _Schedule:
    """Round-robin baton among ``n`` micro-batch threads, with abort and deadlines.

    ``turn`` is the index allowed to run. Passing the baton moves it to the next micro-batch that
    has not finished; a thread whose siblings have all finished keeps running without waiting,
    so micro-batches need not yield the same number of times.
    """

    def __init__(self, n: int, timeout_s: float) -> None:
        self.n = n
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.turn: int | None = None  # None until the main thread starts micro-batch 0
        self.finished: set[int] = set()
        self.aborted = False
        self.errors: list[tuple[int, BaseException]] = []
        self.trace: list[tuple[int, str]] = []
        self.compute_stream: Any = None  # set by the main thread right before starting

    def note(self, index: int, event: str) -> None:
        with self.cond:
            self.trace.append((index, event))

    def start(self) -> None:
        with self.cond:
            self.turn = 0
            self.cond.notify_all()

    def _next_after(self, index: int) -> int | None:
        for step in range(1, self.n + 1):
            cand = (index + step) % self.n
            if cand not in self.finished:
                return cand
        return None

    def wait_turn(self, index: int, where: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while self.turn != index:
                if self.aborted:
                    raise _Aborted
                left = deadline - time.monotonic()
                if left <= 0:
                    self.aborted = True
                    self.cond.notify_all()
                    holder = "nobody (not started)" if self.turn is None else f"{self.turn}"
                    raise MicroBatchError(
                        f"micro-batch {index} waited {self.timeout_s:.1f}s for its turn at "
                        f"{where} while micro-batch {holder} held it; a micro-batch that never "
                        "reaches its next yield point (a deadlock or a very slow op) stalls the "
                        "schedule. Raise the wrapper's timeout_s if the work is just slow")
                self.cond.wait(min(left, _POLL_S))
            if self.aborted:
                raise _Aborted

    def pass_baton(self, index: int) -> None:
        with self.cond:
            nxt = self._next_after(index)
            self.turn = index if nxt is None else nxt
            self.cond.notify_all()

    def finish(self, index: int) -> None:
        with self.cond:
            self.finished.add(index)
            if self.turn == index:
                nxt = self._next_after(index)
                self.turn = nxt if nxt is not None else self.turn
            self.cond.notify_all()

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def fail(self, index: int, exc: BaseException) -> None:
        with self.cond:
            self.errors.append((index, exc))
            self.aborted = True
            self.finished.add(index)
            self.cond.notify_all()


# -- the per-thread context --------------------------------------------------------------------


class _CommStreamUses(TorchDispatchMode):
    """Entered by a micro-batch thread while it is on the comm stream: every CUDA tensor an op
    reads is marked as used by the comm stream, every CUDA tensor it returns as used by the
    compute stream (``Tensor.record_stream``).

    Why: the caching allocator hands a freed block to the next allocation *of the stream that
    allocated it* at once. ``h = all_to_all(h)`` frees the compute-stream tensor the comm kernel
    is still reading, and the other micro-batch, computing meanwhile, would be given its memory;
    likewise a comm output read later on the compute stream. A recorded use makes the
    allocator wait for the using stream (inside a CUDA capture: not reuse the block until the
    capture ends)."""

    def __init__(self, comm: torch.cuda.Stream, compute: torch.cuda.Stream) -> None:
        super().__init__()
        self.comm = comm
        self.compute = compute

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # torch.compile'd code in a comm section: compiled as usual, then seen

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self.comm)
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self.compute)
        return out


@dataclasses.dataclass
class MicroBatchContext:
    """What one micro-batch thread knows about itself; :func:`current_micro_batch` returns it."""

    index: int
    num_micro_batches: int
    slice: MicroBatchSlice
    _schedule: _Schedule = dataclasses.field(repr=False)
    comm_stream: Any = dataclasses.field(default=None, repr=False)
    sm_partition: Callable[[int], contextlib.AbstractContextManager[Any]] | None = \
        dataclasses.field(default=None, repr=False)
    _compute_done: Any = dataclasses.field(default=None, repr=False)  # torch.cuda.Event
    _comm_done: Any = dataclasses.field(default=None, repr=False)
    _on_comm: bool = dataclasses.field(default=False, repr=False)
    _sm_cm: contextlib.AbstractContextManager[Any] | None = \
        dataclasses.field(default=None, repr=False)
    _uses: _CommStreamUses | None = dataclasses.field(default=None, repr=False)

    @property
    def compute_stream(self) -> Any:
        return self._schedule.compute_stream

    @property
    def on_comm_stream(self) -> bool:
        return self._on_comm

    # the three transitions ------------------------------------------------------------------
    def _yield(self, event: str) -> None:
        self._schedule.note(self.index, event)
        self._schedule.pass_baton(self.index)
        self._schedule.wait_turn(self.index, event)

    def yield_(self) -> None:
        """Let the next micro-batch run; stay on the current stream."""
        self._yield("yield")

    def yield_to_comm(self) -> None:
        if self._on_comm:
            raise MicroBatchError(
                f"micro-batch {self.index}: yield_to_comm() while already communicating; "
                "pair every yield_to_comm() with a yield_to_compute()")
        if self._compute_done is not None:
            self._compute_done.record(self.compute_stream)
        self._yield("to_comm")
        if self.comm_stream is not None:
            torch.cuda.set_stream(self.comm_stream)
            # communication must see this micro-batch's finished compute, nothing more
            self.comm_stream.wait_event(self._compute_done)
            self._uses = _CommStreamUses(self.comm_stream, self.compute_stream)
            self._uses.__enter__()
        self._on_comm = True
        if self.sm_partition is not None:
            self._sm_cm = self.sm_partition(self.index)
            self._sm_cm.__enter__()

    def yield_to_compute(self) -> None:
        if not self._on_comm:
            raise MicroBatchError(
                f"micro-batch {self.index}: yield_to_compute() without a preceding "
                "yield_to_comm(); the model's yield points are unbalanced")
        self._leave_sm_partition()
        if self._comm_done is not None:
            self._comm_done.record(self.comm_stream)
        self._yield("to_compute")
        if self.comm_stream is not None:
            torch.cuda.set_stream(self.compute_stream)
            self.compute_stream.wait_event(self._comm_done)
        self._on_comm = False

    def _leave_sm_partition(self) -> None:
        """Leave what a comm section entered: the SM partition and the stream-use recorder."""
        cm, self._sm_cm = self._sm_cm, None
        if cm is not None:
            cm.__exit__(None, None, None)
        uses, self._uses = self._uses, None
        if uses is not None:
            uses.__exit__(None, None, None)

    def _rejoin_compute(self) -> None:
        """At the end of the micro-batch: the caller's stream must wait for any communication
        still in flight (also what joins the comm stream back into a CUDA capture)."""
        self._leave_sm_partition()
        if self._on_comm and self.comm_stream is not None:
            self._comm_done.record(self.comm_stream)
            torch.cuda.set_stream(self.compute_stream)
            self.compute_stream.wait_event(self._comm_done)
        self._on_comm = False


_CURRENT: contextvars.ContextVar[MicroBatchContext | None] = contextvars.ContextVar(
    "freezeframe_micro_batch", default=None
)


def current_micro_batch() -> MicroBatchContext | None:
    """The micro-batch this thread runs, or ``None`` outside a micro-batched step."""
    return _CURRENT.get()


def in_micro_batch() -> bool:
    return _CURRENT.get() is not None


def yield_() -> None:
    """Hand the baton to the next micro-batch (no stream change). No-op when not split."""
    ctx = _CURRENT.get()
    if ctx is not None:
        ctx.yield_()


def yield_to_comm() -> None:
    """Call right before launching communication: this micro-batch's compute so far is marked
    done, the next micro-batch gets to launch its compute, then this one continues on the comm
    stream. No-op when not split."""
    ctx = _CURRENT.get()
    if ctx is not None:
        ctx.yield_to_comm()


def yield_to_compute() -> None:
    """Call right after launching communication: the next micro-batch gets to run, then this one
    continues on the compute stream, ordered after its communication. No-op when not split."""
    ctx = _CURRENT.get()
    if ctx is not None:
        ctx.yield_to_compute()


@contextlib.contextmanager
def comm_section() -> Iterator[None]:
    """``with ff.ubatch.comm_section(): all_to_all(...)``: yield_to_comm on entry and
    yield_to_compute on exit (not on an exception: the step is being unwound anyway)."""
    yield_to_comm()
    yield
    yield_to_compute()

