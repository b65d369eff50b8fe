"""The Dynamo backend of one trace: its stages, each returning data.

Dynamo calls :class:`TraceBackend` once, with the traced FX graph and fake example inputs; a
warm start that loads a saved trace calls its :meth:`~TraceBackend.build` with the stored graph
instead. The stages, in order::

    gm ──keep (cache on)──► KeptTrace       what saving the trace will need, taken while the
     │                                      graph still holds its fake values
     ├──build────────────► Built            split -> compile each piece (load or compile) ->
     │                                      wrap (CompileBackend) -> stitch (Stitched), and the
     │                                      source of each graph input
     └──sizes────────────► SizeConditions   the trace's conditions on dynamic sizes

Each result stays on the backend as data for whoever reads it after the first call: the
variant (``built``), trace-once (``sizes``) and the cache's save step (``kept``, ``outputs``).
Saving the trace is a step after the first call (:mod:`~freezeframe.compilation.cached_trace`),
not a wrapper around this backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from freezeframe.cache.artifacts import PieceCache
from freezeframe.cache.key import traced_files_from_graph
from freezeframe.cache.traced_code import code_digests, traced_code_objects
from freezeframe.compilation.constant_stores import ConstantStore, stores_of_current_trace
from freezeframe.compilation.direct_call import Stitched
from freezeframe.compilation.saved_trace import (
    _KEEP_META,
    _detached,
    _holds_view,
    _OutputRecorder,
    _unviewed,
    _wrapped_frame_code,
    valued_nodes,
)
from freezeframe.compilation.size_conditions import SizeConditions, size_conditions_now
from freezeframe.compilation.split import values_the_split_reads
from freezeframe.errors import CacheError

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.cache.entry import CompileCache
    from freezeframe.compilation.backend import CompileBackend

__all__ = ["Built", "KeptTrace", "TraceBackend", "source_name"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Built:
    """What the build stage made of one graph: the stitched call Dynamo's code (or a saved
    trace) calls with the flat graph inputs, and the Dynamo source of each graph input."""

    stitched: Stitched
    sources: tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class KeptTrace:
    """What saving a first call's trace needs of the graph Dynamo traced (taken inside the
    backend, while the graph holds its fake values), or why it cannot be saved."""

    files: tuple[str, ...]  # source files Dynamo traced (they join the cache key)
    code: Mapping[str, Any]  # digests of traced code without a source file (also the key)
    frame: str | None  # which frame Dynamo traced: "forward", "wrapped", or None (another)
    # forward's side effects, when all are constant stores a saved trace can repeat
    stores: tuple[ConstantStore, ...] | None
    graph: bytes | None = None  # the pickled graph; None: not saved (see ``not_saved``)
    valued: tuple[str, ...] = ()  # the nodes the graph blob holds a fake value for
    sources: tuple[str, ...] = ()  # each graph input's source (``L['x']``)
    not_saved: str | None = None  # why this trace cannot be saved


class TraceBackend:
    """The Dynamo backend of one trace (see the module docstring); called once."""

    def __init__(self, pieces: CompileBackend, module: nn.Module,
                 dims: Mapping[str, Sequence[int]], splitting_ops: Sequence[str]) -> None:
        self.pieces = pieces  # split, compile each piece, wrap
        self._module = module
        self._dims = dims
        self._splitting_ops = tuple(splitting_ops)
        self._saving: CompileCache | None = None  # the open cache the trace is kept for
        self.built: Built | None = None
        self.sizes = SizeConditions()
        self.kept: KeptTrace | None = None
        self.outputs: _OutputRecorder | None = None  # the first call's graph outputs

    def save_into(self, cache: CompileCache) -> None:
        """The cache is open for this trace: pieces load from and save to it, and the trace
        Dynamo makes is kept for saving."""
        self._saving = cache
        self.pieces.use_cache(PieceCache(cache))

    def __call__(self, gm: Any, example_inputs: Sequence[Any]) -> Any:
        kept = None
        if self._saving is not None:
            kept = keep_trace(gm, self._module, self._splitting_ops)
            # (before any piece artifact is loaded or saved: they join its key)
            self._saving.add_traced_files(kept.files)
            self._saving.add_traced_code(kept.code)
        built = self.build(gm, example_inputs)
        self.sizes = size_conditions_now(self._dims)
        self.kept = kept
        if kept is not None and kept.graph is not None:
            self.outputs = _OutputRecorder(built.stitched)
            return self.outputs
        return built.stitched

    def build(self, gm: Any, example_inputs: Sequence[Any]) -> Built:
        """Split, compile (or load) each piece, wrap, stitch: the callable the trace's code
        (or a saved trace) calls."""
        stitched = Stitched(self.pieces(gm, example_inputs))
        self.built = Built(stitched, tuple(source_name(n) for n in gm.graph.nodes
                                           if n.op == "placeholder"))
        return self.built


def source_name(node: Any) -> str | None:
    """The name of the Dynamo source a graph placeholder was read from (``L['x']``), if any."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name  # a property in torch 2.13, a method in older builds
    return str(name() if callable(name) else name)


