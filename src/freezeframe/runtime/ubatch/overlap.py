"""Run one step as micro-batches on threads, so one micro-batch's communication overlaps
another's compute (dual-batch overlap).

Why threads. A model's forward is ordinary Python that launches kernels in order. To overlap
micro-batch 0's all-to-all with micro-batch 1's matmuls, the *launches* must interleave: 0's
compute, then 0's communication on a second stream, then 1's compute while 0's communication
runs, and so on. Running each micro-batch's forward on its own thread and passing a *baton*
between them at the model's yield points gives exactly that interleaving without rewriting the
model as a state machine. The baton, the streams each micro-batch launches on and the yield
points a model calls are :mod:`freezeframe.runtime.ubatch.schedule`; the threads of one step,
started, joined and unwound on failure, are :mod:`freezeframe.runtime.ubatch.threads`. This
module decides how a step runs (unsplit, split, or its split graph replayed or captured), slices
the arguments and gives each micro-batch its forward context. On CPU there are no streams: the
baton alone orders the work, and the recorded :attr:`MicroBatchWrapper.last_trace` makes the
order observable.

Graphs. In a FULL step with a graph backend, the first split step of a descriptor is captured
whole by a FULL :class:`~freezeframe.graphs.GraphWrapper` (the same policy, input checks and
counters as every other graph) into the backend's pool, which the runner makes the model's own
pool; later steps of that descriptor replay it without starting any thread. The threads start
before the capture begins and only run inside it. On the ``cuda`` backend they launch onto the
capturing stream (and the comm stream, which joins the capture through the schedule's events).
The ``emulated`` backend records through a dispatch mode, which is per thread, so each thread
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
import dataclasses
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree

from freezeframe.batch import BatchDescriptor
from freezeframe.compilation.module_call import (
    bare_forward,
    call_with_forward,
    may_skip_module_call,
)
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import ForwardContext, entered, get_forward_context
from freezeframe.errors import MicroBatchError
from freezeframe.graphs.backend import GraphBackend, resolve_backend
from freezeframe.graphs.capturable import Capturable
from freezeframe.graphs.wrapper import CaptureWindow, GraphOptions, GraphWrapper
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan, MicroBatchSlice
from freezeframe.runtime.ubatch.stores import SplitStores
from freezeframe.runtime.ubatch.threads import (
    MicroBatchRun,
    MicroBatchWork,
    compile_stance_kept,
)
from freezeframe.stats import Stats

__all__ = ["MicroBatchWrapper"]

logger = logging.getLogger(__name__)


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
        self._captured_work: dict[BatchDescriptor, tuple[MicroBatchWork, ...]] = {}
        self._pending: MicroBatchRun | None = None  # threads started for the capture in progress
        # descriptor -> the output leaves its split graph's forward stored on the module
        self._stores: dict[BatchDescriptor, SplitStores] = {}

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
        self._stores.clear()

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
        model = self.runnable
        if isinstance(model, nn.Module) and not may_skip_module_call(model):
            # the model's hooks run once around the whole step, as around a plain step (a
            # pre-hook's new inputs are what is split, a forward hook sees the joined output);
            # the micro-batches call the forward between them
            bare = bare_forward(model)
            return call_with_forward(
                model, lambda *a, **k: self._split(fctx, plan, a, k, bare), args, kwargs)
        return self._split(fctx, plan, args, kwargs, model)

    def _split(self, fctx: ForwardContext, plan: MicroBatchPlan, args: tuple[Any, ...],
               kwargs: dict[str, Any], call: Callable[..., Any]) -> Any:
        """The step as micro-batches, each running ``call`` on its slices (or its graph)."""
        desc = fctx.batch_descriptor
        with compile_stance_kept():
            if fctx.mode is CUDAGraphMode.FULL and self._graphs is not None and desc is not None:
                return self._graphed(desc, fctx, plan, args, kwargs, call)
            return self._eager(fctx, plan, args, kwargs, call)

    def _eager(self, fctx: ForwardContext, plan: MicroBatchPlan, args: tuple[Any, ...],
               kwargs: dict[str, Any], call: Callable[..., Any]) -> Any:
        """The micro-batches run without a graph, forward's stores then made as the whole
        batch's one call makes them (:class:`SplitStores`)."""
        module = self.runnable if isinstance(self.runnable, nn.Module) else None
        before = SplitStores.snapshot(module) if module is not None else None
        run = self._launch(fctx, plan, args, kwargs, call)
        out = run.finish()
        if before is not None:
            stores = SplitStores.of(before, run.results)
            if stores is not None:
                stores.make(out)
        return out

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
                 args: tuple[Any, ...], kwargs: dict[str, Any], call: Callable[..., Any]
                 ) -> Any:
        """A split FULL step: replay its graph, or capture it."""
        graphs = self._graphs
        assert graphs is not None
        layout = self._layouts.get(desc)
        if layout is not None and layout != plan.padded_slices:
            # captured with the tokens cut elsewhere: the graph would compute that layout
            self.stats.inc("micro_batch_fallbacks")
            logger.debug("split step at %s cut as %s, but its graph was captured cut as %s: "
                         "running the micro-batches eagerly", desc, plan.padded_slices, layout)
            return self._eager(fctx, plan, args, kwargs, call)
        if layout is not None:
            out = graphs(*args, **kwargs)
            stores = self._stores.get(desc)
            if stores is not None:  # a replay runs no Python: forward's stores are made here
                stores.make(out)
            return out
        if not graphs.window.is_open_for(fctx.owner) and self._captured_unsplit(desc, fctx):
            # captured unsplit (the capture's step of this size was not split: under FULL a
            # uniform-decode step shares its key with a mixed one, which splits at another
            # threshold): the model's own graph of the size is the whole step's answer
            self.stats.inc("micro_batch_fallbacks")
            logger.debug("split step at %s, whose FULL graph was captured unsplit: replaying "
                         "it unsplit", desc)
            with entered(dataclasses.replace(fctx, micro_batches=None)):
                return call(*args, **kwargs)
        # Threads start, and create their CUDA events and handles, before the capture begins
        # (creating them inside one is not allowed); inside it they only run.
        module = self.runnable if isinstance(self.runnable, nn.Module) else None
        before = SplitStores.snapshot(module) if module is not None else None
        run = self._pending = self._launch(fctx, plan, args, kwargs, call)
        try:
            out = graphs(*args, **kwargs)
        finally:
            pending, self._pending = self._pending, None
            if pending is not None:  # the capture was refused before it ran the step
                pending.abort()
        if before is not None:
            stores = SplitStores.of(before, run.results)
            if stores is not None:
                self._stores[desc] = stores
                stores.make(out)
        self._layouts[desc] = plan.padded_slices
        self._captured_work[desc] = tuple(run.work)
        return out

    def _captured_unsplit(self, desc: BatchDescriptor, fctx: ForwardContext) -> bool:
        """Whether the model holds its own FULL graph of ``desc`` for this step's owner."""
        held = self.runnable
        if not isinstance(held, Capturable):
            return False
        return any(w.runtime_mode is CUDAGraphMode.FULL
                   and w.graph_for(desc, fctx.owner) is not None
                   for w in held.graph_wrappers())

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
    def _keep_trace(self, trace: list[tuple[int, str]]) -> None:
        self.last_trace = trace

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
                args: tuple[Any, ...], kwargs: dict[str, Any], call: Callable[..., Any]
                ) -> MicroBatchRun:
        """Start one thread per micro-batch and wait until all are initialised (CUDA handles and
        events created, so none of that happens inside a capture); nobody runs the model until
        :meth:`MicroBatchRun.finish` hands micro-batch 0 the baton."""
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
            work.append(MicroBatchWork(self._thread_context(fctx, plan, index), sub_args,
                                       sub_kwargs))
        run = MicroBatchRun(plan, work, self._comm() if use_cuda else None, call,
                            timeout_s=self.timeout_s, sm_partition=self.sm_partition,
                            keep_trace=self._keep_trace)
        run.start()
        return run
