"""Trace-once semantics (research notes §7.8), dynamic-dim inference and its errors."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.compilation.trace import resolve_dynamic_arg_dims


def config(mode, **changes):
    base = dict(mode=mode, backend="eager", cudagraph_mode="none", use_cache=False)
    base.update(changes)
    return ff.CompilationConfig(**base)


class BranchOnSize(nn.Module):
    """x * 2 for batches of 4 or more, else x * 100: tells which trace ran."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 4:
            return x * 2
        return x * 100


class TellsWhoRuns(nn.Module):
    """x * 2 when traced, x * 100 when the Python runs: tells whether Dynamo ran."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return x * 2
        return x * 100


X4 = torch.tensor([1.0, 2.0, 3.0, 4.0])
X3 = torch.tensor([1.0, 2.0, 3.0])


@pytest.mark.parametrize("mode", ["dynamo_trace_once", "piecewise"])
def test_second_size_reuses_the_first_trace(mode):
    model = ff.compile(TellsWhoRuns(), config(mode))
    assert isinstance(model, nn.Module)
    with model.stats.expect(graphs_traced=1, backend_compilations=1, retraces=0):
        assert model(X4).tolist() == [2, 4, 6, 8]
        # the Python forward would give [100, 200, 300]; the size-4 trace is reused
        assert model(X3).tolist() == [2, 4, 6]
        assert model(torch.ones(50)).tolist() == [2] * 50
    assert model.num_traces == 1


@pytest.mark.parametrize("mode", ["dynamo_trace_once", "piecewise"])
def test_a_branch_on_the_batch_size_traces_each_side_once_and_warns(mode):
    model = ff.compile(BranchOnSize(), config(mode))
    with pytest.warns(UserWarning, match=r"branches on a dynamic size \(x\.shape\[0\] >= 4") \
            as caught:
        assert model(X4).tolist() == [2, 4, 6, 8]
    assert [w.filename for w in caught] == [__file__]  # the user's line, not freezeframe's
    assert model.stats.size_branches == 1
    with pytest.warns(UserWarning, match=r"x\.shape\[0\] < 4"):
        assert model(X3).tolist() == [100, 200, 300]  # the other side, as eager
    with model.stats.expect(graphs_traced=0, retraces=0):
        assert model(torch.ones(2)).tolist() == [100, 100]
        assert model(torch.ones(50)).tolist() == [2] * 50
        assert model(torch.ones(1)).tolist() == [100]
    assert (model.num_traces, model.stats.retraces, model.stats.graphs_traced) == (2, 1, 2)


def test_hot_path_bypasses_dynamo():
    model = ff.compile(TellsWhoRuns(), config("dynamo_trace_once"))
    model(X4)
    assert model._variants[0].trace.uses_bytecode
    # Under force_eager, anything that still went through torch.compile would run the
    # original Python (x * 100); the captured bytecode does not consult Dynamo at all.
    with torch.compiler.set_stance("force_eager"):
        assert model(X3).tolist() == [2, 4, 6]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert model(torch.ones(7)).tolist() == [2] * 7
    assert model.stats.graphs_traced == 1


def test_stock_torch_compile_retraces():
    model = ff.compile(BranchOnSize(), config("stock_torch_compile"))
    assert model(X4).tolist() == [2, 4, 6, 8]
    assert model(X3).tolist() == [100, 200, 300]
    assert model.stats.graphs_traced == 2


def test_mode_none_is_the_module():
    model = ff.compile(BranchOnSize(), config("none"))
    assert model(X4).tolist() == [2, 4, 6, 8]
    assert model(X3).tolist() == [100, 200, 300]
    assert model.stats.snapshot() == {}
    assert model.pieces == []


class Affine(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(3) * scale)
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
        y = self.lin(x)
        return y if bias is None else y + bias


def test_two_instances_of_one_class_trace_separately():
    a = ff.compile(Affine(2.0), config("piecewise"))
    b = ff.compile(Affine(5.0), config("piecewise"))
    x = torch.ones(4, 3)
    assert torch.equal(a(x), 2 * x)
    assert torch.equal(b(x), 5 * x)
    assert torch.equal(a(x[:2]), 2 * x[:2])
    assert torch.equal(b(x[:3]), 5 * x[:3])
    assert a.stats.graphs_traced == 1 and b.stats.graphs_traced == 1


def test_parameters_are_read_at_call_time():
    inner = Affine(2.0)
    model = ff.compile(inner, config("piecewise"))
    x = torch.ones(4, 3)
    model(x)
    with torch.no_grad():
        inner.lin.weight.mul_(3)
    assert torch.equal(model(x[:2]), 6 * x[:2])


def test_keyword_arguments_and_optional_tensor():
    model = ff.compile(Affine(1.0), config("piecewise"))
    x = torch.ones(5, 3)
    assert torch.equal(model(x, bias=torch.ones(5, 3)), 2 * x)
    assert torch.equal(model(x[:2], bias=torch.ones(2, 3)), 2 * x[:2])


# -- dynamic dims -------------------------------------------------------------------------
def test_default_dims_from_annotations():
    class M(nn.Module):
        def forward(self, a: torch.Tensor, b: Optional[torch.Tensor], c: int,  # noqa: UP045
                    d: torch.Tensor | None = None):
            return a

    assert resolve_dynamic_arg_dims(M().forward, None) == {"a": (0,), "b": (0,), "d": (0,)}


def test_given_dims_are_normalised():
    assert resolve_dynamic_arg_dims(Affine(1.0).forward, {"x": 0, "bias": [0, -1]}) == {
        "x": (0,), "bias": (0, -1)}


def test_unannotated_tensor_arguments_vary_in_dim_0_by_default():
    """The README's contract: without dynamic_arg_dims, dim 0 of every tensor argument varies,
    annotated or not; a non-tensor value passed for an unannotated argument has nothing to
    mark."""
    class M(nn.Module):
        def forward(self, x, y, scale, n: int = 1):
            return x * scale + y

    assert resolve_dynamic_arg_dims(M().forward, None) == {"x": (0,), "y": (0,), "scale": (0,)}
    model = ff.compile(M(), config("piecewise"))
    for rows in (3, 5, 1, 8):
        x, y = torch.arange(rows * 2.0).reshape(rows, 2), torch.ones(rows, 2)
        assert torch.equal(model(x, y, 2.0), x * 2.0 + y)
    assert (model.num_traces, model.stats.retraces, model.stats.graphs_traced) == (1, 0, 1)


def test_only_non_tensor_annotations_is_an_error():
    class M(nn.Module):
        def forward(self, x: list, n: int):
            return x

    with pytest.raises(ff.ConfigError) as info:
        ff.compile(M(), config("piecewise"))
    assert str(info.value) == (
        f"dynamic_arg_dims: every argument of {M.forward.__qualname__} is annotated as something "
        "other than Tensor or Optional[Tensor] (arguments: ['x', 'n']), so no batch dimension "
        "can be inferred; annotate the tensor arguments as Tensor or pass "
        "dynamic_arg_dims={'x': 0}")
    ff.compile(M(), config("piecewise"), dynamic_arg_dims={"x": 0})  # explicit dims are fine


def test_unknown_argument_is_an_error():
    with pytest.raises(ff.ConfigError, match=r"'y' is not an argument of forward.*\['x', 'bias'\]"):
        ff.compile(Affine(1.0), config("piecewise"), dynamic_arg_dims={"y": 0})


def test_dim_out_of_bounds_is_an_error():
    model = ff.compile(Affine(1.0), config("piecewise"), dynamic_arg_dims={"x": 2})
    with pytest.raises(ff.ConfigError, match="dim 2 does not exist"):
        model(torch.ones(4, 3))


def test_not_a_module_or_config():
    with pytest.raises(ff.ConfigError, match=r"expected an nn\.Module"):
        ff.compile(lambda x: x, config("piecewise"))
    with pytest.raises(ff.ConfigError, match="expected a CompilationConfig"):
        ff.compile(Affine(1.0), {"mode": "piecewise"})


class Rowwise(nn.Module):
    """Reshapes through the batch dim, which a size-1 constant trace would bake in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.view(x.shape[0], 2, 3) * 3).reshape(x.shape[0], -1).sum(-1)


