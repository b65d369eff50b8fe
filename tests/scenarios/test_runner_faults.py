"""Fault injection for GraphRunner: an exception raised by the model at warm-up, at capture, at
replay and inside a micro-batched step. After each, the same runner and a fresh one must give
eager's outputs, and no global state may be left behind (dispatch modes, the garbage collector,
the forward context, grad mode, torch's compile stance, micro-batch threads). Every scenario runs
on every graph backend present (the ``rig`` fixture)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import CompilationConfig
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.faults import (
    FAULT_TYPES,
    FAULTS,
    HIDDEN,
    ClosureForwardModel,
    FaultyModel,
    InjectedFault,
    _assert_clean,
    rig_inputs,
)
from tests.scenarios.conftest import Rig

pytestmark = pytest.mark.usefixtures("faults_disarmed")
inputs = rig_inputs


def eager(rig: Rig, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return FaultyModel().to(rig.device)(x)


def same(rig: Rig, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of host copies (a replayed output is overwritten by the next replay)."""
    return torch.equal(rig.host(a), rig.host(b))


# -- without micro-batching: warm-up, capture, replay ---------------------------------------------
SIZES = [1, 2, 4, 8]


def _config(rig: Rig, **kw: Any) -> CompilationConfig:
    fields: dict[str, Any] = dict(
        splitting_ops=["fffaults::comm"], cudagraph_capture_sizes=SIZES, max_num_tokens=12,
        max_num_seqs=12)
    fields.update(kw)
    mode = fields.pop("cudagraph_mode", "full_and_piecewise")
    return rig.config(mode, **fields)


def _runner(rig: Rig, model: nn.Module, cfg: CompilationConfig) -> GraphRunner:
    return GraphRunner(model, cfg, inputs={"x": Tokens(HIDDEN)}, device=rig.device,
                       progress=False)


def _check_steps(rig: Rig, runner: GraphRunner, seed: int) -> None:
    """Mixed steps (PIECEWISE), uniform decode steps (FULL) and too-large steps (eager)."""
    for n, uniform in ((3, False), (8, True), (1, True), (5, False), (12, False)):
        x = inputs(rig, n, seed=seed + n)
        assert same(rig, runner(x, uniform_decode=uniform), eager(rig, x)), (n, uniform)


# the graphs a full capture stores in the model's wrappers: 2 capturable pieces x 4 sizes
# (PIECEWISE) + 4 FULL graphs
MODEL_GRAPHS = 2 * 4 + 4


@pytest.mark.parametrize("phase", ["trace", "warmup", "capture"])
@pytest.mark.parametrize("warmups", [0, 2])
def test_a_failed_capture_leaves_no_trace_and_a_retry_captures_everything(
        rig: Rig, clean: dict[str, Any], phase: str, warmups: int) -> None:
    """``trace`` fails the first warm-up while Dynamo traces it; for ``warmup`` and ``capture``
    the model made its first call before the runner existed."""
    frozen_before = gc.get_freeze_count()
    cfg = _config(rig, cudagraph_num_of_warmups=warmups)
    model = ff.compile(FaultyModel().to(rig.device), cfg)
    if phase != "trace":
        model(inputs(rig, 5, seed=0))
    runner = _runner(rig, model, cfg)
    FAULTS.armed = phase
    with pytest.raises(FAULT_TYPES, match=f"injected at {phase}"):
        runner.capture()
    assert FAULTS.fired == [phase]
    _assert_clean(frozen_before, clean)
    assert runner.report is None and runner.stats.capture_failures == 1
    assert not model.capture_window.is_open
    assert [w.captured_descriptors for w in model.graph_wrappers()] == (
        [[]] if phase == "trace" else [[], [], []])  # a failed trace built no pieces

    # a fresh runner's capture is the yardstick: the retry warms up and captures as it does
    fresh_cfg = _config(rig, cudagraph_num_of_warmups=warmups)
    fresh = _runner(rig, ff.compile(FaultyModel().to(rig.device), fresh_cfg), fresh_cfg)
    fresh.capture()
    with model.stats.expect(graphs_captured=MODEL_GRAPHS), \
            runner.stats.expect(warmups=fresh.stats.warmups, captures=8):
        report = runner.capture()
    assert report.num_graphs == 8
    with model.stats.expect(graphs_captured=0):
        _check_steps(rig, runner, seed=100)
    _check_steps(rig, fresh, seed=200)
    _assert_clean(frozen_before, clean)


