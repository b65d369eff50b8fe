"""``scripts/gpu_check``: its dry run end to end (as a subprocess, CUDA hidden: every step at
the tiniest shapes, the return files within the device tool's limits, the plan within its
budget), a failing step and a stopped run, and the pure helpers of its GPU path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from freezeframe.bench.gpu_check import main, plan_lines
from freezeframe.bench.gpu_pack import RETURN_FILES, Limits, check_layout, pack
from freezeframe.bench.gpu_probes import overlapping_kernel_pairs
from freezeframe.bench.gpu_run import CheckOptions, pytest_summary
from freezeframe.bench.gpu_steps import CUDA_BUDGET_S, DEADLINES, GPU_MODES, NEEDS_CUDA, STEPS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check"
NO_GPU_LINE = "**No GPU figure was produced**: a dry run (`--dry-run`) rehearses the GPU run"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a machine with a GPU
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def statuses(out: Path) -> list[tuple[str, str, str]]:
    doc: dict[str, Any] = json.loads((out / "gpu_check.json").read_text())
    return [(s["name"], s["status"], s["reason"]) for s in doc["steps"]]


def raw_files(out: Path) -> dict[str, bytes]:
    with tarfile.open(out / "raw.tar.gz") as tar:
        return {m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers() if m.isfile()}


def test_the_dry_run_walks_every_step_and_writes_what_comes_back(tmp_path: Path) -> None:
    """The rehearsal CI runs: every step of the GPU run at the tiniest shapes, every file
    written, nothing beyond the device tool's return limits, the GPU plan printed with its
    deadlines and within its budget."""
    out = tmp_path / "out"
    proc = run_script("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "plan: 480 s of deadlines"
    assert lines[-2] == "layout: within the return limits"
    plan = lines[lines.index("gpu_check: the GPU plan (rehearsed on the CPU):") + 1:][:8]
    assert [line.split()[:3] for line in plan[:7]] == [
        ["environment", "15", "s"], ["kernels", "35", "s"], ["splitkv", "15", "s"],
        ["bench", "315", "s"], ["tests", "45", "s"], ["ubatch", "20", "s"],
        ["cache", "35", "s"]]
    assert [(name, status) for name, status, _ in statuses(out)] == [
        (name, "passed") for name in STEPS]
    assert sorted(p.name for p in out.iterdir()) == sorted(RETURN_FILES)
    assert check_layout(out) == []
    raw = raw_files(out)
    assert sorted(raw) == [f"raw/{name}" for name in (
        "bench/bench.log", "bench/latency_vs_batch.png", "bench/results.json", "bench/table.txt",
        "cache.json", "cache.log", "environment.json", "environment.log", "splitkv.json",
        "splitkv.log", "tests_cuda.log", "tests_kernels.log", "ubatch.json", "ubatch.log",
        "ubatch_trace.json")]
    # the test tiers' commands, verbose so a tier stopped at its deadline names its tests
    assert raw["raw/tests_cuda.log"].decode().startswith(
        f"$ {sys.executable} -m pytest -v -rA -p no:cacheprovider -m cuda tests/cuda "
        "tests/scenarios\n")
    bench = json.loads((out / "bench.json").read_text())
    assert bench == json.loads(raw["raw/bench/results.json"])
    assert list(bench["modes"]) == GPU_MODES.split(",")
    for mode in ("full_and_piecewise", "piecewise", "breakable"):  # every timed step planned
        assert bench["modes"][mode]["planned_steps"] == bench["modes"][mode]["timed_steps"] == 7
    assert set(bench["modes"]["ff-hf"]["generate"]) == {"1", "8"}
    assert bench["modes"]["full_and_piecewise"]["full_decode_profile"]["activity"] == "cpu"
    splitkv = json.loads(raw["raw/splitkv.json"])
    assert (splitkv["finished"], splitkv["ok"], splitkv["problems"]) == (True, True, [])
    assert splitkv["shape"] == {"preset": "tiny", "heads": 4, "kv_heads": 2, "head_dim": 16,
                                "layers": 2, "block_size": 16, "max_blocks": 3,
                                "dtype": "bfloat16"}
    # the table holds 48 positions: too few blocks for "auto" to split, "on" splits in two
    assert [(r["batch"], r["context"], r["split_kv"], r["splits"]) for r in splitkv["rows"]] \
        == [(1, 16, "off", 1), (1, 16, "on", 2), (1, 32, "off", 1), (1, 32, "on", 2)]
    assert splitkv["auto_splits"] == {"1": 1}
    assert all(0 < r["rel_error"] <= 1e-2 and r["ms"] > 0 for r in splitkv["rows"])
    ubatch = json.loads(raw["raw/ubatch.json"])
    assert (ubatch["finished"], ubatch["micro_batches"], ubatch["graphs_captured"]) == (
        True, 2, 1)
    cache = json.loads(raw["raw/cache.json"])
    assert cache["cold_first_call_s"] == bench["modes"]["full_and_piecewise"]["compile_s"]
    assert cache["stats"]["inductor_compiles"] == 0
    doc = json.loads((out / "gpu_check.json").read_text())
    assert (doc["cuda"], doc["dry_run"], doc["passed"], doc["complete"]) == (
        False, True, True, True)
    readme = (out / "README.md").read_text().splitlines()
    assert readme[0].startswith("# freezeframe GPU check: CPU only, ")
    assert readme[2].startswith(NO_GPU_LINE)
    table = readme[readme.index("| batch | context | off ms | on ms | on splits | off/on | "
                                "auto splits |") + 2:][:3]
    ms = {(r["context"], r["split_kv"]): r["ms"] for r in splitkv["rows"]}
    assert table == [
        f"| 1 | 16 | {ms[16, 'off']:.4f} | {ms[16, 'on']:.4f} | 2 | "
        f"{ms[16, 'off'] / ms[16, 'on']:.2f} | 1 (= off) |",
        f"| 1 | 32 | {ms[32, 'off']:.4f} | {ms[32, 'on']:.4f} | 2 | "
        f"{ms[32, 'off'] / ms[32, 'on']:.2f} | 1 (= off) |", ""]
    ratios = readme[readme.index("| batch | off 32/16 | on 32/16 | auto 32/16 |") + 2]
    assert ratios == (f"| 1 | {ms[32, 'off'] / ms[16, 'off']:.2f} | "
                      f"{ms[32, 'on'] / ms[16, 'on']:.2f} | {ms[32, 'off'] / ms[16, 'off']:.2f} |")
    assert (out / "console.log").read_text().splitlines() == lines


def test_a_plan_over_its_budget_fails_the_dry_run(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from freezeframe.bench import gpu_check
    from freezeframe.bench.gpu_run import StepResult

    # the environment probe stubbed (a child process importing torch): every other step is
    # skipped, so only the plan can fail the run
    monkeypatch.setattr(gpu_check, "step_environment",
                        lambda run: StepResult("environment", summary="stubbed"))
    argv = ["--dry-run", "--skip", "kernels,splitkv,bench,tests,ubatch,cache", "--out",
            str(tmp_path)]
    assert main([*argv, "--timeout", "environment=480"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "plan: 480 s of deadlines"
    assert main([*argv, "--timeout", "environment=481"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == ["gpu_check: the plan's deadlines add up to more than the 480 s "
                          "budget", "plan: 481 s of deadlines"]


def test_the_plan_adds_the_deadlines_the_module_derives() -> None:
    """Every step's GPU deadline is stated, with the measured figures it comes from, in
    gpu_steps' docstring, and the deadlines fill the 8-minute budget exactly (a lent GPU comes
    with about 15 minutes in all, a cold start included)."""
    from freezeframe.bench import gpu_steps

    assert CUDA_BUDGET_S == 480
    assert list(DEADLINES) == list(STEPS) == ["environment", "kernels", "splitkv", "bench",
                                              "tests", "ubatch", "cache"]
    assert sum(d.cuda for d in DEADLINES.values()) == CUDA_BUDGET_S
    doc = gpu_steps.__doc__ or ""
    for name, deadline in DEADLINES.items():
        assert f"``{name}`` {deadline.cuda:.0f} s" in doc
    assert "Total: 15 + 35 + 15 + 315 + 45 + 20 + 35 = 480 s." in doc
    lines, total = plan_lines(CheckOptions(steps=STEPS, skip=frozenset({"cache"})))
    assert (lines[-1], total) == ("plan: 445 s of deadlines", 445)
    assert lines[-2] == "  cache        skipped"


@pytest.mark.parametrize("outcome", ["passes", "fails"])
def test_a_failing_step_makes_the_exit_status_non_zero(tmp_path: Path, outcome: str) -> None:
    suite = tmp_path / f"test_{outcome}.py"
    suite.write_text("def test_it():\n    assert 1 + 1 == " + ("2" if outcome == "passes"
                                                               else "3") + "\n")
    out = tmp_path / "results"
    proc = run_script("--quick", "--skip", "kernels,bench", "--skip", "cache",
                      "--emulated-tests", str(suite), "--out", str(out))
    doc = json.loads((out / "gpu_check.json").read_text())
    assert [(name, status) for name, status, _ in statuses(out)] == [
        ("environment", "passed"), ("kernels", "skipped"), ("splitkv", "skipped"),
        ("bench", "skipped"), ("tests", "passed" if outcome == "passes" else "failed"),
        ("ubatch", "skipped"), ("cache", "skipped")]
    assert statuses(out)[2][2] == statuses(out)[5][2] == NEEDS_CUDA
    tests = doc["steps"][4]
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
    log = raw_files(out)["raw/tests_emulated.log"].decode().splitlines()
    assert log[0] == (f"$ {sys.executable} -m pytest -v -rA -p no:cacheprovider "
                      f"-m 'not cuda and not inductor' {suite}")
    assert f"{suite.name}::test_it {'PASSED' if outcome == 'passes' else 'FAILED'}" in \
        "\n".join(log)


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
    assert pytest_summary("285/551 tests collected (266 deselected) in 4.77s\n") == (
        "285/551 tests collected (266 deselected) in 4.77s",
        {"collected": 285, "deselected": 266})
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


def test_a_stopped_run_still_writes_what_it_measured(tmp_path: Path) -> None:
    """``timeout`` wrapping the command sends SIGTERM: the step in progress (here the
    environment probe, a child importing torch) is killed and failed, and the report and the
    return files are written all the same."""
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first == "gpu_check: [1/7] environment\n"
    time.sleep(0.5)  # the probe has started; it takes seconds to import torch
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, first + rest
    assert rest.splitlines()[0] == "gpu_check: stopped by SIGTERM; writing what was measured"
    assert statuses(out) == [
        ("environment", "failed", "stopped by SIGTERM (the run's time was up)")]
    log = raw_files(out)["raw/environment.log"].decode().splitlines()
    assert log[1].startswith("# exit: stopped, ")  # its child's whole group was killed
    assert sorted(p.name for p in out.iterdir()) == sorted(set(RETURN_FILES) - {"bench.json"})
    assert check_layout(out) == []


def test_the_return_layout_is_checked_and_the_archive_kept_under_its_limit(
        tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    (raw / "a" / "b").mkdir(parents=True)
    (raw / "small.log").write_text("x" * 100)
    (raw / "a" / "b" / "big.json").write_bytes(os.urandom(20_000))  # incompressible
    limits = Limits(file_bytes=8_000)
    left_out = pack(raw, out, None, ["one", "two"], limits)
    assert left_out == ["a/b/big.json"]
    assert (out / "console.log").read_text() == "one\ntwo\n"
    assert sorted(raw_files(out)) == ["raw/small.log"]
    assert check_layout(out, limits) == []
    (out / "x" / "y" / "z").mkdir(parents=True)
    (out / "x" / "y" / "z" / "deep.txt").write_text("d")
    (out / "bad name.txt").write_text("b")
    for i in range(5):
        (out / f"f{i}").write_text("f")
    assert check_layout(out, limits) == [
        f"9 files in {out}, more than the 8 that come back",
        "bad name.txt: name 'bad name.txt' has characters besides letters, digits, '.', '_' "
        "and '-'",
        "x/y/z/deep.txt: 3 folders deep, more than 2"]


def test_the_cache_bench_writes_its_json_after_every_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/bench_cache.py's starts are stubbed (each is a fresh process with Inductor,
    minutes on this CPU): after each one the JSON holds every start so far."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_cache", REPO / "scripts" /
                                                  "bench_cache.py")
    assert spec is not None and spec.loader is not None
    bench_cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_cache)
    target = tmp_path / "cache.json"
    timings = {"baseline": (10.0, 1.0), "cold": (70.0, 60.0), "warm": (13.0, 4.0)}
    seen: list[list[str]] = []

    def start(kind: str, *args: Any) -> dict[str, Any]:
        if target.exists():  # what the JSON held when this start began
            seen.append([k for k in ("baseline", "cold", "warms")
                         if json.loads(target.read_text())[0].get(k)])
        process_s, first_call_s = timings[kind]
        return {"process_s": process_s, "first_call_s": first_call_s, "stats": {},
                "inductor_load_s": 1.5, "checksum": 1.0, "out": [1.0], "stages": {},
                "compile_fx_imported": kind == "cold"}

    monkeypatch.setattr(bench_cache, "_start", start)
    assert bench_cache.main(["--presets", "tiny", "--warm-runs", "2", "--json",
                             str(target)]) == 0
    assert seen == [["baseline"], ["baseline", "cold"], ["baseline", "cold", "warms"]]
    entry = json.loads(target.read_text())[0]
    assert entry["warm_cold_first_call"] == pytest.approx(4.0 / 60.0)
    assert entry["warm_cold_startup"] == pytest.approx(3.0 / 60.0)
    assert len(entry["warms"]) == 2 and entry["identical"] is True


def test_the_kernel_timeline_of_a_replay_says_which_communication_overlapped() -> None:
    from freezeframe.bench.ubatch_probe import kernel_timeline

    def kernel(name: str, ts: float, dur: float) -> dict[str, Any]:
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}

    trace = {"traceEvents": [
        kernel("gemm_a", 1000, 100), kernel("spin_kernel", 1100, 300),  # mb 0: compute, comm
        kernel("gemm_b", 1150, 100),  # mb 1's compute during mb 0's comm
        kernel("spin_kernel", 1400, 50), kernel("gemm_c", 1500, 10),  # after it: no overlap
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000},
    ]}
    timeline = kernel_timeline(trace)
    assert timeline["comm_overlaps"] == [True, False]
    assert timeline["kernels"] == [[0.0, 0.1, "gemm_a"], [0.1, 0.4, "spin_kernel"],
                                   [0.15, 0.25, "gemm_b"], [0.4, 0.45, "spin_kernel"],
                                   [0.5, 0.51, "gemm_c"]]
    assert kernel_timeline({"traceEvents": []}) == {"kernels": [], "comm_overlaps": []}


def test_the_split_kv_table_sets_off_and_on_side_by_side() -> None:
    """The report's split-KV section from a probe's rows (made up, two batch sizes: "auto"
    takes the split at one and one pass at the other), and the step's one-line headline."""
    from freezeframe.bench.gpu_report import _splitkv_section
    from freezeframe.bench.gpu_run import StepResult
    from freezeframe.bench.gpu_steps import splitkv_headline

    ms = {(1, 128, "off"): 0.2, (1, 128, "on"): 0.1, (1, 4096, "off"): 4.0,
          (1, 4096, "on"): 0.5, (16, 128, "off"): 0.3, (16, 128, "on"): 0.4,
          (16, 4096, "off"): 6.0, (16, 4096, "on"): 5.0}
    splits = {1: 16, 16: 2}
    data = {"device": "GPU", "timing": "graph replays", "steps": 20, "warmup": 3,
            "tolerance": 0.01, "batch_sizes": [1, 16], "contexts": [128, 4096],
            "modes": ["off", "on"], "auto_splits": {"1": 16, "16": 1},
            "shape": {"preset": "1b", "heads": 32, "kv_heads": 8, "head_dim": 64,
                      "layers": 16, "block_size": 16, "max_blocks": 257, "dtype": "bfloat16"},
            "rows": [{"batch": b, "context": c, "split_kv": m, "ms": t,
                      "splits": splits[b] if m == "on" else 1} for (b, c, m), t in ms.items()]}
    lines = _splitkv_section(StepResult("splitkv", details=data))
    assert lines[0] == "## Split-KV: the attention op alone"
    assert lines[2].startswith("1b preset's decode attention, 16 layers' calls per step (32 "
                               "query heads, 8 KV heads, head dim 64, blocks of 16, a table of "
                               "257 blocks, bfloat16) on GPU: graph replays; 20 timed after 3.")
    assert lines[4:] == [
        "| batch | context | off ms | on ms | on splits | off/on | auto splits |",
        "|---|---|---|---|---|---|---|",
        "| 1 | 128 | 0.2000 | 0.1000 | 16 | 2.00 | 16 (= on) |",
        "| 1 | 4096 | 4.0000 | 0.5000 | 16 | 8.00 | 16 (= on) |",
        "| 16 | 128 | 0.3000 | 0.4000 | 2 | 0.75 | 1 (= off) |",
        "| 16 | 4096 | 6.0000 | 5.0000 | 2 | 1.20 | 1 (= off) |",
        "",
        "| batch | off 4096/128 | on 4096/128 | auto 4096/128 |",
        "|---|---|---|---|",
        "| 1 | 20.00 | 5.00 | 5.00 |",
        "| 16 | 20.00 | 12.50 | 20.00 |"]
    assert splitkv_headline(data) == ("; batch 1, context 4096: off 4.000 ms, on 0.500 ms "
                                      "(16 splits, off/on 8.00)")
    data["rows"] = data["rows"][:3]  # batch 1, context 4096, "on" not measured
    assert splitkv_headline(data) == ""
