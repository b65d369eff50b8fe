"""A runner's capture transaction: eager, lazy and background, one way each key is captured.

Capturing a key is one transaction (:meth:`Capturer.capture_key`)::

    fill the buffers with a dummy step of the key's size (every row holds the fill value)
    warm up: the configured passes without a graph; at least one before the first capture,
        before each concrete compile size, and, where the backend only records (cuda),
        before every key's first capture (lazy set-up never happens inside a capture;
        :mod:`freezeframe.runtime.warmups`)
    capture: the same pass in the key's mode, the model's capture window open for this runner
    note which inputs the capture wrote (a CUDA replay writes without moving version counters)
    and the output leaves' dim 0 at this size (the output cut learns what follows the size)

around which every policy keeps the same rules: the model's buffers the dummy steps wrote are
restored afterwards, the input buffers refilled, and a capture that raises frees every graph
it made and leaves the runner serving without graphs until a capture succeeds.

* eager (:meth:`Capturer.capture_all`): every key the dispatcher owns, PIECEWISE then FULL,
  largest first, under a frozen garbage collector; with a graph-memory budget the sizes the
  prediction is made from go first and the rest only within the budget; with ``lockstep``,
  agreed with the other ranks first and each key between two barriers
  (:mod:`freezeframe.runtime.lockstep`);
* lazy: a key's ``lazy_warmups + 1``-th step captures it (:meth:`Capturer.deferred_step`);
* background: a thread captures the pending keys, one per hold of the runner's lock
  (:mod:`freezeframe.runtime.background`).

Before ``capture()``, a step of a key nothing ran yet runs without a graph where the backend
only records (:meth:`Capturer.warms_up_first`): the next step of the key captures it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from freezeframe.batch import BatchDescriptor, GraphKey
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.errors import CaptureError, FreezeframeError, GraphMemoryBudgetError
from freezeframe.graphs.breakable import BreakableGraph
from freezeframe.graphs.capturable import Capturable
from freezeframe.runtime.background import BackgroundCapture
from freezeframe.runtime.buffers import SavedBuffers
from freezeframe.runtime.capture_policy import CapturePolicy, DeferredCaptures
from freezeframe.runtime.collector import gc_frozen, gc_paused
from freezeframe.runtime.dispatcher import Dispatcher
from freezeframe.runtime.forward import ModelForward, device_current
from freezeframe.runtime.graph_memory import GraphMemoryPrediction, measurement_plan
from freezeframe.runtime.lock import StepLock
from freezeframe.runtime.lockstep import Lockstep, in_lockstep, lockstep_session
from freezeframe.runtime.memory_meter import GraphMemoryMeter, over_budget_message
from freezeframe.runtime.outputs import OutputCut
from freezeframe.runtime.progress import capture_progress
from freezeframe.runtime.report import CaptureReport, GraphCapture
from freezeframe.runtime.warmups import Warmups
from freezeframe.stats import Stats

__all__ = ["CaptureOptions", "Capturer"]

# the runner's logger: its messages are GraphRunner's, filtered by that name
logger = logging.getLogger("freezeframe.runtime.runner")

_NONE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.FULL


@dataclasses.dataclass(frozen=True)
class CaptureOptions:
    """The runner's options about capture (see :class:`~freezeframe.runtime.GraphRunner`)."""

    policy: CapturePolicy
    lazy_warmups: int
    budget: int | None
    progress: bool
    # capture in lockstep with the other ranks of a process group (eager policy only)
    lockstep: Lockstep | None = None


