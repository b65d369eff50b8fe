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

import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.errors import ConfigError
from freezeframe.graphs.backend import graphs_possible
from freezeframe.graphs.capturable import Capturable
from freezeframe.runtime.buffers import StaticBuffers
from freezeframe.runtime.capture import CaptureOptions, Capturer
from freezeframe.runtime.capture_policy import CapturePolicy
from freezeframe.runtime.dispatcher import Dispatcher
from freezeframe.runtime.forward import ModelForward
from freezeframe.runtime.inputs import InputChecker, InputSpec, input_specs
from freezeframe.runtime.lock import StepLock
from freezeframe.runtime.lockstep import Lockstep
from freezeframe.runtime.options import RunnerOptions, resolve_device, runner_config
from freezeframe.runtime.outputs import OutputCut
from freezeframe.runtime.plan import StepOptions
from freezeframe.runtime.report import CaptureReport, GraphCapture
from freezeframe.runtime.route import StepRouter
from freezeframe.runtime.steps import StepParts, Stepper
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from freezeframe.runtime.verify import Verifier
from freezeframe.stats import Stats

__all__ = ["CaptureReport", "GraphCapture", "GraphRunner"]

logger = logging.getLogger(__name__)


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
        verify: check the first ``verify`` graph steps of each key against the module run
            eagerly (:mod:`freezeframe.runtime.verify`); ``verify_tolerance`` overrides the
            per-dtype tolerance of that check.
        lockstep: capture in lockstep with the other ranks of a process group (``True``: the
            world; or a :class:`~freezeframe.runtime.lockstep.Lockstep` naming the group and
            the timeout): the ranks agree on the graphs first, capture each between two
            barriers, and a failure on one rank is an error on every rank within the timeout
            (:mod:`freezeframe.runtime.lockstep`). Needed when the model holds collectives
            (tensor parallelism); only with ``capture_policy="eager"``.

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
        lockstep: Lockstep | bool = False,
    ) -> None:
        options = RunnerOptions(
            outputs=outputs, copy_outputs=copy_outputs, strict=strict, dp_sync=dp_sync,
            dp_group=dp_group, invalid_modes=invalid_modes, call_positional=call_positional,
            progress=progress, capture_policy=capture_policy, lazy_warmups=lazy_warmups,
            graph_memory_budget=graph_memory_budget, verify=verify,
            verify_tolerance=verify_tolerance, lockstep=lockstep)
        self.options = options
        # A model holding its own graphs (ff.compile's); None for a plain callable.
        held = model if isinstance(model, Capturable) else None
        config = runner_config(config, held, strict)
        self.config = config
        self.dispatcher = Dispatcher(config)
        self.stats = Stats()
        self.device = resolve_device(device, model)
        self.graphs_available = graphs_possible(config)
        self.specs: Mapping[str, InputSpec] = input_specs(inputs)
        static = StaticBuffers(self.specs, config, self.device, self.stats)
        self._static = static
        self._lock = StepLock(self.stats)
        forward = ModelForward(model, static, config, call_positional=call_positional,
                               ubatch=self._micro_batching(model, config),
                               query_len=self.dispatcher.uniform_decode_query_len,
                               dp_sync=dp_sync, dp_group=dp_group)
        cut = OutputCut(outputs)
        self._capturer = Capturer(
            model, held, config, self.dispatcher, self.device, self.stats, forward, cut,
            self._lock, CaptureOptions(options.policy, lazy_warmups, graph_memory_budget,
                                       progress, options.lockstep_config),
            self.graphs_available)
        self._stepper = self._new_stepper(held, static, cut, forward)
        self._micro = forward.ubatch
        self._forward = forward

    def _new_stepper(self, held: Capturable | None, static: StaticBuffers, cut: OutputCut,
                     forward: ModelForward) -> Stepper:
        """The step path (steps.py) over the runner's parts, with its input checks, its
        router and, with ``verify``, its verifier."""
        options, config = self.options, self.config
        checker = InputChecker(self.specs, self.device, max_num_tokens=config.max_num_tokens,
                               max_num_seqs=config.max_num_seqs,
                               query_len=self.dispatcher.uniform_decode_query_len)
        verifier = Verifier(options.verify, options.verify_tolerance, self.stats) \
            if options.verify else None
        step_options = StepOptions(strict=options.strict, copy_outputs=options.copy_outputs,
                                   dp_sync=options.dp_sync, dp_group=options.dp_group,
                                   invalid_modes=frozenset(options.invalid_modes),
                                   policy_name=options.policy.value)
        router = StepRouter(config, self.dispatcher, self._capturer, self.stats, step_options,
                            self.graphs_available)
        return Stepper(StepParts(held, static, checker, router, forward, self._capturer, cut,
                                 self.stats, verifier, self.graphs_available), step_options)

    def _micro_batching(self, model: Any, config: CompilationConfig
                        ) -> MicroBatchWrapper | None:
        """The micro-batch wrapper around the model (it stands in for the model's FULL
        graph), when ``config.micro_batching`` is on."""
        if not config.micro_batching:
            return None
        per_request = [name for name, s in self.specs.items() if s.kind == "requests"]
        if per_request:
            raise ConfigError(
                f"GraphRunner: micro_batching=True with the Requests input "
                f"{per_request[0]!r}: a micro-batch would get only its own requests' rows of "
                "it, and freezeframe cannot tell how forward finds a token's request (a Tokens "
                "input of request numbers counts from the step's first request, not the "
                "micro-batch's), so the answer could be another request's row. Pass "
                f"{per_request[0]!r} as a Static input (every micro-batch reads it whole), or "
                "set micro_batching=False")
        kinds: dict[str | int, str] = {name: s.kind for name, s in self.specs.items()}
        kinds.update({i: s.kind for i, s in enumerate(self.specs.values())})
        return MicroBatchWrapper.for_runner(model, config, input_kinds=kinds,
                                           stats=self.stats)

    # -- public views -----------------------------------------------------------------------
    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        """The full static buffers (``max_num_tokens`` / ``max_num_seqs`` rows), read-only view
        of the mapping; writing into them bypasses the runner's padding."""
        return MappingProxyType(self._static.buffers)

    @property
    def report(self) -> CaptureReport | None:
        """What :meth:`capture` did (None before it was called)."""
        return self._capturer.report

    @property
    def captured(self) -> bool:
        return self.report is not None

    @property
    def micro_batches(self) -> MicroBatchWrapper | None:
        """The micro-batch wrapper steps run through (``config.micro_batching``), or None."""
        return self._micro

    @property
    def planned_shapes(self) -> int:
        """How many step shapes have a plan (later steps of them run from it)."""
        return len(self._stepper.plans)

    @property
    def size_histogram(self) -> dict[int, int]:
        """How many steps had each real token count (before padding), smallest first: the
        traffic ``ff.plan_capture_sizes`` / ``freezeframe plan`` choose capture sizes for
        (``json.dump`` it as ``{str(n): count}``)."""
        return dict(sorted(self._stepper.sizes.items()))

    @property
    def model(self) -> Callable[..., Any]:
        """What the steps call (set it to call another callable on the same buffers)."""
        return self._forward.model

    @model.setter
    def model(self, model: Callable[..., Any]) -> None:
        self._forward.model = model
        self._capturer.model = model

    @property
    def graph_memory_budget(self) -> int | None:
        return self.options.graph_memory_budget

    @graph_memory_budget.setter
    def graph_memory_budget(self, budget: int | None) -> None:
        """A new budget for the next :meth:`capture` (after one refused over the old)."""
        self.options = dataclasses.replace(self.options, graph_memory_budget=budget)
        self._capturer.set_budget(budget)

    @property
    def capture_policy(self) -> CapturePolicy:
        return self.options.policy

    # -- one step ---------------------------------------------------------------------------
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
        ``get_forward_context().extras[...]``); they are the caller's alone: the runner sets
        the context's own ``num_tokens_unpadded`` and ``num_reqs_unpadded`` fields.
        ``num_scheduled_tokens``: the tokens of each request, in order, when micro-batching is
        on (where a step is cut between requests); without it a step that is not a uniform
        decode is cut as one request.

        Steps (and :meth:`capture`) hold the runner's lock, so concurrent calls run one after
        the other; see the class docstring for what that means for the returned tensors.
        """
        if self._lock.enter("a step"):
            self._overlapped()
        # Inference only: no autograd graph may hang on the static buffers or graph outputs.
        # One switch for the whole step (torch.no_grad() as a context costs more than the
        # rest of a planned step's Python).
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._stepper.step(args, kwargs, uniform_decode, has_lora, num_active_loras,
                                      num_reqs, invalid_modes, extras, num_scheduled_tokens)
        finally:
            torch._C._set_grad_enabled(grad)
            self._lock.exit()

    def _overlapped(self) -> None:
        """This step waited for another thread's: threads share the runner, so outputs are
        copies from now on (the next thread's step would overwrite a view)."""
        if self._stepper.copy_outputs:  # (copies already: said so, or seen before)
            return
        self._stepper.copy_outputs = True
        if not self.options.copy_outputs:
            logger.warning(
                "GraphRunner: steps from several threads overlapped; they run one at a "
                "time, and from now on every step returns copies of its outputs (a view of "
                "the static outputs would be overwritten by the next thread's step). "
                "Construct the runner with copy_outputs=True when threads share it: the "
                "outputs of the steps before the first overlap were views")

    # -- capture ----------------------------------------------------------------------------
    def capture(self) -> CaptureReport:
        """Capture a graph for every dispatcher key: PIECEWISE first, then FULL, largest first.

        Before each capture the runner runs ``cudagraph_num_of_warmups`` eager passes (mode
        NONE), at least one before the first capture of each key where the backend only
        records (``cuda``), so lazy initialisation (autotuning, workspace allocation, cuBLAS
        handles) happens outside the graph. Every capture pass is a dummy step in which all
        rows hold the inputs' fill values; its outputs are meaningless. The whole capture runs
        under a frozen garbage collector (collected once first): a collection during capture
        would walk every live object per graph and could free tensors the graph still
        references. The model's capture window (``model.capture_window``) is open during
        capture and closed afterwards, so a later step reaching an uncaptured key raises
        instead of capturing mid-serving.

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
        See :mod:`freezeframe.runtime.capture` for the lazy and background policies.
        """
        if self._lock.enter("capture()"):
            self._overlapped()
        try:
            return self._capturer.capture_all()
        finally:
            self._lock.exit()

    def wait_for_capture(self, timeout: float | None = None) -> CaptureReport:
        """Wait until the background capture is done (or ``timeout`` seconds passed) and
        return the report of what it captured; raise what the capture raised. With the other
        policies, the report as it stands (capture() must have been called)."""
        return self._capturer.wait(timeout)

    @property
    def pending_captures(self) -> int:
        """Graph keys the lazy or background policy has not captured yet."""
        return self._capturer.pending

    def __repr__(self) -> str:
        mode = self.dispatcher.cudagraph_mode.name
        return (f"GraphRunner(inputs={list(self.specs)}, mode={mode}, device={self.device}, "
                f"captured={self.captured})")
