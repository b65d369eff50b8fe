"""The steps of ``scripts/gpu_check`` (see ``gpu_check``), their order and their deadlines.

Every step except ``environment`` runs its work in child processes with a deadline, so a crash
or a hang is a failed step, not a lost run; each writes into the run's work directory as it
goes. Only the standard library is imported here.

The plan. A GPU machine is lent for about 15 minutes of device time in all, a cold start of a
few minutes included, one command of at most 10 minutes. So the default run is held to
``CUDA_BUDGET_S`` = 480 s of deadlines, ordered by value: the kernel tests and the split-KV
rows (cheap, and the figure issue 44 turns on), the bench core, the cuda tests, then the rest.
Each deadline below is derived from what the two H100 runs of 2026-11-26 measured
(``docs/results/h100-80gb-hbm3-2026-11-26/``, run 1 and run 2) plus a margin; what has never
run on a GPU is estimated from the nearest measured figure, and says so.

- ``environment`` 15 s: measured 5.8 s (run 1) and 8.2 s (run 2); it now also imports
  transformers (lazily, about 2 s): 10.2 s, and 15 = 1.5 x that.
- ``kernels`` 35 s: the attention kernel's tests, 17 of them: 23.8 s (run 1, pytest 16.4 s)
  and 20.2 s (run 2, pytest 14.2 s), so about 6 s to start and 0.83 s a test; the file holds
  25 now: 6 + 25 x 0.83 = 27 s, x 1.3 = 35 s.
- ``splitkv`` 15 s (never run on a GPU): the attention op alone at the 1B preset's shapes, 24
  rows (batch 1/4/16/64 x context 128/1024/4096 x split-KV off/on). Start, import torch and
  CUDA's context: 5.8 s (run 1's environment step, which does the same and more); the Triton
  kernels at the 1B shapes, one attention build per split count (1, 2, 4, 16) and one combine
  per count above 1, 7 builds at most 0.83 s each (the kernels tier's rate above, a test
  building at least one): 5.8 s; the rows: 8.6 GB of random caches drawn on the device once
  (under 0.1 s at run 1's 3011 GB/s), then per row a capture of 16 launches or 32, a float32
  reference of two layers and 23 replays of at most 3 ms (16 layers x 64 requests x 4096
  positions of bf16 keys and values, 8.6 GB, at 3011 GB/s): about 1.5 s in all. 13.1 s,
  x 1.15 = 15 s: the rows are written as they are measured, batch 1 first, so a deadline that
  comes early costs the last rows of batch 64 only.
- ``bench`` 315 s, the sum of its parts (run 1: 135.1 s for eager, piecewise and
  full_and_piecewise):
  - start, build and bandwidth: import torch 4.2 s (run 2's cache baseline), build 4.6 s
    (run 1 ``model_build_s``), a 1 GiB copy under 1 s: 10 s;
  - eager: startup 1.65 s; 12 decode rows of the grid (3 contexts x 4 batch sizes) of
    12 steps at most 32.5 ms each (run 1's slowest eager decode) = 4.7 s; 4 mixed rows of 6
    steps at 30 ms = 0.7 s; prefill and first calls under 0.5 s: 7.5 s;
  - full_and_piecewise, the first freezeframe mode, so the cold compile: 69.3 s (run 1's
    first compile; run 2's capture probe 70.5 s) + capture of the default ladder 19.5 s
    (run 1; 11.8 s in run 2) + 12 grid rows x 12 steps x at most 13.5 ms = 1.9 s + mixed,
    prefill, the FULL replay's profile and launch count 2 s: 93 s;
  - piecewise: compile with Inductor's caches warm 4.2 s (run 1's second mode) + capture of
    the 8 sizes its steps use at 1.0 s each (run 1: 21 PIECEWISE graphs in 21.2 s) + rows
    3 s: 15 s;
  - breakable (never run on a GPU): no compile; its capture estimated as PIECEWISE's, 8 s,
    + rows 4 s: 12 s;
  - reduce-overhead (never run on a GPU): two torch.compile graphs (batch 1 and 4), each
    estimated at a third of the cold 69.3 s (Inductor's workers and kernel cache are warm in
    the bench's process by then): 2 x 25 = 50 s;
  - the Hugging Face modes (never run on a GPU): three 1.2 B models built on the device at
    about 3 s (the reference Llama's 4.6 s includes a host-side init) = 9 s; hf-eager 2 batch
    sizes x 2 generates x 64 tokens at about 25 ms (HF eager is host-bound like the
    reference's 26-33 ms) = 6.4 s; hf-compile two compiles as reduce-overhead's, 50 s, + its
    generates 2 s; ff-hf's compile 25 s and capture of 8 graphs at 0.35 s (run 2: 0.28-0.42 s
    a graph) 3 s, generates 2 s; ff-hf-lookup's four batch-1 generates 8 s: 105 s.
  The sum, 292.5 s, x 1.08 = 315 s. The modes run in that order (by value), and the bench
  writes its results after every timed row: a deadline that comes early costs the last rows.
- ``tests`` 45 s: the cuda tier, 285 tests; run 2 ran 33 in 30.1 s (0.73 s a test, its
  start included). Serially they would need about 210 s, so the tier runs on 8 pytest-xdist
  workers where xdist is installed (it is on the GPU image): 285 x 0.73 / 8 = 26 s, + 8 s for
  each worker's start: 34 s, x 1.3 = 45 s. Without xdist, or past the deadline, its log names
  every test that ran (``-v``).
- ``ubatch`` 20 s: run 1's eager probe took 11.8 s (8192 tokens, hidden 4096); capturing the
  split step once adds well under a second (run 2: 0.3 s a graph). 20 = 1.7 x.
- ``cache`` 35 s: a warm start of the bench's 1B mode from freezeframe's cache, one process:
  import 4.2 s + build 4.6 s (as above) + a warm first call of 5.8 s (run 2, tiny preset; the
  1B preset has as many distinct pieces, 3) + the ladder's capture 11.8-19.5 s (runs 2 and
  1): 34 s at the slower capture; 35 s.

Total: 15 + 35 + 15 + 315 + 45 + 20 + 35 = 480 s. The split-KV step's 15 s came from the
environment (20 -> 15), the kernels (40 -> 35) and the tests (50 -> 45), whose margins over
the measured figures were 1.5 x or more. A step's deadline is its own plus what the steps
before it left unused, never what the steps after it need (see ``CheckRun.deadline``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import time
from collections.abc import Callable, Mapping
from typing import Any

from freezeframe.bench.gpu_run import CheckRun, StepResult, pytest_summary

__all__ = ["CUDA_BUDGET_S", "CUDA_TESTS", "DEADLINES", "GPU_ONLY", "KERNEL_TESTS", "NEEDS_CUDA",
           "STEPS", "STEP_FUNCS", "Deadline", "cache_figures", "splitkv_headline",
           "step_deadline", "step_environment"]

STEPS = ("environment", "kernels", "splitkv", "bench", "tests", "ubatch", "cache")
GPU_ONLY = frozenset({"splitkv", "ubatch", "cache"})  # skipped on a CPU, except in a dry run
NEEDS_CUDA = "needs CUDA (torch.cuda.is_available() is False)"
CUDA_BUDGET_S = 480.0
CUDA_TESTS = ("tests/cuda", "tests/scenarios")  # where every cuda-marked test lives
# unmarked tests that run on the GPU when there is one (their DEVICE is cuda there)
KERNEL_TESTS = ("tests/unit/test_paged_attention.py",)
XDIST_WORKERS = 8


@dataclasses.dataclass(frozen=True)
class Deadline:
    """A step's deadline: ``cuda`` seconds in the GPU plan (see the module docstring), ``cpu``
    seconds on a CPU (no budget there; a dry run uses these), and where ``cuda`` comes from."""

    cuda: float
    cpu: float
    basis: str


DEADLINES: Mapping[str, Deadline] = {
    "environment": Deadline(15, 120, "measured 5.8 s and 8.2 s (runs 1, 2) + transformers"),
    "kernels": Deadline(35, 600, "measured 23.8 s and 20.2 s for 17 tests; 25 now"),
    "splitkv": Deadline(15, 180, "estimated: start 5.8 s (run 1) + 7 kernel builds + 24 rows"),
    "bench": Deadline(315, 900, "run 1: 135 s for 3 modes; + breakable, reduce-overhead, HF "
                                "(estimated)"),
    "tests": Deadline(45, 900, "run 2: 0.73 s a test; 285 tests on 8 xdist workers"),
    "ubatch": Deadline(20, 120, "measured 11.8 s (run 1) + one capture"),
    "cache": Deadline(35, 300, "import 4.2 + build 4.6 + warm first call 5.8 + capture 19.5"),
}
MIN_STEP_S = 10.0  # a step is not started with less time than this left in the budget


def step_deadline(step: str, cuda: bool, timeouts: Mapping[str, float]) -> float:
    """A step's own deadline: ``--timeout`` where given, else its plan's."""
    return timeouts.get(step, DEADLINES[step].cuda if cuda else DEADLINES[step].cpu)


# -- tests ------------------------------------------------------------------------------------

def _pytest_tier(run: CheckRun, result: StepResult, tier: str, argv: list[str],
                 timeout: float) -> str:
    """Run one pytest tier into ``tests_<tier>.log``; its summary line. A dry run writes the
    command into the log and runs nothing (collecting alone costs CI more than it checks)."""
    if run.dry:
        (run.raw / f"tests_{tier}.log").write_text(f"$ {shlex.join(argv)}\n# not run: a dry "
                                                   "run writes the command only\n")
        result.files.append(f"tests_{tier}.log")
        result.details[tier] = {"command": shlex.join(argv[1:]), "status": "skipped",
                                "reason": "dry run: the command only"}
        return f"{tier}: not run (dry run)"
    proc = run.child(argv, timeout, f"tests_{tier}.log", result)
    line, counts = pytest_summary(proc.stdout)
    info: dict[str, Any] = {"command": shlex.join(argv[1:]), "summary": line,
                            "counts": counts, "seconds": round(proc.seconds, 1)}
    if proc.timed_out:
        info["status"] = "failed"
        ran = sum(1 for text in proc.stdout.splitlines()
                  if re.search(r" (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", text))
        result.fail(f"{tier} tier: {proc.why(timeout)}, after {ran} tests (see "
                    f"tests_{tier}.log)")
    elif proc.returncode != 0 or not counts.get("passed"):
        info["status"] = "failed"
        result.fail(f"{tier} tier: {line} (pytest exit {proc.returncode}; see "
                    f"tests_{tier}.log)")
    else:
        info["status"] = "passed"
    result.details[tier] = info
    return f"{tier}: {line}"


def _pytest(run: CheckRun) -> list[str]:
    """pytest, verbose into its log: a tier stopped at its deadline still names every test
    it ran, and ``-rA`` lists each outcome at the end of one that finished."""
    return [run.python, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider"]


def _step_kernels(run: CheckRun, result: StepResult, timeout: float) -> None:
    result.summary = _pytest_tier(run, result, "kernels", [*_pytest(run), *KERNEL_TESTS],
                                  timeout)


def _step_tests(run: CheckRun, result: StepResult, timeout: float) -> None:
    tiers: list[tuple[str, list[str]]] = []
    if run.cuda or run.dry:
        # every cuda-marked test lives in CUDA_TESTS (a unit test checks this); collecting only
        # there keeps the tier independent of test-only extras such as hypothesis
        workers = ["-n", str(XDIST_WORKERS)] if run.has("xdist") and not run.dry else []
        tiers.append(("cuda", [*_pytest(run), *workers, "-m", "cuda", *CUDA_TESTS]))
    else:
        result.details["cuda"] = {"status": "skipped", "reason": NEEDS_CUDA}
    if not run.dry and (not run.cuda or run.opts.emulated_tier):
        marks = ["-m", "not cuda and not inductor" if run.opts.quick else "not cuda"]
        tiers.append(("emulated", [*_pytest(run), *marks, *run.opts.emulated_tests]))
    else:
        result.details["emulated"] = {
            "status": "skipped", "reason": "runs on CPU (CI runs it on every commit); "
                                          "--emulated-tier runs it on a GPU too"}
    end = time.perf_counter() + timeout
    lines = []
    for tier, argv in tiers:
        left = end - time.perf_counter()
        if left < 1:
            result.fail(f"{tier} tier: not started, the step's {timeout:.0f} s were spent")
            continue
        lines.append(_pytest_tier(run, result, tier, argv, left))
    if not run.cuda and not run.dry:
        lines.insert(0, "cuda: skipped, needs CUDA")
    result.summary = "; ".join(lines)


# -- bench ------------------------------------------------------------------------------------

#: the bench's modes on a GPU, by value (a deadline that comes early costs the last)
GPU_MODES = ("eager,full_and_piecewise,piecewise,breakable,reduce-overhead,"
             "hf-eager,ff-hf,hf-compile,ff-hf-lookup")


def bench_args(cuda: bool, quick: bool, dry: bool, peers: bool = False) -> list[str]:
    """``freezeframe bench``'s arguments for this run."""
    if dry:  # every mode of the GPU run, at the tiniest shapes and step counts
        return ["--preset", "tiny", "--batch-sizes", "1,2", "--contexts", "128", "--grid",
                "--modes", GPU_MODES, "--steps", "1", "--warmup", "1", "--prefill-len", "4",
                "--mixed-chunk", "2", "--hf-new-tokens", "3", "--device", "cpu"]
    if cuda:
        modes = GPU_MODES + (",compile" if peers else "")
        if quick:
            return ["--preset", "1b", "--batch-sizes", "1,64", "--contexts", "128,4096",
                    "--modes", "eager,full_and_piecewise,piecewise", "--steps", "5",
                    "--warmup", "1", "--device", "cuda"]
        return ["--preset", "1b", "--batch-sizes", "1,4,16,64", "--contexts", "128,1024,4096",
                "--grid", "--modes", modes, "--steps", "10", "--warmup", "2",
                "--hf-new-tokens", "64", "--device", "cuda"]
    if quick:
        return ["--preset", "tiny", "--batch-sizes", "1,2", "--modes",
                "eager,none,full_and_piecewise", "--steps", "3", "--warmup", "1",
                "--device", "cpu"]
    return ["--preset", "tiny", "--batch-sizes", "1,2,4,8", "--device", "cpu"]


