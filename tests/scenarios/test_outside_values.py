"""Values forward reads that are neither arguments nor parameters, changed after capture.

A plain tensor attribute (``self.scale = torch.full(...)``, neither parameter nor buffer) is a
graph input like a parameter: replaced by another tensor of the same kind, every graph reading
the old one is dropped and captured again; another shape is refused by name. A module-level
global ``forward`` reads (a float, an attribute of a global object, a global tensor) is checked
on every call as Dynamo's guards would: a changed value is refused by name, an equal one or a
global tensor replaced by one of the same kind is served. Each through a plain call, the
low-level forward context and runner steps, planned (positional) and not (keyword).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.silly import attention
from tests.scenarios.conftest import Rig

SCALE = 2.0
CONSTS = types.SimpleNamespace(shift=0.5)
TABLE = torch.arange(4.0)


class Reader(nn.Module):
    """Reads a plain tensor attribute, a global float, a global object's field and a global
    tensor, around a splitting op."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.scale = torch.full((4,), 3.0)  # neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale
        h = attention(h, h, h)
        return h * SCALE + CONSTS.shift + TABLE


@pytest.fixture(autouse=True)
def _globals_restored() -> Any:
    global SCALE, TABLE
    yield
    SCALE, TABLE = 2.0, torch.arange(4.0)
    CONSTS.shift = 0.5


def _runner(rig: Rig, mode: str) -> tuple[Reader, Any, GraphRunner]:
    global TABLE
    TABLE = TABLE.to(rig.device)
    reader = Reader().to(rig.device)
    reader.scale = reader.scale.to(rig.device)
    cfg = rig.config(mode, cudagraph_capture_sizes=[1, 2, 4], max_num_tokens=8)
    model = ff.compile(reader, cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(4)}, device=rig.device,
                         progress=False)
    runner.capture()
    return reader, model, runner


