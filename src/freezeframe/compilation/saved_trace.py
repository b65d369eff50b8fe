"""The saved trace: a Dynamo trace written down so that a warm start can skip Dynamo.

Holds what a saved trace is made of and how it is checked: the values the trace specialised on
(:class:`ValueCheck`, built from Dynamo's guards by :func:`value_checks`, re-evaluated by
:func:`failed_check` in the rebuilt traced frame, :class:`_Frame`), the sizes it assumed
(:class:`_SavedSizes`), the stored FX graph (:func:`_load_graph`), whether a call's inputs fit
its placeholders (:func:`_first_mismatch`), and the forward that stands in for Dynamo's bytecode
(:class:`_LoadedTrace`). It does not decide when a trace is saved or loaded
(:mod:`freezeframe.compilation.cached_trace`), nor where it is kept
(:class:`freezeframe.cache.store.CompileCache`, which stores the checks as plain rows).

Besides the key (:mod:`freezeframe.cache.key`), a saved trace is reused only when every *value
the trace specialised on* is unchanged, taken from the guards Dynamo built for the trace:
constants and attributes of any name (``self._k``, ``self.table['a']``, a dtype, a field of
a plain object, an enum member, a function or builtin an attribute holds), globals of any
module the trace read (``consts.SCALE``), dict keys, sequence lengths, types, whether a
submodule has hooks, tensors that are not forward arguments (dtype, device, sizes,
strides), and torch's global state (grad mode, inference mode, default dtype/device, autocast,
deterministic algorithms, torch-function modes). Guards are built only after the pieces are
compiled, so these values select a saved trace *inside* the entry (trace.bin keeps one per
set of values) rather than the entry; pieces are safe regardless, since every artifact is
checked against its piece's :func:`~freezeframe.cache.key.graph_hash` (the generated code
holds the constants).
A trace whose guards hold something another process cannot compare (an object compared by
identity, a guard kind not handled here, a global Dynamo installed) is not saved at all.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import importlib
import inspect
import json
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from freezeframe.cache.key import code_digest
from freezeframe.compilation.signature import Signer, SizeGuards
from freezeframe.errors import CacheError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ValueCheck", "failed_check", "missing_values", "source_name", "value_checks",
           "valued_nodes"]


_IMPORT_ALIAS = "__import_"
# Dynamo names the globals it installs ``<prefix>_<n>`` with a dunder prefix; the numbers differ
# between processes.
_INSTALLED_RE = re.compile(r"^__\w*_\d+$")


class _GlobalScope:
    """``G`` in a guard's or a graph input's source: the traced frame's globals, read live.

    Dynamo adds ``__import_<module>`` aliases to those globals while it traces (the globals of a
    function it inlined from another module) and ``__builtins_dict___<n>`` (the frame's
    builtins); a process that did not run Dynamo lacks them, so they are resolved to what they
    name, in every process alike. Any other global Dynamo installed (``<prefix>_<n>``) is
    refused, at save and at load alike, so a trace that needs one is never saved.
    """

    __slots__ = ("_globals",)

    def __init__(self, globals_: Mapping[str, Any]) -> None:
        self._globals = globals_

    def __getitem__(self, name: str) -> Any:
        if name.startswith(_IMPORT_ALIAS):
            module = name[len(_IMPORT_ALIAS):].replace("_dot_", ".")
            return sys.modules.get(module) or importlib.import_module(module)
        if _INSTALLED_RE.match(name):
            if name.startswith("__builtins_dict__"):  # the frame's builtins, as a dict
                found = self._globals.get("__builtins__", builtins)
                return found if isinstance(found, dict) else vars(found)
            raise KeyError(f"{name} is a global Dynamo installed while tracing (a process "
                           "that did not trace lacks it)")
        return self._globals[name]


def _wrapped_frame_code() -> types.CodeType | None:
    """The code of the frame ``torch.compile`` puts around a callable it cannot trace as it is
    (a bound method whose function has no source file); None on a torch without it."""
    try:
        from torch._dynamo.external_utils import wrap_inline
    except ImportError:  # pragma: no cover - depends on the torch build
        return None
    return wrap_inline(len).__code__  # type: ignore[no-any-return]


class _Frame:
    """The frame Dynamo traced, rebuilt without Dynamo, so the sources its guards and graph
    inputs name (``L['x']``, ``L['self'].scale``, ``G['consts'].SCALE``) can be evaluated.

    ``kind`` is ``"forward"`` (the module's forward itself: ``L`` holds its arguments at entry,
    defaults applied) or ``"wrapped"`` (``torch.compile``'s wrapper around a forward without a
    source file: ``L`` holds ``args``, ``kwargs`` and ``fn``, the bound forward). Functions made
    by :meth:`function` take the module followed by the call's arguments.
    """

    def __init__(self, module: Any, kind: str) -> None:
        func: Any = module.forward.__func__
        self.kind = kind
        self.module = module
        if kind == "forward":
            params = _parameter_list(func.__code__)
            names = [p.lstrip("*") for p in params if p not in ("/", "*")]
            self._head = ", ".join(params)
            self._locals = "{" + ", ".join(f"{n!r}: {n}" for n in names) + "}"
            self.argument_roots = frozenset(names[1:])
            self.parameters = frozenset(names)
            self._defaults = (func.__defaults__, func.__kwdefaults__)
            globals_ = func.__globals__
        elif kind == "wrapped":
            self._head = "_ff_self, *args, **kwargs"
            self._locals = "{'args': args, 'kwargs': kwargs, 'fn': _ff_fn}"
            self.argument_roots = frozenset({"args", "kwargs"})
            self.parameters = frozenset()
            self._defaults = (None, None)
            code = _wrapped_frame_code()
            if code is None:  # pragma: no cover - depends on the torch build
                raise CacheError("this torch has no wrapper frame to rebuild")
            from torch._dynamo import external_utils

            globals_ = vars(external_utils)
        else:
            raise CacheError(f"unknown traced frame kind {kind!r}")
        self.globals = _GlobalScope(globals_)

    def function(self, body: str, lines: Sequence[str] = (), *, frame_locals: bool = True,
                 **names: Any) -> Callable[..., Any]:
        """``def f(<frame parameters>): L = <frame locals>; <lines>; return <body>``,
        compiled (without ``L`` when ``frame_locals`` is False: the code reads the parameters
        by name); ``lines`` and ``body`` may also read ``names`` (each starting with
        ``_ff_``)."""
        assert all(name.startswith("_ff_") for name in names), names
        statements = "".join(f"    {line}\n" for line in lines)
        head = f"    L = {self._locals}\n" if frame_locals else ""
        text = f"def _f({self._head}):\n{head}{statements}    return {body}\n"
        namespace: dict[str, Any] = {"G": self.globals, "_ff_fn": self.module.forward,
                                     "__builtins__": {}, **names}
        exec(compile(text, "<freezeframe saved trace>", "exec"), namespace)
        fn = namespace["_f"]
        fn.__defaults__, fn.__kwdefaults__ = self._defaults
        return fn  # type: ignore[no-any-return]

    def locals_at_entry(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return self.function("L")(self.module, *args, **kwargs)  # type: ignore[no-any-return]


def _parameter_list(code: types.CodeType) -> list[str]:
    """A code object's parameters as a ``def`` writes them (``/``, ``*``, ``*args``, ...)."""
    nargs = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:nargs])
    params = names[: code.co_argcount]
    if code.co_posonlyargcount:
        params.insert(code.co_posonlyargcount, "/")
    if code.co_flags & inspect.CO_VARARGS:
        params.append("*" + code.co_varnames[nargs])
    elif code.co_kwonlyargcount:
        params.append("*")
    params.extend(names[code.co_argcount:])
    if code.co_flags & inspect.CO_VARKEYWORDS:
        params.append("**" + code.co_varnames[nargs + (1 if code.co_flags &
                                                        inspect.CO_VARARGS else 0)])
    return params


