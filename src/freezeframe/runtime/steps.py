"""A runner's steps: every step is a plan (:mod:`freezeframe.runtime.plan`) run through one
function, :meth:`Stepper.run`.

::

    GraphRunner.__call__(inputs, options)
        |
        v
    Stepper.step: the shape's kept plan (one dict lookup: the plan key), else
                  Stepper.plan: bind and check the inputs, route (mode, descriptor, padded
                  sizes; fallbacks counted), staging, the work (a replay where the graph is
                  there, else the model's Python, recording the piece chain under PIECEWISE)
        |
        v  StepPlan
    Stepper.run(plan, inputs): stage -> (check) -> work in its context -> written inputs
                  copied back (when watched) -> the output cut -> kept for the shape when the
                  work replayed graphs and wrote nothing

A step whose plan's graph was dropped meanwhile (the replay raises
:class:`~freezeframe.graphs.StaleReplay` before anything ran) is planned again, the model's
Python then capturing the graph again (or raising that the capture window is closed).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from freezeframe.compilation.module_call import may_skip_module_call
from freezeframe.config import CUDAGraphMode
from freezeframe.context import ForwardContext, entered
from freezeframe.graphs.capturable import Capturable
from freezeframe.graphs.replay import StaleReplay
from freezeframe.runtime.buffers import (
    Slot,
    StaticBuffers,
    alias,
    detach_from_written,
    map_tensors,
)
from freezeframe.runtime.capture import Capturer
from freezeframe.runtime.forward import ModelForward, device_current
from freezeframe.runtime.inputs import InputChecker
from freezeframe.runtime.outputs import OutputCut
from freezeframe.runtime.plan import (
    GraphReplay,
    ModelCall,
    PieceReplays,
    StepCall,
    StepOptions,
    StepPlan,
    input_key,
    plan_key,
    step_options,
)
from freezeframe.runtime.route import StepRouter
from freezeframe.runtime.verify import Verifier
from freezeframe.stats import Stats

__all__ = ["STALE", "StepParts", "Stepper"]

_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
_STEP_COUNTER = {_NONE: "steps_eager", _PIECEWISE: "steps_piecewise", _FULL: "steps_full"}
STALE = object()  # run()'s answer when its plan's graph is gone: the step is planned again


@dataclasses.dataclass(frozen=True)
class StepParts:
    """The runner's parts its steps use (built once by :class:`GraphRunner`)."""

    held: Capturable | None  # the model, when it holds graphs of its own
    static: StaticBuffers
    inputs: InputChecker
    router: StepRouter
    forward: ModelForward
    capturer: Capturer
    cut: OutputCut
    stats: Stats
    verifier: Verifier | None
    graphs_available: bool


