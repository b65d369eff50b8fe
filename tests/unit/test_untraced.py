"""Modes NONE and STOCK_TORCH_COMPILE (no trace): hooks on the module run as in eager, a graph
capture of a forward that sets module attributes is refused, and stock compiles leave nothing
on the class's ``forward``. Every answer is compared with eager, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.config import CUDAGraphMode
from freezeframe.context import forward_context
from freezeframe.errors import CaptureError

MODES = ["none", "stock_torch_compile"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x)) * 2.0


class KeepsLast(Net):
    def __init__(self) -> None:
        super().__init__()
        self.last = torch.zeros(1, 4)  # (a tensor attribute may hold another tensor later)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.last = out
        return out


def _config(mode: str, cudagraph_mode: str = "none", **changes: Any) -> ff.CompilationConfig:
    return ff.CompilationConfig(mode=mode, backend="eager", cudagraph_mode=cudagraph_mode,
                                graph_backend="emulated", cudagraph_capture_sizes=[2, 4],
                                use_cache=False, **changes)


def _eager(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return module(x)


def _add_one(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 3.0 + 1.0


def _negate_input(module: nn.Module, args: Any) -> tuple[torch.Tensor, ...]:
    return (-args[0],)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- hooks on the module itself, and hooks added later ---------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_a_hook_on_the_module_itself_runs_as_in_eager(mode: str) -> None:
    torch.manual_seed(0)
    module = Net()
    model = ff.compile(module, _config(mode))
    x = torch.randn(3, 4)
    assert torch.equal(model(x), _eager(module, x))
    handle = module.register_forward_hook(_add_one)
    pre = module.register_forward_pre_hook(_negate_input)
    for n in (3, 5):
        x = torch.randn(n, 4)
        assert torch.equal(model(x), _eager(module, x))
    handle.remove()
    pre.remove()
    x = torch.randn(6, 4)
    assert torch.equal(model(x), _eager(module, x))


@pytest.mark.parametrize("mode", MODES)
def test_a_hook_registered_on_the_module_before_the_first_call_runs(mode: str) -> None:
    torch.manual_seed(1)
    module = Net()
    module.register_forward_hook(_add_one)
    model = ff.compile(module, _config(mode))
    x = torch.randn(3, 4)
    assert torch.equal(model(x), _eager(module, x))


@pytest.mark.parametrize("mode", MODES)
def test_a_hook_added_to_a_submodule_after_the_first_call_runs(mode: str) -> None:
    torch.manual_seed(2)
    module = Net()
    model = ff.compile(module, _config(mode))
    x = torch.randn(4, 4)
    assert torch.equal(model(x), _eager(module, x))
    handle = module.block.register_forward_hook(_add_one)
    assert torch.equal(model(x), _eager(module, x))
    if mode == "stock_torch_compile":  # Dynamo does not guard an empty hook dict
        assert model.stats.stock_recompiles_for_hooks == 1
    handle.remove()  # (a dict Dynamo guards)
    assert torch.equal(model(x), _eager(module, x))
    torch.ones(1, requires_grad=True).register_hook(lambda g: g)  # moves the handle counter
    assert torch.equal(model(x), _eager(module, x))
    if mode == "stock_torch_compile":
        assert model.stats.stock_recompiles_for_hooks == 1


# -- a forward that sets module attributes under graphs -----------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("graph_mode", ["full", "piecewise"])
def test_a_capture_of_a_forward_that_stores_its_output_is_refused(mode: str,
                                                                  graph_mode: str) -> None:
    """A replay does not run forward's Python: ``self.last`` would keep an older call's
    tensor. The capture is refused by name, and the attribute is put back."""
    torch.manual_seed(3)
    module = KeepsLast()
    changes = {"splitting_ops": []} if graph_mode == "piecewise" else {}
    model = ff.compile(module, _config(mode, graph_mode, **changes))
    runtime = CUDAGraphMode.FULL if graph_mode == "full" else CUDAGraphMode.PIECEWISE
    x = torch.randn(10, 4)
    assert torch.equal(model(x), _eager(module, x))  # no forward context: eager, stores
    kept = module.last
    with pytest.raises(CaptureError, match=r"self\.last.*buffer"), \
            forward_context(BatchDescriptor(4), mode=runtime):
        model(torch.randn(4, 4))
    assert module.last is kept  # put back as it was before the refused call
    assert model.stats.graphs_captured == 0
    y = torch.randn(4, 4)
    assert torch.equal(model(y), _eager(module, y))
    assert torch.equal(module.last, _eager(module, y))


@pytest.mark.parametrize("mode", MODES)
def test_a_submodule_counter_set_during_capture_is_refused_and_put_back(mode: str) -> None:
    class Counts(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x)

    module = Net()
    module.block = Counts()
    model = ff.compile(module, _config(mode, "full"))
    with pytest.raises(CaptureError, match=r"self\.block\.calls"), \
            forward_context(BatchDescriptor(2), mode=CUDAGraphMode.FULL):
        model(torch.randn(2, 4))
    assert not hasattr(module.block, "calls")


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_that_leaves_its_attributes_alone_is_captured_and_replayed(mode: str) -> None:
    torch.manual_seed(4)
    module = Net()
    model = ff.compile(module, _config(mode, "full"))
    for _ in range(3):
        x = torch.randn(4, 4)
        with forward_context(BatchDescriptor(4), mode=CUDAGraphMode.FULL):
            got = model(x).clone()
        assert torch.equal(got, _eager(module, x))
    assert model.stats.graphs_captured == 1


# -- nothing left on the class's forward --------------------------------------------------------
def test_stock_torch_compile_instances_leave_the_class_forward_alone() -> None:
    x = torch.randn(3, 4)
    for i in range(10):
        module = Net()
        model = ff.compile(module, _config("stock_torch_compile"), inference_mode=False)
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                y = torch.randn(3 + i, 4)
                assert torch.equal(model(y), module(y))
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    assert entries(Net.forward.__code__) == []
    module = Net()
    with torch.no_grad():
        assert torch.equal(torch.compile(module, fullgraph=True, backend="eager")(x), module(x))
