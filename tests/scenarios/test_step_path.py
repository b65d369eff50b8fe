"""One step path: every GraphRunner step is a plan run through one function,
``Stepper.run(plan, inputs)`` (runtime/steps.py) -- the first step of a shape, the later
(planned) steps of it, steps that cannot be planned and micro-batched steps alike. A spy on
that function records each step's plan; the model's forward and the graphs' replays are only
ever called from inside it (capture passes aside). And steps given by name or with ``extras``
are planned as positional ones are: a splitting op reads each step's own extras. Every
scenario runs on every graph backend present (the ``rig`` fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.context import get_forward_context
from freezeframe.graphs.replay import Replay
from freezeframe.models.ops import define_op
from freezeframe.runtime import GraphRunner, Tokens
from freezeframe.runtime.forward import ModelForward
from freezeframe.runtime.plan import ModelCall, StepPlan
from freezeframe.runtime.steps import Stepper
from tests.helpers.toy_models import SillyModel
from tests.scenarios.conftest import Rig
from tests.scenarios.runners import config, same


class Spy:
    """Every plan ``Stepper.run`` ran, in order; and whether a model call or a replay of a
    step ever happened outside it."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []
        self.depth = 0
        self.outside: list[str] = []

    def kinds(self) -> list[str]:
        names = []
        for plan in self.plans:
            work = plan.work
            name = type(work).__name__
            if isinstance(work, ModelCall) and work.recording is not None:
                name += "+recording"
            if isinstance(work, ModelCall) and work.slices is not None:
                name += f"+{len(work.slices.slices)} slices"
            names.append(name)
        return names


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    seen = Spy()
    run, forward, replay = Stepper.run, ModelForward.__call__, Replay.on_captured

    def spied_run(self: Stepper, plan: StepPlan, inputs: Any, extras: Any = None) -> Any:
        seen.plans.append(plan)
        seen.depth += 1
        try:
            return run(self, plan, inputs, extras)
        finally:
            seen.depth -= 1

    def spied_forward(self: ModelForward, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("capturing") and seen.depth == 0:
            seen.outside.append("model call")
        return forward(self, *args, **kwargs)

    def spied_replay(self: Replay) -> Any:
        if seen.depth == 0:
            seen.outside.append("replay")
        return replay(self)

    monkeypatch.setattr(Stepper, "run", spied_run)
    monkeypatch.setattr(ModelForward, "__call__", spied_forward)
    monkeypatch.setattr(Replay, "on_captured", spied_replay)
    yield seen
    assert seen.outside == []


def eager_silly(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return SillyModel().to(x.device)(x)


def silly_runner(rig: Rig, graph_mode: str, **kw: Any) -> tuple[Any, GraphRunner]:
    cfg = config(rig, graph_mode)
    model = ff.compile(SillyModel().to(rig.device), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False, **kw)
    runner.capture()
    return model, runner


def steps(rig: Rig, runner: GraphRunner) -> None:
    """Four steps of 3 tokens: by position, by name, with extras, by position; each checked
    against eager."""
    for i, call in enumerate(["position", "name", "extras", "position"]):
        x = rig.randn(3, 3, generator=torch.Generator().manual_seed(i))
        if call == "name":
            out = runner(x=x)
        elif call == "extras":
            out = runner(x, extras={"tag": i})
        else:
            out = runner(x)
        assert same(rig, out, eager_silly(x)), call


@pytest.mark.parametrize("graph_mode", ["full", "piecewise"])
def test_the_first_and_the_later_steps_of_a_shape_run_one_plan_each(
        rig: Rig, spy: Spy, graph_mode: str) -> None:
    model, runner = silly_runner(rig, graph_mode)
    spy.plans.clear()  # (capture() makes no step)
    with runner.stats.expect(steps=4), model.stats.expect(graphs_captured=0):
        steps(rig, runner)
    first, *later = spy.plans
    if graph_mode == "full":  # the first step replays its graph as the later ones do
        assert spy.kinds() == ["GraphReplay"] * 4
        assert all(plan is first for plan in later)
    else:  # the first step records the piece chain the later ones replay
        assert spy.kinds() == ["ModelCall+recording"] + ["PieceReplays"] * 3
        assert all(plan is later[0] for plan in later)
    assert runner.planned_shapes == 1


def test_steps_that_cannot_be_planned_run_an_eager_plan_each(rig: Rig, spy: Spy) -> None:
    # a forward hook on the model must run at every step: no step skips the model's call
    model, runner = silly_runner(rig, "full")
    seen: list[int] = []
    handle = model.register_forward_hook(lambda m, a, out: seen.append(out.shape[0]))
    spy.plans.clear()
    steps(rig, runner)
    assert spy.kinds() == ["ModelCall"] * 4 and len(set(map(id, spy.plans))) == 4
    assert seen == [4] * 4 and runner.planned_shapes == 0
    handle.remove()
    # graphs off: every step runs the model eagerly, from a plan of its own
    _, runner = silly_runner(rig, "none")
    spy.plans.clear()
    steps(rig, runner)
    assert spy.kinds() == ["ModelCall"] * 4 and runner.planned_shapes == 0


class TokenWise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


def test_a_micro_batched_step_is_a_plan_whose_work_is_its_slices(rig: Rig, spy: Spy) -> None:
    cfg = ff.CompilationConfig(mode="none", cudagraph_mode="none", micro_batching=True,
                               micro_batch_decode_threshold=2,
                               micro_batch_prefill_threshold=2, max_num_tokens=8,
                               max_num_seqs=8)
    runner = GraphRunner(TokenWise(), cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False)
    x = rig.randn(6, 3, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        assert same(rig, runner(x, num_scheduled_tokens=[2, 2, 2]), x * 2 + 1)
    assert spy.kinds() == ["ModelCall+2 slices"] * 2


# -- steps by name and with extras are planned ------------------------------------------------
SCALE_OP = "steptest::scale_by_extras"


def _scale(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x * extras["scale"]``: a splitting op that reads the step's forward context."""
    ctx = get_forward_context()
    scale = ctx.extras.get("scale", 1.0) if ctx is not None else 1.0
    torch.mul(x, scale, out=out)


_LIBRARY = define_op(SCALE_OP, "(Tensor x, Tensor(a!) out) -> ()", _scale,
                     lambda x, out: None)


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.steptest.scale_by_extras(x + 1, out)
        return out * 2


@pytest.mark.parametrize("graph_mode", ["full", "piecewise"])
def test_steps_by_name_and_with_extras_are_planned(rig: Rig, graph_mode: str) -> None:
    """A PIECEWISE plan's splitting op reads each step's own extras (they are staged into the
    step's forward context, not frozen into the plan). A FULL graph was captured without any
    extras and a replay reads none: the same answer the model's own call gives."""
    cfg = config(rig, graph_mode, splitting_ops=[SCALE_OP])
    model = ff.compile(Scaled().to(rig.device), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False)
    runner.capture()
    x = rig.randn(3, 3, generator=torch.Generator().manual_seed(0))
    runner(x=x, extras={"scale": 5.0})  # the first step of the shape plans it
    signer = model._signer  # (a planned step routes nothing through the model)
    assert signer is not None

    def no_routing(*args: Any) -> Any:
        raise AssertionError("a planned step routed its call through the model")

    signer.key = no_routing  # type: ignore[method-assign, assignment]
    for scale in (3.0, -1.0, 0.5):
        with model.stats.expect(graphs_captured=0, replays=1 if graph_mode == "full" else 2):
            got = runner(x=x, extras={"scale": scale})
        # FULL: the capture's (empty) extras are replayed; PIECEWISE: this step's
        want = (x + 1) * (1.0 if graph_mode == "full" else scale) * 2
        assert same(rig, got, want), scale
        assert same(rig, runner(x, extras={"scale": scale}), want)
    assert runner.planned_shapes == 1


def test_the_dispatch_options_of_a_step_are_part_of_its_plan_key(rig: Rig) -> None:
    """``invalid_modes={FULL}`` sends a uniform decode step of FULL_AND_PIECEWISE to its
    PIECEWISE graphs: it gets a plan of its own, and the plain decode steps of that shape keep
    replaying the FULL graph."""
    model, runner = silly_runner(rig, "full_and_piecewise")
    x = rig.randn(3, 3, generator=torch.Generator().manual_seed(0))
    decode = {"uniform_decode": True, "num_reqs": 3}
    no_full = {ff.CUDAGraphMode.FULL}
    for _ in range(3):
        with runner.stats.expect(steps_full=1), model.stats.expect(replays=1):
            assert same(rig, runner(x, **decode), eager_silly(x))
        with runner.stats.expect(steps_piecewise=1), model.stats.expect(replays=3):
            assert same(rig, runner(x, invalid_modes=no_full, **decode), eager_silly(x))
    assert runner.planned_shapes == 2
