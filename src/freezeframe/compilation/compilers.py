"""The compilers a piece can be handed to, and the manager that calls them.

A :class:`Compiler` turns one FX piece plus example inputs into a callable for one compile
range (symbolic shapes) or one concrete size (static shapes). :class:`CompilerManager` is the
single door every compilation goes through: it counts ``backend_compilations`` (per piece and
range, also for a cache hit or a reused piece, so counts depend on neither), compiles each
*distinct* piece once per range (pieces whose :func:`~freezeframe.cache.key.graph_hash` is equal
share one callable: the layers of a transformer), times and logs each compile, hands callables
that launch their own kernels to the graph backend's ``prepare``, and is where the on-disk cache
hooks in (``cache=``: an object with ``load`` and ``save``, see :class:`ArtifactCache`).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib
import inspect
import logging
import marshal
import time
import uuid as uuid_module
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import fx

from freezeframe.cache.artifacts import choose_artifact_format
from freezeframe.cache.key import graph_hash, hash_sources
from freezeframe.compilation.split import fx_forward
from freezeframe.errors import CompileError, ConfigError
from freezeframe.sizes import Range
from freezeframe.stats import Stats

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.config import CompilationConfig

__all__ = [
    "ArtifactCache",
    "Compiler",
    "CompilerManager",
    "EagerCompiler",
    "InductorCompiler",
    "config_passes",
    "current_compile_range",
    "make_compiler",
    "pass_sources",
    "stock_backend",
]

logger = logging.getLogger(__name__)

# The range being compiled right now, so an Inductor pass can specialise on it (read with
# current_compile_range()). A ContextVar, not a global: concurrent compiles do not mix.
_COMPILE_RANGE: contextvars.ContextVar[Range | None] = contextvars.ContextVar(
    "freezeframe_compile_range", default=None)


def _restart_signal() -> type[BaseException]:
    """Dynamo's signal to trace the frame again (Inductor raises TensorifyScalarRestartAnalysis
    from inside a compile): never wrapped, or Dynamo cannot catch it. Looked up when an
    exception is being handled, so importing this module does not import Dynamo."""
    import torch._dynamo.exc

    return torch._dynamo.exc.RestartAnalysis


def current_compile_range() -> Range | None:
    """The compile range (or single size) of the compilation in progress, else ``None``."""
    return _COMPILE_RANGE.get()


@contextlib.contextmanager
def _compiling(compile_range: Range) -> Iterator[None]:
    token = _COMPILE_RANGE.set(compile_range)
    try:
        yield
    finally:
        _COMPILE_RANGE.reset(token)


class Compiler(Protocol):
    """Compiles one piece for one range or size. ``name`` keys cache entries;
    ``launches_kernels`` says whether the result runs generated kernels of its own (rather
    than the piece's torch ops), which a graph backend may need to know."""

    name: str
    launches_kernels: bool

    def compile(self, graph: fx.GraphModule, example_inputs: list[Any],
                compile_range: Range, piece_index: int) -> Callable[..., Any]: ...


class ArtifactCache(Protocol):
    """What :class:`CompilerManager` expects of an on-disk cache
    (:class:`freezeframe.cache.artifacts.PieceCache`).

    ``load`` returns a ready callable or ``None`` on a miss; ``save`` is called after a miss
    was compiled. ``compiler`` is the compiler that would compile (its ``name`` and, for
    Inductor, its ``compile_artifact`` give what is worth saving). ``recover`` is asked after a
    compile failed: True when it repaired something the compile depends on (a damaged Inductor
    cache directory), so that one more try is worth it.
    """

    def load(self, compiler: Compiler, graph: fx.GraphModule, example_inputs: list[Any],
             compile_range: Range, piece_index: int) -> Callable[..., Any] | None: ...

    def recover(self, error: BaseException) -> bool: ...

    def save(self, compiler: Compiler, graph: fx.GraphModule, example_inputs: list[Any],
             compile_range: Range, piece_index: int, runnable: Callable[..., Any]) -> None: ...


class EagerCompiler:
    """No code generation: the piece runs as the FX graph it is. Fast to build, so the tests
    and CPU users can exercise split, ranges and graphs without waiting for Inductor."""

    name = "eager"
    launches_kernels = False

    def __init__(self, stats: Stats) -> None:
        self._stats = stats

    def compile(self, graph: fx.GraphModule, example_inputs: list[Any],
                compile_range: Range, piece_index: int) -> Callable[..., Any]:
        self._stats.inc("eager_compiles")
        return fx_forward(graph)


def resolve_pass(name: str, value: str | Callable[..., Any]) -> Callable[..., Any]:
    """The callable an ``inductor_passes`` entry names (a callable, or 'module.function')."""
    if callable(value):
        return value
    module_name, _, attr = str(value).rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"inductor_passes[{name!r}]: cannot import {value!r} ({exc}); give a callable or "
            "an importable 'package.module.function' name") from None
    if not callable(obj):
        raise ConfigError(f"inductor_passes[{name!r}]: {value!r} is not callable")
    return obj


