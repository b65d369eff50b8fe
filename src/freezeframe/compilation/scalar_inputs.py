"""The Python numbers Dynamo hands a graph as inputs, made constants of it when graphs replay.

``torch.compile`` may pass a Python number that forward reads (an argument, an attribute, a
global, a closure cell, a function's default) to its graph as an input instead of a constant:
an int as a ``SymInt`` once its value changed (automatic dynamic) or from the first call with
``dynamic=True``; a float, likewise, as a 0-d float64 tensor the graph reads back with
``.item()`` (with Dynamo's ``specialize_float`` off, its default in torch 2.13). A graph
captured from such code keeps the value of the capturing call: every replay would answer with
it (an int; a float's ``.item()`` runs once, at the capture, which the emulated backend refuses
as it refuses every read back to the host).

So, where a model's calls may be captured, each such input is *specialised* before the graph
is compiled: its value becomes a constant of the graph, guarded by Dynamo
(``guard_scalar``, the guard Dynamo itself adds when a backend asks for a size's value), and
the graph no longer takes it. Dynamo checks that guard on every call and compiles again for
another value, as it does for a number it never made an input; past its ``recompile_limit``
it runs forward eagerly (right answers, no graphs, Dynamo's own warning). Sizes of tensors
(the batch dim) stay symbolic: the graphs are keyed by them.

A number that cannot be specialised (Dynamo gave no value to guard) is refused in a graph
step instead, naming it (:func:`refuse_scalar_capture`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import guard_scalar

from freezeframe.config import CUDAGraphMode
from freezeframe.context import get_forward_context
from freezeframe.errors import CaptureError
from freezeframe.stats import Stats

__all__ = ["ScalarInput", "refuse_scalar_capture", "specialising_scalars"]

logger = logging.getLogger(__name__)

DynamoBackend = Callable[..., Any]  # (graph module, example inputs) -> the compiled callable


@dataclasses.dataclass(frozen=True)
class ScalarInput:
    """One graph input that is a Python number forward read: its place among the graph's
    inputs, where Dynamo read it from (``argument 't'``, ``self.norm.eps``), and the value
    the graph was specialised on (None when it could not be)."""

    index: int
    source: str
    value: int | float | bool | None


def _source_of(node: fx.Node) -> str:
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    name = getattr(source, "name", "")
    return shown_source(str(name() if callable(name) else name))


def _is_size(node: fx.Node) -> bool:
    """Whether a symbolic placeholder stands for a size, stride or offset of a tensor (the
    batch dim): those stay symbolic."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    return isinstance(source, torch._dynamo.source.TensorPropertySource)


def _specialise_one(graph: fx.Graph, node: fx.Node) -> tuple[bool, int | float | bool | None]:
    """Make ``node`` (a placeholder Dynamo made of a Python number) a constant of ``graph``:
    (whether the placeholder is gone, the value), or (False, None) when it is not one or
    cannot be."""
    arg = node.meta.get("grapharg")
    example = node.meta.get("example_value")
    if getattr(arg, "pass_arg_as_tensor", False):
        # a float as a 0-d tensor; its uses read it with .item(), whose value Dynamo keeps
        memo = getattr(example, "item_memo", None)
        readers = [u for u in node.users if u.op == "call_method" and u.target == "item"]
        if memo is None or not readers:
            return False, None
        try:
            value = guard_scalar(memo)
        except Exception:  # (an unbacked value: nothing to guard on)
            return False, None
        for reader in readers:
            reader.replace_all_uses_with(value)  # type: ignore[arg-type]
            graph.erase_node(reader)
        if node.users:  # also read as a tensor: still an input, of a value guarded now
            return False, value
        graph.erase_node(node)
        return True, value
    if isinstance(example, (torch.SymInt, torch.SymFloat, torch.SymBool)) \
            and not _is_size(node):
        try:
            value = guard_scalar(example)
        except Exception:
            return False, None
        node.replace_all_uses_with(value)  # type: ignore[arg-type]
        graph.erase_node(node)
        return True, value
    return False, None


