"""GraphRunner's lazy and background capture policies (runtime/capture_policy.py): what is
captured when, that every step still gives eager's answer, and that a failed capture leaves the
runner serving. Every scenario runs on every graph backend present (the ``rig`` fixture)."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import CompilationConfig, CUDAGraphMode
from freezeframe.context import get_forward_context
from freezeframe.errors import ConfigError
from freezeframe.runtime import GraphRunner, Static, Tokens
from tests.helpers.faults import FAULTS, FaultyModel, InjectedFault, _inputs
from tests.helpers.toy_models import SillyModel
from tests.scenarios.conftest import Rig

FULL, PW = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE
SIZES = [1, 2, 4, 8]


def config(rig: Rig, graphs: str = "full", ops: tuple[str, ...] = ("silly::attention",),
           **kw: Any) -> CompilationConfig:
    fields: dict[str, Any] = dict(
        splitting_ops=list(ops), cudagraph_capture_sizes=SIZES, max_num_tokens=8,
        max_num_seqs=8)
    fields.update(kw)
    return rig.config(graphs, **fields)


def silly_runner(rig: Rig, policy: str, mode: str = "full", **kw: Any
                 ) -> tuple[ff.compilation.CompiledModel, GraphRunner]:
    cfg = config(rig, mode)
    model = ff.compile(SillyModel(), cfg)
    return model, GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                              progress=False, capture_policy=policy, **kw)


def eager(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return SillyModel()(x)


def same(rig: Rig, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of host copies (a replayed output is overwritten by the next replay)."""
    return torch.equal(rig.host(a), rig.host(b))


def test_lazy_captures_a_size_at_its_second_step_and_never_an_unseen_one(rig: Rig) -> None:
    model, runner = silly_runner(rig, "lazy")
    report = runner.capture()
    assert (report.num_graphs, runner.pending_captures, model.stats.graphs_captured) == (0, 4, 0)
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(0)).to(rig.device)
    with runner.stats.expect(fallback_not_captured=1, steps_eager=1, steps_full=0):
        assert same(rig, runner(x), eager(x))  # first sight: runs without a graph
    with runner.stats.expect(fallback_not_captured=0, steps_full=1, captures=1), \
            model.stats.expect(graphs_captured=1, replays=1):
        # second sight: a dummy step captures size 4, then the step replays it
        assert same(rig, runner(x * 2), eager(x * 2))
    with model.stats.expect(graphs_captured=0, replays=1):
        assert same(rig, runner(x * 3), eager(x * 3))
    assert [g.descriptor.num_tokens for g in runner.report.graphs] == [4]
    assert runner.pending_captures == 3


def test_lazy_with_no_warmups_captures_at_first_sight(rig: Rig) -> None:
    model, runner = silly_runner(rig, "lazy", lazy_warmups=0)
    runner.capture()
    x = torch.ones(5, 3, device=rig.device)
    with runner.stats.expect(fallback_not_captured=0, steps_full=1), \
            model.stats.expect(graphs_captured=1):
        assert same(rig, runner(x), eager(x))
    assert runner.report.num_graphs == 1


def test_lazy_piecewise_and_full_keys_are_captured_separately(rig: Rig) -> None:
    model, runner = silly_runner(rig, "lazy", mode="full_and_piecewise", lazy_warmups=0)
    runner.capture()
    x = torch.ones(2, 3, device=rig.device)
    assert same(rig, runner(x, uniform_decode=True), eager(x))  # the FULL decode key
    assert same(rig, runner(x), eager(x))  # the PIECEWISE mixed key: 3 piece graphs
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


def test_lazy_cuts_outputs_right_before_two_sizes_are_captured(rig: Rig) -> None:
    cfg = config(rig, "full", mode="dynamo_trace_once", splitting_ops=None)
    runner = GraphRunner(ff.compile(TableAndTokens().to(rig.device), cfg), cfg,
                         inputs={"x": Tokens(3)}, device=rig.device, progress=False,
                         capture_policy="lazy", lazy_warmups=0)
    runner.capture()
    for n in (3, 3, 2):
        tokens, table = runner(torch.ones(n, 3, device=rig.device))
        tokens, table = rig.host(tokens), rig.host(table)
        assert torch.equal(tokens, torch.full((n, 3), 2.0))
        assert torch.equal(table, torch.arange(12.0).reshape(4, 3)), n


