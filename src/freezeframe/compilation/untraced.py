"""A compiled model's modes without a trace: NONE (the forward as written) and
STOCK_TORCH_COMPILE (plain ``torch.compile``, graph breaks allowed), with their graphs.

Neither mode has one traced graph to split, so their PIECEWISE graphs are *breakable*
(:mod:`freezeframe.graphs.breakable`): the running forward is captured in segments that break
at the splitting ops and at ``@ff.graph_break`` functions. The call goes::

    FULL wrapper (FULL graphs)  ->  breakable PIECEWISE wrapper  ->  run
    (each present only when cudagraph_mode has that kind of graph)

per distinct set of Python values among the call's arguments (a float timestep, an int step
count: a graph replays the value of its capture, so each set gets graphs of its own, up to
:data:`~freezeframe.compilation.routing.MAX_TRACES` sets; a call with one more is refused by
name), where ``run`` calls the module as eager does, hooks and all: ``module(...)`` (NONE), or
``torch.compile`` of a function that calls it (STOCK_TORCH_COMPILE: :class:`_StockCall`, over a
code object of this model's own, so nothing is left on the class's ``forward``, and compiled
anew when a hook is added to a module that had none, which Dynamo does not guard on). A graph
replay does not run forward's Python: a capture whose forward sets module attributes
(``self.last = out``) is refused (:func:`_refusing_attribute_stores`).

Under STOCK_TORCH_COMPILE with breakable graphs each Dynamo graph is split at the splitting
ops like a traced one (:class:`CompileBackend`, its pieces compiled by the config's compiler)
and each splitting-op piece becomes a break point: Dynamo's compiled frames never see the
break, which happens in the stitching code between pieces. Under NONE the splitting ops are
found as they are called (a torch-function mode sees each op).
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import fx, nn
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle as _hook_handles

from freezeframe.compilation.assemble import CompileStack
from freezeframe.compilation.backend import CompileBackend
from freezeframe.compilation.compilers import stock_backend
from freezeframe.compilation.module_call import PositionalForm
from freezeframe.compilation.module_state import ModuleState
from freezeframe.compilation.module_state import _user_attrs as user_attrs
from freezeframe.compilation.outside_reads import OutsideReads
from freezeframe.compilation.routing import MAX_TRACES
from freezeframe.compilation.scalar_inputs import specialising_scalars
from freezeframe.compilation.split import check_splitting_ops, matches_splitting_op
from freezeframe.compilation.values import describe, token
from freezeframe.config import CompilationConfig, CompilationMode, CUDAGraphMode, breakable_capture
from freezeframe.context import get_forward_context
from freezeframe.errors import CaptureError, CompileError
from freezeframe.graphs import GraphWrapper
from freezeframe.graphs.breakable import break_point
from freezeframe.stats import Stats

__all__ = ["Untraced"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Graphs:
    """The graph wrappers of one set of Python argument values: ``call`` is the outermost."""

    breakable: GraphWrapper | None
    full: GraphWrapper | None
    call: Callable[..., Any]


class Untraced:
    """How a model of mode NONE or STOCK_TORCH_COMPILE is called: ``call`` (its forward, or,
    with graphs, the outermost of the FULL wrapper, the breakable PIECEWISE wrapper and the
    forward of the call's Python argument values), and its wrappers."""

    def __init__(self, module: nn.Module, config: CompilationConfig, stack: CompileStack,
                 stats: Stats, model_key: str) -> None:
        self._module, self._stack, self._stats = module, stack, stats
        self._model_key = model_key
        breakable = breakable_capture(config) and stack.graph_backend is not None
        if breakable and config.splitting_ops:
            check_splitting_ops(config.splitting_ops)
        # the module's __call__, not its forward: hooks on the module itself run as in eager
        run: Callable[..., Any] = module.__call__
        if config.mode is CompilationMode.STOCK_TORCH_COMPILE:
            backend = (_BreakingBackend(stack, model_key) if breakable and config.splitting_ops
                       else stock_backend(config, stats, prepare=(
                           stack.graph_backend.prepare if stack.graph_backend else None)))
            if stack.graph_backend is not None:
                backend = specialising_scalars(backend, model_key, stats,
                                               cast(CUDAGraphMode, config.cudagraph_mode))
            run = _StockCall(module, backend, model_key, stats)
        self.run = run
        graph_modes = {CUDAGraphMode.PIECEWISE} if breakable else set()
        if stack.full_graphs:
            graph_modes.add(CUDAGraphMode.FULL)
        self._graph_modes = frozenset(graph_modes)
        self._captured = (_refusing_attribute_stores(run, module, model_key, self._graph_modes)
                          if graph_modes else run)
        self._breakable = breakable
        # ops are seen as they run only without Dynamo (under it, the split finds them)
        self._watch_ops = config.mode is CompilationMode.NONE
        # per set of Python argument values (see _values_key), its graphs; () for a call of
        # tensors only, made now so that its wrappers are visible before the first call
        self._keyed: dict[tuple[Any, ...], _Graphs] = {}
        self._spelling = PositionalForm(module.forward)  # one argument list per graph
        self._last = self._graphs(())
        self.call: Callable[..., Any] = self._call if graph_modes else run

    def _graphs(self, key: tuple[Any, ...]) -> _Graphs:
        """The graphs of ``key``, made on its first call (refused past MAX_TRACES sets)."""
        graphs = self._keyed.get(key)
        if graphs is not None:
            return graphs
        valued = [k for k in self._keyed if k]
        if len(valued) >= MAX_TRACES:
            raise CompileError(
                f"{self._model_key}: a graph call with Python argument values "
                f"{self._shown(key)} would need a set of graphs of its own (a graph replays "
                f"the values of its capture), number {len(valued) + 1}, above the limit of "
                f"{MAX_TRACES}; earlier calls had {self._shown(valued[0])}. Pass a value "
                "that changes per call as a tensor (torch.tensor(t)), so the graph reads it "
                "instead of freezing it")
        breakable = (self._stack.breakable_wrapper(self._captured, watch_ops=self._watch_ops)
                     if self._breakable else None)
        full = self._stack.full_wrapper(breakable if breakable is not None else self._captured)
        graphs = self._keyed[key] = _Graphs(breakable, full,
                                            full or breakable or self._captured)
        if key:
            self._stats.inc("graph_sets_for_values")
            logger.info("%s: graphs of their own for Python argument values %s (set %d)",
                        self._model_key, self._shown(key), len(valued) + 1)
        return graphs

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        ctx = get_forward_context()
        if ctx is None or ctx.batch_descriptor is None or ctx.mode not in self._graph_modes:
            return self.run(*args, **kwargs)  # (every wrapper would call through)
        args, kwargs = self._spelling(args, kwargs)
        graphs = self._graphs(_values_key(args, kwargs))
        self._last = graphs
        return graphs.call(*args, **kwargs)

    def _shown(self, key: tuple[Any, ...]) -> str:
        return ", ".join(f"{name}={describe(tok)}" for name, tok in key) or "(none)"

    def for_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Graphs:
        """The graphs a graph call of these arguments goes to."""
        return self._graphs(_values_key(*self._spelling(args, kwargs)))

    @property
    def breakable(self) -> GraphWrapper | None:
        """The breakable PIECEWISE wrapper of the last graph call's values."""
        return self._last.breakable

    @property
    def full(self) -> GraphWrapper | None:
        """The FULL wrapper of the last graph call's values."""
        return self._last.full

    def state(self, on_change: Callable[[], None]) -> ModuleState:
        """The module state to follow with graphs: which values forward reads is not known
        without a trace, so every tensor attribute is followed for moves, and every plain
        class attribute and global of the module's classes (``OutsideReads.untraced``)."""
        return ModuleState(self._module, outside=OutsideReads.untraced(self._module),
                           tensor_reads=None, on_change=on_change)

    def drop_for_change(self, why: str, warned: set[str]) -> None:
        """The module changed (``why``): every graph, which replays the Python of its capture,
        is dropped, to be captured again on next use running the new Python (logged once per
        model, counted in ``stats.graphs_dropped_module_changed``)."""
        for wrapper in self.wrappers():
            wrapper.clear()
        self._stats.inc("graphs_dropped_module_changed")
        log = logger.debug if "module changed" in warned else logger.warning
        warned.add("module changed")
        log("%s: %s; its graphs replay the Python of their capture, so all of them were "
            "dropped and are captured again (stats.graphs_dropped_module_changed; logged "
            "once)", self._model_key, why)

    def wrappers(self) -> list[GraphWrapper]:
        """Per set of values: the breakable PIECEWISE wrapper, then the FULL one (those
        present)."""
        return [w for graphs in list(self._keyed.values())
                for w in (graphs.breakable, graphs.full) if w is not None]


def _values_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The Python values among a call's arguments, each (its position or name, its token by
    the rule of :mod:`~freezeframe.compilation.values`); tensors left out (a graph reads
    them). Empty for a call of tensors only."""
    key = [(f"argument {i}", token(a, _tensor_kind)) for i, a in enumerate(args)
           if not isinstance(a, torch.Tensor)]
    if kwargs:
        key += [(name, token(a, _tensor_kind)) for name, a in sorted(kwargs.items())
                if not isinstance(a, torch.Tensor)]
    return tuple(key)


def _tensor_kind(value: torch.Tensor) -> tuple[Any, ...]:
    return ("tensor", value.dtype, value.device, value.dim())


def _call_module(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # the function STOCK_TORCH_COMPILE compiles (a private copy of its code per compile)
    return self(*args, **kwargs)


def _hook_dicts(module: nn.Module) -> list[dict[Any, Any]]:
    """Every forward and forward-pre hook dict of ``module`` and its submodules, and the
    global ones."""
    dicts: list[dict[Any, Any]] = [_torch_module._global_forward_hooks,
                                   _torch_module._global_forward_pre_hooks]
    for sub in module.modules():
        dicts += (sub._forward_hooks, sub._forward_pre_hooks)
    return dicts


def _hooked(module: nn.Module) -> set[int]:
    """Which of those dicts hold hooks, by id."""
    return {id(d) for d in _hook_dicts(module) if d}


class _StockCall:
    """``torch.compile`` (graph breaks allowed) of a call of ``module`` as eager makes it:
    through ``module(...)``, so hooks on the module itself run too, in Dynamo's graph.

    Two things plain ``torch.compile(module.forward)`` gets wrong are avoided here:

    * Dynamo keeps what it compiles on the code object it ran, which every instance of a class
      shares: each compiled model would leave entries on the class's ``forward`` (a grad mode
      each), and a plain ``torch.compile`` of the class would then hit Dynamo's recompile
      limit. The compiled function runs over a private copy of its code.
    * Dynamo does not guard on an empty hook dict (``skip_nnmodule_hook_guards``): a hook
      registered after the first call on a module that had none would never run. Every hook
      registration moves torch's process-wide handle counter; when it moved, the hook dicts
      are looked at, and if one holds hooks that held none, the call is compiled anew
      (logged, ``stats.stock_recompiles_for_hooks``). Hooks removed, or added to a dict that
      had some, are Dynamo's guards' business."""

    def __init__(self, module: nn.Module, backend: Any, model_key: str, stats: Stats) -> None:
        self._module = module
        self._backend = backend
        self._model_key = model_key
        self._stats = stats
        self._compiled: Callable[..., Any] = self._compile()

    def _compile(self) -> Callable[..., Any]:
        self._mark = _hook_handles.next_id  # read first: registering moves it before storing
        self._hooked = _hooked(self._module)
        # a name of its own too: Dynamo keeps what it learnt of a frame's inputs (a float that
        # changed is a tensor from then on) by file, line and name, across code objects
        name = f"_call_module_{id(self):x}"
        func = types.FunctionType(_call_module.__code__.replace(co_name=name, co_qualname=name),
                                  _call_module.__globals__, name)
        return torch.compile(types.MethodType(func, self._module), backend=self._backend)

    def _hooks_added(self) -> bool:
        mark = _hook_handles.next_id
        if not _hooked(self._module) <= self._hooked:
            return True
        self._mark = mark  # another hook (a tensor's, one on a dict Dynamo guards)
        return False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._mark != _hook_handles.next_id and self._hooks_added():
            logger.info("%s: a hook was registered on a module that had none since it was "
                        "compiled (torch.compile does not guard on that): compiled again",
                        self._model_key)
            self._stats.inc("stock_recompiles_for_hooks")
            self._compiled = self._compile()
        return self._compiled(*args, **kwargs)


def _refusing_attribute_stores(run: Callable[..., Any], module: nn.Module, model_key: str,
                               graph_modes: frozenset[CUDAGraphMode]) -> Callable[..., Any]:
    """``run`` for the graph wrappers: a call that one of them captures (a forward context of
    one of ``graph_modes`` with a descriptor; a replay does not call it) must leave every
    attribute of every module as it found it. A replay does not run forward's Python, so a
    ``self.last = out`` or ``self.calls += 1`` would keep the capture's value forever (a
    trace replays such stores; these modes have none): the capture is refused, with the
    attributes put back as they were."""

    def captured(*args: Any, **kwargs: Any) -> Any:
        ctx = get_forward_context()
        if ctx is None or ctx.batch_descriptor is None or ctx.mode not in graph_modes:
            return run(*args, **kwargs)
        before = [(name, sub, user_attrs(sub)) for name, sub in module.named_modules()]
        out = run(*args, **kwargs)
        for name, sub, then in before:
            now = user_attrs(sub)
            changed = sorted(k for k in then.keys() | now.keys()
                             if k not in now or k not in then or now[k] is not then[k])
            if changed:
                _put_back(before)
                where = f"self.{name}." if name else "self."
                raise CaptureError(
                    f"{model_key}: forward sets {where}{changed[0]} (or deletes it) while "
                    f"the {ctx.mode.name} graph for {ctx.batch_descriptor} is captured; a "
                    "graph replay does not run forward's Python, so every replay would leave "
                    "the capture's value there instead of its own call's. Keep such state in "
                    "a tensor buffer updated in place (self.register_buffer(...), "
                    "self.buf.copy_(out)), or keep it out of forward; or use mode "
                    "'piecewise', whose trace replays the store on every call")
        return out

    return captured


def _put_back(before: list[tuple[str, nn.Module, dict[str, Any]]]) -> None:
    """Every module's attributes as they were before a refused capture."""
    for _, sub, then in before:
        attrs = vars(sub)
        for name in list(user_attrs(sub)):
            if name not in then:
                del attrs[name]
        attrs.update(then)


