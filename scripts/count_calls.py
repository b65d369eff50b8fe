"""Count freezeframe's own Python calls (and module switches) in a step or a first call.

    python scripts/count_calls.py                      # every scenario, one line each
    python scripts/count_calls.py full-step --calls    # one scenario, every call listed

Runs from the repository root without PYTHONPATH: this checkout's ``src`` and the repository
root (for ``tests.helpers``) go first on ``sys.path``. ``--src DIR`` counts another
checkout's freezeframe (its ``src`` directory) with this script's scenarios.

What is counted (``tests/helpers/call_count.py``): every call of a Python function of
freezeframe's own (its package, or code it generated), not the emulated graph backend's replay
of recorded ops nor the model's code; a module switch is a counted call into another module
than its counted caller's. The scenarios use ``freezeframe.models.example.ExampleMLP``
(2 layers: 3 capturable pieces), the eager compiler, no compile cache, emulated graphs:

  first-call            the first call of ff.compile(ExampleMLP()): trace, split, compile
  full-step             a planned FULL step of a captured GraphRunner (3 tokens padded to 4)
  piecewise-step        a planned PIECEWISE step (3 pieces, 2 splitting-op calls)
  first-full-step       the first step of that shape, FULL (it plans)
  first-piecewise-step  the first step of that shape, PIECEWISE (it plans)

``tests/unit/test_call_counts.py`` holds the planned steps' counts exactly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", help="scenario names (default: all)")
    parser.add_argument("--calls", action="store_true", help="list every counted call")
    parser.add_argument("--src", type=Path, default=REPO / "src",
                        help="the src directory of the freezeframe to count (default: this "
                             "checkout's)")
    args = parser.parse_args()
    sys.path[:0] = [str(args.src.resolve()), str(REPO)]
    from tests.helpers.call_count import SCENARIOS, scenario

    names = args.scenarios or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    for name in names:
        counted = scenario(name)
        print(f"{name:<22} {len(counted.calls):5d} calls  {counted.switches:5d} module switches"
              f"  {len(counted.modules):3d} modules")
        if args.calls:
            print(counted.table())


if __name__ == "__main__":
    main()
