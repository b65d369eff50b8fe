"""The capture-size planner: choose the sizes to capture from the batch sizes a model really sees.

A step of ``n`` tokens runs the graph of the smallest captured size ``>= n`` (the *rung* above it),
so every rung costs graph memory and capture time, and every gap between rungs costs padded work
on the steps that fall into it. Given a histogram of observed step sizes, a per-size step cost and
a budget (a number of sizes, graph memory, or both), :func:`plan_capture_sizes` picks the rungs
that minimise the expected padded work::

    work(ladder) = sum over observed sizes s of count(s) * step_cost(padded(s))

It solves this exactly. Rungs sit at observed sizes and at the top (``max_size``, by default the
largest observed size, so that every observed step has a rung): moving a rung down to the
largest observed size it serves never makes a step longer, so for a step cost that does not fall
as the size grows no other placement can do better. Over the sorted distinct sizes this is a
one-dimensional dynamic program: the cost of a rung is the padded work of the block of sizes it
serves, and a plan is a chain of blocks ending at the top.

* With a limit on the number of sizes only, the program runs layer by layer (the best chain of
  ``k`` rungs ending at each size), ``O(max_sizes * n**2)`` for ``n`` distinct sizes.
* With a memory budget it keeps, at each size, every chain that no other chain beats on work,
  rung count and memory at once (a Pareto set), dropping chains that can no longer fit the top
  rung or beat a plan already found. This is exact for any per-size memory.

Among plans of equal work the planner returns the one with the fewest sizes, then the least
memory.

:func:`evaluate_ladder` scores any ladder (vLLM's default, :func:`default_ladder`, or your own)
on the same histogram, so a plan can be compared with what would be captured otherwise.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from freezeframe.config import CompilationConfig
from freezeframe.errors import ConfigError
from freezeframe.sizes import default_capture_sizes

__all__ = [
    "CapturePlan",
    "LinearGraphMemory",
    "LinearStepCost",
    "MeasuredCurve",
    "default_ladder",
    "evaluate_ladder",
    "plan_capture_sizes",
    "read_histogram",
    "read_size_map",
]

# A per-size model: a callable ``size -> value`` or measured ``{size: value}`` points.
SizeModel = Callable[[int], float] | Mapping[int, float]


@dataclasses.dataclass(frozen=True)
class LinearStepCost:
    """The default step cost, in token-equivalents: ``per_step + per_token * padded_tokens``.

    ``per_step`` stands for the launch and host work every step pays whatever its size (16
    tokens' worth by default). Every step pays it once under any ladder, so with this model the
    best plan is simply the one with the fewest padded tokens. Pass measured step times instead
    (a ``{size: time}`` mapping, see :class:`MeasuredCurve`) when a step's time is not linear in
    its tokens, as for a memory-bound decode step that takes about as long at 1 token as at 32:
    padding inside such a flat region costs nothing, and the planner spends its rungs elsewhere.
    """

    per_step: float = 16.0
    per_token: float = 1.0

    def __call__(self, size: int) -> float:
        return self.per_step + self.per_token * size


@dataclasses.dataclass(frozen=True)
class LinearGraphMemory:
    """The default graph-memory estimate per captured size: ``per_graph_mib + per_token_mib *
    size`` (6 MiB per graph plus 8 KiB per token of the size).

    A rough model, not a measurement. It is set so that vLLM's 51-size default ladder up to 512
    comes to about 0.38 GiB, inside the 0.32-0.48 GiB reported for all sizes of an 8B model
    (shared/research/perf_numbers.md, section 3); graphs captured largest first share one memory
    pool, so most of a graph's cost is its own bookkeeping, not its activations. Measure your
    model's graphs (the runner's capture report) and pass them as a ``{size: MiB}`` mapping.
    """

    per_graph_mib: float = 6.0
    per_token_mib: float = 1 / 128

    def __call__(self, size: int) -> float:
        return self.per_graph_mib + self.per_token_mib * size


@dataclasses.dataclass(frozen=True)
class MeasuredCurve:
    """Values measured at some sizes, linearly interpolated between them.

    A size below the smallest or above the largest measured size is an error (no guessing
    outside what was measured). ``argument`` names the planner argument the points came from, so
    that the error says which one to extend.
    """

    points: tuple[tuple[int, float], ...]
    argument: str

    @classmethod
    def from_mapping(cls, values: Mapping[Any, Any], argument: str) -> MeasuredCurve:
        if not isinstance(values, Mapping) or not values:
            raise ConfigError(f"{argument}: expected a non-empty mapping of size -> value, got "
                              f"{values!r}")
        points = []
        for size, value in values.items():
            _check_size(size, f"{argument} size")
            points.append((size, _check_value(value, f"{argument}[{size}]")))
        return cls(tuple(sorted(points)), argument)

    def __call__(self, size: int) -> float:
        sizes = [s for s, _ in self.points]
        i = bisect.bisect_left(sizes, size)
        if i < len(sizes) and sizes[i] == size:
            return self.points[i][1]
        if i == 0 or i == len(sizes):
            raise ConfigError(
                f"{self.argument}: size {size} is outside the measured sizes {sizes[0]}.."
                f"{sizes[-1]}; add a measurement at or beyond {size}")
        (lo, lo_value), (hi, hi_value) = self.points[i - 1], self.points[i]
        return lo_value + (hi_value - lo_value) * (size - lo) / (hi - lo)


@dataclasses.dataclass(frozen=True)
class CapturePlan:
    """A ladder of capture sizes scored against a histogram of step sizes.

    ``work`` is ``sum count(s) * step_cost(padded(s))`` over the histogram. A step above the
    largest size (possible only for a ladder given to :func:`evaluate_ladder`) runs without a
    graph, unpadded: it is counted in ``uncovered_steps`` and costs ``step_cost(s)``.
    """

    sizes: tuple[int, ...]
    memory_mib: tuple[float, ...]
    """The estimated graph memory of each size, in the order of ``sizes``."""
    steps: int
    """The number of steps in the histogram."""
    real_tokens: int
    padded_tokens: int
    uncovered_steps: int
    work: float

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def total_memory_mib(self) -> float:
        return sum(self.memory_mib)

    @property
    def waste(self) -> float:
        """The expected padding waste, ``(padded - real) / real`` tokens."""
        return (self.padded_tokens - self.real_tokens) / self.real_tokens

    @property
    def expected_padded_tokens(self) -> float:
        """Padded tokens per step, on average over the histogram."""
        return self.padded_tokens / self.steps

    @property
    def expected_work(self) -> float:
        """Step cost per step, on average over the histogram."""
        return self.work / self.steps

    def config_dict(self) -> dict[str, Any]:
        """The capture fields of a compilation config, for ``ff.CompilationConfig.from_dict``
        (or merged into a config of your own). A config whose ``max_num_tokens`` is below the
        largest size drops the sizes above it, and then refuses the disagreeing maximum."""
        return {"cudagraph_capture_sizes": list(self.sizes),
                "max_cudagraph_capture_size": self.sizes[-1]}

    def to_json(self) -> str:
        """:meth:`config_dict` as JSON, for ``ff.CompilationConfig.from_json`` or
        ``freezeframe config @FILE``."""
        return json.dumps(self.config_dict())


# -- input checks -------------------------------------------------------------------------------


def _check_size(size: Any, what: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{what}: a batch size must be an int >= 1, got {size!r}")
    return size


def _check_value(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise ConfigError(f"{what}: expected a finite number >= 0, got {value!r}")
    return float(value)


def _histogram(histogram: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The observed sizes (ascending, counts > 0) and their counts."""
    if not isinstance(histogram, Mapping):
        raise ConfigError(f"histogram: expected a mapping of batch size -> step count, got "
                          f"{type(histogram).__name__} {histogram!r}")
    pairs = []
    for size, count in histogram.items():
        _check_size(size, "histogram")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"histogram[{size}]: a step count must be an int >= 0, got "
                              f"{count!r}")
        if count:
            pairs.append((size, count))
    if not pairs:
        raise ConfigError(f"histogram: no step was observed ({dict(histogram)!r}); give at least "
                          "one size with a count >= 1")
    pairs.sort()
    return tuple(s for s, _ in pairs), tuple(c for _, c in pairs)


