"""``ff.compile`` and :class:`CompiledModel`, the ``nn.Module`` a user gets back."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import operator
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules import module as _nn_module
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle as _hook_handles

from freezeframe.batch import BatchDescriptor
from freezeframe.compilation.backend import CompileBackend
from freezeframe.compilation.cached_trace import ModelCache
from freezeframe.compilation.compilers import CompilerManager, make_compiler
from freezeframe.compilation.direct_call import (
    DirectCall,
    Stitched,
    direct_call,
    free_of_side_effects,
    planned_stitching,
    rebuilder,
    sized_call,
)
from freezeframe.compilation.module_state import ModuleState, has_uninitialised_lazy
from freezeframe.compilation.saved_trace import source_name
from freezeframe.compilation.signature import (
    CallSignature,
    SameCall,
    Signer,
    SizeGuards,
    difference,
    distinct_storages,
    exact_key,
    incompatibility,
    same_call,
)
from freezeframe.compilation.split import Piece
from freezeframe.compilation.trace import TraceOnce, is_size_equality, resolve_dynamic_arg_dims
from freezeframe.config import CompilationConfig, CompilationMode, CUDAGraphMode
from freezeframe.context import get_forward_context
from freezeframe.errors import (
    CaptureError,
    CompileError,
    ConfigError,
    FreezeframeError,
    InputMismatchError,
)
from freezeframe.graphs import (
    CaptureWindow,
    GraphBackend,
    GraphOptions,
    GraphWrapper,
    resolve_backend,
)
from freezeframe.graphs.wrapper import PieceReplay, StaleReplay
from freezeframe.stats import Stats

__all__ = ["CompiledModel", "compile"]

logger = logging.getLogger(__name__)

_requires_grad = operator.attrgetter("requires_grad")
_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state
_inference_mode_enabled = torch.is_inference_mode_enabled


# Where freezeframe's and torch's own frames are: a warning is reported at the first frame
# outside them, the user's line that called the model.
_INTERNAL = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
             os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def _warn_at_caller(message: str) -> None:
    frame: types.FrameType | None = sys._getframe(0)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def _first_lines(text: str, n: int) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:n] + (["  ..."] if len(lines) > n else []))


def _needs_grad(values: Iterable[Any]) -> bool:
    """Whether a tensor among ``values`` (or inside a list, tuple or dict among them) requires
    grad; plain tensors are checked without flattening."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple, dict)) and any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in pytree.tree_leaves(value)):
            return True
    return False


# A model gets one trace per distinct call structure (see freezeframe.compilation.signature); a
# forward whose structure keeps changing (an int argument that counts steps) would otherwise
# trace forever. Past this many traces a new structure is an error that names what changed.
MAX_TRACES = 8
# How many exact call keys a compiled model remembers (one per distinct shape called); past
# this the memory is emptied and refilled.
MAX_EXACT_KEYS = 1024


@dataclasses.dataclass
class _Variant:
    """One trace of the model and everything built from it: the call structure it serves,
    the trace, its compiled pieces and graph wrappers, its on-disk cache, its FULL wrapper."""

    signature: CallSignature | None  # None until its first call
    trace: TraceOnce
    backend: CompileBackend
    cache: ModelCache
    full_wrapper: GraphWrapper | None
    guards: SizeGuards | None = None  # the trace's conditions on sizes; None until traced
    stitched: Stitched | None = None  # what the trace's code calls, once traced
    sources: list[str | None] | None = None  # the Dynamo source of each graph input
    # the trace called without Dynamo's bytecode (direct_call.py), from its second call on;
    # ``direct_tried`` is set once that was worked out (``direct`` left None where the direct
    # call could differ: the bytecode stays)
    direct: DirectCall | None = None
    direct_tried: bool = False
    # the stitching copies with pieces' entries bound in, by those entries (sized_call)
    sized: dict[tuple[int, ...], Any] = dataclasses.field(default_factory=dict)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.full_wrapper is not None:
            return self.full_wrapper(*args, **kwargs)
        direct = self.direct
        if direct is not None:
            return direct.call(*args, **kwargs)
        return self.cache(*args, **kwargs)


