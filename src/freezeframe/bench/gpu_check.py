"""``scripts/gpu_check``: one command that checks every GPU claim and writes what it found.

Steps, in order (each timed; each passed, failed or skipped with a reason). The GPU-only
evidence comes first, so that what a short GPU lease can measure is measured before anything
that could also run elsewhere:

1. ``environment`` - Python, torch, triton, GPU name/memory/driver/CUDA, the C compiler and
   Python headers Triton builds its launchers with, freezeframe; fails when something the
   project needs is missing (optional extras only degrade).
2. ``tests`` - on CUDA the ``cuda`` test tier (``pytest -m cuda tests/cuda tests/scenarios``)
   and the ``kernels`` tier (the Triton attention kernel's tests, which run on the GPU there);
   the emulated tier (``tests/emulated tests/scenarios``) runs on CPU, and on CUDA only with
   ``--emulated-tier`` (CI runs it on every commit).
3. ``bench`` - ``freezeframe bench``: ``--preset 1b`` on CUDA (eager, piecewise and
   full_and_piecewise; ``--peers`` adds ``torch.compile`` and ``reduce-overhead``, which cost
   several full Inductor compiles), the tiny preset on CPU. The bench writes its results after
   every mode, so a bench stopped at its deadline still leaves the modes it finished.
4. ``capture`` - the capture report of the default ladder on the 1B preset (CUDA only): time
   and memory per graph and in total, replays checked against the uncompiled model.
5. ``ubatch`` - a dual-batch step's ``torch.profiler`` Chrome trace and overlap check (CUDA
   only).
6. ``cache`` - compile cache cold vs warm start with Inductor in fresh processes, outputs
   compared (``scripts/bench_cache.py``; the tiny preset, whose compile fits the budget).

Everything goes to ``--out`` (default ``docs/results/<gpu-or-cpu>-<date>/``): ``gpu_check.json``,
a ``README.md`` with the tables, each step's log and files; both are rewritten after every step,
so a run cut short keeps what it finished. The exit status is 1 when any step failed, 0
otherwise (2 for a bad argument). Every step except ``environment`` runs in child processes with
a deadline, so a crash or a hang in one is a failed step, not a lost run. On a CUDA machine the
whole run is held to ``--budget-s`` (default 480 s), and each step's own deadline is its share
of that budget (``TIMEOUTS``, which add up to it): a step never takes the time of the steps
after it, and one that would start after the budget is spent fails with that reason.

This module runs the steps in order and is the command line; each step is in ``gpu_steps``,
the report it writes in ``gpu_report``. These import only the standard library (and
freezeframe, which imports no torch), so they can report a missing or broken torch instead of
crashing on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from freezeframe.bench.gpu_report import write_report
from freezeframe.bench.gpu_steps import (
    CUDA_BUDGET_S,
    GPU_ONLY,
    NEEDS_CUDA,
    ROOT,
    STEP_FUNCS,
    STEPS,
    CheckOptions,
    CheckRun,
    StepResult,
    step_environment,
)

__all__ = ["main", "run_check"]


def _default_out(run: CheckRun) -> Path:
    gpu = run.env_info.get("gpu")
    name = "cpu"
    if gpu:
        words = re.sub(r"[^a-z0-9]+", "-", gpu["name"].lower()).strip("-").split("-")
        name = "-".join(w for w in words if w != "nvidia") or "gpu"
    return ROOT / "docs" / "results" / f"{name}-{datetime.date.today().isoformat()}"


def run_check(opts: CheckOptions, python: str = sys.executable,
              echo: Callable[[str], None] = print) -> tuple[int, Path]:
    """Run every step ``opts`` selects; returns (exit status, out dir)."""
    run = CheckRun(opts, python)
    try:
        echo(f"gpu_check: [1/{len(STEPS)}] environment")
        results = [step_environment(run)]
        run.out = opts.out.resolve() if opts.out is not None else _default_out(run)
        run.out.mkdir(parents=True, exist_ok=True)
        (run.out / "environment.json").write_text(json.dumps(run.env_info, indent=2))
        results[0].files.append("environment.json")
        run.budget_s = opts.budget_s if opts.budget_s is not None else (
            CUDA_BUDGET_S if run.cuda else 0.0)
        echo(f"gpu_check:   {results[0].status}: {results[0].summary or results[0].reason}")
        for index, name in enumerate(STEPS[1:], start=2):
            result = StepResult(name)
            results.append(result)
            echo(f"gpu_check: [{index}/{len(STEPS)}] {name}")
            _run_step(run, result)
            echo(f"gpu_check:   {result.status} ({result.seconds:.1f} s): "
                 f"{result.reason or result.summary}")
            write_report(run, results)  # after every step: a run cut short keeps it
        failed = [r.name for r in results if r.status == "failed"]
        write_report(run, results)
        echo(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}"
             f" in {run.elapsed():.0f} s; wrote {run.out}/README.md and gpu_check.json")
        return (1 if failed else 0), run.out
    finally:
        shutil.rmtree(run.work, ignore_errors=True)


def _run_step(run: CheckRun, result: StepResult) -> None:
    """Run the step ``result`` is for, or skip it (``--skip``, or it needs CUDA), or fail it
    without running when the budget is spent."""
    name = result.name
    if name in run.opts.skip:
        result.status, result.reason = "skipped", "skipped with --skip"
    elif name in GPU_ONLY and not run.cuda:
        result.status, result.reason = "skipped", NEEDS_CUDA
    else:
        timeout = run.deadline(name)
        if timeout is None:
            result.fail(f"not run: the {run.budget_s:.0f} s budget was spent "
                        "(raise --budget-s or --skip a step)")
        else:
            t0 = time.perf_counter()
            try:
                STEP_FUNCS[name](run, result, timeout)
            except Exception as exc:  # a bug in this script must not lose the others
                result.fail(f"gpu_check itself raised {type(exc).__name__}: {exc}")
            result.seconds = time.perf_counter() - t0


# -- command line -----------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/gpu_check",
        description="Check freezeframe's GPU claims on this machine (what can run without a "
                    "GPU runs on CPU) and write the results to --out.")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory (default docs/results/<gpu-or-cpu>-<date>/)")
    p.add_argument("--quick", action="store_true",
                   help="reduced mode: fewer bench modes and sizes, no inductor-marked tests")
    p.add_argument("--skip", action="append", default=[], metavar="STEP",
                   help=f"skip a step (repeat or comma-separate): {', '.join(STEPS[1:])}")
    p.add_argument("--emulated-tests", default="tests/emulated,tests/scenarios",
                   metavar="PATHS", help="comma-separated pytest paths of the emulated suite "
                                         "(default tests/emulated,tests/scenarios)")
    p.add_argument("--emulated-tier", action="store_true",
                   help="on CUDA, also run the emulated test tier (it always runs on CPU)")
    p.add_argument("--peers", action="store_true",
                   help="on CUDA, the bench also times torch.compile and reduce-overhead "
                        "(several full Inductor compiles: raise --budget-s)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"wall-time budget in seconds (default {CUDA_BUDGET_S:.0f} on CUDA, "
                        "none on CPU; 0: none)")
    p.add_argument("--timeout", action="append", default=[], metavar="STEP=SECONDS",
                   help="override one step's deadline")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    timeouts: dict[str, float] = {}
    for item in args.timeout:
        name, sep, value = item.partition("=")
        try:
            timeouts[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            parser.error(f"--timeout: expected STEP=SECONDS, got {item!r}")
    try:
        opts = CheckOptions(
            out=args.out, quick=args.quick,
            skip=frozenset(s.strip() for item in args.skip for s in item.split(",")
                           if s.strip()),
            emulated_tests=tuple(p.strip() for p in args.emulated_tests.split(",") if p.strip()),
            emulated_tier=args.emulated_tier, peers=args.peers,
            budget_s=args.budget_s, timeouts=timeouts)
    except ValueError as exc:
        parser.error(str(exc))
    return run_check(opts)[0]


if __name__ == "__main__":
    raise SystemExit(main())