def _model(model: SizeModel | None, default: Callable[[int], float],
           argument: str) -> Callable[[int], float]:
    """A checked ``size -> value`` function from a callable, a mapping or None (the default)."""
    if model is None:
        return default
    if isinstance(model, Mapping):
        return MeasuredCurve.from_mapping(model, argument)
    if not callable(model):
        raise ConfigError(f"{argument}: expected a callable size -> value or a mapping of "
                          f"measured sizes, got {model!r}")

    def checked(size: int) -> float:
        return _check_value(model(size), f"{argument}({size})")

    return checked


# -- scoring ------------------------------------------------------------------------------------


def _score(sizes: Sequence[int], observed: tuple[int, ...], counts: tuple[int, ...],
           step_cost: Callable[[int], float], graph_mib: Callable[[int], float]) -> CapturePlan:
    padded_tokens = real_tokens = uncovered = 0
    work = 0.0
    for size, count in zip(observed, counts, strict=True):
        i = bisect.bisect_left(sizes, size)
        padded = sizes[i] if i < len(sizes) else size
        uncovered += count if i == len(sizes) else 0
        real_tokens += count * size
        padded_tokens += count * padded
        work += count * step_cost(padded)
    return CapturePlan(sizes=tuple(sizes), memory_mib=tuple(graph_mib(s) for s in sizes),
                       steps=sum(counts), real_tokens=real_tokens, padded_tokens=padded_tokens,
                       uncovered_steps=uncovered, work=work)


