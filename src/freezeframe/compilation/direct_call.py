"""Calling the traced graph without the Python code Dynamo generated around it.

Dynamo turns ``forward`` into bytecode that gathers the graph's inputs from the frame (the
arguments, each parameter read through its module path, each dynamic size), calls the
compiled graph, and builds the return value from its outputs. Around that it keeps hooks of
its own (a profiling record before and after, each size read through a helper behind a
``torch._dynamo.disable`` wrapper, the graph call behind another): on the development CPU
about 15 us per call, more than a small model's pieces cost. A :class:`DirectCall` does the
same work in plain Python, built once from the trace::

    Dynamo's bytecode                              DirectCall
    -----------------                              ----------
    record_pregraph_bytecode_enter()
    s0 = call_size(x, 0)                           bind(self, x) ->
    w = L['self']._modules['lin']._parameters['weight']    (x.size()[0], x, <the same path>)
    record_pregraph_bytecode_exit()
    out = __compiled_fn(s0, x, w)  # disable wrapper  out = stitched(*inputs)
    return out[0]                                  return rebuild(out)

The graph inputs are evaluated from their Dynamo *sources* (``L['x'].size()[0]``, the
parameter paths) in the rebuilt frame of ``forward`` (the same machinery a warm start uses,
:mod:`freezeframe.compilation.saved_trace`), so a replaced parameter is read anew on every
call as Dynamo's code would. A direct call is built only when it provably does the same work:
the generated code has no Python side effect (:func:`free_of_side_effects`), every graph input
has a plain source, every returned tensor is a graph output, and, on the call that builds it,
the bound inputs are the very objects (tensors) and values (sizes) Dynamo's code passed.
Anything else keeps calling the bytecode.
"""

from __future__ import annotations

import dis
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from freezeframe.compilation.saved_trace import _Frame

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.compilation.trace import TraceOnce

__all__ = ["DirectCall", "Stitched", "direct_call", "free_of_side_effects", "rebuilder"]


class Stitched:
    """What Dynamo's code (or a saved trace) calls with the flat graph inputs: the compiled
    stitching graph, which records its calls' inputs and outputs while ``recording`` is a
    list (:meth:`CompiledModel.plan_piecewise`)."""

    __slots__ = ("fn", "recording")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.recording: list[tuple[tuple[Any, ...], Any]] | None = None

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
    if code is None:  # no bytecode: a saved trace, which already assumes no side effects
        return trace.traced
    for ins in dis.get_instructions(code):
        if ins.opname in _SIDE_EFFECT_OPS:
            return False
        if ins.opname in _NAME_OPS and ins.argval in _SIDE_EFFECT_NAMES:
            return False
    return True


def rebuilder(out: Any, flat_out: Any) -> Callable[[Any], Any] | None:
    """A function that builds the model's output from the stitching graph's outputs as Dynamo's
    code did for ``out``; None unless every tensor of ``out`` is one of them."""
    flat = list(flat_out) if isinstance(flat_out, (tuple, list)) else [flat_out]
    leaves, spec = pytree.tree_flatten(out)
    picks: list[int | None] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            where = next((j for j, t in enumerate(flat) if t is leaf), None)
            if where is None:
                return None
            picks.append(where)
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            picks.append(None)  # a constant of the trace
        else:
            return None
    single = isinstance(flat_out, (tuple, list))
    if len(leaves) == 1 and isinstance(out, torch.Tensor):
        j = picks[0]
        return (lambda f: f[j]) if single else (lambda f: f)
    constants = list(leaves)

    def rebuild(f: Any) -> Any:
        items = f if single else (f,)
        values = [constants[k] if j is None else items[j] for k, j in enumerate(picks)]
        return pytree.tree_unflatten(values, spec)

    return rebuild


class DirectCall:
    """``forward`` on a call's arguments without Dynamo's bytecode (see the module
    docstring)."""

    __slots__ = ("_bind", "_module", "_rebuild", "_stitched")

    def __init__(self, module: Any, bind: Callable[..., tuple[Any, ...]], stitched: Stitched,
                 rebuild: Callable[[Any], Any]) -> None:
        self._module = module
        self._bind = bind
        self._stitched = stitched
        self._rebuild = rebuild

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._rebuild(self._stitched(*self._bind(self._module, *args, **kwargs)))


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
        bind = _Frame(module, "forward").function(f"({', '.join(map(str, sources))},)")
        bound = bind(module, *args, **kwargs)
    except Exception:  # a source this frame cannot evaluate: keep the bytecode
        return None
    if len(bound) != len(flat_in) or not all(map(_same_input, bound, flat_in)):
        return None
    return DirectCall(module, bind, stitched, rebuild)


def _same_input(bound: Any, passed: Any) -> bool:
    if isinstance(passed, torch.Tensor):
        return bound is passed
    return type(bound) is type(passed) and bound == passed
