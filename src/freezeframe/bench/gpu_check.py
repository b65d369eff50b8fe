"""``scripts/gpu_check``: one command that checks every GPU claim and writes what it found.

Steps, in order of value (each timed, each passed, failed or skipped with a reason; their
deadlines and where they come from are in ``gpu_steps``):

1. ``environment`` - Python, torch, triton, transformers, GPU name/memory/driver/CUDA, the C
   compiler and Python headers Triton builds its launchers with, freezeframe; fails when
   something the project needs is missing (optional extras only degrade).
2. ``kernels`` - the Triton attention kernel's tests (on the GPU where there is one).
3. ``splitkv`` - the Triton attention op alone at the 1B preset's decode shapes, split-KV off
   and on side by side at batch 1/4/16/64 x context 128/1024/4096, and the count ``"auto"``
   chose (``splitkv_probe``; on a CPU, in a dry run only, the tiny preset in Triton's
   interpreter).
4. ``bench`` - the bench core, ``freezeframe bench``: on CUDA the 1B preset, bf16, eager, every
   freezeframe graph mode through the runner's planned path, ``torch.compile(mode=
   "reduce-overhead")`` at the steps its comparison needs, decode at contexts 128/1024/4096 x
   batch 1/4/16/64, the capture of the default ladder with the graph pool predicted and
   measured, the profiler table of one FULL decode replay, host time per step, and the Hugging
   Face rows (``ff.hf`` against HF's ``generate``); the tiny preset on CPU.
5. ``tests`` - the ``cuda`` test tier on CUDA (``pytest -m cuda tests/cuda tests/scenarios``,
   on xdist workers where installed); the emulated tier on CPU (and on CUDA with
   ``--emulated-tier``).
6. ``ubatch`` - a micro-batched step captured as one FULL graph: replays timed against the
   unsplit model, and the overlap read from a profiler trace of the replays (CUDA only).
7. ``cache`` - a warm start of the bench's 1B mode from freezeframe's compile cache in a fresh
   process (Inductor's own cache empty), against the bench's cold compile (CUDA only).

Every step except ``environment``'s probe runs in child processes with a deadline, so a crash
or a hang in one is a failed step, not a lost run; each writes into a work directory as it
goes (a probe after each measurement, the bench after each timed row, pytest verbosely into
its log). After every step, and when the run is stopped (SIGTERM or SIGINT: ``timeout``
wrapping the command), the report and the return files are written to ``--out`` (default
``docs/results/<gpu-or-cpu>-<date>/``): at most 8 files, two folders deep at most
(``gpu_pack``), checked against those limits. The exit status is 1 when any step failed or
the layout breaks the limits, 0 otherwise (2 for a bad argument).

On a CUDA machine the run is held to ``--budget-s`` (default 480 s): each step gets its own
deadline plus what the steps before it left unused, never what the steps after it need.
``--dry-run`` rehearses the GPU run on the CPU: every step, at the tiniest shapes and on the
emulated graph backend (the test tiers' commands written, not run), writes every file and
checks the layout; it prints the GPU plan (each step and its deadline) and ends with
``plan: N s of deadlines``, failing when N exceeds the budget. CI runs it.

This module runs the steps in order and is the command line; each step is in ``gpu_steps``,
the run state in ``gpu_run``, the report in ``gpu_report`` and the return files in
``gpu_pack``. These import only the standard library (and freezeframe, which imports no
torch), so they can report a missing or broken torch instead of crashing on it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from freezeframe.bench.gpu_pack import check_layout, pack
from freezeframe.bench.gpu_report import write_report
from freezeframe.bench.gpu_run import ROOT, CheckOptions, CheckRun, StepResult, Stopped
from freezeframe.bench.gpu_steps import (
    CUDA_BUDGET_S,
    DEADLINES,
    GPU_ONLY,
    MIN_STEP_S,
    NEEDS_CUDA,
    STEP_FUNCS,
    STEPS,
    step_deadline,
    step_environment,
)

__all__ = ["main", "plan_lines", "run_check"]


def _default_out(run: CheckRun) -> Path:
    gpu = run.env_info.get("gpu")
    name = "cpu"
    if gpu:
        words = re.sub(r"[^a-z0-9]+", "-", gpu["name"].lower()).strip("-").split("-")
        name = "-".join(w for w in words if w != "nvidia") or "gpu"
    return ROOT / "docs" / "results" / f"{name}-{datetime.date.today().isoformat()}"


def plan_lines(opts: CheckOptions) -> tuple[list[str], float]:
    """The GPU plan: a line per step with its deadline and where it comes from, the last
    ``plan: N s of deadlines``; and N (the steps ``--skip`` leaves out count nothing)."""
    lines, total = [], 0.0
    for name in STEPS:
        if name in opts.skip:
            lines.append(f"  {name:<12} skipped")
            continue
        seconds = step_deadline(name, True, opts.timeouts)
        total += seconds
        lines.append(f"  {name:<12} {seconds:>5.0f} s  ({DEADLINES[name].basis})")
    return [*lines, f"plan: {total:.0f} s of deadlines"], total


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`Stopped` in the main thread while the run goes on."""
    def stop(signum: int, _frame: Any) -> None:
        raise Stopped(signal.Signals(signum).name)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Console:
    """What the run prints, kept for ``console.log``."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self.echo(line)


def run_check(opts: CheckOptions, python: str = sys.executable,
              echo: Callable[[str], None] = print) -> tuple[int, Path]:
    """Run every step ``opts`` selects; returns (exit status, out dir)."""
    run = CheckRun(opts, python)
    say = _Console(echo)
    results: list[StepResult] = []
    try:
        with _stop_on_signals():
            return _run(run, results, say)
    finally:
        shutil.rmtree(run.work, ignore_errors=True)


def _run(run: CheckRun, results: list[StepResult], say: _Console) -> tuple[int, Path]:
    opts = run.opts
    plan, total = plan_lines(opts)
    stopped = ""
    try:
        say(f"gpu_check: [1/{len(STEPS)}] environment")
        results.append(step_environment(run))
        run.out = opts.out.resolve() if opts.out is not None else _default_out(run)
        run.out.mkdir(parents=True, exist_ok=True)
        run.budget_s = opts.budget_s if opts.budget_s is not None else (
            CUDA_BUDGET_S if run.cuda and not run.dry else 0.0)
        say(f"gpu_check:   {results[0].status}: {results[0].summary or results[0].reason}")
        say("gpu_check: the GPU plan" + (" (rehearsed on the CPU)" if run.dry else "") + ":")
        for line in plan:
            say(line)
        _write(run, results, say)
        for index, name in enumerate(STEPS[1:], start=2):
            result = StepResult(name)
            results.append(result)
            say(f"gpu_check: [{index}/{len(STEPS)}] {name}")
            _run_step(run, result)
            say(f"gpu_check:   {result.status} ({result.seconds:.1f} s): "
                f"{result.reason or result.summary}")
            _write(run, results, say)  # after every step: a run cut short keeps it
    except Stopped as exc:
        stopped = str(exc)
        if not results:  # stopped in the environment step: report that much
            results.append(StepResult("environment"))
            run.out = opts.out.resolve() if opts.out is not None else _default_out(run)
            run.out.mkdir(parents=True, exist_ok=True)
        if results[-1].status != "failed":
            results[-1].fail(f"stopped by {stopped} (the run's time was up)")
        say(f"gpu_check: stopped by {stopped}; writing what was measured")
    problems = _write(run, results, say)
    failed = [r.name for r in results if r.status == "failed"]
    over = run.dry and total > CUDA_BUDGET_S
    say(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}"
        f" in {run.elapsed():.0f} s; wrote {run.out}")
    say(f"layout: {'; '.join(problems) if problems else 'within the return limits'}")
    if over:
        say(f"gpu_check: the plan's deadlines add up to more than the {CUDA_BUDGET_S:.0f} s "
            "budget")
    say(plan[-1])
    _write(run, results, say)  # console.log with the lines above
    return (1 if failed or problems or over or stopped else 0), run.out


def _write(run: CheckRun, results: Sequence[StepResult], say: _Console) -> list[str]:
    """The report and the return files in ``--out``; what breaks the return limits."""
    if run.out == Path():
        return []
    write_report(run, results)
    left_out = pack(run.raw, run.out, run.raw / "bench" / "results.json", say.lines)
    if left_out:
        run.env_info.setdefault("left_out_of_raw", left_out)
    return check_layout(run.out)


def _deadline(run: CheckRun, name: str) -> float | None:
    """Seconds this step may take: without a budget its own deadline; with one, what is left
    of the budget less the deadlines of the steps after it: its own plus what the earlier
    steps left unused (their deadlines add up to the budget). None when too little is left."""
    own = step_deadline(name, run.cuda and not run.dry, run.opts.timeouts)
    if not run.budget_s:
        return own
    later = STEPS[STEPS.index(name) + 1:]
    reserved = sum(step_deadline(s, True, run.opts.timeouts) for s in later
                   if s not in run.opts.skip and not (s in GPU_ONLY and not run.cuda))
    left = run.budget_s - run.elapsed() - reserved
    return None if left < MIN_STEP_S else left


def _run_step(run: CheckRun, result: StepResult) -> None:
    """Run the step ``result`` is for, or skip it (``--skip``, or it needs CUDA), or fail it
    without running when the budget is spent."""
    name = result.name
    if name in run.opts.skip:
        result.status, result.reason = "skipped", "skipped with --skip"
        return
    if name in GPU_ONLY and not run.cuda and not run.dry:
        result.status, result.reason = "skipped", NEEDS_CUDA
        return
    timeout = _deadline(run, name)
    if timeout is None:
        result.fail(f"not run: the {run.budget_s:.0f} s budget was spent "
                    "(raise --budget-s or --skip a step)")
        return
    result.deadline_s = round(timeout, 1)
    t0 = time.perf_counter()
    try:
        STEP_FUNCS[name](run, result, timeout)
    except Exception as exc:  # a bug in this script must not lose the others
        result.fail(f"gpu_check itself raised {type(exc).__name__}: {exc}")
    finally:
        result.seconds = time.perf_counter() - t0


# -- command line -----------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/gpu_check",
        description="Check freezeframe's GPU claims on this machine (what can run without a "
                    "GPU runs on CPU) and write the results to --out.")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory: the few files that come back from a GPU machine "
                        "(default docs/results/<gpu-or-cpu>-<date>/)")
    p.add_argument("--dry-run", action="store_true",
                   help="rehearse the GPU run on the CPU: every step at the tiniest shapes on "
                        "emulated graphs, every file written, the layout checked; prints the "
                        "GPU plan and fails when its deadlines exceed the budget")
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
                   help="on CUDA, the bench also times torch.compile's default mode on every "
                        "row (a full Inductor compile more: raise --budget-s)")
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
            steps=STEPS, out=args.out, quick=args.quick, dry_run=args.dry_run,
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
