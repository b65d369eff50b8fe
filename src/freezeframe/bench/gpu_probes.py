"""The checks of ``scripts/gpu_check`` that run inside a child process, one per command.

    python -m freezeframe.bench.gpu_probes environment --json OUT.json
    python -m freezeframe.bench.gpu_probes capture --json OUT.json [--preset 1b]
    python -m freezeframe.bench.gpu_probes ubatch --json OUT.json --trace TRACE.json

Each writes one JSON object to ``--json`` with ``"ok"`` (did the check pass) and ``"problems"``
(why not, one sentence each), and exits 0 when ok, 1 when a check failed. Anything else (a
crash, a timeout) is reported by the parent from the exit status and stderr. They run in child
processes so that a CUDA fault or an out-of-memory in one check cannot take the others down,
and so that each starts with fresh device memory.

``environment`` must work without torch installed (it is what says torch is missing), so every
import of torch here is inside a function.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from freezeframe.bench.measure import StepBuilder
    from freezeframe.bench.modes import CompiledLlama
    from freezeframe.config import CompilationConfig
    from freezeframe.models import LlamaModel
    from freezeframe.models.inputs import StepInputs
    from freezeframe.runtime.runner import CaptureReport

__all__ = ["MIN_TORCH", "main", "overlapping_kernel_pairs", "probe_environment"]

MIN_TORCH = (2, 11)
# what freezeframe needs on every machine / on a CUDA machine / to run the test tiers
NEEDED = ("torch",)
NEEDED_ON_CUDA = ("triton",)
NEEDED_FOR_TESTS = ("pytest",)
# optional extras: without them the bench prints plain progress lines and writes no plot
OPTIONAL = ("tqdm", "matplotlib", "hypothesis")


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


# -- capture report -------------------------------------------------------------------------

def probe_capture(preset: str, compiler: str, tolerance: float,
                  allow_cpu: bool = False) -> dict[str, Any]:
    """Compile the Llama preset, capture the default ladder (FULL_AND_PIECEWISE) on CUDA, and
    check graph replays against the uncompiled model.

    The configuration is the one ``freezeframe bench`` uses for its ``full_and_piecewise`` mode
    at batch sizes up to 64 (max_num_seqs 65, max_num_tokens 512), so a compile cache the bench
    filled in the same check run makes this compile a warm start. ``allow_cpu`` runs the same
    code on the emulated backend without CUDA (to test this probe; its figures mean nothing).
    """
    import torch

    from freezeframe.bench.measure import StepBuilder, StepShapes
    from freezeframe.bench.modes import graph_config
    from freezeframe.models import build_llama
    from freezeframe.models.serving import EagerForward

    on_cuda = torch.cuda.is_available()
    if not on_cuda and not allow_cpu:
        return {"ok": False, "problems": ["needs CUDA: torch.cuda.is_available() is False"]}
    device = torch.device("cuda" if on_cuda else "cpu")
    shapes = StepShapes.for_preset(preset, max_bs=64, mixed_chunk=16)
    steps = StepBuilder(shapes, shapes.cache_config(), device)
    base = build_llama(preset, steps.cache, device=device, seed=0)
    config = graph_config(shapes, "FULL_AND_PIECEWISE", compiler, on_cuda)
    captured = _compile_and_capture(base, config, steps)
    eager = EagerForward(base)
    replay_steps = [("decode bs1", steps.decode(1)), ("decode bs5 (padded)", steps.decode(5)),
                    ("decode bs64", steps.decode(shapes.max_bs)), ("mixed bs8", steps.mixed(8))]
    checks = [_check_replays(name, step, captured.llama, eager, base)
              for name, step in replay_steps]
    problems = [problem for check in checks for problem in check.problems(tolerance)]
    return {
        "ok": not problems,
        "problems": problems,
        "preset": preset,
        "compiler": compiler,
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu (emulated graphs)",
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "capture_sizes": list(config.cudagraph_capture_sizes or ()),
        **captured.to_json(),
        "replay_checks": [dataclasses.asdict(check) for check in checks],
        "runner_stats": captured.llama.runner.stats.snapshot(),
        "model_stats": captured.llama.compiled.stats.snapshot(),
    }


@dataclasses.dataclass(frozen=True)
class _Captured:
    """The compiled Llama after capture, and what compiling and capturing cost."""

    llama: CompiledLlama
    report: CaptureReport
    weights_bytes: int
    compile_s: float
    reserved_growth_bytes: int

    def to_json(self) -> dict[str, Any]:
        report = self.report
        return {
            "weights_bytes": self.weights_bytes,
            "compile_s": self.compile_s,
            "capture_s": report.seconds,
            "capture_memory_bytes": report.memory_bytes,
            "reserved_growth_bytes": self.reserved_growth_bytes,
            "predicted_memory_bytes": report.predicted_bytes,
            "prediction_error": report.prediction_error,
            "summary": report.summary(),
            "graphs": [{"mode": g.mode.name, "num_tokens": g.descriptor.num_tokens,
                        "num_reqs": g.descriptor.num_reqs, "uniform": g.descriptor.uniform,
                        "seconds": g.seconds, "memory_bytes": g.memory_bytes,
                        "predicted_bytes": g.predicted_bytes, "probe": g.probe}
                       for g in report.graphs],
        }


def _compile_and_capture(base: LlamaModel, config: CompilationConfig,
                         steps: StepBuilder) -> _Captured:
    """Compile on the bench's largest mixed step, then capture every graph of ``config``."""
    import torch

    from freezeframe.bench.modes import compile_with_runner

    on_cuda = steps.device.type == "cuda"
    started = time.perf_counter()

    def say(what: str) -> None:  # progress on stderr: a probe killed at its deadline says where
        print(f"capture probe: {time.perf_counter() - started:6.1f} s {what}", file=sys.stderr,
              flush=True)

    def memory(fn: Callable[[torch.device], int]) -> int:
        return fn(steps.device) if on_cuda else 0

    weights_bytes = memory(torch.cuda.memory_allocated)
    t0 = time.perf_counter()
    # a budget the capture cannot exceed (the whole device), so the runner measures a few
    # sizes first and predicts the rest: the report then sets prediction beside measurement
    budget = memory(lambda d: int(torch.cuda.get_device_properties(d).total_memory)) or None
    llama = compile_with_runner(base, config, steps.shapes, graph_memory_budget=budget)
    say("compiling")
    # compiles (a dynamic dim first seen as 1 is specialised)
    _replay_logits(llama.forward, steps.mixed(steps.shapes.max_bs), base)
    if on_cuda:
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    say(f"compiled in {compile_s:.1f} s; capturing")
    reserved_before = memory(torch.cuda.memory_reserved)
    report = llama.runner.capture()
    reserved_after = memory(torch.cuda.memory_reserved)
    say(f"captured: {report.summary()}")
    return _Captured(llama, report, weights_bytes, compile_s, reserved_after - reserved_before)


