"""The rung program on a lower envelope of lines: the exact plans for a large histogram.

Above :data:`~freezeframe.planning_search.EXACT_SEARCH_MAX` candidate sizes the plain dynamic
program of :class:`~freezeframe.planning_search.RungProblem`, ``O(n**2)`` per rung layer, is too
slow. A block's work is linear in the steps below its rung, so each rung below is a line, and
the minimum over them is read off the lower envelope of the lines so far: ``O(n log n)`` per
layer, exact up to float rounding. :func:`envelope` is one pass (with memory priced in, the
approximate search's inner step too); :func:`envelope_best` is
:meth:`~freezeframe.planning_search.RungProblem.best_with_at_most` for many candidates.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.planning_search import RungProblem

__all__ = ["TIE", "drop_free_rungs", "envelope", "envelope_best", "walk"]

TIE = 1e-12
"""Relative slack under which two works count as equal (float rounding, not a modelling
choice)."""


def envelope(cost: Sequence[float], prefix: Sequence[int], add: Sequence[float],
             lower: Sequence[float] | None) -> tuple[list[float], list[int]]:
    """One pass of the rung program in ``O(n log n)``: for each candidate ``r``, the least
    ``work + sum of add`` of a chain whose highest rung is ``r``, and the rung below it.

    With ``P[j]`` the steps of candidates ``0..j``, that value is ``add[r] + cost[r] * P[r] +
    min over j of (v[j] - P[j] * cost[r])``: each rung below, ``j``, is a line in ``x =
    cost[r]`` whose slope ``-P[j]`` falls as ``j`` rises, so the minimum is read off the lower
    envelope of the lines so far with one bisection. With ``lower`` None, ``v`` is this pass's
    own values (chains of any length; ``j = -1``, no rung below, is the line 0); given, ``v`` is
    ``lower`` (each chain one rung longer than those ``lower`` holds). ``inf`` where no chain
    ends at ``r``.
    """
    n, inf = len(cost), math.inf
    own = lower is None
    # the envelope: line i is heads[i] + slopes[i] * x, the lowest from starts[i] on
    heads: list[float] = [0.0] if own else []
    slopes: list[float] = [0.0] if own else []
    rungs: list[int] = [-1] if own else []
    starts: list[float] = [-inf] if own else []

    def add_line(head: float, slope: float, rung: int) -> None:
        while heads:
            if slope == slopes[-1]:  # a candidate with no steps: keep the lower of the two
                if head >= heads[-1]:
                    return
            else:
                start = (head - heads[-1]) / (slopes[-1] - slope)  # lower from here on
                if start > starts[-1]:  # (the first line is lowest from -inf on)
                    heads.append(head)
                    slopes.append(slope)
                    rungs.append(rung)
                    starts.append(start)
                    return
            del heads[-1], slopes[-1], rungs[-1], starts[-1]
        heads.append(head)
        slopes.append(slope)
        rungs.append(rung)
        starts.append(-inf)

    values, below = [inf] * n, [-1] * n
    for r in range(n):
        if lower is not None and r and lower[r - 1] < inf:
            add_line(lower[r - 1], -prefix[r], r - 1)
        if not heads:
            continue
        x = cost[r]
        i = bisect.bisect_right(starts, x) - 1
        values[r] = add[r] + x * prefix[r + 1] + (heads[i] + slopes[i] * x)
        below[r] = rungs[i]
        if own:
            add_line(values[r], -prefix[r + 1], r)
    return values, below


def walk(below: Sequence[int], top: int) -> list[int]:
    """The chain whose highest rung is ``top``, read back through ``below`` (each rung's rung
    below, as :func:`envelope` returns them), ascending."""
    chain, r = [], top
    while r >= 0:
        chain.append(r)
        r = below[r]
    return chain[::-1]


def drop_free_rungs(p: RungProblem, chain: list[int]) -> list[int]:
    """``chain`` without the rungs whose removal costs no work (up to rounding): the envelope
    program breaks ties between equal chains by position, not by their number of rungs."""
    slack = TIE * abs(p.work(chain))
    out, i = list(chain), 0
    while i < len(out) - 1:
        lo = out[i - 1] if i else -1
        r, hi = out[i], out[i + 1]
        if p.block(lo, hi) - p.block(lo, r) - p.block(r, hi) <= slack:
            del out[i]
            i = max(i - 1, 0)  # the rung below may have become free
        else:
            i += 1
    return out


def envelope_best(p: RungProblem, limit: int) -> list[int]:
    """:meth:`RungProblem.best_with_at_most` above ``EXACT_SEARCH_MAX`` candidates: the
    best chain of any length, and, when that has more than ``limit`` rungs, the best of ``k``
    rungs for ``k = 1..limit``, layer by layer (stopping early once a layer reaches the best of
    any length)."""
    n, zero = p.n, [0.0] * p.n
    values, below = envelope(p.cost, p.prefix, zero, None)
    chain = drop_free_rungs(p, walk(below, n - 1))
    if len(chain) <= limit:
        return chain
    unlimited = values[-1]
    layer = [p.cost[r] * p.prefix[r + 1] for r in range(n)]  # one rung: it serves 0..r
    parents = [[-1] * n]
    best_k, best_work = 1, layer[-1]
    for k in range(2, limit + 1):
        layer, back = envelope(p.cost, p.prefix, zero, layer)
        parents.append(back)
        if layer[-1] < best_work - TIE * abs(best_work):
            best_k, best_work = k, layer[-1]
        if best_work <= unlimited + TIE * abs(unlimited):
            break
    chain, r = [], n - 1
    for k in range(best_k - 1, -1, -1):
        chain.append(r)
        r = parents[k][r]
    return drop_free_rungs(p, chain[::-1])
