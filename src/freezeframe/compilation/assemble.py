"""The compile stack every front door builds from a config, in one place.

``ff.compile`` (per trace of a model) and the ``torch.compile(backend="freezeframe")`` entry
point (per graph Dynamo hands over) compile the same way::

    config --resolve--> graph backend (cuda / emulated / None)
           --make-----> compiler (eager / inductor) --> CompilerManager (compile-or-load)
    per graph:          CompileBackend (split, compile per range, PIECEWISE wrappers)
                        + a FULL GraphWrapper around the whole, when the mode has FULL graphs
    per trace (ff.compile): TraceBackend (keep for saving, build = the above + stitch, the
                        size conditions), TraceOnce through it, ModelCache (load or trace,
                        then save) around both

One :class:`CompileStack` serves one compiled model (or one ``FreezeframeBackend``): its pieces
share the stats, the compiler manager (so a repeated piece compiles once), the graph backend
(one memory pool) and the capture window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

from torch import nn

from freezeframe.compilation.backend import CompileBackend
from freezeframe.compilation.cached_trace import ModelCache
from freezeframe.compilation.compilers import CompilerManager, make_compiler
from freezeframe.compilation.direct_call import DirectCall, Stitched
from freezeframe.compilation.module_call import PositionalForm
from freezeframe.compilation.signature import CallSignature, Signer
from freezeframe.compilation.size_conditions import SizeGuards
from freezeframe.compilation.split import splitting_ops_of
from freezeframe.compilation.trace import TraceOnce
from freezeframe.compilation.trace_backend import TraceBackend
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.graphs import (
    CaptureWindow,
    GraphBackend,
    GraphOptions,
    GraphWrapper,
    resolve_backend,
)
from freezeframe.graphs.breakable import BreakableBackend
from freezeframe.stats import Stats

__all__ = ["CompileStack", "Variant"]


@dataclasses.dataclass
class Variant:
    """One trace of the model and everything built from it: the call structure it serves,
    the trace, its compiled pieces and graph wrappers, its on-disk cache, its FULL wrapper."""

    signature: CallSignature | None  # None until its first call
    trace: TraceOnce
    backend: CompileBackend  # the pieces: split, compiled, wrapped
    dynamo: TraceBackend  # the one backend of the trace, holding what its stages made
    cache: ModelCache
    full_wrapper: GraphWrapper | None
    guards: SizeGuards | None = None  # the trace's conditions on sizes; None until traced
    # the trace called without Dynamo's bytecode (direct_call.py), from its second call on;
    # ``direct_tried`` is set once that was worked out (``direct`` left None where the direct
    # call could differ: the bytecode stays)
    direct: DirectCall | None = None
    direct_tried: bool = False
    # the stitching copies with pieces' entries bound in, by those entries (sized_call)
    sized: dict[tuple[int, ...], Any] = dataclasses.field(default_factory=dict)
    # the one spelling of a call for the FULL graph (model(x=a) and model(a) alike)
    spelling: PositionalForm | None = None

    @property
    def stitched(self) -> Stitched | None:
        """What the trace's code calls, once traced (or loaded)."""
        built = self.dynamo.built
        return built.stitched if built is not None else None

    @property
    def sources(self) -> list[str | None] | None:
        """The Dynamo source of each graph input, once traced (or loaded)."""
        built = self.dynamo.built
        return list(built.sources) if built is not None else None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.full_wrapper is not None:
            if self.spelling is not None:
                args, kwargs = self.spelling(args, kwargs)
            return self.full_wrapper(*args, **kwargs)
        direct = self.direct
        if direct is not None:
            return direct.call(*args, **kwargs)
        return self.cache(*args, **kwargs)


