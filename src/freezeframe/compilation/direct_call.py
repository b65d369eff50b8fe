"""Calling the traced graph without the Python code Dynamo generated around it.

Dynamo turns ``forward`` into bytecode that gathers the graph's inputs from the frame (the
arguments, each parameter read through its module path, each dynamic size), calls the
compiled graph, and builds the return value from its outputs. Around that it keeps hooks of
its own (a profiling record before and after, each size read through a helper behind a
``torch._dynamo.disable`` wrapper, the graph call behind another): on the development CPU
about 15 us per call, more than a small model's pieces cost. A :class:`DirectCall` does the
same work in one function generated once from the trace::

    Dynamo's bytecode                              DirectCall.call
    -----------------                              ---------------
    record_pregraph_bytecode_enter()               def _f(self, x):
    s0 = call_size(x, 0)                               _ff_r0 = self._modules  # shared heads
    w = L['self']._modules['lin']._parameters['weight']
    record_pregraph_bytecode_exit()                    return _ff_stitched(x.size()[0], x,
    out = __compiled_fn(s0, x, w)  # disable wrapper       _ff_r0['lin']._parameters['weight']
    return out[0]                                      )[0]

The graph inputs are evaluated from their Dynamo *sources* (``L['x'].size()[0]``, the
parameter paths) in the rebuilt frame of ``forward`` (the same machinery a warm start uses,
:mod:`freezeframe.compilation.saved_trace`), so a replaced parameter is read anew on every
call as Dynamo's code would. A direct call is built only when it provably does the same work:
the generated code has no Python side effect (:func:`free_of_side_effects`), every graph input
has a plain source, every returned tensor is a graph output, and, on the call that builds it,
the bound inputs are the very objects (tensors) and values (sizes) Dynamo's code passed.
Anything else keeps calling the bytecode. For calls of one exact shape, :func:`sized_call`
makes the same function call the stitching graph's code with each piece's compiled entry for
that shape bound in (:func:`planned_stitching`), so no piece picks its entry per call.
"""

from __future__ import annotations

import dis
import inspect
import operator
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from freezeframe.compilation.saved_trace import _Frame

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.compilation.piecewise import PiecewiseBackend
    from freezeframe.compilation.trace import TraceOnce

__all__ = ["DirectCall", "Stitched", "direct_call", "free_of_side_effects", "planned_stitching",
           "rebuilder", "sized_call"]


class Stitched:
    """What Dynamo's code (or a saved trace) calls with the flat graph inputs: the compiled
    stitching graph, which records its calls' inputs and outputs while ``recording`` is a
    list (a runner's first PIECEWISE step of a shape: ``graph_steps.PieceRecording``; the
    direct call's construction)."""

    __slots__ = ("fn", "pure", "recording")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.recording: list[tuple[tuple[Any, ...], Any]] | None = None
        # whether the trace's generated code does nothing but call this graph
        # (free_of_side_effects), once worked out: a runner asks at each padded size
        self.pure: bool | None = None

    def calls(self, stitching: Any) -> bool:
        """Whether this calls ``stitching``'s own forward (not behind cudagraph_copy_inputs'
        copies), so that its code with other piece attributes (:func:`planned_stitching`)
        does the same work."""
        fn = self.fn
        return inspect.ismethod(fn) and fn.__self__ is stitching

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        if self.recording is not None:
            self.recording.append((args, out))
        return out


# Bytecode that changes Python state outside the graph: a direct call (and a runner's planned
# step) skips the generated code, so a trace whose code does any of this keeps it. Dynamo
# replays a forward's mutations after the graph call with stores, or with calls it names (an
# attribute set through ``object_setattr_ignore_descriptor``, a dict through
# ``clear``/``update``...); the check refuses every name that could mutate, so it errs towards
# keeping the bytecode.
_SIDE_EFFECT_OPS = frozenset({"STORE_ATTR", "DELETE_ATTR", "STORE_SUBSCR", "DELETE_SUBSCR",
                              "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_DEREF", "DELETE_DEREF",
                              "STORE_NAME", "DELETE_NAME"})
