"""``torch.compile(model, backend="freezeframe", options={...})``: the same stages as ff.compile
(split, per-range compile, graphs per padded size) behind torch.compile's own front door."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import freezeframe as ff
from freezeframe.compilation.dynamo_backend import (
    FreezeframeBackend,
    config_from_options,
    freezeframe_backend,
)
from freezeframe.models.example import MIX_OP, ExampleMLP

REPO = Path(__file__).resolve().parents[2]
HIDDEN = 8
OPTIONS: dict[str, Any] = {"backend": "eager", "splitting_ops": [MIX_OP]}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model() -> ExampleMLP:
    return ExampleMLP(hidden_size=HIDDEN, num_layers=2).eval()


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_outputs_equal_eager_for_every_size_through_the_registered_name() -> None:
    module = _model()
    compiled = torch.compile(module, backend="freezeframe", options=OPTIONS)
    with torch.no_grad():
        for n in (2, 3, 5, 8, 13, 1):
            x = _rows(n, n)
            assert torch.equal(compiled(x), module(x)), n
    # Dynamo's rules: the first size (2) is compiled static, the second (3) makes the batch dim
    # dynamic and that graph serves 3..13; size 1 is specialised (Dynamo's 0/1 rule) and gets
    # a graph of its own: three graphs, none per size
    assert counters["stats"]["unique_graphs"] == 3


def test_the_graph_is_split_at_the_splitting_op_like_ff_compile() -> None:
    module = _model()
    backend = FreezeframeBackend(backend="eager", splitting_ops=[MIX_OP],
                                 compile_ranges_endpoints=[4])
    compiled = torch.compile(module, backend=backend, dynamic=True)
    with torch.no_grad():
        x = _rows(6, 0)
        assert torch.equal(compiled(x), module(x))
    (graph,) = backend.graphs
    # 2 layers: 3 capturable pieces around 2 calls of the splitting op
    assert [p.is_splitting_op for p in graph.pieces] == [False, True, False, True, False]
    # each capturable piece compiled for both ranges, [1, 4] and [5, 8192]
    assert [[str(r) for r in b.entries] for b in graph.piece_backends] == \
        [["[1, 4]", "[5, 8192]"]] * 3
    assert backend.stats.get("graphs_traced") == 1
    assert backend.stats.get("eager_compiles") == 6

    reference = ff.compile(_model(), ff.CompilationConfig(
        backend="eager", splitting_ops=[MIX_OP], compile_ranges_endpoints=[4]))
    with torch.no_grad():
        reference(x)
    assert [p.is_splitting_op for p in reference.pieces] == \
        [p.is_splitting_op for p in graph.pieces]


def test_graphs_per_padded_size_replay_the_eager_answer() -> None:
    module = _model()
    backend = FreezeframeBackend(backend="eager", splitting_ops=[MIX_OP],
                                 cudagraph_mode="piecewise", graph_backend="emulated",
                                 cudagraph_capture_sizes=[2, 4, 8])
    compiled = torch.compile(module, backend=backend, dynamic=True)
    buffer = torch.zeros(8, HIDDEN)  # the static input, rows for the largest size
    with torch.no_grad():
        compiled(buffer[:2])  # outside a forward context: compiles, runs without graphs
        for step, n in enumerate((3, 4, 1, 7, 3, 8)):
            size = backend.config.padded_size(n)
            assert size is not None
            x = _rows(n, 100 + step)
            buffer[:n].copy_(x)
            buffer[n:size].zero_()
            with ff.forward_context(ff.BatchDescriptor(num_tokens=size),
                                    mode=ff.CUDAGraphMode.PIECEWISE):
                out = compiled(buffer[:size])
            # the padded batch's answer exactly; the unpadded one up to float rounding (a
            # matmul over 4 rows may round differently from one over 3)
            assert torch.equal(out, module(buffer[:size])), n
            torch.testing.assert_close(out[:n], module(x), rtol=1e-5, atol=1e-6)
    # sizes 4, 2 and 8 captured once each (3 pieces per size); 3 steps replayed
    assert backend.stats.get("graphs_captured") == 9
    assert backend.stats.get("replays") == 9
    assert len(backend.graph_wrappers()) == 3


def test_full_graphs_wrap_the_whole_graph() -> None:
    module = _model()
    compiled = torch.compile(module, backend="freezeframe", dynamic=True, options={
        "backend": "eager", "mode": "dynamo_trace_once", "cudagraph_mode": "full",
        "graph_backend": "emulated", "cudagraph_capture_sizes": [4]})
    x = _rows(4, 1)
    with torch.no_grad():
        compiled(_rows(2, 0))
        with ff.forward_context(ff.BatchDescriptor(num_tokens=4), mode=ff.CUDAGraphMode.FULL):
            first = compiled(x).clone()
            x2 = _rows(4, 2)
            x.copy_(x2)
            second = compiled(x)
    assert torch.equal(first, module(_rows(4, 1)))
    assert torch.equal(second, module(x2))


def test_options_map_to_config_fields() -> None:
    cfg = config_from_options({"backend": "eager", "splitting_ops": [MIX_OP],
                               "cudagraph_mode": "piecewise", "max_num_batched_tokens": 64,
                               "cudagraph_capture_sizes": [4, 1, 2]})
    assert cfg == ff.CompilationConfig(backend="eager", splitting_ops=[MIX_OP],
                                       cudagraph_mode="piecewise", max_num_tokens=64,
                                       cudagraph_capture_sizes=[1, 2, 4])
    whole = ff.CompilationConfig(backend="eager")
    assert config_from_options({"config": whole}) is whole
    assert config_from_options(None) == ff.CompilationConfig()


def test_unknown_options_are_named_with_the_valid_ones() -> None:
    # Dynamo wraps what a backend raises in its BackendCompilerFailed; ours is inside, whole
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as exc:
        torch.compile(_model(), backend="freezeframe",
                      options={"backend": "eager", "capture_sizes": [1]})(_rows(2, 0))
    inner = exc.value.inner_exception
    assert isinstance(inner, ff.ConfigError)
    message = str(inner)
    assert message in str(exc.value)
    assert ("torch.compile(backend='freezeframe'): unknown option(s) ['capture_sizes']; valid "
            "options are the CompilationConfig fields [") in message
    for name in ("cudagraph_capture_sizes", "splitting_ops", "max_num_seqs", "'config'"):
        assert name in message


@pytest.mark.parametrize(("options", "match"), [
    ({"mode": "none"}, r"mode NONE is not a mode of this backend"),
    ({"mode": "stock_torch_compile"}, r"mode STOCK_TORCH_COMPILE is not a mode of this backend"),
    ({"config": ff.CompilationConfig(), "backend": "eager"},
     r"option 'config' comes with \['backend'\]"),
    ({"config": {"backend": "eager"}}, r"option 'config' must be a CompilationConfig, got dict"),
    ({"cudagraph_mode": "sometimes"}, r"cudagraph_mode: unknown CUDA-graph mode 'sometimes'"),
])
def test_bad_options_are_config_errors(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ff.ConfigError, match=match):
        config_from_options(options)


def test_torch_compile_modes_are_refused_with_the_option_to_use() -> None:
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ff.ConfigError, match=r"mode='reduce-overhead'\): torch.compile's modes "
                                             r"belong to Inductor"):
        freezeframe_backend(gm, [torch.ones(2)], mode="reduce-overhead")


def test_recompiles_stay_bounded_across_many_sizes() -> None:
    module = _model()
    backend = FreezeframeBackend(backend="eager", splitting_ops=[MIX_OP])
    compiled = torch.compile(module, backend=backend)
    with torch.no_grad():
        for n in range(1, 41):
            x = _rows(n, n)
            assert torch.equal(compiled(x), module(x)), n
    # size 1 (static), then one dynamic graph for sizes 2..40
    assert counters["stats"]["unique_graphs"] == 2
    assert len(backend.graphs) == 2
    assert backend.stats.get("graphs_traced") == 2
    assert sum(counters["recompiles"].values()) <= 1


def test_the_entry_point_lists_the_backend_without_importing_freezeframe() -> None:
    code = (
        "import sys, torch\n"
        "print('freezeframe' in torch._dynamo.list_backends())\n"
        "print('freezeframe' in sys.modules)\n"
        "f = torch.compile(lambda x: x * 2, backend='freezeframe', "
        "options={'backend': 'eager'})\n"
        "print(f(torch.ones(3)).tolist())\n"
        "print('freezeframe' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd="/", timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:4] == ["True", "False", "[2.0, 2.0, 2.0]", "True"], (
        f"{proc.stdout}\n{proc.stderr}\nthe installed freezeframe has no torch_dynamo_backends "
        "entry point: reinstall it (pip install -e .)")


SHIFT = 0.5  # a global forward reads


def _halved(h: torch.Tensor, by: float = 0.5) -> torch.Tensor:
    return h * by


def _offset() -> tuple[Any, list[float]]:
    cell = [0.25]

    def offset(h: torch.Tensor) -> torch.Tensor:
        return h + cell[0]

    return offset, cell


_OFFSET, _CELL = _offset()


class _Scaled(torch.nn.Module):
    """A linear layer's output changed by Python numbers from every place forward reads one:
    a float and an int argument, a float and an int attribute, a global, a function's default
    and a closure cell."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.eps, self.n = 1.0, 2

    def forward(self, x: torch.Tensor, t: float, k: int = 1) -> torch.Tensor:
        h = self.lin(x) * t + k + self.eps * self.n + SHIFT
        return _OFFSET(_halved(h))


