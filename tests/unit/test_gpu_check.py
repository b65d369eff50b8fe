"""``scripts/gpu_check``: its CPU path end to end (as a subprocess, CUDA hidden, the slow steps
skipped), a failing step making the exit status non-zero, and the pure helpers of its GPU path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from freezeframe.bench.gpu_check import main
from freezeframe.bench.gpu_probes import overlapping_kernel_pairs
from freezeframe.bench.gpu_steps import (
    CUDA_BUDGET_S,
    NEEDS_CUDA,
    STEPS,
    TIMEOUTS,
    pytest_summary,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check"
NO_GPU_LINE = ("**No GPU figure was produced**: this machine has no CUDA device "
               "(torch.cuda.is_available() is False).")


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a machine with a GPU
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def statuses(out: Path) -> list[tuple[str, str, str]]:
    doc: dict[str, Any] = json.loads((out / "gpu_check.json").read_text())
    return [(s["name"], s["status"], s["reason"]) for s in doc["steps"]]


def test_cpu_quick_path_runs_what_it_can_and_says_no_gpu_figure(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = run_script("--quick", "--skip", "tests,cache", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert statuses(out) == [
        ("environment", "passed", ""),
        ("tests", "skipped", "skipped with --skip"),
        ("bench", "passed", ""),
        ("capture", "skipped", NEEDS_CUDA),
        ("ubatch", "skipped", NEEDS_CUDA),
        ("cache", "skipped", "skipped with --skip"),
    ]
    assert [name for name, _, _ in statuses(out)] == list(STEPS)
    doc = json.loads((out / "gpu_check.json").read_text())
    assert (doc["cuda"], doc["gpu"], doc["quick"], doc["passed"]) == (False, None, True, True)
    readme = (out / "README.md").read_text().splitlines()
    assert readme[0].startswith("# freezeframe GPU check: CPU only, ")
    assert readme[2].startswith(NO_GPU_LINE)
    assert "| capture | skipped | 0.0 s | needs CUDA (torch.cuda.is_available() is False) |" \
        in readme
    bench = json.loads((out / "bench" / "results.json").read_text())
    assert (bench["preset"], bench["batch_sizes"], list(bench["modes"])) == (
        "tiny", [1, 2], ["eager", "none", "full_and_piecewise"])
    assert (out / "bench" / "table.txt").read_text().startswith("tiny preset on ")
    assert "gpu_check: all checks passed" in proc.stdout


@pytest.mark.parametrize("outcome", ["passes", "fails"])
def test_a_failing_step_makes_the_exit_status_non_zero(tmp_path: Path, outcome: str) -> None:
    suite = tmp_path / f"test_{outcome}.py"
    suite.write_text("def test_it():\n    assert 1 + 1 == " + ("2" if outcome == "passes"
                                                               else "3") + "\n")
    out = tmp_path / "results"
    proc = run_script("--quick", "--skip", "bench", "--skip", "cache", "--emulated-tests",
                      str(suite), "--out", str(out))
    doc = json.loads((out / "gpu_check.json").read_text())
    tests = doc["steps"][1]
    assert tests["details"]["cuda"] == {"status": "skipped", "reason": NEEDS_CUDA}
    emulated = tests["details"]["emulated"]
    if outcome == "passes":
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (tests["status"], tests["reason"]) == ("passed", "")
        assert emulated["counts"] == {"passed": 1}
        assert doc["passed"] is True
    else:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert tests["status"] == "failed"
        assert tests["reason"].startswith("emulated tier: 1 failed in ")
        assert tests["reason"].endswith("(pytest exit 1; see tests_emulated.log)")
        assert emulated["counts"] == {"failed": 1}
        assert doc["passed"] is False
        assert "Result: **FAILED**: tests." in (out / "README.md").read_text()
        assert "gpu_check: FAILED: tests in " in proc.stdout
    log = (out / "tests_emulated.log").read_text().splitlines()
    assert log[0] == (f"$ {sys.executable} -m pytest -q -p no:cacheprovider "
                      f"-m 'not cuda and not inductor' {suite}")


@pytest.mark.parametrize(("argv", "message"), [
    (["--skip", "environment"], "--skip: unknown or unskippable step(s) ['environment']"),
    (["--skip", "bench,nope"], "--skip: unknown or unskippable step(s) ['nope']"),
    (["--timeout", "bench"], "--timeout: expected STEP=SECONDS, got 'bench'"),
    (["--timeout", "bench=soon"], "--timeout: expected STEP=SECONDS, got 'bench=soon'"),
    (["--timeout", "bnch=10"], "--timeout: unknown step(s) ['bnch']"),
    (["--budget-s", "-1"], "--budget-s must be >= 0 (0: no budget), got -1.0"),
])
def test_bad_arguments_exit_2_naming_the_argument(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_pytest_summary_reads_the_final_line() -> None:
    output = ".s.F\n=== short test summary info ===\nFAILED t.py::x\n" \
             "1 failed, 2 passed, 1 skipped, 3 deselected, 2 warnings in 4.56s\n"
    assert pytest_summary(output) == (
        "1 failed, 2 passed, 1 skipped, 3 deselected, 2 warnings in 4.56s",
        {"failed": 1, "passed": 2, "skipped": 1, "deselected": 3, "warning": 2})
    assert pytest_summary("== 1 error in 0.20s ==\n") == ("1 error in 0.20s", {"error": 1})
    assert pytest_summary("no tests ran in 0.01s\n") == ("no tests ran in 0.01s", {})
    assert pytest_summary("Traceback ...\nImportError: x\n") == ("(no pytest summary line)", {})


def test_overlapping_kernel_pairs_counts_pairs_on_different_streams() -> None:
    def kernel(stream: int, ts: float, dur: float) -> dict[str, Any]:
        return {"cat": "kernel", "ts": ts, "dur": dur, "args": {"stream": stream}}

    trace = {"traceEvents": [
        kernel(7, 0, 10), kernel(7, 10, 10),  # compute stream: [0, 10), [10, 20)
        kernel(13, 5, 10),  # comm stream: [5, 15) overlaps both compute kernels
        kernel(13, 20, 5),  # [20, 25): touches [10, 20) at its end only, no overlap
        {"cat": "cpu_op", "ts": 0, "dur": 100, "args": {}},  # not a kernel
        {"cat": "kernel", "ts": 3, "args": {"stream": 7}},  # no duration: ignored
    ]}
    assert overlapping_kernel_pairs(trace) == {
        "kernels_per_stream": {"7": 2, "13": 2}, "overlapping_pairs": 2}
    serial = {"traceEvents": [kernel(7, 0, 10), kernel(13, 10, 10)]}
    assert overlapping_kernel_pairs(serial)["overlapping_pairs"] == 0


def test_every_cuda_marked_test_lives_where_gpu_check_collects_them() -> None:
    """gpu_check collects the cuda tier from CUDA_TESTS only (so that a missing test extra such
    as hypothesis cannot stop it); a cuda-marked test elsewhere would never run there."""
    from freezeframe.bench.gpu_steps import CUDA_TESTS

    homes = [REPO / path for path in CUDA_TESTS]
    elsewhere = [str(p.relative_to(REPO)) for p in sorted((REPO / "tests").rglob("*.py"))
                 if "mark.cuda" in p.read_text() and p.name != "test_gpu_check.py"
                 and not any(home in p.parents for home in homes)]
    assert elsewhere == []
    assert CUDA_TESTS == ("tests/cuda", "tests/scenarios")


def test_the_cuda_steps_deadlines_are_shares_of_an_eight_minute_budget() -> None:
    """The default GPU run fits its budget by construction: each step's deadline is its share,
    and the shares add up to the budget (a lent GPU comes with about 15 minutes in all)."""
    assert CUDA_BUDGET_S == 480
    assert sum(cuda for cuda, _cpu in TIMEOUTS.values()) == CUDA_BUDGET_S
    assert list(TIMEOUTS) == list(STEPS)
    # the GPU-only evidence comes before what could run elsewhere
    assert STEPS.index("capture") < STEPS.index("cache")
    assert STEPS.index("ubatch") < STEPS.index("cache")


def test_the_cache_step_reads_what_scripts_bench_cache_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's cache figures come from the very entry ``scripts/bench_cache.py`` builds
    (its starts stubbed: each is a fresh process with Inductor, minutes on this CPU); the
    first GPU run failed here on a key the script no longer wrote."""
    import importlib.util

    from freezeframe.bench.gpu_steps import cache_figures

    spec = importlib.util.spec_from_file_location("bench_cache", REPO / "scripts" /
                                                  "bench_cache.py")
    assert spec is not None and spec.loader is not None
    bench_cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_cache)
    timings = {"baseline": (10.0, 1.0), "cold": (70.0, 60.0), "warm": (13.0, 4.0)}

    def start(kind: str, *args: Any) -> dict[str, Any]:
        process_s, first_call_s = timings[kind]
        stats = {"cold": {"inductor_compiles": 3}, "warm": {"cache_hits": 3}}.get(kind, {})
        return {"process_s": process_s, "first_call_s": first_call_s, "stats": stats,
                "inductor_load_s": 1.5, "checksum": 1.0, "out": [1.0], "stages": {}}

    monkeypatch.setattr(bench_cache, "_start", start)
    entry = bench_cache._bench("tiny", None, 1, "cuda")
    figures = cache_figures(json.loads(json.dumps(entry)))
    assert figures["starts"] == {
        "baseline": {"first_call_s": 1.0, "process_s": 10.0,
                     "stats": dict.fromkeys(("inductor_compiles", "cache_hits", "cache_misses",
                                             "artifacts_loaded"), 0)},
        "cold": {"first_call_s": 60.0, "process_s": 70.0,
                 "stats": {"inductor_compiles": 3, "cache_hits": 0, "cache_misses": 0,
                           "artifacts_loaded": 0}},
        "warm1": {"first_call_s": 4.0, "process_s": 13.0,
                  "stats": {"inductor_compiles": 0, "cache_hits": 3, "cache_misses": 0,
                            "artifacts_loaded": 0}},
    }
    assert figures["warm_cold_first_call"] == pytest.approx(4.0 / 60.0)
    assert figures["warm_cold_startup"] == pytest.approx(3.0 / 60.0)
    assert (figures["preset"], figures["device"], figures["outputs_identical"]) == (
        "tiny", "cuda", True)
