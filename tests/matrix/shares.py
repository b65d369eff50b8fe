"""What the matrix's calls did, in shares: how many were compared with eager and how many
refused, per path and per configuration; how many runner steps ran from their plan; how many
calls replayed a graph. The refusal floor (test_matrix.py) holds on these numbers, and
``python -m tests.matrix.shares [TIER] [SEEDS] [START]`` prints them as the tables committed in
docs/results/ (the cases run without shrinking and without the after-case health check).
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

from tests.matrix.cases import RUNNER_VIAS, Case, generate
from tests.matrix.harness import CallRecord, Failure, Outcome, execute


@dataclasses.dataclass
class Tally:
    """Counts of one group of calls."""

    calls: int = 0
    refused: int = 0
    graph: int = 0  # a graph was due
    replayed: int = 0
    runner_steps: int = 0  # compared runner steps
    planned: int = 0

    def add(self, record: CallRecord) -> None:
        self.calls += 1
        if record.refused:
            self.refused += 1
            return
        self.graph += record.graph
        self.replayed += record.replayed
        if record.via in RUNNER_VIAS:
            self.runner_steps += 1
            self.planned += record.planned

    @property
    def compared(self) -> int:
        return self.calls - self.refused

    def share(self, part: int, whole: int | None = None) -> float:
        whole = self.calls if whole is None else whole
        return part / whole if whole else 0.0


Group = Callable[[Case, CallRecord], str]

GROUPS: dict[str, Group] = {
    "path": lambda case, rec: case.path,
    "path / way": lambda case, rec: f"{case.path} / {rec.via}",
    "compile mode": lambda case, rec: case.mode,
    "cudagraph_mode": lambda case, rec: case.graph_mode,
    "path / cudagraph_mode": lambda case, rec: f"{case.path} / {case.graph_mode}",
}


def tallies(results: Iterable[tuple[Case, Outcome]], group: Group) -> dict[str, Tally]:
    out: dict[str, Tally] = collections.defaultdict(Tally)
    for case, outcome in results:
        for record in outcome.records:
            out[group(case, record)].add(record)
    return dict(sorted(out.items()))


def case_shares(results: Iterable[tuple[Case, Outcome]]) -> dict[str, tuple[int, int]]:
    """(cases with at least one such call, cases) for: runner cases with a planned step,
    runner and context cases with a replay."""
    counts = {"runner cases with a planned step": [0, 0],
              "runner cases with a replayed graph": [0, 0],
              "context cases with a replayed graph": [0, 0]}
    for case, outcome in results:
        compared = [r for r in outcome.records if not r.refused]
        if case.path == "runner":
            counts["runner cases with a planned step"][1] += 1
            counts["runner cases with a planned step"][0] += any(r.planned for r in compared)
            counts["runner cases with a replayed graph"][1] += 1
            counts["runner cases with a replayed graph"][0] += any(r.replayed for r in compared)
        if case.path == "context":
            counts["context cases with a replayed graph"][1] += 1
            counts["context cases with a replayed graph"][0] += any(r.replayed for r in compared)
    return {k: (v[0], v[1]) for k, v in counts.items()}


def markdown(results: list[tuple[Case, Outcome]]) -> str:
    lines = []
    for name, group in GROUPS.items():
        lines += ["", f"| {name} | calls | compared | refused | graph due | replayed | "
                      "planned (of runner steps) |", "|---|---|---|---|---|---|---|"]
        for key, t in tallies(results, group).items():
            planned = f"{t.planned}/{t.runner_steps}" if t.runner_steps else "-"
            lines.append(f"| {key} | {t.calls} | {t.share(t.compared):.0%} | "
                         f"{t.share(t.refused):.0%} | {t.share(t.graph, t.compared):.0%} | "
                         f"{t.share(t.replayed, t.compared):.0%} | {planned} |")
    reasons = collections.Counter(r.accepted_as for _, o in results for r in o.records
                                  if r.refused)
    wrong = {r.accepted_as: r.wrong_for_user for _, o in results for r in o.records
             if r.wrong_for_user}
    total = sum(len(o.records) for _, o in results)
    lines += ["", "| refused as (tests/matrix/refusals.py) | calls | share of all calls | "
                  "wrong for a user (its OPEN case) |", "|---|---|---|---|"]
    for name, n in reasons.most_common():
        lines.append(f"| {name} | {n} | {n / total:.1%} | {wrong.get(name, '') or '-'} |")
    lines += ["", "| cases | share |", "|---|---|"]
    for key, (n, of) in case_shares(results).items():
        lines.append(f"| {key} | {n}/{of} |")
    return "\n".join(lines)


def run_seeds(tier: str, seeds: Iterable[int]) -> tuple[list[tuple[Case, Outcome]],
                                                       list[tuple[int, str]]]:
    results, failures = [], []
    for seed in seeds:
        case = generate(seed, tier)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                results.append((case, execute(case, f"{tmp}/cache" if case.warm else None)))
            except Failure as failure:
                failures.append((seed, str(failure).splitlines()[0][:200]))
    return results, failures


if __name__ == "__main__":  # python -m tests.matrix.shares [TIER] [SEEDS] [START]
    import os

    os.environ.pop("FREEZEFRAME_DISABLE_CACHE", None)
    _args = [a for a in sys.argv[1:] if not a.startswith("--")]
    _tier = _args[0] if _args else "fast"
    _count = int(_args[1]) if len(_args) > 1 else 88
    _start = int(_args[2]) if len(_args) > 2 else 0
    _began = time.monotonic()
    _results, _failures = run_seeds(_tier, range(_start, _start + _count))
    print(f"tier {_tier}, seeds {_start}..{_start + _count - 1}: {len(_results)} cases ran, "
          f"{len(_failures)} failed ({time.monotonic() - _began:.0f} s)")
    for _seed, _why in _failures:
        print(f"  seed {_seed} failed: {_why}")
    print(markdown(_results))
    if "--refusals" in sys.argv:
        for _case, _outcome in _results:
            for _rec in _outcome.records:
                if _rec.refused:
                    print(f"REFUSAL seed {_case.seed} {_case.path}/{_rec.via} {_case.mode} "
                          f"{_case.graph_mode}: {_rec.refused[:240]!r}")
