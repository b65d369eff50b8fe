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

This module imports only the standard library (and freezeframe, which imports no torch), so it
can report a missing or broken torch instead of crashing on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["STEPS", "CheckOptions", "StepResult", "cache_figures", "main", "pytest_summary",
           "run_check"]

ROOT = Path(__file__).resolve().parents[3]  # src/freezeframe/bench/gpu_check.py -> repo root
SRC = Path(__file__).resolve().parents[2]

STEPS = ("environment", "tests", "bench", "capture", "ubatch", "cache")
GPU_ONLY = frozenset({"capture", "ubatch"})
NEEDS_CUDA = "needs CUDA (torch.cuda.is_available() is False)"
NO_GPU_FIGURE = "**No GPU figure was produced**"
# per-step deadlines in seconds, (on CUDA, on CPU). On CUDA they are the steps' shares of
# CUDA_BUDGET_S and add up to it, so the default run fits its budget by construction.
TIMEOUTS: Mapping[str, tuple[float, float]] = {
    "environment": (20, 120), "tests": (110, 900), "bench": (170, 600),
    "capture": (80, 300), "ubatch": (40, 90), "cache": (60, 300),
}
CUDA_BUDGET_S = 480.0
CUDA_TESTS = ("tests/cuda", "tests/scenarios")  # where every cuda-marked test lives
# unmarked tests that run on the GPU when there is one (their DEVICE is cuda there)
KERNEL_TESTS = ("tests/unit/test_paged_attention.py",)
MIN_STEP_S = 10.0  # a step is not started with less time than this left in the budget


@dataclasses.dataclass(frozen=True)
class CheckOptions:
    """What to run. ``out`` None means ``docs/results/<gpu-or-cpu>-<date>/``."""

    out: Path | None = None
    quick: bool = False
    skip: frozenset[str] = frozenset()
    emulated_tests: tuple[str, ...] = ("tests/emulated", "tests/scenarios")
    emulated_tier: bool = False  # run the emulated tier on CUDA too (always on CPU)
    peers: bool = False  # the bench also times torch.compile and reduce-overhead on CUDA
    budget_s: float | None = None  # None: CUDA_BUDGET_S on CUDA, no budget on CPU; 0: none
    timeouts: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = sorted(set(self.skip) - set(STEPS[1:]))
        if bad:
            raise ValueError(f"--skip: unknown or unskippable step(s) {bad}; choose from "
                             f"{list(STEPS[1:])} (environment always runs)")
        bad = sorted(set(self.timeouts) - set(STEPS))
        if bad:
            raise ValueError(f"--timeout: unknown step(s) {bad}; choose from {list(STEPS)}")
        if any(t <= 0 for t in self.timeouts.values()):
            raise ValueError(f"--timeout: seconds must be > 0, got {dict(self.timeouts)}")
        if self.budget_s is not None and self.budget_s < 0:
            raise ValueError(f"--budget-s must be >= 0 (0: no budget), got {self.budget_s}")
        if not self.emulated_tests:
            raise ValueError("--emulated-tests: give at least one test path")


@dataclasses.dataclass
class StepResult:
    """One step's outcome. ``summary`` is the one line the README's step table shows."""

    name: str
    status: str = "passed"  # "passed" | "failed" | "skipped"
    reason: str = ""
    seconds: float = 0.0
    summary: str = ""
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    files: list[str] = dataclasses.field(default_factory=list)

    def fail(self, reason: str) -> None:
        """Mark failed; reasons of several failures are joined."""
        self.status = "failed"
        self.reason = f"{self.reason}; {reason}" if self.reason else reason


@dataclasses.dataclass(frozen=True)
class ChildRun:
    argv: tuple[str, ...]
    returncode: int | None  # None: killed at its deadline
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def tail(self, lines: int = 8) -> str:
        text = (self.stderr.strip() or self.stdout.strip()).splitlines()
        return " | ".join(line.strip() for line in text[-lines:])

    def why(self, timeout: float) -> str:
        if self.timed_out:
            return f"killed after {timeout:.0f} s (its deadline)"
        return f"exit {self.returncode}: {self.tail(4)}"