def test_background_captures_everything_while_steps_get_eagers_answer(rig: Rig) -> None:
    model, runner = silly_runner(rig, "background")
    report = runner.capture()
    assert report.num_graphs <= 4
    for step in range(12):
        n = 1 + step % 8
        x = torch.randn(n, 3, generator=torch.Generator().manual_seed(step)).to(rig.device)
        assert same(rig, runner(x), eager(x)), step
    report = runner.wait_for_capture(timeout=60)
    assert sorted(g.descriptor.num_tokens for g in report.graphs) == SIZES
    assert runner.pending_captures == 0
    assert runner.stats.lock_waits == 0  # waiting for the capture thread is not an overlap
    with model.stats.expect(replays=4, graphs_captured=0):
        for n in (1, 2, 3, 8):
            x = torch.full((n, 3), float(n), device=rig.device)
            assert same(rig, runner(x), eager(x))
    steps = runner.stats.steps_full + runner.stats.steps_eager
    assert steps == 16 and runner.stats.steps_eager == runner.stats.fallback_not_captured


# -- failures ---------------------------------------------------------------------------------
def faulty_runner(rig: Rig, policy: str) -> GraphRunner:
    cfg = config(rig, "full", ops=("fffaults::comm",))
    return GraphRunner(ff.compile(FaultyModel().to(rig.device), cfg), cfg,
                       inputs={"x": Tokens(4)}, device=rig.device, progress=False,
                       capture_policy=policy, lazy_warmups=0)


def faulty_inputs(rig: Rig, tokens: int, seed: int) -> torch.Tensor:
    return _inputs(tokens, seed).to(rig.device)


def faulty_eager(rig: Rig, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return FaultyModel().to(rig.device)(x)


def test_a_failed_lazy_capture_raises_once_and_leaves_the_runner_serving(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    runner = faulty_runner(rig, "lazy")
    runner.capture()
    x1 = faulty_inputs(rig, 1, 1)
    assert same(rig, runner(x1), faulty_eager(rig, x1))  # size 1 captured and replayed
    gc_before = (gc.isenabled(), gc.get_freeze_count())
    FAULTS.armed = "capture"
    x = faulty_inputs(rig, 3, 2)
    with pytest.raises(InjectedFault, match="injected at capture"):
        runner(x)
    assert (gc.isenabled(), gc.get_freeze_count()) == gc_before
    assert get_forward_context() is None
    assert runner.stats.capture_failures == 1
    # the failed key never captures again; its steps run without a graph and are counted
    with caplog.at_level(logging.WARNING, logger="freezeframe.runtime.runner"), \
            runner.stats.expect(fallback_capture_failed=2):
        assert same(rig, runner(x), faulty_eager(rig, x))
        assert same(rig, runner(x), faulty_eager(rig, x))
    assert "capturing the graph for this step" in caplog.text
    # every graph was freed; size 1 is captured again on its next step
    with runner.stats.expect(captures=1, steps_full=1):
        assert same(rig, runner(x1), faulty_eager(rig, x1))


def test_a_failed_background_capture_is_raised_by_wait_for_capture(rig: Rig) -> None:
    runner = faulty_runner(rig, "background")
    FAULTS.armed = "capture"
    runner.capture()
    with pytest.raises(InjectedFault, match="injected at capture"):
        runner.wait_for_capture(timeout=60)
    for n in (1, 3, 8):  # the runner serves on, without graphs
        x = faulty_inputs(rig, n, n)
        assert same(rig, runner(x), faulty_eager(rig, x))
    assert runner.stats.steps_full == 0


# -- configuration ----------------------------------------------------------------------------
def test_bad_policies_are_refused_by_name(rig: Rig) -> None:
    cfg = config(rig)
    model = ff.compile(SillyModel(), cfg)
    with pytest.raises(ConfigError, match=r"capture_policy='later' is not a capture policy; "
                       r"use one of \['eager', 'lazy', 'background'\]"):
        GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                    capture_policy="later")
    with pytest.raises(ConfigError, match=r"lazy_warmups must be an int >= 0, got -1"):
        GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                    capture_policy="lazy", lazy_warmups=-1)
    with pytest.raises(ConfigError, match="capture_policy='background' with dp_sync=True"):
        GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                    capture_policy="background", dp_sync=True)