class Capturer:
    """Owns what a runner captured and how: the report, the keys still deferred, the inputs
    each graph writes, the warm-up bookkeeping (see the module docstring)."""

    def __init__(self, model: Any, held: Capturable | None, config: CompilationConfig,
                 dispatcher: Dispatcher, device: torch.device, stats: Stats,
                 forward: ModelForward, cut: OutputCut, lock: StepLock,
                 options: CaptureOptions, graphs_available: bool) -> None:
        self.model, self._held, self._config = model, held, config
        self._dispatcher, self._device, self._stats = dispatcher, device, stats
        self._forward, self._cut, self._lock, self._options = forward, cut, lock, options
        self._graphs_available = graphs_available
        self.report: CaptureReport | None = None
        # (mode, descriptor) -> the inputs its graph writes into, seen at capture
        self.graph_writes: dict[GraphKey, frozenset[str]] = {}
        # a capture failed (and freed its graphs): steps run without graphs until one succeeds
        self.capture_failed = False
        # capture() found compiling disabled for the process: nothing captured, steps eager
        self.compile_disabled = False
        self.deferred: DeferredCaptures | None = None
        self._background: BackgroundCapture | None = None
        # sizes and graph keys that ran eagerly before their first capture
        self._warmups = Warmups(held, config, device.type == "cuda")
        self._memory = GraphMemoryMeter(held, device, self._ubatch_bytes)
        if held is not None:  # steps before capture() capture, whoever closed the window
            held.capture_window.open_for(forward.static)

    # -- the eager policy -------------------------------------------------------------------
    def capture_all(self) -> CaptureReport:
        """capture(): see :meth:`~freezeframe.runtime.GraphRunner.capture`."""
        if self.report is not None:
            logger.info("GraphRunner.capture: graphs already captured; returning the report")
            return self.report
        groups = self._dispatcher.capture_descriptors() if self._graphs_available else []
        device_name = str(self._device)
        if not groups:
            reason = ("cudagraph_mode is NONE" if self._config.cudagraph_mode is _NONE
                      else "no graph backend is available")
            logger.info("GraphRunner.capture: nothing to capture (%s)", reason)
            self.report = CaptureReport(device=device_name)
            return self.report
        if self._held is not None and torch._dynamo.config.disable:
            # the process runs without compiling (TORCH_COMPILE_DISABLE=1): so does this runner
            logger.warning("GraphRunner.capture: compiling is disabled for the process "
                           "(TORCH_COMPILE_DISABLE=1 or torch._dynamo.config.disable), so no "
                           "graph is captured and every step runs eagerly")
            self.compile_disabled = True
            self.report = CaptureReport(device=device_name)
            return self.report
        self._refuse_if_compiling_is_off()
        if self._held is not None:
            self._held.capture_window.close_for(self._forward.static)
        _drop_low_level_graphs(self._held, self._stats)
        keys = [(mode, desc) for mode, descs in groups for desc in descs]
        if self._options.policy is not CapturePolicy.EAGER:
            return self._defer(keys, device_name)
        return self._capture_keys(keys, device_name)

    def _capture_keys(self, keys: list[GraphKey], device_name: str) -> CaptureReport:
        budget = self._options.budget
        # With a budget the sizes measured for the prediction go first (see capture())
        probes = measurement_plan(keys) if budget is not None else []
        measured = set(probes)
        order = [*probes, *(key for key in keys if key not in measured)]
        prediction: GraphMemoryPrediction | None = None
        records: list[GraphCapture] = []
        # with lockstep: the plan agreed with the other ranks first (see lockstep.py)
        with lockstep_session(self._options.lockstep, self._config, order, budget,
                              self._forward.static.slots) as sync, \
                self._transaction(frozen_gc=True) as used_before, \
                capture_progress(len(keys), self._options.progress) as bar:
            for key in probes:
                with in_lockstep(sync, len(records), key):
                    records.append(self.capture_key(key))
                bar.update(1)
            if budget is not None:
                prediction = self._memory.predict(keys, records, used_before)
                if prediction.total_bytes > budget:
                    raise GraphMemoryBudgetError(
                        over_budget_message(budget, prediction, len(records)))
            for key in order[len(probes):]:
                with in_lockstep(sync, len(records), key):
                    records.append(self.capture_key(key))
                bar.update(1)
            if self._on_cuda:
                torch.cuda.synchronize(self._device)
            seconds = time.perf_counter() - self._started
            used_after = self._memory.in_use()
        self._cut.classify()
        if prediction is None and self._memory.graphs_hold_their_own:
            # emulated graphs do not depend on the capture order: the prediction the same
            # measured sizes would have made, for the report's predicted-vs-actual columns
            prediction = self._memory.predict(keys, records, None)
        if prediction is not None:
            probed = set(probes) if probes else set(measurement_plan(keys))
            records = [dataclasses.replace(
                r, predicted_bytes=prediction.for_key(r.mode, r.descriptor).predicted_bytes,
                probe=(r.mode, r.descriptor) in probed) for r in records]
        report = CaptureReport(graphs=tuple(records), seconds=seconds,
                               memory_bytes=max(0, used_after - used_before),
                               device=device_name, prediction=prediction, budget_bytes=budget)
        self.report = report
        logger.info("GraphRunner: %s", report.summary())
        return report

    def _ubatch_bytes(self) -> int:
        ubatch = self._forward.ubatch
        return ubatch.memory_bytes() if ubatch is not None else 0

    def set_budget(self, budget: int | None) -> None:
        self._options = dataclasses.replace(self._options, budget=budget)

    @property
    def _on_cuda(self) -> bool:
        return self._device.type == "cuda"

    @contextlib.contextmanager
    def _transaction(self, frozen_gc: bool, key: GraphKey | None = None) -> Iterator[int]:
        """Around one capture (eager: all keys; lazy and background: one): the model's window
        open for this runner, the garbage collector frozen (or paused), and, whatever happens,
        the dummy steps undone; a failure frees every graph it made. Yields the graph memory in
        use at the start (see :class:`GraphMemoryMeter`)."""
        # the runner's device current: the backend captures on the current device's stream
        with device_current(self._device), \
                self._transaction_on_device(frozen_gc, key) as used_before:
            yield used_before

    @contextlib.contextmanager
    def _transaction_on_device(self, frozen_gc: bool, key: GraphKey | None) -> Iterator[int]:
        """The transaction of :meth:`_transaction`, the runner's device current."""
        window = self._held.capture_window if self._held is not None else None
        # Copied aside before the clock and the memory baseline start: the report measures
        # graphs, not the copies.
        saved = SavedBuffers(self.model, device_room=_device_room(self._device, frozen_gc))
        self._started = time.perf_counter()
        if frozen_gc:
            gc.collect()  # a dropped runner's graphs go before the baseline, not inside it
        if frozen_gc and self._on_cuda:
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()
        used_before = self._memory.in_use()
        if frozen_gc:
            self._stats.inc("capture_runs")
        primed = self._warmups.snapshot()
        stream = torch.cuda.current_stream(self._device) if self._on_cuda else None
        if frozen_gc:
            self._cut.forget()
        try:
            with contextlib.ExitStack() as stack:
                if window is not None:
                    _open_window(stack, window, self._forward.static, frozen_gc)
                stack.enter_context(gc_frozen() if frozen_gc else gc_paused())
                yield used_before
        except BaseException:
            self._forget_failed_capture(primed, stream)
            if key is not None and self.deferred is not None:
                self.deferred.failed_on(key)
            else:
                self.capture_failed = True
            raise
        finally:
            self._undo_dummy_steps(saved)
        self.capture_failed = False

    def capture_key(self, key: GraphKey, error_mode: str = "global") -> GraphCapture:
        """Warm up and capture one key (see the module docstring); inside a transaction."""
        mode, desc = key
        forward, static = self._forward, self._forward.static
        tokens, reqs = static.fill_dummy(desc, self._config.max_num_seqs)
        # FULL graphs of split sizes are captured split (warm-ups split too)
        plan = forward.micro_batches(None, tokens, reqs, tokens, reqs, desc.uniform) \
            if mode is _FULL else None
        used_before = self._memory.in_use()
        t0 = time.perf_counter()
        for _ in range(self._warmups.before_capture(mode, desc)):
            forward(_NONE, desc, tokens, reqs, tokens, reqs, {}, plan, capturing=True)
            self._stats.inc("warmups")
        if self._on_cuda:
            torch.cuda.synchronize(self._device)
        versions = static.versions()
        out = forward(mode, desc, tokens, reqs, tokens, reqs, {}, plan, capturing=True,
                      error_mode=error_mode)
        self._cut.record(out, tokens, reqs)
        if self._on_cuda:
            torch.cuda.synchronize(self._device)
        self.graph_writes[key] = frozenset(
            name for (name, _kind, buf), before in zip(static.slots, versions, strict=True)
            if buf._version != before)
        self._stats.inc("captures")
        seconds = time.perf_counter() - t0
        segments, breaks = _breaks_of(self._held, mode, desc, self._forward.static)
        return GraphCapture(mode=mode, descriptor=desc, seconds=seconds,
                            memory_bytes=max(0, self._memory.in_use() - used_before),
                            segments=segments, breaks=breaks)

    # -- steps before capture(), lazy and background ---------------------------------------
    def warms_up_first(self, key: GraphKey) -> bool:
        """A step of ``key`` before capture(): whether it runs without a graph, as the key's
        warm-up (counted in ``warmups``), because no pass ran its code yet and the backend
        only records; the next step of the key captures it."""
        if self.report is not None or not self._warmups.first_step(key):
            return False
        self._stats.inc("warmups")
        return True

    def deferred_step(self, key: GraphKey) -> str | None:
        """A step of ``key`` whose graph the lazy or background policy has not captured:
        capture it now when the lazy policy says it is due (None: the graph is there), else
        the reason the step runs without a graph."""
        deferred = self.deferred
        assert deferred is not None
        if self._options.policy is CapturePolicy.LAZY and deferred.due(key):
            self._capture_deferred(key)
            return None
        return "capture_failed" if key in deferred.failed else "not_captured"

    def _defer(self, order: list[GraphKey], device_name: str) -> CaptureReport:
        """capture() of the lazy and background policies: learn how the outputs follow the
        padded size from two eager dummy steps, then leave the graphs to the steps (lazy) or
        to a thread (background)."""
        sizes = sorted({desc.num_tokens for _, desc in order})[:2]
        probes = [next(d for _, d in order if d.num_tokens == n) for n in sizes]
        saved = SavedBuffers(self.model)
        self._cut.forget()
        try:
            for desc in probes:
                tokens, reqs = self._forward.static.fill_dummy(desc, self._config.max_num_seqs)
                out = self._forward(_NONE, desc, tokens, reqs, tokens, reqs, {}, None,
                                    capturing=True)
                self._cut.record(out, tokens, reqs)
                self._stats.inc("warmups")
        finally:
            self._undo_dummy_steps(saved)
        self._cut.classify()
        self.deferred = DeferredCaptures(order, self._options.lazy_warmups)
        self.report = CaptureReport(device=device_name)
        if self._options.policy is CapturePolicy.BACKGROUND:
            self._background = BackgroundCapture(
                self.deferred, self._lock,
                lambda key: self._capture_deferred(key, error_mode="thread_local"))
            self._background.ensure_running()
        logger.info("GraphRunner: %d graphs left to capture (%s)", len(order),
                    self._options.policy.value)
        return self.report

    def _capture_deferred(self, key: GraphKey, error_mode: str = "global") -> None:
        """Capture one graph key, holding the runner's lock (a step's or the background
        thread's), as capture() captures each of its keys."""
        assert self.deferred is not None and self.report is not None
        with self._transaction(frozen_gc=False, key=key):
            record = self.capture_key(key, error_mode)
        self.deferred.captured(key)
        self._cut.classify()
        report = self.report
        self.report = dataclasses.replace(
            report, graphs=(*report.graphs, record), seconds=report.seconds + record.seconds,
            memory_bytes=report.memory_bytes + record.memory_bytes)

    def wait(self, timeout: float | None) -> CaptureReport:
        """wait_for_capture(): see :meth:`~freezeframe.runtime.GraphRunner.wait_for_capture`."""
        if self.report is None:
            raise FreezeframeError("wait_for_capture() before capture(); call "
                                   "runner.capture() first")
        if self._background is not None:
            self._background.wait(timeout)
        return self.report

    @property
    def pending(self) -> int:
        return self.deferred.num_pending if self.deferred is not None else 0

    # -- after every graph was dropped (parameters replaced) ---------------------------------
    def again(self) -> None:
        """Capture the keys again as the policy does (eager: all of them now; lazy and
        background: each pending again); before capture(), nothing (steps capture)."""
        if self.report is None:
            return
        if self.deferred is not None:
            self.deferred.restart()
            if self._background is not None:
                self._background.ensure_running()
            return
        self.graph_writes.clear()
        self.report = None
        self.capture_all()

    # -- the rules around a transaction ----------------------------------------------------
    def _refuse_if_compiling_is_off(self) -> None:
        off = self._held.compile_off_reason if self._held is not None else None
        if off is not None:
            raise CaptureError(
                f"GraphRunner.capture: {off}, so the model runs eagerly and would capture no "
                "graph. Call capture() where compiling is on (outside torch.compiler."
                "set_stance('force_eager'), without TORCH_COMPILE_DISABLE=1); steps may still "
                "run eagerly meanwhile")

    def _forget_failed_capture(self, primed: tuple[frozenset[int], frozenset[GraphKey]],
                               stream: Any) -> None:
        """Undo a capture attempt that raised, so that a retry starts as the first attempt
        did: the graphs it stored (some may hold a half-recorded capture) are freed, the sizes
        it primed count as unprimed (a failed first call may have left the model untraced),
        and the caller's CUDA stream is current again."""
        self._stats.inc("capture_failures")
        self._warmups.restore(primed)
        self.graph_writes.clear()
        if self._held is not None:
            for wrapper in self._held.graph_wrappers():
                wrapper.drop_owned_by(self._forward.static)  # another runner's stay
        if self._forward.ubatch is not None:
            self._forward.ubatch.clear()
        if stream is not None:
            torch.cuda.set_stream(stream)
        logger.warning("GraphRunner.capture failed; its graphs were freed, and capture() may "
                       "be called again")

    def _undo_dummy_steps(self, saved: SavedBuffers) -> None:
        """After warm-ups and captures: refill the input buffers (the dummy steps wrote their
        rows, and the model may have too), restore the model's buffers they wrote into (a
        running count, a cache) and the attributes forward stored (``self.last = out``):
        eagerly, those steps never happened."""
        self._forward.static.reset_padding()
        restored = saved.restore()
        if restored:
            self._stats.inc("buffers_restored", restored)
        restored = saved.restore_attributes()
        if restored:
            self._stats.inc("attributes_restored", restored)