# Custom-pass settings of Inductor's config. Each is wrapped per compile range (see
# _make_pass_chain) so that Inductor's FX-graph cache can never serve one range the code it
# compiled for another under the same pass.
CUSTOM_PASS_SETTINGS = ("post_grad_custom_pre_pass", "post_grad_custom_post_pass",
                         "joint_custom_pre_pass", "joint_custom_post_pass")


def pass_identity(fn: Callable[..., Any]) -> str:
    """What identifies a pass's behaviour: its ``uuid()`` when it has one (Inductor's
    ``CustomGraphPass`` contract), else a digest of its code — bytecode, constants and names,
    nested code objects included, and the values its closure holds — so an edited body is a new
    identity even where the name stays. A pass whose code cannot be read gets an identity no
    other process shares (never a cache hit, never a stale one)."""
    uuid = getattr(fn, "uuid", None)
    if callable(uuid):
        return repr(uuid())
    qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
    name = f"{getattr(fn, '__module__', '?')}.{qualname}"
    method = vars(type(fn)).get("__call__")  # a pass object: the code of its class's __call__
    code = getattr(fn, "__code__", None) or getattr(method, "__code__", None)
    try:
        blob = marshal.dumps(code) if code is not None else None
        cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
        if blob is not None:
            blob += repr(cells).encode()
    except (ValueError, TypeError):  # a constant marshal cannot write, an empty cell
        blob = None
    if blob is None:
        return f"{name}#unreadable-{_PROCESS_TOKEN}"
    return f"{name}#{hashlib.sha256(blob).hexdigest()[:16]}"


_PROCESS_TOKEN = uuid_module.uuid4().hex


def config_passes(config: CompilationConfig) -> dict[str, Any]:
    """Every Inductor pass the config installs: ``inductor_passes`` and the custom-pass
    settings of ``inductor_compile_config``."""
    passes = dict(config.inductor_passes)
    for setting in CUSTOM_PASS_SETTINGS:
        value = config.inductor_compile_config.get(setting)
        if value is not None:
            passes[f"inductor_compile_config.{setting}"] = value
    return passes


def pass_sources(passes: Mapping[str, Any]) -> dict[str, list[str | None]]:
    """``{pass name: [sha256 of the file defining it, identity of its code]}``.

    The config's own key names a string pass by its name and a callable by its qualified name,
    and Inductor keys a custom pass by its ``uuid()``; none of them changes when the pass body
    or a helper it calls is edited, so the defining file's contents and the code's digest
    (:func:`pass_identity`) join the cache key (:meth:`~freezeframe.cache.entry.CompileCache.open`
    takes them as ``inductor_passes``). The file hash is None when the pass or its file cannot be
    found (a lambda typed at a prompt).
    """
    out: dict[str, list[str | None]] = {}
    for name, value in sorted(passes.items()):
        try:
            fn = resolve_pass(name, value)
        except ConfigError:
            out[name] = [None, None]
            continue
        try:
            path = inspect.getsourcefile(fn) or inspect.getsourcefile(type(fn))
        except TypeError:
            path = None
        out[name] = [hash_sources([path]).get(path) if path else None, pass_identity(fn)]
    return out


