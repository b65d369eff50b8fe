"""A saved trace keeps the fake values its split reads (the placeholders', sizes, and every value
crossing a piece boundary), so a warm start does not re-derive them by fake propagation through
the whole graph (issue 16: 4.6 s of a warm start's first call); the values inside pieces are
left out (Inductor traces a piece again from its inputs' values:
tests/integration/test_cache_integration.py compiles one on a warm start). Values are never
re-derived by fake propagation (outside Dynamo's tracing context it can pin a symbolic size): a
trace whose values cannot be written is not saved, and one whose values do not come back is
refused; warm starts then trace with Dynamo. Eager compiler."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.cache.key import graph_hash
from freezeframe.compilation import CompiledModel, cached_trace, saved_trace, trace_backend
from freezeframe.compilation.split import split_graph, values_the_split_reads
from freezeframe.errors import CacheError
from tests.helpers.silly import OP_NAME, attention


class Viewy(nn.Module):
    """Splits a projection into two views (storage offsets 0 and 4) mid-graph; the views
    cross into the splitting op's piece, and a whole ``size()`` is taken after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        a, b = h.split(4, dim=1)
        mixed = (a * b.sigmoid()).tanh()
        y = (attention(a, b, mixed) + 1).relu()
        return (y * mixed).reshape(y.size()).reshape(-1, 2, 2).sum(-1)


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FREEZEFRAME_DISABLE_CACHE", raising=False)


class _Spy:
    """Records what the warm start's loader was given and gave back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loads: list[tuple[Any, Any]] = []  # (valued argument, loaded graph)
        real_load = cached_trace._load_graph

        def load(blob: bytes, valued: Any) -> Any:
            gm, inputs = real_load(blob, valued)
            self.loads.append((valued, gm))
            return gm, inputs

        monkeypatch.setattr(cached_trace, "_load_graph", load)


def _traced_graph(root: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A cold start under ``root``; the graph Dynamo traced, with every node's value."""
    graphs: list[Any] = []
    real = trace_backend.keep_trace

    def keep(gm: Any, *args: Any) -> Any:
        graphs.append(gm)
        return real(gm, *args)

    with monkeypatch.context() as patch:
        patch.setattr(trace_backend, "keep_trace", keep)
        _start(root)
    (gm,) = graphs
    return gm


