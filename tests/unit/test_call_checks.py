"""Every call of a compiled model is checked against what its trace assumed (issue: never a
wrong answer). A new call structure gets its own trace; an input error raises and says what to
do; nothing is ever silently served by a trace made for something else."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.compilation.routing import MAX_TRACES
from freezeframe.compilation.signature import CallSignature, Signer, difference
from freezeframe.errors import CompileError, InputMismatchError
from tests.helpers.toy_models import LlamaConfig, ToyLlama

MODES = ["dynamo_trace_once", "piecewise"]


def config(mode: str = "piecewise", **changes: object) -> ff.CompilationConfig:
    base: dict[str, object] = dict(mode=mode, backend="eager", cudagraph_mode="none",
                                   use_cache=False)
    base.update(changes)
    return ff.CompilationConfig(**base)


class OptionalBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        if bias is not None:
            y = y + bias
        return y * 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("first_with_bias", [False, True])
def test_optional_argument_none_then_tensor_traces_each_structure(mode, first_with_bias):
    torch.manual_seed(0)
    eager = OptionalBias()
    model = ff.compile(eager, config(mode))
    x, bias = torch.randn(3, 4), torch.randn(3, 4)
    calls = [((x, bias), {}), ((x,), {})] if first_with_bias else [((x,), {}), ((x, bias), {})]
    calls += [((torch.randn(5, 4),), {}), ((torch.randn(6, 4),), {"bias": torch.randn(6, 4)})]
    for args, kwargs in calls:
        torch.testing.assert_close(model(*args, **kwargs), eager(*args, **kwargs))
    assert (model.num_traces, model.stats.retraces, model.stats.graphs_traced) == (2, 1, 2)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


@pytest.mark.parametrize("mode", MODES)
def test_another_dtype_is_a_clear_error_not_garbage(mode):
    model = ff.compile(Scale(), config(mode))
    model(torch.ones(2, 3))
    with pytest.raises(InputMismatchError,
                       match=r"argument 'x' is torch.float64, but the model was traced with "
                             r"torch.float32; pass x.to\(torch.float32\)"):
        model(torch.ones(2, 3, dtype=torch.float64))
    assert model.stats.graphs_traced == 1


@pytest.mark.parametrize("bad, message", [
    (torch.ones(2, 3, 1), r"argument 'x' has 3 dims, but the model was traced with 2"),
    (torch.ones(2, 5), r"argument 'x' has size 5 in dim 1, but dim 1 was fixed at 3 when the "
                       r"model was traced \(only dims \[0\] of 'x' vary between calls\); if dim "
                       r"1 should vary, pass dynamic_arg_dims=\{'x': \[0, 1\]\} to ff.compile"),
    ([[1.0, 2.0, 3.0]], r"argument 'x' is a list \(a list \(the float 1\.0; the float 2\.0; "
                        r"the float 3\.0\)\), but the model was traced with a "
                        r"torch.float32 tensor on cpu of shape \(\*, 3\), contiguous; pass a "
                        r"tensor"),
    (torch.ones(2, 3, device="meta"), r"argument 'x' is on meta, but the model was traced "
                                      r"with it on cpu; move it with x.to\('cpu'\)"),
])
def test_wrong_rank_size_type_or_device_names_the_argument_and_the_fix(bad, message):
    model = ff.compile(Scale(), config())
    model(torch.ones(4, 3))
    with pytest.raises(InputMismatchError, match=message):
        model(bad)
    torch.testing.assert_close(model(torch.ones(2, 3)), torch.tensor([[1.0, 2.0, 3.0]] * 2))


class MulInPlaceThenAdd(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x + y


@pytest.mark.parametrize("mode", MODES)
def test_aliased_arguments_get_their_own_trace(mode):
    model = ff.compile(MulInPlaceThenAdd(), config(mode))
    a, b = torch.ones(3), torch.ones(3)
    assert model(a, b).tolist() == [3.0, 3.0, 3.0]
    c = torch.ones(4)
    assert model(c, c).tolist() == [4.0] * 4  # eager: x and y are one tensor, 2 + 2
    assert c.tolist() == [2.0] * 4
    assert model.stats.retraces == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_transposed_input_gets_its_own_trace(mode):
    class RowSums(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.cumsum(1) * 2

    eager = RowSums()
    model = ff.compile(eager, config(mode))
    x = torch.arange(12.0).reshape(4, 3)
    torch.testing.assert_close(model(x), eager(x))
    t = torch.arange(12.0).reshape(3, 4).t()  # (4, 3), strides (1, 4)
    torch.testing.assert_close(model(t), eager(t))
    assert model.stats.retraces == 1


class ScaleBy(nn.Module):
    def forward(self, x: torch.Tensor, factor: int) -> torch.Tensor:
        return x * factor


def test_a_python_scalar_is_part_of_the_structure_and_traces_are_bounded():
    model = ff.compile(ScaleBy(), config())
    x = torch.ones(2)
    for factor in range(1, MAX_TRACES + 1):
        assert model(x, factor).tolist() == [float(factor)] * 2
    assert model(torch.ones(3), 3).tolist() == [3.0] * 3  # an old structure: no new trace
    assert model.num_traces == MAX_TRACES
    with pytest.raises(CompileError, match=r"trace number 9, above the limit of 8.*factor=the "
                                           r"int 9.*pass values that change per call"):
        model(x, MAX_TRACES + 1)


def test_positional_and_keyword_spellings_share_one_trace():
    model = ff.compile(ScaleBy(), config())
    assert model(torch.ones(2), 3).tolist() == [3.0, 3.0]
    assert model(torch.ones(2), factor=3).tolist() == [3.0, 3.0]
    assert model(x=torch.ones(4), factor=3).tolist() == [3.0] * 4
    assert model.num_traces == 1


def test_dynamic_sizes_the_trace_found_equal_must_stay_equal():
    model = ff.compile(ToyLlama(LlamaConfig(num_layers=1)),
                       config(splitting_ops=["silly::attention"]))
    ids = torch.randint(0, 128, (6,))
    model(ids, torch.arange(6))
    with pytest.raises(InputMismatchError, match=r"argument 'input_ids' has 6 along dim 0 but "
                                                  r"argument 'positions' has 5 along dim 0"):
        model(ids, torch.arange(5))


class FirstCallSize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1) @ x.t()


@pytest.mark.parametrize("mode", MODES)
def test_a_first_call_of_one_row_serves_every_size(mode):
    eager = FirstCallSize()
    model = ff.compile(eager, config(mode))
    for n in (1, 2, 5, 1, 7):
        x = torch.randn(n, 4)
        torch.testing.assert_close(model(x), eager(x))


# -- autograd and inference mode -------------------------------------------------------------
def graphs_config(cudagraph_mode: str) -> ff.CompilationConfig:
    return config("piecewise", cudagraph_mode=cudagraph_mode, graph_backend="emulated",
                  splitting_ops=["silly::attention"], cudagraph_capture_sizes=[1, 2, 4],
                  max_num_tokens=4)


@pytest.mark.parametrize("graph_mode", ["piecewise", "full", "full_and_piecewise"])
def test_graph_capture_works_without_no_grad(graph_mode):
    eager = ToyLlama(LlamaConfig(num_layers=2, init_value=0.01))
    model = ff.compile(eager, graphs_config(graph_mode))
    ids, pos = torch.randint(0, 128, (4,)), torch.arange(4)
    mode = ff.CUDAGraphMode.FULL if graph_mode == "full" else ff.CUDAGraphMode.PIECEWISE
    model(ids, pos)  # the trace, autograd on
    with (model.stats.expect(graphs_captured=1 if graph_mode == "full" else 3),
          ff.forward_context(4, mode=mode)):
        model(ids, pos)  # capture, autograd on
    new_ids = torch.randint(0, 128, (4,))
    ids.copy_(new_ids)
    with ff.forward_context(4, mode=mode):
        out = model(ids, pos)  # replay outside inference mode
    with torch.no_grad():
        torch.testing.assert_close(out, eager(new_ids, pos))


@pytest.mark.parametrize("graph_mode", ["piecewise", "full_and_piecewise"])
def test_captured_inside_inference_mode_then_called_outside(graph_mode):
    eager = ToyLlama(LlamaConfig(num_layers=2, init_value=0.01))
    model = ff.compile(eager, graphs_config(graph_mode))
    ids, pos = torch.randint(0, 128, (4,)), torch.arange(4)
    with torch.inference_mode():
        model(ids, pos)
        with ff.forward_context(4, mode=ff.CUDAGraphMode.PIECEWISE):
            model(ids, pos)
    with ff.forward_context(4, mode=ff.CUDAGraphMode.PIECEWISE):
        out = model(ids, pos)
    with torch.no_grad():
        torch.testing.assert_close(out, eager(ids, pos))


def test_the_very_first_call_inside_a_full_forward_context():
    eager = ToyLlama(LlamaConfig(num_layers=2, init_value=0.01))
    model = ff.compile(eager, graphs_config("full"))
    ids, pos = torch.randint(0, 128, (2,)), torch.arange(2)
    with torch.no_grad():
        expected = eager(ids, pos)
    with (model.stats.expect(graphs_traced=1, graphs_captured=0),
          ff.forward_context(2, mode=ff.CUDAGraphMode.FULL)):
        torch.testing.assert_close(model(ids, pos), expected)  # traced, not captured
    with model.stats.expect(graphs_captured=1, replays=1):
        for _ in range(2):  # captures, then replays
            with ff.forward_context(2, mode=ff.CUDAGraphMode.FULL):
                torch.testing.assert_close(model(ids, pos), expected)


def test_inference_mode_false_keeps_autograd():
    eager = Scale()
    model = ff.compile(eager, config(), inference_mode=False)
    x = torch.ones(2, 3, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [[1.0, 2.0, 3.0]] * 2
    with torch.no_grad():
        assert not model(torch.ones(2, 3)).requires_grad  # another autograd mode: its own trace
    assert model.stats.retraces == 1


def grad_after_a_no_grad_call(backend: str) -> None:
    """inference_mode=False: a first call under no_grad, then one with grad on (another trace)
    must answer as eager does: the output requires grad, the values and the parameters'
    gradients are eager's."""
    torch.manual_seed(0)
    mine, eager = RowNorm(), RowNorm()
    eager.load_state_dict(mine.state_dict())
    model = ff.compile(mine, config(backend=backend), inference_mode=False)
    with torch.no_grad():
        x = torch.randn(3, 8)
        torch.testing.assert_close(model(x), eager(x))
    x = torch.randn(5, 8)
    got, want = model(x), eager(x)
    assert got.requires_grad and want.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    want.sum().backward()
    for p, q in zip(mine.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


def test_a_call_with_grad_after_a_no_grad_call_keeps_autograd():
    """The eager compiler's sibling of the Inductor test (test_inductor_paths.py), where the
    no_grad trace's compiled pieces were reused for the grad trace."""
    grad_after_a_no_grad_call("eager")


def test_outputs_are_inference_tensors_by_default():
    model = ff.compile(Scale(), config())
    assert model(torch.ones(2, 3)).is_inference()


# -- Dynamo disabled ---------------------------------------------------------------------------
def test_dynamo_disabled_runs_eagerly_warns_once_and_counts():
    # torch's own config.patch, not monkeypatch.setattr: pytest >= 9.2 undoes a setattr on an
    # object lacking the name in its __dict__ by deleting it, which removes the option from
    # torch's config module for every later test.
    with torch._dynamo.config.patch(disable=True):
        model = ff.compile(Scale(), config())
        with pytest.warns(UserWarning, match=r"Dynamo is disabled .*runs the module eagerly"):
            assert model(torch.ones(1, 3)).tolist() == [[1.0, 2.0, 3.0]]
        assert model(torch.ones(2, 3)).tolist() == [[1.0, 2.0, 3.0]] * 2
        assert (model.stats.compile_disabled, model.stats.graphs_traced) == (2, 0)
    assert torch._dynamo.config.disable is False
    assert model(torch.ones(2, 3)).tolist() == [[1.0, 2.0, 3.0]] * 2
    assert model.stats.graphs_traced == 1


def test_torch_compile_disable_env_var_in_a_fresh_process(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import warnings, torch, freezeframe as ff\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x: torch.Tensor):\n"
        "        return x * 2\n"
        "m = ff.compile(M(), ff.CompilationConfig(mode='piecewise', backend='eager',"
        " use_cache=False))\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    print(m(torch.ones(2)).tolist(), m.stats.compile_disabled, len(w))\n")
    env = dict(os.environ, TORCH_COMPILE_DISABLE="1")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[2.0, 2.0] 1 1"