class Stepper:
    """Runs a runner's steps: finds or makes each step's plan, runs it (see the module
    docstring), keeps the plans of the shapes that replay."""

    def __init__(self, parts: StepParts, options: StepOptions) -> None:
        self._parts, self._options = parts, options
        self._held, self._static, self._forward = parts.held, parts.static, parts.forward
        self._stats, self._verifier, self._cut = parts.stats, parts.verifier, parts.cut
        self._names = tuple(parts.static.specs)
        self._on_cuda = parts.static.device.type == "cuda"
        # return copies of the outputs: copy_outputs=True, or since threads were seen sharing
        # the runner (GraphRunner sets it then)
        self.copy_outputs = options.copy_outputs
        self.plans: dict[Any, StepPlan] = {}  # plan key -> the kept plan of that shape
        # (mode, descriptor, padded requests) -> the replay work of the plans that run it: the
        # shapes padded to one size share it, so only the first of them asks the model
        self._works: dict[tuple[Any, ...], GraphReplay | PieceReplays] = {}
        # real token count -> steps of that many tokens (GraphRunner.size_histogram)
        self.sizes: dict[int, int] = {}
        # the model's graph generation the graphs and plans belong to (it moves when the model
        # drops every graph: parameters replaced)
        held = parts.held
        self._generation = held.graph_generation if held is not None else 0

    # -- a step ------------------------------------------------------------------------------
    def step(self, args: tuple[Any, ...], kwargs: dict[str, Any], uniform_decode: bool,
             has_lora: bool, num_active_loras: int, num_reqs: int | None,
             invalid_modes: Collection[CUDAGraphMode], extras: Mapping[str, Any] | None,
             num_scheduled_tokens: Sequence[int] | None) -> Any:
        """One step (see ``GraphRunner.__call__``): its shape's kept plan, or a plan made now,
        run."""
        plans, model = self.plans, self._forward.model
        # a replay skips nn.Module.__call__: only where the call would run nothing else
        # (model_hooked, written out: this is every step's path)
        if plans and (not isinstance(model, torch.nn.Module) or may_skip_module_call(model)):
            if kwargs or has_lora or num_active_loras or invalid_modes \
                    or num_scheduled_tokens is not None:
                plan, inputs = self._lookup(args, kwargs, num_reqs, uniform_decode,
                                            step_options(has_lora, num_active_loras,
                                                         invalid_modes),
                                            num_scheduled_tokens)
            else:  # most steps: plan_key written out (this lookup is their input check)
                inputs = args
                try:
                    plan = plans.get((num_reqs, uniform_decode, *map(input_key, args)))
                except AttributeError:  # an input is no tensor: the whole way says so
                    plan = None
            if plan is not None:
                out = self.run(plan, inputs, extras)
                if out is not STALE:
                    return out
        call = StepCall(args, kwargs, uniform_decode, has_lora, num_active_loras, num_reqs,
                        invalid_modes, extras, num_scheduled_tokens)
        plan, staged = self.plan(call)
        out = self.run(plan, staged, extras)
        if out is STALE:  # a graph dropped between planning and running: the model's way
            plan, staged = self.plan(call, replays=False)
            out = self.run(plan, staged, extras)
        return out

    def _lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any], num_reqs: int | None,
                uniform_decode: bool, options: tuple[Any, ...] | None,
                num_scheduled_tokens: Sequence[int] | None
                ) -> tuple[StepPlan | None, tuple[Any, ...]]:
        """The kept plan of a step with inputs by name or with step options, and its inputs
        in the runner's order; no plan where the names do not fit (the whole way says how)
        or the micro-batch split depends on ``num_scheduled_tokens``."""
        names, count = self._names, len(args)
        if count + len(kwargs) != len(names) or (num_scheduled_tokens is not None
                                                 and self._forward.ubatch is not None):
            return None, args
        try:
            inputs = (*args, *map(kwargs.__getitem__, names[count:]))
        except KeyError:
            return None, args
        return self.plans.get(plan_key(inputs, num_reqs, uniform_decode, options)), inputs

    # -- making a plan: the whole way ---------------------------------------------------------
    def plan(self, call: StepCall, replays: bool = True) -> tuple[StepPlan, list[Any]]:
        """The step's plan (see :mod:`~freezeframe.runtime.plan`) and its inputs in the
        runner's order: inputs bound and checked, the step routed, staged, its work chosen
        (``replays=False``: the model's Python, whatever is captured)."""
        held, static = self._held, self._static
        if held is not None and self._parts.graphs_available \
                and held.check_state() != self._generation:
            self.capture_again()
        values = self._parts.inputs.bind(call.args, call.kwargs)
        num_tokens, reqs = self._parts.inputs.validate(values, call.num_reqs,
                                                       call.uniform_decode)
        route = self._parts.router.route(call, num_tokens, reqs)
        mode, desc = route.mode, route.desc
        padded_tokens, padded_reqs = route.padded_tokens, route.padded_reqs
        writes = self._parts.capturer.graph_writes.get((mode, desc))
        if writes:
            aliased = static.aliased(values)
            if aliased:
                static.refuse_written_alias(values, aliased, writes)
        slices = self._forward.micro_batches(call.num_scheduled_tokens, num_tokens, reqs,
                                             padded_tokens, padded_reqs, route.uniform)
        staging = static.staging(num_tokens, padded_tokens, reqs, padded_reqs)
        inputs = [values[name] for name in staging.names]
        counters = (("steps", 1), (_STEP_COUNTER[mode], 1)) + (
            (("padded_tokens", padded_tokens - num_tokens),) if padded_tokens != num_tokens
            else ())
        keyed = (replays and held is not None and writes is not None and not writes
                 and slices is None and not self._options.dp_sync and not self.model_hooked())
        plan = StepPlan(route, num_tokens, reqs, staging, ModelCall(slices), None, None, True,
                        writes, counters,
                        plan_key(inputs, call.num_reqs, call.uniform_decode, call.options)
                        if keyed else None)
        if plan.key is not None:
            self._replay_work(plan)
        return plan, inputs

    def _replay_work(self, plan: StepPlan) -> None:
        """The work of a step that may be kept (``plan.key`` is set): the model's graph of
        the whole forward where it was captured on the buffers (FULL, a breakable model's
        PIECEWISE), or, under PIECEWISE, the model's Python with the piece chain recorded."""
        held = self._held
        assert held is not None
        route, owner = plan.route, self._static
        mode = route.mode
        if mode is _FULL and self._forward.ubatch is not None:
            return  # its FULL graphs are the micro-batch wrapper's: through the model
        known = self._works.get((mode, route.desc, route.padded_reqs))
        if known is not None and _live(known):
            plan.work = known
        else:
            args, kwargs = self._forward.arguments(route.padded_tokens, route.padded_reqs)
            replay = held.graph_replay(mode, route.desc, args, kwargs, owner)
            if replay is None:
                if mode is _PIECEWISE:
                    plan.work = ModelCall(None, held.record_pieces(args, kwargs, route.desc,
                                                                   owner))
                return
            plan.work = GraphReplay(replay)
        plan.check = held.state_check()
        if mode is _FULL:  # it reads no context; its answer: the same static outputs every
            # replay, cut once
            plan.watch = False
            replay = plan.work.replay  # type: ignore[union-attr]
            plan.output = self._cut.cut(replay.output, route.padded_tokens, plan.num_tokens,
                                        route.padded_reqs, plan.num_reqs)
        else:
            plan.context = self._context(plan)

    def _context(self, plan: StepPlan) -> ForwardContext:
        """The forward context a replay in context runs in (its splitting ops read it)."""
        route = plan.route
        return ForwardContext(route.mode, route.desc, num_tokens_unpadded=plan.num_tokens,
                              num_reqs_unpadded=plan.num_reqs, owner=self._static)

    # -- running a plan: every step ----------------------------------------------------------
    def run(self, plan: StepPlan, inputs: Sequence[Any],
            extras: Mapping[str, Any] | None = None) -> Any:
        """Run one step from its plan: stage the inputs, run the work, copy back what it wrote
        into an input, cut the outputs (see the module docstring). :data:`STALE` when a graph
        of the plan was dropped before anything ran."""
        static = self._static
        static.stage_into(plan.staging, inputs)
        n = plan.num_tokens
        try:
            self.sizes[n] += 1
        except KeyError:  # (the first step of this many tokens)
            self.sizes[n] = 1
        tallies, work = plan.tallies, plan.work
        model_call = work.__class__ is ModelCall
        if model_call:  # (counted even when the model raises)
            self._count(plan)
        verifier = self._verifier
        before = verifier.begin(  # type: ignore[union-attr]
            self._held.module, dict(zip(self._names, inputs, strict=True))) if (  # type: ignore[union-attr]
            verifier is not None and plan.route.mode is not _NONE and self._held is not None
            and verifier.due(plan.graph_key)) else None
        versions = static.versions() if plan.watch else None
        try:
            if model_call:
                out = self._call_model(plan, work, extras)  # type: ignore[arg-type]
            elif plan.context is None:  # a FULL replay (it reads no context)
                check = plan.check
                if check is not None:
                    check()
                out = work.replay.on_captured()  # type: ignore[union-attr]
            else:
                out = self._replay_in_context(plan, extras)
        except StaleReplay:
            if model_call:
                self._after_failure(plan, inputs, versions)
                raise
            return self._stale(plan)
        except BaseException:
            self._after_failure(plan, inputs, versions)
            raise
        if tallies:
            for tally, by in tallies:
                tally.n += by
        elif not model_call:  # the first step of a replay plan
            self._count(plan)
        if versions is None:  # a FULL replay: new views of its static outputs
            out = plan.output
            out = out.detach() if out.__class__ is torch.Tensor else map_tensors(out, alias)
            if not tallies and plan.key is not None:
                self._keep(plan)
        else:
            out = self._answer(plan, out, inputs, versions)
        if before is not None:
            assert verifier is not None and self._held is not None
            held = self._held
            verifier.finish(plan.graph_key, before, out, held.module, lambda: verifier.reference(
                held, before, self._forward.call_positional, n, extras or {}))
        if self.copy_outputs:
            return map_tensors(out, lambda t: t.clone())
        return out

    def _count(self, plan: StepPlan) -> None:
        """A step's counters, for a plan that has no tallies (not kept yet)."""
        for name, by in plan.counters:
            self._stats.inc(name, by)

    def _call_model(self, plan: StepPlan, work: ModelCall,
                    extras: Mapping[str, Any] | None) -> Any:
        """The model's Python on the buffer views, in the step's forward context."""
        route, recording = plan.route, work.recording
        call = (route.mode, route.desc, route.padded_tokens, route.padded_reqs, plan.num_tokens,
                plan.num_reqs, dict(extras) if extras else {}, work.slices)
        if recording is None:
            return self._forward(*call)
        with recording:
            return self._forward(*call)

    def _replay_in_context(self, plan: StepPlan, extras: Mapping[str, Any] | None) -> Any:
        """A PIECEWISE replay: its splitting ops run eagerly, read the forward context (this
        step's ``extras`` too) and launch on the runner's device."""
        ctx = plan.context
        assert ctx is not None
        if extras:
            ctx = dataclasses.replace(ctx, extras=MappingProxyType(dict(extras)))
        check, work = plan.check, plan.work
        run = work.chain if work.__class__ is PieceReplays else \
            work.replay.on_captured  # type: ignore[union-attr]
        with entered(ctx):
            if check is not None:
                check()
            if self._on_cuda:
                with device_current(self._static.device):
                    return run()
            return run()

    def _answer(self, plan: StepPlan, out: Any, inputs: Sequence[Any],
                versions: list[int]) -> Any:
        """After a watched step: the inputs it wrote copied back, the outputs cut; the plan
        kept (or a recorded chain's plan made) when it replayed and wrote nothing."""
        static, route = self._static, plan.route
        slots = static.written(versions, plan.graph_writes) \
            if plan.graph_writes or static.versions() != versions else []
        work = plan.work
        if slots or work.__class__ is ModelCall:
            if slots and plan.kept:  # a planned step wrote an input after all: forgotten
                self._forget(plan)
            values = dict(zip(self._names, inputs, strict=True))
            answer = self._finish(out, values, slots, plan)
            if not slots and plan.key is not None and work.__class__ is ModelCall:
                self._keep_chain(plan, work, out)  # type: ignore[arg-type]
            return answer
        if out is plan.last_out:  # the same static tensor as last step: the same cut of it
            cut = plan.last_cut  # (a new view of it per step)
            return cut.detach() if cut.__class__ is torch.Tensor else map_tensors(cut, alias)
        cut = self._cut.cut(out, route.padded_tokens, plan.num_tokens, route.padded_reqs,
                            plan.num_reqs)
        if out.__class__ is torch.Tensor:
            # kept as a view of its own (the answer returned now may be changed in place)
            plan.last_out, plan.last_cut = out, map_tensors(cut, alias)
        if not plan.kept and plan.key is not None:
            self._keep(plan)
        return cut

    def _finish(self, out: Any, values: Mapping[str, torch.Tensor], slots: list[Slot],
                plan: StepPlan) -> Any:
        """Copy the inputs the step wrote (``slots``) back to the caller and cut the outputs
        to the real rows."""
        static, route = self._static, plan.route
        out = detach_from_written(out, values, slots)
        written = static.copy_back(values, slots, plan.num_tokens, plan.num_reqs)
        if written:
            aliased = static.aliased(values)
            if aliased:
                static.refuse_written_alias(values, aliased, written)
        return self._cut.cut(out, route.padded_tokens, plan.num_tokens, route.padded_reqs,
                             plan.num_reqs)

    def _after_failure(self, plan: StepPlan, inputs: Sequence[Any],
                       versions: list[int] | None) -> None:
        """A step raised: what the model wrote before it did reaches the caller, as in eager,
        and the buffers are refilled (it may have written any row)."""
        static = self._static
        if versions is not None:
            with contextlib.suppress(Exception):
                slots = static.written(versions, plan.graph_writes)
                values = dict(zip(self._names, inputs, strict=True))
                static.copy_back(values, slots, plan.num_tokens, plan.num_reqs)
        with contextlib.suppress(Exception):
            static.reset_padding()

    # -- kept plans --------------------------------------------------------------------------
    def _keep(self, plan: StepPlan) -> None:
        """Keep ``plan`` for the later steps of its shape (it counts with tallies from now)."""
        key = plan.key
        assert key is not None
        if key in self.plans:
            self._forget(self.plans[key])
        # steps_planned: only steps run from a kept plan count it (the bench reads it)
        plan.tallies = tuple((self._stats.tally(name), by)
                             for name, by in (*plan.counters, ("steps_planned", 1)))
        self.plans[key] = plan
        route = plan.route
        self._works[(route.mode, route.desc, route.padded_reqs)] = plan.work  # type: ignore

    def _keep_chain(self, plan: StepPlan, work: ModelCall, out: Any) -> None:
        """The plan of the later steps of a PIECEWISE shape, from the chain its first step
        recorded."""
        chain = work.recording.chain(out) if work.recording is not None else None
        if chain is None:
            return
        assert self._held is not None
        self._keep(dataclasses.replace(plan, work=PieceReplays(chain),
                                       check=self._held.state_check(),
                                       context=self._context(plan)))

    def _forget(self, plan: StepPlan) -> None:
        if plan.key is not None and self.plans.get(plan.key) is plan:
            del self.plans[plan.key]
        for tally, _ in plan.tallies:
            self._stats.retire(tally)
        plan.tallies = ()

    def _stale(self, plan: StepPlan) -> Any:
        """A graph of ``plan`` was dropped (its replay raised before anything ran): forget
        the plan; the step is planned again."""
        self._forget(plan)
        route = plan.route
        self._works.pop((route.mode, route.desc, route.padded_reqs), None)
        self.sizes[plan.num_tokens] -= 1  # (the step is counted when it runs again)
        return STALE

    def capture_again(self) -> None:
        """The model dropped every graph (its parameters or buffers were replaced after the
        capture, so the graphs read old memory): forget what was planned on them and capture
        the keys again as the capture policy does. Counted in ``stats.recaptures``; the model
        logs the change once."""
        assert self._held is not None
        self._generation = self._held.graph_generation
        for plan in list(self.plans.values()):
            self._forget(plan)
        self._works.clear()
        if self._forward.ubatch is not None:
            self._forward.ubatch.clear()
        self._stats.inc("recaptures")
        self._parts.capturer.again()

    # -- what a step needs to know -----------------------------------------------------------
    def model_hooked(self) -> bool:
        """Whether a replay may not stand in for calling the model: a replay skips
        ``nn.Module.__call__``, so a model whose call runs more than its forward (see
        :func:`~freezeframe.compilation.module_call.may_skip_module_call`) goes through it."""
        model = self._forward.model
        return isinstance(model, torch.nn.Module) and not may_skip_module_call(model)



def _live(work: GraphReplay | PieceReplays) -> bool:
    """Whether every graph ``work`` replays is still held."""
    if work.__class__ is GraphReplay:
        return work.replay.graph is not None  # type: ignore[union-attr]
    return all(r.graph is not None for r in work.chain.replays)  # type: ignore[union-attr]