def test_first_call_of_size_one_traces_a_symbolic_batch():
    model = ff.compile(Rowwise(), config("piecewise"))
    one = torch.arange(6.0).reshape(1, 6)
    assert torch.equal(model(one), Rowwise()(one))
    assert model.stats.graphs_traced == 1
    for n in (2, 3, 7):                                  # one trace serves every later size
        x = torch.randn(n, 6)
        assert torch.allclose(model(x), Rowwise()(x))
    assert model.stats.graphs_traced == 1


def test_first_call_of_size_zero_is_an_error():
    model = ff.compile(BranchOnSize(), config("piecewise"))
    with pytest.raises(ff.CompileError, match="empty along its dynamic dim 0"):
        model(torch.ones(0))
    assert model.stats.graphs_traced == 0
    assert model(X4).tolist() == [2, 4, 6, 8]          # a proper first call still works


class _Validates(torch.nn.Module):
    """Raises its own error for a bad input, as user code validating its arguments does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != 4:
            raise ValueError(f"x must have 4 columns, got {x.shape[1]}")
        return x * 2


def test_an_exception_forward_raises_itself_reaches_the_caller_as_it_is() -> None:
    """Dynamo stops tracing at the raise; the caller gets forward's own ValueError (as from
    eager and from torch.compile), not a CompileError about tracing."""
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", splitting_ops=[],
                               cudagraph_mode="none")
    model = ff.compile(_Validates(), cfg)
    with pytest.raises(ValueError, match=r"^x must have 4 columns, got 3$"):
        model(torch.ones(2, 3))
    assert model.num_traces == 0
    assert torch.equal(model(torch.ones(2, 4)), torch.full((2, 4), 2.0))  # traces then
    assert model.num_traces == 1


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def test_many_compiled_models_of_a_class_leave_its_code_to_torch_compile() -> None:
    """Each trace used to leave a compiled entry on forward's code object, which every
    instance shares: after eight compiled models of a class, a plain torch.compile of the
    class hit Dynamo's recompile limit. Traces run over a private copy of the code."""
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", splitting_ops=[],
                               cudagraph_mode="none", use_cache=False)
    x = torch.randn(3, 4)
    for _ in range(10):
        model = ff.compile(_Small(), cfg)
        model(x)
    code = _Small.forward.__code__
    assert torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code) == []
    module = _Small()
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))
