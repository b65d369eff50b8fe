"""The traced code a cache entry depends on besides its source files.

A trace read code that has no source file to hash (``python -c``, ``exec``, ``<stdin>``, a
notebook cell, FX's generated code): its digest (bytecode, constants with nested code, names,
flags: :func:`code_digest`) joins the entry's key. On a warm start such code is found again in
the live model (its classes, the forward's globals, the values the trace specialised on) and
compared (:func:`code_mismatch`); code that cannot be found, or that changed, means no reuse.
The rest of the key: :mod:`freezeframe.cache.key`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from freezeframe.cache.key import _sha

__all__ = ["code_digest", "code_digests", "code_mismatch", "traced_code_objects"]

logger = logging.getLogger(__name__)


def _needs_code_digest(filename: str) -> bool:
    """True for code whose file cannot vouch for it: ``<stdin>``, ``<string>`` (``python -c``,
    ``exec``), FX's ``<eval_with_key>``, a notebook cell's file that is not on disk. Frozen
    standard-library modules (``<frozen ...>``) come with the Python build, which is a key
    factor of its own."""
    if filename.startswith("<frozen "):
        return False
    if not filename or filename.startswith("<"):
        return True
    return not (os.path.isfile(filename) and os.access(filename, os.R_OK))


def _const_text(value: Any) -> Any:
    if isinstance(value, types.CodeType):
        return ["code", code_digest(value)]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_const_text(v) for v in value]]
    if isinstance(value, frozenset):  # iteration order follows string hashing: sort
        return ["frozenset", sorted(json.dumps(_const_text(v)) for v in value)]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    return [type(value).__name__, repr(value)]


def code_digest(code: types.CodeType) -> str:
    """A digest of what a code object does, the same in every process for the same source: its
    bytecode, constants (nested functions and classes by their own digest), names, arguments,
    flags and exception table. File name and line numbers are left out, so moving code without
    changing it keeps the digest."""
    parts = [
        getattr(code, "co_qualname", code.co_name), code.co_code.hex(),
        [_const_text(c) for c in code.co_consts], code.co_names, code.co_varnames,
        code.co_freevars, code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
        code.co_kwonlyargcount, code.co_flags,
        getattr(code, "co_exceptiontable", b"").hex(),
    ]
    return _sha(parts)[:32]


def _nested_code(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested_code(const)


def code_digests(codes: Iterable[types.CodeType]) -> dict[str, list[str]]:
    """``{qualified name: sorted digests}`` of the code objects among ``codes`` (and the code
    nested in them) that have no source file to hash (:func:`_needs_code_digest`)."""
    found: dict[str, set[str]] = {}
    for outer in codes:
        if not _needs_code_digest(outer.co_filename):
            continue
        for code in _nested_code(outer):
            name = getattr(code, "co_qualname", code.co_name)
            found.setdefault(name, set()).add(code_digest(code))
    return {name: sorted(d) for name, d in sorted(found.items())}


def traced_code_objects() -> list[types.CodeType]:
    """Every code object the active Dynamo trace traced or inlined, the traced frame first
    (empty outside a backend, or on a torch without ``traced_code``)."""
    try:
        from torch._guards import TracingContext

        ctx = TracingContext.try_get()
        return list(getattr(ctx, "traced_code", None) or ())
    except Exception as exc:  # pragma: no cover - depends on the torch build
        logger.debug("tracing context unavailable: %s", exc)
        return []


def _live_code_digests(roots: Iterable[Any]) -> dict[str, set[str]]:
    """``{qualified name: digests}`` of the code without a source file that ``roots`` reach: a
    root's class and its bases (methods, properties, static and class methods), a function's
    code, nested code, closure cells and, for a function without a source file, the functions
    and classes of its globals (a helper defined beside a ``python -c`` model)."""
    found: dict[str, set[str]] = {}
    seen: set[int] = set()
    unsourced: dict[str, bool] = {}  # file name -> _needs_code_digest, asked once per file
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.MethodType | staticmethod | classmethod):
            stack.append(obj.__func__)
        elif isinstance(obj, property):
            stack.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, types.FunctionType):
            code = obj.__code__
            if code.co_filename not in unsourced:
                unsourced[code.co_filename] = _needs_code_digest(code.co_filename)
            if not unsourced[code.co_filename]:
                continue
            for inner in _nested_code(code):
                name = getattr(inner, "co_qualname", inner.co_name)
                found.setdefault(name, set()).add(code_digest(inner))
            stack.extend(c.cell_contents for c in obj.__closure__ or ()
                         if _has_contents(c))
            if id(obj.__globals__) not in seen:
                seen.add(id(obj.__globals__))
                stack.extend(v for v in list(obj.__globals__.values())
                             if isinstance(v, type | types.FunctionType))
        elif isinstance(obj, type):
            for klass in obj.__mro__:
                if klass.__module__ != "builtins" and klass is not obj:
                    stack.append(klass)
            stack.extend(v for v in list(vars(obj).values())
                         if isinstance(v, type | types.FunctionType | staticmethod
                                       | classmethod | property))
        elif not isinstance(obj, types.ModuleType):
            stack.append(type(obj))
    return found


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def code_mismatch(recorded: Mapping[str, Sequence[str]], roots: Iterable[Any]) -> str | None:
    """Why the live code does not match the digests recorded with a trace, or None. Each
    recorded name must be found, and every live code object of that name must have a recorded
    digest (two definitions of one name that differ cannot be told apart, so they do not match).
    """
    if not recorded:
        return None
    live = _live_code_digests(roots)
    generated: dict[str, set[str]] | None = None
    for name, digests in recorded.items():
        now = live.get(name)
        if not now and name.startswith(_GENERATED_PREFIX):
            # a method dataclasses generated (``__init__`` of an output class the trace built):
            # not reachable from the model, and one name for every dataclass, so it matches
            # when each recorded digest is that of a live dataclass's method
            if generated is None:
                generated = _dataclass_method_digests()
            if set(digests) <= generated.get(name, set()):
                continue
            return f"the code of {name} (a generated dataclass method) changed"
        if not now:
            return f"the code of {name} (no source file) cannot be found to compare"
        if now != set(digests):
            return f"the code of {name} (no source file) changed"
    return None


_GENERATED_PREFIX = "__create_fn__.<locals>."  # dataclasses' generated methods (Python 3.11+)


def _dataclass_method_digests() -> dict[str, set[str]]:
    """``{qualified name: digests}`` of the methods dataclasses generated for every dataclass
    in a loaded module's globals."""
    found: dict[str, set[str]] = {}
    classes: list[type] = []
    with warnings.catch_warnings():  # (a deprecated module attribute warns when looked at)
        warnings.simplefilter("ignore")
        for module in list(sys.modules.values()):
            classes.extend(value for value in list(getattr(module, "__dict__", {}).values())
                           if isinstance(value, type) and "__dataclass_fields__" in vars(value))
    for value in classes:
        for member in list(vars(value).values()):
            # the generated function, or one a library wrapped it in (transformers' output
            # classes keep theirs in the wrapper's closure)
            inner = [c.cell_contents for c in getattr(member, "__closure__", None) or ()
                     if _has_contents(c)]
            for func in (member, getattr(member, "__wrapped__", None), *inner):
                code = getattr(func, "__code__", None)
                if isinstance(code, types.CodeType) \
                        and code.co_qualname.startswith(_GENERATED_PREFIX):
                    found.setdefault(code.co_qualname, set()).add(code_digest(code))
    return found
