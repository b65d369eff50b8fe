"""One micro-batched step in flight: a thread per micro-batch, started, run turn by turn, joined.

:class:`MicroBatchRun` starts one thread per micro-batch and waits at a barrier until each has
made its CUDA events and handles (so none of that happens inside a capture); nobody runs the
model until :meth:`MicroBatchRun.finish` hands micro-batch 0 the baton of
:mod:`freezeframe.runtime.ubatch.schedule`. Each thread runs its slices of the arguments
(:class:`MicroBatchWork`) under its own forward context, and ``finish`` joins them and
concatenates their outputs along dim 0 in the caller's thread (:func:`concat_outputs`), so in a
capture the concatenation is part of the graph.

Failure. If one micro-batch raises, the schedule is aborted: every thread waiting for the baton
wakes up and unwinds, and the caller gets the original exception. Every wait has a deadline, so a
thread that never yields again (a deadlock in user code) becomes a :class:`MicroBatchError`
naming the micro-batch, never a hang. An interrupted caller (a signal, ``KeyboardInterrupt``)
unwinds the threads before the exception leaves. Once the threads are done, torch's process-wide
compile stance is what it was before the step (:func:`compile_stance_kept`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from freezeframe.context import ForwardContext, entered
from freezeframe.errors import MicroBatchError
from freezeframe.runtime.outputs import join_outputs
from freezeframe.runtime.ubatch.schedule import (
    _CURRENT,
    _POLL_S,
    MicroBatchContext,
    _Aborted,
    _Schedule,
)
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan

__all__ = ["MicroBatchRun", "MicroBatchWork", "compile_stance_kept", "concat_outputs"]


@contextlib.contextmanager
def compile_stance_kept() -> Iterator[None]:
    """Put torch's compile stance back as it was once the micro-batch threads are done.

    The stance is one process-wide value, and a compiled model whose Dynamo bytecode cannot be
    reused enters and leaves ``torch.compiler.set_stance("fail_on_recompile")`` around each of
    its calls. Each micro-batch thread yields *inside* such a call, so the threads leave it in
    a different order than they entered it, and the last one to leave restores the stance the
    first one set: ``fail_on_recompile`` would stay on for the whole process, and an unrelated
    ``torch.compile`` / ``ff.compile`` would then fail its first call. The stance this step
    started with is restored (only if it changed), after every thread has joined or unwound.
    """
    from torch._dynamo import eval_frame

    before = getattr(eval_frame, "_stance", None)
    try:
        yield
    finally:
        if before is not None and getattr(eval_frame, "_stance", None) is not before:
            eval_frame._set_stance(before)


def concat_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate per-micro-batch outputs along dim 0, leaf by leaf, in every container the
    runner's output cut knows (tuples, dicts, dataclasses, pytree nodes)."""
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(list(outputs), dim=0)
    return join_outputs(outputs, lambda leaves: torch.cat(leaves, dim=0))


