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
the compute stream still reads it (the usual PyTorch multi-stream rule). freezeframe does that
for every tensor an op *dispatched through torch* reads or writes while a micro-batch is on the
comm stream (a custom op, a c10d collective, an ATen op): inputs are marked as used by the comm
stream and outputs as used by the compute stream (see :class:`_CommStreamUses`), so the other
micro-batch's allocations cannot take their memory while the comm kernels still read it. A
kernel launched without going through torch's dispatcher (a raw Triton or CUDA-extension call)
is invisible there: wrap it in a custom op, or call ``record_stream`` yourself.

Failure. If one micro-batch raises, the schedule is aborted: every thread waiting for the baton
wakes up and unwinds, and the caller gets the original exception. Every wait has a deadline, so a
thread that never yields again (a deadlock in user code) becomes a :class:`MicroBatchError`
naming the micro-batch, never a hang. Once the threads are done, torch's process-wide compile
stance is what it was before the step (see :func:`_compile_stance_kept`).

Graphs. In a FULL step with a graph backend, the first split step of a descriptor is captured
whole by a FULL :class:`~freezeframe.graphs.GraphWrapper` (the same policy, input checks and
counters as every other graph) into the backend's pool, which the runner makes the model's own
pool; later steps of that descriptor replay it without starting any thread. The threads start
before the capture begins and only run inside it. On the ``cuda`` backend they launch onto the
capturing stream (and the comm stream, which joins the capture through the events above). The
``emulated`` backend records through a dispatch mode, which is per thread, so each thread
enters :meth:`~freezeframe.graphs.GraphBackend.share_capture`'s recorder and the one graph holds
every launch in the order the schedule ran it. Two fallbacks, both counted in
``micro_batch_fallbacks`` and logged: a step that arrives unsplit at a descriptor whose graph was
captured split runs eagerly (replaying the split graph would compute another layout, and a
second graph of the same size beside it would double its memory); a split step cut at other
token positions than the capture's runs its micro-batches without the graph.

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
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from freezeframe.batch import BatchDescriptor
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import ForwardContext, entered, get_forward_context
from freezeframe.errors import MicroBatchError
from freezeframe.graphs.backend import GraphBackend, resolve_backend
from freezeframe.graphs.capturable import Capturable
from freezeframe.graphs.wrapper import CaptureWindow, GraphOptions, GraphWrapper
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

    Used by the runner above the model when ``config.micro_batching`` is on. The step's plan
    (:class:`MicroBatchPlan`, from :func:`~freezeframe.runtime.ubatch.slicing.plan_micro_batches`)
    is read from the forward context's ``micro_batches`` field; without one the step runs
    unsplit (through ``unsplit`` — typically the model with its own FULL GraphWrapper — or
    ``runnable``).

    Inputs: every tensor argument whose dim 0 equals the padded token count is sliced per
    micro-batch; other arguments are shared. Outputs are concatenated along dim 0 in micro-batch
    order. ``slice_extras(index, slice, parent_extras) -> dict`` may add per-micro-batch extras
    (attention metadata from :func:`~freezeframe.runtime.ubatch.slicing.slice_attention_metadata`,
    ...) to each thread's forward context.

    With a graph ``backend``, a split step in FULL mode is captured by a FULL
    :class:`~freezeframe.graphs.GraphWrapper` around the whole threaded step (keyed by the
    step's descriptor, with that wrapper's input checks), into ``backend``'s memory pool: give
    it the model's own backend and split and unsplit graphs share one pool.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        *,
        backend: GraphBackend | None = None,
        unsplit: Callable[..., Any] | None = None,
        stats: Stats | None = None,
        window: CaptureWindow | None = None,
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
        self.backend = backend
        self.unsplit = unsplit if unsplit is not None else runnable
        self.stats = stats if stats is not None else Stats()
        self.timeout_s = float(timeout_s)
        self.sm_partition = sm_partition
        self.slice_extras = slice_extras
        # argument name (or position) -> "tokens" | "requests" | "static"
        self.input_kinds: Mapping[str | int, str] = dict(input_kinds or {})
        self._device = device
        self._comm_stream: Any = None  # created on first CUDA use
        self.last_trace: list[tuple[int, str]] = []
        # The split graphs: the threaded step itself, captured whole in FULL mode.
        self._graphs: GraphWrapper | None = None if backend is None else GraphWrapper(
            self._split_step, CUDAGraphMode.FULL, backend, GraphOptions(log=True),
            stats=self.stats, window=window if window is not None else CaptureWindow())
        # descriptor -> the slices its split graph was captured with
        self._layouts: dict[BatchDescriptor, tuple[MicroBatchSlice, ...]] = {}
        # descriptor -> what its split graph's micro-batches ran with (argument slices, the
        # tensors slice_extras made before the capture): the graph reads their memory, so they
        # live as long as it does
        self._captured_work: dict[BatchDescriptor, tuple[_Work, ...]] = {}
        self._pending: _Run | None = None  # threads started for the capture in progress

    @classmethod
    def for_runner(cls, model: Callable[..., Any], config: CompilationConfig, *,
                   input_kinds: Mapping[str | int, str] | None = None,
                   stats: Stats | None = None) -> MicroBatchWrapper:
        """The wrapper a :class:`~freezeframe.runtime.GraphRunner` puts around ``model`` when
        ``config.micro_batching`` is on.

        It sits *above* the model, so the model's own FULL wrapper handles unsplit steps, and
        inside a micro-batch (mode NONE) every wrapper of the model calls through. Split FULL
        graphs are captured with the model's own graph backend (so into the same memory pool
        as its unsplit graphs) and its capture window; a model without graphs of its own gets
        a backend resolved from the config.
        """
        held = model if isinstance(model, Capturable) else None
        backend = None
        if cast(CUDAGraphMode, config.cudagraph_mode).has_full_cudagraphs():  # resolved
            backend = held.graph_backend if held is not None else resolve_backend(config)
        return cls(model, backend=backend, unsplit=model,
                   stats=held.stats if held is not None else stats,
                   window=held.capture_window if held is not None else None,
                   input_kinds=input_kinds)

    @property
    def captured_descriptors(self) -> list[BatchDescriptor]:
        """The descriptors that have a split FULL graph, in capture order."""
        return self._graphs.captured_descriptors if self._graphs is not None else []

    def memory_bytes(self) -> int:
        """The memory its split graphs report holding (see GraphWrapper.memory_bytes)."""
        return self._graphs.memory_bytes() if self._graphs is not None else 0

    def clear(self) -> None:
        """Drop every split graph (the next split step of each size captures again)."""
        if self._graphs is not None:
            self._graphs.clear()
        self._layouts.clear()
        self._captured_work.clear()

    # -- entry --------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fctx = get_forward_context()
        plan = fctx.micro_batches if fctx is not None else None
        if fctx is None or plan is None:
            return self._run_unsplit(fctx, args, kwargs)
        if isinstance(self.runnable, Capturable) and not self.runnable.traced:
            # A compiled model traces on its first call and holds its trace lock across that
            # whole call; a micro-batch yielding inside it would stall its siblings on the
            # lock. So the first call runs unsplit (and eagerly: nothing is captured).
            self.stats.inc("micro_batch_unsplit_first_calls")
            with entered(dataclasses.replace(fctx, mode=CUDAGraphMode.NONE,
                                             micro_batches=None)):
                return self.runnable(*args, **kwargs)
        self.stats.inc("micro_batched_steps")
        desc = fctx.batch_descriptor
        with _compile_stance_kept():
            if fctx.mode is CUDAGraphMode.FULL and self._graphs is not None and desc is not None:
                return self._graphed(desc, fctx, plan, args, kwargs)
            return self._launch(fctx, plan, args, kwargs).finish()

    def _run_unsplit(self, fctx: ForwardContext | None, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
        desc = fctx.batch_descriptor if fctx is not None else None
        if fctx is not None and fctx.mode is CUDAGraphMode.FULL and desc in self._layouts:
            # the graph for this size was captured split; an unsplit step must not replay it
            # (different layout) nor have the model capture a second graph of the same size
            # beside it, so it runs eagerly
            self.stats.inc("micro_batch_fallbacks")
            logger.debug("unsplit step at %s, whose FULL graph was captured split: running "
                         "eagerly", desc)
            with entered(dataclasses.replace(fctx, mode=CUDAGraphMode.NONE)):
                return self.runnable(*args, **kwargs)
        return self.unsplit(*args, **kwargs)

    # -- graphs -------------------------------------------------------------------------------
    def _graphed(self, desc: BatchDescriptor, fctx: ForwardContext, plan: MicroBatchPlan,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A split FULL step: replay its graph, or capture it."""
        assert self._graphs is not None
        layout = self._layouts.get(desc)
        if layout is not None and layout != plan.padded_slices:
            # captured with the tokens cut elsewhere: the graph would compute that layout
            self.stats.inc("micro_batch_fallbacks")
            logger.debug("split step at %s cut as %s, but its graph was captured cut as %s: "
                         "running the micro-batches eagerly", desc, plan.padded_slices, layout)
            return self._launch(fctx, plan, args, kwargs).finish()
        if layout is not None:
            return self._graphs(*args, **kwargs)
        # Threads start, and create their CUDA events and handles, before the capture begins
        # (creating them inside one is not allowed); inside it they only run.
        run = self._pending = self._launch(fctx, plan, args, kwargs)
        try:
            out = self._graphs(*args, **kwargs)
        finally:
            pending, self._pending = self._pending, None
            if pending is not None:  # the capture was refused before it ran the step
                pending.abort()
        self._layouts[desc] = plan.padded_slices
        self._captured_work[desc] = tuple(run.work)
        return out

    def _split_step(self, *args: Any, **kwargs: Any) -> Any:
        """What the split graph captures: the threads started by :meth:`_graphed`, run to the
        end with their work recorded into this capture."""
        run, self._pending = self._pending, None
        if run is None:
            raise MicroBatchError("a split graph was entered without its micro-batch threads; "
                                  "call the MicroBatchWrapper, not its graph wrapper")
        assert self.backend is not None
        run.join_capture = self.backend.share_capture()
        return run.finish()

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

    def _launch(self, fctx: ForwardContext | None, plan: MicroBatchPlan,
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Run:
        """Start one thread per micro-batch and wait until all are initialised (CUDA handles and
        events created, so none of that happens inside a capture); nobody runs the model until
        :meth:`_Run.finish` hands micro-batch 0 the baton."""
        use_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda
                       for t in pytree.tree_leaves((args, kwargs)))
        n = plan.num_micro_batches
        work = []
        for index in range(n):
            sl = plan.padded_slices[index]
            sub_args = tuple(_slice_arg(a, sl, plan.num_tokens_padded, self.input_kinds.get(i))
                             for i, a in enumerate(args))
            sub_kwargs = {k: _slice_arg(v, sl, plan.num_tokens_padded, self.input_kinds.get(k))
                          for k, v in kwargs.items()}
            work.append(_Work(self._thread_context(fctx, plan, index), sub_args, sub_kwargs))
        run = _Run(self, plan, work, self._comm() if use_cuda else None)
        run.start()
        return run


@dataclasses.dataclass(frozen=True)
class _Work:
    """What one micro-batch thread runs: its forward context and its slices of the arguments."""

    context: ForwardContext
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Run:
    """One micro-batched step in flight: its threads, schedule and per-thread results."""

    def __init__(self, wrapper: MicroBatchWrapper, plan: MicroBatchPlan, work: list[_Work],
                 comm: Any) -> None:
        n = plan.num_micro_batches
        self.wrapper = wrapper
        self.plan = plan
        self.work = work
        self.comm = comm  # the comm stream, on CUDA
        self.device = torch.cuda.current_device() if comm is not None else None
        self.inference = torch.is_inference_mode_enabled()
        self.grad = torch.is_grad_enabled()
        self.sched = _Schedule(n, wrapper.timeout_s)
        self.barrier = threading.Barrier(n + 1, timeout=wrapper.timeout_s)
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
                                comm_stream=self.comm, sm_partition=self.wrapper.sm_partition)
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
                    self.results[index] = self.wrapper.runnable(*work.args, **work.kwargs)
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
        sched, n, timeout_s = self.sched, self.plan.num_micro_batches, self.wrapper.timeout_s
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
        return _concat(self.results)

    def abort(self) -> None:
        """Unwind the threads: the capture around them failed, or the caller was interrupted.
        Each stops at its next yield point (or at the start barrier)."""
        self.sched.abort()
        self.barrier.abort()
        for t in self.threads:
            if t.ident is not None:  # started
                t.join(self.wrapper.timeout_s)
