"""The plans of GraphRunner steps (runtime/plan.py, runtime/steps.py), end to end: the first
step of a captured shape makes a plan, later steps of that shape stage new data and replay
without routing the call through the model (FULL) or run the piece chain without the model's
Python (PIECEWISE). A plan still refuses a changed module and inputs of another dtype or kind,
goes back through the model when its graphs were dropped, counts and answers as the whole way
does, rebuilds the output containers every step, and is never made (or is dropped) where a
step must run the model's Python or copy a written input back; padding rows hold their fill at
every step. Every scenario runs on every graph backend present (the ``rig`` fixture)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import CompilationConfig
from freezeframe.errors import InputMismatchError
from freezeframe.runtime import GraphRunner, Tokens
from freezeframe.runtime.plan import PieceReplays
from tests.helpers.silly import attention, get_counter, reset_counter
from tests.helpers.toy_models import KeepsLast, SillyModel
from tests.scenarios.conftest import Rig
from tests.scenarios.runners import SIZES, config, same


def traced_once_config(rig: Rig, graph_mode: str) -> CompilationConfig:
    """Traced once by Dynamo and not split: the whole forward in one graph."""
    return config(rig, graph_mode, mode="dynamo_trace_once", splitting_ops=None)


def randn(rig: Rig, n: int, seed: int) -> torch.Tensor:
    return rig.randn(n, 3, generator=torch.Generator().manual_seed(seed))


def full(rig: Rig, n: int, value: float) -> torch.Tensor:
    return torch.full((n, 3), value, device=rig.device)


def eager_silly(rig: Rig, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return SillyModel().to(rig.device)(x)


# -- the plan of a FULL step: made once per shape, then stage and replay ----------------------
def _full_runner(rig: Rig) -> tuple[ff.compilation.CompiledModel, GraphRunner]:
    cfg = config(rig, "full")
    model = ff.compile(SillyModel().to(rig.device), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False)
    runner.capture()
    return model, runner


def test_full_steps_of_a_captured_shape_replay_without_routing_the_call(rig: Rig) -> None:
    model, runner = _full_runner(rig)
    runner(full(rig, 3, 0.0))  # the first step of size 4 makes the plan
    signer = model._signer
    assert signer is not None

    def no_routing(*args: Any) -> Any:
        raise AssertionError("a planned FULL step routed its call through the model")

    signer.key = no_routing  # type: ignore[method-assign, assignment]
    for n, seed in ((3, 1), (4, 2), (3, 3)):
        x = randn(rig, n, seed)
        with model.stats.expect(replays=1, graphs_captured=0):
            out = rig.host(runner(x))
        assert torch.equal(out, rig.host(eager_silly(rig, x)))


def test_a_planned_full_step_still_refuses_a_changed_module(rig: Rig) -> None:
    model, runner = _full_runner(rig)
    runner(full(rig, 3, 0.0))
    # the train/eval flag: the trace baked the old state (an attribute forward never reads
    # may change, issue 42)
    model.module.train(not model.module.training)
    with pytest.raises(ff.CompileError, match="the module changed after its first call"):
        runner(full(rig, 3, 0.0))


def test_a_planned_full_step_whose_graph_was_dropped_goes_back_through_the_model(
        rig: Rig) -> None:
    model, runner = _full_runner(rig)
    x = full(rig, 3, 1.0)
    assert torch.equal(rig.host(runner(x)), torch.full((3, 3), 28.0))
    for wrapper in model.graph_wrappers():
        wrapper.clear()
    with pytest.raises(ff.CaptureError, match="capture window is closed"):
        runner(x)  # the plan's graph is gone; the model may not capture during serving
    with model.capture_window.opened(), model.stats.expect(graphs_captured=1, replays=0):
        assert torch.equal(rig.host(runner(x)), torch.full((3, 3), 28.0))
    with model.stats.expect(graphs_captured=0, replays=1):
        assert torch.equal(rig.host(runner(2 * x)), torch.full((3, 3), 37.0))
    # each step counted once, the one whose plan went stale too
    assert (runner.stats.steps, runner.size_histogram) == (4, {3: 4})


def test_planned_steps_count_and_answer_as_the_first_step_of_their_shape_did(rig: Rig) -> None:
    """Steps of a planned shape (plan.py) stage new data every time and are counted
    exactly as steps that take the whole way."""
    model, runner = _full_runner(rig)
    for step, n in enumerate([3, 3, 4, 3, 1, 3, 8, 3]):
        x = randn(rig, n, step)
        padded = next(s for s in SIZES if s >= n)
        with runner.stats.expect(steps=1, steps_full=1, padded_tokens=padded - n), \
                model.stats.expect(replays=1, graphs_captured=0):
            out = rig.host(runner(x))
        assert torch.equal(out, rig.host(eager_silly(rig, x))), (step, n)
    # the counters read the same through every view of them
    snap = runner.stats.snapshot()
    assert (snap["steps"], runner.stats.steps, runner.stats["steps_full"]) == (8, 8, 8)
    assert snap["padded_tokens"] == runner.stats.get("padded_tokens") == 5  # five 3s padded to 4


def test_a_planned_shape_still_refuses_inputs_of_another_dtype_or_kind(rig: Rig) -> None:
    _, runner = _full_runner(rig)
    x = full(rig, 3, 1.0)
    runner(x)
    runner(x)  # planned now
    with pytest.raises(InputMismatchError, match=r"input 'x': expected dtype torch.float32, "
                       r"got torch.float64"):
        runner(x.double())
    with pytest.raises(InputMismatchError, match=r"expected a torch\.Tensor, got ndarray"):
        runner(rig.host(x).numpy())  # type: ignore[arg-type]
    assert torch.equal(rig.host(runner(x)), torch.full((3, 3), 28.0))  # the plan still serves


def test_planned_steps_by_name_and_with_copied_outputs(rig: Rig) -> None:
    cfg = config(rig, "full")
    model = ff.compile(SillyModel().to(rig.device), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, copy_outputs=True,
                         device=rig.device, progress=False)
    runner.capture()
    first = runner(full(rig, 3, 1.0))
    second = runner(full(rig, 3, 0.0))  # planned: a copy, not the static output again
    third = runner(x=full(rig, 3, 2.0))  # by name: the whole way, same answer
    assert torch.equal(rig.host(first), torch.full((3, 3), 28.0))
    assert torch.equal(rig.host(second), torch.full((3, 3), 19.0))
    assert torch.equal(rig.host(third), torch.full((3, 3), 37.0))
    assert model.stats.replays == 3


# -- the plan of a PIECEWISE step: the piece chain without the model's Python ----------------
def _piecewise_runner(rig: Rig, module: nn.Module | None = None,
                      **kw: Any) -> tuple[ff.compilation.CompiledModel, GraphRunner]:
    cfg = config(rig, "piecewise")
    module = module if module is not None else SillyModel()
    model = ff.compile(module.to(rig.device), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False, **kw)
    runner.capture()
    return model, runner


def test_planned_piecewise_steps_replay_the_pieces_and_call_the_ops(rig: Rig) -> None:
    model, runner = _piecewise_runner(rig)
    runner(full(rig, 3, 0.0))  # the first step of each input shape makes its plan
    runner(full(rig, 4, 0.0))
    signer = model._signer
    assert signer is not None

    def no_routing(*args: Any) -> Any:
        raise AssertionError("a planned PIECEWISE step routed its call through the model")

    signer.key = no_routing  # type: ignore[method-assign, assignment]
    for step, n in enumerate([3, 4, 3, 3]):
        x = randn(rig, n, step)
        reset_counter()
        with runner.stats.expect(steps=1, steps_piecewise=1, padded_tokens=4 - n), \
                model.stats.expect(replays=3, graphs_captured=0):
            out = rig.host(runner(x))
        assert get_counter() == 2  # both silly::attention calls ran, between the pieces
        assert torch.equal(out, rig.host(eager_silly(rig, x))), step


def test_a_planned_piecewise_step_still_refuses_a_changed_module(rig: Rig) -> None:
    model, runner = _piecewise_runner(rig)
    runner(full(rig, 3, 0.0))
    model.module.train(not model.module.training)  # (the trace baked the old flag)
    with pytest.raises(ff.CompileError, match="the module changed after its first call"):
        runner(full(rig, 3, 0.0))


def test_a_planned_piecewise_step_whose_graphs_were_dropped_goes_back_through_the_model(
        rig: Rig) -> None:
    model, runner = _piecewise_runner(rig)
    x = full(rig, 3, 1.0)
    assert torch.equal(rig.host(runner(x)), torch.full((3, 3), 28.0))
    for wrapper in model.graph_wrappers():
        wrapper.clear()
    reset_counter()
    with pytest.raises(ff.CaptureError, match="capture window is closed"):
        runner(x)
    assert get_counter() == 0  # the plan noticed before running any op
    with model.capture_window.opened(), model.stats.expect(graphs_captured=3):
        assert torch.equal(rig.host(runner(x)), torch.full((3, 3), 28.0))
    with model.stats.expect(graphs_captured=0, replays=3):
        assert torch.equal(rig.host(runner(2 * x)), torch.full((3, 3), 37.0))


class DictOut(nn.Module):
    """A dict output with a constant beside the tensors: the plan rebuilds it every step."""

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = attention(x + 1, x, x)
        return {"h": h * 2, "tag": 7, "x2": x * 2}


def test_a_planned_piecewise_step_rebuilds_the_output_structure(rig: Rig) -> None:
    _, runner = _piecewise_runner(rig, DictOut())
    for step, n in enumerate([3, 3, 2, 3]):
        x = randn(rig, n, step)
        out = runner(x)
        with torch.no_grad():
            want = DictOut()(x)
        assert out.keys() == want.keys() and out["tag"] == 7
        assert same(rig, out["h"], want["h"]) and same(rig, out["x2"], want["x2"]), step


def test_a_forward_with_a_python_side_effect_is_not_planned(rig: Rig) -> None:
    module = KeepsLast()
    _, runner = _piecewise_runner(rig, module)
    for n in (3, 3, 3):
        x = full(rig, n, float(n))
        out = rig.host(runner(x))
        assert torch.equal(out, rig.host(3 * x + 1))
        assert module.last is not None and torch.equal(rig.host(module.last[:n]),
                                                       rig.host(3 * x + 1))
    assert runner.planned_shapes == 0


class WritesInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        x.add_(1)
        return out


def test_a_model_that_writes_its_input_copies_it_back_at_every_step(rig: Rig) -> None:
    """Its capture saw the write, so its steps are never planned: each copies the real rows
    back, as eager would have written them."""
    cfg = traced_once_config(rig, "full")
    runner = GraphRunner(ff.compile(WritesInput(), cfg), cfg, inputs={"x": Tokens()},
                         device=rig.device, progress=False)
    runner.capture()
    for _ in range(4):
        x = torch.ones(3, device=rig.device)
        with runner.stats.expect(inputs_copied_back=1, steps_full=1):
            assert torch.equal(rig.host(runner(x)), torch.full((3,), 2.0))
        assert torch.equal(rig.host(x), torch.full((3,), 2.0))


class TwoOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"a": x * 2, "b": [x + 1, x - 1]}


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_planned_step_returns_new_containers_the_caller_may_change(rig: Rig,
                                                                    mode: str) -> None:
    """A caller that pops a key from one step's dict (or appends to its list) does not find
    the next step's output changed: every step builds its containers anew, planned or not."""
    cfg = config(rig, mode)
    runner = GraphRunner(ff.compile(TwoOutputs(), cfg), cfg, inputs={"x": Tokens(3)},
                         device=rig.device, progress=False)
    runner.capture()
    for step in range(4):
        x = full(rig, 3, float(step))
        out = runner(x)
        assert sorted(out) == ["a", "b"] and len(out["b"]) == 2, step
        assert same(rig, out["a"], 2 * x) and same(rig, out["b"][1], x - 1), step
        out.pop("a")
        out["b"].append(out["b"][0])
    assert runner.planned_shapes == 1  # the later steps were planned