_SIDE_EFFECT_NAMES = frozenset({
    "setattr", "delattr", "object_setattr_ignore_descriptor", "__setattr__", "__delattr__",
    "__setitem__", "__delitem__", "append", "extend", "insert", "pop", "remove", "clear",
    "update", "setdefault", "popitem", "add", "discard", "sort", "reverse"})
_NAME_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME"})


def free_of_side_effects(trace: TraceOnce) -> bool:
    """Whether the code Dynamo generated for ``forward`` does nothing but call the graph."""
    code = trace.bytecode
    if code is None:  # a saved trace: its forward repeats the stores it was saved with, if any
        return trace.traced or trace.loaded_side_effects is False
    for ins in dis.get_instructions(code):
        if ins.opname in _SIDE_EFFECT_OPS:
            return False
        if ins.opname in _NAME_OPS and ins.argval in _SIDE_EFFECT_NAMES:
            return False
    return True


def rebuilder(out: Any, flat_out: Any) -> Callable[[Any], Any] | None:
    """A function that builds the model's output from the stitching graph's outputs as Dynamo's
    code did for ``out``; None unless every tensor of ``out`` is one of them and every other
    leaf is None or a string."""
    flat = list(flat_out) if isinstance(flat_out, (tuple, list)) else [flat_out]
    leaves, spec = pytree.tree_flatten(out)
    picks: list[int | None] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            where = next((j for j, t in enumerate(flat) if t is leaf), None)
            if where is None:
                return None
            picks.append(where)
        elif leaf is None or isinstance(leaf, str):
            picks.append(None)  # a constant of the trace
        else:
            # a number may come from a size (``return h, x.shape[0]``): Dynamo's code computes
            # it anew on every call, so the code stays
            return None
    single = isinstance(flat_out, (tuple, list))
    if len(leaves) == 1 and isinstance(out, torch.Tensor):
        j = picks[0]
        return operator.itemgetter(j) if single else _whole
    constants = list(leaves)

    def rebuild(f: Any) -> Any:
        items = f if single else (f,)
        values = [constants[k] if j is None else items[j] for k, j in enumerate(picks)]
        return pytree.tree_unflatten(values, spec)

    return rebuild


# A Dynamo source as direct calls read it: a frame local, then attribute reads, string or
# integer subscripts and argument-less method calls (``L['self']._modules['mlp']._parameters
# ['weight']``, ``L['x'].size()[0]``).
_NAME = r"[A-Za-z_]\w*"
_LOCAL = re.compile(rf"L\['({_NAME})'\]")
_STEP = rf"\.{_NAME}\(\)|\.{_NAME}|\['[^'\\]*'\]|\[-?\d+\]"
_SOURCE = re.compile(rf"(?P<root>{_LOCAL.pattern}|{_NAME})(?P<steps>(?:{_STEP})*)")
_STEPS = re.compile(_STEP)


def _by_name(source: str, parameters: frozenset[str]) -> str:
    """``source`` with a leading ``L['x']`` read as the parameter ``x`` itself (a frame local
    the generated function has by name), unless ``x`` is named like the frame's own ``L`` or
    ``G`` (a parameter named ``_ff_*`` keeps the bytecode: see :class:`DirectCall`)."""
    match = _LOCAL.match(source)
    if match is None or match[1] not in parameters or match[1] in ("L", "G"):
        return source
    return match[1] + source[match.end():]


