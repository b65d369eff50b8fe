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
  (:func:`_approximate_within`). Memory is priced into the program (Lagrangian relaxation, the
  price found as LARAC does: a handful of passes), and the best plan within both limits met on
  the way is improved by local search (move a rung between its neighbours; add, remove, or move
  one to another gap) and by the exact search over the sizes near its rungs. The plan is within
  both limits and covers every observed size; its work is not proven minimal (a lower bound is
  logged at DEBUG). ``scripts/bench_planner.py`` compares it with the exact search.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Sequence

__all__ = ["EXACT_SEARCH_MAX", "RungProblem"]

logger = logging.getLogger(__name__)

EXACT_SEARCH_MAX = 128
"""Up to this many candidate sizes the searches are the exact quadratic ones (whose results the
unit tests pin down); above it the envelope program and, for a binding budget, the approximate
search. The exact budget search takes about 0.2 s on 128 candidates and grows quickly beyond."""

# Relative slack under which two works count as equal (float rounding, not a modelling choice).
_TIE = 1e-12
# Local search stops after this many rounds even while it still finds improving moves, and the
# approximate search after this many exact searches around its plan.
_MAX_ROUNDS = 64
_MAX_POLISHES = 2


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
            return _envelope_best(self, limit)
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
        return fast if self.memory(fast) <= budget else _approximate_within(self, limit, budget)

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


# -- above EXACT_SEARCH_MAX: the program on a lower envelope of lines ---------------------------


