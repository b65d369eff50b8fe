"""The capture-size planner: choose the sizes to capture from the batch sizes a model really sees.

A step of ``n`` tokens runs the graph of the smallest captured size ``>= n`` (the *rung* above it),
so every rung costs graph memory and capture time, and every gap between rungs costs padded work
on the steps that fall into it. Given a histogram of observed step sizes, a per-size step cost and
a budget (a number of sizes, graph memory, or both), :func:`plan_capture_sizes` picks the rungs
that minimise the expected padded work::

    work(ladder) = sum over observed sizes s of count(s) * step_cost(padded(s))

Rungs sit at observed sizes and at the top (``max_size``, by default the largest observed size,
so that every observed step has a rung): moving a rung down to the largest observed size it
serves never makes a step longer, so for a step cost that does not fall as the size grows no
other placement can do better. Over the sorted distinct sizes this is a one-dimensional dynamic
program: the cost of a rung is the padded work of the block of sizes it serves, and a plan is a
chain of blocks ending at the top. The searches live in :mod:`freezeframe.planning_search`;
what is exact and what is approximated:

* With no budget, or a limit on the number of sizes only, or a memory budget that the best plan
  under the size limit fits: **exact**, for any number of sizes (``O(n**2)`` up to
  ``EXACT_SEARCH_MAX`` = 128 distinct sizes, ``O(n log n)`` per rung layer above).
* With a memory budget that binds, up to 128 distinct sizes: **exact**. The search keeps, at each
  size, every chain that no other chain beats on work, rung count and memory at once (a Pareto
  set), dropping chains that can no longer fit the top rung or beat a plan already found; exact
  for any per-size memory, but its time grows quickly with the sizes.
* With a memory budget that binds, above 128 distinct sizes: **approximate**. The budget is
  priced into the program (Lagrangian relaxation); the plans that finds, and the exact plan over
  a coarse choice of sizes, are improved by local search and by the exact search over the sizes
  near their rungs. The plan fits both limits and covers every observed size; its work is not
  proven minimal: on 40 seeded histograms of 130-260 sizes it was the exact plan's in 24 and at
  most 0.07% above it (``scripts/bench_planner.py`` prints these figures and the times; 10,000
  distinct sizes take well under a second).

Among plans of equal work the planner returns the one with the fewest sizes, then the least
memory: exactly up to 128 distinct sizes; above, up to float rounding, and no captured size is
one whose removal costs no work.

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
from freezeframe.planning_search import RungProblem
from freezeframe.sizes import default_capture_sizes, padded_size

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
    _sizes: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the measured sizes, for the bisection of every call (a planner calls once per size)
        object.__setattr__(self, "_sizes", tuple(s for s, _ in self.points))

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
        sizes = self._sizes
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
        rung = padded_size(size, sizes)
        padded = size if rung is None else rung  # (above the ladder: unpadded, no graph)
        uncovered += count if rung is None else 0
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

    The result is exact except with a ``budget_mib`` that binds on more than
    ``EXACT_SEARCH_MAX`` (128) distinct sizes, where it is the approximate search's plan (see
    the module docstring: within both limits, work not proven minimal).

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
    problem = RungProblem(candidates, weights, [step_cost(s) for s in candidates],
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
