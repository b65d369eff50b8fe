"""Run one step as micro-batches on threads, so one micro-batch's communication overlaps
another's compute (dual-batch overlap).

Why threads. A model's forward is ordinary Python that launches kernels in order. To overlap
micro-batch 0's all-to-all with micro-batch 1's matmuls, the *launches* must interleave: 0's
compute, then 0's communication on a second stream, then 1's compute while 0's communication
runs, and so on. Running each micro-batch's forward on its own thread and passing a *baton*
between them at the model's yield points gives exactly that interleaving without rewriting the
model as a state machine. Only the thread holding the baton runs; the others wait, so launches
happen in one well-defined order (which also keeps a CUDA graph capture legal).

Streams. On CUDA every micro-batch computes on the caller's current stream (the *compute*
stream) and communicates on the wrapper's *comm* stream. ``yield_to_comm()`` records "my compute
is done", passes the baton, and on resuming makes the comm stream wait for that event before the
communication kernels are launched; ``yield_to_compute()`` is the mirror image. On CPU there are
no streams: the baton alone orders the work, and the recorded :attr:`MicroBatchWrapper.last_trace`
makes the order observable.

Model side. A model calls the yield points through :mod:`freezeframe.ubatch`::

    h = self.mlp_in(x)
    ff.ubatch.yield_to_comm()        # my compute is queued; let the next micro-batch compute
    h = all_to_all(h)                # launched on the comm stream
    ff.ubatch.yield_to_compute()     # let the next micro-batch communicate; back to compute
    y = self.mlp_out(h)

Outside a micro-batched step every yield point is a no-op, so the same model runs unsplit.

Yield points must not be traced: inside a compiled model, call them from the Python body of a
custom op (the communication op itself, or a splitting op), which Dynamo records as one call and
which runs, and yields, at execution time. A tensor allocated on the comm stream and read later
on the compute stream belongs to the comm stream's allocator pool; call
``t.record_stream(torch.cuda.current_stream())`` after switching back if it may be freed while
the compute stream still reads it (the usual PyTorch multi-stream rule).

Failure. If one micro-batch raises, the schedule is aborted: every thread waiting for the baton
wakes up and unwinds, and the caller gets the original exception. Every wait has a deadline, so a
thread that never yields again (a deadlock in user code) becomes a :class:`MicroBatchError`
naming the micro-batch, never a hang. Once the threads are done, torch's process-wide compile
stance is what it was before the step (see :func:`_compile_stance_kept`).

Graphs. With ``runtime_mode`` FULL and a graph backend, the first split step of a padded size is
captured: the threads run inside one capture and the graph is stored under the *total* token
count; later steps of that size replay it without starting any thread. On the ``cuda`` backend
the worker threads launch onto the capturing stream (and the comm stream, which joins the
capture through the events above). The ``emulated`` backend records with a thread-local
dispatch mode that worker threads cannot see, so there each micro-batch records its own
emulated graph inside its thread and the stored graph replays them in micro-batch order followed
by the main thread's concatenation (micro-batches touch disjoint tokens, so that order computes
the same result as the interleaved one). A step that arrives unsplit at a size whose graph was
captured split runs eagerly and counts ``micro_batch_fallbacks``: replaying the split graph
would compute a different request layout, and capturing a second graph for the same key would
replace the first.

SM partitioning. ``sm_partition`` is an optional callable ``(micro_batch_index) ->
context manager``, entered when a micro-batch switches to communication and exited when it
switches back (or finishes). Communication libraries that can cap their SM count (DeepEP-style
all-to-all, or a compute library with ``set_num_sms``) use it to leave SMs to the other
micro-batch's compute. The default does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch.utils import _pytree as pytree

from freezeframe.batch import BatchDescriptor
from freezeframe.config import CUDAGraphMode
from freezeframe.context import ForwardContext, entered, get_forward_context
from freezeframe.errors import CaptureError, FreezeframeError
from freezeframe.graphs.capturable import Capturable
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan, MicroBatchSlice
from freezeframe.stats import Stats

__all__ = [
    "MicroBatchContext",
    "MicroBatchError",
    "MicroBatchWrapper",
    "comm_section",
    "current_micro_batch",
    "in_micro_batch",
    "yield_",
    "yield_to_comm",
    "yield_to_compute",
]

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting thread re-checks the abort flag


class MicroBatchError(FreezeframeError, RuntimeError):
    """A micro-batched step could not complete: a thread timed out or the schedule broke."""


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
        cm, self._sm_cm = self._sm_cm, None
        if cm is not None:
            cm.__exit__(None, None, None)

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


# -- process-wide state the threads may disturb ------------------------------------------------


@contextlib.contextmanager
def _compile_stance_kept() -> Iterator[None]:
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


# -- the wrapper --------------------------------------------------------------------------------


class _SplitGraph:
    """A split capture: the main graph plus (emulated backend only) one graph per micro-batch
    thread, replayed in micro-batch order before the main graph's concatenation."""

    __slots__ = ("main", "outputs", "plan", "threads")

    def __init__(self, main: Any, threads: list[Any], outputs: Any, plan: MicroBatchPlan):
        self.main = main
        self.threads = threads
        self.outputs = outputs
        self.plan = plan

    def replay(self) -> None:
        for graph in self.threads:
            graph.replay()
        self.main.replay()