# -- threads -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_four_threads_making_the_first_call_at_once(mode):
    torch.manual_seed(0)
    eager = OptionalBias()
    model = ff.compile(eager, config(mode))
    inputs = [torch.randn(n, 4) for n in (2, 3, 5, 7)]
    outs: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        try:
            barrier.wait()
            for step in range(20):  # later calls run concurrently, on sizes that alternate
                outs[i].append(model(inputs[(i + step) % 4]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with torch.no_grad():
        want = [eager(x) for x in inputs]
    for i in range(4):
        assert len(outs[i]) == 20
        for step, out in enumerate(outs[i]):
            torch.testing.assert_close(out, want[(i + step) % 4])
    assert (model.stats.graphs_traced, model.num_traces) == (1, 1)


class RowNorm(nn.Module):
    """Reductions over rows and a broadcast: code Inductor would write differently for one row."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (h - h.mean(dim=0, keepdim=True)) * torch.softmax(h, dim=-1)


class BranchOnOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.shape[0] > 1:  # decided with no guard by a trace made at size >= 2
            h = h * 3
        return h


@pytest.mark.parametrize("mode", MODES)
def test_size_one_after_a_trace_made_at_two_or_more_gets_its_own_trace(mode):
    """Found by the differential suite: Dynamo assumes a dynamic size is at least 2 when the
    first call has 2 or more rows, so `x.shape[0] > 1` left no guard, and a size-1 call (a
    decode step) ran the other side of the branch."""
    torch.manual_seed(0)
    eager = BranchOnOne()
    model = ff.compile(eager, config(mode))
    for n in (3, 1, 2, 1, 5):
        x = torch.randn(n, 4)
        torch.testing.assert_close(model(x), eager(x))
    assert (model.num_traces, model.stats.retraces) == (2, 1)


class BranchAt(nn.Module):
    def __init__(self, pin: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pin = pin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if (x.shape[0] == 2) if self.pin else (x.shape[0] > 2):
            h = h * 3
        return h


@pytest.mark.parametrize("mode", MODES)
def test_a_bound_equal_to_the_first_size_traces_instead_of_failing(mode):
    """Found by the differential suite: `x.shape[0] > 2` first called at size 2 made Dynamo
    pin the size (it assumes sizes of at least 2) and raise a raw ConstraintViolationError."""
    torch.manual_seed(0)
    eager = BranchAt(pin=False)
    model = ff.compile(eager, config(mode))
    for n in (2, 3, 1, 2, 6):
        x = torch.randn(n, 4)
        torch.testing.assert_close(model(x), eager(x))
    assert model.num_traces == 2  # sizes <= 2 and sizes > 2


def test_testing_a_dynamic_size_for_one_value_is_a_clear_error():
    model = ff.compile(BranchAt(pin=True), config("dynamo_trace_once"))
    with pytest.raises(CompileError, match=r"forward pins a dynamic size to 2 \(.*line \d+, in "
                                           r"forward: if \(x.shape\[0\] == 2\)"):
        model(torch.randn(2, 4))


class DataBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


def test_a_branch_on_tensor_values_is_a_compile_error_naming_the_line() -> None:
    """Dynamo's raw Unsupported used to reach the user; now it is ours, with Dynamo's account
    of the line kept, and the model traces again (and fails the same way) on the next call."""
    model = ff.compile(DataBranch(), config())
    for _ in range(2):
        with pytest.raises(CompileError, match=r"forward cannot be traced as one graph"
                                               r"(.|\n)*Data-dependent branching(.|\n)*"
                                               r"test_call_checks.py(.|\n)*torch.where") as info:
            model(torch.ones(3, 2))
        assert isinstance(info.value.__cause__, torch._dynamo.exc.Unsupported)
    assert model.num_traces == 0


class StarArgs(nn.Module):
    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return args[0] * 2


def test_a_forward_of_only_star_args_says_what_to_do() -> None:
    with pytest.raises(ff.ConfigError, match=r"takes only \*args / \*\*kwargs.*give forward "
                                             r"named parameters"):
        ff.compile(StarArgs(), config())


# -- the retrace message names what changed ---------------------------------------------------
def _forward(x: torch.Tensor, y: torch.Tensor | None = None, xs: list | None = None,
             scale: float = 1.0) -> None:
    pass


def _sig(*args: object, **kwargs: object) -> CallSignature:
    return Signer(_forward, {"x": (0,), "y": (0,)}, grad_matters=True).signature(args, kwargs)


def _list5(i: int = -1, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Five float32 vectors, the ``i``-th of ``dtype``: a list that describes alike."""
    return [torch.ones(2, dtype=dtype if j == i else torch.float32) for j in range(5)]


X = torch.ones(3, 4)


@pytest.mark.parametrize(("new", "message"), [
    (lambda: _sig(X, torch.ones(3, 4)),
     "y: None -> a torch.float32 tensor on cpu of shape (*, 4), contiguous"),
    (lambda: _sig(X.double()), "x: dtype torch.float32 -> torch.float64"),
    (lambda: _sig(torch.ones(3, 4, 1)), "x: rank 2 -> 3"),
    (lambda: _sig(torch.ones(4, 3).t()), "x: strides contiguous -> (1, 3)"),
    (lambda: _sig(X.clone().requires_grad_()), "x: requires_grad False -> True"),
    (lambda: _sig(X, X), "y: None -> a torch.float32 tensor on cpu of shape (*, 4), contiguous; "
                         "storage sharing: none -> x is y"),
    (lambda: _sig(X, scale=2.0), "scale: the float 1.0 -> the float 2.0"),
])
def test_the_difference_names_the_argument_and_the_property(new, message):
    assert difference(_sig(X), new()) == message


def test_the_difference_looks_inside_containers_and_at_the_autograd_mode():
    xs = _list5()
    old = _sig(X, xs=xs)
    assert old.describe() == _sig(X, xs=_list5(3, dtype=torch.float16)).describe()  # alike
    assert difference(old, _sig(X, xs=_list5(3, dtype=torch.float16))) == \
        "xs[3]: dtype torch.float32 -> torch.float16"
    assert difference(old, _sig(X, xs=xs[:4])) == "xs: a list of 5 items -> a list (" + \
        "; ".join(["a torch.float32 tensor on cpu of shape (2), contiguous"] * 4) + ")"
    with torch.no_grad():
        assert difference(old, _sig(X, xs=xs)) == "autograd: grad enabled -> grad disabled"
    assert difference(old, old) == "nothing (the same structure)"


class ListSum(nn.Module):
    def forward(self, x: torch.Tensor, xs: list) -> torch.Tensor:
        return x * 2 + sum(t.sum() for t in xs)


def test_the_retrace_warning_says_what_changed(caplog):
    model = ff.compile(ListSum(), config(), inference_mode=False)
    xs = _list5()
    with caplog.at_level("WARNING", logger="freezeframe.compilation.routing"):
        model(torch.ones(3, 4), xs)
        model(torch.ones(3, 4, requires_grad=True), xs)
        model(torch.ones(3, 4), _list5(3, dtype=torch.float64))
    assert [r.getMessage() for r in caplog.records] == [
        f"{__name__}.ListSum: a call with a new structure is traced again (trace 2); it differs "
        "from the first trace in x: requires_grad False -> True",
        f"{__name__}.ListSum: a call with a new structure is traced again (trace 3); it differs "
        "from the first trace in xs[3]: dtype torch.float32 -> torch.float64",
    ]
    assert model.stats.retraces == 2


class ScaledByTensor(nn.Module):
    """Scaled by a 0-d tensor argument (a diffusion timestep passed as a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * t


@pytest.mark.parametrize("mode", MODES)
def test_a_0d_tensor_argument_stays_static_under_the_default_dims(mode: str) -> None:
    """Issue 42 item 13: the default dims (dim 0 of every tensor argument) refused a 0-d
    tensor with "give a dim in [-0, -1]", a range with no dim in it. A scalar has no batch
    dim: it stays static, its value read anew each call, by one trace."""
    module = ScaledByTensor()
    model = ff.compile(module, config(mode))
    for n, t in ((3, 0.5), (5, 0.25), (3, 2.0), (1, -1.0)):
        x, scale = torch.randn(n, 4), torch.tensor(t)
        torch.testing.assert_close(model(x, scale), module(x, scale).detach())
    assert model.num_traces == 1
    with pytest.raises(ff.ConfigError, match=r"dynamic_arg_dims\['t'\]: argument 't' is a 0-d "
                                             r"tensor .* leave it out of dynamic_arg_dims"):
        ff.compile(ScaledByTensor(), config(mode), dynamic_arg_dims={"x": 0, "t": 0})(
            torch.randn(3, 4), torch.tensor(0.5))
