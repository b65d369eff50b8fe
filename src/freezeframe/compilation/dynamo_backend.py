"""freezeframe as a ``torch.compile`` backend: ``torch.compile(model, backend="freezeframe")``.

The package registers :func:`freezeframe_backend` under the ``torch_dynamo_backends`` entry
point, so ``torch._dynamo.list_backends()`` lists ``"freezeframe"`` once the package is
installed, without importing it. ``options`` are :class:`~freezeframe.config.CompilationConfig`
fields (vLLM's spellings, such as ``max_num_batched_tokens``, included)::

    compiled = torch.compile(model, backend="freezeframe", dynamic=True, options={
        "backend": "eager", "splitting_ops": ["mylib::attention"],
        "cudagraph_mode": "piecewise", "cudagraph_capture_sizes": [1, 2, 4, 8]})

Each graph Dynamo hands over goes through the same stages as in ``ff.compile``
(:class:`~freezeframe.compilation.backend.CompileBackend`): split at the splitting ops, each
capturable piece compiled per compile range and compile size, and, when the config asks for
graphs and a graph backend is available, wrapped in a PIECEWISE graph wrapper (the whole graph
in a FULL one for the FULL modes) that captures and replays per padded batch descriptor inside
``ff.forward_context``. What ``torch.compile`` keeps for itself: tracing, guards and
recompilation (Dynamo's own rules, so the batch dim is dynamic only after a second size or with
``dynamic=True`` / ``torch._dynamo.mark_dynamic``), graph breaks (each graph is compiled on its
own) and autograd. freezeframe's on-disk cache is not used here; Dynamo's and Inductor's own
caches are. With graphs, the Python numbers Dynamo passes a graph as inputs are made guarded
constants of it first (:mod:`~freezeframe.compilation.scalar_inputs`): a capture would freeze
them, so another value is a recompile.

To inspect what was built, pass a :class:`FreezeframeBackend` instance instead of the string:
its ``graphs`` list holds one :class:`~freezeframe.compilation.backend.CompileBackend` per
Dynamo graph (``pieces``, ``piece_backends``, ``wrappers``) and ``stats`` counts the work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from torch import fx

from freezeframe.compilation.assemble import CompileStack
from freezeframe.compilation.backend import CompileBackend
from freezeframe.compilation.scalar_inputs import specialising_scalars
from freezeframe.config import CompilationConfig, CompilationMode, CUDAGraphMode
from freezeframe.config_fields import KEY_ALIASES
from freezeframe.errors import ConfigError
from freezeframe.graphs import GraphBackend, GraphWrapper
from freezeframe.stats import Stats

__all__ = ["BACKEND_NAME", "FreezeframeBackend", "freezeframe_backend"]

BACKEND_NAME = "freezeframe"
"""The name ``torch.compile(backend=...)`` knows this backend by (the entry point's name)."""

# The one option that is not a config field: a whole CompilationConfig.
_CONFIG_OPTION = "config"
_MODES = (CompilationMode.PIECEWISE, CompilationMode.DYNAMO_TRACE_ONCE)


def config_from_options(options: Mapping[str, Any] | None) -> CompilationConfig:
    """The config ``torch.compile(..., options=...)`` describes: either ``{"config": cfg}`` or
    CompilationConfig fields. An option that is neither is a ConfigError naming it and listing
    the valid ones."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"torch.compile(backend={BACKEND_NAME!r}): options must be a dict of "
                          f"CompilationConfig fields, got {options!r}")
    fields = CompilationConfig.field_names()
    unknown = sorted(str(k) for k in options
                     if k != _CONFIG_OPTION and KEY_ALIASES.get(k, k) not in fields)
    if unknown:
        raise ConfigError(
            f"torch.compile(backend={BACKEND_NAME!r}): unknown option(s) {unknown}; valid "
            f"options are the CompilationConfig fields {sorted(fields)}, their vLLM spellings "
            f"{sorted(KEY_ALIASES)}, or {_CONFIG_OPTION!r} (a whole CompilationConfig)")
    if _CONFIG_OPTION in options:
        config = options[_CONFIG_OPTION]
        if len(options) > 1:
            others = sorted(str(k) for k in options if k != _CONFIG_OPTION)
            raise ConfigError(
                f"torch.compile(backend={BACKEND_NAME!r}): option 'config' comes with {others}; "
                "give either a whole CompilationConfig or its fields, not both (use "
                "config.replace(...) to change fields of a config)")
        if not isinstance(config, CompilationConfig):
            raise ConfigError(
                f"torch.compile(backend={BACKEND_NAME!r}): option 'config' must be a "
                f"CompilationConfig, got {type(config).__name__}")
    else:
        config = CompilationConfig.from_dict(options)
    if config.mode not in _MODES:
        mode = cast(CompilationMode, config.mode)
        raise ConfigError(
            f"torch.compile(backend={BACKEND_NAME!r}): mode {mode.name} is not a mode of this "
            "backend: torch.compile has already traced the graph it hands over, so the backend "
            "either splits and compiles it per range (mode 'piecewise', the default) or "
            "compiles it whole ('dynamo_trace_once'); for no compilation, do not call "
            "torch.compile")
    return config


class FreezeframeBackend:
    """A Dynamo backend compiling every graph it is given as ``ff.compile`` compiles its trace.

    One instance may serve several graphs (recompiles, graph breaks): each gets its own
    :class:`CompileBackend` in ``graphs``; they share ``stats``, the compiler manager, the
    graph backend (one memory pool) and ``capture_window``.
    """

    def __init__(self, config: CompilationConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise ConfigError(f"FreezeframeBackend: give a CompilationConfig or options, not "
                              f"both (got config and {sorted(options)})")
        self.config = config_from_options({_CONFIG_OPTION: config} if config is not None
                                          else options)
        self._stack = CompileStack.of(self.config, Stats()).with_compiler(BACKEND_NAME)
        self.stats = self._stack.stats
        self.capture_window = self._stack.window
        # None when graphs are off (cudagraph_mode NONE, or "auto" without CUDA).
        self.graph_backend: GraphBackend | None = self._stack.graph_backend
        self.manager = self._stack.manager
        self.graphs: list[CompileBackend] = []
        self.full_wrappers: list[GraphWrapper] = []
        graph_mode = cast(CUDAGraphMode, self.config.cudagraph_mode)
        # with graphs, the Python numbers Dynamo would pass a graph become its constants (a
        # capture would freeze them): another value is a recompile
        self._compile = (self._compile_graph if self.graph_backend is None
                         or graph_mode is CUDAGraphMode.NONE else
                         specialising_scalars(self._compile_graph, BACKEND_NAME, self.stats,
                                              graph_mode))

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self._compile(gm, example_inputs)

    def _compile_graph(self, gm: fx.GraphModule,
                       example_inputs: Sequence[Any]) -> Callable[..., Any]:
        backend = self._stack.piece_compiler(f"{BACKEND_NAME} graph {len(self.graphs)}")
        fn = backend(gm, example_inputs)
        self.graphs.append(backend)
        full = self._stack.full_wrapper(fn)
        if full is None:
            return fn
        self.full_wrappers.append(full)
        return full

    def graph_wrappers(self) -> list[GraphWrapper]:
        """Every graph wrapper built so far: the PIECEWISE ones of each graph, then the FULL
        ones."""
        return [w for g in self.graphs for w in g.wrappers] + list(self.full_wrappers)

    def __repr__(self) -> str:
        mode = cast(CompilationMode, self.config.mode)
        graph_mode = cast(CUDAGraphMode, self.config.cudagraph_mode)
        return (f"FreezeframeBackend(mode={mode.name}, backend={self.config.backend}, "
                f"cudagraph_mode={graph_mode.name}, graphs={len(self.graphs)})")


def freezeframe_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                        options: Mapping[str, Any] | None = None,
                        mode: str | None = None) -> Callable[..., Any]:
    """The function behind ``torch.compile(model, backend="freezeframe", options={...})``.

    torch.compile calls it once per graph with the same ``options``, so each graph gets a
    :class:`FreezeframeBackend` of its own; pass an instance as ``backend=`` to share one (and
    to inspect it). ``mode=`` (torch.compile's ``"reduce-overhead"`` ...) is refused: graphs are
    asked for with the ``cudagraph_mode`` option.
    """
    if mode is not None:
        raise ConfigError(
            f"torch.compile(backend={BACKEND_NAME!r}, mode={mode!r}): torch.compile's modes "
            "belong to Inductor's own pipeline; leave mode out and ask for graphs with "
            "options={'cudagraph_mode': 'piecewise'} (or 'full', 'full_and_piecewise')")
    return FreezeframeBackend(config_from_options(options))(gm, example_inputs)
