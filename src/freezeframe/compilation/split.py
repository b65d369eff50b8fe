"""Split a traced FX graph at *splitting ops* into an ordered list of pieces.

A splitting op (attention, a collective, anything that must run outside a captured graph) gets
a piece of its own; everything between two splitting ops becomes one *capturable* piece. The
pieces are stitched back together by a small top-level ``GraphModule`` whose ``submod_<i>``
children run in the original order, so in-place mutations (an attention op writing its output
buffer) happen exactly where they did in the model.

Splitting-op names are checked against torch's op registry by :func:`check_splitting_ops`
(the compile path calls it in ``ff.compile``): a name that resolves to no registered op is a
:class:`~freezeframe.errors.ConfigError` naming the closest registered names, because a typo
would otherwise leave the op silently inside a captured piece.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import operator
import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from freezeframe.config import CompilationConfig, CompilationMode
from freezeframe.errors import ConfigError

__all__ = [
    "Piece",
    "SplitGraph",
    "check_splitting_ops",
    "fx_forward",
    "matches_splitting_op",
    "split_graph",
    "splitting_ops_of",
    "values_the_split_reads",
]

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
    """The stitching module, its pieces in execution order, and the splitting-op names that
    matched at least one node of the graph (``matched_ops``, a subset of the names asked for)."""

    stitching: fx.GraphModule
    pieces: tuple[Piece, ...]
    matched_ops: frozenset[str] = frozenset()

    @property
    def capturable(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if p.capturable)


# The modules of torch's C bindings of ATen ops, as Dynamo records them in a graph
# (``F.scaled_dot_product_attention`` is ``torch._C._nn.scaled_dot_product_attention``)
_ATEN_BINDINGS = ("torch", "torch._C._nn", "torch._C._VariableFunctions", "torch._C._linalg",
                  "torch._C._fft", "torch._C._special")


def _op_names(target: Any) -> tuple[str, str | None] | None:
    """``(packet_name, overload_name)`` of an op registered with ``torch.library``, or None.
    A builtin torch function that binds an ATen op (what Dynamo records for
    ``F.scaled_dot_product_attention``) is that op's packet: ``aten::scaled_dot_product_attention``
    matches it, so an ordinary module can be split at SDPA without a custom op."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name, target._overloadname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name, None
    if (isinstance(target, types.BuiltinFunctionType)
            and getattr(target, "__module__", None) in _ATEN_BINDINGS
            and isinstance(getattr(torch.ops.aten, target.__name__, None),
                           torch._ops.OpOverloadPacket)):
        return f"aten::{target.__name__}", None
    return None


def _matching_ops(target: Any, splitting_ops: Iterable[str]) -> list[str]:
    """Every name in ``splitting_ops`` that ``target`` matches."""
    names = _op_names(target)
    if names is None:
        return []
    packet, overload = names
    return [wanted for wanted in splitting_ops
            if wanted == packet or (overload is not None and wanted == f"{packet}.{overload}")]


def matches_splitting_op(target: Any, splitting_ops: Iterable[str]) -> bool:
    """Whether a ``call_function`` target is one of ``splitting_ops``.

    ``"ns::op"`` matches the packet and every overload of it; ``"ns::op.overload"`` matches
    only that overload (a bare packet target does not say which overload runs, so it does not
    match an overload-specific name).
    """
    return bool(_matching_ops(target, splitting_ops))


# -- registry check -------------------------------------------------------------------------------
_MAX_LISTED = 12  # registered names listed in an error, at most


def _packet(namespace: str, op: str) -> torch._ops.OpOverloadPacket | None:
    """The registered op ``namespace::op``, or None. ``torch.ops.<ns>.<op>`` resolves an op
    from the dispatcher (and TorchScript's registry) on first access."""
    try:
        found = getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return None
    return found if isinstance(found, torch._ops.OpOverloadPacket) else None


def _registered_ops() -> dict[str, set[str]]:
    """Namespace -> op names (overloads dropped) of every op the dispatcher knows."""
    out: dict[str, set[str]] = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = qualified.partition("::")
        out.setdefault(namespace, set()).add(rest.partition(".")[0])
    return out


def _is_subsequence(short: str, long: str) -> bool:
    chars = iter(long)
    return all(c in chars for c in short)


