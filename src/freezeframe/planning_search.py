"""Where to put the rungs: the searches behind :func:`freezeframe.planning.plan_capture_sizes`.

The candidates are the distinct observed sizes (and the top, when ``max_size`` is above them),
ascending; a plan is a chain of rungs ending at the top. What is exact and what is not:

* **No memory budget, or one the best plan under the rung limit fits: exact.** Up to
  :data:`EXACT_SEARCH_MAX` candidates a plain dynamic program, ``O(n**2)`` (``O(limit * n**2)``
  with a rung limit); above, the same program with the minimum over the rung below read off a
  lower envelope of lines (a block's work is linear in the steps below its rung), ``O(n log
  n)`` per rung layer. Exact up to float rounding; among plans of equal work the fewest rungs
  exactly below the threshold, and above it no rung that saves no work.
* **A memory budget that binds, up to** :data:`EXACT_SEARCH_MAX` **candidates: exact**, by the
  bounded Pareto search of :meth:`RungProblem.exact_within`, whose time grows fast beyond.
* **A memory budget that binds, above** :data:`EXACT_SEARCH_MAX` **candidates: approximate**
  (:mod:`freezeframe.planning_approximate`). Memory is priced into the program (Lagrangian
  relaxation, the price found as LARAC does: a handful of passes), and the best plan within both
  limits met on the way is improved by local search (move a rung between its neighbours; add,
  remove, or move one to another gap) and by the exact search over the sizes near its rungs.
  The plan is within both limits and covers every observed size; its work is not proven minimal
  (a lower bound is logged at DEBUG). ``scripts/bench_planner.py`` compares it with the exact
  search.

This module holds the problem (:class:`RungProblem`) and the exact searches up to
:data:`EXACT_SEARCH_MAX` candidates; the program above it is :mod:`freezeframe.planning_envelope`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from freezeframe.planning_approximate import approximate_within
from freezeframe.planning_envelope import envelope_best

__all__ = ["EXACT_SEARCH_MAX", "RungProblem"]

EXACT_SEARCH_MAX = 128
"""Up to this many candidate sizes the searches are the exact quadratic ones (whose results the
unit tests pin down); above it the envelope program and, for a binding budget, the approximate
search. The exact budget search takes about 0.2 s on 128 candidates and grows quickly beyond."""


class RungProblem:
    """Rung placement over the candidate sizes ``sizes[0] < ... < sizes[-1]`` (the top).

    A rung at candidate ``r`` whose rung below is ``j`` serves candidates ``j+1..r``; its block
    costs ``cost[r] * (steps of candidates j+1..r)``. Methods return the chosen candidate
    indices, ascending, always ending with the top.
    """

    def __init__(self, sizes: Sequence[int], counts: Sequence[int], cost: list[float],
                 mib: list[float]) -> None:
        self.n = len(sizes)
        self.cost = cost
        self.mib = mib
        self.prefix = [0]  # prefix[i] = steps of candidates 0..i-1
        for c in counts:
            self.prefix.append(self.prefix[-1] + c)
        self.mib_rises = all(a <= b for a, b in itertools.pairwise(mib))  # as by default

    def block(self, j: int, r: int) -> float:
        """The work of a rung at ``r`` whose rung below is ``j`` (``-1``: none)."""
        return self.cost[r] * (self.prefix[r + 1] - self.prefix[j + 1])

    def best_with_at_most(self, limit: int) -> list[int]:
        """Fewest-work plan with at most ``limit`` rungs (ties: fewest rungs)."""
        n, inf = self.n, math.inf
        if n > EXACT_SEARCH_MAX:
            return envelope_best(self, limit)
        if limit >= n:
            return self._best_unlimited()
        # layer[r]: least work of k rungs with the highest at r; parents[k][r]: the rung below it.
        layer = [self.block(-1, r) for r in range(n)]
        parents: list[list[int]] = [[-1] * n]
        best_k, best_work = 1, layer[-1]
        for k in range(2, limit + 1):
            nxt, back = [inf] * n, [-1] * n
            for r in range(k - 1, n):
                cost_r, steps_r = self.cost[r], self.prefix[r + 1]
                for j in range(k - 2, r):
                    work = layer[j] + cost_r * (steps_r - self.prefix[j + 1])
                    if work < nxt[r]:
                        nxt[r], back[r] = work, j
            layer = nxt
            parents.append(back)
            if layer[-1] < best_work:
                best_k, best_work = k, layer[-1]
        chosen, r = [], n - 1
        for k in range(best_k - 1, -1, -1):
            chosen.append(r)
            r = parents[k][r]
        return chosen[::-1]

    def _best_unlimited(self) -> list[int]:
        """Fewest-work plan with any number of rungs (ties: fewest rungs), in ``O(n**2)``."""
        best: list[tuple[float, int]] = []  # best[r]: (work, rungs) with the highest rung at r
        below: list[int] = []
        for r in range(self.n):
            options = [(self.block(-1, r), 1, -1)]
            options += [(best[j][0] + self.block(j, r), best[j][1] + 1, j) for j in range(r)]
            work, k, j = min(options)
            best.append((work, k))
            below.append(j)
        chosen, r = [], self.n - 1
        while r >= 0:
            chosen.append(r)
            r = below[r]
        return chosen[::-1]

    def folded(self, near: Sequence[int]) -> RungProblem:
        """The problem over the candidates ``near`` only (ascending, ending at the top), the
        steps of the others folded into the nearest of them above."""
        counts, below = [], -1
        for r in near:
            counts.append(self.prefix[r + 1] - self.prefix[below + 1])
            below = r
        return RungProblem(near, counts, [self.cost[r] for r in near],
                           [self.mib[r] for r in near])

    def memory(self, chosen: Sequence[int]) -> float:
        return sum(self.mib[i] for i in chosen)  # ascending, as CapturePlan sums it

    def rank(self, chosen: Sequence[int]) -> tuple[float, int, float]:
        """What a plan is judged by: work, then rungs, then memory."""
        return self.work(chosen), len(chosen), self.memory(chosen)

    def best_within(self, limit: int, budget: float) -> list[int]:
        """:meth:`exact_within` up to :data:`EXACT_SEARCH_MAX` candidates; above, the best plan
        under the rung limit when it fits the budget, else the approximate search's plan."""
        if self.n <= EXACT_SEARCH_MAX:
            return self.exact_within(limit, budget)
        fast = self.best_with_at_most(limit)
        if self.memory(fast) <= budget:
            return fast
        return approximate_within(self, limit, budget, EXACT_SEARCH_MAX)

    def exact_within(self, limit: int, budget: float) -> list[int]:
        """Fewest-work plan with at most ``limit`` rungs and memory <= ``budget`` (ties: fewest
        rungs, then least memory).

        When the best plan under the rung limit alone fits the budget, that is the answer.
        Otherwise a search over partial plans (ascending rungs) keeps, per highest rung, those
        that no other partial plan matches or beats on work, rungs and memory at once, and drops
        any whose lower bound on the final work exceeds the best complete plan found so far. The
        bound is the Lagrangian relaxation of the memory budget (memory priced at ``lam`` work
        per MiB, ``lam`` chosen to make the bound tightest); it only cuts plans that cannot win,
        so the result stays exact.
        """
        fast = self.best_with_at_most(limit)
        if self.memory(fast) <= budget:
            return fast
        n, top = self.n, self.n - 1
        lam, incumbent = self._relax(limit, budget)
        ahead = self._ahead(lam, self._most_rungs(limit, budget), limit)
        labels: list[list[tuple[float, int, float, int, int]]] = []  # per highest rung:
        # (work, rungs, memory, rung below, index of its label there)
        for r in range(n):
            reserve_k, reserve_mib = (0, 0.0) if r == top else (1, self.mib[top])
            # a little slack, on the scale of the priced sums, so rounding never cuts a plan
            # as good as the incumbent
            bound = incumbent + 1e-9 * (abs(incumbent) + lam * budget + 1.0)
            mib_r = self.mib[r]
            # floor[k]: least priced work above r for a plan with k rungs up to r, less the
            # budget's price; a partial plan is cut when its work + lam * memory + floor > bound
            floor = [row[r] - lam * (budget - mib_r) for row in ahead]
            found = []
            if 1 + reserve_k <= limit and mib_r + reserve_mib <= budget:
                work = self.block(-1, r)
                if work + floor[1] <= bound:
                    found.append((work, 1, mib_r, -1, -1))
            k_cap = limit - 1 - reserve_k
            for j in range(r):
                block = self.block(j, r)
                cut = bound - block
                least_cut = cut - floor[2]  # labels[j] is sorted by work + lam * mib
                for index, (work, k, mib, _, _) in enumerate(labels[j]):
                    priced = work + lam * mib
                    if priced > least_cut:
                        break
                    # memory summed as the plan sums it (ascending), so that fits means fits
                    if (k <= k_cap and (mib + mib_r) + reserve_mib <= budget
                            and priced + floor[k + 1] <= cut):
                        found.append((work + block, k + 1, mib + mib_r, j, index))
            kept = _pareto(found, limit if limit < n else None)
            kept.sort(key=lambda label: label[0] + lam * label[2])
            labels.append(kept)
            if r != top:  # each partial plan closed by the top rung is a plan
                close, close_mib = self.block(r, top), self.mib[top]
                incumbent = min([incumbent, *(w + close for w, k, m, *_ in kept
                                              if k < limit and m + close_mib <= budget)])
        _, _, _, j, index = min(labels[top], key=lambda label: label[:3])
        chosen = [top]
        while j >= 0:
            chosen.append(j)
            _, _, _, j, index = labels[j][index]
        return chosen[::-1]

    def _most_rungs(self, limit: int, budget: float) -> int:
        """At least the most rungs a plan within ``budget`` can have: the top and the smallest
        others, with some slack for rounding (too many only weakens the bound)."""
        total, most = self.mib[-1], 1
        slack = 1e-9 * (abs(budget) + 1.0)
        for mib in sorted(self.mib[:-1]):
            total += mib
            if total > budget + slack or most == limit:
                break
            most += 1
        return most

    def _ahead(self, lam: float, most: int, limit: int) -> list[list[float]]:
        """``ahead[k][r]``: the least ``work + lam * memory`` of the rungs above ``r`` for a
        plan of at most ``most`` rungs with ``k`` of them up to ``r`` (inf where none fits)."""
        n, top, cost, prefix = self.n, self.n - 1, self.cost, self.prefix
        inf = math.inf
        # at_most[q][r]: least priced work above r with at most q more rungs
        at_most = [[inf] * top + [0.0]]
        for _ in range(most):
            prev = at_most[-1]
            base = [lam * self.mib[t] + prev[t] + cost[t] * prefix[t + 1] for t in range(n)]
            row = [inf] * n
            row[top] = 0.0
            for r in range(top):
                steps_r = prefix[r + 1]
                row[r] = min(base[t] - cost[t] * steps_r for t in range(r + 1, n))
            at_most.append(row)
        return [at_most[most - k] if k <= most else [inf] * n
                for k in range(max(most, limit) + 2)]

    def _relax(self, limit: int, budget: float) -> tuple[float, float]:
        """The memory price ``lam`` that makes the Lagrangian bound tightest (by bisection on
        its subgradient), and the least work of a plan within the limits met on the way (the
        top rung alone to start with)."""
        incumbent = self.block(-1, self.n - 1)
        # Any price gives a valid bound; the search only looks for a tight one. At hi no rung
        # whose memory is above a millionth of the budget is worth its memory.
        positive = [m for m in self.mib if m > 0]
        lo, hi = 0.0, (incumbent + 1.0) / max(min(positive), 1e-6 * budget, 1e-12)
        best_value, best_lam = -math.inf, 0.0
        for _ in range(30):
            lam = (lo + hi) / 2
            value, chain = self._priced(lam)
            if self.memory(chain) <= budget:
                hi = lam
                if len(chain) <= limit:
                    incumbent = min(incumbent, self.work(chain))
            else:
                lo = lam
            if value - lam * budget > best_value:
                best_value, best_lam = value - lam * budget, lam
        return best_lam, incumbent

    def work(self, chosen: Sequence[int]) -> float:
        return sum(self.block(j, r) for j, r in zip([-1, *chosen], chosen, strict=False))

    def _priced(self, lam: float) -> tuple[float, list[int]]:
        """The least ``work + lam * memory`` of a whole plan, and that plan."""
        n, top, cost, prefix = self.n, self.n - 1, self.cost, self.prefix
        priced = [lam * mib for mib in self.mib]
        after, nxt = [0.0] * n, [top] * n
        base = [0.0] * n  # base[t] - cost[t] * steps up to r: the priced work from t on
        base[top] = priced[top] + cost[top] * prefix[n]
        for r in range(n - 2, -1, -1):
            steps_r = prefix[r + 1]
            after[r], nxt[r] = min((base[t] - cost[t] * steps_r, t) for t in range(r + 1, n))
            base[r] = priced[r] + after[r] + cost[r] * prefix[r + 1]
        value, first = min((cost[r] * prefix[r + 1] + priced[r] + after[r], r) for r in range(n))
        chain = [first]
        while chain[-1] != top:
            chain.append(nxt[chain[-1]])
        return value, chain


def _pareto(found: list[tuple[float, int, float, int, int]],
            limit: int | None) -> list[tuple[float, int, float, int, int]]:
    """The labels that no other label matches or beats on work, rungs and memory at once; with
    no rung limit (``None``), on work and memory, the rung count only breaking ties of work."""
    found.sort(key=lambda label: (label[2], label[0], label[1]))
    kept = []
    if limit is None:
        least = (math.inf, 0)  # the least (work, rungs) of a kept label
        for label in found:
            if least <= label[:2]:
                continue
            kept.append(label)
            least = label[:2]
        return kept
    lowest = [math.inf] * (limit + 1)  # lowest[k]: least work of a kept label with <= k rungs
    for label in found:
        work, k = label[0], label[1]
        if lowest[k] <= work:
            continue
        kept.append(label)
        for r in range(k, limit + 1):
            if lowest[r] <= work:
                break
            lowest[r] = work
    return kept
