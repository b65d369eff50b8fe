"""Constant stores: the one kind of Python side effect a saved trace can repeat by itself.

Dynamo's code for ``forward`` calls the graph and then replays forward's Python side effects.
A saved trace (:mod:`~freezeframe.compilation.cached_trace`) calls the graph alone, so a
forward with side effects is normally not saved: a warm start would skip them. One kind is
common and harmless to repeat without Dynamo: a library setting an attribute of one of its own
module-level objects to a constant. transformers' output capturing does it on every call of a
model (``_active_collector.global_var = None``, ``.compiling = False``: a context variable that
falls back on attributes under Dynamo), which alone kept every Hugging Face trace out of the
cache.

At trace time :func:`stores_of_current_trace` reads Dynamo's record of the side effects. When
every one is such a store (the object reached from an imported module by attribute names, the
value None, a bool, a number or a string) it returns them, and the saved trace repeats them
after each call (:func:`apply`), as Dynamo's code does. Anything else (a store into the module,
a list append, a tensor hook, a non-constant value) gives None: not saved, as before.

Before::

    Dynamo's bytecode: graph(...); object_setattr(transformers...._active_collector,
                                                  "compiling", False); return ...
    saved trace:       graph(...); return ...          (the store skipped: not saved)

After::

    saved trace:       graph(...); ConstantStore(...).apply(); return ...
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any

__all__ = ["ConstantStore", "apply", "imported_module", "resolve", "stores_of_current_trace"]

_IMPORT_PREFIX = "__import_"  # how Dynamo names an imported module among its globals


def imported_module(global_name: str) -> str | None:
    """The module a global Dynamo installed for an import names (``__import_a_dot_b``:
    ``a.b``), or None for any other global."""
    if not global_name.startswith(_IMPORT_PREFIX):
        return None
    return global_name[len(_IMPORT_PREFIX):].replace("_dot_", ".")
_LITERALS = (type(None), bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class ConstantStore:
    """``<module>.<path...>.<attr> = value``, by ``object.__setattr__`` (as Dynamo's code)."""

    module: str
    path: tuple[str, ...]
    attr: str
    value: Any

    def target(self) -> Any:
        obj: Any = importlib.import_module(self.module)
        for name in self.path:
            obj = getattr(obj, name)
        return obj

    def to_data(self) -> list[Any]:
        return [self.module, list(self.path), self.attr, self.value]

    @classmethod
    def from_data(cls, data: Sequence[Any]) -> ConstantStore:
        module, path, attr, value = data
        return cls(str(module), tuple(str(p) for p in path), str(attr), value)


def apply(stores: Sequence[tuple[Any, str, Any]]) -> None:
    """Repeat resolved stores ``(object, attr, value)`` (see :func:`resolve`)."""
    for obj, attr, value in stores:
        object.__setattr__(obj, attr, value)


def resolve(stores: Sequence[ConstantStore]) -> list[tuple[Any, str, Any]]:
    """Each store's target object looked up once (raises what the lookup raises)."""
    return [(store.target(), store.attr, store.value) for store in stores]


def _module_path(source: Any) -> tuple[str, tuple[str, ...]] | None:
    """``(module, attribute names)`` of a Dynamo source that reaches an object from an
    imported module's global (``G['__import_a_dot_b'].x.y``), or None."""
    names: list[str] = []
    while type(source).__name__ == "AttrSource":
        names.append(str(source.member))
        source = source.base
    if type(source).__name__ != "GlobalSource":
        return None
    module = imported_module(str(source.global_name))
    if module is None or not names:
        return None
    return module, tuple(reversed(names))


def stores_of_current_trace() -> tuple[ConstantStore, ...] | None:
    """The side effects of the trace Dynamo is making now, if every one is a constant store
    (an empty tuple when there are none); None when any is something else, or when this
    torch does not show them."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        effects = tx.output.side_effects
        mutations = dict(effects.store_attr_mutations)
        modified = [v for v in effects.id_to_variable.values() if effects.is_modified(v)]
        hooks = effects.tensor_hooks
    except Exception:  # a torch whose side-effect record looks otherwise
        return None
    # (a tensor's in-place changes are in the graph; an attribute set on one is a mutation)
    if hooks or any(v not in mutations and type(v).__name__ != "TensorVariable"
                    for v in modified):
        return None
    stores: list[ConstantStore] = []
    for variable, attrs in mutations.items():
        where = _module_path(getattr(variable, "source", None))
        if where is None:
            return None
        for attr, value in attrs.items():
            if type(value).__name__ != "ConstantVariable":
                return None
            constant = getattr(value, "value", None)
            if type(constant) not in _LITERALS:
                return None
            stores.append(ConstantStore(where[0], where[1], str(attr), constant))
    try:  # each target must be the object mutated, reached by its path (as a warm start will)
        targets = {id(store.target()) for store in stores}
    except Exception:
        return None
    if targets != {id(getattr(v, "value", None)) for v in mutations}:
        return None
    return tuple(stores)