class _CannotCheck(Exception):
    """A guard whose condition cannot be re-checked in another process."""


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', None)}"


def _encode(value: Any) -> Any:
    """A value as plain data that compares equal in another process exactly when the value is
    the same: primitives with their type, containers element-wise, dtypes and devices by name,
    enum members, classes, modules and builtins by their qualified name, functions by name and
    code digest. Anything else (an arbitrary object compared by identity) raises
    :class:`_CannotCheck`."""
    import torch

    kind = type(value)
    if value is None:
        return ["none"]
    if kind in (bool, int, str):
        return [kind.__name__, value]
    if kind in (float, complex):
        return [kind.__name__, repr(value)]  # keeps nan, inf and -0.0 apart
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is types.CodeType:
        return ["code", code_digest(value)]
    if kind in (tuple, list, torch.Size):
        return [kind.__name__, [_encode(v) for v in value]]
    if kind in (set, frozenset):
        return [kind.__name__, sorted(json.dumps(_encode(v)) for v in value)]
    if isinstance(value, torch.dtype | torch.device):
        return [kind.__name__, str(value)]
    if isinstance(value, enum.Enum):
        return ["enum", _qualified(kind), value.name]
    if isinstance(value, type):
        return ["class", _qualified(value)]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if isinstance(value, types.FunctionType):
        return ["function", _qualified(value), code_digest(value.__code__)]
    if isinstance(value, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
        return ["op", str(value)]
    if isinstance(value, types.BuiltinFunctionType | types.MethodDescriptorType
                  | types.WrapperDescriptorType | types.ClassMethodDescriptorType):
        owner = getattr(value, "__self__", None)
        if owner is None or isinstance(owner, type | types.ModuleType):
            return ["builtin", _qualified(owner) if isinstance(owner, type) else
                    getattr(owner, "__name__", None), _qualified(value)]
    raise _CannotCheck(f"a {_qualified(kind)} compared by identity")


@dataclasses.dataclass(frozen=True)
class ValueCheck:
    """One thing a trace specialised on, re-checked before its saved trace is reused.

    ``source`` is the guard's source expression (``L['self']._k``, ``G['consts'].SCALE``,
    ``L['n']``), evaluated in the rebuilt traced frame (:class:`_Frame`); ``kind`` says what is
    compared with ``expected`` (plain data, :func:`_encode`): ``value`` (the encoded value),
    ``type`` (its class), ``len``, ``keys`` (a dict's keys in order), ``contains`` (whether
    ``arg`` is a key), ``hasattr`` (whether attribute ``arg`` exists), ``in_dict`` (whether
    ``arg`` is in the object's instance dict), ``same`` (whether it is the object ``arg``
    names), ``not_none``, ``tensor`` (dtype, device, sizes, strides of a tensor that is not a
    forward argument) and ``state`` (a global torch setting named by ``source``). ``guard`` is
    Dynamo's guard kind it came from, for logs.
    """

    kind: str
    source: str
    expected: Any
    arg: Any = None
    guard: str = ""

    def as_tuple(self) -> tuple[Any, ...]:
        return (self.kind, self.source, self.expected, self.arg, self.guard)


# Dynamo guard kinds, by what the saved trace does with them.
_VALUE_GUARDS = frozenset({
    "CONSTANT_MATCH", "EQUALS_MATCH", "BOOL_MATCH", "NONE_MATCH", "ID_MATCH", "CLASS_MATCH",
    "MODULE_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH", "CONSTANT_SUBCLASS_MATCH",
})
# Global torch state with no source: each is replaced by the settings _STATE records.
_STATE_GUARDS = frozenset({
    "GRAD_MODE", "GLOBAL_STATE", "DETERMINISTIC_ALGORITHMS", "TORCH_FUNCTION_STATE",
    "DEFAULT_DEVICE", "AUTOGRAD_SAVED_TENSORS_HOOKS",
})
# Symbolic-size guards: trace-once drops them on purpose (one trace serves every batch size);
# the fit check (:func:`_first_mismatch`) re-checks dtype, rank and every static size.
_SIZE_GUARDS = frozenset({"SHAPE_ENV"})


def _torch_state() -> dict[str, Callable[[], Any]]:
    import torch

    return {
        "grad_enabled": torch.is_grad_enabled,
        "inference_mode": torch.is_inference_mode_enabled,
        "default_dtype": lambda: str(torch.get_default_dtype()),
        "default_device": lambda: str(torch.get_default_device()),
        "deterministic": torch.are_deterministic_algorithms_enabled,
        "autocast_cpu": lambda: torch.is_autocast_enabled("cpu"),
        "autocast_cuda": lambda: torch.is_autocast_enabled("cuda"),
        "torch_function": torch._C._is_torch_function_enabled,
        "function_modes": lambda: len(torch.overrides._get_current_function_mode_stack()),
        "saved_tensor_hooks": lambda: torch._C._autograd._top_saved_tensors_default_hooks(
            False) is not None,
    }


def _guard_keyword(entry: Any, name: str) -> Any:
    create = getattr(getattr(entry, "orig_guard", None), "create_fn", None)
    keywords = getattr(create, "keywords", None) or {}
    if name not in keywords:
        raise _CannotCheck(f"{entry.guard_type} guard on {entry.name} without its {name!r}")
    return keywords[name]


def _hasattr_name(entry: Any, source: str) -> str:
    """The attribute a HASATTR guard tests: its ``attr`` keyword, or, where Dynamo names it
    only in the guarded source (torch 2.11's guard on iterating a ModuleList reads
    ``...['ups'].__iter__``), the source's last attribute."""
    try:
        return str(_guard_keyword(entry, "attr"))
    except _CannotCheck:
        match = re.search(r"\.([A-Za-z_][A-Za-z0-9_]*)$", source)
        if match is None:
            raise
        return match.group(1)


def _source_text(source: Any) -> str:
    name = source.name  # a property in torch 2.13, a method in older builds
    return str(name() if callable(name) else name)


def value_checks(entries: Sequence[Any], frame: _Frame) -> list[ValueCheck]:
    """The checks a saved trace needs, from the guards Dynamo built for the trace.

    Raises :class:`_CannotCheck` for a guard that cannot be re-checked in another process (an
    object compared by identity, a guard kind not handled here): such a trace is not saved.
    """
    import torch

    checks: dict[tuple[Any, ...], ValueCheck] = {}

    def add(check: ValueCheck) -> None:
        checks.setdefault((check.kind, check.source, repr(check.arg)), check)

    for entry in entries:
        kind = entry.guard_type
        guard = getattr(entry, "orig_guard", None)
        source = str(getattr(guard, "name", "") or entry.name)
        if kind in _STATE_GUARDS or kind in _SIZE_GUARDS:
            continue
        if kind == "TENSOR_MATCH":
            root = re.match(r"^L\[['\"]([^'\"]+)['\"]\]", source)
            if root is not None and root.group(1) in frame.argument_roots:
                continue  # a forward argument: the fit check compares it with the placeholders
            value = entry.value
            if not isinstance(value, torch.Tensor):
                raise _CannotCheck(f"TENSOR_MATCH guard on {source} holds no tensor")
            add(ValueCheck("tensor", source, _tensor_meta(value), guard=kind))
            continue
        if kind in _VALUE_GUARDS:
            add(ValueCheck("value", source, _encode(_entry_value(entry)), guard=kind))
        elif kind == "TYPE_MATCH":
            value = _entry_value(entry)
            if type(value) is object and source.startswith("L["):
                # a bare object() held by the model (or passed in) is a sentinel, told apart
                # from others only by identity; a trace that compared it with ``is`` has no
                # guard but this one (Dynamo 2.13 guards such a comparison by type alone), so
                # nothing could re-check it. One reached through a module global (torch's own
                # polyfill sentinels) is the same object for every caller of that code.
                raise _CannotCheck(f"the identity of the bare object() at {source}")
            add(ValueCheck("type", source, _qualified(type(value)), guard=kind))
        elif kind in ("SEQUENCE_LENGTH", "EMPTY_NN_MODULE_HOOKS_DICT"):
            value = _entry_value(entry)
            add(ValueCheck("type", source, _qualified(type(value)), guard=kind))
            add(ValueCheck("len", source, len(value), guard=kind))
        elif kind in ("DICT_KEYS_MATCH", "MAPPING_KEYS_CHECK"):
            add(ValueCheck("keys", source, [_encode(k) for k in _entry_value(entry)],
                           guard=kind))
        elif kind in ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS",
                      "SET_NOT_CONTAINS"):
            key = _guard_keyword(entry, "key")
            _encode(key)  # a key that cannot be written down cannot be checked
            add(ValueCheck("contains", source, "NOT" not in kind, arg=key, guard=kind))
        elif kind == "HASATTR":
            attr = _hasattr_name(entry, source)
            if not source.endswith("." + attr):
                raise _CannotCheck(f"HASATTR guard on {source} for attribute {attr!r}")
            add(ValueCheck("hasattr", source[: -len(attr) - 1], bool(entry.has_value),
                           arg=attr, guard=kind))
        elif kind == "NOT_PRESENT_IN_GENERIC_DICT":
            add(ValueCheck("in_dict", source, False, arg=_guard_keyword(entry, "attr"),
                           guard=kind))
        elif kind == "DUPLICATE_INPUT":
            other = _source_text(_guard_keyword(entry, "source_b"))
            add(ValueCheck("same", source, True, arg=other, guard=kind))
        elif kind == "NOT_NONE_MATCH":
            add(ValueCheck("not_none", source, True, guard=kind))
        else:
            raise _CannotCheck(f"a {kind} guard on {source or 'global state'}")
    for name, read in _torch_state().items():
        try:
            add(ValueCheck("state", name, _encode(read()), guard="torch state"))
        except Exception as exc:
            raise _CannotCheck(f"torch setting {name} cannot be read ({exc})") from None
    return list(checks.values())