def shared_reads(sources: Sequence[str]) -> tuple[list[str], list[str]]:
    """The graph inputs' ``sources`` rewritten to read each shared prefix once, as Dynamo's own
    code does: ``(lines, exprs)``, where ``lines`` assign the shared prefixes to locals and
    ``exprs`` read each source from them. A 12-layer model's 52 parameter paths share their
    ``L['self']._modules['layers']._modules['3']...`` heads; read in full, they cost three times
    as much. A source outside the plain grammar is read as it is::

        L['self']._modules['a']._parameters['w']      _ff_r0 = L['self']._modules
        L['self']._modules['b']._parameters['w']  ->  (_ff_r0['a']._parameters['w'],
                                                       _ff_r0['b']._parameters['w'])
    """
    paths: list[tuple[str, ...] | None] = []
    for source in sources:
        match = _SOURCE.fullmatch(source)
        paths.append(None if match is None
                     else (match["root"], *_STEPS.findall(match["steps"])))
    count: dict[tuple[str, ...], int] = {}
    for path in paths:
        for k in range(1, len(path or ()) + 1):
            prefix = path[:k]  # type: ignore[index]
            count[prefix] = count.get(prefix, 0) + 1
    # a prefix is named where the sources sharing it part ways (no one step continues all)
    continued = {prefix[:-1] for prefix, n in count.items()
                 if len(prefix) > 1 and n == count[prefix[:-1]]}
    names: dict[tuple[str, ...], str] = {}
    lines: list[str] = []

    def read(path: tuple[str, ...]) -> str:
        for k in range(len(path), 0, -1):  # from the longest named prefix
            name = names.get(path[:k])
            if name is not None:
                return name + "".join(path[k:])
        return "".join(path)

    for prefix in sorted(count, key=len):
        if count[prefix] > 1 and prefix not in continued and len(prefix) > 1:
            expr = read(prefix)
            names[prefix] = f"_ff_r{len(names)}"
            lines.append(f"{names[prefix]} = {expr}")
    exprs = [source if path is None else read(path) for source, path in zip(sources, paths,
                                                                            strict=True)]
    return lines, exprs


def _whole(flat_out: Any) -> Any:
    """The rebuild of an output that is the graph's one output itself."""
    return flat_out


class DirectCall:
    """``forward`` on a call's arguments without Dynamo's bytecode (see the module
    docstring): :attr:`call` is one generated function, bound to the module, that evaluates
    the graph inputs' sources, calls ``stitched`` on them and rebuilds the output. ``stitched``
    is the compiled graph (a :class:`Stitched`), or, for calls of one exact shape, the
    stitching graph with each piece's entry for that shape bound in (:func:`sized_call`)."""

    __slots__ = ("_frame", "_module", "_rebuild", "_sources", "bind", "call")

    def __init__(self, module: Any, frame: _Frame, sources: Sequence[str],
                 stitched: Callable[..., Any], rebuild: Callable[[Any], Any]) -> None:
        if any(name.startswith("_ff_") for name in frame.parameters):
            # (the generated code's own names would be hidden by such a parameter)
            raise ValueError("forward has a parameter named like the direct call's names")
        self._module, self._frame, self._sources, self._rebuild = module, frame, sources, rebuild
        lines, exprs = shared_reads([_by_name(source, frame.parameters)
                                     for source in sources])
        # the frame's locals dict only where a source still reads it
        needs_locals = any("L[" in text for text in (*lines, *exprs))
        inputs = ", ".join(exprs)
        self.bind: Callable[..., tuple[Any, ...]] = types.MethodType(
            frame.function(f"({inputs},)", lines, frame_locals=needs_locals), module)
        graph = f"_ff_stitched({inputs})"
        body = graph if rebuild is _whole else f"_ff_rebuild({graph})"
        self.call: Callable[..., Any] = types.MethodType(
            frame.function(body, lines, frame_locals=needs_locals, _ff_stitched=stitched,
                           _ff_rebuild=rebuild), module)

    def calling(self, stitched: Callable[..., Any]) -> DirectCall:
        """The same direct call with the graph inputs passed to ``stitched`` instead."""
        return DirectCall(self._module, self._frame, self._sources, stitched, self._rebuild)

    def rebuild(self, flat_out: Any) -> Any:
        return self._rebuild(flat_out)


class _Chooser:
    """Stands in for one piece's :class:`PiecewiseBackend` during one call and keeps the
    compiled entry it ran."""

    __slots__ = ("backend", "chosen")

    def __init__(self, backend: PiecewiseBackend) -> None:
        self.backend = backend
        self.chosen: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        fn = self.chosen = self.backend.entry_for(args)
        return fn(*args)