def pytest_summary(output: str) -> tuple[str, dict[str, int]]:
    """pytest's final summary line in ``output`` and its counts (``{"passed": 3, ...}``)."""
    pattern = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|"
                         r"warnings?)")
    for line in reversed(output.strip().splitlines()):
        text = line.strip().strip("=").strip()
        counts = {("error" if k.startswith("error") else "warning" if k.startswith("warning")
                   else k): int(n) for n, k in pattern.findall(text)}
        if counts and re.search(r" in [\d.]+s", text):
            return text, counts
        if text.startswith("no tests ran"):
            return text, {}
    return "(no pytest summary line)", {}


class _Run:
    """One check run: the out dir, the child environment and the clock."""

    def __init__(self, opts: CheckOptions, python: str) -> None:
        self.opts = opts
        self.python = python
        self.started = time.perf_counter()
        self.cuda = False
        self.env_info: dict[str, Any] = {}
        self.out = Path()
        self.budget_s: float | None = None
        self.work = Path(tempfile.mkdtemp(prefix="ff_gpu_check_"))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SRC), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        # fresh compile caches: startup figures are cold starts, and nothing leaks into the
        # user's caches; the capture step reuses what the bench compiled in this run
        env["FREEZEFRAME_CACHE_DIR"] = str(self.work / "freezeframe_cache")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(self.work / "inductor_cache")
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.env = env

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def deadline(self, step: str) -> float | None:
        """Seconds this step may take: its own deadline, cut to what is left of the budget;
        None when the budget is already spent."""
        own = self.opts.timeouts.get(step, TIMEOUTS[step][0 if self.cuda else 1])
        if not self.budget_s:
            return own
        left = self.budget_s - self.elapsed()
        return None if left < MIN_STEP_S else min(own, left)

    def child(self, argv: Sequence[str], timeout: float, log: str | None = None,
              result: StepResult | None = None) -> ChildRun:
        """Run ``argv`` in the repo root; kill its whole process group at ``timeout``."""
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(argv), cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # the group of our own child
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            code = None
        run = ChildRun(tuple(argv), code, stdout, stderr, time.perf_counter() - t0)
        if log is not None:
            (self.out / log).write_text(
                f"$ {shlex.join(argv)}\n# exit: {'killed at deadline' if code is None else code}"
                f", {run.seconds:.1f} s\n\n{stdout}\n--- stderr ---\n{stderr}")
            if result is not None:
                result.files.append(log)
        return run


# -- steps ------------------------------------------------------------------------------------

def _probe(run: _Run, name: str, args: Sequence[str], result: StepResult,
           timeout: float) -> dict[str, Any] | None:
    """A ``gpu_probes`` child writing ``<name>.json`` into the out dir; its JSON, or None with
    the step failed when it crashed or timed out."""
    target = run.out / f"{name}.json"
    target.unlink(missing_ok=True)
    proc = run.child([run.python, "-m", "freezeframe.bench.gpu_probes", *args,
                      "--json", str(target)], timeout, f"{name}.log", result)
    if proc.returncode not in (0, 1) or not target.exists():
        result.fail(f"the {name} probe did not finish: {proc.why(timeout)}")
        return None
    result.files.append(target.name)
    data: dict[str, Any] = json.loads(target.read_text())
    for problem in data.get("problems", []):
        result.fail(problem)
    return data