def _slice_arg(value: Any, sl: MicroBatchSlice, num_tokens_padded: int,
               kind: str | None = None) -> Any:
    """Slice one model argument for micro-batch ``sl``.

    ``kind`` ("tokens", "requests", "static") comes from the runner's input specs when known.
    Without it, a tensor whose dim 0 is ``num_tokens_padded`` is taken to be per-token and
    sliced; anything else (weights, scalars, per-request tensors of another size) is shared.
    A per-request tensor is sliced by the (padded) request range, straddling requests included.
    """
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or kind == "static":
        return value
    if kind == "requests":
        return value[sl.req_start:sl.req_stop]
    if kind == "tokens" or (kind is None and value.shape[0] == num_tokens_padded):
        return value[sl.token_start:sl.token_stop]
    return value


def _concat(outputs: Sequence[Any]) -> Any:
    """Concatenate per-micro-batch outputs along dim 0, leaf by leaf (tensor, tuple, dict)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs), dim=0)
    leaves0, spec = pytree.tree_flatten(first)
    columns = [pytree.tree_flatten(out)[0] for out in outputs]
    joined = []
    for i, leaf in enumerate(leaves0):
        if isinstance(leaf, torch.Tensor):
            joined.append(torch.cat([col[i] for col in columns], dim=0))
        else:
            joined.append(leaf)
    return pytree.tree_unflatten(joined, spec)


class MicroBatchWrapper:
    """Runs ``runnable`` as micro-batches when the forward context carries a plan.

    Used by the runner in place of the FULL :class:`~freezeframe.graphs.GraphWrapper` when
    ``config.micro_batching`` is on. The step's plan (:class:`MicroBatchPlan`, from
    :func:`~freezeframe.runtime.ubatch.slicing.plan_micro_batches`) is read from the forward
    context's ``micro_batches`` field; without one the step runs unsplit (through
    ``unsplit`` — typically a FULL GraphWrapper — or ``runnable``).

    Inputs: every tensor argument whose dim 0 equals the padded token count is sliced per
    micro-batch; other arguments are shared. Outputs are concatenated along dim 0 in micro-batch
    order. ``slice_extras(index, slice, parent_extras) -> dict`` may add per-micro-batch extras
    (attention metadata from :func:`~freezeframe.runtime.ubatch.slicing.slice_attention_metadata`,
    ...) to each thread's forward context.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        *,
        runtime_mode: CUDAGraphMode = CUDAGraphMode.FULL,
        backend: Any = None,
        unsplit: Callable[..., Any] | None = None,
        stats: Stats | None = None,
        window: Any = None,
        device: torch.device | int | None = None,
        timeout_s: float = 300.0,
        sm_partition: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
        slice_extras: Callable[[int, MicroBatchSlice, Mapping[str, Any]], Mapping[str, Any]]
        | None = None,
        input_kinds: Mapping[str | int, str] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"MicroBatchWrapper: timeout_s must be > 0, got {timeout_s}")
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.backend = backend
        self.unsplit = unsplit if unsplit is not None else runnable
        self.stats = stats if stats is not None else Stats()
        self.window = window
        self.timeout_s = float(timeout_s)
        self.sm_partition = sm_partition
        self.slice_extras = slice_extras
        # argument name (or position) -> "tokens" | "requests" | "static"
        self.input_kinds: Mapping[str | int, str] = dict(input_kinds or {})
        self._device = device
        self._comm_stream: Any = None  # created on first CUDA use
        self.graphs: dict[int, _SplitGraph] = {}  # total padded tokens -> split capture
        self.last_trace: list[tuple[int, str]] = []

    @classmethod
    def for_runner(cls, model: Callable[..., Any], config: Any, *,
                   input_kinds: Mapping[str | int, str] | None = None,
                   stats: Stats | None = None) -> MicroBatchWrapper:
        """The wrapper a :class:`~freezeframe.runtime.GraphRunner` puts around ``model`` when
        ``config.micro_batching`` is on.

        It sits *above* the model, so the model's own FULL wrapper handles unsplit steps, and
        inside a micro-batch (mode NONE) every wrapper of the model calls through. Split FULL
        graphs are captured here with a backend resolved from the config (on CUDA its own pool,
        separate from the model's) and the model's capture window.
        """
        backend = None
        if config.cudagraph_mode.has_full_cudagraphs():
            from freezeframe.graphs import resolve_backend

            backend = resolve_backend(config)
        held = model if isinstance(model, Capturable) else None
        return cls(model, backend=backend, unsplit=model,
                   stats=held.stats if held is not None else stats,
                   window=held.capture_window if held is not None else None,
                   input_kinds=input_kinds)

    def clear(self) -> None:
        """Drop every split graph (the next split step of each size captures again)."""
        self.graphs.clear()

    # -- entry --------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fctx = get_forward_context()
        plan: MicroBatchPlan | None = fctx.micro_batches if fctx is not None else None
        mode = fctx.mode if fctx is not None else CUDAGraphMode.NONE
        if plan is None:
            return self._run_unsplit(fctx, mode, args, kwargs)
        if getattr(self.runnable, "traced", True) is False:
            # A compiled model traces on its first call and holds its trace lock across that
            # whole call; a micro-batch yielding inside it would stall its siblings on the
            # lock. So the first call runs unsplit (and eagerly: nothing is captured).
            assert fctx is not None
            self.stats.inc("micro_batch_unsplit_first_calls")
            with entered(dataclasses.replace(fctx, mode=CUDAGraphMode.NONE,
                                             micro_batches=None)):
                return self.runnable(*args, **kwargs)
        self.stats.inc("micro_batched_steps")
        key = plan.num_tokens_padded
        if mode is CUDAGraphMode.FULL and self.backend is not None:
            graph = self.graphs.get(key)
            if graph is not None:
                graph.replay()
                self.stats.inc("replays")
                return graph.outputs
            with _compile_stance_kept():
                return self._capture(fctx, plan, args, kwargs)
        with _compile_stance_kept():
            return self._run_threads(fctx, plan, args, kwargs, per_thread_capture=False)[0]

    def _run_unsplit(self, fctx: ForwardContext | None, mode: CUDAGraphMode,
                     args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        desc = fctx.batch_descriptor if fctx is not None else None
        if mode is CUDAGraphMode.FULL and desc is not None and desc.num_tokens in self.graphs:
            # the graph for this size was captured split; an unsplit step must not replay it
            # (different layout) nor capture over it, so it runs eagerly
            self.stats.inc("micro_batch_fallbacks")
            logger.debug("unsplit step at %d tokens, whose FULL graph was captured split: "
                         "running eagerly", desc.num_tokens)
            assert fctx is not None
            with entered(dataclasses.replace(fctx, mode=CUDAGraphMode.NONE)):
                return self.runnable(*args, **kwargs)
        return self.unsplit(*args, **kwargs)

    # -- capture ------------------------------------------------------------------------------
    def _capture(self, fctx: ForwardContext | None, plan: MicroBatchPlan,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = plan.num_tokens_padded
        if self.window is not None and not self.window.is_open:
            raise CaptureError(
                f"micro-batched FULL graph for {key} tokens ({plan.num_micro_batches} "
                "micro-batches) would be captured while the capture window is closed; capture "
                "every size in GraphRunner.capture() first, or open the window")
        per_thread = getattr(self.backend, "name", None) != "cuda"
        thread_graphs: list[Any] = []

        # threads start (and initialise) before the capture begins; inside it they only run
        run = self._launch(fctx, plan, args, kwargs, per_thread_capture=per_thread)

        def run_all() -> Any:
            out, graphs = run.finish()
            thread_graphs.extend(graphs)
            return out

        try:
            main_graph, output = self.backend.capture(run_all)
        except BaseException:
            run.abort()
            raise
        split = _SplitGraph(main_graph, thread_graphs, output, plan)
        if not self.backend.capture_computes:
            split.replay()  # recorded, not run: run once so this step's output is real
        self.graphs[key] = split
        self.stats.inc("graphs_captured")
        logger.debug("captured micro-batched FULL graph for %d tokens (%d micro-batches)", key,
                     plan.num_micro_batches)
        return output

    # -- threads ------------------------------------------------------------------------------
    def _comm(self) -> Any:
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(device=self._device)
        return self._comm_stream

    def _thread_context(self, fctx: ForwardContext | None, plan: MicroBatchPlan, index: int
                        ) -> ForwardContext:
        """The context micro-batch ``index`` runs under: its own descriptor, slice and index,
        the caller's extras (plus what ``slice_extras`` adds), and mode NONE (inside a
        micro-batch nothing captures; a split graph, if any, is the whole step)."""
        sl = plan.padded_slices[index]
        parent = fctx if fctx is not None else ForwardContext()
        extras: dict[str, Any] = dict(parent.extras)
        if self.slice_extras is not None:
            extras.update(self.slice_extras(index, sl, parent.extras))
        desc = fctx.batch_descriptor if fctx is not None else None
        sub = BatchDescriptor(
            num_tokens=sl.num_tokens,
            num_reqs=sl.num_reqs,
            uniform=desc.uniform if desc is not None else False,
            has_lora=desc.has_lora if desc is not None else False,
            num_active_loras=desc.num_active_loras if desc is not None else 0,
        )
        return dataclasses.replace(
            parent, mode=CUDAGraphMode.NONE, batch_descriptor=sub,
            extras=MappingProxyType(extras), micro_batches=None, micro_batch=sl,
            micro_batch_index=index, dp_metadata=plan.dp[index] if plan.dp is not None else None)

    def _run_threads(self, fctx: ForwardContext | None, plan: MicroBatchPlan,
                     args: tuple[Any, ...], kwargs: dict[str, Any], *,
                     per_thread_capture: bool) -> tuple[Any, list[Any]]:
        run = self._launch(fctx, plan, args, kwargs, per_thread_capture=per_thread_capture)
        return run.finish()

    def _launch(self, fctx: ForwardContext | None, plan: MicroBatchPlan,
                args: tuple[Any, ...], kwargs: dict[str, Any], *,
                per_thread_capture: bool) -> _Run:
        """Start one thread per micro-batch and wait until all are initialised (CUDA handles and
        events created, so none of that happens inside a capture); nobody runs the model until
        :meth:`_Run.finish` hands micro-batch 0 the baton."""
        use_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda
                       for t in pytree.tree_leaves((args, kwargs)))
        run = _Run(self, plan, use_cuda)
        comm = self._comm() if use_cuda else None
        inference = torch.is_inference_mode_enabled()
        grad = torch.is_grad_enabled()
        device = torch.cuda.current_device() if use_cuda else None
        backend = self.backend if per_thread_capture else None
        sched, barrier, n = run.sched, run.barrier, plan.num_micro_batches

        def body(index: int) -> None:
            sl = plan.padded_slices[index]
            ctx = MicroBatchContext(index=index, num_micro_batches=n, slice=sl,
                                    _schedule=sched, comm_stream=comm,
                                    sm_partition=self.sm_partition)
            kinds = self.input_kinds
            sub_args = tuple(_slice_arg(a, sl, plan.num_tokens_padded, kinds.get(i))
                             for i, a in enumerate(args))
            sub_kwargs = {k: _slice_arg(v, sl, plan.num_tokens_padded, kinds.get(k))
                          for k, v in kwargs.items()}
            thread_ctx = self._thread_context(fctx, plan, index)
            try:
                if use_cuda:
                    torch.cuda.set_device(device)
                    # create events and cuBLAS handles now: creating them during a capture
                    # is not allowed
                    ctx._compute_done, ctx._comm_done = torch.cuda.Event(), torch.cuda.Event()
                    with torch.cuda.stream(comm):
                        ctx._compute_done.record()
                        ctx._comm_done.record()
                        torch.cuda.current_blas_handle()
                    torch.cuda.current_blas_handle()
                barrier.wait()
                sched.wait_turn(index, "start")
                if use_cuda:
                    torch.cuda.set_stream(sched.compute_stream)
                sched.note(index, "start")
                grad_mode = (torch.inference_mode() if inference
                             else torch.set_grad_enabled(grad))
                token = _CURRENT.set(ctx)
                try:
                    with grad_mode, entered(thread_ctx):
                        if backend is not None:
                            run.graphs[index], run.results[index] = backend.capture(
                                lambda: self.runnable(*sub_args, **sub_kwargs), gc_disable=True)
                        else:
                            run.results[index] = self.runnable(*sub_args, **sub_kwargs)
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
                barrier.abort()

        run.threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(body, i),
                             name=f"freezeframe-ubatch-{i}", daemon=True)
            for i in range(n)
        ]
        try:
            for t in run.threads:
                t.start()
            barrier.wait()
        except threading.BrokenBarrierError:
            sched.abort()  # a thread failed (or stalled) before starting; reported by finish()
        except BaseException:
            run.abort()  # interrupted (a signal, KeyboardInterrupt): no thread may outlive us
            raise
        return run


