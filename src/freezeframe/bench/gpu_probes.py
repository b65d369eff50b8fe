"""The checks of ``scripts/gpu_check`` that run inside a child process, one per command.

    python -m freezeframe.bench.gpu_probes environment --json OUT.json
    python -m freezeframe.bench.gpu_probes warmstart --json OUT.json [--preset 1b]
    python -m freezeframe.bench.gpu_probes ubatch --json OUT.json --trace TRACE.json
    python -m freezeframe.bench.gpu_probes splitkv --json OUT.json [--preset 1b]

Each writes one JSON object to ``--json`` with ``"ok"`` (did the check pass) and ``"problems"``
(why not, one sentence each), rewritten after each measurement (a probe killed at its deadline
leaves what it measured; ``"finished"`` is set at the end), and exits 0 when ok, 1 when a check
failed. Anything else (a crash, a timeout) is reported by the parent from the exit status and
stderr. They run in child
processes so that a CUDA fault or an out-of-memory in one check cannot take the others down,
and so that each starts with fresh device memory.

``environment`` must work without torch installed (it is what says torch is missing), so every
import of torch here is inside a function.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MIN_TORCH", "main", "overlapping_kernel_pairs", "probe_environment"]

MIN_TORCH = (2, 11)
# what freezeframe needs on every machine / on a CUDA machine / to run the test tiers
NEEDED = ("torch",)
NEEDED_ON_CUDA = ("triton",)
NEEDED_FOR_TESTS = ("pytest",)
# optional extras: without them the bench prints plain progress lines and writes no plot,
# skips its Hugging Face modes (transformers), and the cuda tier runs in one process (xdist)
OPTIONAL = ("tqdm", "matplotlib", "hypothesis", "transformers", "xdist")


def _version_of(dist: str) -> str | None:
    """The installed version of ``dist`` (import name), None when it cannot be imported."""
    try:
        module = importlib.import_module(dist)
    except Exception:  # an extra that is present but broken counts as missing
        return None
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown version"
    return str(version)


def _release(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (nvidia-smi not found)"
    try:
        proc = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown (nvidia-smi failed: {exc})"
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else \
        f"unknown (nvidia-smi exit {proc.returncode})"


def probe_environment(need_tests: bool = True) -> dict[str, Any]:
    """What is installed and which device there is; ``problems`` lists what the project needs
    and does not find (a missing optional extra is listed under ``missing_optional`` only)."""
    import freezeframe

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "freezeframe": freezeframe.__version__,
        "freezeframe_path": str(Path(freezeframe.__file__).resolve().parent),
        "cuda": False,
    }
    problems: list[str] = []
    versions = {name: _version_of(name) for name in
                (*NEEDED, *NEEDED_ON_CUDA, *NEEDED_FOR_TESTS, *OPTIONAL)}
    info["packages"] = versions
    info["missing_optional"] = [n for n in OPTIONAL if versions[n] is None]
    torch_version = versions["torch"]
    if torch_version is None:
        problems.append("torch is not importable: freezeframe needs torch >= "
                        f"{'.'.join(map(str, MIN_TORCH))} (pip install torch)")
    elif _release(torch_version) < MIN_TORCH:
        problems.append(f"torch {torch_version} is too old: freezeframe needs torch >= "
                        f"{'.'.join(map(str, MIN_TORCH))}")
    if need_tests:
        problems += [f"{n} is not importable: the test steps need it (pip install {n})"
                     for n in NEEDED_FOR_TESTS if versions[n] is None]
    if torch_version is not None:
        import torch

        info["torch_cuda_build"] = torch.version.cuda
        info["cuda"] = bool(torch.cuda.is_available())
        if info["cuda"]:
            index = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            info["gpu"] = {
                "name": props.name,
                "count": torch.cuda.device_count(),
                "memory_bytes": int(props.total_memory),
                "capability": f"{props.major}.{props.minor}",
                "multiprocessors": int(props.multi_processor_count),
                "driver": _driver_version(),
                "cudnn": torch.backends.cudnn.version(),
            }
            problems += [f"{n} is not importable: Inductor needs it on a CUDA machine"
                         for n in NEEDED_ON_CUDA if versions[n] is None]
            info["launcher_toolchain"], missing = _launcher_toolchain()
            problems += missing
    info["ok"] = not problems
    info["problems"] = problems
    return info


def _launcher_toolchain() -> tuple[dict[str, str | None], list[str]]:
    """What Triton builds its kernel launchers with at first use (a C compiler and Python's
    headers), and a problem for each one missing: without them the first Triton kernel (ours,
    or one Inductor generated) fails on the GPU, not before."""
    import sysconfig

    compiler = next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    found = {"c_compiler": compiler, "python_h": str(header) if header.exists() else None}
    problems = []
    if compiler is None:
        problems.append("no C compiler (cc, gcc or clang) on PATH: Triton builds its kernel "
                        "launchers with one at first use")
    if found["python_h"] is None:
        problems.append(f"Python's headers are missing ({header} not found): Triton builds its "
                        "kernel launchers against them (install python3-dev)")
    return found, problems


# -- compile cache: a warm start of the bench's model ---------------------------------------

def probe_warmstart(bench: dict[str, Any], write: Callable[[dict[str, Any]], None]
                    ) -> dict[str, Any]:
    """A warm start, in this fresh process, of the graph mode the bench compiled first
    (``full_and_piecewise``) on the bench's shapes and compiler, read from ``bench`` (its
    results.json), with freezeframe's cache the bench filled and Inductor's own cache empty
    (the caller points it at a fresh directory): the stages of the start, its first call (the
    bench's ``compile_s`` of that mode is the cold one) and the counters that say what was
    loaded rather than compiled. Written after each stage."""
    t0 = time.perf_counter()
    import torch

    from freezeframe.bench.measure import StepBuilder, StepShapes, logits_of, sync
    from freezeframe.bench.modes import LADDER_MODE, compile_with_runner, graph_config
    from freezeframe.models import build_llama

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    preset = bench["preset"]
    result: dict[str, Any] = {"ok": False, "problems": [], "preset": preset,
                              "device": torch.cuda.get_device_name() if cuda else "cpu",
                              "stages": {"import torch": time.perf_counter() - t0}}
    write(result)
    shapes = StepShapes(context=bench["context"], prefill_len=bench["prefill_len"],
                        max_bs=max(bench["batch_sizes"]), mixed_chunk=bench["mixed_chunk"],
                        contexts=tuple(bench["contexts"]))
    steps = StepBuilder(shapes, shapes.cache_config(), device)
    t1 = time.perf_counter()
    base = build_llama(preset, steps.cache, device=device, seed=0)
    sync(device)
    result["stages"]["build model"] = time.perf_counter() - t1
    write(result)
    t2 = time.perf_counter()
    config = graph_config(shapes, LADDER_MODE.upper(), bench["compiler"], cuda)
    llama = compile_with_runner(base, config, shapes)
    logits_of(llama.forward, steps.mixed(shapes.max_bs), base)()
    sync(device)
    result["first_call_s"] = result["stages"]["first call"] = time.perf_counter() - t2
    stats = llama.compiled.stats.snapshot()
    result["stats"] = {k: stats.get(k, 0) for k in (
        "inductor_compiles", "cache_hits", "cache_misses", "artifacts_loaded",
        "traces_loaded")}
    cold = bench.get("modes", {}).get(LADDER_MODE, {}).get("compile_s")
    if cold:
        result["cold_first_call_s"] = cold
        result["warm_cold_first_call"] = result["first_call_s"] / cold
    write(result)
    t3 = time.perf_counter()
    result["capture"] = llama.runner.capture().summary()
    result["stages"]["capture"] = time.perf_counter() - t3
    result["process_s"] = time.perf_counter() - t0
    loaded = result["stats"]["cache_hits"] + result["stats"]["artifacts_loaded"]
    if bench["compiler"] == "inductor" and (result["stats"]["inductor_compiles"] or not loaded):
        result["problems"].append(
            f"the warm start compiled ({result['stats']}): freezeframe's cache did not serve "
            "the bench's pieces")
    result["ok"] = not result["problems"]
    return result


# -- micro-batch overlap ----------------------------------------------------------------------

def overlapping_kernel_pairs(trace: dict[str, Any]) -> dict[str, Any]:
    """Kernels of a Chrome trace grouped by stream, and how many pairs on different streams
    run at the same time (the evidence of overlap in the trace itself)."""
    kernels: dict[int, list[tuple[float, float]]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel" or "dur" not in event:
            continue
        stream = int(event.get("args", {}).get("stream", -1))
        start = float(event["ts"])
        kernels.setdefault(stream, []).append((start, start + float(event["dur"])))
    pairs = 0
    streams = sorted(kernels)
    for i, a in enumerate(streams):
        for b in streams[i + 1:]:
            pairs += sum(1 for s0, e0 in kernels[a] for s1, e1 in kernels[b]
                         if s0 < e1 and s1 < e0)
    return {"kernels_per_stream": {str(s): len(kernels[s]) for s in streams},
            "overlapping_pairs": pairs}


def probe_ubatch(trace_path: Path, tokens: int, hidden: int, steps: int,
                 write: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A dual-batch step of a toy model (matmul compute, a spin kernel standing in for an
    all-to-all) through :class:`MicroBatchWrapper`, captured whole as one FULL graph: its
    replays against the unsplit model (outputs and time), the eager threaded split beside them,
    and a ``torch.profiler`` trace of replays whose kernel timeline shows whether each
    micro-batch's communication ran while the other computed. On a CPU the same code runs on
    the emulated backend (no overlap is possible there: a check of the probe, not a figure).
    Written after each measurement."""
    import torch

    from freezeframe.bench.ubatch_probe import (
        MicroBatchedToy,
        kernel_timeline,
        median_ms,
        spin_cycles_per_ms,
    )

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"ok": False, "problems": [], "tokens": tokens, "hidden": hidden,
                              "device": torch.cuda.get_device_name() if cuda else "cpu"}
    toy = MicroBatchedToy.build(tokens, hidden, gen, device)
    if toy is None:
        result["problems"].append(f"plan_micro_batches did not split {tokens} tokens")
        return result
    result["micro_batches"] = len(toy.plan.slices)
    if cuda:
        result["comm_ms_target"] = toy.match_comm_to_compute(spin_cycles_per_ms())
    result["capture_s"] = toy.capture()
    result["max_rel_diff_vs_unsplit"] = toy.check_replay(gen)
    write(result)
    for name, fn in (("split_step_ms", toy.replay), ("unsplit_step_ms", toy.unsplit),
                     ("eager_split_step_ms", toy.split)):
        result[name] = median_ms(fn, steps, cuda)
        write(result)
    toy.profile_replays(trace_path)
    trace = json.loads(trace_path.read_text())
    result["trace"] = trace_path.name
    result["trace_overlap"] = overlapping_kernel_pairs(trace)
    result["timeline"] = kernel_timeline(trace)
    result["graphs_captured"] = toy.wrapper.stats.get("graphs_captured")
    result["problems"] = _ubatch_problems(result, cuda)
    result["ok"] = not result["problems"]
    return result


