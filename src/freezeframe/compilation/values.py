"""How a Python value is compared with the value a trace saw: one rule for arguments and attributes.

A trace bakes in every non-tensor value ``forward`` reads: an argument ``scale=2.0``, an
attribute ``self.eps``, a config object's field. freezeframe drops Dynamo's guards, so it keeps,
for each such value, a *token*: a hashable stand-in that equals the token of a later value
exactly when the trace would serve that value too. :mod:`signature` builds tokens of call
arguments, :mod:`module_state` of module attributes; both use :func:`token`::

    2.0, np.float32(2.0), Fraction(1, 2)    by type and value (1, 1.0 and True differ; -0.0 and
                                            0.0 differ; every NaN equals every NaN)
    [a, b], (a, b), {k: v}, {a, b}          item by item (a set in its iteration order)
    slice(a, b), range(n), partial(f, a)    by their parts
    obj.method                              by the object (its fields) and the function
    a dataclass, a plain object             by its attributes (``__dict__`` and ``__slots__``,
                                            at most 256)
    a function, a module, a torch operator  by identity (:class:`Same`)
    (``torch.ops.ns.op``), anything else

Containers are compared :data:`MAX_DEPTH` levels deep; deeper values, and objects with more
than 256 attributes, by identity: a change made in place there is not seen. A long list
of only ints or only strings takes one ``tuple()`` copy rather than one token per item.
Tensors are left to the caller (``tensor_token``): an argument's dynamic dims or an attribute's
rank are the caller's rule.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MAX_DEPTH", "Same", "parts", "plain_token", "token"]

MAX_DEPTH = 4
_MAX_FIELDS = 256  # an object with more attributes than this is compared by identity
_PLAIN = (bool, int, float, str, bytes, complex, type(None), torch.dtype, torch.device,
          enum.Enum)
_FAST_LIST = 32  # lists at least this long try the int-only / str-only copy first
# Code objects a trace inlines: the same code with other closure values is other code.
_CODE = (types.FunctionType, types.BuiltinFunctionType, type)


class Same:
    """Equal only to a ``Same`` of the very same object. It holds a reference, so the
    object's id cannot be reused by a new object while a token holds it."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        name = getattr(self.obj, "__qualname__", None)
        if not isinstance(name, str):
            name = type(self.obj).__qualname__
        return f"{name} at {id(self.obj):#x}"


def plain_token(value: Any) -> tuple[Any, Any] | None:
    """``(type, value)`` of a scalar, or None when ``value`` is not one. ``-0.0`` is told
    from ``0.0`` (``1 / k`` differs) and every NaN equals every other (each call with a NaN
    would otherwise be a new structure); numpy and other numeric scalars go by their repr,
    which keeps type, sign and NaN the same way."""
    if isinstance(value, _PLAIN):
        if isinstance(value, float) and (value == 0 or math.isnan(value)):
            return (type(value), repr(value))  # np.float64 is a float too
        if isinstance(value, complex):
            return (type(value), repr(value))
        return (type(value), value)
    if isinstance(value, numbers.Number) or _is_numpy_scalar(value):
        return (type(value), repr(value))
    return None


def _is_numpy_scalar(value: Any) -> bool:
    return type(value).__module__ == "numpy" and getattr(value, "shape", None) == ()


def parts(value: Any) -> tuple[str, tuple[Any, ...], tuple[Any, ...]] | None:
    """``(kind, keys, items)`` of a value compared by its parts (see the module docstring),
    or None when it is compared by identity (also when reading its parts raises: a property
    that fails, an odd ``__iter__``). ``keys`` are hashable: dict keys as tokens, field names
    as strings, ``()`` for sequences."""
    try:
        return _parts(value)
    except Exception:
        return None


