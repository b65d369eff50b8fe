"""The capture-size planner: hand-worked plans, vLLM's ladder scored, bad input, properties
checked against brute force over every subset of sizes, and the searches for large histograms
(above ``EXACT_SEARCH_MAX`` distinct sizes) checked against exact answers."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import freezeframe as ff
from freezeframe import planning_search
from freezeframe.errors import ConfigError
from freezeframe.planning import (
    CapturePlan,
    LinearGraphMemory,
    LinearStepCost,
    MeasuredCurve,
    default_ladder,
    evaluate_ladder,
    plan_capture_sizes,
    read_histogram,
)

# {1: 10, 2: 10, 8: 1}: 21 steps, 10 + 20 + 8 = 38 real tokens. The top, 8, is always a rung.
SMALL = {1: 10, 2: 10, 8: 1}


def test_two_sizes_by_hand() -> None:
    # {1, 8}: 1->1 (10), 2->8 (80), 8->8 (8) = 98 padded tokens.
    # {2, 8}: 1->2 (20), 2->2 (20), 8->8 (8) = 48 padded tokens: the better one.
    plan = plan_capture_sizes(SMALL, max_sizes=2)
    assert plan.sizes == (2, 8)
    assert (plan.steps, plan.real_tokens, plan.padded_tokens) == (21, 38, 48)
    assert plan.uncovered_steps == 0
    assert plan.waste == 10 / 38
    assert plan.expected_padded_tokens == 48 / 21
    # default cost: 16 per step + 1 per padded token = 21 * 16 + 48
    assert plan.work == 384.0
    assert plan.expected_work == 384 / 21
    # default memory: 6 MiB + size/128 MiB per graph
    assert plan.memory_mib == (6 + 2 / 128, 6 + 8 / 128)
    assert plan.total_memory_mib == 12.078125
    assert plan.max_size == 8


def test_one_size_is_the_top() -> None:
    plan = plan_capture_sizes(SMALL, max_sizes=1)
    assert plan.sizes == (8,)
    assert plan.padded_tokens == 21 * 8


def test_no_budget_captures_every_observed_size() -> None:
    plan = plan_capture_sizes(SMALL)
    assert plan.sizes == (1, 2, 8)
    assert plan.padded_tokens == 38 and plan.waste == 0.0


def test_memory_budget_by_hand() -> None:
    # {2, 8}: 12 + 10/128 = 12.078125 MiB; {1, 8}: 12 + 9/128 = 12.0703125 MiB; {8}: 6.0625.
    assert plan_capture_sizes(SMALL, budget_mib=12.08).sizes == (2, 8)
    # 12.075 leaves out {2, 8} and {1, 2, 8} (18.09 MiB): {1, 8} is the best that fits
    plan = plan_capture_sizes(SMALL, budget_mib=12.075)
    assert plan.sizes == (1, 8) and plan.padded_tokens == 98
    assert plan_capture_sizes(SMALL, budget_mib=12.07).sizes == (8,)
    # both limits: the rung limit binds first here
    assert plan_capture_sizes(SMALL, budget_mib=100.0, max_sizes=2).sizes == (2, 8)


def test_given_max_size_is_always_captured() -> None:
    plan = plan_capture_sizes(SMALL, max_sizes=2, max_size=16)
    # {2, 16}: 20 + 20 + 16 = 56; {8, 16}: 80 + 80 + 8 = 168; {1, 16}: 10 + 160 + 16 = 186
    assert plan.sizes == (2, 16) and plan.padded_tokens == 56
    assert plan_capture_sizes(SMALL, max_size=16).sizes == (1, 2, 8, 16)


def test_measured_step_times_move_the_rungs() -> None:
    histogram = {1: 100, 8: 10, 64: 5}
    # Linear cost, padded tokens: {1, 64}: 100 + 15 * 64 = 1060; {8, 64}: 110 * 8 + 320 = 1200.
    assert plan_capture_sizes(histogram, max_sizes=2).sizes == (1, 64)
    # Step time flat up to 8 tokens (10 us), then linear to 24 us at 64:
    # {1, 64}: 100 * 10 + 15 * 24 = 1360; {8, 64}: 110 * 10 + 5 * 24 = 1220.
    times = {1: 10.0, 8: 10.0, 64: 24.0}
    plan = plan_capture_sizes(histogram, max_sizes=2, cost=times)
    assert plan.sizes == (8, 64) and plan.work == 1220.0
    # a callable gives the same answer
    curve = MeasuredCurve.from_mapping(times, "cost")
    assert plan_capture_sizes(histogram, max_sizes=2, cost=curve).sizes == (8, 64)


def test_measured_curve_interpolates_and_refuses_to_extrapolate() -> None:
    curve = MeasuredCurve.from_mapping({8: 10.0, 64: 24.0, 1: 10.0}, "cost")
    assert curve.points == ((1, 10.0), (8, 10.0), (64, 24.0))
    assert (curve(1), curve(4), curve(36), curve(64)) == (10.0, 10.0, 17.0, 24.0)
    with pytest.raises(ConfigError, match=r"cost: size 65 is outside the measured sizes 1\.\.64; "
                                          r"add a measurement at or beyond 65"):
        curve(65)
    with pytest.raises(ConfigError, match=r"memory: size 128 is outside"):
        plan_capture_sizes({128: 1}, memory={1: 6.0, 64: 7.0})


def test_linear_models() -> None:
    assert LinearStepCost()(10) == 26.0
    assert LinearStepCost(per_step=0.0, per_token=2.0)(10) == 20.0
    assert LinearGraphMemory()(128) == 7.0
    assert LinearGraphMemory(per_graph_mib=1.0, per_token_mib=0.5)(4) == 3.0


def test_default_ladder_is_the_configs() -> None:
    ladder = default_ladder()
    assert ladder == ff.CompilationConfig().cudagraph_capture_sizes
    assert ladder == (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
    assert len(ladder) == 51
    assert default_ladder(100) == (1, 2, 4, *range(8, 97, 8), 100)


def test_evaluate_ladder_counts_steps_above_it_as_uncovered() -> None:
    report = evaluate_ladder(SMALL, [4, 1, 2, 2])
    assert report.sizes == (1, 2, 4)
    # 8 is above the ladder: no graph, unpadded, 16 + 8 to run
    assert (report.padded_tokens, report.uncovered_steps, report.waste) == (38, 1, 0.0)
    assert report.work == 21 * 16 + 38
    default = evaluate_ladder(SMALL, default_ladder())
    # 1->1, 2->2, 8->8: the default ladder has every size of this histogram
    assert (default.padded_tokens, default.uncovered_steps) == (38, 0)
    assert len(default.memory_mib) == 51
    # 51 graphs of 6 MiB plus (sum of the sizes = 10503) / 128
    assert default.total_memory_mib == pytest.approx(51 * 6 + 10503 / 128, abs=1e-9)


def test_plan_feeds_back_into_the_config() -> None:
    plan = plan_capture_sizes({1: 5, 3: 7, 20: 2, 100: 1}, max_sizes=3)
    assert plan.config_dict() == {"cudagraph_capture_sizes": list(plan.sizes),
                                  "max_cudagraph_capture_size": 100}
    for cfg in (ff.CompilationConfig.from_dict(plan.config_dict()),
                ff.CompilationConfig.from_json(plan.to_json())):
        assert cfg.cudagraph_capture_sizes == plan.sizes
        assert cfg.max_cudagraph_capture_size == 100


@pytest.mark.parametrize(("histogram", "message"), [
    ([1, 2], r"histogram: expected a mapping of batch size -> step count, got list \[1, 2\]"),
    ({0: 3}, r"histogram: a batch size must be an int >= 1, got 0"),
    ({"3": 3}, r"histogram: a batch size must be an int >= 1, got '3'"),
    ({True: 3}, r"histogram: a batch size must be an int >= 1, got True"),
    ({2: -1}, r"histogram\[2\]: a step count must be an int >= 0, got -1"),
    ({2: 1.5}, r"histogram\[2\]: a step count must be an int >= 0, got 1\.5"),
    ({}, r"histogram: no step was observed \(\{\}\); give at least one size with a count >= 1"),
    ({4: 0}, r"histogram: no step was observed \(\{4: 0\}\)"),
])
def test_bad_histograms(histogram: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_capture_sizes(histogram)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match=r"max_sizes: a batch size must be an int >= 1, got 0"):
        plan_capture_sizes(SMALL, max_sizes=0)
    with pytest.raises(ConfigError, match=r"budget_mib: expected a finite number >= 0, got nan"):
        plan_capture_sizes(SMALL, budget_mib=math.nan)
    with pytest.raises(ConfigError, match=r"max_size: 4 is below the largest observed size 8; "
                                          r"every observed size needs a rung at or above it"):
        plan_capture_sizes(SMALL, max_size=4)
    with pytest.raises(ConfigError, match=r"budget_mib: 6\.0 MiB is below the estimated graph "
                                          r"memory of the largest size 8 alone \(6\.06 MiB\)"):
        plan_capture_sizes(SMALL, budget_mib=6.0)
    with pytest.raises(ConfigError, match=r"cost\(1\): expected a finite number >= 0, got -1"):
        plan_capture_sizes(SMALL, cost=lambda size: -1)
    with pytest.raises(ConfigError, match=r"memory\[2\]: expected a finite number >= 0, got 'x'"):
        plan_capture_sizes(SMALL, memory={2: "x"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"cost: expected a callable size -> value or a mapping"):
        plan_capture_sizes(SMALL, cost=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"sizes: expected a non-empty list of capture sizes"):
        evaluate_ladder(SMALL, [])
    with pytest.raises(ConfigError, match=r"sizes: a batch size must be an int >= 1, got -2"):
        evaluate_ladder(SMALL, [-2, 4])


def test_read_histogram() -> None:
    assert read_histogram('{"1": 120, "3": 40}') == {1: 120, 3: 40}
    assert read_histogram('{"histogram": {"8": 2}}') == {8: 2}
    with pytest.raises(ConfigError, match=r"h\.json: not valid JSON"):
        read_histogram("{1: 2}", "h.json")
    with pytest.raises(ConfigError, match=r"histogram: key 'a' is not a batch size"):
        read_histogram('{"a": 2}')
    with pytest.raises(ConfigError, match=r"histogram: key '08' is not a batch size written as "
                                          r"an int"):
        read_histogram('{"08": 2}')
    with pytest.raises(ConfigError, match=r"histogram: expected a JSON object of size -> step "
                                          r"count"):
        read_histogram("[1, 2]")


# -- properties ---------------------------------------------------------------------------------


def brute_force(histogram: dict[int, int], top: int, max_sizes: int | None,
                budget: float | None, cost: object, memory: object) -> float | None:
    """The least work over every ladder of observed sizes plus the top; None when none fits."""
    observed = sorted(s for s, c in histogram.items() if c)
    others = [s for s in observed if s != top]
    best = None
    for r in range(len(others) + 1):
        if max_sizes is not None and r + 1 > max_sizes:
            break
        for subset in itertools.combinations(others, r):
            report = evaluate_ladder(histogram, [*subset, top], cost=cost,  # type: ignore[arg-type]
                                     memory=memory)  # type: ignore[arg-type]
            if budget is not None and report.total_memory_mib > budget:
                continue
            if best is None or report.work < best:
                best = report.work
    return best


@st.composite
def cases(draw: st.DrawFn, most_sizes: int = 8,
          whole_costs: bool = False) -> dict[str, object]:
    sizes = draw(st.lists(st.integers(1, 64), min_size=1, max_size=most_sizes, unique=True))
    histogram = {s: draw(st.integers(0, 40)) for s in sizes}
    histogram[draw(st.sampled_from(sizes))] = draw(st.integers(1, 40))
    observed_top = max(s for s, c in histogram.items() if c)
    top = observed_top + draw(st.sampled_from([0, 0, 1, 7]))
    candidates = sorted({*(s for s, c in histogram.items() if c), top})
    cost = draw(st.one_of(
        st.none(),
        # measured times, not necessarily rising with size
        st.fixed_dictionaries({s: st.integers(0, 50) if whole_costs else st.floats(0.0, 50.0)
                               for s in candidates}),
    ))
    memory = draw(st.one_of(
        st.none(),
        st.fixed_dictionaries({s: st.floats(0.0, 20.0) for s in candidates}),
    ))
    memory_of = MeasuredCurve.from_mapping(memory, "memory") if memory else LinearGraphMemory()
    budget = draw(st.one_of(st.none(), st.floats(memory_of(top), memory_of(top) + 60.0)))
    return {"histogram": histogram, "max_size": None if top == observed_top else top,
            "max_sizes": draw(st.one_of(st.none(), st.integers(1, 4))), "budget_mib": budget,
            "cost": cost, "memory": memory, "top": top}


def check(case: dict[str, object]) -> CapturePlan:
    histogram, top = case["histogram"], case["top"]
    plan = plan_capture_sizes(histogram, max_sizes=case["max_sizes"],  # type: ignore[arg-type]
                              budget_mib=case["budget_mib"], cost=case["cost"],  # type: ignore
                              memory=case["memory"], max_size=case["max_size"])  # type: ignore
    assert plan.sizes[-1] == top
    assert list(plan.sizes) == sorted(set(plan.sizes))
    assert set(plan.sizes) <= {*histogram, top}  # type: ignore[misc]
    if case["max_sizes"] is not None:
        assert len(plan.sizes) <= case["max_sizes"]  # type: ignore[operator]
    if case["budget_mib"] is not None:
        assert plan.total_memory_mib <= case["budget_mib"]  # type: ignore[operator]
    assert plan.uncovered_steps == 0
    for size, count in histogram.items():  # type: ignore[attr-defined]
        assert not count or any(rung >= size for rung in plan.sizes)
    # the plan's own figures are what scoring its ladder gives
    assert plan == evaluate_ladder(histogram, plan.sizes, cost=case["cost"],  # type: ignore
                                   memory=case["memory"])  # type: ignore[arg-type]
    best = brute_force(histogram, top, case["max_sizes"], case["budget_mib"],  # type: ignore
                       case["cost"], case["memory"])
    assert best is not None and plan.work == pytest.approx(best, rel=1e-12, abs=1e-9)
    return plan


@settings(max_examples=300, deadline=None)
@given(cases())
def test_plan_is_within_budget_covers_every_size_and_is_optimal(case: dict[str, object]) -> None:
    check(case)


@settings(max_examples=40, deadline=None)
@given(cases(most_sizes=13))
def test_plan_is_optimal_on_larger_cases(case: dict[str, object]) -> None:
    check(case)


@settings(max_examples=100, deadline=None)
@given(cases(whole_costs=True))
def test_plans_of_equal_work_prefer_fewer_sizes(case: dict[str, object]) -> None:
    # whole-number step costs, so that equal work is equal to the last bit
    plan = check(case)
    if len(plan.sizes) > 1:
        fewer = plan_capture_sizes(
            case["histogram"], max_sizes=len(plan.sizes) - 1,  # type: ignore[arg-type]
            budget_mib=case["budget_mib"], cost=case["cost"],  # type: ignore[arg-type]
            memory=case["memory"], max_size=case["max_size"])  # type: ignore[arg-type]
        assert fewer.work > plan.work


# -- large histograms ---------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "histogram_decode.json"


def least_work(histogram: dict[int, int], cost: Callable[[int], float],
               max_sizes: int | None) -> float:
    """The least work of any ladder of observed sizes ending at the largest, with at most
    ``max_sizes`` sizes: the plain quadratic dynamic program, written out independently."""
    sizes = sorted(s for s, c in histogram.items() if c)
    price = [cost(s) for s in sizes]
    steps = [0]
    for s in sizes:
        steps.append(steps[-1] + histogram[s])
    n = len(sizes)
    if max_sizes is None:
        best: list[float] = []
        for r in range(n):
            best.append(min([price[r] * steps[r + 1]]
                            + [best[j] + price[r] * (steps[r + 1] - steps[j + 1])
                               for j in range(r)]))
        return best[-1]
    layer = [price[r] * steps[r + 1] for r in range(n)]
    answer = layer[-1]
    for _ in range(max_sizes - 1):
        layer = [min((layer[j] + price[r] * (steps[r + 1] - steps[j + 1]) for j in range(r)),
                     default=math.inf) for r in range(n)]
        answer = min(answer, layer[-1])
    return answer


def large_histogram(n: int, seed: int, spread: int = 4) -> dict[int, int]:
    rng = random.Random(seed)
    return {s: rng.randint(0, 50) for s in rng.sample(range(1, spread * n), n)}


@pytest.mark.parametrize("max_sizes", [None, 12])
@pytest.mark.parametrize("measured", [False, True])
def test_large_histograms_are_planned_exactly_without_a_budget(max_sizes: int | None,
                                                              measured: bool) -> None:
    # 300 sizes, above EXACT_SEARCH_MAX: the lower-envelope program, checked against the plain
    # one; measured step times that fall and rise again as the size grows, or the default
    histogram = large_histogram(300, seed=1)
    observed = sorted(s for s, c in histogram.items() if c)
    assert len(observed) > planning_search.EXACT_SEARCH_MAX
    rng = random.Random(2)
    cost = ({s: rng.uniform(1.0, 400.0) for s in (1, *observed[::7], observed[-1])} if measured
            else None)
    curve = MeasuredCurve.from_mapping(cost, "cost") if cost else LinearStepCost()
    plan = plan_capture_sizes(histogram, max_sizes=max_sizes, cost=cost)
    assert plan.work == pytest.approx(least_work(histogram, curve, max_sizes), rel=1e-12)
    assert plan == evaluate_ladder(histogram, plan.sizes, cost=cost)
    assert plan.sizes[-1] == observed[-1] and plan.uncovered_steps == 0
    if max_sizes is None and not measured:
        assert plan.sizes == tuple(observed)  # rising step cost: every size, no padding
    if max_sizes is not None:
        assert len(plan.sizes) == max_sizes


def test_large_histograms_drop_rungs_that_save_no_work() -> None:
    # a step time flat up to 32 tokens: padding 1..31 up to 32 is free, so no size below 32
    # is captured, and every size above it is (the step time rises there)
    histogram = {s: 1 for s in range(1, 301)}
    plan = plan_capture_sizes(histogram, cost={1: 10.0, 32: 10.0, 300: 278.0})
    assert plan.sizes == tuple(range(32, 301))
    assert plan_capture_sizes(histogram, cost={1: 5.0, 300: 5.0}).sizes == (300,)


def test_the_example_histogram_gets_the_exact_plan() -> None:
    # 236 distinct sizes: a budget that binds takes the approximate search, which finds the
    # exact search's plan here (the plan docs/results/cpu-2026-11-25.md shows)
    histogram = read_histogram(EXAMPLE.read_text())
    assert len(histogram) > planning_search.EXACT_SEARCH_MAX
    plan = plan_capture_sizes(histogram, budget_mib=128)
    with mock.patch.object(planning_search, "EXACT_SEARCH_MAX", 10**9):
        exact = plan_capture_sizes(histogram, budget_mib=128)
    assert plan == exact
    assert plan.sizes == (9, 12, 19, 60, 69, 75, 80, 85, 90, 94, 102, 122, 177, 194, 202, 209,
                          218, 240)
    assert plan_capture_sizes(histogram, max_sizes=16).sizes == (
        9, 12, 19, 60, 70, 76, 82, 88, 93, 102, 122, 177, 195, 205, 217, 240)


@pytest.mark.parametrize(("seed", "budget", "extra"), [
    (3, 128.0, 550.0),  # 1117446 against the exact 1116896: 0.049% more
    (4, 64.0, 0.0),
    (5, 300.0, 49.0),  # 1034500 against 1034451: 0.0047% more
])
def test_the_approximate_search_against_the_exact_one(seed: int, budget: float,
                                                      extra: float) -> None:
    """160 sizes: above EXACT_SEARCH_MAX, and few enough for the exact search to answer too.
    The approximate plan fits and covers, and its work is the exact plan's, or a little more
    (pinned, so that a change to the search shows)."""
    histogram = large_histogram(160, seed, spread=3)
    plan = plan_capture_sizes(histogram, budget_mib=budget)
    with mock.patch.object(planning_search, "EXACT_SEARCH_MAX", 10**9):
        exact = plan_capture_sizes(histogram, budget_mib=budget)
    assert plan.total_memory_mib <= budget and plan.uncovered_steps == 0
    assert plan == evaluate_ladder(histogram, plan.sizes)
    assert plan.work - exact.work == extra
    assert plan.work <= exact.work * 1.001


def test_thousands_of_sizes_under_a_budget() -> None:
    # 4,096 distinct sizes: the exact search did not finish on these; the plan fits, covers
    # every size, and costs no less than the best plan without a budget
    histogram = large_histogram(4096, seed=6, spread=2)
    plan = plan_capture_sizes(histogram, budget_mib=512.0, max_size=8192)
    assert plan.sizes[-1] == 8192 and plan.uncovered_steps == 0
    assert plan.total_memory_mib <= 512.0
    assert plan == evaluate_ladder(histogram, plan.sizes)
    free = plan_capture_sizes(histogram, max_size=8192)
    assert plan.work >= free.work and len(plan.sizes) < len(free.sizes)
    with_limit = plan_capture_sizes(histogram, budget_mib=512.0, max_sizes=8, max_size=8192)
    assert len(with_limit.sizes) <= 8 and with_limit.total_memory_mib <= 512.0


@settings(max_examples=150, deadline=None)
@given(cases(), st.sampled_from([0, 5]))
def test_the_large_histogram_searches_on_small_cases(case: dict[str, object],
                                                     threshold: int) -> None:
    """The searches for large histograms, made to run on every case: exact without a budget
    that binds; with one, a plan within both limits that no plan beats by brute force."""
    kwargs = {"max_sizes": case["max_sizes"], "cost": case["cost"], "memory": case["memory"],
              "max_size": case["max_size"]}
    with mock.patch.object(planning_search, "EXACT_SEARCH_MAX", threshold):
        plan = plan_capture_sizes(case["histogram"], budget_mib=case["budget_mib"],  # type: ignore
                                  **kwargs)  # type: ignore[arg-type]
        free = plan_capture_sizes(case["histogram"], **kwargs)  # type: ignore[arg-type]
    histogram, top, budget = case["histogram"], case["top"], case["budget_mib"]
    assert plan.sizes[-1] == top and plan.uncovered_steps == 0
    assert plan == evaluate_ladder(histogram, plan.sizes, cost=case["cost"],  # type: ignore
                                   memory=case["memory"])  # type: ignore[arg-type]
    if case["max_sizes"] is not None:
        assert len(plan.sizes) <= case["max_sizes"]  # type: ignore[operator]
    best_free = brute_force(histogram, top, case["max_sizes"], None,  # type: ignore[arg-type]
                            case["cost"], case["memory"])
    assert free.work == pytest.approx(best_free, rel=1e-12, abs=1e-9)
    best = brute_force(histogram, top, case["max_sizes"], budget,  # type: ignore[arg-type]
                       case["cost"], case["memory"])
    assert best is not None
    if budget is None or free.total_memory_mib <= budget:  # type: ignore[operator]
        assert plan.work == pytest.approx(best, rel=1e-12, abs=1e-9)
    else:
        assert plan.total_memory_mib <= budget  # type: ignore[operator]
        assert plan.work >= best - 1e-9 * abs(best)
