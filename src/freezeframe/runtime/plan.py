"""A runner's steps: each shape planned once on its first step, then run from the plan.

The first step of a shape goes the whole way (:meth:`Stepper.step`): bind and check the
inputs, dispatch to a runtime mode and padded descriptor (with every fallback counted and
logged), stage the inputs into the static buffers, run the model in its forward context (or
replay the model's FULL graph directly), detect the inputs it wrote and copy them back, cut
the outputs to the real rows. When that step replayed captured graphs and touched nothing but
their buffers, everything it worked out depends only on the inputs' shapes, dtypes and
devices and on the step options, so it is kept as a :class:`StepPlan`::

    first step of a shape                         later steps of that shape (run)
    ---------------------                         --------------------------------
    bind, check every input                       one dict lookup: the key holds each input's
                                                    class, shape, dtype and device
    dispatch -> (mode, descriptor)                (planned)
    staging views, padding rows                   copy the inputs (one launch); the padding
                                                    only when another shape was staged since
    route the call through the model              (planned)
    module-state check                            module-state check
    FULL: replay the graph                        replay the graph
    PIECEWISE: Dynamo's code, the stitching       the stitching graph on the recorded flat
      graph, each piece's wrapper, which calls      inputs, each piece's Replay called
      the piece's Replay                            directly (the same argument checks), the
                                                    splitting ops called as before
    which inputs were written?                    FULL: none (a replay repeats the writes of
                                                    the step that made the plan, which wrote
                                                    none); PIECEWISE: the version counters are
                                                    compared (a splitting op runs its Python)
    cut the outputs                               FULL: new views of the same static outputs;
                                                    PIECEWISE: cut again

A plan is made only for steps with options it covers (no keyword inputs, ``extras``,
``invalid_modes``, LoRA, micro-batching, data-parallel agreement, hooks on the model), and a
PIECEWISE one only when the code Dynamo generated for ``forward`` does nothing but call the
graph. A plan ends when a graph of it is dropped (its replay raises
:class:`~freezeframe.graphs.StaleReplay` before anything runs) or when a PIECEWISE step of it
sees an input written: that step finishes the whole way and the plan is forgotten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from freezeframe.batch import BatchDescriptor, GraphKey, mixed_step_reqs
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import ForwardContext, entered
from freezeframe.errors import FallbackError, InputMismatchError
from freezeframe.graphs.capturable import Capturable
from freezeframe.graphs.replay import INPUT_COPIES, StaleReplay
from freezeframe.runtime.buffers import (
    Slot,
    Staging,
    StaticBuffers,
    alias,
    detach_from_written,
    map_tensors,
)
from freezeframe.runtime.capture import Capturer
from freezeframe.runtime.dispatcher import Dispatcher
from freezeframe.runtime.dist import agree_across_ranks
from freezeframe.runtime.forward import ModelForward, device_current
from freezeframe.runtime.inputs import InputChecker
from freezeframe.runtime.outputs import OutputCut
from freezeframe.runtime.report import FALLBACK_REASONS
from freezeframe.runtime.verify import Verifier
from freezeframe.stats import Stats, Tally

__all__ = ["StepCall", "StepPlan", "Stepper", "plan_key"]

# the runner's logger: its messages are GraphRunner's, filtered by that name
logger = logging.getLogger("freezeframe.runtime.runner")

_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
_GRAPH_MODES = frozenset({_PIECEWISE, _FULL})
_STEP_COUNTER = {_NONE: "steps_eager", _PIECEWISE: "steps_piecewise", _FULL: "steps_full"}
STALE = object()  # a plan's answer when its graph is gone: the step takes the whole way


@dataclasses.dataclass(frozen=True, slots=True)
class StepCall:
    """One call of the runner: its inputs and the step options (see GraphRunner.__call__)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    uniform_decode: bool = False
    has_lora: bool = False
    num_active_loras: int = 0
    num_reqs: int | None = None
    invalid_modes: Collection[CUDAGraphMode] = frozenset()
    extras: Mapping[str, Any] | None = None
    num_scheduled_tokens: Sequence[int] | None = None

    @property
    def plannable(self) -> bool:
        """Whether a plan covers these options (and so may serve, or be made from, it)."""
        return not (self.kwargs or self.extras or self.invalid_modes or self.has_lora
                    or self.num_scheduled_tokens is not None)


