"""Attribute stores: what a forward binds on its module's submodules (``self.last = out``), seen
around one call and repeated later.

A FULL graph of a traced forward holds Dynamo's whole code, the stores it replays after the graph
call included, but a replay runs kernels only: the Python store does not happen again. The
capturing call's stores are therefore noted (:meth:`AttributeStores.around`) and every replay of
that graph repeats them (:meth:`AttributeStores.repeat`): the same objects bound under the same
names, which is what eager's store does too (the stored output is the graph's output tensor,
which each replay overwrites).

:func:`public_attributes` is the one rule for which attributes count: every entry of a module's
``__dict__`` but ``nn.Module``'s own bookkeeping (names starting with ``_``, ``training``). A
capture transaction uses it too, to put back what its dummy steps stored.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["AttributeStores", "public_attributes"]

_DELETED = object()
_ABSENT = object()


def public_attributes(attrs: dict[str, Any]) -> dict[str, Any]:
    """The entries of a module's ``__dict__`` its ``forward`` may store (not ``nn.Module``'s own
    bookkeeping), as a new dict."""
    return {k: v for k, v in attrs.items() if k[0] != "_" and k != "training"}


class AttributeStores:
    """The bindings one call made on a module's submodules: (the submodule's ``__dict__``, name,
    the object bound, or a deletion)."""

    __slots__ = ("stores",)

    def __init__(self, stores: tuple[tuple[dict[str, Any], str, Any], ...]) -> None:
        self.stores = stores

    @staticmethod
    def snapshot(module: nn.Module) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Every submodule's ``__dict__`` with its public attributes now (see
        :meth:`since`)."""
        return [(vars(sub), public_attributes(vars(sub))) for sub in module.modules()]

    @classmethod
    def since(cls, before: list[tuple[dict[str, Any], dict[str, Any]]]
              ) -> AttributeStores | None:
        """The stores made since :meth:`snapshot` returned ``before``; None when there were
        none."""
        made: list[tuple[dict[str, Any], str, Any]] = []
        for attrs, then in before:
            now = public_attributes(attrs)
            made += [(attrs, name, value) for name, value in now.items()
                     if then.get(name, _ABSENT) is not value]
            made += [(attrs, name, _DELETED) for name in then if name not in now]
        return cls(tuple(made)) if made else None

    def repeat(self) -> None:
        """Make the same stores again."""
        for attrs, name, value in self.stores:
            if value is _DELETED:
                attrs.pop(name, None)
            else:
                attrs[name] = value

    def names(self) -> list[str]:
        return sorted({name for _, name, _ in self.stores})