def _start(root: Path) -> tuple[CompiledModel, torch.Tensor]:
    model = ff.compile(Viewy(), ff.CompilationConfig(mode="piecewise", backend="eager",
                                                     splitting_ops=[OP_NAME],
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


def test_a_warm_start_loads_only_the_values_the_split_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cold, cold_out = _start(tmp_path)
    assert (cold.stats.traces_loaded, cold.stats.artifacts_saved) == (0, 1)  # the trace
    spy = _Spy(monkeypatch)
    warm, warm_out = _start(tmp_path)
    assert warm.stats.traces_loaded == 1
    assert torch.equal(warm_out, cold_out)
    ((valued, gm),) = spy.loads
    nodes = {n.name: n for n in gm.graph.nodes}
    held = sorted(name for name, n in nodes.items()
                  if "example_value" in n.meta or "val" in n.meta)
    assert sorted(valued) == held == sorted(values_the_split_reads(gm, [OP_NAME]))
    # kept: the placeholders and the size symbol, the split's tuple and the size (no
    # tensors), the two views, the tanh and the buffer that the attention piece reads, y
    # (whose whole size() is taken) and the returned sum; not kept: what stays inside a piece
    assert sorted(valued) == sorted([
        *(n.name for n in gm.graph.nodes if n.op == "placeholder"),
        "split", "a", "b", "mixed", "out", "y", "size", "sum_1"])
    assert {"h", "sigmoid", "mul", "add", "mul_1", "reshape", "reshape_1"}.isdisjoint(valued)
    # the second half of the split, stored as a view's detach(): same sizes, strides and
    # storage offset as the traced view, and no base
    b = _node(gm, operator.getitem, 1).meta["example_value"]
    assert (b.shape[1], b.stride(), b.storage_offset(), b._is_view()) == (4, (8, 1), 4, False)
    a = _node(gm, operator.getitem, 0).meta["example_value"]
    assert (a.shape[1], a.stride(), a.storage_offset()) == (4, (8, 1), 0)


def _held(gm: Any) -> set[str]:
    """The names of the nodes of ``gm`` that hold a fake value."""
    return {n.name for n in gm.graph.nodes if "example_value" in n.meta or "val" in n.meta}


def _described(gm: Any, names: Any = None) -> list[Any]:
    out = []
    for n in gm.graph.nodes:
        if names is not None and n.name not in names:
            continue
        v = n.meta.get("example_value")
        values = v if isinstance(v, (tuple, list)) else [v]
        out.append([n.name] + [(str(t.shape), str(t.stride()), str(t.storage_offset()),
                                t.dtype, t.requires_grad)
                               if isinstance(t, torch.Tensor) else repr(t) for t in values])
    return out


def _loaded_both_ways(root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Any]:
    """A cold start under ``root``, then a warm start: (the names of the nodes saved with a
    value, the graph the warm start loaded, the graph Dynamo traced in the cold start)."""
    traced_gm = _traced_graph(root, monkeypatch)
    spy = _Spy(monkeypatch)
    _start(root)
    ((valued, stored_gm),) = spy.loads
    return valued, stored_gm, traced_gm


def test_saved_values_equal_the_traced_ones(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    valued, stored_gm, traced_gm = _loaded_both_ways(tmp_path, monkeypatch)
    assert _described(stored_gm, set(valued)) == _described(traced_gm, set(valued))


def test_the_kept_values_split_the_graph_into_the_same_pieces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces of a graph holding only the kept values are the pieces of the traced one:
    same structural hashes, so a warm start finds the cold start's artifacts."""
    _valued, stored_gm, full_gm = _loaded_both_ways(tmp_path, monkeypatch)
    kept, full = split_graph(stored_gm, [OP_NAME]), split_graph(full_gm, [OP_NAME])
    assert [p.name for p in kept.pieces] == [p.name for p in full.pieces]
    assert len(kept.capturable) == 2
    for mine, theirs in zip(kept.capturable, full.capturable, strict=True):
        inputs = [n.meta["example_value"] for n in mine.graph.graph.nodes
                  if n.op == "placeholder"]
        full_inputs = [n.meta["example_value"] for n in theirs.graph.graph.nodes
                       if n.op == "placeholder"]
        assert graph_hash(mine.graph, inputs) == graph_hash(theirs.graph, full_inputs)
        assert _described(mine.graph, _held(mine.graph)) == _described(theirs.graph,
                                                                        _held(mine.graph))


class _Scaled(nn.Module):
    """Reads a buffer before and after the splitting op: traced by FX, it is a ``get_attr``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = attention(x * self.scale, x, x)
        return y * self.scale


def test_a_get_attr_keeps_its_value_even_beside_its_only_user() -> None:
    """``split_module`` gives a ``get_attr`` no piece: it hands it to every piece using it as
    an input, with its value. So each is kept, also one whose only user follows it in the
    same piece (``scale_1``, read after the splitting op)."""
    gm = torch.fx.symbolic_trace(_Scaled())
    attrs = sorted(n.name for n in gm.graph.nodes if n.op == "get_attr")
    assert attrs == ["scale", "scale_1"]
    keep = values_the_split_reads(gm, [OP_NAME])
    assert set(attrs) <= keep
    assert {"x", "mul", "empty_like", "mul_1"} <= keep  # (each crosses a piece boundary)


def _saved_blob(root: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The graph blob of the saved trace under ``root`` (captured from a warm start's load)."""
    blobs: list[bytes] = []
    real = cached_trace._load_graph

    def load(blob: bytes, valued: Any) -> Any:
        blobs.append(blob)
        return real(blob, valued)

    monkeypatch.setattr(cached_trace, "_load_graph", load)
    _start(root)
    (blob,) = blobs
    return blob


def test_a_trace_whose_values_cannot_be_written_is_not_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(value: Any) -> Any:
        raise TypeError("cannot write this value")

    with monkeypatch.context() as patch:
        patch.setattr(trace_backend, "_detached", refuse)
        cold, cold_out = _start(tmp_path)
    assert (cold.stats.traces_not_saved, cold.stats.artifacts_saved) == (1, 0)
    spy = _Spy(monkeypatch)
    warm, warm_out = _start(tmp_path)
    assert (warm.stats.traces_loaded, warm.stats.graphs_traced, spy.loads) == (0, 1, [])
    assert torch.equal(warm_out, cold_out)


def test_a_graph_whose_values_do_not_all_come_back_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _start(tmp_path)
    blob = _saved_blob(tmp_path, monkeypatch)
    with pytest.raises(CacheError, match=r"the fake values of \['no_such_node'\] did not"):
        saved_trace._load_graph(blob, ["l_x_", "no_such_node"])
    with pytest.raises(CacheError, match="no list of its stored fake values"):
        saved_trace._load_graph(blob, None)  # (an older version's trace)
    gm, inputs = saved_trace._load_graph(blob, ["l_x_"])
    assert len(inputs) == sum(1 for n in gm.graph.nodes if n.op == "placeholder")
