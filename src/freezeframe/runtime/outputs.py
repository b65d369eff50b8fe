"""The output cut: which rows of each output leaf a step answers with.

A step of 3 tokens runs at the padded size 4, so an output with one row per token has 4 rows,
the last one padding. The runner's ``outputs=`` says what each leaf's rows are (``"tokens"``,
``"requests"``, ``"none"``; a sequence or mapping for a tuple or dict output), and a leaf is
cut to the real rows where its dim 0 is the padded size::

    leaf of kind "tokens", padded 4, real 3     [4, H] -> rows [0:3]
    leaf of kind "requests", padded 2, real 1   [2, V] -> rows [0:1]
    leaf of kind "none"                         returned whole

What capture adds: every dummy step of capture records each leaf's dim 0 at its padded size
(:meth:`OutputCut.record`). A leaf whose dim 0 stayed the same across the sizes (a table
computed from a weight) is never cut, even at the size it happens to equal; a leaf whose dim 0
is always the same multiple of the tokens (a ``flatten()`` of per-token rows) cannot be cut
by rows at all, which a step that needs padding refuses by name.

Every answer is a new tensor object (a view): an in-place change of one answer's metadata
(``y.t_()``) must not reach the static output the next step answers with.

An output is walked as a tree (:mod:`freezeframe.containers`, the cut too): a tensor is a
leaf; dicts (``ModelOutput`` too), tuples, namedtuples and lists, dataclasses (a plain
``@dataclass`` of tensors, which torch's pytree does not know), and any other class registered
with ``torch.utils._pytree`` are containers, rebuilt around their cut children. Any other object
that holds a tensor cannot be cut: a step answering with one is refused by name (or marked
``"none"``, returned whole).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from freezeframe.containers import map_tensors, tensor_leaves
from freezeframe.containers import node as _node
from freezeframe.errors import ConfigError

__all__ = ["OUTPUT_KINDS", "OutputCut", "check_outputs", "map_tensors"]


def _holds_tensor(obj: Any) -> bool:
    """Whether an object that is no container holds a tensor among its attributes."""
    attrs = getattr(obj, "__dict__", None)
    values = list(attrs.values()) if isinstance(attrs, dict) else []
    values += [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())
               if isinstance(s, str)]
    return any(isinstance(v, torch.Tensor) for v in values)


def join_outputs(outputs: Sequence[Any], join: Callable[[list[torch.Tensor]], torch.Tensor]
                 ) -> Any:
    """One output made of several of the same structure (a micro-batched step's, one per
    micro-batch): each tensor leaf ``join`` of the leaves at its place, every container
    rebuilt as the first output's (dataclasses too), any other value the first's. A tensor
    object found in two places of every output is joined once."""
    return _joined(list(outputs), join, {})


def _joined(parts: list[Any], join: Callable[[list[torch.Tensor]], torch.Tensor],
            done: dict[tuple[int, ...], torch.Tensor]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        key = tuple(map(id, parts))
        known = done.get(key)
        if known is None:
            known = done[key] = join(parts)
        return known
    node = _node(first)
    if node is None:
        return first
    children, rebuild = node
    columns = [[v for _, v in children]]
    for other in parts[1:]:
        found = _node(other)
        if found is None or len(found[0]) != len(children):
            raise ValueError(f"the outputs differ in structure: {type(first).__name__} and "
                             f"{type(other).__name__}")
        columns.append([v for _, v in found[0]])
    return rebuild([_joined([col[i] for col in columns], join, done)
                    for i in range(len(children))])


OUTPUT_KINDS = ("tokens", "requests", "none")
Seen = dict[int, set[tuple[int, int | None, int | None]]]  # leaf -> (tokens, reqs, dim 0)


def check_outputs(outputs: Any) -> Any:
    """``outputs=`` checked at construction: a kind, or a sequence or mapping of kinds (a
    misspelled kind is an error then, not at the first step)."""
    if isinstance(outputs, str):
        if outputs not in OUTPUT_KINDS:
            raise ConfigError(f"outputs: unknown kind {outputs!r}; use one of "
                              f"{list(OUTPUT_KINDS)}, or a sequence or mapping of them")
        return outputs
    if isinstance(outputs, Mapping):
        for v in outputs.values():
            check_outputs(v)
        return outputs
    if isinstance(outputs, (tuple, list)):
        for v in outputs:
            check_outputs(v)
        return outputs
    raise ConfigError(f"outputs: expected 'tokens', 'requests', 'none' or a sequence or "
                      f"mapping of them, got {outputs!r}")


class OutputCut:
    """How one runner cuts its outputs; learns from capture which leaves follow the size."""

    def __init__(self, outputs: Any) -> None:
        self.outputs = check_outputs(outputs)
        self._seen: Seen = {}
        self._fixed: dict[int, frozenset[str]] = {}
        self._scaled: dict[int, int] = {}

    def forget(self) -> None:
        """A new capture starts: what the last one saw no longer counts."""
        self._seen.clear()

    def record(self, out: Any, tokens: int, reqs: int) -> None:
        """One dummy step's output at ``tokens`` (and ``reqs``) padded rows."""
        for i, leaf in enumerate(tensor_leaves(out)):
            self._seen.setdefault(i, set()).add(
                (tokens, reqs, int(leaf.shape[0]) if leaf.dim() else None))

    def classify(self) -> None:
        """Which leaves follow the padded size, from every dummy step recorded."""
        self._fixed = _fixed_leaves(self._seen)
        self._scaled = _scaled_leaves(self._seen)

    def cut(self, out: Any, padded_tokens: int, num_tokens: int, padded_reqs: int | None,
            reqs: int | None) -> Any:
        """The real rows of each output leaf (see the module docstring); a tensor object
        found twice, as one kind, is cut once (both places hold the one cut, as eager's held
        the one tensor)."""
        return self._cut(out, self.outputs, padded_tokens, num_tokens, padded_reqs, reqs, [0],
                         {})

    def _cut(self, out: Any, kinds: Any, padded_tokens: int, num_tokens: int,
             padded_reqs: int | None, reqs: int | None, leaf: list[int],
             done: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if isinstance(out, torch.Tensor):
            if not isinstance(kinds, str):
                raise ConfigError(f"outputs={self.outputs!r} does not match a single tensor "
                                  "output; use outputs='tokens', 'requests' or 'none'")
            index = leaf[0]
            leaf[0] += 1
            known = done.get((id(out), kinds))
            if known is not None:
                return known[1]
            result = self._cut_leaf(out, kinds, index, padded_tokens, num_tokens,
                                    padded_reqs, reqs)
            done[(id(out), kinds)] = (out, result)
            return result
        node = _node(out)
        if node is None:
            if kinds != "none" and _holds_tensor(out):
                raise ConfigError(
                    f"the model returned a {type(out).__qualname__} holding tensors, which the "
                    "runner cannot cut to the real rows (it knows tensors, tuples, lists, "
                    "dicts, dataclasses and classes registered with torch.utils._pytree): "
                    "return one of those, register the class with "
                    "torch.utils._pytree.register_pytree_node, or mark it outputs='none' "
                    "(returned whole, padding rows included)")
            return out
        children, rebuild = node
        if isinstance(kinds, (tuple, list)) and len(kinds) != len(children):
            raise ConfigError(f"outputs={self.outputs!r} has {len(kinds)} entries but the "
                              f"model returned {len(children)} values")
        parts = []
        for i, (key, value) in enumerate(children):
            kind = (kinds[key] if isinstance(kinds, Mapping)
                    else kinds[i] if isinstance(kinds, (tuple, list)) else kinds)
            parts.append(self._cut(value, kind, padded_tokens, num_tokens, padded_reqs, reqs,
                                   leaf, done))
        return rebuild(parts)

    def _cut_leaf(self, out: torch.Tensor, kind: str, index: int, padded_tokens: int,
                  num_tokens: int, padded_reqs: int | None, reqs: int | None) -> torch.Tensor:
        """Output leaf ``index`` cut as ``kind``."""
        fixed = self._fixed.get(index)
        if fixed is not None and kind in fixed:
            return out.detach()
        scale = self._scaled.get(index)
        if scale is not None and kind == "tokens" and padded_tokens != num_tokens:
            raise ConfigError(
                f"output {index} (a tensor of shape {tuple(out.shape)}) has a dim 0 of "
                f"{scale} x the padded token count at every captured size (a flatten() "
                "or view(-1) of per-token rows): the runner cannot tell its padding rows "
                f"from the real ones. Return it with the tokens first ((tokens, {scale}, "
                "...)) so they are cut, or mark it outputs='none' and cut it yourself")
        return cut_rows(out, kind, padded_tokens, num_tokens, padded_reqs, reqs)


def cut_rows(t: torch.Tensor, kind: str, padded_tokens: int, num_tokens: int,
             padded_reqs: int | None, reqs: int | None) -> torch.Tensor:
    """``t`` cut to the real rows, always as a new tensor object (a view)."""
    if kind == "none" or t.dim() == 0:
        return t.detach()
    if kind == "tokens":
        return t[:num_tokens] if t.shape[0] == padded_tokens else t.detach()
    if kind == "requests":
        if reqs is None or padded_reqs is None:
            return t.detach()
        return t[:reqs] if t.shape[0] == padded_reqs else t.detach()
    raise ConfigError(f"outputs: unknown kind {kind!r}; use 'tokens', 'requests' or 'none'")


def _fixed_leaves(seen: Seen) -> dict[int, frozenset[str]]:
    """For each output leaf whose dim 0 stayed the same across two or more padded sizes
    (a table derived from a weight or a Static input): the kinds ('tokens', 'requests') it is
    therefore not cut as, even at the size its dim 0 happens to equal. A leaf whose dim 0
    changes with the size (``y[:4]``: 1, 2, 4, 4) follows the step and is cut wherever its
    dim 0 is the padded size."""
    out: dict[int, frozenset[str]] = {}
    for index, sizes in seen.items():
        dims = {d for _, _, d in sizes}
        if len(dims) != 1:
            continue
        fixed = set()
        if len({t for t, _, _ in sizes}) > 1:
            fixed.add("tokens")
        if len({r for _, r, _ in sizes if r is not None}) > 1:
            fixed.add("requests")
        if fixed:
            out[index] = frozenset(fixed)
    return out


def _scaled_leaves(seen: Seen) -> dict[int, int]:
    """Output leaves whose dim 0 was the same multiple (2 or more) of the padded token count
    at two or more sizes: ``{leaf: multiple}``."""
    out: dict[int, int] = {}
    for index, sizes in seen.items():
        ratios = {d // t if d is not None and t and d % t == 0 else None for t, _, d in sizes}
        if len({t for t, _, _ in sizes}) > 1 and len(ratios) == 1:
            ratio = ratios.pop()
            if ratio is not None and ratio > 1:
                out[index] = ratio
    return out
