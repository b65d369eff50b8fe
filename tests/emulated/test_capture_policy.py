"""GraphRunner's lazy and background capture policies (runtime/capture_policy.py) on the emulated
backend: what is captured when, that every step still gives eager's answer, and that a failed
capture leaves the runner serving."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import CompilationConfig, CUDAGraphMode
from freezeframe.errors import ConfigError
from freezeframe.runtime import GraphRunner, Static, Tokens
from tests.helpers.faults import FAULTS, FaultyModel, InjectedFault, _eager, _inputs
from tests.helpers.toy_models import SillyModel

FULL, PW = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE
SIZES = [1, 2, 4, 8]


def config(graphs: str = "full", ops: tuple[str, ...] = ("silly::attention",),
           **kw: Any) -> CompilationConfig:
    fields: dict[str, Any] = dict(
        mode="piecewise", backend="eager", splitting_ops=list(ops), cudagraph_mode=graphs,
        graph_backend="emulated", cudagraph_capture_sizes=SIZES, max_num_tokens=8,
        max_num_seqs=8, use_cache=False)
    fields.update(kw)
    return CompilationConfig(**fields)


def silly_runner(policy: str, mode: str = "full", **kw: Any
                 ) -> tuple[ff.compilation.CompiledModel, GraphRunner]:
    cfg = config(mode)
    model = ff.compile(SillyModel(), cfg)
    return model, GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False,
                              capture_policy=policy, **kw)


def eager(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return SillyModel()(x)


def test_lazy_captures_a_size_at_its_second_step_and_never_an_unseen_one() -> None:
    model, runner = silly_runner("lazy")
    report = runner.capture()
    assert (report.num_graphs, runner.pending_captures, model.stats.graphs_captured) == (0, 4, 0)
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    with runner.stats.expect(fallback_not_captured=1, steps_eager=1, steps_full=0):
        assert torch.equal(runner(x), eager(x))  # first sight: runs without a graph
    with runner.stats.expect(fallback_not_captured=0, steps_full=1, captures=1), \
            model.stats.expect(graphs_captured=1, replays=1):
        # second sight: a dummy step captures size 4, then the step replays it
        assert torch.equal(runner(x * 2), eager(x * 2))
    with model.stats.expect(graphs_captured=0, replays=1):
        assert torch.equal(runner(x * 3), eager(x * 3))
    assert [g.descriptor.num_tokens for g in runner.report.graphs] == [4]
    assert runner.pending_captures == 3


def test_lazy_with_no_warmups_captures_at_first_sight() -> None:
    model, runner = silly_runner("lazy", lazy_warmups=0)
    runner.capture()
    x = torch.ones(5, 3)
    with runner.stats.expect(fallback_not_captured=0, steps_full=1), \
            model.stats.expect(graphs_captured=1):
        assert torch.equal(runner(x), eager(x))
    assert runner.report.num_graphs == 1


def test_lazy_piecewise_and_full_keys_are_captured_separately() -> None:
    model, runner = silly_runner("lazy", mode="full_and_piecewise", lazy_warmups=0)
    runner.capture()
    x = torch.ones(2, 3)
    assert torch.equal(runner(x, uniform_decode=True), eager(x))  # the FULL decode key
    assert torch.equal(runner(x), eager(x))  # the PIECEWISE mixed key: 3 piece graphs
    assert [(g.mode, g.descriptor.num_tokens) for g in runner.report.graphs] == [
        (FULL, 2), (PW, 2)]
    assert model.stats.graphs_captured == 1 + 3


class TableAndTokens(nn.Module):
    """Returns the tokens doubled and a [4, 3] table that does not depend on the batch: at
    padded size 4 its dim 0 equals the padded size, and it must not be cut to the real rows."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.arange(12.0).reshape(4, 3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, self.table + 0


def test_lazy_cuts_outputs_right_before_two_sizes_are_captured() -> None:
    cfg = config("full", mode="dynamo_trace_once", splitting_ops=None)
    runner = GraphRunner(ff.compile(TableAndTokens(), cfg), cfg, inputs={"x": Tokens(3)},
                         progress=False, capture_policy="lazy", lazy_warmups=0)
    runner.capture()
    for n in (3, 3, 2):
        tokens, table = runner(torch.ones(n, 3))
        assert torch.equal(tokens, torch.full((n, 3), 2.0))
        assert torch.equal(table, torch.arange(12.0).reshape(4, 3)), n


def test_background_captures_everything_while_steps_get_eagers_answer() -> None:
    model, runner = silly_runner("background")
    report = runner.capture()
    assert report.num_graphs <= 4
    for step in range(12):
        n = 1 + step % 8
        x = torch.randn(n, 3, generator=torch.Generator().manual_seed(step))
        assert torch.equal(runner(x), eager(x)), step
    report = runner.wait_for_capture(timeout=60)
    assert sorted(g.descriptor.num_tokens for g in report.graphs) == SIZES
    assert runner.pending_captures == 0
    assert runner.stats.lock_waits == 0  # waiting for the capture thread is not an overlap
    with model.stats.expect(replays=4, graphs_captured=0):
        for n in (1, 2, 3, 8):
            x = torch.full((n, 3), float(n))
            assert torch.equal(runner(x), eager(x))
    steps = runner.stats.steps_full + runner.stats.steps_eager
    assert steps == 16 and runner.stats.steps_eager == runner.stats.fallback_not_captured