def _step_bench(run: CheckRun, result: StepResult, timeout: float) -> None:
    out = run.raw / "bench"
    args = [*bench_args(run.cuda, run.opts.quick, run.dry, run.opts.peers), "--out", str(out),
            "-q"]
    result.details["command"] = "freezeframe bench " + " ".join(
        a if a != str(out) else "OUT/bench" for a in args)
    out.mkdir(exist_ok=True)
    (out / "results.json").unlink(missing_ok=True)
    proc = run.child([run.python, "-m", "freezeframe.cli", "bench", *args], timeout,
                     "bench/bench.log", result)
    if proc.returncode != 0:
        result.fail(f"freezeframe bench failed: {proc.why(timeout)}")
    if not (out / "results.json").exists():
        if proc.returncode == 0:
            result.fail("freezeframe bench wrote no results.json")
        return
    # the bench rewrites results.json after every timed row: a bench stopped at its deadline
    # still reports what it timed
    data = json.loads((out / "results.json").read_text())
    table = "\n".join(line for line in proc.stdout.strip().splitlines()
                      if not line.startswith(("wrote ", "USDT:")))
    if table:
        (out / "table.txt").write_text(table + "\n")
        result.details["table"] = table
    result.files += [str(p.relative_to(run.raw)) for p in sorted(out.iterdir())
                     if p.name in ("results.json", "latency_vs_batch.png", "table.txt")]
    _bench_summary(result, data, proc.returncode != 0)