def test_a_planned_step_that_sees_an_input_written_finishes_the_whole_way(rig: Rig) -> None:
    """The guard behind a PIECEWISE plan (its splitting ops run their Python every step):
    should a planned step move an input buffer's version counter after all, the step copies
    the write back and the plan is dropped."""
    _, runner = _piecewise_runner(rig)
    runner(full(rig, 3, 1.0))
    runner(full(rig, 3, 1.0))
    plans = runner._stepper.plans  # (a fault injected into the one plan)
    (key, plan), = plans.items()
    assert isinstance(plan.work, PieceReplays)
    chain = plan.work.chain

    class Writes:
        replays = chain.replays

        def __call__(self) -> Any:
            out = chain()
            runner.buffers["x"][:3].add_(1)
            return out

    plans[key] = dataclasses.replace(plan, work=PieceReplays(Writes()))
    x = full(rig, 3, 1.0)
    with runner.stats.expect(inputs_copied_back=1, steps_piecewise=1):
        assert torch.equal(rig.host(runner(x)), torch.full((3, 3), 28.0))
    assert torch.equal(rig.host(x), torch.full((3, 3), 2.0))
    assert key not in plans
    x = full(rig, 3, 1.0)
    # planned again, from scratch
    assert torch.equal(rig.host(runner(x)), torch.full((3, 3), 28.0))
    assert torch.equal(rig.host(x), torch.ones(3, 3))