@pytest.mark.parametrize(("phase", "tokens", "uniform"),
                         [("replay", 3, False), ("eager", 12, False)])
def test_a_fault_in_a_step_leaves_the_runner_working(rig: Rig, clean: dict[str, Any],
                                                     phase: str, tokens: int,
                                                     uniform: bool) -> None:
    """A mixed step replays PIECEWISE graphs around the faulty splitting op, which runs
    eagerly between them; a 12-token step runs without graphs."""
    frozen_before = gc.get_freeze_count()
    cfg = _config(rig)
    model = ff.compile(FaultyModel().to(rig.device), cfg)
    runner = _runner(rig, model, cfg)
    runner.capture()
    FAULTS.armed = phase
    with pytest.raises(InjectedFault, match=f"injected at {phase}"):
        runner(inputs(rig, tokens, seed=1), uniform_decode=uniform)
    assert FAULTS.fired == [phase]
    _assert_clean(frozen_before, clean)
    with model.stats.expect(graphs_captured=0):
        _check_steps(rig, runner, seed=300)
    fresh = _runner(rig, ff.compile(FaultyModel().to(rig.device), cfg), cfg)
    fresh.capture()
    _check_steps(rig, fresh, seed=400)
    _assert_clean(frozen_before, clean)


# -- micro-batched ---------------------------------------------------------------------------------
def _ubatch_config(rig: Rig, **kw: Any) -> CompilationConfig:
    """FULL graphs of 8 tokens captured split in two; 9..16-token steps run split and eager."""
    fields: dict[str, Any] = dict(
        mode="dynamo_trace_once", backend="eager", cudagraph_mode="full",
        graph_backend=rig.backend, cudagraph_capture_sizes=[8], max_num_tokens=16,
        max_num_seqs=16, micro_batching=True, micro_batch_decode_threshold=2,
        micro_batch_prefill_threshold=2, use_cache=False)
    fields.update(kw)
    return CompilationConfig(**fields)


def _ubatch_runner(rig: Rig, model: nn.Module, cfg: CompilationConfig) -> GraphRunner:
    runner = _runner(rig, model, cfg)
    assert runner.micro_batches is not None
    runner.micro_batches.timeout_s = 60
    return runner


def _check_ubatch_steps(rig: Rig, runner: GraphRunner, model: Any, seed: int) -> None:
    """7 and 8 tokens replay the split graph, 3 tokens cannot be split (eager, unsplit), 12
    tokens are above the capture size (eager, split)."""
    with model.stats.expect(replays=2, graphs_captured=0, micro_batch_fallbacks=1,
                            micro_batched_steps=3):
        for n in (7, 8, 3, 12):
            x = inputs(rig, n, seed=seed + n)
            assert same(rig, runner(x), eager(rig, x)), n