def _eager(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(x)


def _steps(rig: Rig, runner: GraphRunner, reader: Reader, x: torch.Tensor) -> None:
    """A planned (positional) and an unplanned (keyword) step, each compared with eager."""
    for _ in range(2):
        torch.testing.assert_close(rig.host(runner(x)), rig.host(_eager(reader, x)))
    torch.testing.assert_close(rig.host(runner(x=x)), rig.host(_eager(reader, x)))


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_tensor_attribute_replaced_after_capture_is_read_anew(rig: Rig, mode: str) -> None:
    reader, model, runner = _runner(rig, mode)
    x = rig.randn(3, 4, generator=torch.Generator().manual_seed(1))
    _steps(rig, runner, reader, x)
    assert runner.planned_shapes == 1
    old = reader.scale
    reader.scale = torch.full((4,), -1.5, device=rig.device)
    _steps(rig, runner, reader, x)
    assert model.stats.get("graphs_dropped_weights") == 1
    assert runner.stats.get("recaptures") == 1
    assert torch.equal(rig.host(old), torch.full((4,), 3.0))  # never written into
    reader.scale = torch.ones(1, device=rig.device)  # another shape: the trace's code is not
    with pytest.raises(ff.CompileError, match=r"model\.scale was a torch\.float32 tensor of "
                                              r"shape \[4\] .* is a torch\.float32 tensor of "
                                              r"shape \[1\]"):
        runner(x)


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_changed_global_is_refused_and_an_equal_one_served(rig: Rig, mode: str) -> None:
    global SCALE
    reader, model, runner = _runner(rig, mode)
    x = rig.randn(3, 4, generator=torch.Generator().manual_seed(2))
    _steps(rig, runner, reader, x)
    SCALE = 3.0
    refusal = r"the global SCALE \(of module .*test_outside_values\), which forward reads, " \
              r"was 2\.0 at the trace and is 3\.0 now"
    with pytest.raises(ff.CompileError, match=refusal):
        runner(x)
    with pytest.raises(ff.CompileError, match=refusal):
        model(x)
    SCALE = float("2.0")  # another object of the same value
    _steps(rig, runner, reader, x)
    CONSTS.shift = 0.25  # a field of a global object, changed in place
    with pytest.raises(ff.CompileError, match=r"the global CONSTS\.shift .* was 0\.5 at the "
                                              r"trace and is 0\.25 now"):
        runner(x)
    CONSTS.shift = 0.5
    _steps(rig, runner, reader, x)
    assert model.stats.get("graphs_dropped_weights") == 0


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_global_tensor_replaced_drops_the_graphs(rig: Rig, mode: str) -> None:
    global TABLE
    reader, model, runner = _runner(rig, mode)
    x = rig.randn(3, 4, generator=torch.Generator().manual_seed(3))
    _steps(rig, runner, reader, x)
    TABLE = torch.full((4,), 9.0, device=rig.device)
    _steps(rig, runner, reader, x)
    assert model.stats.get("graphs_dropped_weights") == 1
    TABLE = torch.ones(2, 4, device=rig.device)
    with pytest.raises(ff.CompileError, match=r"the global TABLE .* was a torch\.float32 "
                                              r"tensor of shape \[4\] .* shape \[2, 4\]"):
        runner(x)


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_the_low_level_context_sees_outside_values(rig: Rig, mode: str) -> None:
    global SCALE
    reader = Reader().to(rig.device)
    reader.scale = reader.scale.to(rig.device)
    global TABLE
    TABLE = TABLE.to(rig.device)
    model = ff.compile(reader, rig.config(mode, cudagraph_capture_sizes=[4], max_num_tokens=8))
    graph_mode = ff.CUDAGraphMode.FULL if mode == "full" else ff.CUDAGraphMode.PIECEWISE
    x = rig.randn(4, 4, generator=torch.Generator().manual_seed(4))

    def step() -> torch.Tensor:
        with ff.forward_context(ff.BatchDescriptor(num_tokens=4), mode=graph_mode):
            return rig.host(model(x))

    for _ in range(3):  # trace, capture, replay
        step()
    reader.scale = torch.full((4,), 0.5, device=rig.device)
    torch.testing.assert_close(step(), rig.host(_eager(reader, x)))
    SCALE = 4.0
    with pytest.raises(ff.CompileError, match="the global SCALE"):
        step()


def test_debug_and_plain_calls_refuse_a_changed_global() -> None:
    global SCALE
    for debug in (False, True):
        SCALE = 2.0
        reader = Reader()
        model = ff.compile(reader, ff.CompilationConfig(
            mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
            cudagraph_mode="none", use_cache=False, debug=debug))
        x = torch.randn(3, 4)
        for _ in range(3):
            torch.testing.assert_close(model(x), _eager(reader, x))
        SCALE = 5.0
        with pytest.raises(ff.CompileError, match="the global SCALE"):
            model(x)


_OPS = torch.library.Library("ff_outside_test", "FRAGMENT")
_OPS.define("scaled(Tensor x) -> Tensor")
_OPS.define("scaled.by(Tensor x, float k) -> Tensor")
_OPS.impl("scaled", lambda x: x * 2, "CompositeExplicitAutograd")
_OPS.impl("scaled.by", lambda x, k: x * k, "CompositeExplicitAutograd")


class OpReader(nn.Module):
    """Calls a custom operator through the global ``torch`` (as the Llama calls its attention)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ff_outside_test.scaled(x) + 1


def test_a_torch_operator_forward_reads_is_the_same_after_its_overloads_are_used() -> None:
    """Found by the matrix (fast seed 8, the Llama): the operator packet forward reads through
    the global ``torch`` grows a cache as its overloads are first used; it was compared field
    by field, and the next call was refused as a changed global."""
    model = ff.compile(OpReader(), ff.CompilationConfig(  # debug: the full check every call
        mode="piecewise", backend="eager", cudagraph_mode="none", use_cache=False, debug=True))
    x = torch.arange(6.0).reshape(3, 2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), x * 2 + 1)
        torch.ops.ff_outside_test.scaled.by(x, 3.0)  # the packet resolves its other overload
        torch.ops.ff_outside_test.scaled.default._dispatch_cache.clear()  # and its cache moves
        torch.testing.assert_close(model(x), x * 2 + 1)
    assert model.stats.get("retraces") == 0
