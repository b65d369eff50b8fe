"""``ff.compile`` and :class:`CompiledModel`, the ``nn.Module`` a user gets back."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from freezeframe.compile.backend import CompileBackend
from freezeframe.compile.cache import ModelCache
from freezeframe.compile.compilers import CompilerManager, make_compiler
from freezeframe.compile.split import Piece
from freezeframe.compile.trace import TraceOnce, resolve_dynamic_arg_dims
from freezeframe.config import CompilationConfig, CompilationMode, CUDAGraphMode
from freezeframe.errors import ConfigError
from freezeframe.graphs import CaptureWindow, GraphOptions, GraphWrapper, resolve_backend
from freezeframe.stats import Stats

__all__ = ["CompiledModel", "compile"]

logger = logging.getLogger(__name__)


class CompiledModel(nn.Module):
    """A module compiled per ``config``: traced once on the first call, then run as compiled
    pieces (and graphs) for every batch size.

    Holds every piece of compile state for this one instance (trace, pieces, compiled
    entries, graph wrappers, ``stats``), so two compiled models never share anything.
    """

    def __init__(self, module: nn.Module, config: CompilationConfig,
                 dynamic_arg_dims: Mapping[str, int | Sequence[int]] | None = None, *,
                 model_key: str | None = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"ff.compile: expected an nn.Module, got {type(module).__name__}")
        if not isinstance(config, CompilationConfig):
            raise ConfigError(f"ff.compile: expected a CompilationConfig, got "
                              f"{type(config).__name__}; build one with "
                              "ff.CompilationConfig(...) or CompilationConfig.from_dict(...)")
        self.module = module
        self.config = config
        self.stats = Stats()
        self.model_key = model_key or f"{type(module).__module__}.{type(module).__qualname__}"
        graph_mode = cast(CUDAGraphMode, config.cudagraph_mode)
        self.capture_window = CaptureWindow()
        # None when graphs are off (cudagraph_mode NONE, or "auto" without CUDA).
        self._graph_backend: Any = resolve_backend(config)

        self.manager: CompilerManager | None = None
        self._backend: CompileBackend | None = None
        self._trace: TraceOnce | None = None
        self._cache: ModelCache | None = None
        self._stock: Callable[..., Any] | None = None
        mode = config.mode
        if mode in (CompilationMode.DYNAMO_TRACE_ONCE, CompilationMode.PIECEWISE):
            dims = resolve_dynamic_arg_dims(module.forward, dynamic_arg_dims)
            compiler = make_compiler(config.backend, self.stats, config.inductor_compile_config,
                                     config.inductor_passes)
            self.manager = CompilerManager(compiler, self.stats, model_key=self.model_key)
            self._backend = CompileBackend(config, self.stats, self.manager,
                                           graph_backend=self._graph_backend,
                                           window=self.capture_window, model_key=self.model_key)
            # The on-disk cache wraps the backend (traced files, saved trace) and the first call.
            self._cache = ModelCache(self, dims, model_key=model_key)
            self._trace = TraceOnce(module, self._cache.wrap_backend(self._backend), dims)
            self._cache.trace = self._trace
        elif mode is CompilationMode.STOCK_TORCH_COMPILE:
            self._stock = torch.compile(module.forward, backend=self._stock_backend)
        self._run: Callable[..., Any] = (self._cache if self._cache is not None
                                         else self._stock if self._stock is not None
                                         else module.forward)

        self._full_wrapper: GraphWrapper | None = None
        if self._graph_backend is not None and graph_mode.has_full_cudagraphs():
            self._full_wrapper = GraphWrapper(
                self._run, CUDAGraphMode.FULL, self._graph_backend, options=GraphOptions(),
                stats=self.stats, window=self.capture_window, debug=config.debug)

    # -- stock torch.compile ---------------------------------------------------------------
    def _stock_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """Plain torch.compile with counting: every (re)trace is a graph traced."""
        self.stats.inc("graphs_traced")
        self.stats.inc("backend_compilations")
        if self.config.backend == "eager":
            self.stats.inc("eager_compiles")
            return gm.forward
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        self.stats.inc("inductor_compiles")
        with inductor_config.patch(dict(self.config.inductor_compile_config)):
            return compile_fx(gm, example_inputs)

    # -- public surface --------------------------------------------------------------------
    @property
    def pieces(self) -> list[Piece]:
        """The split pieces in execution order (empty before the first call)."""
        return list(self._backend.pieces) if self._backend is not None else []

    @property
    def traced(self) -> bool:
        return self._trace is not None and self._trace.traced

    def graph_wrappers(self) -> list[Any]:
        """Every graph wrapper this model owns (piecewise ones, then the FULL one)."""
        out = list(self._backend.wrappers) if self._backend is not None else []
        if self._full_wrapper is not None:
            out.append(self._full_wrapper)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Inside someone else's trace: be inlined as the plain module.
            return self.module(*args, **kwargs)
        if self._full_wrapper is not None:
            return self._full_wrapper(*args, **kwargs)
        return self._run(*args, **kwargs)

    def extra_repr(self) -> str:
        mode = cast(CompilationMode, self.config.mode)
        graph_mode = cast(CUDAGraphMode, self.config.cudagraph_mode)
        return (f"mode={mode.name}, backend={self.config.backend}, "
                f"cudagraph_mode={graph_mode.name}")


def compile(module: nn.Module, config: CompilationConfig,
            dynamic_arg_dims: Mapping[str, int | Sequence[int]] | None = None, *,
            model_key: str | None = None) -> CompiledModel:
    """Compile ``module`` per ``config``; returns an ``nn.Module`` to call instead of it.

    ``dynamic_arg_dims`` maps forward argument names to the dim(s) whose size varies between
    calls (default: dim 0 of every Tensor / Optional[Tensor] argument). ``model_key`` names
    this model in logs and in the compile cache (default: the module's class path).
    """
    return CompiledModel(module, config, dynamic_arg_dims, model_key=model_key)
