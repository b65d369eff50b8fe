"""Which attributes of the module's instances a trace read, from the sources of its guards.

Dynamo guards every value it specialises on, by the expression that reaches it from the traced
frame: ``L['self'].eps``, ``L['self']._modules['ln'].eps``, ``L['self'].cfg.eps`` (the
attribute ``cfg`` of the root), ``L['self'].scale`` (a tensor attribute, a graph input). Walking
each such source from the module, through ``_modules`` to submodules, names the attribute of
a module of the tree it reads first: (the module's id, the attribute's name). The module-state
check (:mod:`~freezeframe.compilation.module_state`) compares those attributes with the trace,
and follows the tensors among them as it follows parameters; an attribute no guard reaches
is none of the trace's business.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["attribute_reads", "tensor_attrs"]

_TENSOR_KINDS = frozenset({"TENSOR_MATCH", "tensor"})
# nn.Module's own dicts: a step into a submodule (_modules), or into parameters and buffers
# (compared their own way)
_INTO_CHILD = "_modules"
_SLOTS = frozenset({"_parameters", "_buffers"})


def _steps(node: ast.AST) -> list[tuple[str, Any]] | None:
    """``L['self'].a['k'].b`` as [('attr', 'a'), ('item', 'k'), ('attr', 'b')], or None when
    the source is not such a chain from ``L['self']``."""
    steps: list[tuple[str, Any]] = []
    while True:
        if isinstance(node, ast.Attribute):
            steps.append(("attr", node.attr))
            node = node.value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if isinstance(node.value, ast.Name) and node.value.id == "L":
                if node.slice.value != "self":
                    return None
                return steps[::-1]
            steps.append(("item", node.slice.value))
            node = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("___odict_getitem", "getattr") and len(node.args) == 2
              and isinstance(node.args[1], ast.Constant)):
            # ___odict_getitem(d, k) is d[k]; getattr(o, 'a b') an attribute of any name
            steps.append(("item" if node.func.id != "getattr" else "attr",
                          node.args[1].value))
            node = node.args[0]
        else:
            return None


def _first_read(module: nn.Module, steps: list[tuple[str, Any]],
                owned: set[int]) -> tuple[nn.Module, str] | None:
    """The module of the tree and the attribute of it that ``steps`` (from ``module``) read
    first, or None (a parameter or buffer, or no attribute of a module of the tree)."""
    holder: Any = module
    i = 0
    while i < len(steps) and id(holder) in owned:
        kind, name = steps[i]
        if kind != "attr":
            return None
        if name == _INTO_CHILD and i + 1 < len(steps) and steps[i + 1][0] == "item":
            holder = holder._modules.get(steps[i + 1][1])
            i += 2
            continue
        if name in _SLOTS:
            return None
        if name == "__dict__" and i + 1 < len(steps) and steps[i + 1][0] == "item":
            name = steps[i + 1][1]
        return (holder, str(name)) if isinstance(name, str) else None
    return None


def attribute_reads(reads: Iterable[tuple[str, str]], module: nn.Module
                    ) -> tuple[frozenset[tuple[int, str]], frozenset[tuple[int, str]]]:
    """From a trace's (source, guard kind) pairs: every attribute of a module of ``module``'s
    tree it read, and those among them it read as tensors (graph inputs); each as (the id of
    the module holding it, the attribute's name). Parameters and buffers are not among them."""
    owned = {id(m) for m in module.modules()}
    found: set[tuple[int, str]] = set()
    tensors: set[tuple[int, str]] = set()
    for source, kind in reads:
        if "L['self']" not in source:
            continue
        try:
            steps = _steps(ast.parse(source, mode="eval").body)
        except SyntaxError:
            continue
        read = _first_read(module, steps, owned) if steps else None
        if read is None:
            continue
        holder, name = read
        found.add((id(holder), name))
        if kind in _TENSOR_KINDS and isinstance(vars(holder).get(name), torch.Tensor):
            tensors.add((id(holder), name))
    return frozenset(found), frozenset(tensors)


def tensor_attrs(module: nn.Module) -> dict[tuple[int, str], int]:
    """Every plain tensor attribute (neither parameter nor buffer) of ``module``'s tree: (the id
    of its module, its name) -> the id of the tensor it holds (to tell which ones a call stored
    anew)."""
    return {(id(m), name): id(value) for m in module.modules()
            for name, value in vars(m).items() if isinstance(value, torch.Tensor)}