@dataclasses.dataclass(eq=False, slots=True)
class StepPlan:
    """A step of one input shape, planned (see the module docstring). What each input must be
    (class, shape, dtype, device) is the plan's key (:func:`plan_key`).

    ``output`` is a FULL step's answer: views of the graph's static outputs, the same every
    replay. ``counts`` are the runner's counter increments of such a step, each a tally of the
    runner's stats and the amount one step adds."""

    staging: Staging
    replay: Callable[[], Any]
    replay_key: tuple[BatchDescriptor, int | None]
    output: Any
    counts: tuple[tuple[Tally, int], ...]
    num_tokens: int
    num_reqs: int | None
    #: None for a FULL step (``output`` is its answer); for a PIECEWISE step, the forward
    #: context its splitting ops read, and ``output`` is unused (each step's outputs are cut
    #: to the real rows anew: a splitting op may return fresh tensors)
    context: ForwardContext | None = None
    #: PIECEWISE: the tensor the last step returned (before cutting) and its cut to the real
    #: rows; a step that returns the same tensor (a piece's static output) reuses the cut
    last_out: torch.Tensor | None = None
    last_cut: Any = None

    @property
    def graph_key(self) -> GraphKey:
        """The graph key it replays (FULL without a context, else PIECEWISE)."""
        return (_FULL if self.context is None else _PIECEWISE, self.replay_key[0])


# What a plan requires of each positional input. The class rules out tensor subclasses (and
# anything that is not a tensor: it has no ``shape``), which take the whole way and its checks.
_input_key = operator.attrgetter("__class__", "shape", "dtype", "device")


class _CopiedInto:
    """The runner's buffers a graph replay copied a new argument into during a hooked step:
    a forward pre-hook on the model returned new inputs, so the model ran on them and the
    replay copied them into the captured tensors, the runner's buffers. That copy is the
    library's own write, and what the graph then writes lands in the hook's tensors (the
    wrapper copies it there), so neither reaches the caller's input. A write made before the
    copy (the hook wrote the caller's input in place) does, as in eager: the buffer is kept
    as it was just before the copy."""

    __slots__ = ("_static", "_versions", "kept")

    def __init__(self, static: StaticBuffers, versions: list[int]) -> None:
        self._static, self._versions = static, versions
        # input name -> the buffer before the first copy into it when the step had written it
        # already, else None
        self.kept: dict[str, torch.Tensor | None] = {}

    def __call__(self, target: torch.Tensor) -> None:
        storage = target.untyped_storage().data_ptr()
        for (name, _, buf), before in zip(self._static.slots, self._versions, strict=True):
            if name not in self.kept and buf.untyped_storage().data_ptr() == storage:
                self.kept[name] = buf.clone() if buf._version != before else None

    def caller_writes(self, slots: list[Slot]) -> list[Slot]:
        """``slots`` (the buffers whose version moved) less the copies, each buffer written
        before its copy as it was then."""
        out: list[Slot] = []
        for name, kind, buf in slots:
            if name not in self.kept:
                out.append((name, kind, buf))
            elif (before := self.kept[name]) is not None:
                out.append((name, kind, before))
        return out


def plan_key(args: Sequence[Any], num_reqs: int | None, uniform_decode: bool
             ) -> tuple[Any, ...] | None:
    """The key of a step's plan: the step options a plan depends on and, per positional
    input, its class, shape, dtype and device; None when an input is no tensor (the step
    takes the whole way and fails there with a clear error). One dict lookup of this key is
    the whole input check of a planned step."""
    try:
        return (num_reqs, uniform_decode, *map(_input_key, args))
    except AttributeError:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class _Route:
    """Where a step goes: its runtime mode and descriptor, the padded sizes it runs at."""

    mode: CUDAGraphMode
    desc: BatchDescriptor
    padded_tokens: int
    padded_reqs: int | None
    uniform: bool


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The runner's options the steps read (see GraphRunner)."""

    strict: bool
    copy_outputs: bool
    dp_sync: bool
    dp_group: Any
    invalid_modes: frozenset[CUDAGraphMode]
    policy_name: str


