"""Trace a module's forward with Dynamo exactly once and call the result without Dynamo.

``torch.compile`` normally guards every trace and retraces when a guard fails. Serving wants the
opposite: one trace with a symbolic batch dim, reused for every later size. So all guards are
dropped (``guard_filter_fn``), and the bytecode Dynamo generates for ``forward`` is captured
with a bytecode hook that is registered only while the first call runs. Later calls execute
that bytecode as a plain Python function, so neither Dynamo's frame evaluation nor any guard
runs on the hot path. When the bytecode cannot be captured (``forward`` is not a plain Python
function), later calls go through the compiled function, whose one cache entry has no guard
left to fail; the backend refuses a second trace, so a recompile is an error, never silent.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import threading
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from freezeframe.errors import CompileError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.compilation.trace_backend import TraceBackend

__all__ = ["TraceOnce", "dynamo_off_reason", "resolve_dynamic_arg_dims"]

logger = logging.getLogger(__name__)

# Enough cache entries for many CompiledModels of one class: each instance adds one entry
# (its own backend) to the same code object, which Dynamo would otherwise count as recompiles.
_RECOMPILE_LIMIT = 8192



def dynamo_off_reason() -> str | None:
    """Why Dynamo will not trace right now (``TORCH_COMPILE_DISABLE=1``, a disabled Dynamo
    config, the ``force_eager`` stance), or None."""
    if torch._dynamo.config.disable:
        return "Dynamo is disabled (TORCH_COMPILE_DISABLE=1 or torch._dynamo.config.disable)"
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    if getattr(stance, "stance", "default") == "force_eager":
        return "the torch.compiler stance is force_eager"
    return None

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
    """``{arg name: dims}`` to mark dynamic. Default (the README's contract): dim 0 of every
    tensor argument, i.e. of each argument annotated ``Tensor`` or ``Optional[Tensor]`` or not
    annotated at all (what the call passes decides: a non-tensor value has no dims to mark)."""
    sig = inspect.signature(forward)
    params = [n for n, p in sig.parameters.items()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if given is None:
        try:
            hints = typing.get_type_hints(forward)
        except Exception:  # unresolvable string annotations: fall back to the raw text
            hints = {}
        dims: dict[str, tuple[int, ...]] = {n: (0,) for n in params
                if sig.parameters[n].annotation is inspect.Parameter.empty
                or _is_tensor_annotation(hints.get(n, sig.parameters[n].annotation))}
        if not dims:
            name = getattr(forward, '__qualname__', forward)
            if not params:
                raise ConfigError(
                    f"dynamic_arg_dims: {name} takes only *args / **kwargs, so freezeframe "
                    "cannot name the argument whose dim 0 is the batch: give forward named "
                    "parameters (def forward(self, x: torch.Tensor, ...)), or wrap the module "
                    "in one whose forward has them")
            raise ConfigError(
                f"dynamic_arg_dims: every argument of {name} is annotated as something other "
                f"than Tensor or Optional[Tensor] (arguments: {params}), so no batch "
                "dimension can be inferred; annotate the tensor arguments as Tensor or pass "
                f"dynamic_arg_dims={{{params[0]!r}: 0}}")
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


def _specialised(exc: Exception, nested: Sequence[tuple[str, torch.Tensor]] = ()
                 ) -> CompileError:
    """The error for a forward that pins a dynamic size to one value (``if x.shape[0] == 2``,
    or a dynamic dim combined with a tensor nested in a list or dict, whose sizes are fixed).
    ``nested``: the call's tensors inside containers, with their paths."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines()]
    where = ""
    if "User stack:" in lines:
        stack = lines[lines.index("User stack:") + 1:]
        where = " (" + ": ".join(line for line in stack[:2] if line) + ")"
    value = re.search(r"specialized it to be a constant \((-?\d+)\)", text)
    pinned = f" to {value.group(1)}" if value else ""
    size = int(value.group(1)) if value else None
    holders = [f"{path} (shape {tuple(t.shape)})" for path, t in nested if size in t.shape]
    if holders:
        return CompileError(
            f"forward pins a dynamic size{pinned}{where}: that is a size of "
            f"{', '.join(holders)}, a tensor inside a list, tuple or dict argument. Only "
            "top-level tensor arguments have dynamic dims; a nested tensor's sizes are fixed "
            "at the trace, so using it with a dynamic dim fixes that dim too. Pass that tensor "
            "as an argument of forward of its own (its dim 0 is then dynamic like the others), "
            "or keep its sizes the same in every call")
    return CompileError(
        f"forward pins a dynamic size{pinned}{where}. A trace serves every batch size, so "
        "forward may compare a dynamic size with a bound (`x.shape[0] > 4`: each side is "
        "traced separately) but not test it for one value; compute such a value from a tensor "
        "instead, or leave that dim out of dynamic_arg_dims")


def _nested_tensors(arguments: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors inside list, tuple and dict arguments, with a path for messages."""
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, path: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if depth:
                found.append((path, value))
        elif depth < 4 and isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]", depth + 1)
        elif depth < 4 and isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}[{k!r}]", depth + 1)

    for name, value in arguments.items():
        walk(value, name, 0)
    return found


@contextlib.contextmanager
def _size_oblivious() -> Iterator[None]:
    """Scoped: trace backed sizes size-obliviously. Otherwise Dynamo makes a dynamic dim seen
    at size 1 a constant, and for one seen at 2 or more assumes every size is at least 2 (it
    decides `x.shape[0] > 1` with no guard): with guards dropped, either trace would silently
    serve sizes it is not valid for. Traced this way the dim stays symbolic, a branch on it is
    a guard (checked per call by SizeGuards), and one trace serves size 1 too."""
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        yield


class TraceOnce:
    """Owns the one Dynamo trace of ``module.forward`` and the fast call path after it."""

    def __init__(self, module: nn.Module, backend: TraceBackend,
                 dynamic_arg_dims: Mapping[str, Sequence[int]], *,
                 dims_given: bool = True) -> None:
        """``dims_given``: the dims were the user's, not the default dim 0 of every tensor
        argument (which leaves a 0-d tensor static: it has no batch dim)."""
        self._module = module
        self._backend = backend
        self._dims = dict(dynamic_arg_dims)
        self._dims_given = dims_given
        self._forward_func = getattr(module.forward, "__func__", None)
        self._compiled: Callable[..., Any] | None = None
        self._fast: Callable[..., Any] | None = None
        self._lock = threading.Lock()  # one trace even if two threads make the first call
        self.traced = False
        # a trace loaded from the cache: whether its forward repeats Python side effects
        # (constant stores); None when Dynamo traced
        self.loaded_side_effects: bool | None = None
        # Every guard Dynamo built for the trace (and that trace-once then dropped): the values
        # the trace specialised on (``CONSTANT_MATCH`` on ``self.scale``, ``G['consts'].SCALE``,
        # ...), for whoever must re-check them without Dynamo (the saved trace).
        self.guard_entries: list[Any] = []
        # The source expression of every such value (``self.scale``,
        # ``dict(type(self).__dict__)['OFFSET']``, ``G['SCALE']``) with its guard's kind, from
        # the guards or, for a trace loaded from the cache, from its saved checks: the
        # module-state check finds the class attributes, globals and tensor attributes
        # forward read among them.
        self.value_reads: list[tuple[str, str]] = []
        # The trace's conditions on dynamic sizes (Python branches on them): (sympy expression,
        # where in the user's code), and which (argument, dim) each size symbol stands for.
        self.size_conditions: list[tuple[Any, str]] = []
        self.size_symbols: dict[Any, tuple[str, int]] = {}

    @property
    def uses_bytecode(self) -> bool:
        """True once later calls run the captured bytecode directly (no Dynamo at all)."""
        return self._fast is not None

    @property
    def bytecode(self) -> types.CodeType | None:
        """The code Dynamo generated for ``forward`` (what later calls run), once traced."""
        return self._fast.__code__ if self._fast is not None else None

    def _mark_dynamic(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Mark the dynamic dims of the first call's tensors."""
        try:
            bound = inspect.signature(self._module.forward).bind(*args, **kwargs)
        except TypeError as exc:
            raise CompileError(f"cannot bind the first call's arguments to forward: {exc}") \
                from None
        for name, dims in self._dims.items():
            value = bound.arguments.get(name)
            if not isinstance(value, torch.Tensor):
                continue  # an Optional[Tensor] left None: nothing to mark
            if value.dim() == 0 and not self._dims_given:
                continue  # a 0-d tensor (a scalar) has no batch dim: it stays static
            if value.dim() == 0:
                raise ConfigError(
                    f"dynamic_arg_dims[{name!r}]: argument {name!r} is a 0-d tensor (a "
                    "scalar), which has no dim to make dynamic; leave it out of "
                    "dynamic_arg_dims")
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
                torch._dynamo.mark_dynamic(value, d % value.dim())

    def _private_forward(self) -> tuple[Callable[..., Any], types.CodeType | None]:
        """``module.forward`` bound over a copy of its code object, and that copy.

        Dynamo keeps what it compiles on the code object it ran, which every instance of the
        class shares: each trace would leave an entry there, and after eight of them (eight
        compiled models of one class in a process) a plain ``torch.compile`` of the class
        hits Dynamo's recompile limit. Traced over a private copy of the code, nothing is left
        on the class's own."""
        func = self._forward_func
        if func is None or not isinstance(getattr(func, "__code__", None), types.CodeType):
            return self._module.forward, getattr(func, "__code__", None)
        private = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__,
                                     func.__defaults__, func.__closure__)
        private.__kwdefaults__ = func.__kwdefaults__
        private.__qualname__ = func.__qualname__
        return types.MethodType(private, self._module), private.__code__

    def first_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Trace (through ``backend``), run once, and capture the bytecode for later calls."""
        from torch._dynamo import convert_frame

        self._mark_dynamic(args, kwargs)
        forward, code = self._private_forward()
        captured: list[types.CodeType] = []

        def hook(old: types.CodeType, new: types.CodeType) -> types.CodeType | None:
            if old is code and not captured:
                captured.append(new)
            return None  # keep Dynamo's code as it is

        def drop_and_record(entries: Sequence[Any]) -> list[bool]:
            self.guard_entries = list(entries)
            self.value_reads = [(_guard_source(e), str(e.guard_type)) for e in entries]
            return _drop_all_guards(entries)

        from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

        handle = convert_frame.register_bytecode_hook(hook)  # type: ignore[arg-type]
        self._compiled = torch.compile(forward, fullgraph=True, dynamic=False,
                                       backend=self._backend,
                                       options={"guard_filter_fn": drop_and_record})
        try:
            with _dynamo_limits(), _size_oblivious():
                out = self._compiled(*args, **kwargs)
        except ConstraintViolationError as exc:
            self._compiled = None
            arguments = inspect.signature(self._module.forward).bind(*args, **kwargs).arguments
            raise _specialised(exc, _nested_tensors(arguments)) from None
        except BaseException:
            self._compiled = None  # a failed first call leaves nothing half-built behind
            raise
        finally:
            handle.remove()
        self.traced = True
        self.size_conditions = list(self._backend.sizes.conditions)
        self.size_symbols = dict(self._backend.sizes.symbols)
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

    def adopt_saved(self, conditions: Sequence[tuple[Any, str]],
                    symbols: Mapping[Any, tuple[str, int]], reads: Sequence[tuple[str, str]],
                    *, side_effects: bool) -> None:
        """Take what a trace loaded from the cache recorded (Dynamo did not run, so nothing was
        recorded here) as this trace's: its conditions on sizes, the sources and guard kinds
        of the values it specialised on (its saved checks), and whether its forward repeats
        Python side effects."""
        self.size_conditions = list(conditions)
        self.size_symbols = dict(symbols)
        self.value_reads = list(reads)
        self.loaded_side_effects = side_effects

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fast is not None:
            return self._fast(self._module, *args, **kwargs)
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    return self.first_call(args, kwargs)
            return self(*args, **kwargs)  # another thread traced meanwhile
        # No guard is left to fail, so Dynamo reuses the trace; should it trace anyway, the
        # backend refuses a second trace. (No process-wide compile stance is set here: another
        # thread or model would see it.)
        return self._compiled(*args, **kwargs)


def _guard_source(entry: Any) -> str:
    """The source expression a guard entry checks (as the saved checks name it)."""
    guard = getattr(entry, "orig_guard", None)
    return str(getattr(guard, "name", "") or getattr(entry, "name", "") or "")