@dataclasses.dataclass
class CompileStack:
    """The compiler, compile manager and graph backend of one compiled model.

    ``graph_backend`` is None when graphs are off (``cudagraph_mode`` NONE, or "auto" without
    CUDA); ``manager`` is None until :meth:`with_compiler` (modes that compile nothing).
    """

    config: CompilationConfig
    stats: Stats
    window: CaptureWindow
    graph_backend: GraphBackend | None
    manager: CompilerManager | None = None
    # whether calls keep the caller's autograd mode (inference_mode=False, Dynamo's backend):
    # then a capture in inference mode allocates ordinary tensors (GraphWrapper)
    ordinary_memory: bool = True

    @classmethod
    def of(cls, config: CompilationConfig, stats: Stats, *,
           ordinary_memory: bool = True) -> CompileStack:
        """The stack for ``config`` without a compiler yet (see :meth:`with_compiler`)."""
        return cls(config, stats, CaptureWindow(), resolve_backend(config),
                   ordinary_memory=ordinary_memory)

    def with_compiler(self, model_key: str) -> CompileStack:
        """Give the stack its compiler manager: the config's compiler, with the graph
        backend's ``prepare`` for callables that launch kernels of their own."""
        config = self.config
        compiler = make_compiler(config.backend, self.stats, config.inductor_compile_config,
                                 config.inductor_passes)
        prepare = self.graph_backend.prepare if self.graph_backend is not None else None
        self.manager = CompilerManager(compiler, self.stats, model_key=model_key,
                                       prepare=prepare)
        return self

    @property
    def full_graphs(self) -> bool:
        """Whether this stack captures whole forwards (a FULL wrapper around each graph)."""
        mode = cast(CUDAGraphMode, self.config.cudagraph_mode)
        return self.graph_backend is not None and mode.has_full_cudagraphs()

    def piece_compiler(self, model_key: str) -> CompileBackend:
        """A new Dynamo backend for one graph: it splits the graph and compiles its pieces."""
        assert self.manager is not None, "with_compiler() first"
        return CompileBackend(self.config, self.stats, self.manager,
                              graph_backend=self.graph_backend, window=self.window,
                              model_key=model_key, ordinary_memory=self.ordinary_memory)

    def full_wrapper(self, run: Callable[..., Any]) -> GraphWrapper | None:
        """``run`` wrapped for FULL graphs, or None when this stack captures none."""
        if not self.full_graphs:
            return None
        assert self.graph_backend is not None
        return GraphWrapper(run, CUDAGraphMode.FULL, self.graph_backend,
                            options=GraphOptions(), stats=self.stats, window=self.window,
                            debug=self.config.debug, ordinary_memory=self.ordinary_memory)

    def breakable_wrapper(self, run: Callable[..., Any], *, watch_ops: bool) -> GraphWrapper:
        """``run`` (a forward without a trace) wrapped for breakable PIECEWISE graphs: captured
        in segments that break at the splitting ops and ``@ff.graph_break`` functions
        (:mod:`freezeframe.graphs.breakable`); ``watch_ops``: find the ops as they are called
        (mode NONE) rather than as break points of a split graph."""
        assert self.graph_backend is not None
        backend = BreakableBackend(self.graph_backend, tuple(self.config.splitting_ops or ()),
                                   watch_ops=watch_ops)
        return GraphWrapper(run, CUDAGraphMode.PIECEWISE, backend, options=GraphOptions(),
                            stats=self.stats, window=self.window, debug=self.config.debug,
                            ordinary_memory=self.ordinary_memory)

    def variant(self, module: nn.Module, model_key: str, dims: dict[str, tuple[int, ...]],
                user_key: str | None, signer: Signer | None, signature: CallSignature | None,
                *, dims_given: bool = True) -> Variant:
        """A new, untraced trace of ``module``: its backend (the piece compiler inside), the
        trace-once callable Dynamo traces through it, the first call around both (load or
        trace, then save), its FULL wrapper. The first call through ``variant.cache`` traces
        (or loads) it."""
        pieces = self.piece_compiler(model_key)
        backend = TraceBackend(pieces, module, dims, splitting_ops_of(self.config))
        trace = TraceOnce(module, backend, dims, dims_given=dims_given)
        cache = ModelCache(module, self.config, self.stats, backend, trace, dims,
                           model_key=user_key, signer=signer)
        made = Variant(signature, trace, pieces, backend, cache, self.full_wrapper(cache))
        if made.full_wrapper is not None:
            made.spelling = PositionalForm(module.forward)
        return made