def _replay_logits(forward: Callable[[StepInputs], torch.Tensor], step: StepInputs,
                   base: LlamaModel) -> torch.Tensor:
    """Each request's logits (float32) of one step through ``forward``."""
    import torch

    with torch.no_grad():
        hidden = forward(step)
        return base.compute_logits(hidden[step.last_token_index()]).float()


@dataclasses.dataclass(frozen=True)
class ReplayCheck:
    """Two replays of one step against the uncompiled model (a ``replay_checks`` entry)."""

    step: str
    graph_replays: int  # of the two runner steps, those that replayed a graph
    relative_error: float  # relative L2 difference of the logits from the uncompiled model's
    finite: bool
    replay_repeatable: bool  # both replays gave the same logits

    def problems(self, tolerance: float) -> list[str]:
        name = self.step
        problems: list[str] = []
        if not self.finite:
            problems.append(f"{name}: non-finite logits from the captured graphs")
        if self.relative_error > tolerance:
            problems.append(f"{name}: logits differ from the uncompiled model by "
                            f"{self.relative_error:.3g} (relative L2), more than the "
                            f"{tolerance:g} allowed")
        if not self.replay_repeatable:
            problems.append(f"{name}: two replays of the same step gave different logits")
        if self.graph_replays != 2:
            problems.append(f"{name}: {self.graph_replays} of 2 steps replayed a graph (the "
                            "others ran eagerly)")
        return problems