class Stepper:
    """Runs a runner's steps: the plans, the whole way, dispatch and fallback accounting."""

    def __init__(self, held: Capturable | None, config: CompilationConfig,
                 dispatcher: Dispatcher, stats: Stats, static: StaticBuffers,
                 inputs: InputChecker, cut: OutputCut, forward: ModelForward,
                 capturer: Capturer, verifier: Verifier | None, options: StepOptions,
                 graphs_available: bool) -> None:
        self._held, self._config, self._dispatcher, self._stats = held, config, dispatcher, stats
        self._static, self._inputs, self._cut, self._forward = static, inputs, cut, forward
        self._capturer, self._verifier, self._options = capturer, verifier, options
        self._graphs_available = graphs_available
        self.copy_after_overlap = False  # set once threads were seen sharing the runner
        self.plans: dict[Any, StepPlan] = {}  # plan_key(...) -> the plan of that shape
        # real token count -> steps of that many tokens (GraphRunner.size_histogram)
        self.sizes: dict[int, int] = {}
        # (descriptor, padded requests) -> (graphs captured when looked up, the model's direct
        # FULL replay for that shape or None); see _replayer
        self._replays: dict[tuple[BatchDescriptor, int | None],
                            tuple[int, Callable[[], Any] | None]] = {}
        self._logged_reasons: set[str] = set()
        # the model's graph generation the graphs and plans belong to (it moves when the model
        # drops every graph: parameters replaced)
        self._generation = held.graph_generation if held is not None else 0

    # -- a planned step ---------------------------------------------------------------------
    def planned(self, args: tuple[Any, ...], num_reqs: int | None,
                uniform_decode: bool) -> Any:
        """A step with only the options a plan covers, run from its shape's plan, or
        :data:`STALE` (no plan, or it no longer holds): the caller takes the whole way."""
        if not self.plans or self.model_hooked():
            return STALE
        key = plan_key(args, num_reqs, uniform_decode)
        plan = self.plans.get(key)
        if plan is None or (self._verifier is not None
                            and self._verifier.due(plan.graph_key)):
            return STALE
        self._static.stage_into(plan.staging, args)
        self.sizes[plan.num_tokens] += 1  # the first step of the shape put it there
        if plan.context is None:
            out = self._run_full_plan(key, plan)
        else:
            out = self._run_piecewise_plan(key, plan, args, plan.context)
        if out is STALE:
            return out
        return self._copied(out)

    def _run_full_plan(self, key: Any, plan: StepPlan) -> Any:
        # the replay repeats the work of the step that made the plan, which wrote no input,
        # so no version counter is read
        try:
            plan.replay()  # grad mode is off for the whole step (see GraphRunner.__call__)
        except StaleReplay:
            return self._stale_plan(key, plan)
        except BaseException:
            with contextlib.suppress(Exception):
                self._static.reset_padding()
            raise
        for tally, by in plan.counts:
            tally.n += by
        out = plan.output
        # new tensor objects (views) and containers every step, as a step taking the whole
        # way makes: the caller may change the last ones (y.t_(), pop a key)
        return out.detach() if out.__class__ is torch.Tensor else map_tensors(out, alias)

    def _run_piecewise_plan(self, key: Any, plan: StepPlan, args: tuple[Any, ...],
                            context: ForwardContext) -> Any:
        """The replay and answer of a planned PIECEWISE step: its splitting ops run their
        Python, so the inputs' version counters are compared around it."""
        versions = self._static.versions()
        try:
            # the splitting ops run eagerly: on the runner's device (a Triton launch goes to
            # the current one)
            with device_current(self._static.device), entered(context):
                out = plan.replay()
        except StaleReplay:
            return self._stale_plan(key, plan)
        except BaseException:
            self._after_failure(dict(zip(self._static.specs, args, strict=True)), versions,
                                None, plan.num_tokens, plan.num_reqs)
            raise
        for tally, by in plan.counts:
            tally.n += by
        padded_tokens, padded_reqs = plan.replay_key[0].num_tokens, plan.replay_key[1]
        if self._static.versions() != versions:
            # The model wrote an input after all: finish the whole way, without the plan.
            self._forget_plan(key)
            values = dict(zip(self._static.specs, args, strict=True))
            slots = self._static.written(versions, None)
            return self._finish(out, values, slots, self._static.aliased(values),
                                padded_tokens, plan.num_tokens, padded_reqs, plan.num_reqs)
        if out is plan.last_out:  # the same static tensor as last step: the same cut of it
            cut = plan.last_cut  # (a new view of it per step)
            return cut.detach() if cut.__class__ is torch.Tensor else map_tensors(cut, alias)
        cut = self._cut.cut(out, padded_tokens, plan.num_tokens, padded_reqs, plan.num_reqs)
        if out.__class__ is torch.Tensor:
            # kept as a view of its own (the answer returned now may be changed in place)
            plan.last_out, plan.last_cut = out, map_tensors(cut, alias)
        return cut

    def _stale_plan(self, key: Any, plan: StepPlan) -> Any:
        """A graph of ``plan`` was dropped (its replay raised before anything ran): forget the
        plan and the shape's remembered replay; the caller takes the whole way."""
        self._forget_plan(key)
        self._replays.pop(plan.replay_key, None)
        return STALE

    def _forget_plan(self, key: Any) -> None:
        plan = self.plans.pop(key)
        for tally, _ in plan.counts:
            self._stats.retire(tally)

    # -- the whole way ----------------------------------------------------------------------
    def step(self, call: StepCall) -> Any:
        """One step the whole way (see the module docstring), keeping its plan when it can."""
        held = self._held
        if held is not None and self._graphs_available \
                and held.check_state() != self._generation:
            self.capture_again()
        values = self._inputs.bind(call.args, call.kwargs)
        num_tokens, reqs = self._inputs.validate(values, call.num_reqs, call.uniform_decode)
        self.sizes[num_tokens] = self.sizes.get(num_tokens, 0) + 1
        aliased = self._static.aliased(values)
        route = self._route(call, num_tokens, reqs)
        mode, desc = route.mode, route.desc
        padded_tokens, padded_reqs = route.padded_tokens, route.padded_reqs
        self._static.stage(values, num_tokens, padded_tokens, reqs, padded_reqs)
        counters = (("steps", 1), (_STEP_COUNTER[mode], 1)) + (
            (("padded_tokens", padded_tokens - num_tokens),) if padded_tokens != num_tokens
            else ())
        for name, by in counters:
            self._stats.inc(name, by)
        extras = dict(call.extras) if call.extras else {}
        split = self._forward.micro_batches(call.num_scheduled_tokens, num_tokens, reqs,
                                            padded_tokens, padded_reqs, route.uniform)
        versions = self._static.versions()
        writes = self._capturer.graph_writes.get((mode, desc))
        if aliased and writes:
            self._static.refuse_written_alias(values, aliased, writes)
        hooked = self.model_hooked()  # its hooks run in __call__: no direct replay then
        plannable = writes is not None and not writes and split is None and not hooked \
            and held is not None and call.plannable and not self._options.dp_sync
        verifier = self._verifier
        before = verifier.begin(held.module, values) if (  # type: ignore[union-attr]
            verifier is not None and mode is not _NONE and held is not None
            and verifier.due((mode, desc))) else None
        copies = _CopiedInto(self._static, versions) if hooked else None  # (pre-hooks)
        token = INPUT_COPIES.set(copies) if copies is not None else None
        try:
            out, replay = self._run(route, num_tokens, reqs, extras, split,
                                    plannable, direct=split is None and not hooked)
        except BaseException:
            self._after_failure(values, versions, writes, num_tokens, reqs, copies)
            raise
        finally:
            if token is not None:
                INPUT_COPIES.reset(token)
        slots = self._static.written(versions, writes)
        if copies is not None and copies.kept:
            slots = copies.caller_writes(slots)
        out = self._finish(out, values, slots, aliased, padded_tokens, num_tokens, padded_reqs,
                           reqs)
        if before is not None:
            assert verifier is not None and held is not None
            verifier.finish((mode, desc), before, out, held.module, lambda: verifier.reference(
                held, before, self._forward.call_positional, num_tokens, extras))
        if replay is not None and not slots and plannable:
            context = ForwardContext(mode, desc, num_tokens_unpadded=num_tokens,
                                     num_reqs_unpadded=reqs, owner=self._static) \
                if mode is _PIECEWISE else None
            self._keep_plan(call, replay, (desc, padded_reqs), out, counters, num_tokens,
                            reqs, padded_tokens, padded_reqs, context)
        return self._copied(out)

    def _run(self, route: _Route, num_tokens: int, reqs: int | None,
             extras: Mapping[str, Any], split: Any, plannable: bool, direct: bool
             ) -> tuple[Any, Callable[[], Any] | None]:
        """The model's answer for the step, and the replay a plan may repeat (or None)."""
        mode, desc = route.mode, route.desc
        padded_tokens, padded_reqs = route.padded_tokens, route.padded_reqs
        replay = self._replayer(mode, desc, padded_tokens, padded_reqs) if direct else None
        if replay is not None:
            try:
                return replay(), replay  # grad mode is off for the whole step
            except StaleReplay:  # its graph was dropped: through the model, which recaptures
                del self._replays[(desc, padded_reqs)]
        if mode is _PIECEWISE and plannable:
            assert self._held is not None
            args, kwargs = self._forward.arguments(padded_tokens, padded_reqs)
            return self._held.plan_piecewise(
                desc, args, kwargs, lambda: self._forward(
                    _PIECEWISE, desc, padded_tokens, padded_reqs, num_tokens, reqs, {}, None),
                self._static)
        out = self._forward(mode, desc, padded_tokens, padded_reqs, num_tokens, reqs,
                            extras, split)
        return out, None

    def _route(self, call: StepCall, num_tokens: int, reqs: int | None) -> _Route:
        """Dispatch the step, through every reason it may run without a graph."""
        step_tokens, uniform = num_tokens, bool(call.uniform_decode)
        if self._options.dp_sync:
            step_tokens, uniform = agree_across_ranks(num_tokens, uniform,
                                                      self._options.dp_group)
        base = self._options.invalid_modes
        invalid = base | frozenset(call.invalid_modes) if call.invalid_modes else base
        lora = (call.has_lora, call.num_active_loras)
        mode, desc = self._dispatch(step_tokens, uniform, *lora, invalid)
        capturer = self._capturer
        key = (mode, desc)
        if mode is not _NONE and capturer.capture_failed:
            mode, desc = self._without_graph(key, "capture_failed", step_tokens, uniform, *lora)
        elif mode is not _NONE and capturer.deferred and capturer.deferred.waiting(key):
            reason = capturer.deferred_step(key)
            if reason is not None:
                mode, desc = self._without_graph(key, reason, step_tokens, uniform, *lora)
        if mode is not _NONE and capturer.warms_up_first((mode, desc)):
            # before capture(), a step of a key nothing ran yet would capture that key's code
            # on its first run (the window is open): it runs without a graph, as a warm-up
            mode, desc = self._dispatcher.dispatch(step_tokens, uniform, *lora,
                                                   invalid_modes=_GRAPH_MODES)
        padded_tokens = desc.num_tokens if mode is not _NONE else step_tokens
        padded_reqs = desc.num_reqs if desc.num_reqs is not None else reqs
        if mode is _PIECEWISE and reqs is not None:
            # A piecewise graph's key ignores the request count, so its pieces were captured
            # with the request rows the capture gave them; every step of that size passes as
            # many (the padded rows hold the fill value), never fewer, which a replay would
            # read as stale rows.
            padded_reqs = mixed_step_reqs(padded_tokens, self._config.max_num_seqs)
        if reqs is not None and padded_reqs is not None and reqs > padded_reqs:
            raise InputMismatchError(
                f"step has {reqs} requests but the graph key {desc} holds {padded_reqs}; with "
                f"uniform_decode=True every request must have exactly "
                f"{self._dispatcher.uniform_decode_query_len} tokens")
        return _Route(mode, desc, padded_tokens, padded_reqs, uniform)

    def _after_failure(self, values: Mapping[str, torch.Tensor], versions: list[int],
                       writes: frozenset[str] | None, num_tokens: int, reqs: int | None,
                       copies: _CopiedInto | None = None) -> None:
        """A step raised: what the model wrote before it did reaches the caller, as in eager,
        and the buffers are refilled (it may have written any row)."""
        with contextlib.suppress(Exception):
            slots = self._static.written(versions, writes)
            if copies is not None and copies.kept:
                slots = copies.caller_writes(slots)
            self._static.copy_back(values, slots, num_tokens, reqs)
        with contextlib.suppress(Exception):
            self._static.reset_padding()

    def _finish(self, out: Any, values: Mapping[str, torch.Tensor], slots: list[Slot],
                aliased: tuple[tuple[str, ...], ...], padded_tokens: int, num_tokens: int,
                padded_reqs: int | None, reqs: int | None) -> Any:
        """After the model ran: copy the inputs it wrote (``slots``) back to the caller and
        cut the outputs to the real rows."""
        out = detach_from_written(out, values, slots)
        written = self._static.copy_back(values, slots, num_tokens, reqs)
        if aliased and written:
            self._static.refuse_written_alias(values, aliased, written)
        return self._cut.cut(out, padded_tokens, num_tokens, padded_reqs, reqs)

    def _keep_plan(self, call: StepCall, replay: Callable[[], Any],
                   replay_key: tuple[BatchDescriptor, int | None], out: Any,
                   counters: tuple[tuple[str, int], ...], num_tokens: int, reqs: int | None,
                   padded_tokens: int, padded_reqs: int | None,
                   context: ForwardContext | None) -> None:
        """Keep what this step worked out, for later steps of its shape: it replayed a FULL
        graph (or a planned PIECEWISE chain, run in ``context``), wrote no input and took only
        options a plan covers."""
        if len(call.args) != len(self._static.specs):
            return
        key = plan_key(call.args, call.num_reqs, call.uniform_decode)
        if key is None:
            return
        self.plans[key] = StepPlan(
            staging=self._static.staging(num_tokens, padded_tokens, reqs, padded_reqs),
            replay=replay, replay_key=replay_key, output=map_tensors(out, alias),
            counts=tuple((self._stats.tally(name), by) for name, by in counters),
            num_tokens=num_tokens, num_reqs=reqs, context=context)

    def _replayer(self, mode: CUDAGraphMode, desc: BatchDescriptor, padded_tokens: int,
                  padded_reqs: int | None) -> Callable[[], Any] | None:
        """The model's direct replay of the FULL graph of this step's shape, made once per
        shape: later steps of that shape stage their inputs and replay, without the forward
        context, the call-structure routing or the per-tensor replay checks. Only for a model
        holding its own graphs, after its graph for ``desc`` exists."""
        if mode is not _FULL or self._held is None or self._forward.ubatch is not None:
            return None
        key = (desc, padded_reqs)
        known = self._replays.get(key)
        captured = self._held.stats.get("graphs_captured")
        if known is not None and (known[1] is not None or known[0] == captured):
            return known[1]
        args, kwargs = self._forward.arguments(padded_tokens, padded_reqs)
        with torch.no_grad():
            replay = self._held.replayer(desc, args, kwargs, self._static)
        self._replays[key] = (captured, replay)  # a miss is retried once more graphs exist
        return replay

    def _copied(self, out: Any) -> Any:
        if self._options.copy_outputs or self.copy_after_overlap:
            return map_tensors(out, lambda t: t.clone())
        return out

    def model_hooked(self) -> bool:
        """Whether calling the model runs hooks of its own (forward or forward-pre hooks on the
        model, or torch's global module hooks): a planned step or a direct replay skips
        ``nn.Module.__call__``, so such steps go through it."""
        model = self._forward.model
        return bool((isinstance(model, torch.nn.Module)
                     and (model._forward_hooks or model._forward_pre_hooks))
                    or _global_forward_hooks or _global_forward_pre_hooks)

    def capture_again(self) -> None:
        """The model dropped every graph (its parameters or buffers were replaced after the
        capture, so the graphs read old memory): forget what was planned on them and capture
        the keys again as the capture policy does. Counted in ``stats.recaptures``; the model
        logs the change once."""
        assert self._held is not None
        self._generation = self._held.graph_generation
        for key in list(self.plans):
            self._forget_plan(key)
        self._replays.clear()
        if self._forward.ubatch is not None:
            self._forward.ubatch.clear()
        self._stats.inc("recaptures")
        self._capturer.again()

    # -- dispatch and fallback accounting ---------------------------------------------------
    def _dispatch(self, num_tokens: int, uniform: bool, has_lora: bool, num_active_loras: int,
                  invalid: frozenset[CUDAGraphMode]) -> tuple[CUDAGraphMode, BatchDescriptor]:
        d = self._dispatcher
        off = not self._graphs_available or self._capturer.compile_disabled
        mode, desc = d.dispatch(num_tokens, uniform, has_lora, num_active_loras,
                                invalid_modes=_GRAPH_MODES if off else invalid)
        if mode is _NONE:
            reason = self._fallback_reason(num_tokens, uniform, has_lora, num_active_loras,
                                           invalid)
            self._fallback(reason, num_tokens=num_tokens, uniform=uniform, desc=desc,
                           invalid=sorted(m.name for m in invalid))
        return mode, desc

    def _fallback_reason(self, num_tokens: int, uniform: bool, has_lora: bool,
                         num_active_loras: int, invalid: frozenset[CUDAGraphMode]) -> str:
        d = self._dispatcher
        if d.cudagraph_mode is not _NONE and not self._graphs_available:
            return "graphs_unavailable"
        if d.cudagraph_mode is not _NONE and self._capturer.compile_disabled:
            return "compile_disabled"
        return d.why_no_graph(num_tokens, uniform, has_lora, num_active_loras, invalid)

    def _without_graph(self, key: GraphKey, reason: str, num_tokens: int, uniform: bool,
                       has_lora: bool, num_active_loras: int
                       ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The step's graph (``key``) cannot run: dispatch it without a graph, counted and
        logged as ``reason`` (strict runners raise)."""
        mode, desc = self._dispatcher.dispatch(num_tokens, uniform, has_lora,
                                               num_active_loras, invalid_modes=_GRAPH_MODES)
        self._fallback(reason, num_tokens=num_tokens, uniform=uniform, desc=key[1],
                       invalid=[])
        return mode, desc

    def _fallback(self, reason: str, **info: Any) -> None:
        self._stats.inc(f"fallback_{reason}")
        level, template = FALLBACK_REASONS[reason]
        message = template.format(
            backend=self._config.graph_backend, max_size=self._dispatcher.max_capture_size,
            mode=self._dispatcher.cudagraph_mode.name, policy=self._options.policy_name,
            **info)
        if self._options.strict:
            raise FallbackError(
                f"step would run without a graph ({reason}): {message}. The runner is strict; "
                "construct it with strict=False to allow eager fallbacks")
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            logger.log(level, "GraphRunner eager fallback (%s, logged once): %s", reason, message)