@pytest.mark.parametrize("phase", ["trace", "micro_batch_capture"])
def test_a_failed_micro_batched_capture_leaves_no_trace(rig: Rig, clean: dict[str, Any],
                                                        phase: str) -> None:
    """``trace`` fails the first call (the priming warm-up, unsplit) while Dynamo traces it,
    ``micro_batch_capture`` one micro-batch thread inside the split capture. The retried
    capture must store the split graph."""
    frozen_before = gc.get_freeze_count()
    cfg = _ubatch_config(rig)
    model = ff.compile(FaultyModel().to(rig.device), cfg)
    runner = _ubatch_runner(rig, model, cfg)
    FAULTS.armed = phase
    with pytest.raises(FAULT_TYPES, match=f"injected at {phase}"):
        runner.capture()
    assert FAULTS.fired == [phase]
    _assert_clean(frozen_before, clean)
    assert runner.report is None and runner.micro_batches is not None
    assert runner.micro_batches.captured_descriptors == []
    assert not model.capture_window.is_open

    # the priming warm-up runs split once the model has traced (the failed attempt's did)
    split_warmups = 0 if phase == "trace" else 1
    with model.stats.expect(graphs_captured=1, micro_batched_steps=1 + split_warmups):
        assert runner.capture().num_graphs == 1
    assert [d.num_tokens for d in runner.micro_batches.captured_descriptors] == [8]
    _check_ubatch_steps(rig, runner, model, seed=500)
    fresh = _ubatch_runner(rig, ff.compile(FaultyModel().to(rig.device), cfg), cfg)
    fresh.capture()
    _check_ubatch_steps(rig, fresh, fresh.model, seed=600)
    _assert_clean(frozen_before, clean)


def test_a_fault_in_a_micro_batched_step_leaves_the_runner_working(
        rig: Rig, clean: dict[str, Any]) -> None:
    frozen_before = gc.get_freeze_count()
    cfg = _ubatch_config(rig)
    model = ff.compile(FaultyModel().to(rig.device), cfg)
    runner = _ubatch_runner(rig, model, cfg)
    runner.capture()
    FAULTS.armed = "micro_batch_eager"
    with pytest.raises(InjectedFault, match="injected at micro_batch_eager"):
        runner(inputs(rig, 12, seed=3))
    _assert_clean(frozen_before, clean)
    _check_ubatch_steps(rig, runner, model, seed=700)
    _assert_clean(frozen_before, clean)


def test_micro_batch_threads_leave_the_compile_stance_alone(rig: Rig) -> None:
    """A compiled model whose bytecode cannot be reused runs each call under torch's
    process-wide ``fail_on_recompile`` stance. Micro-batch threads enter and leave that stance
    interleaved; after the step it must be what it was, or an unrelated ``ff.compile`` in the
    same process fails its first call."""
    from torch._dynamo import eval_frame

    cfg = _ubatch_config(rig)
    model = ff.compile(ClosureForwardModel().to(rig.device), cfg)
    runner = _ubatch_runner(rig, model, cfg)
    FAULTS.armed = "micro_batch_capture"
    with pytest.raises(InjectedFault):
        runner.capture()
    assert eval_frame._stance.stance == "default"
    runner.capture()
    assert eval_frame._stance.stance == "default"
    _check_ubatch_steps(rig, runner, model, seed=800)
    assert eval_frame._stance.stance == "default"

    other = ff.compile(FaultyModel().to(rig.device), _config(rig, cudagraph_mode="none"))
    x = inputs(rig, 5, seed=9)
    assert same(rig, other(x), eager(rig, x))


class WritesThenFails(nn.Module):
    """Writes into its input (``x += 1``) before the faulty op, as a model updating a cache does
    before a later layer fails."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = FaultyModel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return self.inner(x)


def test_a_write_made_before_the_step_raised_reaches_the_caller(rig: Rig) -> None:
    """Eager leaves ``x`` incremented when the step raises after the write; the runner ran the
    step on its static copy, so it copies that write back before the exception leaves."""
    cfg = _config(rig)
    runner = _runner(rig, ff.compile(WritesThenFails().to(rig.device), cfg), cfg)
    runner.capture()
    x = inputs(rig, 12, seed=3)  # beyond the largest captured size: an eager step
    before = x.clone()
    FAULTS.armed = "eager"
    with pytest.raises(InjectedFault):
        runner(x)
    assert FAULTS.fired == ["eager"]
    assert torch.equal(rig.host(x), rig.host(before + 1))
    y = inputs(rig, 12, seed=4)
    want = eager(rig, y + 1)
    assert same(rig, runner(y), want)
    assert torch.equal(rig.host(y), rig.host(inputs(rig, 12, seed=4) + 1))