# -- the keep stage -------------------------------------------------------------------------
def keep_trace(gm: Any, module: nn.Module, splitting_ops: Sequence[str]) -> KeptTrace:
    """What saving the trace Dynamo is making (``gm``) needs: the traced files and code for
    the key, the traced frame, forward's constant stores, the sources of the graph inputs
    and the pickled graph; or why it cannot be saved."""
    codes = traced_code_objects()
    kept = KeptTrace(tuple(traced_files_from_graph(gm)), code_digests(codes),
                     _traced_frame_kind(module, codes), stores_of_current_trace())
    sources, why = _input_sources(gm)
    if why is None:
        try:
            from torch.fx._graph_pickler import GraphPickler, Options
        except ImportError:  # pragma: no cover - torch without a graph pickler
            why = "this torch has no graph pickler"
    if why is not None:
        return dataclasses.replace(kept, not_saved=why)
    # Node metadata: only what splitting and Inductor read (Dynamo's own entries hold real
    # tensors and weak references).
    options = Options(ops_filter=None, node_metadata_key_filter=_KEEP_META.__contains__)
    try:
        with _kept_values_only(gm, splitting_ops):
            blob = GraphPickler.dumps(gm, options)
            valued = valued_nodes(gm)
    except Exception as exc:
        logger.debug("graph pickling failed", exc_info=True)
        return dataclasses.replace(kept, not_saved="the traced graph cannot be serialised "
                                                   f"({type(exc).__name__}: {exc})")
    return dataclasses.replace(kept, graph=blob, valued=tuple(valued), sources=tuple(sources))


def _traced_frame_kind(module: nn.Module, codes: Sequence[types.CodeType]) -> str | None:
    """Which frame Dynamo traced (see ``saved_trace._Frame``), from the first traced code."""
    func = getattr(getattr(module, "forward", None), "__func__", None)
    if not codes or func is None:
        return None
    if codes[0] == func.__code__:  # (a private copy of it: see TraceOnce)
        return "forward"
    if codes[0] is _wrapped_frame_code():
        return "wrapped"
    return None


def _input_sources(gm: Any) -> tuple[list[str], str | None]:
    """The sources the traced graph's inputs are read from (``L['x']``, ``G['consts'].T``), in
    placeholder order, and why the trace cannot be saved when one has no such plain source (a
    saved trace rebinds each input from its source, without Dynamo's bytecode)."""
    sources: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = source_name(node)
        if name is None or not (name.startswith("L[") or name.startswith("G[")):
            return sources, f"graph input {node.name} has no plain source"
        sources.append(name)
    return sources, None


@contextlib.contextmanager
def _kept_values_only(gm: Any, splitting_ops: Sequence[str]) -> Iterator[None]:
    """The traced graph as a saved trace stores it, for the duration of the block; its node
    metadata is restored on the way out, whatever happens.

    A placeholder that is a view (say a reshaped block table) is stored as a plain tensor of the
    same sizes and strides: what the graph sees, without the view's base. So is every fake value
    the split reads (:func:`~freezeframe.compilation.split.values_the_split_reads`: the values
    crossing piece boundaries, sizes), a view as its ``detach()`` (the graph pickler cannot
    write a view's base), so a warm start need not re-derive them by fake propagation through
    the whole graph; :func:`valued_nodes` lists the nodes stored with one. The values inside
    pieces are left out (most of them: unpickling one costs about 2 ms); a piece compiled on a
    warm start is traced again by Inductor from its inputs' values. A trace whose kept values
    cannot be written (state the pickler cannot write) is not saved: re-deriving them by fake
    propagation outside Dynamo's tracing context can pin a symbolic size to the traced one (an
    op that reads it as an int), so warm starts trace it with Dynamo instead (its pieces'
    artifacts still load).
    """
    replaced: dict[tuple[Any, str], Any] = {}

    def put(node: Any, key: str, value: Any) -> None:
        replaced.setdefault((node, key), node.meta[key])
        node.meta[key] = value

    try:
        for node in gm.graph.nodes:
            for key in ("example_value", "val"):
                if key in node.meta and node.op == "placeholder":
                    put(node, key, _unviewed(node.meta[key]))
        keep = values_the_split_reads(gm, splitting_ops)
        for node in gm.graph.nodes:
            for key in ("example_value", "val"):
                if key not in node.meta or node.op == "placeholder":
                    continue
                if node.name not in keep:
                    replaced.setdefault((node, key), node.meta[key])
                    del node.meta[key]
                    continue
                put(node, key, _detached(node.meta[key]))
                if _holds_view(node.meta[key]):
                    raise CacheError(f"the value of {node.name} is still a view")
        yield
    finally:
        for (node, key), value in replaced.items():
            node.meta[key] = value
