"""A compiled model calls its traced graph without Dynamo's bytecode from the trace's second
call on (compilation/direct_call.py), and only where that does exactly what the bytecode did:
same inputs bound (a replaced parameter read anew), same return structure, no Python side
effect skipped."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from tests.helpers.silly import attention
from tests.helpers.toy_models import KeepsLast, LlamaConfig, ToyLlama

MODES = ["dynamo_trace_once", "piecewise"]


def config(mode: str) -> ff.CompilationConfig:
    return ff.CompilationConfig(mode=mode, backend="eager", cudagraph_mode="none",
                                splitting_ops=["silly::attention"] if mode == "piecewise"
                                else None, use_cache=False)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 3.0

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                flip: bool = False) -> dict[str, Any]:
        h = attention(self.lin(x), x, x)
        if bias is not None:
            h = h + bias
        if flip:
            h = -h
        return {"h": h * self.scale, "parts": (h, x.sum(dim=-1)), "tag": "net"}


def _direct(model: ff.compilation.CompiledModel) -> int:
    """How many of the model's traces call their graph directly."""
    return sum(v.direct is not None for v in model._variants)


def _no_bytecode(model: ff.compilation.CompiledModel) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the call went through Dynamo's bytecode")

    for variant in model._variants:
        variant.trace._fast = refuse


def _same(a: Any, b: Any) -> None:
    assert a.keys() == b.keys() and a["tag"] == b["tag"] == "net"
    torch.testing.assert_close(a["h"], b["h"], rtol=0, atol=0)
    for got, want in zip(a["parts"], b["parts"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_later_calls_skip_the_bytecode_and_answer_as_eager(mode: str) -> None:
    module = Net()
    model = ff.compile(module, config(mode))
    with torch.no_grad():
        for n in (5, 3):  # the first call traces, the second builds the direct call
            model(torch.randn(n, 4))
        assert _direct(model) == 1
        _no_bytecode(model)
        for n in (2, 7, 5):
            x = torch.randn(n, 4)
            _same(model(x), module(x))


def test_keyword_and_default_arguments_are_bound_as_the_frame_binds_them() -> None:
    module = Net()
    model = ff.compile(module, config("piecewise"))
    with torch.no_grad():
        for n in (5, 3):
            model(torch.randn(n, 4), bias=torch.randn(n, 4), flip=True)
        _no_bytecode(model)
        x, bias = torch.randn(6, 4), torch.randn(6, 4)
        _same(model(x, bias, True), module(x, bias, True))
        _same(model(x, flip=True, bias=bias), module(x, bias=bias, flip=True))


def test_a_replaced_parameter_is_read_anew_on_every_direct_call() -> None:
    module = Net()
    model = ff.compile(module, config("piecewise"))
    with torch.no_grad():
        model(torch.randn(5, 4))
        model(torch.randn(3, 4))
        _no_bytecode(model)
        module.lin.weight = nn.Parameter(torch.randn(4, 4))
        x = torch.randn(4, 4)
        _same(model(x), module(x))
        module.lin.bias.add_(1.0)  # in place, as an optimizer step would
        _same(model(x), module(x))


def test_a_forward_with_a_python_side_effect_keeps_its_bytecode() -> None:
    module = KeepsLast()
    model = ff.compile(module, config("piecewise"))
    with torch.no_grad():
        for n in (3, 4, 5, 6):
            x = torch.randn(n)
            out = model(x)
            torch.testing.assert_close(out, 3 * x + 1, rtol=0, atol=0)
            assert module.last is out  # the store ran on this call too
    assert _direct(model) == 0


class ReturnsInput(nn.Module):
    """Returns its own argument beside a graph output: not a graph output, so the return
    value cannot be rebuilt from the graph's outputs alone, and the bytecode stays."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return attention(x, x, x) * 2, x


def test_a_return_value_that_is_not_a_graph_output_keeps_the_bytecode() -> None:
    model = ff.compile(ReturnsInput(), config("piecewise"))
    with torch.no_grad():
        for n in (3, 4, 5):
            x = torch.randn(n)
            out, same = model(x)
            assert same is x
            torch.testing.assert_close(out, 6 * x, rtol=0, atol=0)
    assert _direct(model) == 0


def test_the_toy_llama_calls_directly_and_matches_eager() -> None:
    module = ToyLlama(LlamaConfig(num_layers=2))
    model = ff.compile(module, config("piecewise"))
    with torch.no_grad():
        for n in (5, 3):
            model(torch.randint(0, 128, (n,)), torch.arange(n))
        assert _direct(model) == 1
        _no_bytecode(model)
        for n in (1, 8, 4):
            ids, pos = torch.randint(0, 128, (n,)), torch.arange(n)
            torch.testing.assert_close(model(ids, pos), module(ids, pos), rtol=0, atol=0)


def test_a_number_computed_from_a_size_is_returned_fresh() -> None:
    class Counts(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, bool, float]:
            n = x.shape[0]
            return attention(x, x, x), n, n > 5, n / 2

    module = Counts()
    for mode in MODES:
        model = ff.compile(module, config(mode))
        with torch.no_grad():
            for n in (4, 4, 4, 8, 3, 8):
                out = model(torch.randn(n, 4))
                assert out[1:] == (n, n > 5, n / 2)