def _closest(word: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` candidates close to ``word``: difflib's close matches, with candidates that
    ``word`` abbreviates (its letters in order, "atn" for "attention") ranked first."""
    pool = set(candidates)
    close = set(difflib.get_close_matches(word, pool, n=n, cutoff=0.5))
    close.update(c for c in pool if len(word) >= 2 and _is_subsequence(word, c))

    def rank(c: str) -> tuple[bool, float, str]:
        return (not _is_subsequence(word, c), -difflib.SequenceMatcher(None, word, c).ratio(), c)

    return sorted(close, key=rank)[:n]


def _listing(names: Iterable[str]) -> str:
    ordered = sorted(names)
    more = f", ... ({len(ordered) - _MAX_LISTED} more)" if len(ordered) > _MAX_LISTED else ""
    return ", ".join(ordered[:_MAX_LISTED]) + more


def _registration_problem(name: str, registry: dict[str, set[str]]) -> str | None:
    """Why ``name`` (``ns::op`` or ``ns::op.overload``) names no registered op, or None."""
    namespace, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    packet = _packet(namespace, op)
    if packet is not None:
        if overload and overload not in packet.overloads():
            return (f"{name!r}: op '{namespace}::{op}' has no overload {overload!r}; its "
                    f"overloads are {sorted(packet.overloads())}; write '{namespace}::{op}' "
                    "for all overloads")
        return None
    ops = registry.get(namespace)
    if ops:
        close = _closest(op, ops)
        guess = (f"did you mean {' or '.join(repr(f'{namespace}::{c}') for c in close)}?"
                 if close else "no registered op of that namespace has a close name")
        return (f"{name!r} is not a registered op; {guess} (ops registered in namespace "
                f"{namespace!r}: {_listing(ops)})")
    spaces = _closest(namespace, registry)
    guesses = [f"{ns}::{c}" for ns in spaces for c in _closest(op, registry[ns], n=1)]
    guess = f"did you mean {' or '.join(map(repr, guesses))}? " if guesses else ""
    near = (f"closest namespaces: {', '.join(map(repr, spaces))}" if spaces
            else "no registered namespace has a close name")
    return f"{name!r}: no op is registered in namespace {namespace!r}; {guess}({near})"


def check_splitting_ops(names: Iterable[str]) -> None:
    """Raise :class:`ConfigError` when a splitting-op name resolves to no registered op.

    ``names`` are normalised config names (``ns::op`` or ``ns::op.overload``). Ops defined with
    ``torch.library`` are registered when the module defining them is imported, so the check
    belongs where the model is compiled, not where the config is built. Every bad name is
    reported in one error, each with the closest registered names.
    """
    registry: dict[str, set[str]] | None = None
    problems = []
    for name in names:
        namespace, _, rest = name.partition("::")
        if _packet(namespace, rest.partition(".")[0]) is not None and "." not in rest:
            continue  # the common case: no need to list the whole registry
        if registry is None:
            registry = _registered_ops()
        problem = _registration_problem(name, registry)
        if problem is not None:
            problems.append(problem)
    if problems:
        raise ConfigError(
            "splitting_ops: " + "; ".join(problems) + ". Fix the name, or import the module "
            "that registers the op (torch.library.custom_op or Library.define) before "
            "ff.compile")


def splitting_ops_of(config: CompilationConfig) -> tuple[str, ...]:
    """The ops a compiled model's graph is split at: the config's ``splitting_ops``, none when
    the graph is compiled whole (``DYNAMO_TRACE_ONCE``)."""
    if config.mode is CompilationMode.DYNAMO_TRACE_ONCE:
        return ()
    return tuple(config.splitting_ops or ())


def _assign_pieces(gm: fx.GraphModule, splitting_ops: Sequence[str]
                   ) -> tuple[dict[fx.Node, int], set[int], set[str]]:
    """Each node's piece number (placeholders and the output have none; a ``get_attr`` has one
    here, though ``split_module`` gives it none and hands it to every piece that uses it), the
    numbers of the splitting-op pieces, and the splitting ops that matched a node."""
    piece_of: dict[fx.Node, int] = {}
    splitting_ids: set[int] = set()
    matched: set[str] = set()
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        hits = _matching_ops(node.target, splitting_ops) if node.op == "call_function" else []
        if hits:
            matched.update(hits)
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
    return piece_of, splitting_ids, matched


def values_the_split_reads(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> set[str]:
    """The names of the nodes whose fake values :func:`split_graph` reads (``split_module``
    reads ``example_value``), so that a graph holding only these splits into the same pieces as
    one holding every node's: the placeholders and ``get_attr`` nodes (each becomes an input,
    with its value, of every piece that uses it); every node whose value is not a tensor (a
    symbolic size binds its symbol where it is first seen); every node whose value another
    piece, or the graph's output, uses (its symbolic sizes become that piece's inputs; each
    piece's placeholders take their values from these); and, as a precaution, every tensor
    whose ``size()`` is taken whole (``split_module`` has code that rewrites such a call per
    dimension from the tensor's value, unused in torch 2.13). The other nodes' values are not
    needed to compile a piece: Inductor traces it again from its inputs' values. (Re-deriving
    them by fake propagation would be wrong: outside Dynamo's tracing context an op like
    ``F.pad`` reads a symbolic size as an int, which pins the size to the traced one.)"""
    piece_of = _assign_pieces(gm, splitting_ops)[0]
    keep: set[str] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            keep.add(node.name)
            continue
        if (node.op == "call_method" and node.target == "size" and len(node.args) == 1
                and not node.kwargs and isinstance(node.args[0], fx.Node)):
            keep.add(node.args[0].name)
        value = node.meta.get("example_value", node.meta.get("val"))
        home = piece_of.get(node)
        if (value is not None and not isinstance(value, torch.Tensor)) or any(
                user.op == "output" or piece_of.get(user) != home for user in node.users):
            keep.add(node.name)  # (a size, a tuple of tensors: cheap, and read as it is)
    return keep


def split_graph(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> SplitGraph:
    """Split ``gm`` so that every splitting-op node is a piece of its own.

    N non-adjacent splitting ops, none first or last, give 2N+1 pieces of which N+1 are
    capturable. A ``getitem`` on the result of a splitting op stays in the op's piece, so a
    captured piece never starts by unpacking an eager op's tuple.
    """
    piece_of, splitting_ids, matched = _assign_pieces(gm, splitting_ops)
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
    return SplitGraph(stitching=stitching, pieces=tuple(pieces), matched_ops=frozenset(matched))


def fx_forward(gm: fx.GraphModule) -> Any:
    """``gm``'s generated ``forward``, bound, for calling on every step without
    ``nn.Module.__call__`` (its hook checks and fx's call wrapper cost more than a small
    piece's work). The code of a lazy GraphModule (what ``split_module`` and Dynamo make) is
    generated first: its ``forward`` before that is a stub that goes back through
    ``__call__`` on every call."""
    recompile = getattr(gm, "real_recompile", None)
    if recompile is not None:
        recompile()
    return gm.forward