def _bench_summary(result: StepResult, data: Mapping[str, Any], stopped: bool) -> None:
    modes = data.get("modes", {})
    timed = [m for m, e in modes.items() if "decode" in e or "generate" in e]
    failed = {m: e["error"] for m, e in modes.items() if "error" in e}
    skipped = {m: e["skipped"] for m, e in modes.items() if "skipped" in e}
    planned = {m: f"{e['planned_steps']}/{e['timed_steps']}" for m, e in modes.items()
               if e.get("planned_steps") is not None}
    result.details.update(notes=data.get("notes", []), skipped_modes=skipped,
                          failed_modes=failed, planned_steps=planned,
                          comparisons=data.get("comparisons", {}))
    for mode, error in failed.items():
        result.fail(f"bench mode {mode}: {error[:300]}")
    unfinished = data.get("unfinished_modes", [])
    result.summary = (f"{data.get('preset')} preset on {data.get('device')}: "
                      f"{len(timed)} modes timed at batch sizes {data.get('batch_sizes')}"
                      + (f"; planned steps {planned}" if planned else "")
                      + (f"; skipped {sorted(skipped)}" if skipped else "")
                      + (f"; not reached {unfinished}" if unfinished and stopped else ""))


# -- probes -----------------------------------------------------------------------------------