def _make_pass_chain(passes: Sequence[tuple[str, Callable[..., Any]]],
                     compile_range: Range) -> Any:
    """One Inductor post-grad custom pass running the user's passes in order.

    Built as a ``CustomGraphPass`` whose uuid names the passes and the range, so Inductor's
    own FX-graph cache stays usable and never mixes code compiled for different ranges.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass

    ident = hashlib.sha256(
        repr([(n, pass_identity(f)) for n, f in passes] + [str(compile_range)]).encode()
    ).hexdigest()

    class _PassChain(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for _, fn in passes:
                fn(graph)

        def uuid(self) -> Any:
            return ident

    return _PassChain()


class InductorCompiler:
    """Inductor code generation in the artifact format
    :func:`~freezeframe.cache.artifacts.choose_artifact_format` picks for this torch (torch's
    AOT artifact, ``standalone_compile``'s cache artifact, or ``compile_fx`` with nothing to
    save); ``artifact_format`` forces one (``"standalone"`` exercises the fallback).

    Single sizes compile with ``dynamic_shapes="from_example_inputs"`` (static shapes, real
    example sizes); ranges with ``"from_graph"`` (the graph's symbolic shapes). The user's
    ``inductor_compile_config`` and passes apply only inside ``torch._inductor.config.patch``
    around this call, never to the process.
    """

    name = "inductor"
    launches_kernels = True

    def __init__(self, stats: Stats, compile_config: Mapping[str, Any] | None = None,
                 passes: Mapping[str, str | Callable[..., Any]] | None = None, *,
                 artifact_format: str = "auto") -> None:
        self._stats = stats
        # "aot", "standalone" or None (compile_fx): what is compiled, saved and loaded
        self.artifact_format = choose_artifact_format(artifact_format)
        self._compile_config = dict(compile_config or {})
        self._passes = [(n, resolve_pass(n, v)) for n, v in (passes or {}).items()]
        if self._passes and "post_grad_custom_post_pass" in self._compile_config:
            raise ConfigError(
                "inductor_compile_config sets post_grad_custom_post_pass and inductor_passes is "
                "not empty; freezeframe installs inductor_passes there, so give your pass in "
                "inductor_passes instead")

    def _patches(self, compile_range: Range) -> dict[str, Any]:
        patches = dict(self._compile_config)
        for setting in CUSTOM_PASS_SETTINGS:
            user_pass = patches.get(setting)
            if user_pass is not None and callable(user_pass):
                patches[setting] = _make_pass_chain([(setting, user_pass)], compile_range)
        if self._passes:
            patches["post_grad_custom_post_pass"] = _make_pass_chain(self._passes,
                                                                     compile_range)
        return patches

    def compile_artifact(self, graph: fx.GraphModule, example_inputs: list[Any],
                         compile_range: Range, piece_index: int) -> tuple[Any, Callable[..., Any]]:
        """``(artifact, runnable)``; ``artifact`` is the ``CompiledArtifact`` (has ``save``) or
        ``None`` on the ``compile_fx`` path."""
        from torch._inductor import config as inductor_config

        self._stats.inc("inductor_compiles")
        self._stats.inc(f"inductor_compiles_{self.artifact_format or 'compile_fx'}")
        dynamic = "from_example_inputs" if compile_range.is_single_size() else "from_graph"
        with inductor_config.patch(self._patches(compile_range)), _compiling(compile_range), \
                _never_a_cache_hit(dynamic == "from_graph"):
            if self.artifact_format is not None:
                extra: dict[str, Any] = {"aot": True} if self.artifact_format == "aot" else {}
                standalone = cast(Callable[..., Any], torch._inductor.standalone_compile)
                artifact = standalone(graph, list(example_inputs), dynamic_shapes=dynamic,
                                      **extra)
                return artifact, artifact
            from torch._inductor.compile_fx import compile_fx

            return None, cast(Callable[..., Any], compile_fx(graph, list(example_inputs)))

    def compile(self, graph: fx.GraphModule, example_inputs: list[Any],
                compile_range: Range, piece_index: int) -> Callable[..., Any]:
        return self.compile_artifact(graph, example_inputs, compile_range, piece_index)[1]


@contextlib.contextmanager
def _never_a_cache_hit(fresh: bool) -> Iterator[None]:
    """``fresh``: compile without hitting Inductor's caches, while still writing to them.

    Inductor's FX graph cache, on a hit, adds the cached code's guards to the trace's shape
    environment: for the reference Llama that pinned its request dim to 4, so every range
    compile after the first on a machine (the same process or another) failed "forward pins a
    dynamic size to 4" (tests/matrix: inductor_llama_on_a_warm_inductor_cache). Turning the
    cache off would also take away what a standalone artifact serialises from (its bundled
    autograd cache entry), and no compiled piece could be saved. So a range compile gets a
    cache-key tag of its own: it writes as usual and never reads another compile's entry.
    freezeframe's own compile cache keeps warm starts warm."""
    compiler_config: Any = torch.compiler.config  # (a config module: patch() is dynamic)
    if not fresh:
        yield
    elif hasattr(compiler_config, "cache_key_tag"):
        with compiler_config.patch(cache_key_tag=f"freezeframe-{uuid_module.uuid4().hex}"):
            yield
    else:  # (a torch without the tag: no cache at all, and no saved artifact)
        from torch._inductor import config as inductor_config

        with inductor_config.patch(fx_graph_cache=False):
            yield


def make_compiler(backend: str, stats: Stats, compile_config: Mapping[str, Any] | None = None,
                  passes: Mapping[str, str | Callable[..., Any]] | None = None, *,
                  artifact_format: str = "auto") -> Compiler:
    """The compiler a config's ``backend`` names (``artifact_format``: Inductor's, see
    :func:`~freezeframe.cache.artifacts.choose_artifact_format`)."""
    if backend == "eager":
        return EagerCompiler(stats)
    if backend == "inductor":
        return InductorCompiler(stats, compile_config, passes, artifact_format=artifact_format)
    raise ConfigError(f"backend: unknown compiler {backend!r}; use 'eager' or 'inductor'")



def stock_backend(config: CompilationConfig, stats: Stats,
                  prepare: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
                  ) -> Callable[..., Any]:
    """The Dynamo backend of mode ``STOCK_TORCH_COMPILE``: plain torch.compile with counting
    (every (re)trace is a graph traced and compiled whole by the config's compiler).
    ``prepare`` is the graph backend's (``GraphBackend.prepare``) when the model has graphs:
    Inductor's code then goes through it as the traced pieces' does (on the emulated backend
    a unit recorded whole, since its C++ kernels write through pointers a recorder cannot
    see: without it every emulated FULL replay of an Inductor-compiled stock model was
    wrong)."""

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        stats.inc("graphs_traced")
        stats.inc("backend_compilations")
        if config.backend == "eager":
            stats.inc("eager_compiles")
            return gm.forward
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        stats.inc("inductor_compiles")
        with inductor_config.patch(dict(config.inductor_compile_config)):
            compiled: Any = compile_fx(gm, example_inputs)
        return prepare(compiled) if prepare is not None else compiled

    return backend

class CompilerManager:
    """Compile-or-load for one compiled model; every piece x range/size goes through here."""

    def __init__(self, compiler: Compiler, stats: Stats, *, cache: ArtifactCache | None = None,
                 model_key: str = "",
                 prepare: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
                 ) -> None:
        self.compiler = compiler
        self.cache = cache
        # the graph backend's prepare (GraphBackend.prepare), for callables that launch their
        # own kernels; None when graphs are off
        self._prepare = prepare
        self.model_key = model_key
        self._stats = stats
        self.compile_seconds = 0.0
        # (graph_hash, range start, range end) -> (first piece index, unprepared runnable): a
        # piece whose structure an earlier piece had reuses that piece's compiled code
        self._compiled: dict[tuple[str, int, int], tuple[int, Callable[..., Any]]] = {}

    def use_cache(self, cache: ArtifactCache | None) -> None:
        """Load and save compiled artifacts through ``cache`` (None: compile every time)."""
        self.cache = cache

    def _compile_once_more_after_recovery(self, graph: fx.GraphModule,
                                          example_inputs: list[Any], compile_range: Range,
                                          piece_index: int) -> Callable[..., Any]:
        """Compile; if that fails and the cache can recover (it emptied a damaged Inductor
        cache directory), compile once more. A second failure is the compiler's own."""
        try:
            return self.compiler.compile(graph, example_inputs, compile_range, piece_index)
        except (ConfigError, CompileError, _restart_signal()):
            raise
        except Exception as exc:
            if self.cache is None or not self.cache.recover(exc):
                raise
        return self.compiler.compile(graph, example_inputs, compile_range, piece_index)

    def compile(self, graph: fx.GraphModule, example_inputs: list[Any], compile_range: Range,
                piece_index: int, *, graph_key: str | None = None) -> Callable[..., Any]:
        """The runnable of ``graph`` for ``compile_range``: the one an earlier piece with the
        same structural hash got for this range (``pieces_reused``), else loaded from the cache,
        else compiled. ``graph_key`` is the piece's :func:`graph_hash` when the caller has it
        (computed from ``graph`` and ``example_inputs`` otherwise)."""
        # Counted before the cache is asked: a cache hit is still a backend compilation.
        self._stats.inc("backend_compilations")
        key = graph_key if graph_key is not None else graph_hash(graph, example_inputs)
        slot = (key, compile_range.start, compile_range.end)
        shared = self._compiled.get(slot)
        if shared is not None:
            self._stats.inc("pieces_reused")
            logger.debug("piece %d for sizes %s: the same graph as piece %d, reusing its "
                         "compiled code", piece_index, compile_range, shared[0])
            return self._prepared(shared[1])
        runnable = self._compile_or_load(graph, example_inputs, compile_range, piece_index)
        self._compiled[slot] = (piece_index, runnable)
        return self._prepared(runnable)

    def _prepared(self, runnable: Callable[..., Any]) -> Callable[..., Any]:
        if self._prepare is not None and self.compiler.launches_kernels:
            return self._prepare(runnable)
        return runnable

    def _compile_or_load(self, graph: fx.GraphModule, example_inputs: list[Any],
                         compile_range: Range, piece_index: int) -> Callable[..., Any]:
        start = time.perf_counter()
        runnable = None
        if self.cache is not None:
            runnable = self.cache.load(self.compiler, graph, example_inputs, compile_range,
                                       piece_index)
        loaded = runnable is not None
        if runnable is None:
            try:
                runnable = self._compile_once_more_after_recovery(graph, example_inputs,
                                                                  compile_range, piece_index)
            except (ConfigError, CompileError, _restart_signal()):
                raise  # (a restart signal is Dynamo's to catch: it traces again)
            except Exception as exc:
                raise CompileError(
                    f"{self.compiler.name} failed to compile piece {piece_index} for sizes "
                    f"{compile_range}: {type(exc).__name__}: {exc}; try backend='eager' to "
                    "check the model itself, or move the failing op into splitting_ops"
                ) from exc
            if self.cache is not None:
                self.cache.save(self.compiler, graph, example_inputs, compile_range,
                                piece_index, runnable)
        elapsed = time.perf_counter() - start
        self.compile_seconds += elapsed
        logger.debug("%s piece %d for sizes %s in %.3f s%s", "loaded" if loaded else "compiled",
                     piece_index, compile_range, elapsed, " (cache)" if loaded else "")
        return runnable
