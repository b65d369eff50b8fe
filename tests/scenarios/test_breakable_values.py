"""Python values a graph without a trace reads (modes NONE and STOCK_TORCH_COMPILE): issue 42
item 3. A breakable or FULL graph replays the Python of its capture, so every Python value a
segment reads is keyed on (a float or int argument: graphs of their own per value, refused past
the limit) or re-captured when it changes (a class attribute, an attribute, a global of the
model's file); never replayed stale. Each on every graph backend present (``rig``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.config import CUDAGraphMode
from freezeframe.context import forward_context
from freezeframe.runtime import Tokens
from tests.helpers import silly  # noqa: F401  (registers silly::attention)
from tests.scenarios.conftest import Rig

GAIN = 1.0


class Diffusion(nn.Module):
    """Reads a float argument, a class attribute, an attribute and a global in Python."""

    SHIFT = 1.0

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.bias = 0.0

    def forward(self, x: torch.Tensor, t: float = 1.0) -> torch.Tensor:
        h = self.lin(x) * t + self.SHIFT + self.bias + GAIN
        out = torch.empty_like(h)
        torch.ops.silly.attention(h, h, h, out)
        return out


@pytest.fixture(autouse=True)
def _restored() -> Any:
    global GAIN
    yield
    GAIN = 1.0
    Diffusion.SHIFT = 1.0


def _config(rig: Rig, mode: str, graphs: str) -> ff.CompilationConfig:
    return rig.config(graphs, mode=mode, cudagraph_capture_sizes=[2, 4], max_num_tokens=4)


def _eager(module: nn.Module, *args: Any) -> torch.Tensor:
    with torch.no_grad():
        return module(*args)


def _stepper(rig: Rig, mode: str, graphs: str) -> tuple[Diffusion, Any, Any, torch.Tensor]:
    module = Diffusion().to(rig.device)
    model = ff.compile(module, _config(rig, mode, graphs))
    runtime = CUDAGraphMode.PIECEWISE if graphs == "piecewise" else CUDAGraphMode.FULL
    x = rig.randn(4, 4, generator=torch.Generator().manual_seed(1))

    def step(t: float) -> torch.Tensor:
        with forward_context(BatchDescriptor(4), mode=runtime):
            return rig.host(model(x, t))

    return module, model, step, x


@pytest.mark.parametrize("graphs", ["piecewise", "full"])
def test_a_float_argument_gets_graphs_per_value_through_the_forward_context(
        rig: Rig, graphs: str) -> None:
    module, model, step, x = _stepper(rig, "none", graphs)
    for t in (0.5, 0.5, 0.5, 0.25, 0.25, 0.5, 0.25):  # warm-up, capture, replays
        torch.testing.assert_close(step(t), rig.host(_eager(module, x, t)))
    assert model.stats.get("graph_sets_for_values") == 2
    for t in (0.1, 0.2, 0.3, 0.4, 0.6, 0.7):  # up to the limit of 8 sets
        torch.testing.assert_close(step(t), rig.host(_eager(module, x, t)))
    with pytest.raises(ff.CompileError, match=r"argument 1=0\.8 .* above the limit of 8.*"
                                              r"as a tensor"):
        step(0.8)
    torch.testing.assert_close(step(0.5), rig.host(_eager(module, x, 0.5)))


def test_stock_torch_compile_serves_a_changed_float_argument(rig: Rig) -> None:
    """Once the value changes, torch.compile passes the float to its graph as an input (a
    tensor read back with .item()), which a capture would freeze: the graph is specialised on
    the value instead, so torch.compile compiles again per value and every step answers (it
    was refused before, naming the argument)."""
    module, model, step, x = _stepper(rig, "stock_torch_compile", "piecewise")
    for t in (0.5, 0.5, 0.5, 0.25, 0.25, 0.75, 0.5, 0.75):
        torch.testing.assert_close(step(t), rig.host(_eager(module, x, t)))
    # (0.25 and 0.75: torch.compile made t an input of their graphs, specialised on its value)
    assert model.stats.get("scalar_inputs_specialised") == 2


@pytest.mark.parametrize(("mode", "graphs"), [("none", "piecewise"),
                                             ("stock_torch_compile", "piecewise")])
def test_python_state_changed_after_capture_is_captured_again(rig: Rig, mode: str,
                                                              graphs: str) -> None:
    """A class attribute, an attribute (read by forward or not) and a global of the model's
    file, changed after the capture: each drops the graphs, which are captured again running
    the new Python; the runner captures its keys again. Never the capture's value."""
    global GAIN
    module = Diffusion().to(rig.device)
    cfg = _config(rig, mode, graphs)
    model = ff.compile(module, cfg)
    runner = ff.GraphRunner(model, cfg, inputs={"x": Tokens(4)}, progress=False,
                            device=rig.device)
    runner.capture()
    x = rig.randn(3, 4, generator=torch.Generator().manual_seed(2))
    changes = [lambda: setattr(Diffusion, "SHIFT", 2.5), lambda: setattr(module, "bias", -1.0),
               lambda: setattr(module, "unread", "anything")]
    for change in changes:
        for _ in range(2):
            torch.testing.assert_close(rig.host(runner(x)), rig.host(_eager(module, x)))
        change()
    torch.testing.assert_close(rig.host(runner(x)), rig.host(_eager(module, x)))
    GAIN = 3.0
    changes.append(lambda: None)
    torch.testing.assert_close(rig.host(runner(x)), rig.host(_eager(module, x)))
    assert model.stats.get("graphs_dropped_module_changed") == len(changes)
    assert runner.stats.get("recaptures") == len(changes)


def test_stock_torch_compile_serves_a_changed_class_float(rig: Rig) -> None:
    """torch.compile recompiles for a changed float class attribute with the float as an
    input of the new graph (a tensor read back by .item()), which a capture would freeze: the
    graph is specialised on it, and the runner's graphs captured again answer (refused by
    name before)."""
    module = Diffusion().to(rig.device)
    cfg = _config(rig, "stock_torch_compile", "piecewise")
    model = ff.compile(module, cfg)
    runner = ff.GraphRunner(model, cfg, inputs={"x": Tokens(4)}, progress=False,
                            device=rig.device)
    runner.capture()
    x = rig.randn(3, 4, generator=torch.Generator().manual_seed(2))
    for shift in (1.0, 2.5, 2.5, 4.0):
        Diffusion.SHIFT = shift
        torch.testing.assert_close(rig.host(runner(x)), rig.host(_eager(module, x)))
    # 2.5 and 4.0, each in the graph of the capture's keyword call and of the steps'
    # positional one (torch.compile guards on the spelling)
    assert model.stats.get("scalar_inputs_specialised") == 4
