"""Parameters and buffers replaced, moved or set to None after graphs were captured.

A captured graph reads every parameter and buffer at the address it had at capture (a CUDA
graph bakes the address in; the emulated backend replays on the captured tensors). So a change
between steps must never be served from the old graphs: a tensor replaced by another of the
same kind drops every graph, and the next step captures again (``stats.graphs_dropped_weights``,
the runner's ``stats.recaptures``); a change the trace cannot serve (another dtype, a tensor set
to None, a buffer registered after the trace) is a ``CompileError`` naming it. The old tensor is
never written into. Every scenario runs on every graph backend present.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.silly import attention
from tests.scenarios.conftest import Rig

MODES = ["full", "piecewise", "full_and_piecewise"]


class Block(nn.Module):
    """Two linear layers around a splitting op, and a buffer added to the output."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 4)
        self.register_buffer("shift", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = attention(h, h, h)
        return self.lin2(torch.relu(h)) + self.shift


def _runner(rig: Rig, mode: str) -> tuple[Block, Any, GraphRunner]:
    block = Block().to(rig.device)
    cfg = rig.config(mode, cudagraph_capture_sizes=[1, 2, 4], max_num_tokens=8)
    model = ff.compile(block, cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(4)}, device=rig.device,
                         progress=False)
    runner.capture()
    return block, model, runner


def _eager(block: Block, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x)