class CompiledModel(nn.Module):
    """A module compiled per ``config``: traced once on the first call, then run as compiled
    pieces (and graphs) for every batch size.

    Holds every piece of compile state for this one instance (traces, pieces, compiled
    entries, graph wrappers, ``stats``), so two compiled models never share anything.

    Every call is checked against what the trace assumed (:mod:`freezeframe.compilation.signature`):
    a tensor with another dtype, device, rank or fixed size is an
    :class:`~freezeframe.errors.InputMismatchError`; another call *structure* (``None`` where
    a tensor was, another plain value, another memory layout, arguments sharing storage, a
    batch size on the other side of a Python branch in ``forward``) gets its own trace,
    counted in ``stats.retraces`` and logged, up to :data:`MAX_TRACES` traces.

    Calls run under ``torch.inference_mode()`` unless ``inference_mode=False`` was given to
    :func:`compile` (graph capture records no autograd history).
    """

    def __init__(self, module: nn.Module, config: CompilationConfig,
                 dynamic_arg_dims: Mapping[str, int | Sequence[int]] | None = None, *,
                 model_key: str | None = None, inference_mode: bool = True) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"ff.compile: expected an nn.Module, got {type(module).__name__}")
        if not isinstance(config, CompilationConfig):
            raise ConfigError(f"ff.compile: expected a CompilationConfig, got "
                              f"{type(config).__name__}; build one with "
                              "ff.CompilationConfig(...) or CompilationConfig.from_dict(...)")
        if not isinstance(inference_mode, bool):
            raise ConfigError(f"ff.compile: inference_mode must be True or False, got "
                              f"{inference_mode!r}")
        self.module = module
        self.config = config
        self.stats = Stats()
        self.model_key = model_key or f"{type(module).__module__}.{type(module).__qualname__}"
        self.inference_mode = inference_mode
        self._user_key = model_key
        self.capture_window = CaptureWindow()
        # None when graphs are off (cudagraph_mode NONE, or "auto" without CUDA).
        self._graph_backend: GraphBackend | None = resolve_backend(config)
        self._graph_mode = cast(CUDAGraphMode, config.cudagraph_mode)

        self.manager: CompilerManager | None = None
        self._dims: dict[str, tuple[int, ...]] = {}
        self._signer: Signer | None = None
        self._variants: list[_Variant] = []
        self._routes: dict[tuple[Any, ...], list[_Variant]] = {}
        # exact call key (signature.exact_key) -> where such a call goes: filled once a call
        # of that key has been routed with its variant's direct call worked out
        self._exact: dict[tuple[Any, ...], Callable[..., Any]] = {}
        # per exact key, a check that a call is alike without building its key (SameCall),
        # None where there is none; and the one of the last remembered call served
        self._same: dict[tuple[Any, ...], SameCall | None] = {}
        self._last: SameCall | None = None
        self._lock = threading.RLock()  # one thread traces; the others wait for it
        self._armed_at = -1  # the hook-handle count __call__'s short cut was worked out at
        self._warned: set[str] = set()
        self._stock: Callable[..., Any] | None = None
        self._full_wrapper: GraphWrapper | None = None
        self._spare: _Variant | None = None
        self._params: tuple[nn.Parameter, ...] | None = None  # listed at the first graph step
        # The module's Python state as the first trace saw it (see module_state): checked
        # cheaply on every call, fully on route misses and, with config.debug, on every call.
        self._state: ModuleState | None = None
        self._check_state_every_call = config.debug
        # moves on each drop of every graph (parameters replaced: _drop_graphs_reading); a
        # runner compares it to capture its keys again
        self.graph_generation = 0
        self._grad_matters = not inference_mode  # autograd mode is part of a call's key
        mode = config.mode
        if mode in (CompilationMode.DYNAMO_TRACE_ONCE, CompilationMode.PIECEWISE):
            self._dims = resolve_dynamic_arg_dims(module.forward, dynamic_arg_dims)
            compiler = make_compiler(config.backend, self.stats, config.inductor_compile_config,
                                     config.inductor_passes)
            prepare = self._graph_backend.prepare if self._graph_backend is not None else None
            self.manager = CompilerManager(compiler, self.stats, model_key=self.model_key,
                                           prepare=prepare)
            self._signer = Signer(module.forward, self._dims, grad_matters=not inference_mode)
            if not inference_mode and self._graph_backend is not None \
                    and self._graph_mode is not CUDAGraphMode.NONE:
                logger.info("%s: inference_mode=False with graphs on; calls that record "
                            "autograd history cannot be captured", self.model_key)
            # Built now so its FULL wrapper is visible before the first call; the first call
            # gives it its structure.
            self._spare = self._new_variant(None)
            return
        if mode is CompilationMode.STOCK_TORCH_COMPILE:
            self._stock = torch.compile(module.forward, backend=self._stock_backend)
        run = self._stock if self._stock is not None else module.forward
        if self._graph_backend is not None and self._graph_mode.has_full_cudagraphs():
            self._full_wrapper = self._make_full_wrapper(run)

    def _make_full_wrapper(self, run: Callable[..., Any]) -> GraphWrapper:
        assert self._graph_backend is not None
        return GraphWrapper(run, CUDAGraphMode.FULL, self._graph_backend,
                            options=GraphOptions(), stats=self.stats,
                            window=self.capture_window, debug=self.config.debug)

    # -- variants -------------------------------------------------------------------------
    def _new_variant(self, signature: CallSignature | None) -> _Variant:
        assert self.manager is not None
        backend = CompileBackend(self.config, self.stats, self.manager,
                                 graph_backend=self._graph_backend, window=self.capture_window,
                                 model_key=self.model_key)
        # The on-disk cache wraps the backend (traced files, saved trace) and the first call.
        cache = ModelCache(self, self._dims, model_key=self._user_key, signer=self._signer)
        holder: list[_Variant] = []

        def stitched_backend(gm: Any, example_inputs: Sequence[Any]) -> Any:
            stitched = Stitched(backend(gm, example_inputs))
            holder[0].stitched = stitched
            holder[0].sources = [source_name(n) for n in gm.graph.nodes if n.op == "placeholder"]
            return stitched

        trace = TraceOnce(self.module, cache.wrap_backend(stitched_backend), self._dims)
        cache.trace = trace
        full = None
        if self._graph_backend is not None and self._graph_mode.has_full_cudagraphs():
            full = self._make_full_wrapper(cache)
        variant = _Variant(signature, trace, backend, cache, full)
        holder.append(variant)
        return variant

    def _accepts(self, variant: _Variant, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> bool:
        guards = variant.guards
        if guards is None or guards.trivial:
            return guards is not None
        assert self._signer is not None
        return guards.accepts(self._signer.dynamic_sizes(args, kwargs))

    def _route(self, key: tuple[Any, ...], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        """A call whose key has no ready variant: find one, or trace a new one (one thread at
        a time; a thread that waited finds the variant another one traced)."""
        assert self._signer is not None
        with self._lock:
            if self._state is not None:
                self._check_state(self._state)
            for variant in self._routes.get(key, ()):
                if self._accepts(variant, args, kwargs):
                    return variant(args, kwargs)
            signature = self._signer.signature(args, kwargs)
            sizes = self._signer.dynamic_sizes(args, kwargs)
            same = [v for v in self._variants if v.signature == signature]
            for variant in same:
                if self._accepts(variant, args, kwargs):
                    routes = self._routes.setdefault(key, [])
                    if variant not in routes:
                        routes.append(variant)
                    return variant(args, kwargs)
            for variant in same:
                self._check_consistent_sizes(variant, sizes)
            for variant in self._variants:
                if variant.signature is None:
                    continue
                why = incompatibility(variant.signature, signature, self._dims)
                if why is not None:
                    raise InputMismatchError(f"{self.model_key}: {why}")
            if len(self._variants) >= MAX_TRACES:
                raise CompileError(
                    f"{self.model_key}: this call would need trace number "
                    f"{len(self._variants) + 1}, above the limit of {MAX_TRACES}. Each new call "
                    f"structure is traced separately; this one is {signature.describe()}, and "
                    f"differs from the first trace in {self._first_difference(signature)}. "
                    "Keep the call structure fixed: pass values that change per call (step "
                    "counters, flags) as tensors, keep tensors contiguous, pass the same function "
                    "or object each call (a new one is compared by identity), and avoid Python "
                    "branches on the batch size in forward")
            why = self._dynamo_off()
            if why is not None:
                return self._run_eager(why, args, kwargs)
            return self._trace_new(key, signature, sizes, args, kwargs)

    def _first_difference(self, signature: CallSignature) -> str:
        first = self._variants[0].signature if self._variants else None
        return difference(first, signature) if first is not None else signature.describe()

    def _check_consistent_sizes(self, variant: _Variant,
                                sizes: Mapping[tuple[str, int], int]) -> None:
        """Raise when the call breaks an equality the trace found between two dynamic sizes
        (``x`` and ``positions`` must have as many rows): eager would fail on it too."""
        if variant.guards is None:
            return
        symbols = variant.trace.size_symbols
        for expr, where in variant.guards.conditions:
            if not is_size_equality(expr):
                continue
            a, b = symbols.get(expr.lhs), symbols.get(expr.rhs)
            if a is None or b is None or a not in sizes or b not in sizes:
                continue
            if sizes[a] != sizes[b]:
                raise InputMismatchError(
                    f"{self.model_key}: argument {a[0]!r} has {sizes[a]} along dim {a[1]} but "
                    f"argument {b[0]!r} has {sizes[b]} along dim {b[1]}; the model needs them "
                    f"equal (at {where}). Pass both with the same size")

    def _dynamo_off(self) -> str | None:
        """Why Dynamo will not trace right now (``TORCH_COMPILE_DISABLE=1``, a disabled Dynamo
        config, the ``force_eager`` stance), or None."""
        if torch._dynamo.config.disable:
            return "Dynamo is disabled (TORCH_COMPILE_DISABLE=1 or torch._dynamo.config.disable)"
        stance = getattr(torch._dynamo.eval_frame, "_stance", None)
        if getattr(stance, "stance", "default") == "force_eager":
            return "the torch.compiler stance is force_eager"
        return None

    def _run_eager(self, why: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The documented fallback when Dynamo cannot trace: run the module as it is, counted
        in ``stats.compile_disabled`` and warned about once per model."""
        self.stats.inc("compile_disabled")
        if "compile_disabled" not in self._warned:
            self._warned.add("compile_disabled")
            message = (f"{self.model_key}: {why}, so this call runs the module eagerly (no "
                       "trace, no compiled pieces, no graphs); calls keep running eagerly until "
                       "Dynamo is enabled again, and are counted in stats.compile_disabled")
            logger.warning(message)
            _warn_at_caller(message)
        return self.module(*args, **kwargs)

    def _trace_new(self, key: tuple[Any, ...], signature: CallSignature,
                   sizes: Mapping[tuple[str, int], int], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        if self._spare is not None:
            variant, self._spare = self._spare, None
            variant.signature = signature
        else:
            variant = self._new_variant(signature)
        if self._variants:
            self.stats.inc("retraces")
            if any(v.signature == signature for v in self._variants):
                logger.warning("%s: no trace serves a call with dynamic sizes %s (a Python "
                               "branch on a size in forward); it is traced again (trace %d)",
                               self.model_key, dict(sizes), len(self._variants) + 1)
            else:
                logger.warning("%s: a call with a new structure is traced again (trace %d); "
                               "it differs from the first trace in %s", self.model_key,
                               len(self._variants) + 1, self._first_difference(signature))
        # The tracing call runs uncaptured even inside a FULL forward context: Dynamo cannot
        # trace inside a capture. A later call of that descriptor captures.
        first = not self._variants
        if first:
            self._refuse_root_hooks()
        before = None if not first or has_uninitialised_lazy(self.module) \
            else ModuleState(self.module, every_call=False)
        try:
            out = variant.cache(*args, **kwargs)
            if before is not None:
                self._refuse_self_changing_forward(before)
        except BaseException as exc:
            if not self._variants and self._spare is None:
                # Nothing of the failed trace is kept: a fresh spare takes its place, so the
                # model looks as it did before the call and the next call traces again.
                self._spare = self._new_variant(None)
            if isinstance(exc, torch._dynamo.exc.Unsupported) \
                    and "Observed exception" in str(exc):
                # forward raised an exception of its own (input validation): what the user
                # gets from eager, and from torch.compile, which runs the frame eagerly then
                self._raise_users_exception(args, kwargs, exc)
            if isinstance(exc, torch._dynamo.exc.Unsupported):
                # Dynamo's message names the line and what it could not trace; ours says why
                # that is fatal here and what to do.
                raise CompileError(
                    f"{self.model_key}: forward cannot be traced as one graph, which "
                    "freezeframe needs (it splits that graph at the splitting ops and captures "
                    "the pieces; there are no graph breaks to fall back on). Dynamo says:\n"
                    f"{_first_lines(str(exc), 12)}\nMake that code traceable (torch.where "
                    "or torch.cond for a branch on tensor values, no .item() in control flow), "
                    "move it out of forward, or compile the module with torch.compile "
                    "instead") from exc
            inner = getattr(exc, "inner_exception", None)
            if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed) and isinstance(
                    inner, FreezeframeError):
                # Dynamo wraps what our compile path raised in its own error type; the user
                # gets ours, with its message and fix, not Dynamo's wrapper around it.
                raise inner.with_traceback(None) from exc
            raise
        trace = variant.trace
        only: dict[tuple[str, int], int] = {}
        if self.config.backend == "inductor":
            # Inductor specialises code on a size-1 dim even when Dynamo kept it symbolic, so
            # a trace made at size 1 serves size 1 only; another size traces again.
            only = {where: 1 for where, n in sizes.items() if n == 1}
        variant.guards = SizeGuards(trace.size_conditions, trace.size_symbols, only)
        if first:
            self._state = ModuleState(self.module)
        self._warn_branches(trace)
        self._variants.append(variant)
        self._routes.setdefault(key, []).append(variant)
        return out

    def _raise_users_exception(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                               exc: BaseException) -> None:
        """Dynamo stopped at an exception forward raises itself: run forward eagerly, as
        torch.compile would, so the caller gets that exception (``except ValueError`` works);
        return when eager does not raise (the trace's failure is reported then)."""
        try:
            self.module(*args, **kwargs)
        except Exception as users:
            raise users.with_traceback(users.__traceback__) from None
        logger.debug("%s: Dynamo observed an exception that eager did not raise: %s",
                     self.model_key, exc)

    def _refuse_root_hooks(self) -> None:
        """Dynamo traces the compiled module's ``forward``, not its ``__call__``: hooks
        registered on that module itself would never run, so they are refused (hooks on its
        submodules are traced with them)."""
        module = self.module
        kinds = [kind for kind, hooks in (
            ("forward ", module._forward_hooks), ("forward pre-", module._forward_pre_hooks),
            ("backward ", module._backward_hooks),
            ("backward pre-", module._backward_pre_hooks)) if hooks]
        if kinds:
            raise CompileError(
                f"{self.model_key}: the compiled module has {' and '.join(kinds)}hook(s) "
                "registered on itself, which a trace of its forward would skip (its "
                "submodules' hooks are traced). Register them on the compiled model instead "
                "(ff.compile(...).register_forward_hook(...)), where they run on every call, or "
                "remove them before the first call")

    def __setattr__(self, name: str, value: Any) -> None:
        # Any attribute set may be one the short cut of __call__ depends on (forward,
        # _compiled_call_impl): it is worked out again on the next call. Disarmed after the
        # set as well, for a thread arming meanwhile (see _arm).
        self.__dict__["_armed_at"] = -1
        if name == "module" and "module" in self.__dict__.get("_modules", {}):
            raise ConfigError(
                f"{self.model_key}: a compiled model's module cannot be replaced: its traces, "
                "pieces and graphs were made from the first one. Compile the new module "
                "instead: ff.compile(new_module, config)")
        super().__setattr__(name, value)
        self.__dict__["_armed_at"] = -1

    def __reduce__(self) -> tuple[Any, ...]:
        """What a copy of a compiled model is (``copy.copy``, ``copy.deepcopy``, ``pickle``,
        ``torch.save``): a new compiled model of the module (the same module for
        ``copy.copy``, a copy of it otherwise) with the same config, dynamic dims, model key,
        inference mode, train/eval flag and hooks. Nothing compiled is copied: traces, pieces
        and graphs (with their device memory) belong to one instance. The copy traces on its
        first call, keeps stats of its own, and loads its pieces from the compile cache when
        ``use_cache`` is on."""
        state: dict[str, Any] = {"training": self.training}
        for name, value in self.__dict__.items():
            if "hook" in name:  # nn.Module's hook dicts (and flags), each a container anew
                state[name] = type(value)(value) if isinstance(value, dict) else value
        return (_compiled_again, (self.module, self.config, self._dims or None,
                                  self._user_key, self.inference_mode), state)

    def _check_state(self, state: ModuleState) -> None:
        why = state.difference()
        if why is None:
            moved = state.moved_tensors()
            if moved:
                self._drop_graphs_reading(moved)
            state.refresh()
            return
        raise CompileError(
            f"{self.model_key}: the module changed after its first call was traced: {why}. "
            "The trace baked the old value in (freezeframe checks the module's Python state "
            "instead of keeping Dynamo's guards), so this call is refused rather than "
            "answered from a stale trace. Make such changes (model.eval(), hooks, attributes "
            "forward reads) before the first call, or compile again after them: "
            "ff.compile(module, config)")

    def _drop_graphs_reading(self, moved: list[str]) -> None:
        """Parameters or buffers were replaced, or their memory moved, since the graphs were
        captured: every graph reads the old memory at its captured address, so every graph
        is dropped (the next step of each size captures again; a runner captures its keys
        again, see :attr:`graph_generation`). A step is never served from them, and no new
        value is copied into the old tensors (a swapped-out weight stays as it was)."""
        wrappers = [w for w in self.graph_wrappers() if w.captured_descriptors]
        if not wrappers:
            return  # no graph: the trace reads parameters and buffers anew on every call
        for wrapper in wrappers:
            wrapper.clear()
        self._exact.clear()  # routes remembered with the old graphs
        self._same.clear()
        self.__dict__["_last"] = None
        self.graph_generation += 1
        self.stats.inc("graphs_dropped_weights")
        shown = ", ".join(moved[:4]) + (f" and {len(moved) - 4} more" if len(moved) > 4
                                         else "")
        if "weights" not in self._warned:
            self._warned.add("weights")
            logger.warning("%s: %s replaced (or its memory moved) after graphs were captured: "
                           "the graphs read the old memory, so all of them were dropped and "
                           "are captured again (counted in stats.graphs_dropped_weights; "
                           "logged once)", self.model_key, shown)
        else:
            logger.debug("%s: %s replaced: graphs dropped", self.model_key, shown)

    def _refuse_self_changing_forward(self, before: ModuleState) -> None:
        why = before.difference(tensor_stores=True)
        if why is None:
            return
        raise CompileError(
            f"{self.model_key}: forward changes the module's own Python state while it runs "
            f"({why} after the first call). A trace replays what the first call did, so every "
            "later call would repeat that value instead of going on from it. Keep such state "
            "in a tensor buffer (self.register_buffer(...)) and update it in place, or keep it "
            "out of forward")

    def _warn_branches(self, trace: TraceOnce) -> None:
        for expr, where in trace.size_conditions:
            if is_size_equality(expr):
                continue  # two sizes that must be equal: checked per call, not a branch
            text = str(expr)
            for sym, (name, dim) in trace.size_symbols.items():
                text = text.replace(str(sym), f"{name}.shape[{dim}]")
            if text in self._warned:
                continue
            self._warned.add(text)
            self.stats.inc("size_branches")
            message = (f"{self.model_key}: forward branches on a dynamic size ({text}, at "
                       f"{where}); this trace serves only the sizes where that holds, and a "
                       "size on the other side is traced separately (counted in "
                       "stats.retraces). Make forward's control flow independent of the batch "
                       "size to trace once")
            logger.warning(message)
            _warn_at_caller(message)

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A call of an exact shape seen before (:func:`~freezeframe.compilation.signature.
        exact_key`) goes from here straight to where the last such call went, after the
        module-state check; every other call goes through ``nn.Module.__call__`` and
        :meth:`forward`, as do all calls while the model has hooks, runs in someone else's
        trace (Dynamo, TorchScript), keeps autograd (``inference_mode=False``), has its
        ``forward`` replaced on the instance, or has seen no shape twice. The short cut skips
        only what an unhooked ``nn.Module`` call would have done (nothing) and forward's
        routing (which this call repeats by its key).

        Whether the short cut may be taken is worked out once (:meth:`_arm`) and holds while
        torch's hook-handle counter stays where it was (every hook registered, on this model,
        anywhere else or globally, moves it) and no attribute of this model is set (which
        disarms it). A call then checks that counter, the two trace states and this model's
        forward hooks, whose dicts are read on every call because torch moves the counter
        before it stores the hook: a hook registered by another thread while this one arms
        is still seen. (Global forward hooks are counted by the module-state check, which
        refuses them; backward hooks cannot run under inference mode.)"""
        if (self._armed_at != _hook_handles.next_id or self._forward_hooks
                or self._forward_pre_hooks or _is_compiling()
                or _tracing_state() is not None) and not self._arm():
            return super().__call__(*args, **kwargs)
        state = self._state
        if state is not None and (self._check_state_every_call or state.changed_cheaply()):
            self._check_state(state)
        last = self._last  # the last remembered call served: is this one alike?
        if (last is not None and not kwargs and len(args) == last.count and last.check(*args)
                and (last.count == 1 or distinct_storages(args))):
            known = last.call
        else:
            exact = exact_key(args, kwargs, False)
            found = self._exact.get(exact) if exact is not None else None
            if found is None or exact is None:  # (forward keys it again: once per new shape)
                return self.forward(*args, **kwargs)
            known = found
            if exact in self._same:
                same = self._same[exact]
                if same is not None and not same.check(*args):
                    # made in another dispatch state (no_grad, inference_mode): made anew
                    same = self._same[exact] = same_call(args, kwargs, known)
            else:  # (made once per exact key)
                same = self._same[exact] = same_call(args, kwargs, known)
            self.__dict__["_last"] = same  # (not through __setattr__, which disarms)
        if _inference_mode_enabled():
            return known(*args, **kwargs)
        with torch._C._InferenceMode(True):  # what torch.inference_mode() enters
            return known(*args, **kwargs)

    def _arm(self) -> bool:
        """Whether this call may skip ``nn.Module.__call__`` (see :meth:`__call__`); when it
        may, remember the hook-handle counter so that the next calls need not ask again.

        Safe against another thread changing the model meanwhile: the counter is read
        before anything is checked (registering a hook moves it first), and the conditions
        are checked again after arming, while :meth:`__setattr__` disarms after it sets, so
        an attribute set (``forward``) either is seen here or disarms after this store."""
        count = _hook_handles.next_id
        if not self._may_skip_module_call():
            return False
        self.__dict__["_armed_at"] = count  # (not through __setattr__, which disarms)
        if not self._may_skip_module_call():
            self.__dict__["_armed_at"] = -1
            return False
        return True

    def _may_skip_module_call(self) -> bool:
        return not (_is_compiling() or _tracing_state() is not None or not self._exact
                    or not self.inference_mode
                    or "forward" in self.__dict__  # a wrapper set on the instance (accelerate)
                    or self._forward_hooks or self._forward_pre_hooks or self._backward_hooks
                    or self._backward_pre_hooks or _nn_module._global_forward_hooks
                    or _nn_module._global_forward_pre_hooks
                    or _nn_module._global_backward_hooks
                    or _nn_module._global_backward_pre_hooks
                    or self._compiled_call_impl is not None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            # Inside someone else's trace: be inlined as the plain module.
            return self.module(*args, **kwargs)
        if self.inference_mode:
            if _inference_mode_enabled():
                return self._call(args, kwargs)
            with torch._C._InferenceMode(True):  # what torch.inference_mode() enters
                return self._call(args, kwargs)
        if torch.is_grad_enabled() and self._graph_backend is not None:
            self._refuse_graphs_under_autograd(args, kwargs)
        return self._call(args, kwargs)

    def _refuse_graphs_under_autograd(self, args: tuple[Any, ...],
                                      kwargs: dict[str, Any]) -> None:
        """Refuse a graph step (capture or replay) while autograd records and something needs
        a gradient, before any piece runs: a replayed graph records no autograd history, so
        its output would lack eager's gradient. Checked here rather than per piece, because
        a piece that needs no gradient would otherwise be captured before the one that does
        fails, and a graph captured while nothing needed one would be replayed silently.

        Only a graph step with ``inference_mode=False`` and grad enabled pays for it (the
        parameters are listed once, then read at about 0.1 us each per call; a call under
        ``torch.no_grad()``, as the runner makes, skips it)."""
        ctx = get_forward_context()
        if ctx is None or ctx.batch_descriptor is None or ctx.mode is CUDAGraphMode.NONE \
                or not self._graph_mode.has_mode(ctx.mode):
            return
        params = self._params
        if params is None:
            params = self._params = tuple(self.module.parameters())
        if any(map(_requires_grad, params)):
            name = next(n for n, p in self.module.named_parameters() if p.requires_grad)
            why = f"parameter {name!r} requires grad"
        elif _needs_grad(args) or _needs_grad(kwargs.values()):
            why = f"{self._argument_needing_grad(args, kwargs)} requires grad"
        else:
            return
        raise CaptureError(
            f"{self.model_key}: cannot run the {ctx.mode.name} graphs for "
            f"{ctx.batch_descriptor} while autograd is recording ({why}): a replayed graph "
            "records no autograd history, so its output would have no gradient where eager's "
            "has one. This model was compiled with ff.compile(..., inference_mode=False); "
            "graphs are for inference: call under torch.no_grad() or torch.inference_mode(), "
            "compile with inference_mode=True (the default), or run steps that need "
            "gradients with mode=CUDAGraphMode.NONE")

    def _argument_needing_grad(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The name of the first argument holding a tensor that requires grad (error path)."""
        try:
            bound = inspect.signature(self.module.forward).bind(*args, **kwargs).arguments
        except TypeError:  # the call itself is wrong; the model's own error follows
            return "an argument"
        for name, value in bound.items():
            if any(isinstance(t, torch.Tensor) and t.requires_grad
                   for t in pytree.tree_leaves(value)):
                return f"argument {name!r}"
        return "an argument"

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        signer = self._signer
        if signer is None:
            if self._full_wrapper is not None:
                return self._full_wrapper(*args, **kwargs)
            run = self._stock if self._stock is not None else self.module.forward
            return run(*args, **kwargs)
        state = self._state
        if state is not None and (self._check_state_every_call or state.changed_cheaply()):
            self._check_state(state)
        exact = exact_key(args, kwargs, self._grad_matters)
        known = self._exact.get(exact) if exact is not None else None
        if known is not None:
            return known(*args, **kwargs)
        key = signer.key(args, kwargs)
        variant = self._route_of(key, args, kwargs)
        if variant is not None:
            if variant.direct is None and not variant.direct_tried:
                return self._call_building_direct(variant, args, kwargs)
            if exact is not None:
                return self._call_remembering(variant, exact, args, kwargs)
            return variant(args, kwargs)
        return self._route(key, args, kwargs)

    def _call_remembering(self, variant: _Variant, exact: tuple[Any, ...],
                          args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``variant`` and remember it for calls with the exact key ``exact``: its direct
        call, with each piece's compiled entry bound in when the model has no graphs (no
        graph wrapper decides per call), else the variant as it is called now."""
        direct = variant.direct
        stitched = variant.stitched
        stitching = variant.backend.stitching
        if len(self._exact) >= MAX_EXACT_KEYS:
            self._exact.clear()  # (a few slow calls refill it)
            self._same.clear()
        if direct is None or variant.full_wrapper is not None:
            self._exact[exact] = lambda *a, **k: variant(a, k)
            return variant(args, kwargs)
        if self._graph_backend is None and stitched is not None and stitching is not None \
                and stitched.calls(stitching):
            backends = dict(zip(variant.backend.capturable_names,
                                variant.backend.piece_backends, strict=True))
            if all(getattr(stitching, name) is b for name, b in backends.items()):
                out, sized = sized_call(direct, stitching, backends, variant.sized, args,
                                        kwargs)
                self._exact[exact] = sized.call
                return out
        self._exact[exact] = direct.call
        return direct.call(*args, **kwargs)

    def _call_building_direct(self, variant: _Variant, args: tuple[Any, ...],
                              kwargs: dict[str, Any]) -> Any:
        """Call ``variant`` through Dynamo's bytecode, watching what it passes to the graph,
        and work out its direct call (direct_call.py) from that. Done on the variant's second
        routed call: the first one traced (or loaded) it."""
        stitched = variant.stitched
        if stitched is None or stitched.recording is not None or variant.full_wrapper \
                is not None:
            variant.direct_tried = stitched is not None and stitched.recording is None
            return variant(args, kwargs)
        calls: list[tuple[tuple[Any, ...], Any]] = []
        stitched.recording = calls
        try:
            out = variant(args, kwargs)
        finally:
            stitched.recording = None
        variant.direct_tried = True
        variant.direct = direct_call(self.module, variant.trace, variant.sources, stitched,
                                     calls, out, args, kwargs)
        return out

    def replayer(self, descriptor: BatchDescriptor, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Callable[[], Any] | None:
        """A zero-argument function that replays this model's FULL graph for ``descriptor``,
        captured on exactly these arguments (a runner's static buffers), for callers that
        pass them again and again: the call-structure routing and the replay's input checks
        are done once, here; each call keeps the module-state check of every call (the cheap
        tier, or the full one with ``debug``). ``None`` when there is no such graph.

        Call it under no autograd recording (the runner calls under ``torch.no_grad()``); it
        raises :class:`~freezeframe.graphs.StaleReplay` once the graph is dropped."""
        if self._signer is None:
            wrapper = self._full_wrapper
        else:
            variant = self._routed(args, kwargs)
            wrapper = variant.full_wrapper if variant is not None else None
        replay = wrapper.replayer(descriptor, args, kwargs) if wrapper is not None else None
        state = self._state
        if replay is None or state is None:
            return replay
        every_call, check = self._check_state_every_call, self._check_state

        def checked() -> Any:
            if every_call or state.changed_cheaply():
                check(state)
            return replay()

        return checked

    def plan_piecewise(self, descriptor: BatchDescriptor, args: tuple[Any, ...],
                       kwargs: dict[str, Any], run: Callable[[], Any]
                       ) -> tuple[Any, Callable[[], Any] | None]:
        """Call ``run()`` (this model on ``args``/``kwargs``, a runner's static buffers, inside
        a PIECEWISE forward context for ``descriptor``) and watch it: the flat inputs Dynamo's
        code passed to the stitching graph and what it returned. Return ``run()``'s output and,
        when the call can be repeated without the model's Python, a zero-argument function
        that repeats it on the same buffers: the stitching graph called directly on the
        recorded flat inputs, each capturable piece a planned replay
        (:meth:`GraphWrapper.piece_replayer`), the splitting ops called as the graph calls
        them, the output rebuilt from the graph's outputs. The module-state check stays on
        every call; the caller keeps the forward context. None when anything about the call
        is not plannable: no split trace, Python side effects in the generated code, an
        output that is not the graph's own, a piece without a graph."""
        variant = self._routed(args, kwargs) if self._signer is not None else None
        stitched = variant.stitched if variant is not None else None
        if variant is None or stitched is None:
            return run(), None
        calls: list[tuple[tuple[Any, ...], Any]] = []
        stitched.recording = calls
        try:
            out = run()
        finally:
            stitched.recording = None
        return out, self._piecewise_plan(variant, stitched, descriptor, calls, out)

    def _piecewise_plan(self, variant: _Variant, stitched: Stitched,
                        descriptor: BatchDescriptor,
                        calls: list[tuple[tuple[Any, ...], Any]], out: Any
                        ) -> Callable[[], Any] | None:
        backend = variant.backend
        stitching = backend.stitching
        if len(calls) != 1 or stitching is None or not free_of_side_effects(variant.trace):
            return None
        flat_args, flat_out = calls[0]
        rebuild = rebuilder(out, flat_out)
        if rebuild is None or not stitched.calls(stitching):
            return None
        names = backend.capturable_names
        wrappers = [getattr(stitching, name) for name in names]
        if not all(isinstance(w, GraphWrapper) for w in wrappers):
            return None
        replays = [w.piece_replayer(descriptor) for w in wrappers]
        if any(r is None for r in replays):
            return None
        planned = planned_stitching(stitching, dict(zip(names, replays, strict=True)))
        forward = planned.forward
        pieces = cast(list[PieceReplay], replays)
        state, every_call, check = self._state, self._check_state_every_call, self._check_state
        inference = self.inference_mode

        def replay() -> Any:
            # the state first: parameters replaced since the plan drop every graph there
            if state is not None and (every_call or state.changed_cheaply()):
                check(state)
            if not all(piece.live for piece in pieces):
                for piece in pieces:
                    piece.retire()
                raise StaleReplay(f"a PIECEWISE graph for {descriptor} was dropped")
            try:
                if inference:  # (the guard torch.inference_mode() enters, for less)
                    with torch._C._InferenceMode(True):
                        flat = forward(*flat_args)
                else:
                    flat = forward(*flat_args)
            except StaleReplay as exc:  # part of the step ran: it must not run again
                raise CaptureError(
                    f"{self.model_key}: a planned PIECEWISE step for {descriptor} met a piece "
                    f"argument unlike its capture halfway through ({exc})") from None
            return rebuild(flat)

        return replay

    def _routed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Variant | None:
        assert self._signer is not None
        return self._route_of(self._signer.key(args, kwargs), args, kwargs)

    def _route_of(self, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> _Variant | None:
        """The trace an earlier call of this structure (``key``) was routed to and whose size
        conditions this call meets, or None (a route miss: see :meth:`_route`)."""
        assert self._signer is not None
        for variant in self._routes.get(key, ()):
            guards = variant.guards
            if guards is not None and (guards.trivial or guards.accepts(
                    self._signer.dynamic_sizes(args, kwargs))):
                return variant
        return None

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
        """The split pieces of the first trace in execution order (empty before the first
        call)."""
        return list(self._variants[0].backend.pieces) if self._variants else []

    @property
    def compile_off_reason(self) -> str | None:
        """Why a call now runs the module eagerly without tracing or graphs (Dynamo disabled,
        the ``force_eager`` stance), or None when it compiles."""
        return self._dynamo_off()

    @property
    def graph_backend(self) -> GraphBackend | None:
        """The graph backend this model captures with (``None`` when it captures nothing)."""
        return self._graph_backend

    @property
    def traced(self) -> bool:
        return bool(self._variants)

    @property
    def num_traces(self) -> int:
        """How many traces this model holds (one per call structure seen)."""
        return len(self._variants)

    @property
    def _trace(self) -> TraceOnce | None:
        return self._variants[0].trace if self._variants else None

    @property
    def _backend(self) -> CompileBackend | None:
        return self._variants[0].backend if self._variants else None

    def check_state(self) -> int:
        """The every-call module-state check, run now (see :class:`Capturable`): a runner runs
        it before a step that may capture or replay, so graphs that read replaced tensors are
        dropped before it decides, not inside the step. Returns :attr:`graph_generation`."""
        state = self._state
        if state is not None and (self._check_state_every_call or state.changed_cheaply()):
            with self._lock:
                self._check_state(state)
        return self.graph_generation

    def graph_wrappers(self) -> list[Any]:
        """Every graph wrapper this model owns (per trace: the piecewise ones, then the FULL
        one)."""
        out: list[Any] = []
        for variant in [*self._variants, *([self._spare] if self._spare else [])]:
            out.extend(variant.backend.wrappers)
            if variant.full_wrapper is not None:
                out.append(variant.full_wrapper)
        if self._full_wrapper is not None:
            out.append(self._full_wrapper)
        return out

    def extra_repr(self) -> str:
        mode = cast(CompilationMode, self.config.mode)
        graph_mode = cast(CUDAGraphMode, self.config.cudagraph_mode)
        return (f"mode={mode.name}, backend={self.config.backend}, "
                f"cudagraph_mode={graph_mode.name}")


def _compiled_again(module: nn.Module, config: CompilationConfig,
                    dynamic_arg_dims: Mapping[str, Sequence[int]] | None, model_key: str | None,
                    inference_mode: bool) -> CompiledModel:
    """A copy of a compiled model (:meth:`CompiledModel.__reduce__`)."""
    return CompiledModel(module, config, dynamic_arg_dims, model_key=model_key,
                         inference_mode=inference_mode)


def compile(module: nn.Module, config: CompilationConfig,
            dynamic_arg_dims: Mapping[str, int | Sequence[int]] | None = None, *,
            model_key: str | None = None, inference_mode: bool = True) -> CompiledModel:
    """Compile ``module`` per ``config``; returns an ``nn.Module`` to call instead of it.

    ``dynamic_arg_dims`` maps forward argument names to the dim(s) whose size varies between
    calls (default: dim 0 of every tensor argument: each one annotated ``Tensor`` /
    ``Optional[Tensor]``, or not annotated). ``model_key`` names
    this model in logs and in the compile cache (default: the module's class path).
    ``inference_mode`` (default True) runs every call under ``torch.inference_mode()``, as
    serving engines do; pass False to keep the caller's autograd mode (a call that records
    autograd history then cannot be captured as a graph).
    """
    return CompiledModel(module, config, dynamic_arg_dims, model_key=model_key,
                         inference_mode=inference_mode)

