"""Split a traced FX graph at *splitting ops* into an ordered list of pieces.

A splitting op (attention, a collective, anything that must run outside a captured graph) gets
a piece of its own; everything between two splitting ops becomes one *capturable* piece. The
pieces are stitched back together by a small top-level ``GraphModule`` whose ``submod_<i>``
children run in the original order, so in-place mutations (an attention op writing its output
buffer) happen exactly where they did in the model.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

__all__ = ["Piece", "SplitGraph", "matches_splitting_op", "split_graph"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One piece of a split graph.

    ``index`` is the piece's position in execution order; ``name`` the attribute of the
    stitching module that runs it (``submod_<id>``). A splitting-op piece is never compiled or
    captured: it runs eagerly between the captured pieces, which is why ``capturable`` is its
    negation.
    """

    index: int
    name: str
    graph: fx.GraphModule
    is_splitting_op: bool

    @property
    def capturable(self) -> bool:
        return not self.is_splitting_op


@dataclasses.dataclass(frozen=True)
class SplitGraph:
    """The stitching module and its pieces in execution order."""

    stitching: fx.GraphModule
    pieces: tuple[Piece, ...]

    @property
    def capturable(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if p.capturable)


def _op_names(target: Any) -> tuple[str, str | None] | None:
    """``(packet_name, overload_name)`` of an op registered with ``torch.library``, or None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name, target._overloadname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name, None
    return None


def matches_splitting_op(target: Any, splitting_ops: Iterable[str]) -> bool:
    """Whether a ``call_function`` target is one of ``splitting_ops``.

    ``"ns::op"`` matches the packet and every overload of it; ``"ns::op.overload"`` matches
    only that overload (a bare packet target does not say which overload runs, so it does not
    match an overload-specific name).
    """
    names = _op_names(target)
    if names is None:
        return False
    packet, overload = names
    for wanted in splitting_ops:
        if wanted == packet:
            return True
        if overload is not None and wanted == f"{packet}.{overload}":
            return True
    return False


def split_graph(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> SplitGraph:
    """Split ``gm`` so that every splitting-op node is a piece of its own.

    N non-adjacent splitting ops, none first or last, give 2N+1 pieces of which N+1 are
    capturable. A ``getitem`` on the result of a splitting op stays in the op's piece, so a
    captured piece never starts by unpacking an eager op's tuple.
    """
    piece_of: dict[fx.Node, int] = {}
    splitting_ids: set[int] = set()
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and matches_splitting_op(node.target, splitting_ops):
            current += 1
            piece_of[node] = current
            splitting_ids.add(current)
            current += 1
        elif (node.op == "call_function" and node.target is operator.getitem
              and isinstance(node.args[0], fx.Node)
              and piece_of.get(node.args[0]) in splitting_ids):
            piece_of[node] = piece_of[node.args[0]]
        else:
            piece_of[node] = current

    # keep_original_order: mutations by splitting ops must stay where the model put them.
    stitching = split_module(gm, None, lambda node: piece_of[node],  # type: ignore[arg-type]
                             keep_original_order=True)

    names = sorted((n for n, _ in stitching.named_children() if n.startswith("submod_")),
                   key=lambda n: int(n.split("_", 1)[1]))
    pieces = []
    for index, name in enumerate(names):
        sub = getattr(stitching, name)
        pieces.append(Piece(index=index, name=name, graph=sub,
                            is_splitting_op=int(name.split("_", 1)[1]) in splitting_ids))
    logger.debug("split graph into %d pieces (%d at splitting ops %s)", len(pieces),
                 len(splitting_ids), list(splitting_ops))
    return SplitGraph(stitching=stitching, pieces=tuple(pieces))