# -- failures ---------------------------------------------------------------------------------
def faulty_runner(policy: str) -> GraphRunner:
    cfg = config("full", ops=("fffaults::comm",))
    return GraphRunner(ff.compile(FaultyModel(), cfg), cfg, inputs={"x": Tokens(4)},
                       progress=False, capture_policy=policy, lazy_warmups=0)


def test_a_failed_lazy_capture_raises_once_and_leaves_the_runner_serving(
        caplog: pytest.LogCaptureFixture) -> None:
    runner = faulty_runner("lazy")
    runner.capture()
    x1 = _inputs(1, 1)
    assert torch.equal(runner(x1), _eager(x1))  # size 1 captured and replayed
    gc_before = (gc.isenabled(), gc.get_freeze_count())
    FAULTS.armed = "capture"
    x = _inputs(3, 2)
    with pytest.raises(InjectedFault, match="injected at capture"):
        runner(x)
    assert (gc.isenabled(), gc.get_freeze_count()) == gc_before
    assert ff.get_forward_context() is None
    assert runner.stats.capture_failures == 1
    # the failed key never captures again; its steps run without a graph and are counted
    with caplog.at_level(logging.WARNING, logger="freezeframe.runtime.runner"), \
            runner.stats.expect(fallback_capture_failed=2):
        assert torch.equal(runner(x), _eager(x))
        assert torch.equal(runner(x), _eager(x))
    assert "capturing the graph for this step" in caplog.text
    # every graph was freed; size 1 is captured again on its next step
    with runner.stats.expect(captures=1, steps_full=1):
        assert torch.equal(runner(x1), _eager(x1))


def test_a_failed_background_capture_is_raised_by_wait_for_capture() -> None:
    runner = faulty_runner("background")
    FAULTS.armed = "capture"
    runner.capture()
    with pytest.raises(InjectedFault, match="injected at capture"):
        runner.wait_for_capture(timeout=60)
    for n in (1, 3, 8):  # the runner serves on, without graphs
        x = _inputs(n, n)
        assert torch.equal(runner(x), _eager(x))
    assert runner.stats.steps_full == 0


# -- configuration ----------------------------------------------------------------------------
def test_bad_policies_are_refused_by_name() -> None:
    cfg = config()
    model = ff.compile(SillyModel(), cfg)
    with pytest.raises(ConfigError, match=r"capture_policy='later' is not a capture policy; "
                       r"use one of \['eager', 'lazy', 'background'\]"):
        GraphRunner(model, cfg, inputs={"x": Tokens(3)}, capture_policy="later")
    with pytest.raises(ConfigError, match=r"lazy_warmups must be an int >= 0, got -1"):
        GraphRunner(model, cfg, inputs={"x": Tokens(3)}, capture_policy="lazy",
                    lazy_warmups=-1)
    with pytest.raises(ConfigError, match="capture_policy='background' with dp_sync=True"):
        GraphRunner(model, cfg, inputs={"x": Tokens(3)}, capture_policy="background",
                    dp_sync=True)


def test_wait_for_capture_before_capture_is_an_error() -> None:
    _, runner = silly_runner("background")
    with pytest.raises(ff.FreezeframeError, match=r"wait_for_capture\(\) before capture\(\)"):
        runner.wait_for_capture()


def test_static_inputs_work_with_lazy_capture() -> None:
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return x * s

    cfg = config("full", mode="dynamo_trace_once", splitting_ops=None)
    runner = GraphRunner(ff.compile(Scale(), cfg, dynamic_arg_dims={"x": 0}), cfg,
                         inputs={"x": Tokens(2), "s": Static(2, fill=1)}, progress=False,
                         capture_policy="lazy")
    runner.capture()
    s = torch.tensor([2.0, 3.0])
    for n in (3, 3, 3, 5):
        x = torch.ones(n, 2)
        assert torch.equal(runner(x, s), x * s)
    assert runner.report.num_graphs == 1


def test_the_runner_keeps_a_histogram_of_real_step_sizes() -> None:
    _, runner = silly_runner("eager")
    runner.capture()
    for n in (3, 3, 1, 8, 3, 5, 8):  # planned and unplanned steps alike
        runner(torch.ones(n, 3))
    assert runner.size_histogram == {1: 1, 3: 3, 5: 1, 8: 2}
    # what the planner takes: with two sizes, 3 and 8 cost 148 units of the default step cost
    # (16 + padded tokens per step) against 153 for 5 and 8, and 161 for 1 and 8
    assert ff.plan_capture_sizes(runner.size_histogram, max_sizes=2).sizes == (3, 8)
    with pytest.raises(ff.errors.InputMismatchError):
        runner(torch.ones(3, 4))  # refused steps are not counted
    assert runner.size_histogram == {1: 1, 3: 3, 5: 1, 8: 2}