def sized_call(direct: DirectCall, stitching: fx.GraphModule,
               backends: Mapping[str, PiecewiseBackend], known: dict[tuple[int, ...], Any],
               args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, DirectCall]:
    """Make the call ``direct.call(*args, **kwargs)`` and return its output with a
    :class:`DirectCall` for later calls of exactly these shapes: the stitching graph with each
    piece's backend (``backends``, by attribute name) replaced by the compiled entry it ran on
    this call, so such a call picks no entries at all. The entries a call picks follow from
    its exact shapes and plain values (each piece's size is a dynamic size of the inputs), so
    a caller keys the result by :func:`~freezeframe.compilation.signature.exact_key`.

    ``known`` keeps the planned stitching calls already made (:func:`planned_stitching`), by
    the entries they hold: the shapes of one compile range share one. The call runs on
    attributes of its own, so a thread that calls the model meanwhile sees nothing of it."""
    choosers = {name: _Chooser(backend) for name, backend in backends.items()}
    probe = planned_stitching(stitching, choosers)
    out = direct.rebuild(probe(*direct.bind(*args, **kwargs)))
    entries = {name: chooser.chosen for name, chooser in choosers.items()}
    if any(fn is None for fn in entries.values()):  # a piece the call skipped: keep dispatch
        return out, direct
    ids = tuple(id(fn) for fn in entries.values())
    forward = known.get(ids)
    if forward is None:  # (it holds the entries, so their ids stay theirs)
        forward = known[ids] = planned_stitching(stitching, entries)
    return out, direct.calling(forward)


class _Attributes:
    """The attributes a stitching graph's generated code reads from ``self``."""


def planned_stitching(stitching: fx.GraphModule,
                      pieces: Mapping[str, Any]) -> Callable[..., Any]:
    """The stitching module's generated ``forward`` with ``pieces`` in place of its piece
    attributes: the same code object, bound to an object of its own that holds the module's
    attributes (its submodules, parameters and buffers too) with ``pieces`` over them. The
    module keeps its own attributes (the splitting-op pieces among them are plain functions
    already: see ``CompileBackend``), and nothing is copied or generated again (a copy of the
    GraphModule would generate and compile its code anew: milliseconds per copy)."""
    holder = _Attributes()
    attributes = holder.__dict__
    for group in ("_parameters", "_buffers", "_modules"):
        attributes.update(getattr(stitching, group, None) or {})
    attributes.update(stitching.__dict__)
    attributes.update(pieces)
    return types.MethodType(stitching.forward.__func__, holder)  # type: ignore[attr-defined]


def direct_call(module: Any, trace: TraceOnce, sources: Sequence[str | None] | None,
                stitched: Stitched, calls: Sequence[tuple[tuple[Any, ...], Any]], out: Any,
                args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> DirectCall | None:
    """A :class:`DirectCall` for ``forward`` traced as ``trace``, whose graph inputs have the
    Dynamo ``sources`` and whose compiled graph is ``stitched``; or None when it could differ
    from the bytecode. ``calls`` are the (inputs, outputs) of the stitched graph recorded
    while the bytecode ran on ``args``/``kwargs`` and returned ``out``: the direct call must
    bind the same inputs."""
    if trace.bytecode is None or not free_of_side_effects(trace) or len(calls) != 1:
        return None
    if not sources or any(s is None or not s.startswith("L[") for s in sources):
        return None
    flat_in, flat_out = calls[0]
    rebuild = rebuilder(out, flat_out)
    if rebuild is None:
        return None
    try:
        direct = DirectCall(module, _Frame(module, "forward"), [str(s) for s in sources],
                            stitched, rebuild)
        bound = direct.bind(*args, **kwargs)
    except Exception:  # a source this frame cannot evaluate: keep the bytecode
        return None
    if len(bound) != len(flat_in) or not all(map(_same_input, bound, flat_in)):
        return None
    return direct


def _same_input(bound: Any, passed: Any) -> bool:
    if isinstance(passed, torch.Tensor):
        return bound is passed
    return type(bound) is type(passed) and bound == passed