def test_planned_steps_reset_the_padding_an_earlier_shape_wrote(rig: Rig) -> None:
    """A planned step skips resetting its padding only while its shape was the last one
    staged: a larger step in between wrote those rows, and the next planned step of the
    smaller shape fills them again (the model reads every row, padding included)."""
    _, runner = _full_runner(rig)
    runner(full(rig, 3, 1.0))
    runner(full(rig, 3, 1.0))  # planned: 3 rows padded to 4
    assert runner.planned_shapes == 1
    for step, n in enumerate([3, 4, 3, 3, 2, 3, 8, 3]):
        x = randn(rig, n, step)
        out = rig.host(runner(x))
        assert torch.equal(out, rig.host(eager_silly(rig, x))), (step, n)
        pad = next(s for s in SIZES if s >= n)
        assert torch.equal(rig.host(runner.buffers["x"][n:pad]), torch.zeros(pad - n, 3)), \
            (step, n)


class ReadsPadding(nn.Module):
    """Every row gets the sum over all rows the model sees, padding included, then the model
    writes into its input (padding included): the runner must hand it padding rows that hold
    the fill value at every step, whatever earlier steps (or the model) left there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + x.sum()
        x.add_(1)
        return out


@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_padding_rows_hold_the_fill_at_every_step(rig: Rig, graph_mode: str) -> None:
    cfg = traced_once_config(rig, graph_mode)
    model = ff.compile(ReadsPadding(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens()}, device=rig.device,
                         progress=False)
    runner.capture()
    eager = ReadsPadding()
    # the first two steps: the model's write into the padding row must be reset before the
    # second; then a larger step leaves rows behind that smaller ones must not see
    for step, n in enumerate([3, 3, 7, 3, 3, 1, 3, 8, 2, 3, 3]):
        mine = torch.arange(1.0, n + 1, device=rig.device) * (step + 1)
        theirs = mine.clone()
        with torch.no_grad():
            want = rig.host(eager(theirs))
        assert torch.equal(rig.host(runner(mine)), want), (step, n)
        # the write reached the caller's rows only
        assert torch.equal(rig.host(mine), rig.host(theirs)), (step, n)


def test_piecewise_steps_are_planned_when_the_trace_came_from_the_cache(
        rig: Rig, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm start (the trace loaded from the compile cache, so Dynamo never ran) plans its
    PIECEWISE steps as a cold one does (the bench found 3 of 6 rows planned on a warm cache)."""
    monkeypatch.delenv("FREEZEFRAME_DISABLE_CACHE")
    cfg = config(rig, "piecewise", use_cache=True, cache_dir=str(tmp_path / "cache"),
                 cudagraph_capture_sizes=[4])
    planned = []
    for start in ("cold", "warm"):
        model = ff.compile(SillyModel().to(rig.device), cfg)
        runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                             progress=False)
        runner.capture()
        assert model.stats.get("traces_loaded") == (start == "warm")
        for step in range(3):
            x = randn(rig, 3, step)
            assert torch.equal(rig.host(runner(x)), rig.host(eager_silly(rig, x)))
        planned.append(runner.stats.get("steps_planned"))
    assert planned == [2, 2]  # every step after the first of its shape ran from the plan


