"""Per-instance counters.

vLLM keeps its counters in one process-wide singleton; we keep one :class:`Stats` per compiled
model (and per runner), so two models in one process never disturb each other's numbers. The
counter names and their meaning follow vLLM's ``compilation_counter``, so a test written
against vLLM's expectations carries over.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["Stats", "Tally"]


class Tally:
    """One counter's increments on a hot path, kept as a plain integer: ``tally.n += 1`` costs
    a tenth of :meth:`Stats.inc` (which takes a lock and walks the linked parents).

    A tally is made by :meth:`Stats.tally` and read through that ``Stats`` and its parents,
    which add its ``n`` to the counter of its ``name``. It has no lock: its owner increments
    it from one thread at a time (a runner's step holds the runner's lock)."""

    __slots__ = ("n", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.n = 0

    def __repr__(self) -> str:
        return f"Tally({self.name!r}, {self.n})"


class Stats:
    """A small bag of named integer counters with attribute access.

    Counters spring into existence at 0 on first increment or read, so a component can add its
    own counters without a central registry. ``Stats`` objects can be *linked*: a child created by
    :meth:`child` forwards its increments to the parent too, which lets graph wrappers owned by a
    compiled model feed ``model.stats`` without knowing about the model.
    """

    __slots__ = ("_counts", "_lock", "_parents", "_tallies")
    # Declared for type checkers: __getattr__ below would otherwise type them as int.
    _counts: dict[str, int]
    _lock: threading.Lock
    _parents: list[Stats]
    _tallies: list[Tally]

    def __init__(self, initial: Mapping[str, int] | None = None) -> None:
        object.__setattr__(self, "_counts", dict(initial or {}))
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_parents", [])
        object.__setattr__(self, "_tallies", [])

    # -- counting -------------------------------------------------------------------------
    def inc(self, name: str, by: int = 1) -> None:
        """Add ``by`` to counter ``name`` (and to every linked parent)."""
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + by
        for parent in self._parents:
            parent.inc(name, by)

    def tally(self, name: str) -> Tally:
        """A :class:`Tally` for counter ``name``, counted here and in every linked parent."""
        tally = Tally(name)
        self._attach(tally)
        return tally

    def retire(self, tally: Tally) -> None:
        """Fold a tally its owner no longer increments into the plain counters (here and in
        the parents), so that tallies do not pile up."""
        with self._lock:
            if tally not in self._tallies:
                return
            self._tallies.remove(tally)
            if tally.n:
                self._counts[tally.name] = self._counts.get(tally.name, 0) + tally.n
        for parent in self._parents:
            parent.retire(tally)

    def _attach(self, tally: Tally) -> None:
        with self._lock:
            self._tallies.append(tally)
        for parent in self._parents:
            parent._attach(tally)

    def get(self, name: str) -> int:
        count = self._counts.get(name, 0)
        for tally in self._tallies:
            if tally.name == name:
                count += tally.n
        return count

    def link_to(self, parent: Stats) -> None:
        """Forward every later increment of this object to ``parent`` as well."""
        if parent is self:
            raise ValueError("a Stats object cannot be linked to itself")
        self._parents.append(parent)
        for tally in list(self._tallies):
            parent._attach(tally)

    def child(self) -> Stats:
        """A new ``Stats`` whose increments also count here."""
        kid = Stats()
        kid.link_to(self)
        return kid

    # -- reading --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
            tallies = list(self._tallies)
        for tally in tallies:
            if tally.n:
                counts[tally.name] = counts.get(tally.name, 0) + tally.n
        return counts

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Stats counters are changed with inc(), not by assignment")

    def __getitem__(self, name: str) -> int:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.snapshot())

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v}" for k, v in sorted(self.snapshot().items()))
        return f"Stats({body})"

    # -- testing helper -------------------------------------------------------------------
    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that, over the ``with`` block, each named counter changes by exactly the given
        delta. Raises ``AssertionError`` listing every mismatch (before, after, expected)."""
        before = self.snapshot()
        yield
        after = self.snapshot()
        wrong = []
        for name, want in deltas.items():
            got = after.get(name, 0) - before.get(name, 0)
            if got != want:
                wrong.append(
                    f"{name}: before={before.get(name, 0)} after={after.get(name, 0)} "
                    f"delta={got}, expected delta={want}"
                )
        if wrong:
            raise AssertionError("counter deltas differ:\n  " + "\n  ".join(wrong))