def _envelope(cost: Sequence[float], prefix: Sequence[int], add: Sequence[float],
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


def _walk(below: Sequence[int], top: int) -> list[int]:
    chain, r = [], top
    while r >= 0:
        chain.append(r)
        r = below[r]
    return chain[::-1]


def _drop_free_rungs(p: RungProblem, chain: list[int]) -> list[int]:
    """``chain`` without the rungs whose removal costs no work (up to rounding): the envelope
    program breaks ties between equal chains by position, not by their number of rungs."""
    slack = _TIE * abs(p.work(chain))
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


def _envelope_best(p: RungProblem, limit: int) -> list[int]:
    """:meth:`RungProblem.best_with_at_most` above :data:`EXACT_SEARCH_MAX` candidates: the
    best chain of any length, and, when that has more than ``limit`` rungs, the best of ``k``
    rungs for ``k = 1..limit``, layer by layer (stopping early once a layer reaches the best of
    any length)."""
    n, zero = p.n, [0.0] * p.n
    values, below = _envelope(p.cost, p.prefix, zero, None)
    chain = _drop_free_rungs(p, _walk(below, n - 1))
    if len(chain) <= limit:
        return chain
    unlimited = values[-1]
    layer = [p.cost[r] * p.prefix[r + 1] for r in range(n)]  # one rung: it serves 0..r
    parents = [[-1] * n]
    best_k, best_work = 1, layer[-1]
    for k in range(2, limit + 1):
        layer, back = _envelope(p.cost, p.prefix, zero, layer)
        parents.append(back)
        if layer[-1] < best_work - _TIE * abs(best_work):
            best_k, best_work = k, layer[-1]
        if best_work <= unlimited + _TIE * abs(unlimited):
            break
    chain, r = [], n - 1
    for k in range(best_k - 1, -1, -1):
        chain.append(r)
        r = parents[k][r]
    return _drop_free_rungs(p, chain[::-1])


# -- above EXACT_SEARCH_MAX with a binding budget: the approximate search -----------------------


def _approximate_within(p: RungProblem, limit: int, budget: float) -> list[int]:
    """A plan within ``limit`` rungs and ``budget`` MiB, not proven optimal: from each of two
    starts, the best plan the priced program meets (:func:`_priced_search`) and the exact plan
    over a coarse choice of sizes (:func:`_coarse`), :func:`_local_search` and :func:`_polish`
    in turn while they help; the better result, or the top rung alone."""
    found = [[p.n - 1]]
    for start in (_priced_search(p, limit, budget), _coarse(p, limit, budget)):
        chain = _local_search(p, start, limit, budget)
        for _ in range(_MAX_POLISHES):
            polished = _polish(p, chain, limit, budget)
            if polished is None:
                break
            chain = _local_search(p, polished, limit, budget)
        found.append(chain)
    return min(found, key=p.rank)


def _better(p: RungProblem, chain: list[int], than: list[int]) -> bool:
    """Whether ``chain`` has less work than ``than`` beyond rounding, or the same work and
    fewer rungs or less memory."""
    (work, rungs, memory), (old_work, old_rungs, old_memory) = p.rank(chain), p.rank(than)
    slack = _TIE * abs(old_work)
    return work < old_work - slack or (work <= old_work + slack
                                       and (rungs, memory) < (old_rungs, old_memory))


def _coarse(p: RungProblem, limit: int, budget: float) -> list[int]:
    """The exact search over half of :data:`EXACT_SEARCH_MAX` candidates spread evenly over the
    steps (each the first to reach its share of them), the others' steps folded into the
    nearest such candidate above: the plan's overall shape, for local search to refine."""
    total, picks = p.prefix[-1], max(EXACT_SEARCH_MAX // 2 - 1, 1)
    near = sorted({*(bisect.bisect_left(p.prefix, total * i / picks, 1) - 1
                     for i in range(1, picks + 1)), p.n - 1})
    return _restricted(p, near, limit, budget)


def _restricted(p: RungProblem, near: list[int], limit: int, budget: float) -> list[int]:
    """The exact search over the candidates ``near`` (ascending, ending at the top), the steps
    of the others folded into the nearest of them above."""
    counts, below = [], -1
    for r in near:
        counts.append(p.prefix[r + 1] - p.prefix[below + 1])
        below = r
    sub = RungProblem(near, counts, [p.cost[r] for r in near], [p.mib[r] for r in near])
    return [near[i] for i in sub.exact_within(min(limit, len(near)), budget)]


def _polish(p: RungProblem, chain: list[int], limit: int, budget: float) -> list[int] | None:
    """The exact search (:meth:`RungProblem.exact_within`) over the candidates within ``w`` of
    each rung of ``chain``, ``w`` as large as keeps them to :data:`EXACT_SEARCH_MAX`, with the
    steps of the others folded into the nearest such candidate above them. It finds changes
    that move several rungs at once; returns None when it finds nothing better than ``chain``
    (or the chain has too many rungs for a window of 1)."""
    w = (EXACT_SEARCH_MAX // len(chain) - 1) // 2
    if w < 1:
        return None
    near = sorted({x for r in chain for x in range(max(0, r - w), min(p.n, r + w + 1))})
    found = _restricted(p, near, limit, budget)
    return found if _better(p, found, chain) and p.memory(found) <= budget else None


def _priced_search(p: RungProblem, limit: int, budget: float) -> list[int]:
    """The best chain within both limits that the program meets when memory is priced at
    ``lam`` work per MiB, ``lam`` chosen as LARAC does: the slope between the cheapest chain
    known to break a limit and the cheapest known to keep both, until no chain lies below that
    line. Each pass also bounds the optimum from below (``value - lam * budget``); the best
    bound is logged with the plan."""
    n, top, mib = p.n, p.n - 1, p.mib

    def solve(lam: float) -> tuple[float, list[int]]:
        values, below = _envelope(p.cost, p.prefix, [lam * m for m in mib], None)
        return values[-1], _drop_free_rungs(p, _walk(below, top))

    bound, chain = solve(0.0)
    breaks = (p.work(chain), p.memory(chain), chain)
    keeps = (p.work([top]), p.memory([top]), [top])
    for _ in range(24):
        if breaks[1] <= keeps[1] or breaks[0] >= keeps[0]:
            break
        lam = (keeps[0] - breaks[0]) / (breaks[1] - keeps[1])
        value, chain = solve(lam)
        bound = max(bound, value - lam * budget)
        line = keeps[0] + lam * keeps[1]
        if value >= line - _TIE * abs(line):
            break
        found = (p.work(chain), p.memory(chain), chain)
        if found[1] <= budget and len(chain) <= limit:
            keeps = found
        else:
            breaks = found
    logger.debug("capture-size plan over %d sizes: the priced search's best plan has work %.6g; "
                 "no plan within the budget has less than %.6g", n, keeps[0], bound)
    return keeps[2]


def _local_search(p: RungProblem, chain: list[int], limit: int, budget: float) -> list[int]:
    """Improve a chain within both limits by single moves until none helps (at most
    ``_MAX_ROUNDS`` rounds). Each round moves every rung to its best place between its
    neighbours, then makes the best of: add a rung, remove one, or move one into another gap
    (remove it and add one elsewhere). A move is taken when it lowers the work beyond rounding,
    or, for a removal or a move between neighbours, keeps the work and saves rungs or memory."""
    cost, prefix, mib, block = p.cost, p.prefix, p.mib, p.block
    out = list(chain)
    target = budget * (1 - _TIE)  # a little under the budget: running sums drift
    for _ in range(_MAX_ROUNDS):
        changed = False
        memory = p.memory(out)
        slack = _TIE * abs(p.work(out))
        for i in range(len(out) - 1):  # every rung but the top, between its neighbours
            lo, r0, hi = (out[i - 1] if i else -1), out[i], out[i + 1]
            p_lo, p_hi, c_hi = prefix[lo + 1], prefix[hi + 1], cost[hi]
            room = target - memory + mib[r0]
            best, best_x = block(lo, r0) + block(r0, hi), r0
            for x in range(lo + 1, hi):
                if mib[x] <= room:
                    work = cost[x] * (prefix[x + 1] - p_lo) + c_hi * (p_hi - prefix[x + 1])
                    if work < best - slack or (work <= best and mib[x] < mib[best_x]):
                        best, best_x = work, x
            if best_x != r0:
                memory += mib[best_x] - mib[r0]
                out[i] = best_x
                changed = True
        move = _best_move(p, out, limit, target - memory)
        if move is not None:
            out, changed = move, True
        if not changed:
            break
    return out if p.memory(out) <= budget and len(out) <= limit else chain


def _best_move(p: RungProblem, out: list[int], limit: int, room: float) -> list[int] | None:
    """The chain after the best single add, removal, or move of a rung into another gap, when
    that lowers the work beyond rounding (a removal also when it costs no work); else None.
    ``room`` is the memory left under the budget."""
    cost, prefix, mib, block = p.cost, p.prefix, p.mib, p.block
    slack = _TIE * abs(p.work(out))
    gaps = []  # per gap below out[g]: the rungs one could add there, cheapest memory first,
    lo = -1    # with the best work saving among those at or under each memory
    for hi in out:
        p_lo, c_hi = prefix[lo + 1], cost[hi]
        adds = [(mib[x], (cost[x] - c_hi) * (prefix[x + 1] - p_lo), x)
                for x in range(lo + 1, hi) if cost[x] < c_hi]
        if not p.mib_rises:
            adds.sort()
        memories, best, run = [], [], (0.0, -1)
        for memory, saving, x in adds:
            if saving < run[0]:
                run = (saving, x)
            memories.append(memory)
            best.append(run)
        gaps.append((memories, best))
        lo = hi

    def best_add(room: float, skip: tuple[int, ...] = ()) -> tuple[float, int]:
        found = (0.0, -1)
        for g, (memories, best) in enumerate(gaps):
            k = bisect.bisect_right(memories, room)
            if k and g not in skip and best[k - 1][0] < found[0]:
                found = best[k - 1]
        return found

    moves: list[tuple[float, int, int]] = []  # (work change, rung removed or -1, rung added)
    if len(out) < limit:
        change, x = best_add(room)
        if x >= 0:
            moves.append((change, -1, x))
    for i in range(len(out) - 1):
        lo, r0, hi = (out[i - 1] if i else -1), out[i], out[i + 1]
        removal = block(lo, hi) - block(lo, r0) - block(r0, hi)
        if removal <= 0:
            return out[:i] + out[i + 1:]  # a free rung: fewer sizes, same work
        moves.append((removal, i, -1))
        change, x = best_add(room + mib[r0], skip=(i, i + 1))
        if x >= 0:
            moves.append((removal + change, i, x))
    if not moves:
        return None
    change, i, x = min(moves)
    if change >= -slack:
        return None
    chain = out if i < 0 else out[:i] + out[i + 1:]
    return sorted([*chain, x]) if x >= 0 else chain
