"""Values ``forward`` reads from outside its modules' instances, and the check that they hold.

A trace specialises on more than the module's own attributes: a class attribute read through a
module (``self.OFFSET`` with ``OFFSET`` on the class, ``type(self).OFFSET``) and a module-level
global (``SCALE``, ``consts.EPS``, a tensor ``TABLE``, a function ``helper`` it inlined) become
constants or inputs of its graph. Dynamo guards each; freezeframe drops the guards and checks
these values itself, from the sources the guards named (a saved trace's checks on a warm
start), as part of the module-state check (:mod:`~freezeframe.compilation.module_state`)::

    every call   each value is still the very object the trace saw (a class attribute read;
                 for a global, the subscripts and attribute reads of its source); a global
                 tensor also still at the same memory; a global sequence or dict the trace
                 took the length of, that length
    on a hit     compared by the rule of :mod:`~freezeframe.compilation.values` (an equal new
                 object is taken); a global tensor by dtype, device and shape (another tensor
                 of the same kind is read anew by the trace, but a captured graph reads the
                 old memory: :meth:`OutsideReads.moved` names it, and graphs are dropped)

A value whose source ends deeper (``consts`` when ``consts.EPS`` is read) is checked through
the deeper one only: the trace used that value, not the object on the way to it. torch's
global hook dicts, which the module-state check counts already, are left out. Not checked: a
key or an attribute whose absence the trace tested (a ``hasattr`` that was False).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import keyword
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from freezeframe.compilation.values import describe, plain_token, token

__all__ = ["OutsideReads", "class_reads"]

# Dynamo guard kinds of a value the trace used as it is (compared by the values rule on a hit)
_VALUE_KINDS = frozenset({
    "CONSTANT_MATCH", "EQUALS_MATCH", "BOOL_MATCH", "NONE_MATCH", "ID_MATCH", "CLASS_MATCH",
    "MODULE_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH",
    "CONSTANT_SUBCLASS_MATCH", "NOT_NONE_MATCH", "value"})
_TYPE_KINDS = frozenset({"TYPE_MATCH", "type"})
_LENGTH_KINDS = frozenset({"SEQUENCE_LENGTH", "EMPTY_NN_MODULE_HOOKS_DICT", "DICT_KEYS_MATCH",
                           "MAPPING_KEYS_CHECK", "len", "keys"})
_TENSOR_KINDS = frozenset({"TENSOR_MATCH", "tensor"})
_MISSING = object()

# A class attribute in a guard's source: ``type(<module>).NAME`` or
# ``dict(type(<module>)[.__mro__[k]].__dict__)['NAME']`` (how Dynamo names ``self.OFFSET`` read
# from the class, ``type(self).OFFSET``, ``self.__class__.TUP``...)
_CLASS_READ = re.compile(r"type\(((?:[^()]|\([^()]*\))*)\)(?:\.__mro__\[\d+\])?"
                         r"(?:\.__dict__\)\[['\"](\w+)['\"]\]|\.(\w+))")


def class_reads(sources: Iterable[str], module: nn.Module) -> tuple[tuple[type, str], ...]:
    """The class attributes forward read through a module of the tree, from the sources of the
    values its trace specialised on (Dynamo's guards, or a saved trace's checks): each as (the
    module's class, the attribute name), looked up as ``module.NAME`` is (through the MRO, so
    the name set on a subclass counts too). Sources naming no module of ``module``'s tree
    (globals, arguments) are left out."""
    found: dict[tuple[type, str], None] = {}
    namespace = {"__builtins__": {}, "self": module, "L": {"self": module}}
    owned = {id(m) for m in module.modules()}
    for source in sources:
        for match in _CLASS_READ.finditer(source):
            name = match.group(2) or match.group(3)
            if name.startswith("__") or not name.isidentifier() or keyword.iskeyword(name):
                continue
            try:
                holder = eval(compile(match.group(1), "<class read>", "eval"), namespace)
            except Exception:
                continue  # a global, an argument: not the module's state
            if id(holder) in owned:
                found[(type(holder), name)] = None
    return tuple(found)


def _plain_global(source: str) -> bool:
    """Whether ``source`` is a global read as subscripts by constants and attribute reads
    only (``G['consts'].EPS``, ``G['TABLE'][2]``): safe to put in generated code as it is."""
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id != "G":
                return False
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (str, int)) or isinstance(node.value, bool):
                return False
        elif not isinstance(node, (ast.Expression, ast.Subscript, ast.Attribute, ast.Load)):
            return False
    return source.startswith("G[")


def _shown(source: str, where: str) -> str:
    """``G['consts'].EPS`` as a reader knows it: ``consts.EPS`` (a global of ``where``); a
    module Dynamo installed (``G['__import_a_dot_b']``) by its name."""
    text = re.sub(r"G\[['\"]__import_(\w+?)['\"]\]",
                  lambda m: m.group(1).replace("_dot_", "."), source)
    text = re.sub(r"^G\[['\"](\w+)['\"]\]", r"\1", text)
    return f"the global {text} (of module {where})"


def _tensor_meta(value: Any) -> tuple[Any, ...] | None:
    if not isinstance(value, torch.Tensor):
        return None
    return (value.dtype, value.device, tuple(value.shape))


def _tensor_token(value: torch.Tensor) -> tuple[Any, ...]:
    return ("tensor", value.dtype, value.device, tuple(value.shape))


def _describe(tok: Any) -> str:
    def tensor(t: Any) -> str | None:
        if isinstance(t, tuple) and len(t) == 4 and t[0] == "tensor":
            return f"a {t[1]} tensor of shape {list(t[3])} on {t[2]}"
        return None

    return describe(tok, tensor)


@dataclasses.dataclass(eq=False)
class _GlobalRead:
    """One global value the trace read: its source, how it is compared (``value``, ``type``,
    ``len`` or ``tensor``), and what it was."""

    source: str
    compare: str
    read: Callable[[], Any]
    namespace: dict[str, Any]  # the globals ``G`` stands for
    then: Any = None  # the token (or type, length, tensor kind) at the trace

    @property
    def shown(self) -> str:
        return _shown(self.source, str(self.namespace.get("__name__", "?")))

    def now(self) -> Any:
        value = self.read()
        if self.compare == "tensor":
            return _tensor_meta(value)
        if self.compare == "len":
            return (len(value), [token(k, _tensor_token) for k in value]
                    if isinstance(value, dict) else None)
        if self.compare == "type":
            return type(value)
        return token(value, _tensor_token)


class OutsideReads:
    """What the trace of ``module`` read from outside its instances (see the module docstring):
    ``classes``, the class attributes, and the globals of ``namespace`` (forward's globals)
    named by ``reads``, each a (source, kind) pair: a Dynamo guard's source and kind, or a
    saved check's source and guard kind."""

    def __init__(self, module: nn.Module, reads: Sequence[tuple[str, str]],
                 namespace: dict[str, Any] | None, *,
                 untraced: tuple[tuple[tuple[type, str], ...], tuple[_GlobalRead, ...]]
                 | None = None) -> None:
        if untraced is not None:
            self.classes, self.globals = untraced
        else:
            self.classes = class_reads((source for source, _ in reads), module)
            self.globals = _global_reads(reads, namespace) if namespace is not None else ()
        self._class_then = tuple(_class_token(cls, name) for cls, name in self.classes)
        self._verb = "may read" if untraced is not None else "reads"
        for read in self.globals:
            read.then = read.now()
        self._held: tuple[tuple[_GlobalRead, Any, int], ...] = ()
        self.refresh()

    @classmethod
    def none(cls, module: nn.Module) -> OutsideReads:
        """No reads."""
        return cls(module, (), None)

    @classmethod
    def untraced(cls, module: nn.Module) -> OutsideReads:
        """For a module run without a trace (modes NONE and STOCK_TORCH_COMPILE with graphs),
        which values forward reads is not known: every immutable plain value (a number,
        string, bool, None, enum member, or a tuple of them) held as a class attribute
        of a module class of the tree (its bases too, up to ``nn.Module``; torch's own classes
        left out) or as a global of the files defining them."""
        classes: dict[tuple[type, str], None] = {}
        spaces: dict[int, dict[str, Any]] = {}
        for kind in {type(m): None for m in module.modules()}:
            for base in kind.__mro__:
                if base is object or base.__module__.split(".")[0] == "torch":
                    continue
                for name, value in vars(base).items():
                    if not name.startswith("__") and _plain_data(value):
                        classes[(kind, name)] = None
                space = getattr(sys.modules.get(base.__module__), "__dict__", None)
                if space is not None:
                    spaces[id(space)] = space
        found = [_GlobalRead(f"G[{name!r}]", "value", _item(space, name), space)
                 for space in spaces.values() for name, value in space.items()
                 if not name.startswith("__") and _plain_data(value)]
        return cls(module, (), None, untraced=(tuple(classes), tuple(found)))

    def difference(self) -> str | None:
        """What differs from the trace, in words, or None (a global tensor replaced by one of
        the same kind is no difference: see :meth:`moved`)."""
        for (cls, name), then in zip(self.classes, self._class_then, strict=True):
            now = _class_token(cls, name)
            if now != then:
                return (f"the class attribute {cls.__qualname__}.{name} that forward {self._verb} "
                        f"was {_describe(then)} at the trace and is {_describe(now)} now")
        for read in self.globals:
            shown = read.shown
            try:
                now = read.now()
            except Exception as exc:
                return (f"{shown}, which forward {self._verb}, cannot be read any more "
                        f"({type(exc).__name__}: {exc})")
            if now != read.then:
                return (f"{shown}, which forward {self._verb}, was "
                        f"{self._said(read, read.then)} at the trace and is "
                        f"{self._said(read, now)} now")
        return None

    @staticmethod
    def _said(read: _GlobalRead, value: Any) -> str:
        if read.compare == "tensor":
            if value is None:
                return "no tensor"
            dtype, device, shape = value
            return f"a {dtype} tensor of shape {list(shape)} on {device}"
        if read.compare == "len":
            return f"of length {value[0]}" + (f" with keys {value[1]}" if value[1] else "")
        if read.compare == "type":
            return f"of type {value.__qualname__}"
        return _describe(value)

    def refresh(self) -> None:
        """Take the global tensors again (after a full check found no difference)."""
        held = []
        for read in self.globals:
            if read.compare == "tensor":
                with contextlib.suppress(Exception):
                    value = read.read()
                    held.append((read, value, value.data_ptr()))
        self._held = tuple(held)

    def moved(self) -> list[str]:
        """The global tensors replaced by others (or whose memory moved) since the last
        :meth:`refresh`: the trace reads them anew, a captured graph reads the old memory."""
        out = []
        for read, value, ptr in self._held:
            try:
                now = read.read()
            except Exception:
                continue  # (a difference: the full tier says so)
            if now is not value or now.data_ptr() != ptr:
                out.append(read.shown)
        return out

    def terms(self, names: dict[str, Any]) -> list[str]:
        """The every-call terms (see the module docstring), adding what they read to
        ``names``: each is true when the value may have changed."""
        terms = []
        spaces: dict[int, str] = {}
        for j, (cls, name) in enumerate(self.classes):
            names[f"class_{j}"], names[f"class_held_{j}"] = cls, getattr(cls, name, _MISSING)
            terms.append(f"class_{j}.{name} is not class_held_{j}")
        for j, read in enumerate(self.globals):
            expr = f"outside_read_{j}()"
            names[f"outside_read_{j}"] = read.read
            if _plain_global(read.source):  # inline: no call
                space = spaces.setdefault(id(read.namespace), f"outside_ns_{len(spaces)}")
                names[space] = read.namespace
                expr = space + read.source[1:]
            try:
                value = read.read()
            except Exception:
                terms.append("True")  # (the full tier says what it is)
                continue
            if read.compare == "len":
                names[f"outside_len_{j}"] = len(value)
                terms.append(f"len({expr}) != outside_len_{j}")
            else:
                names[f"outside_held_{j}"] = value
                term = f"{expr} is not outside_held_{j}"
                if read.compare == "tensor" and isinstance(value, torch.Tensor):
                    names[f"outside_ptr_{j}"] = value.data_ptr()
                    term += f" or outside_held_{j}.data_ptr() != outside_ptr_{j}"
                terms.append(term)
        return terms


def _plain_data(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is immutable plain data a forward may branch on or compute with: a
    scalar (see :func:`~freezeframe.compilation.values.plain_token`), or a tuple or frozenset
    of such, a few levels deep. (A list, dict or set is changed in place, which the every-call
    identity test cannot see: one used as a log or a counter would be followed only by the
    full check.)"""
    if plain_token(value) is not None:
        return True
    if depth < 3 and type(value) in (tuple, frozenset):
        return all(_plain_data(v, depth + 1) for v in value)
    return False


def _item(space: dict[str, Any], name: str) -> Callable[[], Any]:
    return lambda: space[name]


def _class_token(cls: type, name: str) -> Any:
    return token(getattr(cls, name, _MISSING), _tensor_token)


def _global_reads(reads: Sequence[tuple[str, str]],
                  namespace: dict[str, Any]) -> tuple[_GlobalRead, ...]:
    """The globals among ``reads``, one per source and way of comparing (see the module
    docstring: only the deepest source of a value, no torch global hook dict)."""
    kinds: dict[str, set[str]] = {}
    for source, kind in reads:
        if source.startswith("G[") and "L[" not in source:
            kinds.setdefault(source, set()).add(kind)
    deeper = {s for s in kinds for t in kinds if t != s and t.startswith((s + ".", s + "["))}
    hook_dicts = {id(d) for d in (_nn_module._global_forward_hooks,
                                  _nn_module._global_forward_pre_hooks,
                                  _nn_module._global_backward_hooks,
                                  _nn_module._global_backward_pre_hooks)}
    scope = {"G": namespace, "__builtins__": __builtins__}
    with_helpers = dict(scope)
    try:  # the helpers Dynamo's own guard code calls (___odict_getitem...)
        from torch._dynamo.guards import _get_closure_vars

        with_helpers.update(_get_closure_vars())
        with_helpers["G"] = namespace
    except Exception:
        pass
    found: list[_GlobalRead] = []
    for source, got in kinds.items():
        try:
            read = eval(f"lambda: {source}", scope if _plain_global(source) else with_helpers)
            if id(read()) in hook_dicts:
                continue
        except Exception:
            continue  # (not readable now: nothing to compare with)
        if got & _TENSOR_KINDS:
            found.append(_GlobalRead(source, "tensor", read, namespace))
        if got & _LENGTH_KINDS:
            found.append(_GlobalRead(source, "len", read, namespace))
        if source in deeper:
            continue
        if got & _VALUE_KINDS:
            found.append(_GlobalRead(source, "value", read, namespace))
        elif got & _TYPE_KINDS and not got & _TENSOR_KINDS:
            found.append(_GlobalRead(source, "type", read, namespace))
    return tuple(found)
