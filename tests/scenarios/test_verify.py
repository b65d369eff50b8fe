"""``GraphRunner(..., verify=N)``: the first N graph steps of each key are checked against the
uncompiled module run eagerly; a difference is a VerifyError naming the key and the output, and
the runner keeps serving with its state as the graph step left it. Every scenario runs on every
graph backend present (the ``rig`` fixture)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.errors import ConfigError, VerifyError
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.silly import attention
from tests.scenarios.conftest import Rig

OFFSET = [1.0]  # a Python value an op reads: a captured graph keeps the value it saw


@torch.library.custom_op("verifytest::shift", mutates_args=())
def shift(x: torch.Tensor) -> torch.Tensor:
    return x + OFFSET[0]


@shift.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)  # a buffer the step writes: checked and kept as the graph left it
        h = attention(self.lin(x), x, x)
        return torch.ops.verifytest.shift(h)


def _runner(rig: Rig, mode: str, **options: Any) -> tuple[Shifted, GraphRunner]:
    module = Shifted().to(rig.device)
    cfg = rig.config(mode, cudagraph_capture_sizes=[1, 2, 4], max_num_tokens=8)
    runner = GraphRunner(ff.compile(module, cfg), cfg, inputs={"x": Tokens(4)},
                         device=rig.device, progress=False, **options)
    runner.capture()
    return module, runner


@pytest.mark.parametrize("mode", ["full", "piecewise", "full_and_piecewise"])
def test_the_first_steps_of_each_key_are_checked_then_planned_steps_take_over(
        rig: Rig, mode: str) -> None:
    module, runner = _runner(rig, mode, verify=2)
    steps = float(module.steps)
    for n in (3, 3, 3, 1, 4, 3):
        x = rig.randn(n, 4)
        with torch.no_grad():
            want = rig.host(Shifted().to(rig.device)(x))
        torch.testing.assert_close(rig.host(runner(x)), want)
    # keys: 4 (sizes 3, 3, 3, 4, 3: checked twice) and 1 (once)
    assert runner.stats.get("verified_steps") == 3
    assert runner.stats.get("verify_mismatches") == 0
    # each step counted once: the eager run's write was undone, the graph step's kept
    assert float(module.steps) == steps + 6


def test_a_graph_that_no_longer_answers_like_eager_is_named(rig: Rig) -> None:
    module, runner = _runner(rig, "full", verify=1)
    x = rig.randn(3, 4)
    runner(rig.randn(1, 4))  # key 1 checked and found equal
    OFFSET[0] = 5.0  # the FULL graphs replay the 1.0 they captured; eager adds 5.0
    try:
        steps = float(module.steps)
        with pytest.raises(VerifyError, match=r"verify: the FULL graph step for "
                           r"BatchDescriptor\(num_tokens=4.*\) gave another answer than the "
                           r"module run eagerly on the same inputs: output differs from "
                           r"eager's by up to 4"):
            runner(x)
        assert float(module.steps) == steps + 1  # the graph step's state is kept
        assert runner.stats.get("verify_mismatches") == 1
        runner(x)  # the runner keeps serving (key 4 was checked once: verify=1)
    finally:
        OFFSET[0] = 1.0


@pytest.mark.parametrize(("options", "message"), [
    ({"verify": -1}, r"verify: expected the number of graph steps to check per key, an int "
                     r">= 0, got -1"),
    ({"verify": True}, r"verify: expected .* got True"),
    ({"verify": 1, "verify_tolerance": 2.0}, r"verify_tolerance: expected a relative tolerance "
                                             r"in \[0, 1\) or None"),
])
def test_bad_verify_options_are_refused_by_name(options: dict[str, Any], message: str) -> None:
    """The options are refused before any graph exists: no backend is involved, so this runs
    once, without the rig."""
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", cudagraph_mode="none")
    with pytest.raises(ConfigError, match=message):
        GraphRunner(ff.compile(Shifted(), cfg), cfg, inputs={"x": Tokens(4)}, **options)


class WritesInput(nn.Module):
    """Writes into its input, then reads it (issue 42 item 9a)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return attention(self.lin(x), x, x)