def _parts(value: Any) -> tuple[str, tuple[Any, ...], tuple[Any, ...]] | None:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, (), tuple(value))
    if isinstance(value, dict):
        return ("dict", tuple(_key(k) for k in value), tuple(value.values()))
    if isinstance(value, (set, frozenset)):
        # in iteration order, which is what forward sees ({1, 9} and {9, 1} may differ)
        return (type(value).__name__, (), tuple(value))
    if isinstance(value, (slice, range)):
        return (type(value).__name__, ("start", "stop", "step"),
                (value.start, value.stop, value.step))
    if isinstance(value, functools.partial):
        return ("partial", ("func", "args", "keywords"),
                (value.func, value.args, value.keywords))
    if isinstance(value, types.MethodType):
        return ("method", ("__self__", "__func__"), (value.__self__, value.__func__))
    if isinstance(value, types.BuiltinMethodType) and not isinstance(
            getattr(value, "__self__", None), types.ModuleType):
        # list.append bound to a list, Tensor.add bound to a tensor
        return ("method", ("__self__", "__name__"), (value.__self__, value.__name__))
    if isinstance(value, (_CODE, torch.nn.Module, types.ModuleType)) \
            or type(value).__module__ == "torch._ops":
        # an operator (torch.ops.ns.op, its overloads, namespaces) is one object per process
        # whose caches fill as its overloads are first used: by identity
        return None
    fields = _object_fields(value)  # a dataclass too: its fields and what __post_init__ set
    if fields is None:
        return None
    return (type(value).__qualname__, fields, tuple(getattr(value, n) for n in fields))


def _object_fields(value: Any) -> tuple[str, ...] | None:
    names: list[str] = []
    attrs = getattr(value, "__dict__", None)
    if attrs is not None:
        if type(attrs) is not dict:
            return None
        names.extend(attrs)
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                names.append(slot)
    if (attrs is None and not names) or len(names) > _MAX_FIELDS:
        # no state to compare (a lock, a C object) or too much: the object itself counts
        return None
    return tuple(sorted(set(names)))


def _key(k: Any) -> Any:
    """A dict key's token: ``(1, 2)`` built afresh equals the ``(1, 2)`` seen before."""
    return token(k, Same)


def token(value: Any, tensor_token: Callable[[torch.Tensor], Any], depth: int = 0) -> Any:
    """The token of ``value`` (see the module docstring); tensors get ``tensor_token``."""
    if isinstance(value, torch.Tensor):
        return tensor_token(value)
    plain = plain_token(value)
    if plain is not None:
        return plain
    if depth < MAX_DEPTH:
        if type(value) in (list, tuple) and len(value) >= _FAST_LIST:
            kinds = set(map(type, value))
            if kinds == {int} or kinds == {str}:
                return (type(value), kinds.pop(), tuple(value))
        split = parts(value)
        if split is not None:
            _, keys, items = split
            return (type(value), keys, tuple(token(v, tensor_token, depth + 1) for v in items))
    return Same(value)


def describe(tok: Any, tensor: Callable[[Any], str | None] = lambda t: None) -> str:
    """A token in words, for messages (``tensor`` describes the caller's tensor tokens)."""
    words = tensor(tok)
    if words is not None:
        return words
    if isinstance(tok, Same):
        obj = tok.obj
        name = getattr(obj, "__qualname__", None)
        if callable(obj) and isinstance(name, str):
            return f"{name} at {id(obj):#x}"
        return f"an object of type {type(obj).__qualname__} at {id(obj):#x} (compared by " \
               "identity)"
    if isinstance(tok, tuple) and len(tok) == 2 and isinstance(tok[0], type):
        kind, value = tok
        if isinstance(value, str) and kind is not str:
            return value  # a repr
        return repr(value)
    if isinstance(tok, tuple) and len(tok) == 3 and isinstance(tok[0], type):
        kind, keys, items = tok
        if isinstance(keys, type):  # the int-only / str-only copy of a long list
            return f"a {kind.__name__} of {len(items)} {keys.__name__}s"
        if len(items) > 8:
            return f"a {kind.__name__} of {len(items)} items"
        inner = [describe(v, tensor) for v in items]
        if kind is list:
            return "[" + ", ".join(inner) + "]"
        if kind is tuple:
            return "(" + ", ".join(inner) + ")"
        if kind is dict:
            return "{" + ", ".join(f"{describe(k, tensor)}: {v}"
                                   for k, v in zip(keys, inner, strict=True)) + "}"
        if keys:
            fields = ", ".join(f"{k}={v}" for k, v in zip(keys, inner, strict=True))
            return f"{kind.__qualname__}({fields})"
        return f"{kind.__qualname__}({', '.join(inner)})"
    return repr(tok)
