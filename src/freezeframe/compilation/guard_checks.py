"""The values a trace specialised on, taken from Dynamo's guards and re-checked without Dynamo.

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

Holds :class:`ValueCheck` (one such value, as plain data), :func:`value_checks` (Dynamo's
guards turned into checks) and :func:`failed_check` (the checks re-evaluated in the rebuilt
traced frame, :class:`~freezeframe.compilation.saved_trace._Frame`). It does not hold the rest
of a saved trace (:mod:`freezeframe.compilation.saved_trace`), nor decide when the checks are
built or run (:mod:`freezeframe.compilation.cached_trace`).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import json
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from freezeframe.cache.traced_code import code_digest

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from freezeframe.compilation.saved_trace import _Frame

__all__ = ["ValueCheck", "failed_check", "value_checks"]


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
    ``L['n']``), evaluated in the rebuilt traced frame
    (:class:`~freezeframe.compilation.saved_trace._Frame`); ``kind`` says what is compared with
    ``expected`` (plain data, :func:`_encode`): ``value`` (the encoded value), ``type`` (its
    class), ``len``, ``keys`` (a dict's keys in order), ``contains`` (whether ``arg`` is a key),
    ``hasattr`` (whether attribute ``arg`` exists), ``in_dict`` (whether ``arg`` is in the
    object's instance dict), ``same`` (whether it is the object ``arg`` names), ``not_none``,
    ``tensor`` (dtype, device, sizes, strides of a tensor that is not a forward argument) and
    ``state`` (a global torch setting named by ``source``). ``guard`` is Dynamo's guard kind it
    came from, for logs.
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
# Global torch state with no source: each is replaced by the settings _torch_state reads.
_STATE_GUARDS = frozenset({
    "GRAD_MODE", "GLOBAL_STATE", "DETERMINISTIC_ALGORITHMS", "TORCH_FUNCTION_STATE",
    "DEFAULT_DEVICE", "AUTOGRAD_SAVED_TENSORS_HOOKS",
})
# Symbolic-size guards: trace-once drops them on purpose (one trace serves every batch size);
# the fit check (saved_trace._first_mismatch) re-checks dtype, rank and every static size.
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


def _has_keyword(entry: Any, name: str) -> bool:
    try:
        _guard_keyword(entry, name)
    except _CannotCheck:
        return False
    return True


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
    """The checks a saved trace needs, from the guards Dynamo built for the trace, then the
    torch settings it ran under; a check that several guards ask for is kept once.

    Raises :class:`_CannotCheck` for a guard that cannot be re-checked in another process (an
    object compared by identity, a guard kind not handled here): such a trace is not saved.
    """
    checks: dict[tuple[Any, ...], ValueCheck] = {}

    def add(check: ValueCheck) -> None:
        checks.setdefault((check.kind, check.source, repr(check.arg)), check)

    for entry in entries:
        for check in _guard_checks(entry, frame):
            add(check)
    for check in _state_checks():
        add(check)
    return list(checks.values())


def _guard_checks(entry: Any, frame: _Frame) -> list[ValueCheck]:
    """What one guard asks of the values, as checks another process can run: none for a guard
    the saved trace re-checks its own way (torch state, symbolic sizes, a forward argument)."""
    kind = entry.guard_type
    guard = getattr(entry, "orig_guard", None)
    source = str(getattr(guard, "name", "") or entry.name)
    if kind in _STATE_GUARDS or kind in _SIZE_GUARDS:
        return []
    if kind == "TENSOR_MATCH":
        return _tensor_checks(entry, source, frame)
    if kind in _VALUE_GUARDS:
        return [ValueCheck("value", source, _encode(_entry_value(entry)), guard=kind)]
    if kind == "TYPE_MATCH":
        value = _entry_value(entry)
        if type(value) is object and source.startswith("L["):
            # a bare object() held by the model (or passed in) is a sentinel, told apart
            # from others only by identity; a trace that compared it with ``is`` has no
            # guard but this one (Dynamo 2.13 guards such a comparison by type alone), so
            # nothing could re-check it. One reached through a module global (torch's own
            # polyfill sentinels) is the same object for every caller of that code.
            raise _CannotCheck(f"the identity of the bare object() at {source}")
        return [ValueCheck("type", source, _qualified(type(value)), guard=kind)]
    if kind in ("SEQUENCE_LENGTH", "EMPTY_NN_MODULE_HOOKS_DICT"):
        value = _entry_value(entry)
        return [ValueCheck("type", source, _qualified(type(value)), guard=kind),
                ValueCheck("len", source, len(value), guard=kind)]
    if kind in ("DICT_KEYS_MATCH", "MAPPING_KEYS_CHECK"):
        return [ValueCheck("keys", source, [_encode(k) for k in _entry_value(entry)],
                           guard=kind)]
    if kind in ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS", "SET_NOT_CONTAINS"):
        key = _guard_keyword(entry, "key")
        _encode(key)  # a key that cannot be written down cannot be checked
        return [ValueCheck("contains", source, "NOT" not in kind, arg=key, guard=kind)]
    if kind == "HASATTR":
        attr = _hasattr_name(entry, source)
        # the guarded source names the attribute (``obj.attr``) or, with its ``attr`` keyword
        # (torch 2.13, reaching a submodule through ``_modules['model']``), the object
        if source.endswith("." + attr):  # the guard's value is the attribute, if it exists
            owner, present = source[: -len(attr) - 1], bool(entry.has_value)
        elif _has_keyword(entry, "attr"):  # the guard's value is the object
            owner, present = source, hasattr(_entry_value(entry), attr)
        else:
            raise _CannotCheck(f"HASATTR guard on {source} for attribute {attr!r}")
        return [ValueCheck("hasattr", owner, present, arg=attr, guard=kind)]
    if kind == "NOT_PRESENT_IN_GENERIC_DICT":
        return [ValueCheck("in_dict", source, False, arg=_guard_keyword(entry, "attr"),
                           guard=kind)]
    if kind == "DUPLICATE_INPUT":
        other = _source_text(_guard_keyword(entry, "source_b"))
        return [ValueCheck("same", source, True, arg=other, guard=kind)]
    if kind == "NOT_NONE_MATCH":
        return [ValueCheck("not_none", source, True, guard=kind)]
    raise _CannotCheck(f"a {kind} guard on {source or 'global state'}")


def _tensor_checks(entry: Any, source: str, frame: _Frame) -> list[ValueCheck]:
    """A TENSOR_MATCH guard's check: kept only for a tensor that is not a forward argument,
    since the fit check compares each argument with the trace's placeholders."""
    import torch

    root = re.match(r"^L\[['\"]([^'\"]+)['\"]\]", source)
    if root is not None and root.group(1) in frame.argument_roots:
        return []  # a forward argument: the fit check compares it with the placeholders
    value = entry.value
    if not isinstance(value, torch.Tensor):
        raise _CannotCheck(f"TENSOR_MATCH guard on {source} holds no tensor")
    return [ValueCheck("tensor", source, _tensor_meta(value), guard=entry.guard_type)]


def _state_checks() -> list[ValueCheck]:
    """The torch settings the trace ran under, one check each: Dynamo's own guards on them
    (:data:`_STATE_GUARDS`) name no source that could be evaluated again."""
    checks = []
    for name, read in _torch_state().items():
        try:
            checks.append(ValueCheck("state", name, _encode(read()), guard="torch state"))
        except Exception as exc:
            raise _CannotCheck(f"torch setting {name} cannot be read ({exc})") from None
    return checks


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
    appended to ``seen`` (their code is compared by
    :func:`freezeframe.cache.traced_code.code_mismatch`)."""
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
            what = f"{check.guard} {check.arg!r}" if check.arg is not None else check.guard
            return (f"{check.source} ({what}) is {got!r}, the trace has "
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