class _Run:
    """One micro-batched step in flight: its threads, schedule and per-thread results."""

    def __init__(self, wrapper: MicroBatchWrapper, plan: MicroBatchPlan, use_cuda: bool) -> None:
        n = plan.num_micro_batches
        self.wrapper = wrapper
        self.plan = plan
        self.use_cuda = use_cuda
        self.sched = _Schedule(n, wrapper.timeout_s)
        self.barrier = threading.Barrier(n + 1, timeout=wrapper.timeout_s)
        self.results: list[Any] = [None] * n
        self.graphs: list[Any] = [None] * n
        self.threads: list[threading.Thread] = []

    def finish(self) -> tuple[Any, list[Any]]:
        """Hand micro-batch 0 the baton on the caller's current stream, join every thread,
        re-raise the first failure, and concatenate the outputs (in the caller's thread, so in
        a capture the concatenation is part of the graph)."""
        sched, n, timeout_s = self.sched, self.plan.num_micro_batches, self.wrapper.timeout_s
        sched.compute_stream = torch.cuda.current_stream() if self.use_cuda else None
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
            self.wrapper.last_trace = list(sched.trace)
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
        return _concat(self.results), [g for g in self.graphs if g is not None]

    def abort(self) -> None:
        """Unwind the threads: the capture around them failed, or the caller was interrupted.
        Each stops at its next yield point (or at the start barrier)."""
        self.sched.abort()
        self.barrier.abort()
        for t in self.threads:
            if t.ident is not None:  # started
                t.join(self.wrapper.timeout_s)