@dataclasses.dataclass(frozen=True)
class MicroBatchWork:
    """What one micro-batch thread runs: its forward context and its slices of the arguments."""

    context: ForwardContext
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class MicroBatchRun:
    """One micro-batched step in flight: its threads, schedule and per-thread results."""

    def __init__(self, plan: MicroBatchPlan, work: list[MicroBatchWork], comm: Any,
                 call: Callable[..., Any], *, timeout_s: float,
                 sm_partition: Callable[[int], contextlib.AbstractContextManager[Any]] | None,
                 keep_trace: Callable[[list[tuple[int, str]]], None]) -> None:
        n = plan.num_micro_batches
        self.timeout_s = timeout_s
        self.sm_partition = sm_partition
        self.keep_trace = keep_trace  # handed the order the micro-batches ran in, at the end
        self.call = call  # what each micro-batch runs (the model, or its forward when hooked)
        self.plan = plan
        self.work = work
        self.comm = comm  # the comm stream, on CUDA
        self.device = torch.cuda.current_device() if comm is not None else None
        self.inference = torch.is_inference_mode_enabled()
        self.grad = torch.is_grad_enabled()
        self.sched = _Schedule(n, timeout_s)
        self.barrier = threading.Barrier(n + 1, timeout=timeout_s)
        self.results: list[Any] = [None] * n
        self.threads: list[threading.Thread] = []
        # entered by each thread around its work (set by a capture the threads run inside)
        self.join_capture: Callable[[], contextlib.AbstractContextManager[Any]] = \
            contextlib.nullcontext

    def start(self) -> None:
        """Start the threads and wait at the barrier until each has initialised."""
        self.threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(self._body, i),
                             name=f"freezeframe-ubatch-{i}", daemon=True)
            for i in range(self.plan.num_micro_batches)
        ]
        try:
            for t in self.threads:
                t.start()
            self.barrier.wait()
        except threading.BrokenBarrierError:
            self.sched.abort()  # a thread failed (or stalled) before starting; finish() says
        except BaseException:
            self.abort()  # interrupted (a signal, KeyboardInterrupt): no thread may outlive us
            raise

    def _init_cuda(self, ctx: MicroBatchContext) -> None:
        """Create this thread's events and cuBLAS handles now: creating them during a capture
        is not allowed."""
        torch.cuda.set_device(self.device)
        ctx._compute_done, ctx._comm_done = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(self.comm):
            ctx._compute_done.record()
            ctx._comm_done.record()
            torch.cuda.current_blas_handle()
        torch.cuda.current_blas_handle()

    def _body(self, index: int) -> None:
        sched, work = self.sched, self.work[index]
        ctx = MicroBatchContext(index=index, num_micro_batches=self.plan.num_micro_batches,
                                slice=self.plan.padded_slices[index], _schedule=sched,
                                comm_stream=self.comm, sm_partition=self.sm_partition)
        try:
            if self.comm is not None:
                self._init_cuda(ctx)
            self.barrier.wait()
            sched.wait_turn(index, "start")
            if self.comm is not None:
                torch.cuda.set_stream(sched.compute_stream)
            sched.note(index, "start")
            grad_mode = (torch.inference_mode() if self.inference
                         else torch.set_grad_enabled(self.grad))
            token = _CURRENT.set(ctx)
            try:
                with grad_mode, entered(work.context), self.join_capture():
                    self.results[index] = self.call(*work.args, **work.kwargs)
                ctx._rejoin_compute()
            finally:
                ctx._leave_sm_partition()
                _CURRENT.reset(token)
            sched.note(index, "end")
            sched.finish(index)
        except (_Aborted, threading.BrokenBarrierError):
            sched.finish(index)
        except BaseException as exc:  # handed to the main thread, re-raised there
            sched.fail(index, exc)
            self.barrier.abort()

    def finish(self) -> Any:
        """Hand micro-batch 0 the baton on the caller's current stream, join every thread,
        re-raise the first failure, and concatenate the outputs (in the caller's thread, so in
        a capture the concatenation is part of the graph)."""
        sched, n, timeout_s = self.sched, self.plan.num_micro_batches, self.timeout_s
        sched.compute_stream = torch.cuda.current_stream() if self.comm is not None else None
        deadline = time.monotonic() + timeout_s * (n + 1)
        try:
            if not sched.aborted:
                sched.start()
            for i, t in enumerate(self.threads):
                t.join(max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    sched.abort()
                    t.join(2 * _POLL_S + 1.0)
                if t.is_alive():
                    raise MicroBatchError(
                        f"micro-batch {i} of {n} did not finish within "
                        f"{timeout_s * (n + 1):.1f}s ({self.plan.num_tokens_padded} tokens); it "
                        "is stuck outside a yield point, so it cannot be unwound. Raise "
                        "timeout_s if the step is just slow")
        except MicroBatchError:
            raise  # a stuck thread: already aborted, and it cannot be unwound
        except BaseException:
            # This thread was interrupted (a signal, KeyboardInterrupt) while the micro-batches
            # ran: they must stop at their next yield point before the exception leaves,
            # or they would go on writing into the buffers the caller's next step uses.
            self.abort()
            raise
        finally:
            self.keep_trace(list(sched.trace))
        if sched.errors:
            index, exc = sched.errors[0]
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised in micro-batch {index} of {n}; the others were unwound)")
            raise exc
        if sched.aborted:
            raise MicroBatchError(
                f"micro-batched step of {self.plan.num_tokens_padded} tokens was aborted before "
                f"it started: not all {n} micro-batch threads reached the start barrier within "
                f"{timeout_s:.1f}s")
        return concat_outputs(self.results)

    def abort(self) -> None:
        """Unwind the threads: the capture around them failed, or the caller was interrupted.
        Each stops at its next yield point (or at the start barrier)."""
        self.sched.abort()
        self.barrier.abort()
        for t in self.threads:
            if t.ident is not None:  # started
                t.join(self.timeout_s)