def _keeps_last_runner(rig: Rig, policy: str) -> tuple[KeepsLast, Any, GraphRunner]:
    module = KeepsLast().to(rig.device)
    cfg = config(rig, "full")
    model = ff.compile(module, cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False, capture_policy=policy)
    runner.capture()
    return module, model, runner


def test_a_full_replay_repeats_forwards_store_after_a_plain_call(rig: Rig) -> None:
    """Found by the matrix (stored_output_rebound): a FULL graph holds Dynamo's code, its
    ``self.last = out`` included, but a replay ran kernels only: after a plain call between
    runner steps, planned or not, ``model.last`` kept the plain call's output."""
    module, model, runner = _keeps_last_runner(rig, "eager")
    assert tuple(module.last.shape) == (1,)  # capture()'s dummy steps left nothing there
    for n in (3, 3, 5, 3):
        x = full(rig, n, float(n))
        out = runner(x)
        assert same(rig, out, 3 * x + 1)
        assert tuple(module.last.shape) == (4 if n == 3 else 8, 3)  # the padded batch's
        assert same(rig, module.last[:n], 3 * x + 1)
        model(full(rig, 2, 7.0))  # a plain call stores its own
        assert same(rig, module.last, full(rig, 2, 22.0))
    assert runner.stats.steps_planned == 2


def test_a_background_capture_leaves_the_steps_stored_output(rig: Rig) -> None:
    """Found by the matrix (capture_writes_attributes): the background capture's dummy steps
    ran forward after a user step, and its ``self.last = out`` left a dummy step's output
    there; the capture now puts back every attribute its dummy steps bound."""
    module, _, runner = _keeps_last_runner(rig, "background")
    x = full(rig, 3, 3.0)
    assert same(rig, runner(x), 3 * x + 1)
    runner.wait_for_capture()
    assert tuple(module.last.shape)[1:] == (3,) and module.last.shape[0] in (3, 4)
    assert same(rig, module.last[:3], 3 * x + 1)
    # put back once by the first two dummy steps (capture()), once per key by the thread
    assert runner.stats.attributes_restored == 1 + len(SIZES)
