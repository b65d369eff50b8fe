"""The containers a model's output may come in, walked one way everywhere.

A tensor is a leaf; dicts (``ModelOutput`` too), tuples, namedtuples and lists, dataclasses (a
plain ``@dataclass`` of tensors, which torch's pytree does not know), and any other class
registered with ``torch.utils._pytree`` are containers, each rebuilt around new children of
its own kind. Anything else is a plain value. The graphs (a capture's autograd check, a
replay's output memory), the runner's output cut and ``verify`` all walk an output through
here, so an output container one of them understands, every one does.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["Node", "leaves", "map_tensors", "node", "tensor_leaves"]

# a container's children, each (its key: a mapping key, a field name or a position, its value),
# and the function that rebuilds the container from new values of them
Node = tuple[list[tuple[Any, Any]], Callable[[list[Any]], Any]]


def node(obj: Any) -> Node | None:
    """``obj`` as a container (see the module docstring), or None for a leaf or a plain
    value (a tensor, a number, a string, None, any object of another class)."""
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, Mapping):
        keys = list(obj)
        return ([(k, obj[k]) for k in keys],
                lambda values: type(obj)(dict(zip(keys, values, strict=True))))  # type: ignore[call-arg]
    if isinstance(obj, (tuple, list)):
        rebuild: Callable[[list[Any]], Any] = (
            (lambda values: type(obj)(*values)) if hasattr(obj, "_fields")
            else (lambda values: type(obj)(values)))
        return list(enumerate(obj)), rebuild
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj)]

        def rebuilt(values: list[Any]) -> Any:
            new = copy.copy(obj)
            for name, value in zip(names, values, strict=True):
                object.__setattr__(new, name, value)  # (a frozen dataclass too)
            return new

        return [(n, getattr(obj, n)) for n in names], rebuilt
    entry = pytree.SUPPORTED_NODES.get(type(obj))
    if entry is not None:
        children, context = entry.flatten_fn(obj)
        return (list(enumerate(children)),
                lambda values: entry.unflatten_fn(values, context))
    return None


def tensor_leaves(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``obj``, containers walked in order (a tensor found twice, twice)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    found = node(obj)
    if found is not None:
        for _, value in found[0]:
            yield from tensor_leaves(value)


def leaves(obj: Any, where: str = "output") -> Iterator[tuple[str, Any]]:
    """Every leaf of ``obj`` (tensors and plain values) with where it sits, as an error names
    it: ``output[0]['logits']``, ``output.hidden`` (a dataclass field)."""
    found = node(obj)
    if found is None:
        yield where, obj
        return
    field = dataclasses.is_dataclass(obj)
    for key, value in found[0]:
        yield from leaves(value, f"{where}.{key}" if field else f"{where}[{key!r}]")


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor, every container rebuilt (namedtuples,
    dataclasses and registered pytree nodes too). A tensor object found twice (``(h, [y,
    h])``) is mapped once: both places hold the one result, as they held the one tensor."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    return _mapped(obj, fn, {})


def _mapped(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor],
            done: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
    if isinstance(obj, torch.Tensor):
        known = done.get(id(obj))
        if known is not None:
            return known[1]
        result = fn(obj)
        done[id(obj)] = (obj, result)  # (the tensor kept: its id stays its own meanwhile)
        return result
    found = node(obj)
    if found is None:
        return obj
    children, rebuild = found
    return rebuild([_mapped(v, fn, done) for _, v in children])
