"""Splitting an FX graph at splitting ops: op-name matching, piece counts and order."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

import freezeframe as ff
from freezeframe.compilation.split import matches_splitting_op, split_graph
from tests.helpers import silly
from tests.helpers.toy_models import AttnSandwich, OuterWithTwoInner, SillyModel


@torch.library.custom_op("ffsplit::pair", mutates_args=())
def _pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, x - 1


@_pair.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


# -- op-name matching ---------------------------------------------------------------------
@pytest.mark.parametrize(("target", "names", "want"), [
    (torch.ops.silly.attention, ["silly::attention"], True),
    (torch.ops.silly.attention.default, ["silly::attention"], True),
    (torch.ops.silly.attention.default, ["silly::attention.default"], True),
    (torch.ops.silly.attention, ["silly::attention.default"], False),
    (torch.ops.aten.add.Tensor, ["aten::add"], True),
    (torch.ops.aten.add.Tensor, ["aten::add.Tensor"], True),
    (torch.ops.aten.add.Tensor, ["aten::add.Scalar"], False),
    (torch.ops.aten.add.Tensor, ["aten::addmm"], False),
    (torch.ops.aten.add.Tensor, [], False),
    (operator.add, ["aten::add"], False),
    # a torch function binding an ATen op (as Dynamo records torch.add, F.sdpa) is its packet
    (torch.add, ["aten::add"], True),
    (torch.add, ["aten::add.Tensor"], False),
])
def test_matches_splitting_op(target, names, want):
    assert matches_splitting_op(target, names) is want


# -- splitting ------------------------------------------------------------------------------
def _split(module, ops=("silly::attention",)):
    return split_graph(fx.symbolic_trace(module), list(ops))


def test_two_ops_give_five_pieces_in_order():
    split = _split(SillyModel())
    assert [p.index for p in split.pieces] == [0, 1, 2, 3, 4]
    assert [p.is_splitting_op for p in split.pieces] == [False, True, False, True, False]
    assert [p.capturable for p in split.pieces] == [True, False, True, False, True]
    assert len(split.capturable) == 3
    x = torch.randn(4)
    assert torch.equal(split.stitching(x), SillyModel()(x))


def test_three_ops_give_seven_pieces():
    split = _split(OuterWithTwoInner())
    assert len(split.pieces) == 7
    assert len(split.capturable) == 4


def test_no_matching_op_is_one_piece():
    split = _split(SillyModel(), ops=("other::op",))
    assert len(split.pieces) == 1
    assert split.pieces[0].capturable


def test_overload_specific_name_matches_the_traced_overload():
    # Dynamo records the packet; make_fx-style graphs record the overload
    gm = fx.symbolic_trace(AttnSandwich())
    for node in gm.graph.nodes:
        if node.target is torch.ops.silly.attention:
            node.target = torch.ops.silly.attention.default
    gm.recompile()
    assert len(split_graph(gm, ["silly::attention.default"]).pieces) == 3
    assert len(split_graph(gm, ["silly::attention.other"]).pieces) == 1


def test_adjacent_ops_each_get_a_piece():
    class Adjacent(torch.nn.Module):
        def forward(self, x):
            x = x * 2
            a = torch.empty_like(x)
            b = torch.empty_like(x)
            torch.ops.silly.attention(x, x, x, a)
            torch.ops.silly.attention(a, a, a, b)
            return b + 1

    split = _split(Adjacent())
    assert [p.is_splitting_op for p in split.pieces] == [False, True, True, False]
    x = torch.randn(3)
    assert torch.equal(split.stitching(x), Adjacent()(x))


def test_getitem_of_a_splitting_op_stays_with_it():
    class Pair(torch.nn.Module):
        def forward(self, x):
            a, b = torch.ops.ffsplit.pair(x * 2)
            return a * b

    split = _split(Pair(), ops=("ffsplit::pair",))
    assert [p.is_splitting_op for p in split.pieces] == [False, True, False]
    op_piece = split.pieces[1].graph
    assert any(n.target is operator.getitem for n in op_piece.graph.nodes)
    x = torch.randn(3)
    assert torch.equal(split.stitching(x), Pair()(x))


def test_compiled_model_exposes_piece_records():
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", cudagraph_mode="none",
                               splitting_ops=["silly::attention"], use_cache=False)
    model = ff.compile(SillyModel(), cfg)
    assert model.pieces == []
    silly.reset_counter()
    model(torch.zeros(3))
    assert silly.get_counter() == 2
    assert [(p.index, p.is_splitting_op, p.capturable) for p in model.pieces] == [
        (0, False, True), (1, True, False), (2, False, True), (3, True, False),
        (4, False, True)]


class _SdpaBlock(torch.nn.Module):
    """An ordinary attention block: F.scaled_dot_product_attention, no custom op."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, 2, 8).unbind(1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(a.reshape(x.shape[0], 16))


def test_sdpa_called_through_torch_functional_is_split_at_its_aten_name() -> None:
    # Dynamo records F.scaled_dot_product_attention as torch._C._nn's builtin, not an OpOverload
    assert matches_splitting_op(torch.nn.functional.scaled_dot_product_attention,
                                ["aten::scaled_dot_product_attention"])
    assert not matches_splitting_op(torch.nn.functional.scaled_dot_product_attention,
                                    ["aten::scaled_dot_product_attention.default"])
    assert not matches_splitting_op(torch.matmul, ["aten::scaled_dot_product_attention"])
    torch.manual_seed(0)
    block = _SdpaBlock().eval()
    cfg = ff.CompilationConfig(backend="eager", cudagraph_mode="piecewise",
                               graph_backend="emulated", cudagraph_capture_sizes=[2, 4],
                               splitting_ops=["aten::scaled_dot_product_attention"])
    compiled = ff.compile(block, cfg)
    for rows in (3, 4, 1):
        x = torch.randn(rows, 16)
        with torch.no_grad():
            assert torch.equal(compiled(x), block(x))
    assert [p.is_splitting_op for p in compiled.pieces] == [False, True, False]