def _check_replays(name: str, step: StepInputs, llama: CompiledLlama,
                   eager: Callable[[StepInputs], torch.Tensor], base: LlamaModel) -> ReplayCheck:
    """Run ``step`` twice through the captured graphs and once through ``eager``."""
    import torch

    before = llama.runner.stats.snapshot()
    got = _replay_logits(llama.forward, step, base)
    again = _replay_logits(llama.forward, step, base)
    after = llama.runner.stats.snapshot()
    # the runner counts each step by its graph mode
    replays = sum(after.get(k, 0) - before.get(k, 0) for k in ("steps_piecewise", "steps_full"))
    want = _replay_logits(eager, step, base)
    rel = float((got - want).norm() / want.norm().clamp_min(1e-12))
    return ReplayCheck(step=name, graph_replays=replays, relative_error=rel,
                       finite=bool(torch.isfinite(got).all()),
                       replay_repeatable=bool(torch.equal(got, again)))


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


def probe_ubatch(trace_path: Path, tokens: int, hidden: int, steps: int) -> dict[str, Any]:
    """A dual-batch step of a toy model (matmul compute, a spin kernel standing in for an
    all-to-all) through :class:`MicroBatchWrapper` on CUDA: outputs equal the unsplit model's,
    each micro-batch's communication overlaps the other's compute (CUDA events), the step time
    against the unsplit model, and a ``torch.profiler`` Chrome trace of split steps."""
    import torch

    from freezeframe.bench.ubatch_probe import MicroBatchedToy, median_ms, spin_cycles_per_ms

    if not torch.cuda.is_available():
        return {"ok": False, "problems": ["needs CUDA: torch.cuda.is_available() is False"]}
    gen = torch.Generator().manual_seed(0)
    cycles_per_ms = spin_cycles_per_ms()
    toy = MicroBatchedToy.build(tokens, hidden, gen)
    if toy is None:
        return {"ok": False, "problems": [f"plan_micro_batches did not split {tokens} tokens"]}
    comm_ms = toy.match_comm_to_compute(cycles_per_ms)
    output = toy.compare_with_unsplit()
    timeline = toy.event_timeline()
    split_ms = median_ms(toy.split, steps)
    unsplit_ms = median_ms(toy.unsplit, steps)
    toy.profile_split(trace_path)
    in_trace = overlapping_kernel_pairs(json.loads(trace_path.read_text()))
    problems = [*output.problems(), *timeline.problems(), *_trace_problems(in_trace)]
    return {
        "ok": not problems,
        "problems": problems,
        "device": torch.cuda.get_device_name(),
        "tokens": tokens,
        "hidden": hidden,
        "micro_batches": len(toy.plan.slices),
        "max_abs_diff_vs_unsplit": output.max_abs_diff,
        "comm_ms_target": comm_ms,
        "timeline_ms": timeline.phases_ms,
        "overlaps": timeline.overlaps(),
        "split_step_ms": split_ms,
        "unsplit_step_ms": unsplit_ms,
        "trace": trace_path.name,
        "trace_overlap": in_trace,
        "schedule": [list(e) for e in toy.wrapper.last_trace],
    }


def _trace_problems(in_trace: dict[str, Any]) -> list[str]:
    if in_trace["overlapping_pairs"] == 0:
        return ["the profiler trace shows no kernels on different streams running at the same "
                "time"]
    return []


# -- command line -----------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freezeframe.bench.gpu_probes",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="probe", required=True)
    env = sub.add_parser("environment")
    env.add_argument("--no-tests", action="store_true", help="pytest is not needed")
    cap = sub.add_parser("capture")
    cap.add_argument("--preset", default="1b")
    cap.add_argument("--compiler", choices=["eager", "inductor"], default="inductor")
    cap.add_argument("--allow-cpu", action="store_true",
                     help="run on the emulated backend without CUDA (tests this probe only)")
    cap.add_argument("--tolerance", type=float, default=5e-2,
                     help="largest relative L2 difference of logits from the uncompiled model")
    ub = sub.add_parser("ubatch")
    ub.add_argument("--trace", required=True, help="where to write the Chrome trace")
    ub.add_argument("--tokens", type=int, default=8192)
    ub.add_argument("--hidden", type=int, default=4096)
    ub.add_argument("--steps", type=int, default=20)
    for p in (env, cap, ub):
        p.add_argument("--json", required=True, help="where to write the result")
    args = parser.parse_args(argv)
    result: dict[str, Any]
    if args.probe == "environment":
        result = probe_environment(need_tests=not args.no_tests)
    elif args.probe == "capture":
        result = probe_capture(args.preset, args.compiler, args.tolerance, args.allow_cpu)
    else:
        result = probe_ubatch(Path(args.trace), args.tokens, args.hidden, args.steps)
    Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
