"""A saved trace keeps every node's fake value, so a warm start does not re-derive them by fake
propagation through the whole graph (issue 16: 4.6 s of a warm start's first call); a trace
whose values could not be written still loads, by propagating, as before. Eager compiler."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.compilation import cached_trace, saved_trace


class Viewy(nn.Module):
    """Splits a projection into two views (storage offsets 0 and 4) mid-graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        a, b = h.split(4, dim=1)
        return (a * b.sigmoid()).reshape(-1, 2, 2).sum(-1)


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FREEZEFRAME_DISABLE_CACHE", raising=False)


class _Spy:
    """Counts fake propagations and records what the warm start's loader was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.propagations = 0
        self.loads: list[tuple[Any, Any]] = []  # (valued argument, loaded graph)
        real_propagate = saved_trace._propagate_fake_values
        real_load = cached_trace._load_graph

        def propagate(*args: Any) -> None:
            self.propagations += 1
            real_propagate(*args)

        def load(blob: bytes, valued: Any = None) -> Any:
            gm, inputs = real_load(blob, valued)
            self.loads.append((valued, gm))
            return gm, inputs

        monkeypatch.setattr(saved_trace, "_propagate_fake_values", propagate)
        monkeypatch.setattr(cached_trace, "_load_graph", load)


def _start(root: Path) -> tuple[ff.CompiledModel, torch.Tensor]:
    model = ff.compile(Viewy(), ff.CompilationConfig(mode="piecewise", backend="eager",
                                                     cache_dir=str(root)))
    x = torch.arange(20, dtype=torch.float32).reshape(5, 4) / 7
    with torch.no_grad():
        out = model(x)
        torch.testing.assert_close(out, Viewy()(x), rtol=0, atol=0)
    return model, out


def _node(gm: Any, target: Any, index: int) -> Any:
    (node,) = [n for n in gm.graph.nodes
               if n.target is target and len(n.args) > 1 and n.args[1] == index]
    return node


def test_a_warm_start_takes_the_saved_values_without_fake_propagation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cold, cold_out = _start(tmp_path)
    assert (cold.stats.traces_loaded, cold.stats.artifacts_saved) == (0, 1)
    spy = _Spy(monkeypatch)
    warm, warm_out = _start(tmp_path)
    assert warm.stats.traces_loaded == 1
    assert spy.propagations == 0
    assert torch.equal(warm_out, cold_out)
    ((valued, gm),) = spy.loads
    # every node but the output holds a value
    assert sorted(valued) == sorted(n.name for n in gm.graph.nodes if n.op != "output")
    # the second half of the split, stored as a view's detach(): same sizes, strides and
    # storage offset as the traced view, and no base
    b = _node(gm, operator.getitem, 1).meta["example_value"]
    assert (b.shape[1], b.stride(), b.storage_offset(), b._is_view()) == (4, (8, 1), 4, False)
    a = _node(gm, operator.getitem, 0).meta["example_value"]
    assert (a.shape[1], a.stride(), a.storage_offset()) == (4, (8, 1), 0)


def test_saved_values_equal_the_propagated_ones(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _start(tmp_path)
    spy = _Spy(monkeypatch)
    _start(tmp_path)
    ((_valued, stored_gm),) = spy.loads
    # the same blob loaded the old way: every value re-derived by fake propagation
    blob = _saved_blob(tmp_path, monkeypatch)
    propagated_gm, _ = saved_trace._load_graph(blob, None)
    assert spy.propagations == 1

    def described(gm: Any) -> list[Any]:
        out = []
        for n in gm.graph.nodes:
            v = n.meta.get("example_value")
            values = v if isinstance(v, (tuple, list)) else [v]
            out.append([n.name] + [(str(t.shape), str(t.stride()), str(t.storage_offset()),
                                    t.dtype, t.requires_grad)
                                   if isinstance(t, torch.Tensor) else repr(t) for t in values])
        return out

    assert described(stored_gm) == described(propagated_gm)


def _saved_blob(root: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The graph blob of the saved trace under ``root`` (captured from a warm start's load)."""
    blobs: list[bytes] = []
    real = cached_trace._load_graph

    def load(blob: bytes, valued: Any = None) -> Any:
        blobs.append(blob)
        return real(blob, valued)

    monkeypatch.setattr(cached_trace, "_load_graph", load)
    _start(root)
    (blob,) = blobs
    return blob


def test_a_trace_whose_values_cannot_be_written_still_loads_by_propagating(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(value: Any) -> Any:
        raise TypeError("cannot write this value")

    with monkeypatch.context() as patch:
        patch.setattr(cached_trace, "_detached", refuse)
        _, cold_out = _start(tmp_path)
    spy = _Spy(monkeypatch)
    warm, warm_out = _start(tmp_path)
    assert warm.stats.traces_loaded == 1
    assert spy.loads[0][0] is None  # saved with the placeholders' values only
    assert spy.propagations == 1
    assert torch.equal(warm_out, cold_out)


def test_a_value_that_does_not_come_back_means_propagation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _start(tmp_path)
    blob = _saved_blob(tmp_path, monkeypatch)
    spy = _Spy(monkeypatch)
    gm, inputs = saved_trace._load_graph(blob, ["h", "no_such_node"])
    assert spy.propagations == 1
    assert next(n.name for n in gm.graph.nodes if n.op == "call_function") == "h"  # self.lin(x)
    assert saved_trace.missing_values(gm, ["h", "no_such_node"]) == ["no_such_node"]
    assert all(n.meta.get("example_value") is not None
               for n in gm.graph.nodes if n.op == "call_function")
    assert len(inputs) == sum(1 for n in gm.graph.nodes if n.op == "placeholder")
