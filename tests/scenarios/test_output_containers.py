"""Output containers a runner step cuts to the real rows (issue 42 item 4): a plain
``@dataclass`` of tensors (which torch's pytree does not know) answered with the padded rows
too; every container torch's pytree knows, dataclasses included, is cut now, through the first
step of a shape and its planned steps alike, and an output leaf the runner cannot cut is
refused by name. On every graph backend present."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import freezeframe as ff
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers import silly  # noqa: F401  (registers silly::attention)
from tests.scenarios.conftest import Rig


@dataclasses.dataclass
class Hidden:
    rows: torch.Tensor  # [tokens, 4]
    bias: torch.Tensor  # [4], from a weight: not per token (never cut, even at 4 tokens)
    note: str = "plain"


@dataclasses.dataclass(frozen=True)
class Frozen:
    rows: torch.Tensor


class Pair:
    """A class registered with torch's pytree."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None),
                            lambda values, _: Pair(*values))


class Opaque:
    """Holds a tensor, registered nowhere: the runner cannot know its rows."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows


class Returns(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        out = torch.empty_like(h)
        torch.ops.silly.attention(h, h, h, out)
        if self.kind == "dataclass":
            return Hidden(out * 2, self.lin.bias * 1)
        if self.kind == "frozen":
            return Frozen(out + 1)
        if self.kind == "pytree":
            return Pair(out, out * 3)
        if self.kind == "plain":
            return out
        if self.kind == "repeated":  # one tensor object in two places
            y = out * 3
            return {"pair": (out, [y, out]), "y": y}
        return Opaque(out)


def _runner(rig: Rig, kind: str, graphs: str, **options: Any) -> tuple[Returns, GraphRunner]:
    module = Returns(kind).to(rig.device)
    cfg = rig.config(graphs, cudagraph_capture_sizes=[2, 4], max_num_tokens=8)
    runner = GraphRunner(ff.compile(module, cfg), cfg, inputs={"x": Tokens(4)},
                         device=rig.device, progress=False, **options)
    runner.capture()
    return module, runner


def _leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, (Hidden, Frozen)):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)
                if isinstance(getattr(obj, f.name), torch.Tensor)]
    return [obj.a, obj.b]


@pytest.mark.parametrize(("kind", "copy_outputs"), [("dataclass", False), ("dataclass", True),
                                                    ("frozen", False), ("pytree", True)])
@pytest.mark.parametrize("graphs", ["full", "piecewise"])
def test_every_container_is_cut_to_the_real_rows(rig: Rig, graphs: str, kind: str,
                                                 copy_outputs: bool) -> None:
    module, runner = _runner(rig, kind, graphs, copy_outputs=copy_outputs)
    for step in range(3):  # the first step of the shape, then planned ones
        x = rig.randn(3, 4, generator=torch.Generator().manual_seed(step))
        got = runner(x)
        with torch.no_grad():
            want = module(x)
        assert type(got) is type(want)
        assert [tuple(t.shape) for t in _leaves(got)] == [tuple(t.shape) for t in _leaves(want)]
        for g, w in zip(_leaves(got), _leaves(want), strict=True):
            torch.testing.assert_close(rig.host(g), rig.host(w))
        if kind == "dataclass":
            assert got.note == "plain"
    # (a PIECEWISE plan repeats only an output made of the stitching graph's own outputs
    # in a container it can rebuild: these take the whole way, cut the same way)
    assert runner.planned_shapes == (0 if graphs == "piecewise" else 1)


@pytest.mark.parametrize("copy_outputs", [False, True])
@pytest.mark.parametrize("graphs", ["full", "piecewise"])
def test_a_tensor_returned_twice_is_one_object_in_the_answer(rig: Rig, graphs: str,
                                                             copy_outputs: bool) -> None:
    """Found by the matrix (fast seed 17): the cut made each place of one tensor object a
    tensor of its own (eagerly ``out["y"] is out["pair"][1][0]``)."""
    module, runner = _runner(rig, "repeated", graphs, copy_outputs=copy_outputs)
    for step in range(3):  # the first step of the shape, then planned ones
        x = rig.randn(3, 4, generator=torch.Generator().manual_seed(step))
        got = runner(x)
        with torch.no_grad():
            want = module(x)
        assert got["pair"][0] is got["pair"][1][1] and got["y"] is got["pair"][1][0]
        assert got["pair"][0] is not got["y"]
        torch.testing.assert_close(rig.host(got["y"]), rig.host(want["y"]))
        torch.testing.assert_close(rig.host(got["pair"][0]), rig.host(want["pair"][0]))


@pytest.mark.parametrize("graphs", ["full", "piecewise"])
def test_an_output_the_runner_cannot_cut_is_refused_by_name(rig: Rig, graphs: str) -> None:
    _, runner = _runner(rig, "opaque", graphs)
    with pytest.raises(ff.ConfigError, match=r"returned a Opaque holding tensors, which the "
                                             r"runner cannot cut .*register_pytree_node, or "
                                             r"mark it outputs='none'"):
        runner(rig.randn(3, 4))
    module, whole = _runner(rig, "opaque", graphs, outputs="none")
    x = rig.randn(3, 4)
    got = whole(x)
    assert tuple(got.rows.shape) == (4, 4)  # returned whole: the padded step's rows
    with torch.no_grad():
        torch.testing.assert_close(rig.host(got.rows[:3]), rig.host(module(x).rows))


@pytest.mark.parametrize("how", ["copy_outputs", "inference_mode=False"])
def test_answers_support_in_place_changes_and_autograd_where_the_docs_say(rig: Rig,
                                                                         how: str) -> None:
    """Issue 42 item 11: under the default inference_mode=True an answer is an inference
    tensor, whose in-place change or use in autograd raises torch's own error; the guarantees
    page names the two fixes, each checked here: y.t_(), y.add_() and a trainable head's
    backward on the answers of a captured runner, each matching eager."""
    module = Returns("plain").to(rig.device)
    cfg = rig.config("full", cudagraph_capture_sizes=[2, 4], max_num_tokens=8)
    model = ff.compile(module, cfg, inference_mode=how != "inference_mode=False")
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(4)}, device=rig.device,
                         progress=False, copy_outputs=how == "copy_outputs")
    runner.capture()
    head = nn.Linear(4, 1).to(rig.device)
    for step in range(2):
        x = rig.randn(3, 4, generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            y = runner(x)
            want = module(x)
        assert not y.is_inference()
        torch.testing.assert_close(rig.host(y), rig.host(want))
        y.t_()
        y.t_()
        y.add_(1.0)
        torch.testing.assert_close(rig.host(y), rig.host(want + 1.0))
        head.zero_grad()
        head(y).sum().backward()
        grad = head.weight.grad
        assert grad is not None
        torch.testing.assert_close(rig.host(grad), rig.host((want + 1.0).sum(0, keepdim=True)))
