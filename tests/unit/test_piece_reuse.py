"""Each distinct piece is compiled once per range: pieces whose structural hash
(:func:`freezeframe.cache.key.graph_hash`) is equal share one compiled callable.

Uses the eager compiler and a counting compiler (every call into it is recorded), so the tests
run in a second or two; Inductor's own reuse is checked in tests/integration.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import fx, nn

import freezeframe as ff
from freezeframe.cache.key import graph_hash
from freezeframe.compilation import CompiledModel
from freezeframe.models.example import MIX_OP, ExampleMLP, mix
from freezeframe.sizes import Range


class _Counting:
    """A compiler that records every call into it and compiles nothing (the FX graph runs)."""

    name = "eager"
    launches_kernels = False

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple[int, int]]] = []

    def compile(self, graph: fx.GraphModule, example_inputs: list[Any],
                compile_range: Range, piece_index: int) -> Any:
        self.calls.append((piece_index, (compile_range.start, compile_range.end)))
        return graph


def _compiled(module: nn.Module, **changes: Any) -> tuple[CompiledModel, _Counting]:
    base: dict[str, Any] = dict(mode="piecewise", backend="eager", splitting_ops=[MIX_OP],
                                cudagraph_mode="none", use_cache=False)
    base.update(changes)
    model = ff.compile(module, ff.CompilationConfig(**base), dynamic_arg_dims={"x": 0})
    counting = _Counting()
    assert model.manager is not None
    model.manager.compiler = counting  # the one door every compile goes through
    return model, counting


def test_four_layers_compile_each_distinct_piece_once_per_range() -> None:
    # 4 layers: 5 capturable pieces; the first (up projection only) and the last (down
    # projection only) are unlike the others, the 3 middle ones (down, residual, up) are alike.
    eager = ExampleMLP(hidden_size=16, num_layers=4).eval()
    model, counting = _compiled(copy.deepcopy(eager), compile_ranges_endpoints=[8],
                                compile_sizes=[4], max_num_tokens=64)
    ranges = [(1, 8), (9, 64), (4, 4)]
    with model.stats.expect(capturable_pieces=5, distinct_pieces=3, backend_compilations=15,
                            pieces_reused=6):
        outs = [model(x) for x in (eager.example_input(n) for n in (3, 4, 8, 20))]
    # distinct pieces x ranges calls, each distinct piece compiled at its first index
    assert sorted(counting.calls) == sorted((i, r) for i in (0, 2, 8) for r in ranges)
    assert model._variants[0].backend.distinct_pieces == 3
    with torch.no_grad():
        for n, out in zip((3, 4, 8, 20), outs, strict=True):
            assert torch.equal(out, eager(eager.example_input(n)))  # eager compiler: exact


def test_reused_piece_reads_its_own_parameters() -> None:
    # Pieces get their parameters as inputs, so a shared callable computes each layer with
    # that layer's weights: changing one layer's weights changes the output the eager way.
    eager = ExampleMLP(hidden_size=8, num_layers=3).eval()
    model, _ = _compiled(copy.deepcopy(eager))
    x = eager.example_input(5)
    model(x)
    with torch.no_grad():
        for m in (model.module, eager):
            m.ups[2].weight.mul_(-3.0)
            m.downs[1].bias.add_(0.5)
        assert torch.equal(model(x), eager(x))


class _Scaled(nn.Module):
    """ExampleMLP's layers with a plain-float scale per layer: Dynamo bakes each scale into the
    graph as a constant, so layers of different scale give pieces that differ only in it."""

    def __init__(self, scales: list[float], hidden: int = 8) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.scales = scales
        self.ups = nn.ModuleList(nn.Linear(hidden, 2 * hidden) for _ in scales)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, scale in zip(self.ups, self.scales, strict=True):
            a, gate = up(x).chunk(2, dim=-1)
            out = torch.empty_like(a)
            mix(a, gate, out)
            x = out * scale
        return x


def test_pieces_that_differ_only_in_a_constant_are_not_merged() -> None:
    # pieces: [up0] mix [*2.0, up1] mix [*2.0, up2] mix [*3.0, up3] mix [*3.0]
    eager = _Scaled([2.0, 2.0, 3.0, 3.0]).eval()
    model, counting = _compiled(copy.deepcopy(eager))
    x = torch.randn(6, 8)
    with model.stats.expect(capturable_pieces=5, distinct_pieces=4, pieces_reused=1):
        got = model(x)
    # piece 4 (x*2.0, up2) reuses piece 2 (x*2.0, up1); piece 6 (x*3.0, up3) does not
    assert [i for i, _ in counting.calls] == [0, 2, 6, 8]
    with torch.no_grad():
        assert torch.equal(got, eager(x))


def _fx(fn: Any) -> fx.GraphModule:
    return fx.symbolic_trace(fn)


def test_graph_hash_tells_constants_apart_and_ignores_names() -> None:
    x = [torch.zeros(4, 3)]

    def a(t: torch.Tensor) -> torch.Tensor:
        return t * 2.0

    def b(u: torch.Tensor) -> torch.Tensor:  # another name: the same structure
        return u * 2.0

    assert graph_hash(_fx(a), x) == graph_hash(_fx(b), x)
    assert graph_hash(_fx(a), x) != graph_hash(_fx(lambda t: t * 3.0), x)
    assert graph_hash(_fx(a), x) != graph_hash(_fx(lambda t: t * 2), x)     # int vs float
    assert graph_hash(_fx(a), x) != graph_hash(_fx(lambda t: t + 2.0), x)   # another op
    # input metadata: dtype, shape, strides, requires_grad
    assert graph_hash(_fx(a), x) != graph_hash(_fx(a), [torch.zeros(4, 3, dtype=torch.half)])
    assert graph_hash(_fx(a), x) != graph_hash(_fx(a), [torch.zeros(5, 3)])
    assert graph_hash(_fx(a), x) != graph_hash(_fx(a), [torch.zeros(3, 4).t()])
    assert graph_hash(_fx(a), x) != graph_hash(_fx(a), [torch.zeros(4, 3, requires_grad=True)])
    assert graph_hash(_fx(a), x, "r1") != graph_hash(_fx(a), x, "r2")


class _WithConstant(nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("c", value)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t + self.c


def test_graph_hash_reads_constant_tensors_by_value() -> None:
    x = [torch.zeros(3)]
    one, same, other = (fx.symbolic_trace(_WithConstant(torch.tensor(v)))
                        for v in ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 4.0]))
    assert graph_hash(one, x) == graph_hash(same, x)
    assert graph_hash(one, x) != graph_hash(other, x)


def test_graph_hash_renames_symbols_in_order() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm = _fx(lambda t, n: t * 2.0)
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)

    def fake(dim: int) -> list[Any]:
        s = shape_env.create_unbacked_symint()
        for _ in range(dim):  # a later symbol, as another trace would number it
            s = shape_env.create_unbacked_symint()
        with mode:
            t = torch.empty(s, 3)
        return [t, s]

    first, second = fake(0), fake(2)
    assert str(first[1]) != str(second[1])
    assert graph_hash(gm, first) == graph_hash(gm, second)
    with mode:
        static = [torch.empty(5, 3), 5]
    assert graph_hash(gm, first) != graph_hash(gm, static)


def test_an_object_without_a_value_description_is_hashed_by_identity() -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "Opaque()"  # equal reprs must not make two objects one

    o1, o2 = Opaque(), Opaque()
    g1, g2 = fx.Graph(), fx.Graph()
    for g, o in ((g1, o1), (g2, o2)):
        t = g.placeholder("t")
        g.output(g.call_function(torch.add, (t, 1), {"alpha": o}))
    x = [torch.zeros(2)]
    h1 = graph_hash(fx.GraphModule(nn.Module(), g1), x)
    assert h1 == graph_hash(fx.GraphModule(nn.Module(), g1), x)
    assert h1 != graph_hash(fx.GraphModule(nn.Module(), g2), x)


@pytest.mark.parametrize("mode", ["dynamo_trace_once", "piecewise"])
def test_distinct_pieces_in_the_stats(mode: str) -> None:
    eager = ExampleMLP(hidden_size=8, num_layers=3).eval()
    model, _ = _compiled(copy.deepcopy(eager), mode=mode)
    model(eager.example_input(2 if mode == "piecewise" else 3))
    assert model.stats.distinct_pieces == (3 if mode == "piecewise" else 1)


def test_graph_hash_tells_the_ambient_settings_a_compiler_bakes_in_apart() -> None:
    """Full seed 32: a Dynamo graph traced under torch.autocast has the nodes of one traced
    without, and Inductor's code for the one without (float32) was reused for it."""
    x = [torch.zeros(4, 3)]
    gm = _fx(lambda t: t @ t.T)
    plain = graph_hash(gm, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = graph_hash(gm, x)
    with torch.autocast("cpu", dtype=torch.float16):
        fp16 = graph_hash(gm, x)
    assert len({plain, bf16, fp16}) == 3
    assert graph_hash(gm, x) == plain
