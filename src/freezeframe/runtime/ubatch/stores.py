"""The attribute stores of a micro-batched step, made as the one eager call makes them.

A forward that stores its output on its module (``self.last = out``) runs once per micro-batch
in a split step, so each micro-batch binds its own rows and the last one to finish wins: after
the step the attribute holds a slice of the answer (one row of two), where eager's one call
holds the whole output. A split FULL graph is worse off: a replay runs no Python at all, and
the capture's stores were put back by the capture, so the attribute kept whatever it held
before.

So a split step notes what its micro-batches stored (:meth:`SplitStores.of`): each store of a
tensor that is a leaf of a micro-batch's output is a store of that output leaf, and is made
again with the joined output's leaf at the same place (:meth:`SplitStores.make`) after the
step, and after every replay of its split graph. A store of anything else (an intermediate
tensor, a count) has no whole-batch value to stand for: like a buffer a forward updates, it is
made once per micro-batch on an eager split step and not at all by a replay (docs/
micro_batching.md says so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import nn

from freezeframe.containers import tensor_leaves
from freezeframe.graphs.stores import AttributeStores

__all__ = ["SplitStores"]

Snapshot = list[tuple[dict[str, Any], dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class SplitStores:
    """The output leaves a split step's forward stored: (the module's ``__dict__``, the name,
    the leaf's place in the output)."""

    stores: tuple[tuple[dict[str, Any], str, int], ...]

    @staticmethod
    def snapshot(module: nn.Module) -> Snapshot:
        """Every submodule's attributes before the step (see :meth:`of`)."""
        return AttributeStores.snapshot(module)

    @classmethod
    def of(cls, before: Snapshot, results: Sequence[Any]) -> SplitStores | None:
        """The output leaves the micro-batches (their outputs ``results``) stored since
        ``before``; None when none."""
        made = AttributeStores.since(before)
        if made is None:
            return None
        places = {id(leaf): i for result in results
                  for i, leaf in enumerate(tensor_leaves(result))}
        found = [(attrs, name, places[id(value)]) for attrs, name, value in made.stores
                 if id(value) in places]
        return cls(tuple(found)) if found else None

    def make(self, joined: Any) -> None:
        """Bind each stored attribute to the joined output's leaf at its place."""
        leaves = list(tensor_leaves(joined))
        for attrs, name, place in self.stores:
            attrs[name] = leaves[place]