def specialise(gm: fx.GraphModule) -> tuple[list[ScalarInput], list[ScalarInput]]:
    """Specialise every Python-number input of ``gm`` in place (see the module's doc): the
    inputs removed from the graph, and those left (read as a tensor too, or with no value to
    guard: ``value`` None)."""
    removed: list[ScalarInput] = []
    left: list[ScalarInput] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        arg = node.meta.get("grapharg")
        example = node.meta.get("example_value")
        scalar = getattr(arg, "pass_arg_as_tensor", False) or (
            isinstance(example, (torch.SymInt, torch.SymFloat, torch.SymBool))
            and not _is_size(node))
        if not scalar:
            continue
        source = _source_of(node)
        gone, value = _specialise_one(gm.graph, node)
        (removed if gone else left).append(ScalarInput(index, source, value))
    if removed or any(s.value is not None for s in left):
        gm.graph.lint()
        gm.recompile()
    return removed, left


class _Dropping:
    """The compiled graph called with the inputs it still takes. The placeholders are gone
    from the graph Dynamo handed over, which Dynamo's code calls with the inputs of the
    placeholders left (torch 2.13); should a torch version pass the inputs it traced instead
    (``count`` of them), the specialised ones are dropped here."""

    def __init__(self, fn: Callable[..., Any], keep: Sequence[int], count: int) -> None:
        self._fn = fn
        self._keep = tuple(keep)
        self._count = count

    def __call__(self, *args: Any) -> Any:
        if len(args) == self._count:
            return self._fn(*[args[i] for i in self._keep])
        return self._fn(*args)


def specialising_scalars(backend: DynamoBackend, model_key: str, stats: Stats,
                         graph_mode: CUDAGraphMode) -> DynamoBackend:
    """``backend`` (a Dynamo backend whose graphs a forward context captures), each graph it
    is given first rid of its Python-number inputs (:func:`specialise`); counted in
    ``stats.scalar_inputs_specialised`` and logged. An input that could not be specialised
    refuses a graph step naming it (:func:`refuse_scalar_capture`)."""

    def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        removed, left = specialise(gm)
        for scalar in (*removed, *(s for s in left if s.value is not None)):
            stats.inc("scalar_inputs_specialised")
            logger.info("%s: %s is a Python number torch.compile passed to the graph as an "
                        "input; a graph replay would keep one value, so the graph is "
                        "specialised on %r (torch.compile compiles again for another value)",
                        model_key, scalar.source, scalar.value)
        gone = {s.index for s in removed}
        keep = [i for i in range(len(example_inputs)) if i not in gone]
        fn = backend(gm, [example_inputs[i] for i in keep])
        unguarded = [s.source for s in left if s.value is None]
        if unguarded:
            fn = refuse_scalar_capture(fn, unguarded, model_key, graph_mode)
        return _Dropping(fn, keep, len(example_inputs)) if gone else fn

    return compile_graph


def refuse_scalar_capture(fn: Callable[..., Any], names: Sequence[str], model_key: str,
                          graph_mode: CUDAGraphMode) -> Callable[..., Any]:
    """``fn``, refusing to run under a forward context that captures or replays graphs (one
    of ``graph_mode``'s): its graph takes the Python numbers ``names`` as inputs, which a
    captured graph would freeze, and they could not be specialised."""

    def refusing(*args: Any) -> Any:
        ctx = get_forward_context()
        if ctx is not None and ctx.batch_descriptor is not None \
                and ctx.mode is not CUDAGraphMode.NONE and graph_mode.has_mode(ctx.mode):
            raise CaptureError(
                f"{model_key}: {names[0]} is a Python number that torch.compile passes to the "
                "graph as an input whose value it could not fix, so a captured "
                f"{ctx.mode.name} graph would replay the value of its capture. Pass it as a "
                "tensor (torch.tensor(value) on the model's device), which the graph reads on "
                "every replay, or keep it the same in every call")
        return fn(*args)

    return refusing


def shown_source(source: str) -> str:
    """``L['t']`` and ``L['kwargs']['t']`` as ``argument 't'``, ``L['args'][1]`` (a call
    through ``*args``) as ``positional argument 1``, ``L['self'].x`` as ``self.x``,
    ``G['EPS']`` as ``global EPS``."""
    positional = re.fullmatch(r"L\[['\"]args['\"]\]\[(\d+)\]", source)
    if positional is not None:
        return f"positional argument {positional.group(1)} (counted from 0)"
    text = re.sub(r"L\[['\"]kwargs['\"]\]", "", source)
    text = re.sub(r"^\[['\"](\w+)['\"]\]$", r"\1", text)
    text = re.sub(r"L\[['\"](\w+)['\"]\]", r"\1", text)
    if text.isidentifier():
        return f"argument {text!r}"
    return re.sub(r"G\[['\"](\w+)['\"]\]", r"global \1", text)