class _BreakingBackend:
    """The Dynamo backend of STOCK_TORCH_COMPILE with breakable graphs: each graph Dynamo
    hands over is split at the splitting ops and its pieces compiled (a :class:`CompileBackend`
    per graph, without graph wrappers of its own), and each splitting-op piece is a break
    point of the breakable capture."""

    def __init__(self, stack: CompileStack, model_key: str) -> None:
        self._stack = stack
        self._model_key = model_key
        self._stack.with_compiler(model_key)
        self._no_graphs = CompileStack(stack.config, stack.stats, stack.window, None,
                                       stack.manager, stack.ordinary_memory)
        self.graphs: list[CompileBackend] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        backend = self._no_graphs.piece_compiler(f"{self._model_key} graph {len(self.graphs)}")
        fn = backend(gm, example_inputs)
        self.graphs.append(backend)
        stitching = backend.stitching
        assert stitching is not None
        for piece in backend.pieces:
            if piece.is_splitting_op:
                op = getattr(stitching, piece.name)
                name = _op_name(piece.graph, self._stack.config.splitting_ops or ())
                setattr(stitching, piece.name, break_point(op, name))
        return fn


def _op_name(graph: fx.GraphModule, splitting_ops: Sequence[str]) -> str:
    """The config's name of the splitting op a splitting-op piece calls (as mode NONE names
    its breaks), for the capture report."""
    for node in graph.graph.nodes:
        if node.op == "call_function":
            for name in splitting_ops:
                if matches_splitting_op(node.target, [name]):
                    return name
            return str(node.target)
    return "splitting op"