def evaluate_ladder(histogram: Mapping[int, int], sizes: Sequence[int], *,
                    cost: SizeModel | None = None,
                    memory: SizeModel | None = None) -> CapturePlan:
    """Score the ladder ``sizes`` on ``histogram`` (see :class:`CapturePlan`). ``cost`` and
    ``memory`` are as for :func:`plan_capture_sizes`."""
    observed, counts = _histogram(histogram)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise ConfigError(f"sizes: expected a non-empty list of capture sizes, got {sizes!r}")
    ladder = sorted({_check_size(s, "sizes") for s in sizes})
    return _score(ladder, observed, counts, _model(cost, LinearStepCost(), "cost"),
                  _model(memory, LinearGraphMemory(), "memory"))


def default_ladder(max_size: int | None = None) -> tuple[int, ...]:
    """vLLM's default capture sizes: what ``ff.CompilationConfig()`` captures (up to 512 with its
    default batch limits), or, given ``max_size``, the same rule cut at ``max_size``."""
    if max_size is None:
        return tuple(CompilationConfig().cudagraph_capture_sizes or ())
    return tuple(default_capture_sizes(_check_size(max_size, "max_size")))


# -- planning -----------------------------------------------------------------------------------


def plan_capture_sizes(histogram: Mapping[int, int], *, max_sizes: int | None = None,
                       budget_mib: float | None = None, cost: SizeModel | None = None,
                       memory: SizeModel | None = None,
                       max_size: int | None = None) -> CapturePlan:
    """The capture sizes that minimise the expected padded work of ``histogram`` within a budget.

    ``histogram`` maps each observed batch size (an int >= 1) to how many steps had it (an int
    >= 0; sizes with count 0 are ignored). ``max_sizes`` caps how many sizes are captured;
    ``budget_mib`` caps their estimated graph memory (the sum of ``memory`` over the sizes);
    neither given captures every observed size. ``cost`` is the cost of one step at a padded size
    (default :class:`LinearStepCost`) and ``memory`` a size's graph memory in MiB (default
    :class:`LinearGraphMemory`): each a callable ``size -> number`` or a mapping of measured
    sizes, interpolated (:class:`MeasuredCurve`). ``max_size`` (default: the largest observed
    size) is always captured, so every observed step has a graph.

    Raises :class:`~freezeframe.errors.ConfigError` for a bad histogram or argument, and when no
    plan fits: the top size alone above ``budget_mib``.
    """
    observed, counts = _histogram(histogram)
    if max_sizes is not None:
        _check_size(max_sizes, "max_sizes")
    if budget_mib is not None:
        _check_value(budget_mib, "budget_mib")
    top = observed[-1] if max_size is None else _check_size(max_size, "max_size")
    if top < observed[-1]:
        raise ConfigError(
            f"max_size: {top} is below the largest observed size {observed[-1]}; every observed "
            f"size needs a rung at or above it: raise max_size to at least {observed[-1]} or "
            "drop the larger sizes from the histogram")
    step_cost = _model(cost, LinearStepCost(), "cost")
    graph_mib = _model(memory, LinearGraphMemory(), "memory")

    candidates = observed if top == observed[-1] else (*observed, top)
    weights = counts if top == observed[-1] else (*counts, 0)
    problem = _Problem(candidates, weights, [step_cost(s) for s in candidates],
                       [graph_mib(s) for s in candidates])
    if budget_mib is not None and problem.mib[-1] > budget_mib:
        raise ConfigError(
            f"budget_mib: {budget_mib} MiB is below the estimated graph memory of the largest "
            f"size {top} alone ({problem.mib[-1]:.2f} MiB), which every plan captures; raise "
            "budget_mib or lower max_size")
    limit = len(candidates) if max_sizes is None else min(max_sizes, len(candidates))
    if budget_mib is None:
        chosen = problem.best_with_at_most(limit)
    else:
        chosen = problem.best_within(limit, budget_mib)
    return _score([candidates[i] for i in chosen], observed, counts, step_cost, graph_mib)


