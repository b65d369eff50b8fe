"""GraphRunner: run any model step by step on captured graphs without writing a model runner.

A captured graph (CUDA or emulated) reads its inputs from the addresses it saw at capture time
and writes its outputs to fixed addresses. So a caller must (1) keep every dynamic input in a
static buffer, (2) pad each step to a captured size with rows that cannot poison the real ones,
(3) tell the graph wrappers which graph to replay, and (4) hand back only the real rows. That is
this class:

    runner = ff.GraphRunner(model, cfg, inputs={
        "x": ff.runtime.Tokens(hidden),                            # [num_tokens, hidden]
        "slots": ff.runtime.Tokens(dtype=torch.long, fill=-1),     # padded rows: slot -1
        "seq_lens": ff.runtime.Requests(dtype=torch.int32),        # [num_reqs]
    })
    report = runner.capture()          # every key of the dispatcher, largest first
    y = runner(x, slots, seq_lens)     # or runner(x=..., slots=..., seq_lens=...)

Each step: validate the inputs, agree on the size across data-parallel ranks (optional),
dispatch to (runtime mode, padded descriptor), copy the inputs into the buffers and fill the
padded tail, run the model inside ``ff.forward_context`` and slice the outputs to the real rows.

The graphs themselves live in the model's wrappers (see ``freezeframe.graphs``); the runner
only sets the forward context they react to, so it works with any callable: a
:class:`~freezeframe.compilation.CompiledModel`, a module holding its own wrappers, or a plain
module (which then simply runs eagerly on the padded buffers).

Steps and captures run under ``torch.no_grad()``: the runner serves inference.

Inputs the model writes into: eagerly, a model that writes into an input (``x.add_(1)``,
``cache[slots] = ...``) writes into the caller's tensor. Through the runner it writes into the
static buffer, so after the step the runner copies each written input back into the caller's
tensor: the real rows of a ``Tokens`` / ``Requests`` input (never the padded ones), all of a
``Static`` one. A write is seen as a moved version counter (any in-place op that goes through
the dispatcher, Inductor's compiled code included) or, for a replayed graph, as a write its
capture made (a CUDA replay writes without the dispatcher). ``runner.stats.inputs_copied_back``
counts the copies.

Output lifetime: the tensors a step returns are views of the model's outputs. When a graph was
replayed those are the graph's static output tensors, overwritten by the next step (of any size:
graphs share one memory pool). Consume or copy them before the next step, or construct the runner
with ``copy_outputs=True`` (which threads sharing a runner must do: see ``GraphRunner``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from threading import get_ident as _get_ident
from types import MappingProxyType
from typing import Any

import torch
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from freezeframe.batch import BatchDescriptor
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import ForwardContext, entered, forward_context
from freezeframe.errors import (
    CaptureError,
    ConfigError,
    FallbackError,
    FreezeframeError,
    GraphMemoryBudgetError,
    InputMismatchError,
    ShapeOutOfRangeError,
)
from freezeframe.graphs.backend import graphs_possible
from freezeframe.graphs.capturable import Capturable
from freezeframe.graphs.wrapper import GraphWrapper, StaleReplay
from freezeframe.runtime.capture_policy import CapturePolicy, DeferredCaptures, GraphKey
from freezeframe.runtime.dispatcher import Dispatcher
from freezeframe.runtime.dp import agree_across_ranks
from freezeframe.runtime.graph_memory import (
    GraphMemoryPrediction,
    format_bytes,
    measurement_plan,
    predict_graph_memory,
)
from freezeframe.runtime.inputs import InputSpec
from freezeframe.runtime.progress import capture_progress
from freezeframe.runtime.step_plan import Padding, Staging, StepPlan, plan_key
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan, plan_for_step
from freezeframe.runtime.verify import Verifier
from freezeframe.stats import Stats

__all__ = ["CaptureReport", "GraphCapture", "GraphRunner"]

logger = logging.getLogger(__name__)

_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL

# Keyword arguments of GraphRunner.__call__; an input may not take one of these names.
_STEP_OPTIONS = frozenset({"uniform_decode", "has_lora", "num_active_loras", "num_reqs",
                           "invalid_modes", "extras"})

# Why a step ran without a graph -> (log level, explanation). The counter is fallback_<reason>.
FALLBACK_REASONS: Mapping[str, tuple[int, str]] = {
    "graphs_off": (logging.INFO, "cudagraph_mode is NONE, so every step runs eagerly"),
    "graphs_unavailable": (logging.WARNING,
                           "no graph backend is available (graph_backend={backend} and no CUDA); "
                           "set graph_backend='emulated' to test graphs on CPU"),
    "too_large": (logging.INFO,
                  "a step of {num_tokens} tokens is above the largest capture size {max_size}; "
                  "such steps run eagerly and unpadded (raise max_cudagraph_capture_size to "
                  "capture them)"),
    "mode_invalid": (logging.INFO,
                     "the graph for this step is excluded by invalid_modes={invalid}"),
    "mode_off": (logging.INFO,
                 "cudagraph_mode {mode} captures no graph for this kind of batch "
                 "(uniform_decode={uniform}); use FULL_AND_PIECEWISE to cover mixed batches"),
    "not_captured": (logging.INFO,
                     "the graph for this step ({desc}) is not captured yet (capture_policy="
                     "{policy}); the step runs without a graph until it is"),
    "capture_failed": (logging.WARNING,
                       "capturing the graph for this step ({desc}) failed earlier (the error "
                       "was raised then); such steps run without a graph until a capture of "
                       "it succeeds"),
    "compile_disabled": (logging.INFO,
                         "compiling is disabled for the process (TORCH_COMPILE_DISABLE=1 or "
                         "torch._dynamo.config.disable), so capture() captured nothing and "
                         "every step runs eagerly"),
    "no_key": (logging.WARNING,
               "no captured graph matches the step ({desc}); check the LoRA settings "
               "(max_loras, cudagraph_specialize_lora)"),
}


# -- capture report --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GraphCapture:
    """One captured graph: its key, the wall time of its warm-ups and capture, and the memory
    it took: on CUDA the growth of the graph pool's segments over its capture, read from the
    caching allocator (graphs share one pool, so a graph captured after a larger one may take
    almost nothing); where the graphs account for their own memory (``emulated``: the tensors
    each one keeps), the bytes it added; 0 where neither applies.

    ``predicted_bytes`` is what the graph-memory prediction said for it (None when no
    prediction was made), and ``probe`` whether it was one of the measured sizes the prediction
    was fitted on (captured first when the runner has a budget; see
    :mod:`freezeframe.runtime.graph_memory`)."""

    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    seconds: float
    memory_bytes: int
    predicted_bytes: int | None = None
    probe: bool = False


@dataclasses.dataclass(frozen=True)
class CaptureReport:
    """What :meth:`GraphRunner.capture` did. ``memory_bytes`` is the graph memory of the whole
    capture: the growth of the graph pool on CUDA (the allocator's segments of that pool; a
    model whose graphs the runner cannot see falls back to the free-memory delta), the sum of
    the graphs' own accounting on ``emulated``.

    ``prediction`` is the graph-memory prediction (made before the capture when the runner has a
    ``graph_memory_budget``, from the same measured sizes after it on ``emulated`` otherwise),
    ``budget_bytes`` the budget it was checked against."""

    graphs: tuple[GraphCapture, ...] = ()
    seconds: float = 0.0
    memory_bytes: int = 0
    device: str = "cpu"
    prediction: GraphMemoryPrediction | None = None
    budget_bytes: int | None = None

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def count(self, mode: CUDAGraphMode) -> int:
        return sum(1 for g in self.graphs if g.mode is mode)

    @property
    def predicted_bytes(self) -> int | None:
        """The predicted graph memory of the whole capture, or None."""
        return self.prediction.total_bytes if self.prediction is not None else None

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured for the whole capture, or None without a
        prediction or with nothing measured."""
        if self.prediction is None or self.memory_bytes <= 0:
            return None
        return (self.prediction.total_bytes - self.memory_bytes) / self.memory_bytes

    @property
    def worst_graph_error(self) -> float | None:
        """The largest |predicted - measured| / measured over the graphs that were predicted
        (not measured) and took memory, or None."""
        errors = [abs(g.predicted_bytes - g.memory_bytes) / g.memory_bytes
                  for g in self.graphs
                  if g.predicted_bytes is not None and not g.probe and g.memory_bytes > 0]
        return max(errors) if errors else None

    def summary(self) -> str:
        text = (f"captured {self.num_graphs} graphs ({self.count(_PIECEWISE)} piecewise, "
                f"{self.count(_FULL)} full) in {self.seconds:.2f} s, using "
                f"{format_bytes(self.memory_bytes)} of {self.device} memory")
        error = self.prediction_error
        if self.prediction is not None and error is not None:
            worst = self.worst_graph_error
            text += (f"; predicted {format_bytes(self.prediction.total_bytes)} (error "
                     f"{error:+.1%}" + (f", worst graph {worst:.1%}" if worst is not None
                                        else "") + ")")
        if self.budget_bytes is not None:
            text += f", budget {format_bytes(self.budget_bytes)}"
        return text


