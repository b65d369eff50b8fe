"""The approximate capture-size search: a memory budget that binds on a large histogram.

Above :data:`~freezeframe.planning_search.EXACT_SEARCH_MAX` candidate sizes the exact budget
search (:meth:`~freezeframe.planning_search.RungProblem.exact_within`) takes too long, so when
the best plan under the rung limit does not fit the budget, :func:`approximate_within` finds one
that does. Memory is priced into the envelope program (:mod:`freezeframe.planning_envelope`;
Lagrangian relaxation, the price found as LARAC does: a handful of passes), and the best plan
within both limits met on the way is improved by local search (move a rung between its
neighbours; add, remove, or move one to another gap) and by the exact search over the sizes
near its rungs. The plan is within both limits and covers every observed size; its work is not
proven minimal (a lower bound is logged at DEBUG). ``scripts/bench_planner.py`` compares it with
the exact search.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

from freezeframe.planning_envelope import TIE, drop_free_rungs, envelope, walk

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.planning_search import RungProblem

__all__ = ["approximate_within"]

logger = logging.getLogger(__name__)

# Local search stops after this many rounds even while it still finds improving moves, and the
# approximate search after this many exact searches around its plan.
_MAX_ROUNDS = 64
_MAX_POLISHES = 2


def approximate_within(p: RungProblem, limit: int, budget: float, exact_max: int) -> list[int]:
    """A plan within ``limit`` rungs and ``budget`` MiB, not proven optimal: from each of two
    starts, the best plan the priced program meets (:func:`_priced_search`) and the exact plan
    over a coarse choice of sizes (:func:`_coarse`), :func:`_local_search` and :func:`_polish`
    in turn while they help; the better result, or the top rung alone. ``exact_max`` is the most
    candidates the exact search takes (``EXACT_SEARCH_MAX``): the coarse choice and the polish's
    windows are sized by it."""
    found = [[p.n - 1]]
    for start in (_priced_search(p, limit, budget), _coarse(p, limit, budget, exact_max)):
        chain = _local_search(p, start, limit, budget)
        for _ in range(_MAX_POLISHES):
            polished = _polish(p, chain, limit, budget, exact_max)
            if polished is None:
                break
            chain = _local_search(p, polished, limit, budget)
        found.append(chain)
    return min(found, key=p.rank)


def _better(p: RungProblem, chain: list[int], than: list[int]) -> bool:
    """Whether ``chain`` has less work than ``than`` beyond rounding, or the same work and
    fewer rungs or less memory."""
    (work, rungs, memory), (old_work, old_rungs, old_memory) = p.rank(chain), p.rank(than)
    slack = TIE * abs(old_work)
    return work < old_work - slack or (work <= old_work + slack
                                       and (rungs, memory) < (old_rungs, old_memory))


def _coarse(p: RungProblem, limit: int, budget: float, exact_max: int) -> list[int]:
    """The exact search over half of ``exact_max`` candidates spread evenly over the
    steps (each the first to reach its share of them), the others' steps folded into the
    nearest such candidate above: the plan's overall shape, for local search to refine."""
    total, picks = p.prefix[-1], max(exact_max // 2 - 1, 1)
    near = sorted({*(bisect.bisect_left(p.prefix, total * i / picks, 1) - 1
                     for i in range(1, picks + 1)), p.n - 1})
    return _restricted(p, near, limit, budget)


def _restricted(p: RungProblem, near: list[int], limit: int, budget: float) -> list[int]:
    """The exact search over the candidates ``near`` (ascending, ending at the top), the steps
    of the others folded into the nearest of them above."""
    return [near[i] for i in p.folded(near).exact_within(min(limit, len(near)), budget)]


def _polish(p: RungProblem, chain: list[int], limit: int, budget: float,
            exact_max: int) -> list[int] | None:
    """The exact search (:meth:`RungProblem.exact_within`) over the candidates within ``w`` of
    each rung of ``chain``, ``w`` as large as keeps them to ``exact_max``, with the
    steps of the others folded into the nearest such candidate above them. It finds changes
    that move several rungs at once; returns None when it finds nothing better than ``chain``
    (or the chain has too many rungs for a window of 1)."""
    w = (exact_max // len(chain) - 1) // 2
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
        values, below = envelope(p.cost, p.prefix, [lam * m for m in mib], None)
        return values[-1], drop_free_rungs(p, walk(below, top))

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
        if value >= line - TIE * abs(line):
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
    target = budget * (1 - TIE)  # a little under the budget: running sums drift
    for _ in range(_MAX_ROUNDS):
        changed = False
        memory = p.memory(out)
        slack = TIE * abs(p.work(out))
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
    slack = TIE * abs(p.work(out))
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