def _ubatch_problems(result: dict[str, Any], cuda: bool) -> list[str]:
    problems = []
    # fp16 matmuls over half the rows may pick another kernel: rounding, no more
    if not result["max_rel_diff_vs_unsplit"] <= (1e-2 if cuda else 1e-5):
        problems.append(f"the captured split step differs from the unsplit model: "
                        f"{result['max_rel_diff_vs_unsplit']:.3g} of its largest output")
    if result["graphs_captured"] != 1:
        problems.append(f"{result['graphs_captured']} split graphs captured, expected 1")
    overlaps = result["timeline"]["comm_overlaps"]
    if cuda and not (overlaps and all(overlaps)):
        problems.append(f"the replayed split step's communication overlapped compute in "
                        f"{sum(overlaps)} of {len(overlaps)} spin kernels (profiler trace)")
    return problems


# -- split-KV: the attention op alone, on and off --------------------------------------------

def probe_splitkv(preset: str, batch_sizes: Sequence[int], contexts: Sequence[int], steps: int,
                  warmup: int, write: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The Triton attention op of one decode step (every layer) at ``preset``'s shapes, with
    split-KV off and on, at each batch size and context (:mod:`splitkv_probe`): a row per
    (batch size, context, mode), written as soon as it is measured, in that order; and per
    batch size the split count ``"auto"`` chose. A row whose output misses the float32
    reference is a problem."""
    import torch

    from freezeframe.bench.splitkv_probe import MODES, TOLERANCE, ProbeShape, SplitKVProbe
    from freezeframe.models.paged_attention_triton import interpreter_ready

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = ProbeShape.for_preset(preset, contexts, torch.bfloat16)
    result: dict[str, Any] = {
        "ok": False, "problems": [], "device": torch.cuda.get_device_name() if cuda else "cpu",
        "shape": shape.to_json(), "steps": steps, "warmup": warmup,
        "timing": ("one CUDA graph of the step's calls, CUDA events around each replay after "
                   "an L2 flush; median" if cuda else
                   "Triton's interpreter, wall clock: a check of the probe, not a speed figure"),
        "tolerance": TOLERANCE[shape.dtype], "batch_sizes": list(batch_sizes),
        "contexts": list(contexts), "modes": list(MODES), "rows": [], "auto_splits": {}}
    if not cuda and not interpreter_ready():
        result["problems"].append("no CUDA device and Triton's interpreter is off: run with "
                                  "TRITON_INTERPRET=1 set before triton is imported")
        return result
    probe = SplitKVProbe(shape, max(batch_sizes), max(contexts), device)
    for bs in batch_sizes:
        result["auto_splits"][str(bs)] = probe.splits(probe.step(bs, contexts[0]), "auto")
        for context in contexts:
            for mode in MODES:
                row = probe.row(bs, context, mode, steps, warmup)
                result["rows"].append(row)
                if not row["rel_error"] <= result["tolerance"]:
                    result["problems"].append(
                        f"split_kv={mode!r} at batch {bs}, context {context}: output off the "
                        f"float32 reference by {row['rel_error']:.3g} (relative L2; tolerance "
                        f"{result['tolerance']})")
                write(result)
    result["ok"] = not result["problems"]
    return result


# -- command line -----------------------------------------------------------------------------

def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freezeframe.bench.gpu_probes",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="probe", required=True)
    env = sub.add_parser("environment")
    env.add_argument("--no-tests", action="store_true", help="pytest is not needed")
    warm = sub.add_parser("warmstart")
    warm.add_argument("--bench", required=True, help="the bench's results.json")
    ub = sub.add_parser("ubatch")
    ub.add_argument("--trace", required=True, help="where to write the Chrome trace")
    ub.add_argument("--tokens", type=int, default=8192)
    ub.add_argument("--hidden", type=int, default=4096)
    ub.add_argument("--steps", type=int, default=20)
    sk = sub.add_parser("splitkv")
    sk.add_argument("--preset", default="1b")
    sk.add_argument("--batch-sizes", default="1,4,16,64")
    sk.add_argument("--contexts", default="128,1024,4096")
    sk.add_argument("--steps", type=int, default=20)
    sk.add_argument("--warmup", type=int, default=3)
    for p in (env, warm, ub, sk):
        p.add_argument("--json", required=True, help="where to write the result")
    args = parser.parse_args(argv)
    target = Path(args.json)

    def write(result: dict[str, Any]) -> None:  # after each measurement: a kill keeps it
        partial = target.with_name(f".{target.name}.partial")
        partial.write_text(json.dumps(result, indent=2, default=str))
        os.replace(partial, target)

    result: dict[str, Any]
    if args.probe == "environment":
        result = probe_environment(need_tests=not args.no_tests)
    elif args.probe == "warmstart":
        result = probe_warmstart(json.loads(Path(args.bench).read_text()), write)
    elif args.probe == "ubatch":
        result = probe_ubatch(Path(args.trace), args.tokens, args.hidden, args.steps, write)
    else:
        result = probe_splitkv(args.preset, _ints(args.batch_sizes), _ints(args.contexts),
                               args.steps, args.warmup, write)
    result["finished"] = True
    write(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