def _hooked_runner(rig: Rig, mode: str, module: nn.Module, verify: int
                   ) -> tuple[Any, GraphRunner]:
    cfg = rig.config(mode, cudagraph_capture_sizes=[1, 2, 4], max_num_tokens=8)
    model = ff.compile(module.to(rig.device), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(4)}, device=rig.device,
                         progress=False, verify=verify)
    runner.capture()
    return model, runner


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_verify_runs_the_reference_from_the_inputs_before_the_step(rig: Rig, mode: str) -> None:
    """The reference copied the inputs after the graph step had written them (x + 1 read as
    x + 2): a false mismatch on a correct step."""
    module = WritesInput()
    reference = WritesInput().to(rig.device)
    _, runner = _hooked_runner(rig, mode, module, verify=3)
    for step in range(4):
        x = rig.randn(3, 4, generator=torch.Generator().manual_seed(step))
        mine, theirs = x.clone(), x.clone()
        got = rig.host(runner(mine))
        with torch.no_grad():
            want = rig.host(reference(theirs))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(rig.host(mine), rig.host(theirs))  # written as eager does
    assert runner.stats.get("verified_steps") == 3
    assert runner.stats.get("verify_mismatches") == 0


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_verify_runs_the_models_hooks_in_the_reference(rig: Rig, mode: str) -> None:
    """The reference called the bare module, skipping the compiled model's hooks that the step
    runs (a pre-hook returning new inputs, a forward hook changing the output): a false
    mismatch on a correct step."""
    module = Shifted()
    model, runner = _hooked_runner(rig, mode, module, verify=2)
    model.register_forward_pre_hook(
        lambda m, args, kwargs: ((), {"x": (kwargs["x"] if "x" in kwargs else args[0]) * 2}),
        with_kwargs=True)
    model.register_forward_hook(lambda m, args, out: out + 10.0)
    for step in range(3):
        x = rig.randn(3, 4, generator=torch.Generator().manual_seed(step))
        got = rig.host(runner(x))
        with torch.no_grad():
            want = rig.host(module(x * 2)[:3] + 10.0)
        torch.testing.assert_close(got, want)
    assert runner.stats.get("verified_steps") == 2
    assert runner.stats.get("verify_mismatches") == 0


@dataclasses.dataclass
class _Pair:
    """A plain dataclass output (torch's pytree does not know it)."""

    hidden: torch.Tensor
    shifted: torch.Tensor


class PairOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> _Pair:
        h = attention(self.lin(x), x, x)
        return _Pair(h, torch.ops.verifytest.shift(h))


@pytest.mark.parametrize(("mode", "graphs"), [("piecewise", "full"),
                                              ("stock_torch_compile", "piecewise")])
def test_verify_compares_a_dataclass_output_field_by_field(rig: Rig, mode: str,
                                                           graphs: str) -> None:
    """Full seed 165 (breakable stock_torch_compile graphs): verify compared a @dataclass
    output as one value, with ==, and the step raised torch's "Boolean value of Tensor with
    more than one value is ambiguous". Its fields are compared now, a differing one named."""
    module = PairOut().to(rig.device)
    cfg = rig.config(graphs, mode=mode, cudagraph_capture_sizes=[1, 4], max_num_tokens=4)
    runner = GraphRunner(ff.compile(module, cfg), cfg, inputs={"x": Tokens(4)},
                         device=rig.device, progress=False, verify=1)
    runner.capture()
    x = rig.randn(3, 4)
    got = runner(x)
    with torch.no_grad():
        want = module(x)
    assert type(got) is _Pair
    torch.testing.assert_close(rig.host(got.shifted), rig.host(want.shifted))
    OFFSET[0] = 5.0  # the graphs replay the 1.0 they captured; eager adds 5.0
    try:
        with pytest.raises(VerifyError, match=r"output\.shifted differs from eager's by up to "
                                              r"4"):
            runner(rig.randn(1, 4))
    finally:
        OFFSET[0] = 1.0
    assert runner.stats.get("verified_steps") == 2