def test_wait_for_capture_before_capture_is_an_error(rig: Rig) -> None:
    _, runner = silly_runner(rig, "background")
    with pytest.raises(ff.FreezeframeError, match=r"wait_for_capture\(\) before capture\(\)"):
        runner.wait_for_capture()


def test_static_inputs_work_with_lazy_capture(rig: Rig) -> None:
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return x * s

    cfg = config(rig, "full", mode="dynamo_trace_once", splitting_ops=None)
    runner = GraphRunner(ff.compile(Scale(), cfg, dynamic_arg_dims={"x": 0}), cfg,
                         inputs={"x": Tokens(2), "s": Static(2, fill=1)}, device=rig.device,
                         progress=False, capture_policy="lazy")
    runner.capture()
    s = torch.tensor([2.0, 3.0], device=rig.device)
    for n in (3, 3, 3, 5):
        x = torch.ones(n, 2, device=rig.device)
        assert same(rig, runner(x, s), x * s)
    assert runner.report.num_graphs == 1


def test_the_runner_keeps_a_histogram_of_real_step_sizes(rig: Rig) -> None:
    _, runner = silly_runner(rig, "eager")
    runner.capture()
    for n in (3, 3, 1, 8, 3, 5, 8):  # planned and unplanned steps alike
        runner(torch.ones(n, 3, device=rig.device))
    assert runner.size_histogram == {1: 1, 3: 3, 5: 1, 8: 2}
    # what the planner takes: with two sizes, 3 and 8 cost 148 units of the default step cost
    # (16 + padded tokens per step) against 153 for 5 and 8, and 161 for 1 and 8
    assert ff.plan_capture_sizes(runner.size_histogram, max_sizes=2).sizes == (3, 8)
    with pytest.raises(ff.errors.InputMismatchError):
        runner(torch.ones(3, 4, device=rig.device))  # refused steps are not counted
    assert runner.size_histogram == {1: 1, 3: 3, 5: 1, 8: 2}


class CountsCalls(nn.Module):
    """Counts its calls in a buffer, as a running statistic (or a KV cache write) does."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x * 2 + self.calls


def test_a_lazy_capture_keeps_its_buffer_copies_on_the_device_where_they_fit(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dummy steps of a lazy capture write the model's buffers, which are restored after
    it. capture() keeps its copies on the host beyond DEVICE_LIMIT (0 here); one lazy key on a
    GPU keeps them on the device while they fit in half its free memory, not copying a whole KV
    cache to the host and back per key. On the CPU both are host copies."""
    from freezeframe.runtime import buffers, capture

    where: list[bool] = []

    class Recorded(buffers.SavedBuffers):
        def __init__(self, model: Any, device_room: int = 0) -> None:
            super().__init__(model, device_room)
            where.append(self.on_device)

    monkeypatch.setattr(buffers.SavedBuffers, "DEVICE_LIMIT", 0)
    monkeypatch.setattr(capture, "SavedBuffers", Recorded)
    cfg = config(rig, "full", mode="dynamo_trace_once", splitting_ops=None)
    module = CountsCalls().to(rig.device)
    runner = GraphRunner(ff.compile(module, cfg), cfg, inputs={"x": Tokens(3)},
                         device=rig.device, progress=False, capture_policy="lazy",
                         lazy_warmups=0)
    runner.capture()
    assert where == [False]  # capture(): the two probe steps, copies on the host
    out = rig.host(runner(torch.ones(2, 3, device=rig.device)))  # captures key 2 lazily
    assert where == [False, rig.backend == "cuda"]
    assert torch.equal(out, torch.full((2, 3), 3.0))  # the first real call: calls == 1
    assert rig.host(module.calls).item() == 1.0