def _probe(run: CheckRun, name: str, args: list[str], result: StepResult, timeout: float,
           env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """A ``gpu_probes`` child writing ``<name>.json`` into the work directory (after each
    measurement); its JSON (what it wrote before a kill too), or None when it wrote none."""
    target = run.raw / f"{name}.json"
    target.unlink(missing_ok=True)
    proc = run.child([run.python, "-m", "freezeframe.bench.gpu_probes", *args,
                      "--json", str(target)], timeout, f"{name}.log", result, env)
    data: dict[str, Any] | None = json.loads(target.read_text()) if target.exists() else None
    if data is not None:
        result.files.append(target.name)
    if proc.returncode not in (0, 1) or data is None or not data.get("finished"):
        result.fail(f"the {name} probe did not finish: {proc.why(timeout)}")
    for problem in (data or {}).get("problems", []):
        result.fail(problem)
    return data


def _step_ubatch(run: CheckRun, result: StepResult, timeout: float) -> None:
    args = ["ubatch", "--trace", str(run.raw / "ubatch_trace.json")]
    if run.dry:
        args += ["--tokens", "8", "--hidden", "16", "--steps", "1"]
    elif run.opts.quick:
        args += ["--tokens", "4096", "--steps", "10"]
    data = _probe(run, "ubatch", args, result, timeout)
    if data is None:
        return
    result.details = data
    if (run.raw / "ubatch_trace.json").exists():
        result.files.append("ubatch_trace.json")
    if "split_step_ms" in data:
        overlaps = data.get("timeline", {}).get("comm_overlaps", [])
        result.summary = (f"{data['tokens']} tokens in {data['micro_batches']} micro-batches, "
                          f"captured as one FULL graph: replay {data['split_step_ms']:.3f} ms "
                          f"vs {data.get('unsplit_step_ms', float('nan')):.3f} ms unsplit; "
                          f"communication overlapping compute in {sum(overlaps)} of "
                          f"{len(overlaps)} spin kernels")


def _step_splitkv(run: CheckRun, result: StepResult, timeout: float) -> None:
    args = ["splitkv"]
    if run.dry:  # the tiny preset in Triton's interpreter: 4 rows
        args += ["--preset", "tiny", "--batch-sizes", "1", "--contexts", "16,32", "--steps",
                 "1", "--warmup", "0"]
    elif run.opts.quick:
        args += ["--batch-sizes", "1,64", "--contexts", "128,4096", "--steps", "10"]
    # on a CPU the kernels run in Triton's interpreter, chosen when triton is imported
    env = None if run.cuda else dict(run.env, TRITON_INTERPRET="1")
    data = _probe(run, "splitkv", args, result, timeout, env)
    if data is None:
        return
    result.details = data
    rows = data.get("rows", [])
    planned = len(data["batch_sizes"]) * len(data["contexts"]) * len(data["modes"])
    if len(rows) < planned:
        result.fail(f"split-KV probe: {len(rows)} of {planned} rows measured")
    result.summary = (f"{data['shape']['preset']} preset's attention alone, split-KV off and "
                      f"on: {len(rows)} of {planned} rows" + splitkv_headline(data))


def splitkv_headline(data: Mapping[str, Any]) -> str:
    """``"; batch B, context C: off X ms, on Y ms (N splits, off/on R)"`` for the smallest batch
    and the longest context measured, or ``""`` when that pair lacks a row."""
    ms = {(r["batch"], r["context"], r["split_kv"]): r for r in data.get("rows", [])}
    bs, context = min(data["batch_sizes"]), max(data["contexts"])
    off, on = ms.get((bs, context, "off")), ms.get((bs, context, "on"))
    if off is None or on is None:
        return ""
    return (f"; batch {bs}, context {context}: off {off['ms']:.3f} ms, on {on['ms']:.3f} ms "
            f"({on['splits']} splits, off/on {off['ms'] / on['ms']:.2f})")


def _step_cache(run: CheckRun, result: StepResult, timeout: float) -> None:
    bench = run.raw / "bench" / "results.json"
    if not bench.exists():
        result.fail("not run: the bench wrote no results.json to start its model warm")
        return
    inductor = run.work / "inductor_cache_warm"  # empty: only freezeframe's cache may help
    env = dict(run.env, TORCHINDUCTOR_CACHE_DIR=str(inductor))
    data = _probe(run, "cache", ["warmstart", "--bench", str(bench)], result, timeout, env)
    if data is None:
        return
    result.details = cache_figures(data)
    if "first_call_s" in data:
        ratio = data.get("warm_cold_first_call")
        result.summary = (f"{data['preset']} preset, warm start from freezeframe's cache: "
                          f"first call {data['first_call_s']:.2f} s"
                          + (f" against the bench's cold {data['cold_first_call_s']:.2f} s "
                             f"({ratio:.1%})" if ratio is not None else "")
                          + f"; counters {data['stats']}")


def cache_figures(data: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of a warm start the report shows (``gpu_probes warmstart``)."""
    keys = ("preset", "device", "stages", "first_call_s", "cold_first_call_s",
            "warm_cold_first_call", "stats", "capture", "process_s")
    return {k: data[k] for k in keys if k in data}


STEP_FUNCS: Mapping[str, Callable[[CheckRun, StepResult, float], None]] = {
    "kernels": _step_kernels, "splitkv": _step_splitkv, "bench": _step_bench,
    "tests": _step_tests, "ubatch": _step_ubatch, "cache": _step_cache,
}


def step_environment(run: CheckRun) -> StepResult:
    """Probe into the work dir (the out dir's name depends on the GPU found)."""
    result = StepResult("environment")
    t0 = time.perf_counter()
    target = run.raw / "environment.json"
    args = ["environment"] + (["--no-tests"] if {"kernels", "tests"} <= run.opts.skip else [])
    timeout = step_deadline("environment", False, run.opts.timeouts)
    result.deadline_s = timeout
    proc = run.child([run.python, "-m", "freezeframe.bench.gpu_probes", *args,
                      "--json", str(target)], timeout, "environment.log", result)
    if proc.returncode not in (0, 1) or not target.exists():
        result.fail(f"the environment probe did not finish: {proc.why(timeout)}")
    else:
        info = json.loads(target.read_text())
        run.env_info = info
        run.cuda = bool(info.get("cuda"))
        result.details = info
        result.files.append("environment.json")
        for problem in info["problems"]:
            result.fail(problem)
        pk = info["packages"]
        gpu = info.get("gpu")
        device = (f"{gpu['name']} ({gpu['memory_bytes'] / 2**30:.0f} GiB), driver "
                  f"{gpu['driver']}, CUDA {info['torch_cuda_build']}" if gpu else "no CUDA device")
        result.summary = (f"{device}; Python {info['python']}, torch {pk['torch']}, triton "
                          f"{pk['triton'] or 'not installed'}, transformers "
                          f"{pk.get('transformers') or 'not installed'}, freezeframe "
                          f"{info['freezeframe']}"
                          + (f"; optional extras missing: {', '.join(info['missing_optional'])}"
                             if info["missing_optional"] else ""))
    result.seconds = time.perf_counter() - t0
    return result