def _entry_value(entry: Any) -> Any:
    if not entry.has_value:
        raise _CannotCheck(f"{entry.guard_type} guard on {entry.name} without a value")
    return entry.value


def _tensor_meta(value: torch.Tensor) -> list[Any]:
    return [str(value.dtype), value.device.type, list(value.shape), list(value.stride()),
            bool(value.requires_grad)]


def _guard_namespace(frame: _Frame, locals_: Mapping[str, Any]) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # the helpers Dynamo's own guard code calls
        from torch._dynamo.guards import _get_closure_vars

        namespace.update(_get_closure_vars())
    namespace.update({"L": locals_, "G": frame.globals, "__builtins__": builtins})
    return namespace


def failed_check(checks: Sequence[ValueCheck], frame: _Frame, locals_: Mapping[str, Any],
                 seen: list[Any] | None = None) -> str | None:
    """Why ``checks`` do not hold in ``frame`` (with ``locals_`` as its ``L``), or None when
    each holds. A source that cannot be evaluated fails its check. Values evaluated are
    appended to ``seen`` (their code is compared by :func:`_code_mismatch`)."""
    namespace = _guard_namespace(frame, locals_)
    state = _torch_state()

    def evaluate(source: str) -> Any:
        value = eval(compile(source, "<freezeframe guard>", "eval"), namespace)
        if seen is not None:
            seen.append(value)
        return value

    for check in checks:
        try:
            got = _check_value(check, evaluate, state)
        except _CannotCheck as exc:
            return f"{check.source} ({check.guard}): {exc}"
        except Exception as exc:
            return (f"{check.source} ({check.guard}) cannot be evaluated "
                    f"({type(exc).__name__}: {exc})")
        if got != check.expected:
            return (f"{check.source} ({check.guard}) is {got!r}, the trace has "
                    f"{check.expected!r}")
    return None