def _step_tests(run: _Run, result: StepResult, timeout: float) -> None:
    tiers: list[tuple[str, list[str]]] = []
    pytest = [run.python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if run.cuda:
        # every cuda-marked test lives in CUDA_TESTS (a unit test checks this); collecting only
        # there keeps the tier independent of test-only extras such as hypothesis
        tiers.append(("cuda", [*pytest, "-m", "cuda", *CUDA_TESTS]))
        tiers.append(("kernels", [*pytest, *KERNEL_TESTS]))
    else:
        result.details["cuda"] = {"status": "skipped", "reason": NEEDS_CUDA}
    if not run.cuda or run.opts.emulated_tier:
        # the scenarios' cuda half ran in the cuda tier
        marks = ["-m", "not cuda and not inductor" if run.opts.quick else "not cuda"]
        tiers.append(("emulated", [*pytest, *marks, *run.opts.emulated_tests]))
    else:
        result.details["emulated"] = {
            "status": "skipped", "reason": "runs on CPU (CI runs it on every commit); "
                                          "--emulated-tier runs it here too"}
    end = time.perf_counter() + timeout
    lines = []
    for tier, argv in tiers:
        left = end - time.perf_counter()
        if left < 1:
            result.fail(f"{tier} tier: not started, the step's {timeout:.0f} s were spent")
            continue
        proc = run.child(argv, left, f"tests_{tier}.log", result)
        line, counts = pytest_summary(proc.stdout)
        info: dict[str, Any] = {"command": shlex.join(argv[1:]), "summary": line,
                                "counts": counts, "seconds": round(proc.seconds, 1)}
        if proc.timed_out:
            info["status"] = "failed"
            result.fail(f"{tier} tier: {proc.why(left)}")
        elif proc.returncode != 0 or not counts.get("passed"):
            info["status"] = "failed"
            result.fail(f"{tier} tier: {line} (pytest exit {proc.returncode}; see "
                        f"tests_{tier}.log)")
        else:
            info["status"] = "passed"
        result.details[tier] = info
        lines.append(f"{tier}: {line}")
    if not run.cuda:
        lines.insert(0, "cuda: skipped, needs CUDA")
    result.summary = "; ".join(lines)


def _bench_args(cuda: bool, quick: bool, peers: bool = False) -> list[str]:
    if cuda:
        modes = "eager,piecewise,full_and_piecewise" + (",compile,reduce-overhead" if peers
                                                        else "")
        if quick:
            return ["--preset", "1b", "--batch-sizes", "1,8,64", "--modes", modes,
                    "--steps", "5", "--warmup", "1", "--contexts", "128,4096"]
        return ["--preset", "1b", "--batch-sizes", "1,4,16,64", "--modes", modes,
                "--steps", "10", "--warmup", "2"]
    if quick:
        return ["--preset", "tiny", "--batch-sizes", "1,2", "--modes",
                "eager,none,full_and_piecewise", "--steps", "3", "--warmup", "1"]
    return ["--preset", "tiny", "--batch-sizes", "1,2,4,8"]


def _step_bench(run: _Run, result: StepResult, timeout: float) -> None:
    out = run.out / "bench"
    args = [*_bench_args(run.cuda, run.opts.quick, run.opts.peers),
            "--device", "cuda" if run.cuda else "cpu", "--out", str(out), "-q"]
    result.details["command"] = "freezeframe bench " + " ".join(
        a if a != str(out) else "OUT/bench" for a in args)
    (run.out / "bench").mkdir(exist_ok=True)
    (out / "results.json").unlink(missing_ok=True)
    proc = run.child([run.python, "-m", "freezeframe.cli", "bench", *args], timeout,
                     "bench/bench.log", result)
    if proc.returncode != 0:
        result.fail(f"freezeframe bench failed: {proc.why(timeout)}")
    if not (out / "results.json").exists():
        if proc.returncode == 0:
            result.fail("freezeframe bench wrote no results.json")
        return
    # the bench rewrites results.json after every mode: a bench stopped at its deadline
    # still reports the modes it finished
    data = json.loads((out / "results.json").read_text())
    table = "\n".join(line for line in proc.stdout.strip().splitlines()
                      if not line.startswith("wrote "))
    if table:
        (out / "table.txt").write_text(table + "\n")
        result.details["table"] = table
    result.files += [str(p.relative_to(run.out)) for p in sorted(out.iterdir())
                     if p.name in ("results.json", "latency_vs_batch.png", "table.txt")]
    result.details["notes"] = data.get("notes", [])
    timed = [m for m, e in data.get("modes", {}).items() if "decode" in e]
    skipped = {m: e["skipped"] for m, e in data.get("modes", {}).items() if "skipped" in e}
    result.details["skipped_modes"] = skipped
    result.details["decode_ms"] = {
        m: {bs: row.get("median_ms") for bs, row in e["decode"].items()}
        for m, e in data.get("modes", {}).items() if "decode" in e}
    unfinished = data.get("unfinished_modes", [])
    result.summary = (f"{data.get('preset')} preset on {data.get('device')}: "
                      f"{len(timed)} modes timed at batch sizes {data.get('batch_sizes')}"
                      + (f"; skipped {sorted(skipped)}" if skipped else "")
                      + (f"; not reached {unfinished}" if unfinished and proc.returncode
                         else ""))


def _step_capture(run: _Run, result: StepResult, timeout: float) -> None:
    data = _probe(run, "capture", ["capture", "--preset", "1b", "--compiler", "inductor"],
                  result, timeout)
    if data is None or "summary" not in data:
        return
    result.details = data
    result.summary = (f"{data['summary']}; compile {data['compile_s']:.1f} s; "
                      f"{len(data['replay_checks'])} replays checked against the uncompiled "
                      "model")


def _step_cache(run: _Run, result: StepResult, timeout: float) -> None:
    target = run.out / "cache.json"
    target.unlink(missing_ok=True)
    # the tiny preset on CUDA too: three Inductor compiles of the 1B preset in fresh processes
    # do not fit the step's share of the budget, and the warm/cold ratio is what is measured
    preset = "tiny"
    argv = [run.python, str(ROOT / "scripts" / "bench_cache.py"), "--presets", preset,
            "--device", "cuda" if run.cuda else "cpu", "--warm-runs",
            "1" if run.opts.quick or run.cuda else "2", "--json", str(target)]
    proc = run.child(argv, timeout, "cache.log", result)
    if proc.returncode not in (0, 1) or not target.exists():
        result.fail(f"scripts/bench_cache.py did not finish: {proc.why(timeout)}")
        return
    result.files.append(target.name)
    # scripts/bench_cache.py writes one entry per preset it ran
    data: dict[str, Any] = json.loads(target.read_text())[0]
    result.details = cache_figures(data)
    if not data["identical"]:
        result.fail("warm-start outputs differ from the cold start's")
    result.summary = (f"{preset} preset, Inductor: cold first call "
                      f"{data['cold']['first_call_s']:.2f} s, warm/cold first call "
                      f"{data['warm_cold_first_call']:.1%}, process minus baseline "
                      f"{data['warm_cold_startup']:.1%}; outputs identical: "
                      f"{data['identical']}")


def cache_figures(data: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one ``scripts/bench_cache.py`` entry the report shows: each start's
    first call, process time and counters (the outputs themselves are left out)."""
    starts = {"baseline": data["baseline"], "cold": data["cold"],
              **{f"warm{i + 1}": w for i, w in enumerate(data["warms"])}}
    keys = ("inductor_compiles", "cache_hits", "cache_misses", "artifacts_loaded")
    return {
        "preset": data["preset"], "device": data["device"],
        "starts": {name: {"first_call_s": s["first_call_s"], "process_s": s["process_s"],
                          "stats": {k: s["stats"].get(k, 0) for k in keys}}
                   for name, s in starts.items()},
        "warm_cold_first_call": data["warm_cold_first_call"],
        "warm_cold_startup": data["warm_cold_startup"],
        "outputs_identical": data["identical"],
    }


def _step_ubatch(run: _Run, result: StepResult, timeout: float) -> None:
    args = ["ubatch", "--trace", str(run.out / "ubatch_trace.json")]
    if run.opts.quick:
        args += ["--tokens", "4096", "--steps", "10"]
    data = _probe(run, "ubatch", args, result, timeout)
    if data is None or "split_step_ms" not in data:
        return
    result.details = data
    if (run.out / "ubatch_trace.json").exists():
        result.files.append("ubatch_trace.json")
    result.summary = (f"{data['tokens']} tokens in {data['micro_batches']} micro-batches: "
                      f"{data['split_step_ms']:.3f} ms vs {data['unsplit_step_ms']:.3f} ms "
                      f"unsplit; overlapping kernel pairs in the trace: "
                      f"{data['trace_overlap']['overlapping_pairs']}")


_STEP_FUNCS: Mapping[str, Callable[[_Run, StepResult, float], None]] = {
    "tests": _step_tests, "bench": _step_bench, "capture": _step_capture,
    "cache": _step_cache, "ubatch": _step_ubatch,
}


def _environment(run: _Run) -> StepResult:
    """Probe into the work dir (the out dir's name depends on the GPU found)."""
    result = StepResult("environment")
    t0 = time.perf_counter()
    target = run.work / "environment.json"
    args = ["environment"] + (["--no-tests"] if "tests" in run.opts.skip else [])
    timeout = run.opts.timeouts.get("environment", TIMEOUTS["environment"][1])
    proc = run.child([run.python, "-m", "freezeframe.bench.gpu_probes", *args,
                      "--json", str(target)], timeout)
    result.details["probe_output"] = (proc.stdout + proc.stderr)[-4000:]
    if proc.returncode not in (0, 1) or not target.exists():
        result.fail(f"the environment probe did not finish: {proc.why(timeout)}")
    else:
        info = json.loads(target.read_text())
        run.env_info = info
        run.cuda = bool(info.get("cuda"))
        result.details = info
        for problem in info["problems"]:
            result.fail(problem)
        pk = info["packages"]
        gpu = info.get("gpu")
        device = (f"{gpu['name']} ({gpu['memory_bytes'] / 2**30:.0f} GiB), driver "
                  f"{gpu['driver']}, CUDA {info['torch_cuda_build']}" if gpu else "no CUDA device")
        result.summary = (f"{device}; Python {info['python']}, torch {pk['torch']}, triton "
                          f"{pk['triton'] or 'not installed'}, freezeframe {info['freezeframe']}"
                          + (f"; optional extras missing (degraded output): "
                             f"{', '.join(info['missing_optional'])}"
                             if info["missing_optional"] else ""))
    result.seconds = time.perf_counter() - t0
    return result


def _default_out(run: _Run) -> Path:
    gpu = run.env_info.get("gpu")
    name = "cpu"
    if gpu:
        words = re.sub(r"[^a-z0-9]+", "-", gpu["name"].lower()).strip("-").split("-")
        name = "-".join(w for w in words if w != "nvidia") or "gpu"
    return ROOT / "docs" / "results" / f"{name}-{datetime.date.today().isoformat()}"


def run_check(opts: CheckOptions, python: str = sys.executable,
              echo: Callable[[str], None] = print) -> tuple[int, Path]:
    """Run every step ``opts`` selects; returns (exit status, out dir)."""
    run = _Run(opts, python)
    try:
        echo(f"gpu_check: [1/{len(STEPS)}] environment")
        results = [_environment(run)]
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
            if name in opts.skip:
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
                        _STEP_FUNCS[name](run, result, timeout)
                    except Exception as exc:  # a bug in this script must not lose the others
                        result.fail(f"gpu_check itself raised {type(exc).__name__}: {exc}")
                    result.seconds = time.perf_counter() - t0
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


# -- the report -------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def write_report(run: _Run, results: Sequence[StepResult]) -> None:
    """``gpu_check.json`` and ``README.md`` in the out dir."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    gpu: dict[str, Any] = run.env_info.get("gpu") or {}
    failed = [r.name for r in results if r.status == "failed"]
    doc = {
        "date": date, "cuda": run.cuda, "gpu": gpu or None, "quick": run.opts.quick,
        "budget_s": run.budget_s or None, "total_s": round(run.elapsed(), 1),
        "passed": not failed,
        "complete": len(results) == len(STEPS),
        "steps": [dataclasses.asdict(r) for r in results],
    }
    (run.out / "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str))

    title = gpu["name"] if gpu else "CPU only"
    lines = [f"# freezeframe GPU check: {title}, {date[:10]}", ""]
    if not gpu:
        lines += [f"{NO_GPU_FIGURE}: this machine has no CUDA device "
                  "(torch.cuda.is_available() is False). The CUDA tests, the capture report and "
                  "the micro-batch trace were skipped; the bench ran the CPU preset, where "
                  "freezeframe's graph modes use the emulated backend. Nothing here measures a "
                  "GPU.", ""]
    else:
        lines += [f"GPU: {gpu['name']}, {gpu['memory_bytes'] / 2**30:.1f} GiB, compute "
                  f"capability {gpu['capability']}, driver {gpu['driver']}, CUDA "
                  f"{run.env_info.get('torch_cuda_build')}.", ""]
    verdict = f"**FAILED**: {', '.join(failed)}" if failed else "all checks passed"
    if len(results) < len(STEPS):
        verdict = (f"in progress, {len(results)} of {len(STEPS)} steps reached; so far: "
                   + verdict)
    lines += [f"Result: {verdict}. Mode: {'--quick' if run.opts.quick else 'full'}; total "
              f"{run.elapsed():.0f} s" + (f" (budget {run.budget_s:.0f} s)" if run.budget_s
                                          else "") + ". Produced by `scripts/gpu_check`; the "
              "raw data is in `gpu_check.json`.", "",
              "| step | status | time | what was checked |", "|---|---|---|---|"]
    for r in results:
        text = r.summary if r.status == "passed" else (
            r.reason + (f" ({r.summary})" if r.summary else ""))
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} s | "
                     f"{text.replace('|', '/')} |")
    by_name = {r.name: r for r in results}
    lines += ["", *_environment_section(run.env_info)]
    if results[0].files:
        lines += ["", f"Files: {', '.join(f'`{f}`' for f in results[0].files)}"]
    for name, section in (("tests", _tests_section), ("bench", _bench_section),
                          ("capture", _capture_section), ("ubatch", _ubatch_section),
                          ("cache", _cache_section)):
        found = by_name.get(name)
        if found is None:  # not reached yet (the report is written after every step)
            continue
        r = found
        if r.status != "skipped" and r.details:
            lines += ["", *section(r)]
        if r.files:
            lines += ["", f"Files: {', '.join(f'`{f}`' for f in r.files)}"]
    (run.out / "README.md").write_text("\n".join(lines) + "\n")


def _environment_section(info: Mapping[str, Any]) -> list[str]:
    if not info:
        return ["## Environment", "", "The environment probe did not report (see above)."]
    pk = info.get("packages", {})
    rows = [("Python", info.get("python")), ("platform", info.get("platform")),
            ("freezeframe", f"{info.get('freezeframe')} ({info.get('freezeframe_path')})"),
            ("torch", f"{pk.get('torch')} (CUDA build: {info.get('torch_cuda_build')})"),
            *[(n, pk.get(n) or "not installed") for n in ("triton", "pytest", "hypothesis",
                                                             "tqdm", "matplotlib")]]
    return ["## Environment", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def _tests_section(r: StepResult) -> list[str]:
    out = ["## Tests", "", "| tier | command | status | pytest summary |", "|---|---|---|---|"]
    for tier in ("cuda", "kernels", "emulated"):
        info = r.details.get(tier)
        if info is None:
            continue
        if info.get("status") == "skipped":
            out.append(f"| {tier} | | skipped | {info['reason']} |")
        else:
            out.append(f"| {tier} | `{info['command']}` | {info['status']} | {info['summary']} |")
    return out


def _bench_section(r: StepResult) -> list[str]:
    out = ["## Bench", "", f"`{r.details.get('command', '')}`", ""]
    if "table" in r.details:
        out += ["```text", r.details["table"], "```"]
    return out


def _capture_section(r: StepResult) -> list[str]:
    d = r.details
    if "graphs" not in d:
        return []
    out = ["## Capture report", "",
           f"{d['preset']} preset, {d['compiler']} compiler, {d['cudagraph_mode']}, capture "
           f"sizes {d['capture_sizes']}. Total: {len(d['graphs'])} graphs in "
           f"{d['capture_s']:.2f} s, {_mib(d['capture_memory_bytes'])} MiB (growth of the graph "
           "pool's segments, from the caching allocator; the allocator's reserved memory grew "
           f"{_mib(d['reserved_growth_bytes'])} MiB). " + _prediction_line(d), "",
           "| mode | tokens | requests | uniform | capture ms | memory MiB | predicted MiB |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {g['mode']} | {g['num_tokens']} | {g['num_reqs'] or ''} | {g['uniform']} | "
            f"{g['seconds'] * 1e3:.1f} | {_mib(g['memory_bytes'])} | "
            + ("measured (probe)" if g.get("probe") else
               _mib(g["predicted_bytes"]) if g.get("predicted_bytes") is not None else "")
            + " |" for g in d["graphs"]]
    out += ["", "| replay check | graph steps | relative error vs uncompiled | repeatable |",
            "|---|---|---|---|"]
    out += [f"| {c['step']} | {c['graph_replays']}/2 | {c['relative_error']:.3g} | "
            f"{c['replay_repeatable']} |" for c in d["replay_checks"]]
    return out


def _prediction_line(d: Mapping[str, Any]) -> str:
    predicted = d.get("predicted_memory_bytes")
    if predicted is None:
        return "No prediction was made before the capture."
    error = d.get("prediction_error")
    return (f"Predicted before the rest was captured, from the probes captured first: "
            f"{_mib(predicted)} MiB" + (f" ({error:+.1%} against the measurement)."
                                        if error is not None else "."))


def _cache_section(r: StepResult) -> list[str]:
    d = r.details
    if "starts" not in d:
        return []
    out = ["## Compile cache: cold vs warm start", "",
           f"{d['preset']} preset on {d['device']}, Inductor; each start a fresh process.", "",
           "| start | first call s | process s | counters |", "|---|---|---|---|"]
    keys = ("inductor_compiles", "cache_hits", "cache_misses", "artifacts_loaded")
    for name, s in d["starts"].items():
        counters = " ".join(f"{k}={s['stats'].get(k, 0)}" for k in keys)
        out.append(f"| {name} | {s['first_call_s']:.2f} | {s['process_s']:.2f} | {counters} |")
    out += ["", f"Warm/cold first call {d['warm_cold_first_call']:.1%}; process time minus "
            f"the uncompiled baseline's {d['warm_cold_startup']:.1%}; outputs identical: "
            f"{d['outputs_identical']}."]
    return out


def _ubatch_section(r: StepResult) -> list[str]:
    d = r.details
    if "timeline_ms" not in d:
        return []
    out = ["## Micro-batch overlap", "",
           f"Toy model ({d['tokens']} tokens, hidden {d['hidden']}, fp16 matmuls; a spin "
           f"kernel of about {d['comm_ms_target']:.3f} ms stands in for an all-to-all) split "
           f"into {d['micro_batches']} micro-batches by `MicroBatchWrapper`: step "
           f"{d['split_step_ms']:.3f} ms vs {d['unsplit_step_ms']:.3f} ms unsplit (median). "
           f"Chrome trace: `{d['trace']}` (open in chrome://tracing or ui.perfetto.dev).", "",
           "| phase | start ms | end ms |", "|---|---|---|"]
    out += [f"| {k} | {a:.3f} | {b:.3f} |" for k, (a, b) in d["timeline_ms"].items()]
    out += ["", *[f"- {k}: {'overlaps' if v else 'NO overlap'}" for k, v in
                  d["overlaps"].items()],
            f"- kernels per stream in the trace: {d['trace_overlap']['kernels_per_stream']}, "
            f"overlapping pairs: {d['trace_overlap']['overlapping_pairs']}"]
    return out


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
