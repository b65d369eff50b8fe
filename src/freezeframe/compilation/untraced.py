"""A compiled model's modes without a trace: NONE (the forward as written) and
STOCK_TORCH_COMPILE (plain ``torch.compile``, graph breaks allowed), with their graphs.

Neither mode has one traced graph to split, so their PIECEWISE graphs are *breakable*
(:mod:`freezeframe.graphs.breakable`): the running forward is captured in segments that break
at the splitting ops and at ``@ff.graph_break`` functions. The call goes::

    FULL wrapper (FULL graphs)  ->  breakable PIECEWISE wrapper  ->  run
    (each present only when cudagraph_mode has that kind of graph)

where ``run`` is ``module.forward`` (NONE) or ``torch.compile(module.forward)``
(STOCK_TORCH_COMPILE). Under STOCK_TORCH_COMPILE with breakable graphs each Dynamo graph is
split at the splitting ops like a traced one (:class:`CompileBackend`, its pieces compiled by
the config's compiler) and each splitting-op piece becomes a break point: Dynamo's compiled
frames never see the break, which happens in the stitching code between pieces. Under NONE
the splitting ops are found as they are called (a torch-function mode sees each op).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from freezeframe.compilation.assemble import CompileStack
from freezeframe.compilation.backend import CompileBackend
from freezeframe.compilation.compilers import stock_backend
from freezeframe.compilation.split import check_splitting_ops, matches_splitting_op
from freezeframe.config import CompilationConfig, CompilationMode, breakable_capture
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
        run: Callable[..., Any] = module.forward
        if config.mode is CompilationMode.STOCK_TORCH_COMPILE:
            backend = (_BreakingBackend(stack, model_key) if breakable and config.splitting_ops
                       else stock_backend(config, stats))
            run = torch.compile(module.forward, backend=backend)
        self.run = run
        # ops are seen as they run only without Dynamo (under it, the split finds them)
        watch_ops = config.mode is CompilationMode.NONE
        self.breakable: GraphWrapper | None = (
            stack.breakable_wrapper(run, watch_ops=watch_ops) if breakable else None)
        self.full: GraphWrapper | None = stack.full_wrapper(
            self.breakable if self.breakable is not None else run)
        self.call: Callable[..., Any] = self.full or self.breakable or run

    def wrappers(self) -> list[GraphWrapper]:
        """The breakable PIECEWISE wrapper, then the FULL one (those present)."""
        return [w for w in (self.breakable, self.full) if w is not None]


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
