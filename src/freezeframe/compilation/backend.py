"""The Dynamo backend of one compiled model: split, compile each piece, wrap, stitch.

Dynamo calls it once per :class:`~freezeframe.compilation.model.CompiledModel` with the traced FX
graph and fake example inputs; it returns the callable Dynamo's bytecode will call with the flat
graph inputs on every later step.

In mode PIECEWISE the splitting-op names are checked against torch's op registry when the
backend is built (in ``ff.compile``): a name that resolves to no registered op is a
:class:`~freezeframe.errors.ConfigError`. A registered splitting op that the trace never calls
is logged as a warning and counted in ``stats.splitting_ops_unused``, once per op.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import fx

from freezeframe.cache.key import graph_hash
from freezeframe.compilation.compilers import ArtifactCache, CompilerManager
from freezeframe.compilation.piecewise import PiecewiseBackend, _concrete, concrete_inputs
from freezeframe.compilation.split import (
    Piece,
    SplitGraph,
    check_splitting_ops,
    fx_forward,
    split_graph,
    splitting_ops_of,
)
from freezeframe.config import CompilationConfig, CompilationMode, CUDAGraphMode
from freezeframe.errors import CompileError, ShapeOutOfRangeError
from freezeframe.graphs import GraphOptions, GraphWrapper
from freezeframe.sizes import Range
from freezeframe.stats import Stats

__all__ = ["CompileBackend"]

logger = logging.getLogger(__name__)


def _placeholder_values(gm: fx.GraphModule) -> list[Any] | None:
    values = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            break
        value = node.meta.get("example_value", node.meta.get("val"))
        if value is None:
            return None
        values.append(value)
    return values


def _symbolic_sizes(values: Sequence[Any]) -> list[torch.SymInt]:
    """Every symbolic size among ``values``: SymInt arguments and tensor dims."""
    out = [v for v in values if isinstance(v, torch.SymInt)]
    for v in values:
        if isinstance(v, torch.Tensor):
            out.extend(cast(torch.SymInt, s) for s in v.shape if isinstance(s, torch.SymInt))
    return out


def _hint(size: torch.SymInt) -> int | None:
    """The value a symbolic size had in the traced call, where it is known."""
    hint = size.node.hint
    return int(hint) if hint is not None else None


def _piece_fake_args(split: SplitGraph, example_inputs: Sequence[Any]) -> dict[str, list[Any]]:
    """Fake arguments of every capturable piece: from the placeholders' metadata, or else by
    running the stitching graph on the trace's fake inputs and recording each call."""
    out: dict[str, list[Any]] = {}
    missing = []
    for piece in split.capturable:
        values = _placeholder_values(piece.graph)
        if values is None:
            missing.append(piece.name)
        else:
            out[piece.name] = values
    if not missing:
        return out

    wanted = set(missing)

    class _Recorder(fx.Interpreter):
        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            if target in wanted:
                out[target] = list(args)
            return super().call_module(target, args, kwargs)

    fake_mode = torch._guards.detect_fake_mode(list(example_inputs))
    ctx = fake_mode if fake_mode is not None else torch.no_grad()
    with ctx:
        _Recorder(split.stitching).run(*example_inputs)
    return out


class _CopyInputs:
    """Copy each tensor input that has a symbolic dim into a static buffer before the call,
    so graphs captured inside always read the same addresses. Buffers hold ``capacity`` rows
    along every symbolic dim and are allocated on first use (dtype/device of the input)."""

    def __init__(self, fn: Callable[..., Any], example_inputs: Sequence[Any],
                 capacity: int) -> None:
        self._fn = fn
        self._capacity = capacity
        # (input index, symbolic dims, buffer shape)
        self._slots: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        for i, value in enumerate(example_inputs):
            if not isinstance(value, torch.Tensor):
                continue
            dims = tuple(d for d, s in enumerate(value.shape) if isinstance(s, torch.SymInt))
            if dims:
                shape = tuple(_concrete(s, capacity) for s in value.shape)
                self._slots.append((i, dims, shape))
        self._buffers: dict[int, torch.Tensor] = {}

    def __call__(self, *args: Any) -> Any:
        args_ = list(args)
        for i, dims, shape in self._slots:
            value = args_[i]
            buf = self._buffers.get(i)
            if buf is None:
                buf = torch.zeros(shape, dtype=value.dtype, device=value.device)
                self._buffers[i] = buf
            index = []
            for d in range(value.dim()):
                if d in dims:
                    if value.shape[d] > shape[d]:
                        raise ShapeOutOfRangeError(
                            f"input {i} has {value.shape[d]} rows along dim {d}, above the "
                            f"static input buffer of {shape[d]} (max_num_tokens="
                            f"{self._capacity}); raise max_num_tokens")
                    index.append(slice(0, value.shape[d]))
                else:
                    index.append(slice(None))
            view = buf[tuple(index)]
            view.copy_(value)
            args_[i] = view
        return self._fn(*args_)