def _device_room(device: torch.device, every_key: bool) -> int:
    """Where a transaction may keep its buffer copies on the device: one key (lazy,
    background) while serving, in half the free memory; capture() of every key keeps its
    memory for the graphs (0: the 256 MiB rule of :class:`SavedBuffers`)."""
    if every_key or device.type != "cuda":
        return 0
    return int(torch.cuda.mem_get_info(device)[0] // 2)


def _open_window(stack: contextlib.ExitStack, window: Any, owner: object,
                 every_key: bool) -> None:
    """The capture window open for ``owner``'s steps only (another runner's capture may run
    at the same time) and closed after; capture() of every key also closes it for low-level
    calls, so that a later step reaching an uncaptured key raises instead of capturing
    mid-serving."""
    window.open_for(owner)
    stack.callback(window.close_for, owner)
    if every_key:
        stack.callback(window.close)


def _breaks_of(held: Capturable | None, mode: CUDAGraphMode, desc: BatchDescriptor,
               owner: object) -> tuple[int, tuple[str, ...]]:
    """The segments and breaks of the breakable graph ``owner`` captured for the key, if it
    is one."""
    if held is None:
        return 0, ()
    for wrapper in held.graph_wrappers():
        if wrapper.runtime_mode is mode:
            graph = wrapper.graph_for(desc, owner)
            if isinstance(graph, BreakableGraph):
                return graph.num_segments, tuple(graph.breaks)
    return 0, ()


def _drop_low_level_graphs(held: Capturable | None, stats: Stats) -> None:
    """Free the graphs low-level calls captured (before or after the runner was made): a runner
    never replays them (graphs are kept per owner, see :mod:`freezeframe.graphs.wrapper`), so
    they would only hold memory. Another runner's graphs are that runner's, and stay."""
    wrappers = held.graph_wrappers() if held is not None else []
    dropped = [w for w in wrappers if w.drop_owned_by(None)]
    if dropped:
        logger.warning("GraphRunner.capture: the model held graphs captured by low-level calls "
                       "(%d wrappers); the runner captures its own on its buffers, so they "
                       "were freed", len(dropped))
        stats.inc("foreign_graphs_dropped", len(dropped))