def _check_value(check: ValueCheck, evaluate: Callable[[str], Any],
                 state: Mapping[str, Callable[[], Any]]) -> Any:
    """What ``check`` observes now, comparable with ``check.expected``."""
    import torch

    kind = check.kind
    if kind == "state":
        read = state.get(check.source)
        if read is None:
            raise _CannotCheck("unknown torch setting")
        return _encode(read())
    if kind == "hasattr":
        return hasattr(evaluate(check.source), check.arg)
    value = evaluate(check.source)
    if kind == "value":
        return _encode(value)
    if kind == "type":
        return _qualified(type(value))
    if kind == "len":
        return len(value)
    if kind == "keys":
        return [_encode(k) for k in value]
    if kind == "contains":
        return check.arg in value
    if kind == "in_dict":
        return check.arg in getattr(value, "__dict__", {})
    if kind == "same":
        return value is evaluate(check.arg)
    if kind == "not_none":
        return value is not None
    if kind == "tensor":
        if not isinstance(value, torch.Tensor):
            return ["not a tensor", _qualified(type(value))]
        return _tensor_meta(value)
    raise _CannotCheck(f"unknown check kind {kind!r}")


def source_name(node: Any) -> str | None:
    """The name of the Dynamo source a graph placeholder was read from (``L['x']``), if any."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name  # a property in torch 2.13, a method in older builds
    return str(name() if callable(name) else name)


class _OutputRecorder:
    """Wraps the compiled graph Dynamo's bytecode calls, to see the first call's graph outputs
    (so the forward's return value can be expressed in terms of them for the saved trace)."""

    __slots__ = ("fn", "outputs")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.outputs: list[Any] | None = None

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        if self.outputs is None:
            self.outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        return out


class _LoadedTrace:
    """The forward of a warm start that skipped Dynamo: binds the call's arguments to the
    graph inputs exactly as Dynamo's bytecode did (same source expressions, in the rebuilt
    traced frame), calls the compiled graph and rebuilds the return value from the graph
    outputs."""

    def __init__(self, frame: _Frame, sources: Sequence[str], out_spec: str,
                 out_leaves: Sequence[tuple[str, Any]]) -> None:
        import torch.utils._pytree as pytree

        self._module = frame.module
        self._bind = frame.function(f"({', '.join(sources)},)")
        self.fn: Callable[..., Any] | None = None  # the compiled graph, set once checked
        self._spec = pytree.treespec_loads(out_spec)
        self._leaves = list(out_leaves)
        self._unflatten = pytree.tree_unflatten
        self._single = self._spec.is_leaf() and self._leaves[0][0] == "out"

    def bind(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The graph inputs for a call, evaluated as Dynamo's bytecode would."""
        return self._bind(self._module, *args, **kwargs)  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outs = self.fn(*self._bind(self._module, *args, **kwargs))  # type: ignore[misc]
        if self._single:
            return outs[self._leaves[0][1]]
        leaves = [outs[v] if kind == "out" else v for kind, v in self._leaves]
        return self._unflatten(leaves, self._spec)


@dataclasses.dataclass(frozen=True)
class _SavedSizes:
    """What a saved trace assumed about the dynamic sizes: the conditions its Python branches
    put on them (as sympy text), which argument dim each symbol is, and the sizes it was traced
    at. A warm start loads the trace only for a call that meets the conditions (the other side
    of `if x.shape[0] > 4:` traces again), and, with Inductor, a trace made at size 1 only for
    size 1 (Inductor writes size-1 code there)."""

    conditions: tuple[tuple[Any, str], ...]
    symbols: dict[Any, tuple[str, int]]
    traced_at: dict[tuple[str, int], int]
    inductor: bool

    @staticmethod
    def of(trace: Any, signer: Signer | None, inductor: bool, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> _SavedSizes:
        traced_at = signer.dynamic_sizes(args, kwargs) if signer is not None else {}
        return _SavedSizes(tuple(trace.size_conditions), dict(trace.size_symbols), traced_at,
                           inductor)

    def to_data(self) -> dict[str, Any]:
        import sympy

        return {"conditions": [[sympy.srepr(expr), where] for expr, where in self.conditions],
                "symbols": [[sympy.srepr(sym), name, dim]
                            for sym, (name, dim) in self.symbols.items()],
                "traced_at": [[name, dim, n] for (name, dim), n in self.traced_at.items()],
                "inductor": self.inductor}

    @staticmethod
    def from_data(data: Mapping[str, Any]) -> _SavedSizes:
        import sympy

        symbols = {sympy.sympify(text): (str(name), int(dim))
                   for text, name, dim in data["symbols"]}
        by_name = {str(sym): sym for sym in symbols}
        conditions = []
        for text, where in data["conditions"]:
            expr = sympy.sympify(text)
            # the same symbol objects as the mapping, whatever sympify made of them
            expr = expr.xreplace({s: by_name[str(s)] for s in expr.free_symbols
                                  if str(s) in by_name})
            conditions.append((expr, str(where)))
        traced_at = {(str(name), int(dim)): int(n) for name, dim, n in data["traced_at"]}
        return _SavedSizes(tuple(conditions), symbols, traced_at, bool(data["inductor"]))

    def refuses(self, signer: Signer | None, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> str | None:
        """Why this call's sizes are not ones the saved trace serves, or None."""
        if signer is None:
            return None
        sizes = signer.dynamic_sizes(args, kwargs)
        only = ({where: 1 for where, n in self.traced_at.items() if n == 1}
                if self.inductor else {})
        if SizeGuards(self.conditions, self.symbols, only).accepts(sizes):
            return None
        return (f"the call's sizes {dict(sizes)} are not ones the trace serves (its conditions "
                f"on sizes: {[str(c) for c, _ in self.conditions] or 'none'}, traced at "
                f"{dict(self.traced_at)})")


def _load_graph(blob: bytes, valued: Sequence[str] | None) -> tuple[Any, list[Any]]:
    """A saved graph with the fake values it was saved with, and its placeholders' values.

    ``valued`` names the nodes saved with a fake value
    (:meth:`~freezeframe.compilation.cached_trace.ModelCache._keep_graph`: those the split
    reads). A trace saved without that list (an older version kept the placeholders' values
    only) or whose values do not all come back is refused with :class:`CacheError`, and the
    caller traces with Dynamo: re-deriving them by fake propagation outside Dynamo's tracing
    context can pin a symbolic size to the traced one (``F.pad`` reads it as an int).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if valued is None:
        raise CacheError("the saved graph has no list of its stored fake values")
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    gm: Any = GraphPickler.loads(blob, fake_mode)
    gm.recompile()
    missing = missing_values(gm, valued)
    if missing:
        raise CacheError(f"the fake values of {missing[:3]} did not come back")
    example_inputs = [n.meta.get("example_value", n.meta.get("val"))
                      for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, example_inputs


def valued_nodes(gm: Any) -> list[str]:
    """The names of a graph's nodes that hold a fake value (``example_value`` or ``val``)."""
    return [n.name for n in gm.graph.nodes
            if n.meta.get("example_value", n.meta.get("val")) is not None]


def missing_values(gm: Any, valued: Sequence[str]) -> list[str]:
    """The nodes named in ``valued`` that hold no fake value in ``gm``."""
    have = set(valued_nodes(gm))
    return [name for name in valued if name not in have]


def _holds_view(value: Any) -> bool:
    """Whether a node's fake value is, or (a tuple/list) holds, a tensor that is a view."""
    import torch

    if isinstance(value, (tuple, list)):
        return any(_holds_view(v) for v in value)
    return isinstance(value, torch.Tensor) and value._is_view()


def _detached(value: Any) -> Any:
    """A node's fake value with each tensor that is a view replaced by ``detach()`` of it: the
    same sizes, strides, storage offset and storage, without the view's base (which the graph
    pickler cannot write)."""
    import torch

    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, torch.Tensor) and value._is_view():
        return value.detach()
    return value


_KEEP_META = frozenset({"example_value", "val", "stack_trace", "tensor_meta"})


def _unviewed(value: Any) -> Any:
    """A fake tensor that is a view, as a fresh tensor of the same sizes/strides/dtype."""
    import torch

    if not isinstance(value, torch.Tensor) or not value._is_view():
        return value
    mode = getattr(value, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        plain = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                    device=value.device, requires_grad=value.requires_grad)
    return plain


def _first_mismatch(actual: Sequence[Any], expected: Sequence[Any]) -> str | None:
    """Why the real graph inputs of this call do not fit the saved trace's placeholders, or
    None: same count, tensors with the same dtype, device type, rank and every static size
    (symbolic sizes fit anything), plain ints for symbolic ones."""
    import torch

    if len(actual) != len(expected):
        return f"{len(actual)} graph inputs, the trace has {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"input {i} is {type(a).__name__}, the trace has a tensor"
            if a.dtype != e.dtype or a.device.type != e.device.type or a.dim() != e.dim():
                return (f"input {i} is {a.dtype}/{a.device.type}/rank {a.dim()}, the trace has "
                        f"{e.dtype}/{e.device.type}/rank {e.dim()}")
            for d, (sa, se) in enumerate(zip(a.shape, e.shape, strict=True)):
                if isinstance(se, int) and sa != se:
                    return f"input {i} has size {sa} in dim {d}, the trace has {se}"
        elif isinstance(e, torch.SymInt):
            if not isinstance(a, int):
                return f"input {i} is {type(a).__name__}, the trace has a size"
        elif e is not None and not isinstance(a, type(e)):
            return f"input {i} is {type(a).__name__}, the trace has {type(e).__name__}"
    return None