class CompileBackend:
    """Called by Dynamo exactly once per compiled model (a second call is an error)."""

    def __init__(self, config: CompilationConfig, stats: Stats, manager: CompilerManager, *,
                 graph_backend: Any = None, window: Any = None, model_key: str = "",
                 ordinary_memory: bool = False) -> None:
        self.config = config
        self.stats = stats
        self.manager = manager
        self.graph_backend = graph_backend
        self.window = window
        self.model_key = model_key
        self.ordinary_memory = ordinary_memory  # (GraphWrapper's: the caller's grad mode kept)
        self.pieces: list[Piece] = []
        self.piece_backends: list[PiecewiseBackend] = []
        self.wrappers: list[Any] = []
        self.stitching: fx.GraphModule | None = None
        self.compile_seconds = 0.0
        self.distinct_pieces = 0  # capturable pieces of distinct structure in the trace
        self._called = False
        self._unused_reported: set[str] = set()
        if config.mode is CompilationMode.PIECEWISE and config.splitting_ops:
            check_splitting_ops(config.splitting_ops)

    def use_cache(self, cache: ArtifactCache) -> None:
        """Load and save the pieces' compiled artifacts through ``cache`` from now on."""
        self.manager.use_cache(cache)

    @property
    def capturable_names(self) -> list[str]:
        """The stitching graph's attribute names of the capturable pieces, in order (those of
        ``piece_backends`` and, with piecewise graphs, of ``wrappers``)."""
        return [p.name for p in self.pieces if p.capturable]

    def reset(self) -> None:
        """Forget what a trace built (it failed, or Dynamo rejected it after this backend
        ran), so that the next trace starts from scratch."""
        self._called = False
        self.pieces, self.piece_backends, self.wrappers = [], [], []
        self.stitching = None
        self.distinct_pieces = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self._called:
            raise CompileError(
                f"{self.model_key}: Dynamo traced the model a second time; freezeframe traces "
                "once and reuses that trace for every size. Make forward's control flow "
                "independent of input values and sizes other than through tensor ops")
        self._called = True
        self.stats.inc("graphs_traced")
        start = time.perf_counter()
        # Dynamo hands over real example tensors; the symbolic shapes live in the graph's
        # placeholder metadata, and those fake values are what the rest works from.
        fake_inputs = _placeholder_values(gm) or list(example_inputs)
        fn: Callable[..., Any]
        try:
            if self.config.mode is CompilationMode.DYNAMO_TRACE_ONCE:
                fn = self._compile_whole(gm, fake_inputs)
            else:
                fn = self._compile_piecewise(gm, fake_inputs)
        except BaseException:
            self.reset()
            raise
        graphs_on = (self.graph_backend is not None
                     and self.config.cudagraph_mode is not CUDAGraphMode.NONE)
        if self.config.cudagraph_copy_inputs and graphs_on:
            fn = _CopyInputs(fn, fake_inputs, self.config.max_num_tokens)
        self.compile_seconds = time.perf_counter() - start
        logger.info("%s: compiled %d piece(s) (%d capturable, %d distinct) with %s in %.3f s "
                    "total", self.model_key, len(self.pieces),
                    sum(p.capturable for p in self.pieces), self.distinct_pieces,
                    self.manager.compiler.name, self.compile_seconds)
        return fn

    def _static_size(self, example_inputs: Sequence[Any]) -> int | None:
        """The size to compile at statically instead of over ranges, or None.

        Inductor writes size-1 code for a symbolic size whose hint is 1 (this trace's first
        call had a batch of 1), code that is wrong at other sizes and, for some graphs (a
        reduction over the batch), at 1 as well (NaN on the development CPU). The model serves
        such a trace at size 1 only (``SizeGuards``), so its pieces are compiled at size 1 with
        static shapes: the code Inductor makes for exactly that size."""
        if self.manager.compiler.name != "inductor":
            return None
        hints = {_hint(s) for s in _symbolic_sizes(example_inputs)}
        # (with another dynamic dim at another size, static code for this call's sizes would
        # not serve that dim's other sizes: the symbolic compile stays)
        return 1 if hints == {1} else None

    def _compile_whole(self, gm: fx.GraphModule,
                       example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.pieces = [Piece(index=0, name="graph", graph=gm, is_splitting_op=False)]
        self.stats.inc("pieces")
        self.stats.inc("capturable_pieces")
        self.stats.inc("distinct_pieces")
        self.distinct_pieces = 1
        size = self._static_size(example_inputs)
        if size is not None:
            return self.manager.compile(gm, concrete_inputs(example_inputs, size),
                                        Range(size, size), 0)
        return self.manager.compile(gm, list(example_inputs),
                                    Range(1, self.config.max_num_tokens), 0)

    def _compile_piecewise(self, gm: fx.GraphModule,
                           example_inputs: Sequence[Any]) -> Callable[..., Any]:
        split = split_graph(gm, splitting_ops_of(self.config))
        if self.config.mode is CompilationMode.PIECEWISE:
            # (under STOCK_TORCH_COMPILE each Dynamo graph is one part of the forward: an op
            # missing from one graph is in another)
            self._report_unused_ops(split)
        self.stitching = split.stitching
        self.pieces = list(split.pieces)
        capturable = split.capturable
        self.stats.inc("pieces", len(split.pieces))
        self.stats.inc("capturable_pieces", len(capturable))
        fake_args = _piece_fake_args(split, example_inputs)
        # Identical layers give pieces of one structure: each distinct one is compiled once per
        # range and the others reuse its code (the manager keys its compiles by this hash).
        keys = {p.name: graph_hash(p.graph, fake_args[p.name]) for p in capturable}
        self.distinct_pieces = len(set(keys.values()))
        self.stats.inc("distinct_pieces", self.distinct_pieces)

        graph_mode = cast(CUDAGraphMode, self.config.cudagraph_mode)
        wrap = self.graph_backend is not None and graph_mode.has_piecewise_cudagraphs()
        static = self._static_size(example_inputs)
        for k, piece in enumerate(capturable):
            backend = PiecewiseBackend(
                piece.graph, fake_args[piece.name], piece_index=piece.index,
                manager=self.manager, compile_ranges=self.config.compile_ranges(),
                compile_sizes=cast(tuple[int, ...], self.config.compile_sizes or ()),
                max_num_tokens=self.config.max_num_tokens, graph_key=keys[piece.name],
                static_size=static)
            backend.compile_all()
            self.piece_backends.append(backend)
            runnable: Any = backend
            if wrap:
                first, last = k == 0, k == len(capturable) - 1
                options = GraphOptions(log=first, gc_disable=not first, weak_ref_output=last)
                runnable = GraphWrapper(backend, CUDAGraphMode.PIECEWISE, self.graph_backend,
                                        options=options, stats=self.stats, window=self.window,
                                        debug=self.config.debug,
                                        ordinary_memory=self.ordinary_memory)
                self.wrappers.append(runnable)
            # A plain attribute, not a child module: the stitching code calls self.submod_<i>.
            delattr(split.stitching, piece.name)
            setattr(split.stitching, piece.name, runnable)
        # The splitting-op pieces too: their generated forward as a plain attribute, so each
        # op call skips nn.Module.__call__ (Piece.graph keeps each piece's GraphModule).
        for piece in self.pieces:
            if piece.is_splitting_op:
                delattr(split.stitching, piece.name)
                setattr(split.stitching, piece.name, fx_forward(piece.graph))
        return fx_forward(split.stitching)

    def _report_unused_ops(self, split: SplitGraph) -> None:
        """Warn about (and count) each splitting op the trace never calls: nothing is split at
        it, which is what a user who named it did not expect."""
        for name in self.config.splitting_ops or ():
            if name in split.matched_ops or name in self._unused_reported:
                continue
            self._unused_reported.add(name)
            self.stats.inc("splitting_ops_unused")
            namespace, _, rest = name.partition("::")
            op, _, overload = rest.partition(".")
            hint = (f"; an overload-specific name matches only calls of that overload "
                    f"(torch.ops.{namespace}.{op}.{overload}(...)); write '{namespace}::{op}' "
                    "to match every call of the op" if overload else "")
            logger.warning("%s: splitting op %r never appears in the traced graph, so nothing "
                           "is split at it; check that forward calls torch.ops.%s.%s, or remove "
                           "it from splitting_ops%s", self.model_key, name, namespace, op, hint)
