"""``ff.compile`` and :class:`CompiledModel`, the ``nn.Module`` a user gets back.

The model owns its compile state and its hot path; the parts live next to it: the compile
stack (:mod:`~freezeframe.compilation.assemble`), which trace serves a call and the memos of
repeated calls (:mod:`~freezeframe.compilation.routing`), what a trace refuses and how a failed
one reads (:mod:`~freezeframe.compilation.trace_checks`), and what a runner plans its graph
steps from (:mod:`~freezeframe.compilation.graph_steps`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle as _hook_handles

from freezeframe.batch import BatchDescriptor
from freezeframe.compilation import graph_steps
from freezeframe.compilation.assemble import CompileStack, Variant
from freezeframe.compilation.compilers import CompilerManager
from freezeframe.compilation.module_call import PositionalForm, may_skip_module_call
from freezeframe.compilation.module_state import ModuleState, has_uninitialised_lazy
from freezeframe.compilation.routing import MAX_TRACES, Router
from freezeframe.compilation.signature import (
    CallSignature,
    Signer,
    distinct_storages,
    exact_key,
    same_call,
)
from freezeframe.compilation.split import Piece
from freezeframe.compilation.trace import dynamo_off_reason, resolve_dynamic_arg_dims
from freezeframe.compilation.trace_checks import run_eagerly
from freezeframe.compilation.untraced import Untraced
from freezeframe.config import CompilationConfig, CompilationMode, CUDAGraphMode
from freezeframe.context import get_forward_context
from freezeframe.errors import CompileError, ConfigError
from freezeframe.graphs import GraphBackend
from freezeframe.graphs.replay import Replay
from freezeframe.stats import Stats

__all__ = ["MAX_TRACES", "CompiledModel", "compile"]

logger = logging.getLogger(__name__)

_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state
_inference_mode_enabled = torch.is_inference_mode_enabled


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
        _check_arguments(module, config, inference_mode)
        self.module = module
        self.config = config
        self.stats = Stats()
        self.model_key = model_key or f"{type(module).__module__}.{type(module).__qualname__}"
        self.inference_mode = inference_mode
        self._user_key = model_key
        self._stack = CompileStack.of(config, self.stats, ordinary_memory=not inference_mode)
        self.capture_window = self._stack.window
        # None when graphs are off (cudagraph_mode NONE, or "auto" without CUDA).
        self._graph_backend: GraphBackend | None = self._stack.graph_backend
        self._graph_mode = cast(CUDAGraphMode, config.cudagraph_mode)
        self.manager: CompilerManager | None = None  # compile-or-load, in the trace-once modes
        self._dims: dict[str, tuple[int, ...]] = {}
        self._signer: Signer | None = None
        self._router: Router | None = None
        # the router's memos, read by __call__ without going through it (empty without one)
        self._exact: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._same: dict[tuple[Any, ...], Any] = {}
        self._last: Any = None  # the SameCall of the last remembered call served
        self._lock = threading.RLock()  # one thread traces; the others wait for it
        self._armed_at = -1  # the hook-handle count __call__'s short cut was worked out at
        self._warned: set[str] = set()
        self._untraced: Untraced | None = None  # modes NONE and STOCK_TORCH_COMPILE
        self._params: tuple[nn.Parameter, ...] | None = None  # listed at the first graph step
        # The module's Python state as the first trace saw it (see module_state): checked
        # cheaply on every call, fully on route misses and, with config.debug, on every call.
        self._state: ModuleState | None = None
        self._full_every_call = config.debug
        # The per-call check (the one every call, step and replay runs; see _adopt_state):
        # nothing before the first trace, then the state's generated every-call tier, which
        # runs the full one (_state_changed) when it sees a change; with debug the full one.
        self._check: Callable[[], None] = _unchecked
        # moves on each drop of every graph (parameters replaced: _drop_graphs_reading); a
        # runner compares it to capture its keys again
        self.graph_generation = 0
        self._grad_matters = not inference_mode  # autograd mode is part of a call's key
        if config.mode in (CompilationMode.DYNAMO_TRACE_ONCE, CompilationMode.PIECEWISE):
            self._build_tracing(dynamic_arg_dims)
            return
        self._untraced = Untraced(module, config, self._stack, self.stats, self.model_key)

    def _build_tracing(self, dynamic_arg_dims: Mapping[str, int | Sequence[int]] | None
                       ) -> None:
        """Set up the trace-once modes: the compile stack, the call keys, the router."""
        module = self.module
        self._dims = resolve_dynamic_arg_dims(module.forward, dynamic_arg_dims)
        self.dims_given = dynamic_arg_dims is not None  # (else a 0-d tensor stays static)
        self.manager = self._stack.with_compiler(self.model_key).manager
        self._signer = Signer(module.forward, self._dims, grad_matters=not self.inference_mode)
        if not self.inference_mode and self._stack.graph_backend is not None \
                and self._graph_mode is not CUDAGraphMode.NONE:
            logger.info("%s: inference_mode=False with graphs on; calls that record "
                        "autograd history cannot be captured", self.model_key)
        self._router = Router(self.model_key, self._signer, self._dims, self.stats,
                              self._new_variant, warned=self._warned,
                              inductor=self.config.backend == "inductor",
                              on_state_change=self._state_changed)
        self._exact, self._same = self._router.exact, self._router.same

    def _new_variant(self, signature: CallSignature | None) -> Variant:
        variant = self._stack.variant(self.module, self.model_key, self._dims, self._user_key,
                                      self._signer, signature, dims_given=self.dims_given)
        if variant.full_wrapper is not None:  # its graph holds Dynamo's code, stores too
            variant.full_wrapper.repeat_stores_of(self.module)
        return variant

    # -- routing and tracing ----------------------------------------------------------------
    def _route(self, key: tuple[Any, ...], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        """A call whose key has no ready variant: find one, or trace a new one (one thread at
        a time; a thread that waited finds the variant another one traced)."""
        router = self._router
        assert router is not None
        with self._lock:
            if self._state is not None:
                self._state_changed()  # the full tier, on every route miss
            variant = router.route_of(key, args, kwargs)
            if variant is not None:
                return variant(args, kwargs)
            signature = router.signer.signature(args, kwargs)
            variant = router.serving(key, signature, args, kwargs)
            if variant is not None:
                return variant(args, kwargs)
            why = dynamo_off_reason()
            if why is not None:
                return run_eagerly(self.module, why, self.model_key, self.stats, self._warned,
                                   args, kwargs)
            out, state = router.trace_new(self.module, key, signature, args, kwargs)
            if state is not None:  # the first trace: its module state is checked from now on
                self._adopt_state(state)
            return out

    # -- attributes and copies ---------------------------------------------------------------
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
        """A copy (``copy.copy``/``deepcopy``, ``pickle``, ``torch.save``) is a new compiled
        model of the module (the same one for ``copy.copy``) with the same settings, flag and
        hooks; nothing compiled is copied (it traces anew, or loads from the cache)."""
        state: dict[str, Any] = {"training": self.training}
        for name, value in self.__dict__.items():
            if "hook" in name:  # nn.Module's hook dicts (and flags), each a container anew
                state[name] = type(value)(value) if isinstance(value, dict) else value
        return (_compiled_again, (self.module, self.config, self._dims or None,
                                  self._user_key, self.inference_mode), state)

    # -- the module's state -----------------------------------------------------------------
    def _adopt_state(self, state: ModuleState) -> None:
        self._state = state
        self.__dict__["_check"] = self._state_changed if self._full_every_call \
            else state.check  # (not through __setattr__, which disarms)

    def _state_changed(self) -> None:
        """The full module-state check (on a hit of the every-call tier, a route miss, every
        call with ``debug``): graphs reading replaced tensors dropped, or the call refused."""
        state = self._state
        assert state is not None
        with self._lock:  # (one thread drops and refreshes; re-entered from _route)
            why = state.difference()
            if why is not None and self._untraced is not None:
                # no trace: every graph is captured again, running the new Python
                self._untraced.drop_for_change(why, self._warned)
                self.graph_generation += 1
                self._adopt_state(self._untraced.state(self._state_changed))
                return
            if why is None:
                moved = state.moved_tensors()
                if moved:
                    self._drop_graphs_reading(moved)
                state.refresh()
                if not self._full_every_call:  # (refresh may have generated it anew)
                    self.__dict__["_check"] = state.check
                return
        raise _module_changed(self.model_key, why)

    def state_check(self) -> Callable[[], Any] | None:
        """The every-call module-state check as a function of nothing that stays current (a
        runner's planned step runs it before its replays): :meth:`check_state`; None before
        the first trace."""
        return self.check_state if self._state is not None else None

    def _drop_graphs_reading(self, moved: list[str]) -> None:
        """Parameters or buffers were replaced since the graphs were captured: every graph is
        dropped (:func:`graph_steps.drop_graphs`), and the calls remembered with them."""
        if not graph_steps.drop_graphs(self.graph_wrappers(), moved, self.model_key,
                                       self.stats, self._warned):
            return  # no graph: the trace reads parameters and buffers anew on every call
        if self._router is not None:
            self._router.forget_calls()  # routes remembered with the old graphs
        self.__dict__["_last"] = None
        self.graph_generation += 1

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
        self._check()
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
        if not (self._exact and self.inference_mode and may_skip_module_call(self)):
            return False
        self.__dict__["_armed_at"] = count  # (not through __setattr__, which disarms)
        if not (self._exact and self.inference_mode and may_skip_module_call(self)):
            self.__dict__["_armed_at"] = -1
            return False
        return True

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
            if self._params is None:
                self._params = tuple(self.module.parameters())
            graph_steps.refuse_graphs_under_autograd(
                get_forward_context(), self._graph_mode, self.module, self._params, args,
                kwargs, self.model_key)
        return self._call(args, kwargs)


    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        router = self._router
        if router is None:
            return self._call_untraced(args, kwargs)
        self._check()
        exact = exact_key(args, kwargs, self._grad_matters)
        known = self._exact.get(exact) if exact is not None else None
        if known is not None:
            return known(*args, **kwargs)
        key = router.signer.key(args, kwargs)
        variant = router.route_of(key, args, kwargs)
        if variant is None:
            return self._route(key, args, kwargs)
        if variant.direct is None and not variant.direct_tried:
            return router.call_building_direct(self.module, variant, args, kwargs)
        if exact is not None:
            return router.remember(variant, exact, args, kwargs, self._graph_backend is not None)
        return variant(args, kwargs)

    def _call_untraced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Modes NONE and STOCK_TORCH_COMPILE. With graphs, the module's state is checked as
        a trace's is: a graph replays the Python control flow of its capture and reads the
        parameters it captured, so a change to either must not be answered from it."""
        untraced = self._untraced
        assert untraced is not None
        if untraced.call is not untraced.run and not has_uninitialised_lazy(self.module):
            if self._state is None:
                with self._lock:
                    if self._state is None:
                        self._adopt_state(untraced.state(self._state_changed))
            else:
                self._check()
        return untraced.call(*args, **kwargs)

    # -- what a runner plans its graph steps from (see graph_steps) ------------------------
    def graph_replay(self, mode: CUDAGraphMode, descriptor: BatchDescriptor,
                     args: tuple[Any, ...], kwargs: dict[str, Any], owner: object
                     ) -> Replay | None:
        """The :class:`~freezeframe.graphs.replay.Replay` of this model's graph of the whole
        forward for ``descriptor`` (the FULL graph, or under PIECEWISE a breakable model's
        graph) that ``owner`` (a runner's static buffers) captured reading exactly these
        arguments, or None. A runner's planned step replays it on them directly
        (:meth:`Replay.on_captured`), after :meth:`state_check`: the call-structure routing
        and the replay's input checks are done once, here. Call it under no autograd
        recording (the runner steps under ``torch.no_grad()``)."""
        if self._untraced is not None:
            graphs = self._untraced.for_call(args, kwargs)
            wrapper = graphs.full if mode is CUDAGraphMode.FULL else graphs.breakable
        elif self._router is None or mode is not CUDAGraphMode.FULL:
            wrapper = None
        else:
            variant = self._router.routed(args, kwargs)
            wrapper = variant.full_wrapper if variant is not None else None
        if wrapper is not None:  # (a graph holds the one spelling of its call)
            args, kwargs = PositionalForm(self.module.forward)(args, kwargs)
        return graph_steps.graph_replay(wrapper, descriptor, args, kwargs, owner)

    def record_pieces(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                      descriptor: BatchDescriptor, owner: object
                      ) -> graph_steps.PieceRecording | None:
        """A recording of the stitching graph's calls, for a runner to enter around its own
        call of this model on ``args``/``kwargs`` (its static buffers) in a PIECEWISE step
        for ``descriptor``; its :meth:`~graph_steps.PieceRecording.chain` then says how later
        steps of that shape run without the model's Python. None where the call has no
        stitching graph (a breakable model: see :meth:`graph_replay`)."""
        if self._router is None:
            return None
        variant = self._router.routed(args, kwargs)
        if variant is None or variant.stitched is None:
            return None
        return graph_steps.PieceRecording(variant, descriptor, owner, self.inference_mode,
                                          self.model_key)

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
        return dynamo_off_reason()

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
    def _variants(self) -> list[Variant]:
        return self._router.variants if self._router is not None else []

    def check_state(self) -> int:
        """The every-call module-state check, run now (see :class:`Capturable`): a runner runs
        it before a step that may capture or replay, so graphs that read replaced tensors are
        dropped before it decides, not inside the step. Returns :attr:`graph_generation`."""
        self._check()
        return self.graph_generation

    def graph_wrappers(self) -> list[Any]:
        """Every graph wrapper this model owns (per trace: the piecewise ones, then the FULL
        one)."""
        if self._untraced is not None:
            return list(self._untraced.wrappers())
        return self._router.graph_wrappers() if self._router is not None else []

    def extra_repr(self) -> str:
        mode = cast(CompilationMode, self.config.mode)
        graph_mode = cast(CUDAGraphMode, self.config.cudagraph_mode)
        return (f"mode={mode.name}, backend={self.config.backend}, "
                f"cudagraph_mode={graph_mode.name}")


def _unchecked() -> None:
    """The per-call check before the first trace: nothing to check yet."""


def _module_changed(model_key: str, why: str) -> CompileError:
    return CompileError(
        f"{model_key}: the module changed after its first call was traced: {why}. "
        "The trace baked the old value in (freezeframe checks the module's Python state "
        "instead of keeping Dynamo's guards), so this call is refused rather than "
        "answered from a stale trace. Make such changes (model.eval(), hooks, attributes "
        "forward reads) before the first call, or compile again after them: "
        "ff.compile(module, config)")


def _check_arguments(module: Any, config: Any, inference_mode: Any) -> None:
    if not isinstance(module, nn.Module):
        raise ConfigError(f"ff.compile: expected an nn.Module, got {type(module).__name__}")
    if not isinstance(config, CompilationConfig):
        raise ConfigError(f"ff.compile: expected a CompilationConfig, got "
                          f"{type(config).__name__}; build one with "
                          "ff.CompilationConfig(...) or CompilationConfig.from_dict(...)")
    if not isinstance(inference_mode, bool):
        raise ConfigError(f"ff.compile: inference_mode must be True or False, got "
                          f"{inference_mode!r}")

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

