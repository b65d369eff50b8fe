"""The steps of ``scripts/gpu_check`` (see ``gpu_check``) and what they share: the options, one
run's out dir, child environment and clock, and each step's result.

Every step except ``environment`` runs its work in child processes with a deadline, so a crash
or a hang is a failed step, not a lost run. Only the standard library is imported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CUDA_BUDGET_S", "CUDA_TESTS", "GPU_ONLY", "KERNEL_TESTS", "NEEDS_CUDA", "ROOT",
           "STEPS", "STEP_FUNCS", "TIMEOUTS", "CheckOptions", "CheckRun", "ChildRun",
           "StepResult", "cache_figures", "pytest_summary", "step_environment"]

ROOT = Path(__file__).resolve().parents[3]  # src/freezeframe/bench/gpu_steps.py -> repo root
SRC = Path(__file__).resolve().parents[2]

STEPS = ("environment", "tests", "bench", "capture", "ubatch", "cache")
GPU_ONLY = frozenset({"capture", "ubatch"})
NEEDS_CUDA = "needs CUDA (torch.cuda.is_available() is False)"
# per-step deadlines in seconds, (on CUDA, on CPU). On CUDA they are the steps' shares of
# CUDA_BUDGET_S and add up to it, so the default run fits its budget by construction. Shares
# from the H100 runs of 2026-11-26 (environment 6-8 s, bench 135 s, ubatch 12 s; the cuda
# tier's 33 tests in 24 s): the cuda tier now holds 285 tests, mostly the scenario suite's
# small models (about 0.4 s each on the 2-core dev CPU), so the tests step has 150 s.
TIMEOUTS: Mapping[str, tuple[float, float]] = {
    "environment": (15, 120), "tests": (150, 900), "bench": (145, 600),
    "capture": (80, 300), "ubatch": (30, 90), "cache": (60, 300),
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


class CheckRun:
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

def _probe(run: CheckRun, name: str, args: Sequence[str], result: StepResult,
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


def _step_tests(run: CheckRun, result: StepResult, timeout: float) -> None:
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
        # breakable: the same graphs without a trace (startup without a compile)
        modes = "eager,piecewise,full_and_piecewise,breakable" + (
            ",compile,reduce-overhead" if peers else "")
        if quick:
            return ["--preset", "1b", "--batch-sizes", "1,8,64", "--modes", modes,
                    "--steps", "5", "--warmup", "1", "--contexts", "128,4096"]
        return ["--preset", "1b", "--batch-sizes", "1,4,16,64", "--modes", modes,
                "--steps", "10", "--warmup", "2"]
    if quick:
        return ["--preset", "tiny", "--batch-sizes", "1,2", "--modes",
                "eager,none,full_and_piecewise", "--steps", "3", "--warmup", "1"]
    return ["--preset", "tiny", "--batch-sizes", "1,2,4,8"]


def _step_bench(run: CheckRun, result: StepResult, timeout: float) -> None:
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


def _step_capture(run: CheckRun, result: StepResult, timeout: float) -> None:
    data = _probe(run, "capture", ["capture", "--preset", "1b", "--compiler", "inductor"],
                  result, timeout)
    if data is None or "summary" not in data:
        return
    result.details = data
    result.summary = (f"{data['summary']}; compile {data['compile_s']:.1f} s; "
                      f"{len(data['replay_checks'])} replays checked against the uncompiled "
                      "model")


def _step_cache(run: CheckRun, result: StepResult, timeout: float) -> None:
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


def _step_ubatch(run: CheckRun, result: StepResult, timeout: float) -> None:
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


STEP_FUNCS: Mapping[str, Callable[[CheckRun, StepResult, float], None]] = {
    "tests": _step_tests, "bench": _step_bench, "capture": _step_capture,
    "cache": _step_cache, "ubatch": _step_ubatch,
}


def step_environment(run: CheckRun) -> StepResult:
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