def _new(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(like, value)


CHANGES: dict[str, Callable[[Block], None]] = {
    "parameter replaced": lambda b: setattr(b.lin2, "weight", nn.Parameter(_new(
        b.lin2.weight, 0.5))),
    "buffer replaced": lambda b: setattr(b, "shift", _new(b.shift, 7.0)),
    "bias replaced": lambda b: setattr(b.lin, "bias", nn.Parameter(_new(b.lin.bias, -2.0))),
    "load_state_dict(assign=True)": lambda b: b.load_state_dict(
        {k: _new(v, 0.25) for k, v in b.state_dict().items()}, assign=True),
    "p.data = new memory": lambda b: setattr(b.lin2.weight, "data",
                                             _new(b.lin2.weight, -1.5)),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("mode", MODES)
def test_a_replaced_tensor_drops_the_graphs_and_steps_match_eager(rig: Rig, mode: str,
                                                                  change: str) -> None:
    block, model, runner = _runner(rig, mode)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(rig.device)
    for _ in range(3):  # the shape's plan is made and used
        torch.testing.assert_close(rig.host(runner(x)), rig.host(_eager(block, x)))
    old = block.lin2.weight
    old_values = old.detach().clone()
    recaptures = runner.stats.get("recaptures")
    CHANGES[change](block)
    for n in (3, 4, 1):
        xn = torch.randn(n, 4, generator=torch.Generator().manual_seed(n)).to(rig.device)
        torch.testing.assert_close(rig.host(runner(xn)), rig.host(_eager(block, xn)))
    assert runner.stats.get("recaptures") == recaptures + 1
    assert model.stats.get("graphs_dropped_weights") == 1
    if change != "p.data = new memory":  # (that one replaces the memory of the old object)
        assert torch.equal(old.detach(), old_values)  # the swapped-out weight is untouched


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_the_low_level_path_captures_again_after_a_replaced_weight(rig: Rig,
                                                                   mode: str) -> None:
    block = Block().to(rig.device)
    cfg = rig.config(mode, cudagraph_capture_sizes=[4], max_num_tokens=8)
    model = ff.compile(block, cfg)
    graph_mode = ff.CUDAGraphMode.FULL if mode == "full" else ff.CUDAGraphMode.PIECEWISE
    x = rig.zeros(4, 4) + 1.0

    def step() -> torch.Tensor:
        with ff.forward_context(ff.BatchDescriptor(num_tokens=4), mode=graph_mode):
            return rig.host(model(x))

    step()
    step()  # captures (after the first call traced)
    step()
    block.lin.weight = nn.Parameter(_new(block.lin.weight, 3.0))
    torch.testing.assert_close(step(), rig.host(_eager(block, x)))
    assert model.stats.get("graphs_dropped_weights") == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_change_the_trace_cannot_serve_is_refused_by_name(rig: Rig, mode: str) -> None:
    _, _, runner = _runner(rig, mode)
    x = rig.zeros(3, 4)
    runner(x)
    block = runner.model.module
    block.lin.bias = None
    with pytest.raises(ff.CompileError, match=r"model\.lin\.bias was a torch\.float32 "
                       r"tensor of shape \[4\] on .* at the trace and is None now"):
        runner(x)


def test_a_dtype_change_of_the_module_is_refused_not_replayed(rig: Rig) -> None:
    _, _, runner = _runner(rig, "full")
    x = rig.zeros(3, 4)
    runner(x)
    runner.model.module.to(torch.float64)
    with pytest.raises(ff.CompileError, match=r"was a torch\.float32 tensor .* and is a "
                                              r"torch\.float64 tensor"):
        runner(x)


def test_a_buffer_registered_after_the_trace_is_refused(rig: Rig) -> None:
    _, _, runner = _runner(rig, "piecewise")
    x = rig.zeros(3, 4)
    runner(x)
    runner.model.module.lin.register_buffer("scale", torch.ones(1))
    with pytest.raises(ff.CompileError, match=r"model\.lin\.scale was registered as a "
                                              r"parameter or buffer after the trace"):
        runner(x)


@pytest.mark.parametrize("mode", MODES)
def test_hooks_on_the_compiled_model_run_on_every_runner_step(rig: Rig, mode: str) -> None:
    _, model, runner = _runner(rig, mode)
    x = rig.zeros(3, 4)
    for _ in range(3):
        runner(x)  # planned
    seen: list[tuple[int, ...]] = []
    handle = model.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    for _ in range(3):
        runner(x)
    assert seen == [(4, 4)] * 3  # the padded step, as the model returned it
    handle.remove()
    runner(x)
    assert len(seen) == 3


@pytest.mark.parametrize("in_place", [False, True], ids=["new_inputs", "written_then_new"])
@pytest.mark.parametrize("mode", MODES)
def test_a_pre_hook_returning_new_inputs_never_writes_the_callers_input(
        rig: Rig, mode: str, in_place: bool) -> None:
    """Found by the matrix (pre_hook_inputs_written_back): the replay copied the hook's new
    inputs into the runner's buffers, and the step took that copy for a write of the model and
    copied it back into the caller's tensor. Only what eager writes reaches it: nothing, or
    (``in_place``) the hook's own in-place write."""
    block, model, runner = _runner(rig, mode)

    def halve(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = kwargs["x"] if "x" in kwargs else args[0]  # (the runner passes it by name)
        if in_place:
            x.mul_(2.0)
        return (), {"x": x * 0.5}

    torch.manual_seed(1)
    x = torch.randn(3, 4, device=rig.device)
    runner(x.clone())  # planned before the hook
    model.register_forward_pre_hook(halve, with_kwargs=True)
    reference = Block()
    reference.load_state_dict(block.state_dict())
    reference.to(rig.device).register_forward_pre_hook(halve, with_kwargs=True)
    for _ in range(3):
        mine, theirs = x.clone(), x.clone()
        got = runner(mine)
        want = _eager(reference, theirs)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    torch.testing.assert_close(mine, x * 2.0 if in_place else x, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_pre_hook_on_the_low_level_path_never_writes_the_callers_input(
        rig: Rig, mode: str) -> None:
    """Found by the matrix (pre_hook_low_level): in a forward context, a pre-hook returning
    new inputs made the replay copy them into the captured tensor, which on the low-level
    path is the caller's own input: it changed, where eagerly it does not."""
    block = Block().to(rig.device)
    model = ff.compile(block, rig.config(mode, cudagraph_capture_sizes=[4], max_num_tokens=4))
    reference = Block()
    reference.load_state_dict(block.state_dict())
    reference.to(rig.device)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2)).to(rig.device)
    with ff.forward_context(4, mode):
        model(x)  # captured reading x
    before = rig.host(x)
    for m in (model, reference):
        m.register_forward_pre_hook(lambda _, args: (args[0] * 0.5,))
    for _ in range(2):
        with ff.forward_context(4, mode):
            got = rig.host(model(x))
        torch.testing.assert_close(got, rig.host(_eager(reference, x)), rtol=1e-6, atol=1e-6)
        assert torch.equal(rig.host(x), before)


@pytest.mark.parametrize("mode", MODES)
def test_each_answer_is_its_own_tensor_object(rig: Rig, mode: str) -> None:
    """An in-place change of one answer's metadata (``y.t_()``) must not reach the next."""
    _, _, runner = _runner(rig, mode)
    x = rig.zeros(3, 4)
    answers = [runner(x) for _ in range(4)]
    assert len({id(a) for a in answers}) == 4
    with torch.inference_mode():
        answers[-1].t_()
    assert tuple(runner(x).shape) == (3, 4)
