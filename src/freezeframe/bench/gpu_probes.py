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
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from freezeframe.bench.run import CompiledLlama, StepBuilder
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
    info["ok"] = not problems
    info["problems"] = problems
    return info


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

    from freezeframe.bench.run import StepBuilder, StepShapes, graph_config
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
            # freezeframe has no estimate of graph memory before capture: nothing to compare with
            "predicted_memory_bytes": None,
            "summary": report.summary(),
            "graphs": [{"mode": g.mode.name, "num_tokens": g.descriptor.num_tokens,
                        "num_reqs": g.descriptor.num_reqs, "uniform": g.descriptor.uniform,
                        "seconds": g.seconds, "memory_bytes": g.memory_bytes}
                       for g in report.graphs],
        }


def _compile_and_capture(base: LlamaModel, config: CompilationConfig,
                         steps: StepBuilder) -> _Captured:
    """Compile on the bench's largest mixed step, then capture every graph of ``config``."""
    import torch

    from freezeframe.bench.run import compile_with_runner

    on_cuda = steps.device.type == "cuda"

    def memory(fn: Callable[[torch.device], int]) -> int:
        return fn(steps.device) if on_cuda else 0

    weights_bytes = memory(torch.cuda.memory_allocated)
    t0 = time.perf_counter()
    llama = compile_with_runner(base, config, steps.shapes)
    # compiles (a dynamic dim first seen as 1 is specialised)
    _replay_logits(llama.forward, steps.mixed(steps.shapes.max_bs), base)
    if on_cuda:
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    reserved_before = memory(torch.cuda.memory_reserved)
    report = llama.runner.capture()
    reserved_after = memory(torch.cuda.memory_reserved)
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
    from torch import nn

    import freezeframe as ff
    from freezeframe.batch import BatchDescriptor
    from freezeframe.config import CompilationConfig, CUDAGraphMode
    from freezeframe.context import forward_context, get_forward_context
    from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
    from freezeframe.runtime.ubatch.slicing import plan_micro_batches

    if not torch.cuda.is_available():
        return {"ok": False, "problems": ["needs CUDA: torch.cuda.is_available() is False"]}
    gen = torch.Generator().manual_seed(0)

    def weight() -> torch.Tensor:
        return (torch.randn(hidden, hidden, generator=gen) / hidden**0.5).cuda().half()

    # calibrate the spin kernel: cycles per ms on this GPU
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Parameter(weight()), nn.Parameter(weight())
            self.comm_cycles = 0
            self.events: dict[tuple[int, str], tuple[Any, Any]] = {}

        def _phase(self, name: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
            ctx = get_forward_context()
            index = -1 if ctx is None or ctx.micro_batch_index is None \
                else ctx.micro_batch_index
            begin = torch.cuda.Event(enable_timing=True)
            finish = torch.cuda.Event(enable_timing=True)
            begin.record()
            out = fn()
            finish.record()
            self.events[(index, name)] = (begin, finish)
            return out

        def _comm(self, h: torch.Tensor) -> torch.Tensor:
            torch.cuda._sleep(self.comm_cycles)  # the latency of a simulated all-to-all
            received = torch.empty_like(h)
            received.copy_(h)
            return received

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self._phase("compute1", lambda: torch.relu(x @ self.w1) @ self.w2)
            ff.ubatch.yield_to_comm()
            h = self._phase("comm", lambda: self._comm(h))
            ff.ubatch.yield_to_compute()
            return self._phase("compute2", lambda: torch.relu(h @ self.w1) @ self.w2)

    model = Toy()
    wrapper = MicroBatchWrapper(model, timeout_s=120)  # no graph backend: runs the threads
    cfg = CompilationConfig(micro_batching=True, micro_batch_decode_threshold=2,
                            micro_batch_prefill_threshold=2)
    plan = plan_micro_batches(cfg, [1] * tokens, tokens, tokens, uniform_decode=True, sync=False)
    if plan is None:
        return {"ok": False, "problems": [f"plan_micro_batches did not split {tokens} tokens"]}
    x = torch.randn(tokens, hidden, generator=gen).cuda().half()

    def split() -> torch.Tensor:
        with torch.inference_mode(), forward_context(
                BatchDescriptor(num_tokens=tokens), mode=CUDAGraphMode.NONE, micro_batches=plan):
            return wrapper(x)  # type: ignore[no-any-return]

    def unsplit() -> torch.Tensor:
        with torch.inference_mode():
            return model(x)  # type: ignore[no-any-return]

    def median_ms(fn: Callable[[], torch.Tensor], n: int) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    # the communication takes about as long as half a micro-batch's compute phase
    compute_ms = median_ms(lambda: torch.relu(x[: tokens // 2] @ model.w1) @ model.w2, 5)
    model.comm_cycles = max(1, int(cycles_per_ms * compute_ms / 2))
    problems: list[str] = []
    expected = unsplit()
    got = split()
    torch.cuda.synchronize()
    # each row goes through the same ops split or not, but a matmul over half the rows may pick
    # another kernel, so the comparison allows fp16 rounding and no more
    max_diff = float((got.float() - expected.float()).abs().max())
    scale = float(expected.float().abs().max())
    if not bool(torch.isfinite(got).all()) or max_diff > 1e-2 * max(scale, 1.0):
        problems.append(f"the micro-batched output differs from the unsplit model's: max abs "
                        f"diff {max_diff:.3g} with outputs up to {scale:.3g}")
    # overlap measured with the CUDA events of the split step just run
    origin = torch.cuda.Event(enable_timing=True)
    origin.record()
    model.events.clear()
    split()
    torch.cuda.synchronize()
    t = {f"ubatch{k[0]}:{k[1]}": (origin.elapsed_time(s), origin.elapsed_time(e))
         for k, (s, e) in sorted(model.events.items())}

    def overlap(a: str, b: str) -> bool:
        return a in t and b in t and t[a][0] < t[b][1] and t[b][0] < t[a][1]

    overlaps = {"ubatch0:comm with ubatch1:compute1": overlap("ubatch0:comm", "ubatch1:compute1"),
                "ubatch1:comm with ubatch0:compute2": overlap("ubatch1:comm", "ubatch0:compute2")}
    problems += [f"no overlap of {name} (CUDA event timeline)"
                 for name, seen in overlaps.items() if not seen]
    split_ms = median_ms(split, steps)
    unsplit_ms = median_ms(unsplit, steps)

    from torch.profiler import ProfilerActivity, profile

    model.events.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            split()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    in_trace = overlapping_kernel_pairs(json.loads(trace_path.read_text()))
    if in_trace["overlapping_pairs"] == 0:
        problems.append("the profiler trace shows no kernels on different streams running at "
                        "the same time")
    return {
        "ok": not problems,
        "problems": problems,
        "device": torch.cuda.get_device_name(),
        "tokens": tokens,
        "hidden": hidden,
        "micro_batches": len(plan.slices),
        "max_abs_diff_vs_unsplit": max_diff,
        "comm_ms_target": compute_ms / 2,
        "timeline_ms": t,
        "overlaps": overlaps,
        "split_step_ms": split_ms,
        "unsplit_step_ms": unsplit_ms,
        "trace": trace_path.name,
        "trace_overlap": in_trace,
        "schedule": [list(e) for e in wrapper.last_trace],
    }


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