# -- the runner ----------------------------------------------------------------------------
class GraphRunner:
    """Owns static input buffers, captures every graph the dispatcher knows, runs steps.

    Args:
        model: any callable; called as ``model(**{name: padded_buffer_view})`` (or positionally,
            in the order of ``inputs``, with ``call_positional=True``).
        config: the compilation config (default: ``model.config``). Its capture sizes, graph
            mode, ``max_num_tokens`` and ``max_num_seqs`` size the buffers and the keys.
        inputs: name -> :class:`InputSpec` (``Tokens(...)``, ``Requests(...)``, ``Static(...)``)
            in the order of the model's arguments. At least one ``Tokens`` input is needed.
        device: where the buffers live (default: the model's first parameter, else CPU).
        outputs: how to slice outputs: ``"tokens"`` (rows = tokens), ``"requests"``, ``"none"``,
            or a sequence / mapping of those matching a tuple / dict output.
        copy_outputs: return copies instead of views of the graph's static outputs (needed
            when threads share the runner, see "Threads").
        strict: raise :class:`FallbackError` instead of running a step eagerly.
        dp_sync: agree on the padded size with the other data-parallel ranks each step.
        dp_group: the process group for ``dp_sync`` (default: the world).
        invalid_modes: runtime modes never to dispatch to (for example ``{FULL}``).
        progress: show a tqdm progress bar during capture when tqdm is installed.
        capture_policy: when graphs are captured: ``"eager"`` (all in :meth:`capture`),
            ``"lazy"`` (a graph key's ``lazy_warmups + 1``-th step captures it) or
            ``"background"`` (a thread captures them while steps run); see
            :mod:`freezeframe.runtime.capture_policy`.
        lazy_warmups: steps of a graph key that run without a graph before the lazy policy
            captures it.
        graph_memory_budget: bytes of graph memory :meth:`capture` may use, or None (no
            limit). With a budget, capture() first captures the two smallest sizes of each
            family of keys (and size 1), predicts every other size's memory from them
            (:mod:`freezeframe.runtime.graph_memory`) and raises
            :class:`~freezeframe.errors.GraphMemoryBudgetError`, keeping nothing, when the
            prediction is over the budget. Only with ``capture_policy="eager"``.

    Threads: a step and :meth:`capture` hold the runner's lock (about 0.1-0.2 us when no other
    thread holds it), so calls from several threads run one at a time, each on its own inputs,
    and the inputs the model wrote into are copied back before the lock is released. The
    outputs are the one thing the lock cannot protect: they are views of static memory that
    the next step, of any thread, overwrites. Threads that share a runner must construct it
    with ``copy_outputs=True`` (the copy is made inside the lock). Without it, the first time a
    call has to wait for another thread's, the runner logs a warning, counts ``lock_waits``
    and returns copies from then on; outputs returned as views before that may already have
    been overwritten. A model that calls its own runner from inside a step gets a
    :class:`~freezeframe.errors.FreezeframeError` (not a deadlock).
    """

    def __init__(
        self,
        model: Callable[..., Any],
        config: CompilationConfig | None = None,
        *,
        inputs: Mapping[str, InputSpec],
        device: torch.device | str | None = None,
        outputs: str | Sequence[str] | Mapping[str, str] = "tokens",
        copy_outputs: bool = False,
        strict: bool = False,
        dp_sync: bool = False,
        dp_group: Any = None,
        invalid_modes: Collection[CUDAGraphMode] = frozenset(),
        call_positional: bool = False,
        progress: bool = True,
        capture_policy: CapturePolicy | str = CapturePolicy.EAGER,
        lazy_warmups: int = 1,
        graph_memory_budget: int | None = None,
        verify: int = 0,
        verify_tolerance: float | None = None,
    ) -> None:
        # A model holding its own graphs (ff.compile's); None for a plain callable.
        self._held: Capturable | None = model if isinstance(model, Capturable) else None
        config = _runner_config(config, self._held, strict)
        self.model = model
        self.config = config
        self.dispatcher = Dispatcher(config)
        self.stats = Stats()
        self.strict = strict
        self.copy_outputs = copy_outputs
        self.dp_sync = dp_sync
        self.dp_group = dp_group
        self.call_positional = call_positional
        self.progress = progress
        self.outputs = outputs
        self.invalid_modes = frozenset(invalid_modes)
        for m in self.invalid_modes:
            if m not in (_PIECEWISE, _FULL):
                raise ConfigError(f"invalid_modes may hold PIECEWISE and FULL, got {m!r}")
        self.report: CaptureReport | None = None
        self.capture_policy = CapturePolicy.parse(capture_policy)
        if not isinstance(lazy_warmups, int) or isinstance(lazy_warmups, bool) \
                or lazy_warmups < 0:
            raise ConfigError(f"lazy_warmups must be an int >= 0, got {lazy_warmups!r}")
        self.lazy_warmups = lazy_warmups
        self.graph_memory_budget = _check_budget(graph_memory_budget, self.capture_policy)
        # verify=N: the first N graph steps of each key also run eagerly and are compared
        verifier = Verifier(verify, verify_tolerance, self.stats)
        self._verifier: Verifier | None = verifier if verify else None
        if self.capture_policy is CapturePolicy.BACKGROUND and dp_sync:
            raise ConfigError(
                "capture_policy='background' with dp_sync=True: data-parallel ranks must "
                "capture the same graphs at the same steps, which a background thread cannot "
                "promise; use capture_policy='lazy' (deterministic) or 'eager'")
        # lazy / background: the graph keys not captured yet, and the capturing thread
        self._deferred: DeferredCaptures | None = None
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None
        # capture() failed (and freed its graphs): until one succeeds, steps run without
        # graphs (counted fallback_capture_failed) instead of reaching a closed capture window
        self._capture_failed = False
        # capture() found compiling disabled for the process: nothing captured, steps eager
        self._compile_disabled = False
        self._logged_reasons: set[str] = set()
        # sizes and graph keys that ran eagerly before their first capture (see _num_warmups)
        self._primed_sizes: set[int] = set()
        self._primed_keys: set[GraphKey] = set()
        self.device = _resolve_device(device, model)
        self.graphs_available = graphs_possible(config)
        # the model's graph generation this runner's graphs and plans belong to (it moves when
        # the model drops every graph: parameters replaced; see _capture_again)
        self._generation = self._held.graph_generation if self._held is not None else 0

        specs = _input_specs(inputs)
        self.specs: Mapping[str, InputSpec] = specs
        self._buffers = _allocate_buffers(specs, config, self.device)
        self._buffer_list = list(self._buffers.values())  # in the order of self.specs
        self._slots = [(name, spec.kind, self._buffers[name]) for name, spec in specs.items()]
        # (runtime mode, descriptor) -> the inputs its graph writes into, seen at capture: a
        # CUDA graph replay writes without bumping version counters.
        self._graph_writes: dict[tuple[CUDAGraphMode, BatchDescriptor], frozenset[str]] = {}
        # Output leaves (in _slice's order) -> (padded tokens, padded requests, dim 0) seen at
        # capture; the leaves whose dim 0 did not follow the padded size are never sliced.
        self._leaf_sizes: dict[int, set[tuple[int, int | None, int | None]]] = {}
        self._fixed_leaves: dict[int, frozenset[str]] = {}
        self._scaled_leaves: dict[int, int] = {}
        # Steps and capture hold this lock (see "Threads" in the class docstring).
        self._lock = threading.Lock()
        self._lock_owner: int | None = None  # the thread holding the lock, while it does
        self._last_holder: int | None = None  # the thread that took the lock last (kept)
        self._copy_after_overlap = False
        # Per buffer: the rows from this index on are known to hold the input's fill value (a
        # step whose padding lies there need not reset it). Staging and the model's writes
        # raise it; capture and a failed step refill the whole buffer (back to 0).
        self._fill_from: dict[str, int] = dict.fromkeys(self._buffers, 0)
        # The staging of the last step, while nothing else wrote the buffers since: a step of
        # the same shape then finds its padding reset already (see _stage_into)
        self._staged: Staging | None = None
        # (tokens, padded tokens, requests, padded requests) -> where a step is staged
        self._stagings: dict[tuple[int, int, int | None, int | None], Staging] = {}
        # real token count -> steps of that many tokens (see size_histogram)
        self._sizes: dict[int, int] = {}
        # plan_key(...) -> a FULL step of that shape, planned (step_plan.py)
        self._plans: dict[Any, StepPlan] = {}  # (a None key, no tensor input, is never kept)
        # (descriptor, padded requests) -> (graphs captured when looked up, the model's direct
        # FULL replay for that shape or None); see _replayer
        self._replays: dict[tuple[BatchDescriptor, int | None],
                            tuple[int, Callable[[], Any] | None]] = {}
        # Graph wrappers that held graphs before this runner existed (low-level forward_context
        # calls on other tensors): capture() frees them. Graphs this runner's own steps capture
        # before capture() read its buffers and are kept.
        self._foreign: list[GraphWrapper] = [
            w for w in self._held.graph_wrappers() if w.captured_descriptors] \
            if self._held is not None else []
        # Micro-batching (runtime/ubatch/overlap.py) stands in for the model's FULL graph.
        self._ubatch: MicroBatchWrapper | None = None
        if config.micro_batching:
            kinds: dict[str | int, str] = {name: s.kind for name, s in specs.items()}
            kinds.update({i: s.kind for i, s in enumerate(specs.values())})
            self._ubatch = MicroBatchWrapper.for_runner(model, config, input_kinds=kinds,
                                                        stats=self.stats)

    # -- public views --------------------------------------------------------------------
    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        """The full static buffers (``max_num_tokens`` / ``max_num_seqs`` rows), read-only view
        of the mapping; writing into them bypasses the runner's padding."""
        return MappingProxyType(self._buffers)

    @property
    def captured(self) -> bool:
        return self.report is not None

    @property
    def size_histogram(self) -> dict[int, int]:
        """How many steps had each real token count (before padding), smallest first: the
        traffic ``ff.plan_capture_sizes`` / ``freezeframe plan`` choose capture sizes for
        (``json.dump`` it as ``{str(n): count}``)."""
        return dict(sorted(self._sizes.items()))

    # -- one step ------------------------------------------------------------------------
    def __call__(
        self,
        *args: torch.Tensor,
        uniform_decode: bool = False,
        has_lora: bool = False,
        num_active_loras: int = 0,
        num_reqs: int | None = None,
        invalid_modes: Collection[CUDAGraphMode] = frozenset(),
        extras: Mapping[str, Any] | None = None,
        num_scheduled_tokens: Sequence[int] | None = None,
        **kwargs: torch.Tensor,
    ) -> Any:
        """Run one step. Inputs are given positionally (in the order of ``inputs``) or by name.

        ``uniform_decode``: every request has exactly ``1 + num_speculative_tokens`` tokens.
        ``num_reqs``: the request count when no ``Requests`` input carries it.
        ``extras``: extra values for the forward context (read by ops as
        ``ff.get_forward_context().extras[...]``); they are the caller's alone: the runner sets
        the context's own ``num_tokens_unpadded`` and ``num_reqs_unpadded`` fields.
        ``num_scheduled_tokens``: the tokens of each request, in order, when micro-batching is
        on (where a step is cut between requests); without it a step that is not a uniform
        decode is cut as one request.

        Steps (and :meth:`capture`) hold the runner's lock, so concurrent calls run one after
        the other; see the class docstring for what that means for the returned tensors.
        """
        # The uncontended path is inline (one non-blocking acquire); _wait_for_lock handles
        # the rest.
        if not self._lock.acquire(blocking=False):
            self._wait_for_lock("a step")
        self._lock_owner = self._last_holder = _get_ident()
        # Inference only: no autograd graph may hang on the static buffers or graph outputs.
        # One switch for the whole step (torch.no_grad() as a context costs more than the
        # rest of a planned step's Python).
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            # A shape planned before (step_plan.py): only the options a plan covers.
            if self._plans and not (kwargs or extras or invalid_modes or has_lora
                                    or num_scheduled_tokens is not None
                                    or self._model_hooked()):
                key = plan_key(args, num_reqs, uniform_decode)
                plan = self._plans.get(key)
                if plan is not None and (self._verifier is None
                                         or not self._verifier.due(_graph_key_of(plan))):
                    out = self._run_plan(key, plan, args)
                    if out is not _STALE:
                        return out
            return self._step(args, kwargs, uniform_decode, has_lora, num_active_loras,
                              num_reqs, invalid_modes, extras, num_scheduled_tokens)
        finally:
            torch._C._set_grad_enabled(grad)
            self._lock_owner = None
            self._lock.release()

    def _wait_for_lock(self, what: str) -> None:
        """Another step or capture holds the runner's lock: wait for it. A thread re-entering
        its own step gets an error instead of a deadlock; a call that had to wait for another
        thread's is counted (``lock_waits``) and switches the runner to copying outputs."""
        if self._lock_owner == _get_ident():
            raise FreezeframeError(
                f"GraphRunner: {what} was started from inside a step or capture on the same "
                "thread (the model called its own runner); the static buffers hold the outer "
                "call, so the inner one cannot run. Call the runner only from outside it")
        self._lock.acquire()
        background = self._background
        if background is not None and self._last_holder == background.ident:
            # it waited for the background capture of one graph, not for another step
            self.stats.inc("capture_waits")
            return
        self._overlapped()

    def _overlapped(self) -> None:
        self.stats.inc("lock_waits")
        if not self._copy_after_overlap:
            self._copy_after_overlap = True
            if not self.copy_outputs:
                logger.warning(
                    "GraphRunner: steps from several threads overlapped; they run one at a "
                    "time, and from now on every step returns copies of its outputs (a view of "
                    "the static outputs would be overwritten by the next thread's step). "
                    "Construct the runner with copy_outputs=True when threads share it: the "
                    "outputs of the steps before the first overlap were views")

    def _step(self, args: tuple[Any, ...], kwargs: dict[str, Any], uniform_decode: bool,
              has_lora: bool, num_active_loras: int, num_reqs: int | None,
              invalid_modes: Collection[CUDAGraphMode],
              extras: Mapping[str, Any] | None,
              num_scheduled_tokens: Sequence[int] | None) -> Any:
        held = self._held
        if held is not None and self.graphs_available \
                and held.check_state() != self._generation:
            self._capture_again()
        values = self._bind(args, kwargs)
        num_tokens, reqs = self._validate(values, num_reqs, uniform_decode)
        self._sizes[num_tokens] = self._sizes.get(num_tokens, 0) + 1
        aliased = self._aliased(values) if len(self._slots) > 1 else ()
        step_tokens, step_uniform = num_tokens, bool(uniform_decode)
        if self.dp_sync:
            step_tokens, step_uniform = agree_across_ranks(num_tokens, step_uniform,
                                                           self.dp_group)
        invalid = self.invalid_modes | frozenset(invalid_modes) if invalid_modes \
            else self.invalid_modes
        mode, desc = self._dispatch(step_tokens, step_uniform, has_lora, num_active_loras,
                                    invalid)
        if mode is not _NONE and self._capture_failed:
            mode, desc = self._without_graph((mode, desc), "capture_failed", step_tokens,
                                             step_uniform, has_lora, num_active_loras)
        if mode is not _NONE and self._deferred and self._deferred.waiting((mode, desc)):
            mode, desc = self._deferred_step((mode, desc), step_tokens, step_uniform, has_lora,
                                             num_active_loras)
        if mode is not _NONE and self.report is None and self._records_only() \
                and (mode, desc) not in self._primed_keys:
            # before capture(), a step of a key nothing ran yet would capture that key's code
            # on its first run (the window is open): it runs without a graph, as a warm-up
            mode, desc = self._warm_up_step((mode, desc), step_tokens, step_uniform, has_lora,
                                            num_active_loras)
        padded_tokens = desc.num_tokens if mode is not _NONE else step_tokens
        padded_reqs = desc.num_reqs if desc.num_reqs is not None else reqs
        if mode is CUDAGraphMode.PIECEWISE and reqs is not None:
            # A piecewise graph's key ignores the request count, so its pieces were captured
            # with the request rows _capture_one gave them; every step of that size passes as
            # many (the padded rows hold the fill value), never fewer, which a replay would
            # read as stale rows.
            padded_reqs = min(padded_tokens, self.config.max_num_seqs)
        if reqs is not None and padded_reqs is not None and reqs > padded_reqs:
            raise InputMismatchError(
                f"step has {reqs} requests but the graph key {desc} holds {padded_reqs}; with "
                f"uniform_decode=True every request must have exactly "
                f"{self.dispatcher.uniform_decode_query_len} tokens")
        self._stage(values, num_tokens, padded_tokens, reqs, padded_reqs)
        counters = (("steps", 1), (_STEP_COUNTER[mode], 1)) + (
            (("padded_tokens", padded_tokens - num_tokens),) if padded_tokens != num_tokens
            else ())
        stats = self.stats
        for name, by in counters:
            stats.inc(name, by)
        step_extras = dict(extras) if extras else {}
        plan = self._plan_micro_batches(num_scheduled_tokens, num_tokens, reqs, padded_tokens,
                                        padded_reqs, step_uniform)
        versions = [buf._version for buf in self._buffer_list]
        writes = self._graph_writes.get((mode, desc))
        if aliased and writes:
            self._refuse_written_alias(values, aliased, writes)
        hooked = self._model_hooked()  # its hooks run in __call__: no direct replay then
        plannable = writes is not None and not writes and plan is None and not hooked \
            and self._held is not None and not (kwargs or extras or invalid_modes or has_lora
                                                or self.dp_sync
                                                or num_scheduled_tokens is not None)
        verifier = self._verifier
        checked = verifier is not None and mode is not _NONE and self._held is not None \
            and verifier.due((mode, desc))
        before = verifier.begin(self._held.module) if checked else None  # type: ignore[union-attr]
        replay = None
        try:
            replay = self._replayer(mode, desc, padded_tokens, padded_reqs) \
                if plan is None and not hooked else None
            out = self._replay(replay, desc, padded_reqs) if replay is not None else _STALE
            if out is _STALE:
                replay = None
                if mode is _PIECEWISE and plannable:
                    out, replay = self._planned_piecewise(desc, padded_tokens, padded_reqs,
                                                          num_tokens, reqs)
                else:
                    out = self._forward(mode, desc, padded_tokens, padded_reqs, num_tokens,
                                        reqs, step_extras, plan)
        except BaseException:
            self._after_failure(values, versions, writes, num_tokens, reqs)
            raise
        slots = self._written(versions, writes)
        out = self._finish(out, values, slots, aliased, padded_tokens, num_tokens, padded_reqs,
                           reqs)
        if before is not None:
            assert verifier is not None and self._held is not None
            verifier.finish((mode, desc), before, out, self._held.module,
                            lambda: self._eagerly(values, num_tokens, step_extras))
        if replay is not None and not slots and plannable:
            context = ForwardContext(mode=mode, batch_descriptor=desc,
                                     num_tokens_unpadded=num_tokens, num_reqs_unpadded=reqs) \
                if mode is _PIECEWISE else None
            self._keep_plan(args, num_reqs, uniform_decode, replay, (desc, padded_reqs), out,
                            counters, num_tokens, reqs, padded_tokens, padded_reqs, context)
        if self.copy_outputs or self._copy_after_overlap:
            out = _map_tensors(out, lambda t: t.clone())
        return out

    def _planned_piecewise(self, desc: BatchDescriptor, padded_tokens: int,
                           padded_reqs: int | None, num_tokens: int, reqs: int | None
                           ) -> tuple[Any, Callable[[], Any] | None]:
        """A PIECEWISE step through the model that the model watches, to hand back a replay
        of it for later steps of the shape (see CompiledModel.plan_piecewise)."""
        assert self._held is not None
        views = self._views(padded_tokens, padded_reqs)
        args, kwargs = (tuple(views.values()), {}) if self.call_positional else ((), views)
        return self._held.plan_piecewise(
            desc, args, kwargs, lambda: self._forward(_PIECEWISE, desc, padded_tokens,
                                                      padded_reqs, num_tokens, reqs, {}, None))

    def _after_failure(self, values: Mapping[str, torch.Tensor], versions: list[int],
                       writes: frozenset[str] | None, num_tokens: int, reqs: int | None
                       ) -> None:
        """A step raised: what the model wrote before it did reaches the caller, as in eager,
        and the buffers are refilled (it may have written any row)."""
        with contextlib.suppress(Exception):
            self._copy_back(values, self._written(versions, writes), num_tokens, reqs)
        with contextlib.suppress(Exception):
            self._reset_padding()

    def _finish(self, out: Any, values: Mapping[str, torch.Tensor],
                slots: list[tuple[str, str, torch.Tensor]],
                aliased: tuple[tuple[str, ...], ...], padded_tokens: int, num_tokens: int,
                padded_reqs: int | None, reqs: int | None) -> Any:
        """After the model ran: copy the inputs it wrote (``slots``) back to the caller and
        cut the outputs to the real rows."""
        for name, _, buf in slots:  # the model wrote there: its padding may not hold the fill
            self._fill_from[name] = _rows(buf)
            self._staged = None
        out = self._detach_from_written(out, values, slots)
        written = self._copy_back(values, slots, num_tokens, reqs)
        if aliased and written:
            self._refuse_written_alias(values, aliased, written)
        return self._slice(out, self.outputs, padded_tokens, num_tokens, padded_reqs, reqs,
                           [0])

    # -- planned steps (step_plan.py) ----------------------------------------------------
    def _keep_plan(self, args: tuple[Any, ...], num_reqs: int | None, uniform_decode: bool,
                   replay: Callable[[], Any], replay_key: tuple[BatchDescriptor, int | None],
                   out: Any, counters: tuple[tuple[str, int], ...], num_tokens: int,
                   reqs: int | None, padded_tokens: int, padded_reqs: int | None,
                   context: ForwardContext | None) -> None:
        """Keep what this step worked out, for later steps of its shape: it replayed a FULL
        graph (or a planned PIECEWISE chain, run in ``context``), wrote no input and took only
        options a plan covers."""
        if len(args) != len(self.specs):
            return
        key = plan_key(args, num_reqs, uniform_decode)
        if key is None:
            return
        self._plans[key] = StepPlan(
            staging=self._stagings[(num_tokens, padded_tokens, reqs, padded_reqs)],
            replay=replay, replay_key=replay_key, output=_map_tensors(out, _alias),
            counts=tuple((self.stats.tally(name), by) for name, by in counters),
            num_tokens=num_tokens, num_reqs=reqs, context=context)

    def _stale_plan(self, key: Any, plan: StepPlan) -> Any:
        """A graph of ``plan`` was dropped (its replay raised before anything ran): forget the
        plan and the shape's remembered replay; the caller takes the whole way."""
        self._forget_plan(key)
        self._replays.pop(plan.replay_key, None)
        return _STALE

    def _forget_plan(self, key: tuple[Any, ...]) -> None:
        plan = self._plans.pop(key)
        for tally, _ in plan.counts:
            self.stats.retire(tally)

    def _run_plan(self, key: Any, plan: StepPlan, args: tuple[Any, ...]) -> Any:
        """One step of a planned shape: stage, replay, answer. ``_STALE`` when the plan no
        longer holds (its graph was dropped): the caller takes the whole way."""
        self._stage_into(plan.staging, args)
        self._sizes[plan.num_tokens] += 1  # the first step of the shape put it there
        context = plan.context
        if context is None:
            # FULL: the replay repeats the work of the step that made the plan, which wrote
            # no input, so no version counter is read (see step_plan.py)
            try:
                out = plan.replay()  # grad mode is off for the whole step (see __call__)
            except StaleReplay:
                return self._stale_plan(key, plan)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._reset_padding()
                raise
            for tally, by in plan.counts:
                tally.n += by
            out = plan.output
            # new tensor objects (views) and containers every step, as a step taking the
            # whole way makes: the caller may change the last ones (y.t_(), pop a key)
            out = out.detach() if out.__class__ is torch.Tensor else _map_tensors(out, _alias)
        else:
            out = self._run_piecewise_plan(key, plan, args, context)
            if out is _STALE:
                return out
        if self.copy_outputs or self._copy_after_overlap:
            out = _map_tensors(out, lambda t: t.clone())
        return out

    def _run_piecewise_plan(self, key: tuple[Any, ...], plan: StepPlan, args: tuple[Any, ...],
                            context: ForwardContext) -> Any:
        """The replay and answer of a planned PIECEWISE step: its splitting ops run their
        Python, so the inputs' version counters are compared around it."""
        buffers = self._buffer_list
        versions = [buf._version for buf in buffers]
        try:
            with entered(context):
                out = plan.replay()
        except StaleReplay:
            return self._stale_plan(key, plan)
        except BaseException:
            self._after_failure(dict(zip(self.specs, args, strict=True)), versions, None,
                                plan.num_tokens, plan.num_reqs)
            raise
        for tally, by in plan.counts:
            tally.n += by
        padded_tokens, padded_reqs = plan.replay_key[0].num_tokens, plan.replay_key[1]
        for buf, before in zip(buffers, versions, strict=True):
            if buf._version != before:
                # The model wrote an input after all: finish the whole way, without the plan.
                self._forget_plan(key)
                values = dict(zip(self.specs, args, strict=True))
                slots = self._written(versions, None)
                aliased = self._aliased(values) if len(self._slots) > 1 else ()
                return self._finish(out, values, slots, aliased, padded_tokens,
                                    plan.num_tokens, padded_reqs, plan.num_reqs)
        if out is plan.last_out:  # the same static tensor as last step: the same cut of it
            cut = plan.last_cut  # (a new view of it per step: see _slice_rows)
            return cut.detach() if cut.__class__ is torch.Tensor else _map_tensors(cut, _alias)
        cut = self._slice(out, self.outputs, padded_tokens, plan.num_tokens, padded_reqs,
                          plan.num_reqs, [0])
        if out.__class__ is torch.Tensor:
            # kept as a view of its own (the answer returned now may be changed in place)
            plan.last_out, plan.last_cut = out, _map_tensors(cut, _alias)
        return cut

    def _aliased(self, values: Mapping[str, torch.Tensor]) -> tuple[tuple[str, ...], ...]:
        """Groups of inputs whose byte ranges overlap (the same tensor passed twice, views of
        one storage); :meth:`_refuse_written_alias` confirms that they share an element before
        it refuses (``t[:, :2]`` and ``t[:, 2:]`` interleave but share none)."""
        spans = sorted((*span, name) for name in self.specs
                       if (span := _byte_span(values[name])) is not None)
        groups: list[list[str]] = []
        end = -1
        for start, stop, name in spans:
            if start < end:
                groups[-1].append(name)
            else:
                groups.append([name])
            end = max(end, stop)
        return tuple(tuple(g) for g in groups if len(g) > 1)

    def _refuse_written_alias(self, values: Mapping[str, torch.Tensor],
                              aliased: tuple[tuple[str, ...], ...],
                              written: Collection[str]) -> None:
        """Eagerly, a write into one of two inputs that share memory shows through the other;
        the runner stages each input in a buffer of its own, so it would not."""
        for group in aliased:
            for hit in (n for n in group if n in written):
                other = next((n for n in group
                              if n != hit and _share_elements(values[hit], values[n])), None)
                if other is None:
                    continue
                raise InputMismatchError(
                    f"inputs {hit!r} and {other!r} share memory and the model writes "
                    f"into {hit!r}: eagerly that write would show through {other!r}, "
                    "but the runner stages each input in a buffer of its own, so the step "
                    f"would not give eager's answer. Pass separate tensors (e.g. "
                    f"{other}={other}.clone())")

    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        names = list(self.specs)
        if len(args) > len(names):
            raise InputMismatchError(
                f"step got {len(args)} positional inputs but the runner has {len(names)} "
                f"({names})")
        values = dict(zip(names, args, strict=False))
        for name, value in kwargs.items():
            if name not in self.specs:
                raise InputMismatchError(f"step got an unknown input {name!r}; the runner's "
                                         f"inputs are {names}")
            if name in values:
                raise InputMismatchError(f"input {name!r} given both by position and by name")
            values[name] = value
        missing = [n for n in names if n not in values]
        if missing:
            raise InputMismatchError(f"step is missing input(s) {missing}; the runner's inputs "
                                     f"are {names}")
        return values

    def _validate(self, values: Mapping[str, Any], num_reqs: int | None,
                  uniform_decode: bool) -> tuple[int, int | None]:
        """Check every input against its spec; the step's token and request counts."""
        tokens: tuple[str, int] | None = None
        reqs: tuple[str, int] | None = None
        for name, spec in self.specs.items():
            n = self._check_input(name, spec, values[name])
            if n is None:
                continue
            seen, what = (tokens, "tokens") if spec.kind == "tokens" else (reqs, "requests")
            if seen is not None and seen[1] != n:
                raise InputMismatchError(
                    f"inputs {seen[0]!r} and {name!r} disagree on the number of {what}: "
                    f"{seen[1]} vs {n}")
            if spec.kind == "tokens":
                tokens = tokens or (name, n)
            else:
                reqs = reqs or (name, n)
        assert tokens is not None  # construction requires a Tokens input
        num_tokens = tokens[1]
        max_tokens = self.config.max_num_tokens
        if not 1 <= num_tokens <= max_tokens:
            raise ShapeOutOfRangeError(
                f"input {tokens[0]!r} has {num_tokens} tokens; a step needs 1..max_num_tokens="
                f"{max_tokens} tokens (split larger batches or raise max_num_tokens)")
        if reqs is not None and num_reqs is not None and num_reqs != reqs[1]:
            raise InputMismatchError(
                f"num_reqs={num_reqs} disagrees with input {reqs[0]!r}, which has {reqs[1]} rows")
        count = reqs[1] if reqs is not None else num_reqs
        if count is not None:
            self._check_requests(count, num_tokens, uniform_decode)
        return num_tokens, count

    def _check_input(self, name: str, spec: InputSpec, t: Any) -> int | None:
        """Refuse a value that does not fit its spec; its row count (None for a static one)."""
        if not isinstance(t, torch.Tensor):
            raise InputMismatchError(
                f"input {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != spec.dtype:
            raise InputMismatchError(
                f"input {name!r}: expected dtype {spec.dtype}, got {t.dtype}; convert it "
                f"(tensor.to({spec.dtype})) or declare the input with dtype={t.dtype}")
        if t.device != self.device:
            raise InputMismatchError(
                f"input {name!r}: expected device {self.device}, got {t.device}; move it "
                f"first (tensor.to({str(self.device)!r}))")
        if spec.kind == "static":
            if tuple(t.shape) != spec.shape:
                raise InputMismatchError(
                    f"input {name!r}: static input expected shape {list(spec.shape)}, got "
                    f"{list(t.shape)}")
            return None
        if t.dim() != 1 + len(spec.shape) or tuple(t.shape[1:]) != spec.shape:
            raise InputMismatchError(
                f"input {name!r}: expected shape [{spec.kind}, "
                f"{', '.join(map(str, spec.shape))}]".replace(", ]", "]")
                + f", got {list(t.shape)}; the trailing shape must be {list(spec.shape)}")
        return int(t.shape[0])

    def _check_requests(self, count: int, num_tokens: int, uniform_decode: bool) -> None:
        if not 0 <= count <= self.config.max_num_seqs:
            raise ShapeOutOfRangeError(
                f"step has {count} requests; at most max_num_seqs="
                f"{self.config.max_num_seqs} fit the request buffers")
        if count > num_tokens:
            raise InputMismatchError(
                f"step has {count} requests but only {num_tokens} tokens; every request "
                "needs at least one token")
        q = self.dispatcher.uniform_decode_query_len
        if uniform_decode and count * q != num_tokens:
            raise InputMismatchError(
                f"uniform_decode=True needs num_tokens == num_reqs * {q}, got {num_tokens} "
                f"tokens for {count} requests")

    # -- dispatch and fallback accounting ------------------------------------------------
    def _dispatch(self, num_tokens: int, uniform: bool, has_lora: bool, num_active_loras: int,
                  invalid: frozenset[CUDAGraphMode]) -> tuple[CUDAGraphMode, BatchDescriptor]:
        d = self.dispatcher
        if not self.graphs_available or self._compile_disabled:
            mode, desc = d.dispatch(num_tokens, uniform, has_lora, num_active_loras,
                                    invalid_modes=_GRAPH_MODES)
        else:
            mode, desc = d.dispatch(num_tokens, uniform, has_lora, num_active_loras,
                                    invalid_modes=invalid)
        if mode is _NONE:
            reason = self._fallback_reason(num_tokens, uniform, has_lora, num_active_loras,
                                           invalid)
            self._fallback(reason, num_tokens=num_tokens, uniform=uniform, desc=desc,
                           invalid=sorted(m.name for m in invalid))
        return mode, desc

    def _fallback_reason(self, num_tokens: int, uniform: bool, has_lora: bool,
                         num_active_loras: int, invalid: frozenset[CUDAGraphMode]) -> str:
        d = self.dispatcher
        if d.cudagraph_mode is _NONE:
            return "graphs_off"
        if not self.graphs_available:
            return "graphs_unavailable"
        if self._compile_disabled:
            return "compile_disabled"
        if num_tokens > d.max_capture_size:
            return "too_large"
        if invalid and d.dispatch(num_tokens, uniform, has_lora, num_active_loras)[0] is not _NONE:
            return "mode_invalid"
        # Would a plain batch of this size and kind (no LoRA) get a graph? If not, the config
        # mode simply does not cover this kind of batch.
        if d.dispatch(num_tokens, uniform)[0] is _NONE:
            return "mode_off"
        return "no_key"

    def _deferred_step(self, key: GraphKey, num_tokens: int, uniform: bool, has_lora: bool,
                       num_active_loras: int) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """A step whose graph is not captured yet (lazy or background policy): capture it now
        when the lazy policy says it is due, else run the step without a graph."""
        deferred = self._deferred
        assert deferred is not None
        if self.capture_policy is CapturePolicy.LAZY and deferred.due(key):
            self._capture_deferred(key)
            return key
        reason = "capture_failed" if key in deferred.failed else "not_captured"
        return self._without_graph(key, reason, num_tokens, uniform, has_lora, num_active_loras)

    def _warm_up_step(self, key: GraphKey, num_tokens: int, uniform: bool, has_lora: bool,
                      num_active_loras: int) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """A step before capture() whose graph key no pass ran yet, where the backend only
        records (see _records_only): it runs without a graph (counted in ``warmups``, not a
        fallback), and the next step of the key captures it."""
        self._primed_keys.add(key)
        self._primed_sizes.add(key[1].num_tokens)
        self.stats.inc("warmups")
        return self.dispatcher.dispatch(num_tokens, uniform, has_lora, num_active_loras,
                                        invalid_modes=_GRAPH_MODES)

    def _without_graph(self, key: GraphKey, reason: str, num_tokens: int, uniform: bool,
                       has_lora: bool, num_active_loras: int
                       ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The step's graph (``key``) cannot run: dispatch it without a graph, counted and
        logged as ``reason`` (strict runners raise)."""
        mode, desc = self.dispatcher.dispatch(num_tokens, uniform, has_lora, num_active_loras,
                                              invalid_modes=_GRAPH_MODES)
        self._fallback(reason, num_tokens=num_tokens, uniform=uniform, desc=key[1],
                       invalid=[])
        return mode, desc

    def _fallback(self, reason: str, **info: Any) -> None:
        self.stats.inc(f"fallback_{reason}")
        level, template = FALLBACK_REASONS[reason]
        message = template.format(
            backend=self.config.graph_backend, max_size=self.dispatcher.max_capture_size,
            mode=self.dispatcher.cudagraph_mode.name, policy=self.capture_policy.value, **info)
        if self.strict:
            raise FallbackError(
                f"step would run without a graph ({reason}): {message}. The runner is strict; "
                "construct it with strict=False to allow eager fallbacks")
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            logger.log(level, "GraphRunner eager fallback (%s, logged once): %s", reason, message)

    # -- buffers -------------------------------------------------------------------------
    def _stage(self, values: Mapping[str, torch.Tensor], num_tokens: int, padded_tokens: int,
               reqs: int | None, padded_reqs: int | None) -> None:
        """Copy the step into the buffers and reset the padded tail to each input's fill, so
        no stale rows from an earlier, larger step leak into this one. The buffer views of a
        shape are made once (:meth:`_staging`); a step makes one copy launch for all inputs,
        and a fill only where an earlier step or the model may have written the padding."""
        key = (num_tokens, padded_tokens, reqs, padded_reqs)
        staging = self._stagings.get(key)
        if staging is None:
            staging = self._stagings[key] = self._staging(*key)
        self._stage_into(staging, [values[name] for name in staging.names])

    def _stage_into(self, staging: Staging, sources: Sequence[torch.Tensor]) -> None:
        """Copy ``sources`` (one per input, in spec order) to where ``staging`` says and reset
        the padding rows that may not hold the fill value."""
        # (no autograd: the step runs with grad mode off, see __call__)
        if len(sources) == 1:
            staging.targets[0].copy_(sources[0])
        else:
            torch._foreach_copy_(staging.targets, list(sources))
        if staging is self._staged:
            return  # this shape was staged last and nothing wrote the buffers since
        fill_from = self._fill_from
        for pad in staging.padding:
            if fill_from[pad.name] > pad.start:
                pad.view.fill_(pad.fill)
                if fill_from[pad.name] <= pad.stop:
                    fill_from[pad.name] = pad.start
        for name, real in zip(staging.names, staging.rows, strict=True):
            if real > fill_from[name]:
                fill_from[name] = real
        self._staged = staging

    def _staging(self, num_tokens: int, padded_tokens: int, reqs: int | None,
                 padded_reqs: int | None) -> Staging:
        """Where a step of this shape is copied (each input's real rows) and which rows are
        reset to the input's fill."""
        names: list[str] = []
        targets: list[torch.Tensor] = []
        padding: list[Padding] = []
        rows: list[int] = []
        for name, spec in self.specs.items():
            buf = self._buffers[name]
            names.append(name)
            if spec.kind == "static":
                targets.append(buf)
                rows.append(_rows(buf))  # every row of a static input is data
                continue
            real = num_tokens if spec.kind == "tokens" else (reqs or 0)
            padded = padded_tokens if spec.kind == "tokens" else (padded_reqs or real)
            targets.append(buf[:real])
            rows.append(real)
            if padded > real:
                padding.append(Padding(name, buf[real:padded], spec.fill, real, padded))
        return Staging(tuple(names), targets, tuple(padding), tuple(rows))

    def _reset_padding(self) -> None:
        """Fill every token and request buffer with its input's fill value (after capture's
        dummy steps, or a step that raised, wrote who knows which rows): from here on, a step
        resets only the padded rows an earlier step may have written."""
        self._staged = None
        with torch.no_grad():
            for name, spec in self.specs.items():
                if spec.kind != "static":
                    self._buffers[name].fill_(spec.fill)
                    self._fill_from[name] = 0

    def _written(self, versions: list[int], graph_writes: frozenset[str] | None
                 ) -> list[tuple[str, str, torch.Tensor]]:
        """The input slots ``(name, kind, buffer)`` the step wrote into.

        A write shows as a moved version counter: every in-place op that goes through the
        dispatcher bumps it (eager code, an emulated replay, Inductor's compiled code). A CUDA
        graph replay writes without the dispatcher, so for a replayed graph the inputs its
        capture wrote into (``graph_writes``) count too."""
        return [(name, kind, buf) for (name, kind, buf), before
                in zip(self._slots, versions, strict=True)
                if buf._version != before or (graph_writes is not None and name in graph_writes)]

    def _detach_from_written(self, out: Any, values: Mapping[str, torch.Tensor],
                             slots: list[tuple[str, str, torch.Tensor]]) -> Any:
        """An output leaf that shares memory with an input about to be written back (the
        previous step's output passed in again, to a model that writes its input) is cloned
        first: the copy-back would otherwise overwrite the answer."""
        targets = [values[name] for name, _, _ in slots]
        if not targets:
            return out
        return _map_tensors(out, lambda t: t.clone() if any(
            _share_elements(t, target) for target in targets) else t)

    def _copy_back(self, values: Mapping[str, torch.Tensor],
                   slots: list[tuple[str, str, torch.Tensor]], num_tokens: int,
                   reqs: int | None) -> list[str]:
        """Write each written input slot (see :meth:`_written`) back into the caller's tensor,
        as running the model eagerly on that tensor would have: the real rows of a token or
        request input (never the padding), all of a static one. Returns the names copied."""
        copied: list[str] = []
        for name, kind, buf in slots:
            target = values[name]
            # An inference tensor (an earlier output passed back in) is written the way it
            # was made; any other tensor outside autograd, as eager's in-place op would be.
            mode = torch.inference_mode() if target.is_inference() else torch.no_grad()
            with mode:
                if kind == "static":
                    target.copy_(buf)
                else:
                    target.copy_(buf[:num_tokens if kind == "tokens" else (reqs or 0)])
            self.stats.inc("inputs_copied_back")
            copied.append(name)
        return copied

    def _replayer(self, mode: CUDAGraphMode, desc: BatchDescriptor, padded_tokens: int,
                  padded_reqs: int | None) -> Callable[[], Any] | None:
        """The model's direct replay of the FULL graph of this step's shape, made once per
        shape (the plan): later steps of that shape stage their inputs and replay, without
        the forward context, the call-structure routing or the per-tensor replay checks.
        Only for a model holding its own graphs, after its graph for ``desc`` exists."""
        if mode is not _FULL or self._held is None or self._ubatch is not None:
            return None
        key = (desc, padded_reqs)
        known = self._replays.get(key)
        captured = self._held.stats.get("graphs_captured")
        if known is not None and (known[1] is not None or known[0] == captured):
            return known[1]
        views = self._views(padded_tokens, padded_reqs)
        args, kwargs = (tuple(views.values()), {}) if self.call_positional else ((), views)
        with torch.no_grad():
            replay = self._held.replayer(desc, args, kwargs)
        self._replays[key] = (captured, replay)  # a miss is retried once more graphs exist
        return replay

    def _replay(self, replay: Callable[[], Any], desc: BatchDescriptor,
                padded_reqs: int | None) -> Any:
        """The replay's output, or ``_STALE`` when its graph was dropped (the step then goes
        through the model, which captures again or refuses)."""
        try:
            return replay()  # grad mode is off for the whole step (see __call__)
        except StaleReplay:
            del self._replays[(desc, padded_reqs)]
            return _STALE

    def _views(self, padded_tokens: int, padded_reqs: int | None) -> dict[str, torch.Tensor]:
        views = {}
        for name, spec in self.specs.items():
            buf = self._buffers[name]
            if spec.kind == "tokens":
                views[name] = buf[:padded_tokens]
            elif spec.kind == "requests":
                views[name] = buf[:padded_reqs or 0]
            else:
                views[name] = buf
        return views

    def _forward(self, mode: CUDAGraphMode, desc: BatchDescriptor, padded_tokens: int,
                 padded_reqs: int | None, num_tokens: int, reqs: int | None,
                 extras: Mapping[str, Any], plan: MicroBatchPlan | None,
                 capturing: bool = False, error_mode: str = "global") -> Any:
        views = self._views(padded_tokens, padded_reqs)
        model = self._ubatch if self._ubatch is not None else self.model
        # Inference only: no autograd graph may hang on the static buffers or graph outputs.
        with torch.no_grad(), forward_context(
                desc, mode=mode, num_tokens_unpadded=num_tokens, num_reqs_unpadded=reqs,
                capturing=capturing, capture_error_mode=error_mode, micro_batches=plan,
                **extras):
            if self.call_positional:
                return model(*views.values())
            return model(**views)

    def _plan_micro_batches(self, num_scheduled_tokens: Sequence[int] | None, num_tokens: int,
                            reqs: int | None, padded_tokens: int, padded_reqs: int | None,
                            uniform: bool) -> MicroBatchPlan | None:
        """This step's micro-batch plan, or None: run unsplit."""
        if self._ubatch is None:
            return None
        return plan_for_step(
            self.config, num_tokens, reqs, padded_tokens, padded_reqs, uniform_decode=uniform,
            query_len=self.dispatcher.uniform_decode_query_len,
            num_scheduled_tokens=num_scheduled_tokens,
            dp_group=self.dp_group, sync=self.dp_sync)

    # -- outputs -------------------------------------------------------------------------
    def _slice(self, out: Any, kinds: Any, padded_tokens: int, num_tokens: int,
               padded_reqs: int | None, reqs: int | None, leaf: list[int]) -> Any:
        """The real rows of each output leaf of the kind ``outputs`` gives it. A leaf is
        cut when its dim 0 is the padded size, unless capture saw that its dim 0 does not
        follow the padded size (an output computed from a Static input or a weight whose
        dim 0 happens to equal this step's padded size)."""
        if isinstance(out, torch.Tensor):
            if not isinstance(kinds, str):
                raise ConfigError(f"outputs={self.outputs!r} does not match a single tensor "
                                  "output; use outputs='tokens', 'requests' or 'none'")
            index = leaf[0]
            leaf[0] += 1
            fixed = self._fixed_leaves.get(index)
            if fixed is not None and kinds in fixed:
                return out
            scale = self._scaled_leaves.get(index)
            if scale is not None and kinds == "tokens" and padded_tokens != num_tokens:
                raise ConfigError(
                    f"output {index} (a tensor of shape {tuple(out.shape)}) has a dim 0 of "
                    f"{scale} x the padded token count at every captured size (a flatten() "
                    "or view(-1) of per-token rows): the runner cannot tell its padding rows "
                    f"from the real ones. Return it with the tokens first ((tokens, {scale}, "
                    "...)) so they are cut, or mark it outputs='none' and cut it yourself")
            return _slice_rows(out, kinds, padded_tokens, num_tokens, padded_reqs, reqs)
        if isinstance(out, Mapping):
            return type(out)({  # type: ignore[call-arg]
                k: self._slice(v, kinds[k] if isinstance(kinds, Mapping) else kinds,
                               padded_tokens, num_tokens, padded_reqs, reqs, leaf)
                for k, v in out.items()})
        if isinstance(out, (tuple, list)):
            if isinstance(kinds, (tuple, list)):
                if len(kinds) != len(out):
                    raise ConfigError(f"outputs={self.outputs!r} has {len(kinds)} entries but "
                                      f"the model returned {len(out)} values")
                parts = [self._slice(v, k, padded_tokens, num_tokens, padded_reqs, reqs, leaf)
                         for v, k in zip(out, kinds, strict=True)]
            else:
                parts = [self._slice(v, kinds, padded_tokens, num_tokens, padded_reqs, reqs,
                                     leaf) for v in out]
            return type(out)(parts) if not hasattr(out, "_fields") else type(out)(*parts)
        return out

    # -- capture -------------------------------------------------------------------------
    def capture(self) -> CaptureReport:
        """Capture a graph for every dispatcher key: PIECEWISE first, then FULL, largest first.

        Before each capture the runner runs ``cudagraph_num_of_warmups`` eager passes (mode
        NONE) so lazy initialisation (autotuning, workspace allocation, cuBLAS handles) happens
        outside the graph. Every capture pass is a dummy step in which all rows hold the inputs'
        fill values; its outputs are meaningless. The whole capture runs under a frozen garbage
        collector (collected once first): a collection during capture would walk every live
        object per graph and could free tensors the graph still references. The model's capture
        window (``model.capture_window``) is open during capture and closed afterwards, so a
        later step reaching an uncaptured key raises instead of capturing mid-serving.

        With ``graph_memory_budget`` the order changes: the sizes the prediction is made from
        (size 1 and the two smallest above it, per family of keys: see
        :func:`~freezeframe.runtime.graph_memory.measurement_plan`) are captured first, smallest
        first, then the memory of every other key is predicted; over the budget, capture()
        raises :class:`~freezeframe.errors.GraphMemoryBudgetError` and keeps nothing, as a
        failed capture does (below); within it, the rest follow in the default order.

        Calling it again returns the first report; graphs are captured once. If a capture pass
        or warm-up raises, the exception propagates and the attempt leaves nothing behind: the
        graphs it captured are freed, the window is closed, the garbage collector unfrozen,
        and a later ``capture()`` starts from scratch (``stats.capture_failures`` counts it).
        """
        if not self._lock.acquire(blocking=False):
            self._wait_for_lock("capture()")
        self._lock_owner = self._last_holder = _get_ident()
        try:
            return self._capture_all()
        finally:
            self._lock_owner = None
            self._lock.release()

    def _capture_all(self) -> CaptureReport:
        if self.report is not None:
            logger.info("GraphRunner.capture: graphs already captured; returning the report")
            return self.report
        groups = self.dispatcher.capture_descriptors() if self.graphs_available else []
        device_name = str(self.device)
        if not groups:
            reason = ("cudagraph_mode is NONE" if self.config.cudagraph_mode is _NONE
                      else "no graph backend is available")
            logger.info("GraphRunner.capture: nothing to capture (%s)", reason)
            self.report = CaptureReport(device=device_name)
            return self.report
        if self._held is not None and torch._dynamo.config.disable:
            # the process runs without compiling (TORCH_COMPILE_DISABLE=1): so does this runner
            logger.warning("GraphRunner.capture: compiling is disabled for the process "
                           "(TORCH_COMPILE_DISABLE=1 or torch._dynamo.config.disable), so no "
                           "graph is captured and every step runs eagerly")
            self._compile_disabled = True
            self.report = CaptureReport(device=device_name)
            return self.report
        self._refuse_if_compiling_is_off()
        self._drop_foreign_graphs()
        if self.capture_policy is not CapturePolicy.EAGER:
            return self._defer(groups, device_name)
        window = self._held.capture_window if self._held is not None else None
        keys = [(mode, desc) for mode, descs in groups for desc in descs]
        records: list[GraphCapture] = []
        on_cuda = self.device.type == "cuda"
        budget = self.graph_memory_budget
        # With a budget the sizes measured for the prediction go first (see capture())
        probes = measurement_plan(keys) if budget is not None else []
        prediction: GraphMemoryPrediction | None = None
        # Copied aside before the clock and the memory baseline start: the report measures
        # graphs, not the copies.
        saved = _SavedBuffers(self.model)
        start = time.perf_counter()
        if on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        used_before = self._graph_memory_in_use()
        self.stats.inc("capture_runs")
        primed = (set(self._primed_sizes), set(self._primed_keys))
        stream = torch.cuda.current_stream(self.device) if on_cuda else None
        self._leaf_sizes.clear()
        try:
            if window is not None:
                window.open()
            with _gc_frozen(), capture_progress(len(keys), self.progress) as bar:
                for mode, desc in probes:
                    records.append(self._capture_one(mode, desc))
                    bar.update(1)
                if budget is not None:
                    prediction = self._predict(keys, records, used_before)
                    if prediction.total_bytes > budget:
                        raise GraphMemoryBudgetError(
                            self._over_budget(budget, prediction, len(records)))
                measured = set(probes)
                for mode, desc in keys:
                    if (mode, desc) not in measured:
                        records.append(self._capture_one(mode, desc))
                        bar.update(1)
            if on_cuda:
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
            used_after = self._graph_memory_in_use()
        except BaseException:
            self._forget_failed_capture(primed, stream)
            self._capture_failed = True
            raise
        finally:
            if window is not None:
                window.close()
            self._undo_dummy_steps(saved)
        self._classify_leaves()
        if prediction is None and self._graphs_account_memory():
            # emulated graphs do not depend on the capture order: the prediction the same
            # measured sizes would have made, for the report's predicted-vs-actual columns
            prediction = self._predict(keys, records, None)
        if prediction is not None:
            probed = set(probes) if probes else set(measurement_plan(keys))
            records = [dataclasses.replace(
                r, predicted_bytes=prediction.for_key(r.mode, r.descriptor).predicted_bytes,
                probe=(r.mode, r.descriptor) in probed) for r in records]
        self._capture_failed = False
        report = CaptureReport(graphs=tuple(records), seconds=seconds,
                               memory_bytes=max(0, used_after - used_before),
                               device=device_name, prediction=prediction, budget_bytes=budget)
        self.report = report
        logger.info("GraphRunner: %s", report.summary())
        return report

    def _eagerly(self, values: Mapping[str, torch.Tensor], num_tokens: int,
                 extras: Mapping[str, Any]) -> Any:
        """The uncompiled module on copies of the step's inputs, outside any graph (verify)."""
        assert self._held is not None and self._verifier is not None
        copies = {name: t.clone() if isinstance(t, torch.Tensor) else t
                  for name, t in values.items()}
        with self._verifier.forward_context(num_tokens, extras):
            if self.call_positional:
                return self._held.module(*copies.values())
            return self._held.module(**copies)

    def _model_hooked(self) -> bool:
        """Whether calling the model runs hooks of its own (forward or forward-pre hooks on the
        model, or torch's global module hooks): a planned step or a direct replay skips
        ``nn.Module.__call__``, so such steps go through it."""
        model = self.model
        return bool((isinstance(model, torch.nn.Module)
                     and (model._forward_hooks or model._forward_pre_hooks))
                    or _global_forward_hooks or _global_forward_pre_hooks)

    def _capture_again(self) -> None:
        """The model dropped every graph (its parameters or buffers were replaced after the
        capture, so the graphs read old memory): forget what was planned on them and capture
        the keys again as the capture policy does (eager: all of them now; lazy and
        background: each pending again). Counted in ``stats.recaptures``; the model logs the
        change once."""
        assert self._held is not None
        self._generation = self._held.graph_generation
        for key in list(self._plans):
            self._forget_plan(key)
        self._replays.clear()
        if self._ubatch is not None:
            self._ubatch.clear()
        self.stats.inc("recaptures")
        if self.report is None:
            return  # before capture(): steps capture (after a warm-up) as before
        deferred = self._deferred
        if deferred is not None:
            deferred.restart()
            if self.capture_policy is CapturePolicy.BACKGROUND and (
                    self._background is None or not self._background.is_alive()):
                self._background = threading.Thread(
                    target=self._capture_behind, name="freezeframe-background-capture",
                    daemon=True)
                self._background.start()
            return
        self._graph_writes.clear()
        self.report = None
        self._capture_all()

    def _refuse_if_compiling_is_off(self) -> None:
        off = self._held.compile_off_reason if self._held is not None else None
        if off is not None:
            raise CaptureError(
                f"GraphRunner.capture: {off}, so the model runs eagerly and would capture no "
                "graph. Call capture() where compiling is on (outside torch.compiler."
                "set_stance('force_eager'), without TORCH_COMPILE_DISABLE=1); steps may still "
                "run eagerly meanwhile")

    def _forget_failed_capture(self, primed: tuple[set[int], set[GraphKey]],
                               stream: Any) -> None:
        """Undo a capture attempt that raised, so that a retry starts as the first attempt
        did: the graphs it stored (some may hold a half-recorded capture) are freed, the sizes
        it primed count as unprimed (a failed first call may have left the model untraced),
        and the caller's CUDA stream is current again."""
        self.stats.inc("capture_failures")
        self._primed_sizes, self._primed_keys = primed
        self._graph_writes.clear()
        if self._held is not None:
            for wrapper in self._held.graph_wrappers():
                wrapper.clear()
        if self._ubatch is not None:
            self._ubatch.clear()
        if stream is not None:
            torch.cuda.set_stream(stream)
        logger.warning("GraphRunner.capture failed; its graphs were freed, and capture() may "
                       "be called again")

    def _drop_foreign_graphs(self) -> None:
        """Free graphs the model captured before this runner existed.

        Such graphs (from low-level ``ff.forward_context`` calls) read the caller's tensors, not
        this runner's static buffers: each replay would copy the step's inputs into them. Steps
        this runner made before ``capture()`` captured on its own buffers; those are kept.
        """
        foreign = [w for w in self._foreign if w.captured_descriptors]
        self._foreign = []
        if foreign:
            logger.warning("GraphRunner.capture: the model already held graphs captured outside "
                           "this runner (%d wrappers); they read other tensors, so they are "
                           "freed and captured again on the runner's buffers", len(foreign))
            for wrapper in foreign:
                wrapper.clear()
            self.stats.inc("foreign_graphs_dropped", len(foreign))

    def _records_only(self) -> bool:
        """Whether the graph backend only records kernels when it captures (``cuda``), so code
        that first runs inside a capture would do its lazy set-up there (a Triton kernel's
        compile and autotuning, cuBLAS handles and workspaces, Inductor's first launch): work
        a capture cannot hold. ``emulated`` captures by running, as eager code does."""
        backend = self._held.graph_backend if self._held is not None else None
        if backend is not None:
            return not backend.capture_computes
        return self.device.type == "cuda"

    def _num_warmups(self, mode: CUDAGraphMode, desc: BatchDescriptor) -> int:
        """The configured warm-ups, but at least one eager pass before the very first capture
        and before the first capture of each concrete compile size: tracing and compiling must
        happen outside any capture (a capture records kernels; Dynamo cannot trace under the
        emulated recorder, and compiling inside a CUDA capture is not allowed). Where the
        backend only records (``cuda``), at least one before the first capture of every graph
        key as well: each key may reach code no earlier pass ran (another compile range, an
        attention kernel's specialisation for this many requests, a micro-batch slice at a
        new offset)."""
        n = self.config.cudagraph_num_of_warmups
        num_tokens = desc.num_tokens
        first_sight = num_tokens not in self._primed_sizes
        self._primed_sizes.add(num_tokens)
        new_key = (mode, desc) not in self._primed_keys
        self._primed_keys.add((mode, desc))
        if new_key and self._records_only():
            return max(n, 1)
        if first_sight and (len(self._primed_sizes) == 1
                            or num_tokens in (self.config.compile_sizes or ())):
            return max(n, 1)
        if self._held is not None and not self._held.traced:  # its first call has not succeeded
            return max(n, 1)
        return n

    def _dummy_step(self, desc: BatchDescriptor) -> tuple[int, int]:
        """Fill the buffers for a dummy step of ``desc``: every row (real or padded) holds the
        fill value. Its token and request counts."""
        tokens = desc.num_tokens
        reqs = desc.num_reqs if desc.num_reqs is not None else min(tokens,
                                                                    self.config.max_num_seqs)
        self._staged = None
        with torch.no_grad():
            for name, spec in self.specs.items():
                if spec.kind != "static":
                    rows = tokens if spec.kind == "tokens" else reqs
                    self._buffers[name][:rows].fill_(spec.fill)
        return tokens, reqs

    def _capture_one(self, mode: CUDAGraphMode, desc: BatchDescriptor,
                     error_mode: str = "global") -> GraphCapture:
        tokens, reqs = self._dummy_step(desc)
        # FULL graphs of split sizes are captured split (warm-ups split too)
        plan = self._plan_micro_batches(None, tokens, reqs, tokens, reqs, desc.uniform) \
            if mode is _FULL else None
        on_cuda = self.device.type == "cuda"
        used_before = self._graph_memory_in_use()
        t0 = time.perf_counter()
        for _ in range(self._num_warmups(mode, desc)):
            self._forward(_NONE, desc, tokens, reqs, tokens, reqs, {}, plan, capturing=True)
            self.stats.inc("warmups")
        if on_cuda:
            torch.cuda.synchronize(self.device)
        versions = [buf._version for buf in self._buffer_list]
        out = self._forward(mode, desc, tokens, reqs, tokens, reqs, {}, plan, capturing=True,
                            error_mode=error_mode)
        self._record_leaf_sizes(out, tokens, reqs)
        if on_cuda:
            torch.cuda.synchronize(self.device)
        self._graph_writes[(mode, desc)] = frozenset(
            name for (name, _kind, buf), before in zip(self._slots, versions, strict=True)
            if buf._version != before)
        self.stats.inc("captures")
        seconds = time.perf_counter() - t0
        return GraphCapture(mode=mode, descriptor=desc, seconds=seconds,
                            memory_bytes=max(0, self._graph_memory_in_use() - used_before))

    # -- graph memory (graph_memory.py) --------------------------------------------------
    def _graphs_account_memory(self) -> bool:
        """Whether the model's graphs count their own memory (``emulated``: each graph holds
        its own tensors) rather than living in a CUDA pool only free memory shows."""
        backend = self._held.graph_backend if self._held is not None else None
        return backend is not None and backend.name != "cuda"

    def _graph_memory_in_use(self) -> int:
        """A reading whose growth over a capture is the graph memory it added.

        Emulated graphs: the bytes the model's graphs hold, summed over its wrappers (and the
        micro-batch wrapper's split graphs). They differ from CUDA's because each emulated graph
        keeps its own tensors, so graphs add up. CUDA graphs: minus the device's free memory.
        All of a model's CUDA graphs share one pool, captured largest first, so a smaller
        graph reuses the blocks the largest one left and only free memory tells what the pool
        grew by; a CUDA graph has no count of its own."""
        if self._graphs_account_memory():
            assert self._held is not None
            held = sum(w.memory_bytes() for w in self._held.graph_wrappers())
            return held + (self._ubatch.memory_bytes() if self._ubatch is not None else 0)
        backend = self._held.graph_backend if self._held is not None else None
        if backend is not None and self.device.type == "cuda":
            # the pool's own segments: free memory also moves with cuBLAS workspaces and
            # warm-up caches, which made small graphs look as large as big ones
            index = self.device.index
            pooled = backend.pool_bytes(index if index is not None
                                        else torch.cuda.current_device())
            if pooled is not None:
                return pooled
        return -_free_memory(self.device)

    def _predict(self, keys: list[tuple[CUDAGraphMode, BatchDescriptor]],
                 records: Sequence[GraphCapture],
                 used_before: int | None) -> GraphMemoryPrediction:
        """Predict every key's graph memory from the measured probes (measurement_plan).

        Emulated: each probe's own bytes. CUDA (``used_before`` given): the pool's growth
        since the capture began, at the end of each probe's capture. The probes are captured
        smallest first, so the later probe of a family reuses the earlier's blocks and its own
        delta understates it; the growth so far is its footprint when it is the largest graph
        yet, and an overestimate otherwise, the safe side for a budget."""
        wanted = set(measurement_plan(keys))
        measured: dict[tuple[CUDAGraphMode, BatchDescriptor], int] = {}
        pooled = not self._graphs_account_memory()
        grown = 0
        for record in records:
            grown += record.memory_bytes
            key = (record.mode, record.descriptor)
            if key in wanted:
                measured[key] = grown if pooled and used_before is not None \
                    else record.memory_bytes
        return predict_graph_memory(keys, measured, pooled=pooled)

    def _over_budget(self, budget: int, prediction: GraphMemoryPrediction,
                     measured: int) -> str:
        largest = "; ".join(p.describe() for p in prediction.largest(3))
        sizes = sorted({p.descriptor.num_tokens for p in prediction.sizes})
        return (
            f"graph_memory_budget={budget} bytes ({format_bytes(budget)}): capturing the "
            f"{len(prediction.sizes)} graphs of capture sizes {sizes} is predicted to need "
            f"{prediction.total_bytes} bytes ({format_bytes(prediction.total_bytes)}, "
            f"{'one shared pool' if prediction.pooled else 'summed over graphs'}), from the "
            f"{measured} smallest graphs, captured and measured first. Largest: {largest}. "
            "Nothing was kept (the measured graphs were freed). Fix: capture fewer or smaller "
            "sizes (cudagraph_capture_sizes, max_cudagraph_capture_size), choose sizes under the "
            "budget with `freezeframe plan`, or raise graph_memory_budget")

    def _undo_dummy_steps(self, saved: _SavedBuffers) -> None:
        """After warm-ups and captures: refill the input buffers (the dummy steps wrote their
        rows, and the model may have too) and restore the model's buffers they wrote into (a
        running count, a cache): eagerly, those steps never happened."""
        self._reset_padding()
        restored = saved.restore()
        if restored:
            self.stats.inc("buffers_restored", restored)

    def _classify_leaves(self) -> None:
        """Which output leaves follow the padded size, from every dummy step seen so far."""
        self._fixed_leaves = _fixed_leaves(self._leaf_sizes)
        self._scaled_leaves = _scaled_leaves(self._leaf_sizes)

    def _record_leaf_sizes(self, out: Any, tokens: int, reqs: int) -> None:
        for i, leaf in enumerate(_tensor_leaves(out)):
            self._leaf_sizes.setdefault(i, set()).add(
                (tokens, reqs, int(leaf.shape[0]) if leaf.dim() else None))

    # -- lazy and background capture (capture_policy.py) ---------------------------------
    def _defer(self, groups: list[tuple[CUDAGraphMode, list[BatchDescriptor]]],
               device_name: str) -> CaptureReport:
        """capture() of the lazy and background policies: learn how the outputs follow the
        padded size from two eager dummy steps, then leave the graphs to the steps (lazy) or
        to a thread (background)."""
        order = [(mode, desc) for mode, descs in groups for desc in descs]
        sizes = sorted({desc.num_tokens for _, desc in order})[:2]
        probes = [next(d for _, d in order if d.num_tokens == n) for n in sizes]
        saved = _SavedBuffers(self.model)
        self._leaf_sizes.clear()
        try:
            for desc in probes:
                tokens, reqs = self._dummy_step(desc)
                out = self._forward(_NONE, desc, tokens, reqs, tokens, reqs, {}, None,
                                    capturing=True)
                self._record_leaf_sizes(out, tokens, reqs)
                self.stats.inc("warmups")
        finally:
            self._undo_dummy_steps(saved)
        self._classify_leaves()
        self._deferred = DeferredCaptures(order, self.lazy_warmups)
        self.report = CaptureReport(device=device_name)
        if self.capture_policy is CapturePolicy.BACKGROUND:
            self._background = threading.Thread(
                target=self._capture_behind, name="freezeframe-background-capture",
                daemon=True)
            self._background.start()
        logger.info("GraphRunner: %d graphs left to capture (%s)", len(order),
                    self.capture_policy.value)
        return self.report

    def _capture_deferred(self, key: GraphKey, error_mode: str = "global") -> None:
        """Capture one graph key, holding the runner's lock (a step's or the background
        thread's), as capture() captures each of its keys."""
        assert self._deferred is not None and self.report is not None
        mode, desc = key
        window = self._held.capture_window if self._held is not None else None
        saved = _SavedBuffers(self.model)
        primed = (set(self._primed_sizes), set(self._primed_keys))
        on_cuda = self.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device) if on_cuda else None
        try:
            with contextlib.ExitStack() as stack:
                if window is not None:
                    stack.enter_context(window.opened())
                stack.enter_context(_gc_paused())
                record = self._capture_one(mode, desc, error_mode)
        except BaseException:
            self._forget_failed_capture(primed, stream)
            self._deferred.failed_on(key)
            raise
        finally:
            self._undo_dummy_steps(saved)
        self._deferred.captured(key)
        self._classify_leaves()
        report = self.report
        self.report = dataclasses.replace(
            report, graphs=(*report.graphs, record), seconds=report.seconds + record.seconds,
            memory_bytes=report.memory_bytes + record.memory_bytes)

    def _capture_behind(self) -> None:
        """The background thread: capture every pending key in order, one per lock hold."""
        deferred = self._deferred
        assert deferred is not None
        ident = _get_ident()
        while True:
            self._lock.acquire()
            self._lock_owner = self._last_holder = ident
            try:
                key = deferred.next()
                if key is None:
                    return
                self._capture_deferred(key, error_mode="thread_local")
            except BaseException as exc:
                self._background_error = exc
                logger.warning("GraphRunner: background capture stopped: %s: %s "
                               "(wait_for_capture() raises it)", type(exc).__name__, exc)
                return
            finally:
                self._lock_owner = None
                self._lock.release()
            time.sleep(0)  # let a waiting step have the lock before the next capture

    def wait_for_capture(self, timeout: float | None = None) -> CaptureReport:
        """Wait until the background capture is done (or ``timeout`` seconds passed) and
        return the report of what it captured; raise what the capture raised. With the other
        policies, the report as it stands (capture() must have been called)."""
        if self.report is None:
            raise FreezeframeError("wait_for_capture() before capture(); call "
                                   "runner.capture() first")
        if self._background is not None:
            self._background.join(timeout)
            if self._background.is_alive():
                raise TimeoutError(f"background capture still running after {timeout} s "
                                   f"({self.pending_captures} graphs left)")
        if self._background_error is not None:
            raise self._background_error
        return self.report

    @property
    def pending_captures(self) -> int:
        """Graph keys the lazy or background policy has not captured yet."""
        return self._deferred.num_pending if self._deferred is not None else 0

    def __repr__(self) -> str:
        mode = self.dispatcher.cudagraph_mode.name
        return (f"GraphRunner(inputs={list(self.specs)}, mode={mode}, device={self.device}, "
                f"captured={self.captured})")


# -- helpers ---------------------------------------------------------------------------------
_GRAPH_MODES = frozenset({_PIECEWISE, _FULL})
_STEP_COUNTER = {_NONE: "steps_eager", _PIECEWISE: "steps_piecewise", _FULL: "steps_full"}
_STALE = object()  # _replay's answer when the plan's graph is gone


def _rows(buf: torch.Tensor) -> int:
    return int(buf.shape[0]) if buf.dim() else 0


def _allocate_buffers(specs: Mapping[str, InputSpec], config: CompilationConfig,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """One buffer per input, allocated once; every step writes into these same tensors.

    Always normal tensors (not inference tensors, even when the runner is built under
    inference_mode): the runner writes into them outside inference mode, and their version
    counters tell which inputs the model wrote into."""
    with torch.inference_mode(False):
        return {name: torch.full(spec.buffer_shape(config.max_num_tokens, config.max_num_seqs),
                                 spec.fill, dtype=spec.dtype, device=device)
                for name, spec in specs.items()}


def _runner_config(config: CompilationConfig | None, held: Capturable | None,
                   strict: bool) -> CompilationConfig:
    """The runner's config: the one given, else the model's; it must agree with the model's
    on what sizes the keys (graph mode and capture sizes)."""
    model_config = held.config if held is not None else None
    if config is None:
        config = model_config
    if not isinstance(config, CompilationConfig):
        raise ConfigError(
            f"GraphRunner needs a CompilationConfig, got {config!r}; pass "
            "GraphRunner(model, ff.CompilationConfig(...), inputs=...)")
    if isinstance(model_config, CompilationConfig) and (
            model_config.cudagraph_mode is not config.cudagraph_mode
            or model_config.cudagraph_capture_sizes != config.cudagraph_capture_sizes):
        raise ConfigError(
            "GraphRunner config disagrees with the model's: cudagraph_mode "
            f"{config.cudagraph_mode!s} vs {model_config.cudagraph_mode!s}, capture "
            f"sizes {config.cudagraph_capture_sizes} vs "
            f"{model_config.cudagraph_capture_sizes}; pass the config the model was "
            "compiled with (or leave config out to use model.config)")
    if strict and config.cudagraph_mode is _NONE:
        raise ConfigError(
            "strict=True with cudagraph_mode NONE: every step would be a fallback; turn "
            "graphs on or leave strict off")
    return config


def _input_specs(inputs: Any) -> dict[str, InputSpec]:
    """``inputs`` checked (identifiers, not step options, at least one ``Tokens``) and named."""
    if not isinstance(inputs, Mapping) or not inputs:
        raise ConfigError("inputs: give a mapping of input name -> ff.runtime.Tokens(...) / "
                          "Requests(...) / Static(...), with at least one Tokens input")
    specs: dict[str, InputSpec] = {}
    for name, spec in inputs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"inputs: name {name!r} is not a Python identifier")
        if name in _STEP_OPTIONS:
            raise ConfigError(f"inputs: name {name!r} is reserved for a step option "
                              f"({sorted(_STEP_OPTIONS)}); rename the input")
        if not isinstance(spec, InputSpec):
            raise ConfigError(f"inputs[{name!r}]: expected ff.runtime.Tokens(...), "
                              f"Requests(...) or Static(...), got {spec!r}")
        specs[name] = spec.named(name)
    if not any(s.kind == "tokens" for s in specs.values()):
        raise ConfigError("inputs: at least one input must be Tokens(...): the runner reads "
                          "the step size from the token dimension")
    return specs


def _slice_rows(t: torch.Tensor, kind: str, padded_tokens: int, num_tokens: int,
                padded_reqs: int | None, reqs: int | None) -> torch.Tensor:
    """``t`` cut to the real rows, always as a new tensor object (a view): an in-place
    change of its metadata (``y.t_()``, ``y.unsqueeze_(0)``) must not reach the static output
    the next step answers with."""
    if kind == "none" or t.dim() == 0:
        return t.detach()
    if kind == "tokens":
        return t[:num_tokens] if t.shape[0] == padded_tokens else t.detach()
    if kind == "requests":
        if reqs is None or padded_reqs is None:
            return t.detach()
        return t[:reqs] if t.shape[0] == padded_reqs else t.detach()
    raise ConfigError(f"outputs: unknown kind {kind!r}; use 'tokens', 'requests' or 'none'")


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``t`` can touch, ``[start, stop)``, or None for an empty tensor."""
    start = t.data_ptr()
    if not start or not t.numel():
        return None
    last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have an element in common: their byte ranges overlap and,
    unless both are plain ranges, their element offsets in the storage meet (computed on
    the CPU from the strides; conservatively True when the element sizes differ)."""
    span_a, span_b = _byte_span(a), _byte_span(b)
    if span_a is None or span_b is None or span_a[1] <= span_b[0] or span_b[1] <= span_a[0]:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or \
            a.element_size() != b.element_size() or (a.is_contiguous() and b.is_contiguous()):
        return True
    size = a.untyped_storage().nbytes() // a.element_size()
    index = torch.arange(size, dtype=torch.int64)

    def offsets(t: torch.Tensor) -> torch.Tensor:
        return index.as_strided(t.shape, t.stride(), t.storage_offset()).flatten()

    return bool(torch.isin(offsets(a), offsets(b)).any())


def _tensor_leaves(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of an output, in the order ``GraphRunner._slice`` visits them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensor_leaves(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensor_leaves(v)


def _fixed_leaves(seen: Mapping[int, set[tuple[int, int | None, int | None]]]
                  ) -> dict[int, frozenset[str]]:
    """For each output leaf whose dim 0 stayed the same across two or more padded sizes
    (a table derived from a weight or a Static input): the kinds ('tokens', 'requests') it is
    therefore not cut as, even at the size its dim 0 happens to equal. A leaf whose dim 0
    changes with the size (``y[:4]``: 1, 2, 4, 4) follows the step and is cut wherever its
    dim 0 is the padded size."""
    out: dict[int, frozenset[str]] = {}
    for index, sizes in seen.items():
        dims = {d for _, _, d in sizes}
        if len(dims) != 1:
            continue
        fixed = set()
        if len({t for t, _, _ in sizes}) > 1:
            fixed.add("tokens")
        if len({r for _, r, _ in sizes if r is not None}) > 1:
            fixed.add("requests")
        if fixed:
            out[index] = frozenset(fixed)
    return out


def _scaled_leaves(seen: Mapping[int, set[tuple[int, int | None, int | None]]]
                   ) -> dict[int, int]:
    """Output leaves whose dim 0 was the same multiple (2 or more) of the padded token count
    at two or more sizes: ``{leaf: multiple}``."""
    out: dict[int, int] = {}
    for index, sizes in seen.items():
        ratios = {d // t if d is not None and t and d % t == 0 else None for t, _, d in sizes}
        if len({t for t, _, _ in sizes}) > 1 and len(ratios) == 1:
            ratio = ratios.pop()
            if ratio is not None and ratio > 1:
                out[index] = ratio
    return out


class _SavedBuffers:
    """The model's buffers as they were before ``capture()``, to undo what its dummy steps
    write into them (a running count, a KV cache). A copy on the device up to
    ``DEVICE_LIMIT`` bytes in all, on the host beyond that; restored in place (graphs keep the
    addresses), and only where the version counter moved."""

    DEVICE_LIMIT = 256 << 20

    def __init__(self, model: Any) -> None:
        named = model.named_buffers() if isinstance(model, torch.nn.Module) else ()
        buffers = [b for _, b in named]
        on_device = sum(b.numel() * b.element_size() for b in buffers) <= self.DEVICE_LIMIT
        self.saved: list[tuple[torch.Tensor, int | None, torch.Tensor]] = []
        with torch.no_grad():
            for buf in buffers:
                copy = buf.detach().clone() if on_device else buf.detach().to("cpu", copy=True)
                self.saved.append((buf, _version_of(buf), copy))

    def restore(self) -> int:
        restored = 0
        for buf, version, copy in self.saved:
            if version is not None and _version_of(buf) == version:
                continue
            with torch.inference_mode(buf.is_inference()), torch.no_grad():
                buf.copy_(copy)
            restored += 1
        self.saved.clear()
        return restored


def _version_of(t: torch.Tensor) -> int | None:
    """The version counter, or None for an inference tensor (it has none)."""
    return None if t.is_inference() else t._version


def _graph_key_of(plan: StepPlan) -> GraphKey:
    """The graph key a planned step replays (FULL without a context, else PIECEWISE)."""
    return (_FULL if plan.context is None else _PIECEWISE, plan.replay_key[0])


def _alias(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # a new tensor object on the same memory


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return type(obj)({k: _map_tensors(v, fn) for k, v in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, (tuple, list)):
        parts = [_map_tensors(v, fn) for v in obj]
        return type(obj)(*parts) if hasattr(obj, "_fields") else type(obj)(parts)
    return obj


def _resolve_device(device: torch.device | str | None, model: Any) -> torch.device:
    if device is None:
        params = getattr(model, "parameters", None)
        first = next(iter(params()), None) if callable(params) else None
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_budget(budget: Any, policy: CapturePolicy) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ConfigError(f"graph_memory_budget: expected a number of bytes (an int >= 0) or "
                          f"None, got {budget!r}")
    if policy is not CapturePolicy.EAGER:
        raise ConfigError(
            f"graph_memory_budget={budget} with capture_policy={policy.value!r}: the budget is "
            "checked by capture() before it captures every size, and the lazy and background "
            "policies capture sizes one at a time later, when their steps come; use "
            "capture_policy='eager' with a budget, or leave graph_memory_budget=None (choose "
            "sizes under a budget with `freezeframe plan` instead)")
    return budget


def _free_memory(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Collect once, then freeze every surviving object out of the collector's reach for the
    duration, so the many short-lived objects of capture never trigger a full collection.

    ``gc.unfreeze()`` cannot tell our frozen objects from the caller's, so when the caller has
    frozen some already (a server calling ``gc.freeze()`` after start-up) the collector is
    paused instead, and left as it was found."""
    gc.collect()
    if gc.get_freeze_count() == 0:
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
        return
    with _gc_paused():
        yield


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The collector paused for one capture during serving (no collection first: a lazy or
    background capture must not stall the steps with a full collection)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
