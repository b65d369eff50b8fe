"""Time of the capture-size planner on histograms of many distinct sizes, beside the exact
search it used for every histogram before.

    python scripts/bench_planner.py [--sizes 1000 4096 10000] [--old-limit 120] [--only-new]

Each histogram has every size from 1 to N (N distinct sizes) with a seeded random step count
(1..1000) per size, and the default cost and memory models. For each N and each case
(``budget_mib=128``, the case the issue timed; ``budget_mib=1024``, where a few dozen sizes fit;
``max_sizes=16``, no budget) it prints:

  new        the planner's time, best of 3, in CPU seconds of this process
  old        the search it replaced: ``freezeframe.planning_search`` with ``EXACT_SEARCH_MAX``
             raised above N, which is the old code path for every size (the quadratic program,
             and for a budget that binds the exact Pareto search), in a child process stopped
             after ``--old-limit`` seconds of wall time
  sizes      how many sizes the new plan captures
  vs exact   how much more work the new plan has than the old one's (exact) plan, where the
             old search finished; 0 is the same work

Then, for the approximation alone (a budget that binds on more than ``EXACT_SEARCH_MAX``
distinct sizes), ``--quality`` seeded histograms small enough for the exact search (130 to 260
sizes spread over 1x to 8x their number, 0-50 steps each, budgets of 64 to 400 MiB): in how many
the plan is the exact one, and the most extra work.

A benchmark script, not a test: the figures move with the machine, so compare rows of one run.
Runs from the repository root without PYTHONPATH (this checkout's ``src`` goes first).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from freezeframe import planning, planning_search  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "budget_mib=128": {"budget_mib": 128.0},
    "budget_mib=1024": {"budget_mib": 1024.0},
    "max_sizes=16": {"max_sizes": 16},
}


def histogram(n: int, seed: int = 0) -> dict[int, int]:
    rng = random.Random(seed)
    return {size: rng.randint(1, 1000) for size in range(1, n + 1)}


def plan(n: int, case: str, exact: bool) -> tuple[float, planning.CapturePlan]:
    """CPU seconds of one plan, and the plan."""
    hist = histogram(n)
    if exact:
        planning_search.EXACT_SEARCH_MAX = 10**9
    start = time.process_time()
    result = planning.plan_capture_sizes(hist, **CASES[case])
    return time.process_time() - start, result


def quality_case(seed: int) -> tuple[dict[int, int], float]:
    rng = random.Random(seed)
    n = rng.randint(130, 260)
    spread = rng.choice([1, 2, 4, 8])
    hist = {size: rng.randint(0, 50) for size in rng.sample(range(1, spread * n + 1), n)}
    hist[max(hist)] = max(hist[max(hist)], 1)
    return hist, rng.choice([64.0, 128.0, 256.0, 400.0])


def quality(cases: int) -> None:
    same, worst, exact_s = 0, 0.0, 0.0
    for seed in range(cases):
        hist, budget = quality_case(seed)
        planning_search.EXACT_SEARCH_MAX = 128
        approximate = planning.plan_capture_sizes(hist, budget_mib=budget)
        planning_search.EXACT_SEARCH_MAX = 10**9
        start = time.process_time()
        exact = planning.plan_capture_sizes(hist, budget_mib=budget)
        exact_s += time.process_time() - start
        extra = (approximate.work - exact.work) / exact.work
        same += extra <= 1e-12
        worst = max(worst, extra)
    planning_search.EXACT_SEARCH_MAX = 128
    print(f"approximate search on {cases} histograms of 130-260 sizes: the exact plan's work in "
          f"{same}, at most {worst:+.4%} more work (the exact search took {exact_s:.1f} s in all)")


def old_in_child(n: int, case: str, limit: float) -> dict[str, float] | None:
    """The old search's time and work, from a child process; None when it ran out of time."""
    try:
        done = subprocess.run([sys.executable, __file__, "--child", str(n), case],
                              capture_output=True, text=True, timeout=limit, check=True)
    except subprocess.TimeoutExpired:
        return None
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 4096, 10000])
    parser.add_argument("--old-limit", type=float, default=120.0,
                        help="seconds the old search may run per row (default 120)")
    parser.add_argument("--only-new", action="store_true", help="do not run the old search")
    parser.add_argument("--quality", type=int, default=40,
                        help="histograms to compare with the exact search (default 40; 0: none)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        seconds, result = plan(int(args.child[0]), args.child[1], exact=True)
        print(json.dumps({"seconds": seconds, "work": result.work}))
        return
    print(f"capture-size planner: new search against the old exact search "
          f"(EXACT_SEARCH_MAX = {planning_search.EXACT_SEARCH_MAX}); CPU seconds")
    print(f"{'case':<17}{'sizes N':>8}{'new (s)':>10}{'old (s)':>18}{'plan sizes':>12}"
          f"{'vs exact':>12}")
    for case in CASES:
        for n in args.sizes:
            seconds, result = min((plan(n, case, exact=False) for _ in range(3)),
                                  key=lambda timed: timed[0])
            old = None if args.only_new else old_in_child(n, case, args.old_limit)
            if args.only_new:
                old_text, versus = "not run", "-"
            elif old is None:
                old_text, versus = f"> {args.old_limit:.0f} (stopped)", "-"
            else:
                old_text = f"{old['seconds']:.3f}"
                versus = f"{(result.work - old['work']) / old['work']:+.4%}"
            print(f"{case:<17}{n:>8}{seconds:>10.3f}{old_text:>18}{len(result.sizes):>12}"
                  f"{versus:>12}", flush=True)
    if args.quality and not args.only_new:
        quality(args.quality)


if __name__ == "__main__":
    main()
