"""A compiled model's modes without a trace: NONE (the forward as written) and
STOCK_TORCH_COMPILE (plain ``torch.compile``, graph breaks allowed), with their graphs.

Neither mode has one traced graph to split, so their PIECEWISE graphs are *breakable*
(:mod:`freezeframe.graphs.breakable`): the running forward is captured in segments that break
at the splitting ops and at ``@ff.graph_break`` functions. The call goes::

    FULL wrapper (FULL graphs)  ->  breakable PIECEWISE wrapper  ->  run
    (each present only when cudagraph_mode has that kind of graph)

where ``run`` calls the module as eager does, hooks and all: ``module(...)`` (NONE), or
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

import logging
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle as _hook_handles

from freezeframe.compilation.assemble import CompileStack
from freezeframe.compilation.backend import CompileBackend
from freezeframe.compilation.compilers import stock_backend
from freezeframe.compilation.module_state import _user_attrs as user_attrs
from freezeframe.compilation.split import check_splitting_ops, matches_splitting_op
from freezeframe.config import CompilationConfig, CompilationMode, CUDAGraphMode, breakable_capture
from freezeframe.context import get_forward_context
from freezeframe.errors import CaptureError
from freezeframe.graphs import GraphWrapper
from freezeframe.graphs.breakable import break_point
from freezeframe.stats import Stats

__all__ = ["Untraced"]

logger = logging.getLogger(__name__)


class Untraced:
    """How a model of mode NONE or STOCK_TORCH_COMPILE is called: ``call`` (the outermost of
    its FULL wrapper, its breakable PIECEWISE wrapper and its forward), and its wrappers."""

    def __init__(self, module: nn.Module, config: CompilationConfig, stack: CompileStack,
                 stats: Stats, model_key: str) -> None:
        breakable = breakable_capture(config) and stack.graph_backend is not None
        if breakable and config.splitting_ops:
            check_splitting_ops(config.splitting_ops)
        # the module's __call__, not its forward: hooks on the module itself run as in eager
        run: Callable[..., Any] = module.__call__
        if config.mode is CompilationMode.STOCK_TORCH_COMPILE:
            backend = (_BreakingBackend(stack, model_key) if breakable and config.splitting_ops
                       else stock_backend(config, stats, prepare=(
                           stack.graph_backend.prepare if stack.graph_backend else None)))
            run = _StockCall(module, backend, model_key, stats)
        self.run = run
        graph_modes = {CUDAGraphMode.PIECEWISE} if breakable else set()
        if stack.full_graphs:
            graph_modes.add(CUDAGraphMode.FULL)
        captured = (_refusing_attribute_stores(run, module, model_key, frozenset(graph_modes))
                    if graph_modes else run)
        # ops are seen as they run only without Dynamo (under it, the split finds them)
        watch_ops = config.mode is CompilationMode.NONE
        self.breakable: GraphWrapper | None = (
            stack.breakable_wrapper(captured, watch_ops=watch_ops) if breakable else None)
        self.full: GraphWrapper | None = stack.full_wrapper(
            self.breakable if self.breakable is not None else captured)
        self.call: Callable[..., Any] = self.full or self.breakable or run

    def wrappers(self) -> list[GraphWrapper]:
        """The breakable PIECEWISE wrapper, then the FULL one (those present)."""
        return [w for w in (self.breakable, self.full) if w is not None]


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
        func = types.FunctionType(_call_module.__code__.replace(), _call_module.__globals__,
                                  _call_module.__name__)
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
                                       stack.manager)
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