class _Problem:
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

    def block(self, j: int, r: int) -> float:
        """The work of a rung at ``r`` whose rung below is ``j`` (``-1``: none)."""
        return self.cost[r] * (self.prefix[r + 1] - self.prefix[j + 1])

    def best_with_at_most(self, limit: int) -> list[int]:
        """Fewest-work plan with at most ``limit`` rungs (ties: fewest rungs)."""
        n, inf = self.n, math.inf
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

    def best_within(self, limit: int, budget: float) -> list[int]:
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


# -- histogram files ----------------------------------------------------------------------------


def read_histogram(text: str, source: str = "histogram") -> dict[int, int]:
    """A histogram from JSON text: ``{"1": 120, "3": 40}`` (size -> step count; JSON keys are
    strings) or the same object under a ``"histogram"`` key. ``source`` names the text in
    errors. The counts are checked when the histogram is used."""
    return read_size_map(text, source, "histogram", "step count")


def read_size_map(text: str, source: str, wrapper: str, value: str) -> dict[int, Any]:
    """``{"SIZE": VALUE, ...}`` from JSON text, or the same object under the key ``wrapper``;
    keys become ints, values are returned as they are (their user checks them)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON ({exc}); write an object such as "
                          f'{{"1": 120, "3": 40}} (size -> {value})') from None
    if isinstance(data, dict) and set(data) == {wrapper}:
        data = data[wrapper]
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object of size -> {value} such as "
                          f'{{"1": 120, "3": 40}}, got {data!r}')
    out: dict[int, Any] = {}
    for key, item in data.items():
        try:
            size = int(key)
        except ValueError:
            raise ConfigError(f"{source}: key {key!r} is not a batch size; keys are sizes as "
                              'strings, such as "8"') from None
        if str(size) != key.strip():
            raise ConfigError(f"{source}: key {key!r} is not a batch size written as an int")
        out[size] = item
    return out
