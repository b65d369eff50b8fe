"""Trace a module's forward with Dynamo exactly once and call the result without Dynamo.

``torch.compile`` normally guards every trace and retraces when a guard fails. Serving wants the
opposite: one trace with a symbolic batch dim, reused for every later size. So all guards are
dropped (``guard_filter_fn``), and the bytecode Dynamo generates for ``forward`` is captured
with a bytecode hook that is registered only while the first call runs. Later calls execute
that bytecode as a plain Python function, so neither Dynamo's frame evaluation nor any guard
runs on the hot path. When the bytecode cannot be captured (``forward`` is not a plain Python
function), later calls go through the compiled function under the ``fail_on_recompile``
stance, so a second trace is an error instead of a silent recompile.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from freezeframe.errors import CompileError, ConfigError

__all__ = ["TraceOnce", "resolve_dynamic_arg_dims"]

logger = logging.getLogger(__name__)

# Enough cache entries for many CompiledModels of one class: each instance adds one entry
# (its own backend) to the same code object, which Dynamo would otherwise count as recompiles.
_RECOMPILE_LIMIT = 8192


def _drop_all_guards(entries: Sequence[Any]) -> list[bool]:
    return [False] * len(entries)


def _is_tensor_annotation(ann: Any) -> bool:
    if ann is inspect.Parameter.empty:
        return False
    if isinstance(ann, str):
        text = ann.replace(" ", "")
        return text in {"Tensor", "torch.Tensor", "Optional[Tensor]", "Optional[torch.Tensor]",
                        "Tensor|None", "torch.Tensor|None", "None|Tensor", "None|torch.Tensor"}
    if isinstance(ann, type):
        return issubclass(ann, torch.Tensor)
    origin = typing.get_origin(ann)
    if origin is typing.Union or isinstance(ann, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return len(args) == 1 and _is_tensor_annotation(args[0])
    return False


def resolve_dynamic_arg_dims(forward: Callable[..., Any],
                             given: Mapping[str, int | Sequence[int]] | None
                             ) -> dict[str, tuple[int, ...]]:
    """``{arg name: dims}`` to mark dynamic. Default: dim 0 of every argument annotated
    ``Tensor`` or ``Optional[Tensor]``."""
    sig = inspect.signature(forward)
    params = [n for n, p in sig.parameters.items()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if given is None:
        try:
            hints = typing.get_type_hints(forward)
        except Exception:  # unresolvable string annotations: fall back to the raw text
            hints = {}
        dims: dict[str, tuple[int, ...]] = {n: (0,) for n in params
                if _is_tensor_annotation(hints.get(n, sig.parameters[n].annotation))}
        if not dims:
            raise ConfigError(
                f"dynamic_arg_dims: {getattr(forward, '__qualname__', forward)} has no argument "
                f"annotated Tensor or Optional[Tensor] (arguments: {params}), so no batch "
                "dimension can be inferred; annotate the tensor arguments or pass "
                "dynamic_arg_dims={'x': 0}")
        return dims
    if not isinstance(given, Mapping) or not given:
        raise ConfigError(f"dynamic_arg_dims: expected a non-empty mapping of argument name to "
                          f"dim(s), got {given!r}; e.g. dynamic_arg_dims={{'x': 0}}")
    out: dict[str, tuple[int, ...]] = {}
    for name, dims_ in given.items():
        if name not in params:
            raise ConfigError(f"dynamic_arg_dims: {name!r} is not an argument of forward "
                              f"(arguments: {params}); use one of those names")
        seq = (dims_,) if isinstance(dims_, int) else tuple(dims_)
        if not seq or not all(isinstance(d, int) and not isinstance(d, bool) for d in seq):
            raise ConfigError(f"dynamic_arg_dims[{name!r}]: expected an int or a list of ints, "
                              f"got {dims_!r}")
        out[name] = seq
    return out


@contextlib.contextmanager
def _dynamo_limits() -> Iterator[None]:
    cfg = torch._dynamo.config
    if hasattr(cfg, "recompile_limit"):
        patch = {"recompile_limit": _RECOMPILE_LIMIT,
                 "accumulated_recompile_limit": _RECOMPILE_LIMIT}
    else:  # older spelling
        patch = {"cache_size_limit": _RECOMPILE_LIMIT,
                 "accumulated_cache_size_limit": _RECOMPILE_LIMIT}
    with cfg.patch(patch):
        yield


@contextlib.contextmanager
def _size_oblivious(enabled: bool) -> Iterator[None]:
    """Scoped: trace backed sizes size-obliviously, so a size-1 dynamic dim stays symbolic."""
    if not enabled:
        yield
        return
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        yield


class TraceOnce:
    """Owns the one Dynamo trace of ``module.forward`` and the fast call path after it."""

    def __init__(self, module: nn.Module, backend: Callable[..., Any],
                 dynamic_arg_dims: Mapping[str, Sequence[int]]) -> None:
        self._module = module
        self._backend = backend
        self._dims = dict(dynamic_arg_dims)
        self._forward_func = getattr(module.forward, "__func__", None)
        self._compiled: Callable[..., Any] | None = None
        self._fast: Callable[..., Any] | None = None
        self._lock = threading.Lock()  # one trace even if two threads make the first call
        self.traced = False

    @property
    def uses_bytecode(self) -> bool:
        """True once later calls run the captured bytecode directly (no Dynamo at all)."""
        return self._fast is not None

    def _mark_dynamic(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Mark the dynamic dims; True when one has size 1 and the trace must be size-oblivious."""
        size_oblivious = False
        try:
            bound = inspect.signature(self._module.forward).bind(*args, **kwargs)
        except TypeError as exc:
            raise CompileError(f"cannot bind the first call's arguments to forward: {exc}") \
                from None
        for name, dims in self._dims.items():
            value = bound.arguments.get(name)
            if not isinstance(value, torch.Tensor):
                continue  # an Optional[Tensor] left None: nothing to mark
            for d in dims:
                if not -value.dim() <= d < value.dim():
                    raise ConfigError(
                        f"dynamic_arg_dims[{name!r}]: dim {d} does not exist on a tensor of "
                        f"shape {tuple(value.shape)}; give a dim in [-{value.dim()}, "
                        f"{value.dim() - 1}]")
                if value.shape[d] == 0:
                    raise CompileError(
                        f"the first call traces the model, but argument {name!r} is empty along "
                        f"its dynamic dim {d}; an empty batch cannot be traced. Make the first "
                        "call with a batch of at least 1 (a warm-up at the largest size is "
                        "typical)")
                if value.shape[d] == 1:
                    # Dynamo turns size 1 into a constant even when marked dynamic, and with
                    # guards dropped that size-1 trace would silently serve every size; tracing
                    # size-obliviously keeps the dim symbolic.
                    size_oblivious = True
                torch._dynamo.mark_dynamic(value, d % value.dim())
        return size_oblivious

    def first_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Trace (through ``backend``), run once, and capture the bytecode for later calls."""
        from torch._dynamo import convert_frame

        size_oblivious = self._mark_dynamic(args, kwargs)
        code = getattr(self._forward_func, "__code__", None)
        captured: list[types.CodeType] = []

        def hook(old: types.CodeType, new: types.CodeType) -> types.CodeType | None:
            if old is code and not captured:
                captured.append(new)
            return None  # keep Dynamo's code as it is

        self._compiled = torch.compile(self._module.forward, fullgraph=True, dynamic=False,
                                       backend=self._backend,
                                       options={"guard_filter_fn": _drop_all_guards})
        handle = convert_frame.register_bytecode_hook(hook)  # type: ignore[arg-type]
        try:
            with _dynamo_limits(), _size_oblivious(size_oblivious):
                out = self._compiled(*args, **kwargs)
        except BaseException:
            self._compiled = None  # a failed first call leaves nothing half-built behind
            raise
        finally:
            handle.remove()
        self.traced = True
        func = self._forward_func
        if (captured and func is not None and code is not None
                and captured[0].co_freevars == code.co_freevars):
            self._fast = types.FunctionType(captured[0], func.__globals__, func.__name__,
                                            func.__defaults__, func.__closure__)
            self._fast.__kwdefaults__ = func.__kwdefaults__
        else:
            logger.info("could not capture Dynamo's bytecode for %s; later calls go through "
                        "torch.compile with recompiles forbidden", type(self._module).__name__)
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fast is not None:
            return self._fast(self._module, *args, **kwargs)
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    return self.first_call(args, kwargs)
            return self(*args, **kwargs)  # another thread traced meanwhile
        with torch.compiler.set_stance("fail_on_recompile"):
            return self._compiled(*args, **kwargs)