@pytest.fixture
def _numbers() -> Any:
    global SHIFT
    yield
    SHIFT = 0.5
    _halved.__defaults__ = (0.5,)
    _CELL[0] = 0.25


def _checker(graphs: str, dynamic: bool | None) -> tuple[_Scaled, FreezeframeBackend, Any]:
    module = _Scaled()
    backend = FreezeframeBackend(backend="eager", cudagraph_mode=graphs,
                                 graph_backend="emulated", cudagraph_capture_sizes=[4])
    compiled = torch.compile(module, backend=backend, dynamic=dynamic)
    mode = ff.CUDAGraphMode.PIECEWISE if graphs == "piecewise" else ff.CUDAGraphMode.FULL
    x = _rows(4, 3)

    def check(t: float, k: int) -> None:
        for _ in range(3):  # a capture, two replays
            with ff.forward_context(ff.BatchDescriptor(num_tokens=4), mode=mode):
                assert torch.equal(compiled(x, t, k), module(x, t, k)), (t, k)

    return module, backend, check


def test_a_python_number_from_anywhere_is_served_under_graphs(_numbers: Any) -> None:
    """Issue 42 items 3 and 12 (matrix seeds 168, 194, 221): with dynamic=True, torch.compile
    passes every Python float forward reads (an argument, an attribute, a global, a default,
    a closure cell) to its graph as a tensor read back with .item() from the first call on,
    and an int argument as a SymInt: a capture refused the float (a CaptureError at the first
    call) and replayed the int of its capture. Each graph is specialised on those values now
    (a constant and a guard), so torch.compile compiles again for another value of any one of
    them and every call answers."""
    global SHIFT
    module, backend, check = _checker("piecewise", True)
    changes = [lambda: None, lambda: setattr(module, "eps", 1.5),
               lambda: setattr(module, "n", 3), lambda: setattr(_halved, "__defaults__", (2.0,)),
               lambda: _CELL.__setitem__(0, 0.75)]
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=16):
        check(0.5, 1)
        check(0.25, 1)
        check(0.25, 4)
        for change in changes:
            change()
            check(0.25, 4)
        SHIFT = 2.0
        check(0.25, 4)
    # a graph per set of values (eight), captured at its first call and replayed at the next
    # two; the check after the no-op change replays the graph before it three times
    assert len(backend.graphs) == 8
    assert backend.stats.get("replays") == 8 * 2 + 3
    # six inputs of each graph (t, k, self.eps, SHIFT, the default, the cell; self.n, an
    # nn.Module's int, stays a constant Dynamo guards itself)
    assert backend.stats.get("scalar_inputs_specialised") == 8 * 6


def test_a_changed_int_argument_is_not_replayed_with_its_captured_value() -> None:
    """Automatic dynamic (torch.compile's default): once an int argument changed, the next
    graph took it as a SymInt, and its FULL graph replayed the value of the capture for every
    later value (a wrong answer, silent); a changed float was refused."""
    _, backend, check = _checker("full", None)
    with torch.no_grad():
        for t, k in ((0.5, 1), (0.25, 4), (0.75, 5)):
            check(t, k)
    assert len(backend.graphs) == 3
    assert backend.stats.get("replays") == 3 * 2
    # (t and k, inputs of the second graph and the third)
    assert backend.stats.get("scalar_inputs_specialised") == 2 * 2
