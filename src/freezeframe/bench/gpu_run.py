"""What the steps of ``scripts/gpu_check`` share: the options, one run's directories, child
environment and clock, each step's result, and the child processes a step runs its work in.

Two directories: the *work* directory (temporary) where each step writes as it goes (logs, the
bench's results, the probes' JSON, the trace), and ``--out``, which gets the few files that
come back from a GPU machine (``gpu_pack``), rewritten after every step. Only the standard
library is imported here (and freezeframe, which imports no torch), so a missing or broken
torch is reported, not crashed on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ROOT",
    "SRC",
    "CheckOptions",
    "CheckRun",
    "ChildRun",
    "StepResult",
    "Stopped",
    "pytest_summary",
]

ROOT = Path(__file__).resolve().parents[3]  # src/freezeframe/bench/gpu_run.py -> repo root
SRC = Path(__file__).resolve().parents[2]


class Stopped(BaseException):
    """The run was told to stop (SIGTERM, SIGINT: ``timeout`` wrapping the command): the step
    in progress is failed, and the report and the return files are still written."""


@dataclasses.dataclass(frozen=True)
class CheckOptions:
    """What to run. ``out`` None means ``docs/results/<gpu-or-cpu>-<date>/``; ``steps`` the
    names of every step, in order (the first, the environment, always runs)."""

    steps: tuple[str, ...]
    out: Path | None = None
    quick: bool = False
    dry_run: bool = False  # every step on the CPU, tiny shapes, emulated graphs: a rehearsal
    skip: frozenset[str] = frozenset()
    emulated_tests: tuple[str, ...] = ("tests/emulated", "tests/scenarios")
    emulated_tier: bool = False  # run the emulated tier on CUDA too (always on CPU)
    peers: bool = False  # the bench also times torch.compile's default mode on CUDA
    budget_s: float | None = None  # None: the plan's budget on CUDA, none on CPU; 0: none
    timeouts: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = sorted(set(self.skip) - set(self.steps[1:]))
        if bad:
            raise ValueError(f"--skip: unknown or unskippable step(s) {bad}; choose from "
                             f"{list(self.steps[1:])} ({self.steps[0]} always runs)")
        bad = sorted(set(self.timeouts) - set(self.steps))
        if bad:
            raise ValueError(f"--timeout: unknown step(s) {bad}; choose from {list(self.steps)}")
        if any(t <= 0 for t in self.timeouts.values()):
            raise ValueError(f"--timeout: seconds must be > 0, got {dict(self.timeouts)}")
        if self.budget_s is not None and self.budget_s < 0:
            raise ValueError(f"--budget-s must be >= 0 (0: no budget), got {self.budget_s}")
        if not self.emulated_tests:
            raise ValueError("--emulated-tests: give at least one test path")


@dataclasses.dataclass
class StepResult:
    """One step's outcome. ``summary`` is the one line the README's step table shows;
    ``files`` the step's files in the work directory (packed into the return files)."""

    name: str
    status: str = "passed"  # "passed" | "failed" | "skipped"
    reason: str = ""
    seconds: float = 0.0
    deadline_s: float | None = None
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
    returncode: int | None  # None: killed at its deadline (or the run was stopped)
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
    # "285/551 tests collected": the first number is what was selected
    pattern = re.compile(r"(\d+)(?:/\d+)? (passed|failed|skipped|deselected|errors?|xfailed|"
                         r"xpassed|warnings?|tests? collected)")
    for line in reversed(output.strip().splitlines()):
        text = line.strip().strip("=").strip()
        counts = {("error" if k.startswith("error") else "warning" if k.startswith("warning")
                   else "collected" if k.endswith("collected") else k): int(n)
                  for n, k in pattern.findall(text)}
        if counts and re.search(r" in [\d.]+s", text):
            return text, counts
        if text.startswith("no tests ran"):
            return text, {}
    return "(no pytest summary line)", {}


class CheckRun:
    """One check run: the directories, the child environment and the clock."""

    def __init__(self, opts: CheckOptions, python: str) -> None:
        self.opts = opts
        self.python = python
        self.started = time.perf_counter()
        self.cuda = False
        self.env_info: dict[str, Any] = {}
        self.out = Path()
        self.budget_s: float | None = None
        self.work = Path(tempfile.mkdtemp(prefix="ff_gpu_check_"))
        self.raw = self.work / "raw"  # what the steps write; packed into --out
        self.raw.mkdir()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SRC), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        # fresh compile caches: startup figures are cold starts, and nothing leaks into the
        # user's caches; every step that compiles the 1B model shares them (the bench fills
        # them, the cache step's warm start reads freezeframe's)
        env["FREEZEFRAME_CACHE_DIR"] = str(self.work / "freezeframe_cache")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(self.work / "inductor_cache")
        env.setdefault("PYTHONUNBUFFERED", "1")
        if opts.dry_run:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a rehearsal runs the CPU path everywhere
        self.env = env

    @property
    def dry(self) -> bool:
        return self.opts.dry_run

    def has(self, package: str) -> bool:
        """Whether the environment probe found ``package`` (an import name) importable."""
        return bool(self.env_info.get("packages", {}).get(package))

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def child(self, argv: Sequence[str], timeout: float, log: str | None = None,
              result: StepResult | None = None, env: Mapping[str, str] | None = None
              ) -> ChildRun:
        """Run ``argv`` in the repo root; kill its whole process group at ``timeout`` (or when
        the run is stopped). ``log``: a file of the work directory its output goes to."""
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(argv), cwd=ROOT, env=dict(env or self.env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        stopped: Stopped | None = None
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except (subprocess.TimeoutExpired, Stopped) as exc:
            stopped = exc if isinstance(exc, Stopped) else None
            with contextlib.suppress(ProcessLookupError):  # the group of our own child
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            code = None
        run = ChildRun(tuple(argv), code, stdout, stderr, time.perf_counter() - t0)
        if log is not None:
            path = self.raw / log
            path.parent.mkdir(parents=True, exist_ok=True)
            ended = "stopped" if stopped else "killed at deadline" if code is None else code
            path.write_text(f"$ {shlex.join(argv)}\n# exit: {ended}, {run.seconds:.1f} s\n\n"
                            f"{stdout}\n--- stderr ---\n{stderr}")
            if result is not None and log not in result.files:
                result.files.append(log)
        if stopped is not None:
            raise stopped
        return run
