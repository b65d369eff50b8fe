"""The benchmark behind ``freezeframe bench``: the reference Llama under every way to run it.

Modes: ``eager``; ``compile`` (``torch.compile`` default); ``reduce-overhead``
(``torch.compile(mode="reduce-overhead")``, CUDA only); and freezeframe ``none``,
``piecewise``, ``full``, ``full_and_piecewise`` (``ff.compile`` + GraphRunner). For each mode
and batch size it times a uniform-decode step (hidden states + logits of every request) and a
mixed step (the same decodes plus one prefill chunk), and once per mode a prefill; it records
startup (compile + capture) time and graph memory, and for decode the share of the bandwidth
floor: ``(weight bytes + KV bytes read) / bandwidth``, the bandwidth measured by a large
device copy in the same run.

Decode is also timed by context length (``--contexts``, default 128, 1k and 4k tokens, at the
smallest batch size) so that a step at 4k can be set beside a step at 128 in the same run;
contexts that do not fit the preset's positions are skipped and named in the notes. Beside
them, the bytes each attention path reads per decode token are computed (the pure-torch static
path reads the whole ``max_model_len`` window, the Triton kernel the token's context), and for
each mode with FULL graphs the launches one FULL decode replay issues are counted: the recorded
steps of the emulated graph, or the device activities a profiler sees during one CUDA replay.

On a machine without CUDA the graph modes run on the *emulated* backend, whose replays re-run
every recorded op in Python: they show that the pipeline works and what emulation costs, not
what graphs gain. ``reduce-overhead`` is skipped there (it needs CUDA graphs).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from freezeframe.bench.progress import Progress
from freezeframe.errors import ConfigError
from freezeframe.models import ATTENTION_OP, KVCacheConfig, LlamaConfig, LlamaModel, build_llama
from freezeframe.models.attention import check_attention_kernel, resolve_attention_kernel
from freezeframe.models.inputs import RequestChunk, StepInputs, build_step
from freezeframe.models.serving import EagerForward, RunnerForward, llama_runner_inputs

if TYPE_CHECKING:
    from freezeframe.batch import BatchDescriptor
    from freezeframe.compilation.model import CompiledModel
    from freezeframe.config import CompilationConfig
    from freezeframe.runtime.runner import GraphRunner

__all__ = ["ALL_MODES", "DEFAULT_CONTEXTS", "BenchOptions", "CompiledLlama", "StepBuilder",
           "StepShapes", "compile_with_runner", "full_decode_launches", "graph_config",
           "kv_read_bytes", "prepare_out_dir", "resolve_device", "run_bench"]

TORCH_MODES = ("eager", "compile", "reduce-overhead")
FF_MODES = ("none", "piecewise", "full", "full_and_piecewise")
ALL_MODES = TORCH_MODES + FF_MODES
#: decode context lengths timed side by side (``--contexts``)
DEFAULT_CONTEXTS = (128, 1024, 4096)


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    preset: str = "tiny"
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    modes: tuple[str, ...] = ALL_MODES
    steps: int = 20
    warmup: int = 3
    context: int | None = None  # decode context per request (default: by preset)
    prefill_len: int | None = None
    mixed_chunk: int = 16
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS  # decode rows by context length
    attention_kernel: str = "auto"  # KVCacheConfig.attention_kernel
    compiler: str | None = None  # "eager" | "inductor"; default: inductor on CUDA, else eager
    device: str = "auto"
    out: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in ALL_MODES]
        if bad:
            raise ConfigError(f"--modes: unknown mode(s) {bad}; choose from {list(ALL_MODES)}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"--batch-sizes: give at least one, each >= 1; got "
                              f"{list(self.batch_sizes)}")
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError(f"--steps must be >= 1 and --warmup >= 0, got {self.steps} and "
                              f"{self.warmup}")
        if self.compiler not in (None, "eager", "inductor"):
            raise ConfigError(f"--compiler must be 'eager' or 'inductor', got {self.compiler!r}")
        if self.preset not in LlamaConfig.PRESETS:
            raise ConfigError(f"--preset: unknown preset {self.preset!r}; choose one of "
                              f"{sorted(LlamaConfig.PRESETS)}")
        for name in ("context", "prefill_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.mixed_chunk < 1:
            raise ConfigError(f"mixed_chunk must be >= 1, got {self.mixed_chunk}")
        if any(c < 1 for c in self.contexts):
            raise ConfigError(f"--contexts: each context length must be >= 1, got "
                              f"{list(self.contexts)}")
        check_attention_kernel(self.attention_kernel, "--attention-kernel")


def resolve_device(text: str) -> torch.device:
    """The device ``--device`` names: ``auto`` (cuda when available, else cpu), ``cpu``,
    ``cuda`` or ``cuda:N``; a :class:`ConfigError` for anything else or a missing GPU."""
    if text.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text.strip())
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device: unknown device {text!r}; use auto, cpu, cuda or cuda:N") \
            from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device: the benchmark runs on cpu or cuda, got {text!r}; use "
                          "auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = torch.version.cuda or "none (a CPU-only build)"
            raise ConfigError(
                f"--device {text}: no CUDA device is available (torch.cuda.is_available() is "
                f"False; torch {torch.__version__}, CUDA {build}); use --device cpu or auto")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {text}: there are {count} CUDA device(s), numbered "
                              f"0..{count - 1}")
    return device


def prepare_out_dir(out: Path) -> Path:
    """Create ``out`` (and its parents) and check a file can be written there, so a run that
    takes minutes does not fail at its very end; a :class:`ConfigError` when it cannot."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file, not a directory; choose a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"--out {str(out)!r}: cannot write results there ({reason}); choose a "
                          "writable directory") from None
    return out


class _Timer:
    """Per-call latency: CUDA events on a GPU (device time between steps), else perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def measure(self, fn: Callable[[], Any], steps: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return times
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]


def measure_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), median of 5."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = _Timer(device).measure(lambda: dst.copy_(src), steps=5, warmup=2)
    return 2 * n * 4 / (statistics.median(times) / 1e3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _device_used(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def run_bench(opts: BenchOptions, progress: Progress | None = None) -> dict[str, Any]:
    """Run everything ``opts`` asks for; returns the JSON-able result (also written to disk).

    ``progress`` reports each phase while it runs (default: silent). The device and the output
    directory are checked before anything is built.
    """
    progress = progress if progress is not None else Progress(len(opts.modes), enabled=False)
    device = resolve_device(opts.device)
    compiler = opts.compiler or ("inductor" if device.type == "cuda" else "eager")
    notes = _setup_notes(device.type == "cuda", compiler)
    batch_sizes = tuple(sorted(set(opts.batch_sizes)))
    llama_config = LlamaConfig.preset(opts.preset)
    contexts, skipped = split_contexts(opts.contexts, llama_config.max_position)
    if skipped:
        notes.append(
            f"decode contexts {', '.join(map(str, skipped))} skipped: above the {opts.preset} "
            f"preset's {llama_config.max_position} positions (one block of "
            f"{StepShapes.block_size} is kept free)")
    shapes = StepShapes.for_preset(opts.preset, batch_sizes[-1], opts.mixed_chunk,
                                   context=opts.context, prefill_len=opts.prefill_len,
                                   contexts=contexts, attention_kernel=opts.attention_kernel)
    _check_fits(shapes, opts.preset, llama_config)
    out = prepare_out_dir(Path(opts.out)) if opts.out else None
    bench = _Bench.build(opts, _Setup(device, compiler, shapes, batch_sizes), llama_config,
                         progress)
    result = bench.header(notes)
    # each mode's logits of its first decode step at each batch size, compared with eager's
    firsts: dict[str, list[torch.Tensor]] = {}
    result["unfinished_modes"] = list(opts.modes)
    for mode in opts.modes:
        entry, first = bench.run_mode(mode)
        result["modes"][mode] = entry
        result["unfinished_modes"].remove(mode)
        if first is not None:
            firsts[mode] = first
        # each mode once, as soon as it and eager have run
        _compare_with_eager(result, firsts, bench.dtype,
                            only=None if mode == "eager" else mode)
        _add_speedups(result, batch_sizes)
        if out is not None:  # after every mode, so a run stopped early keeps what it did
            write_json(result, out)
    if "eager" not in firsts:
        result["notes"].append("outputs not checked: the eager mode was not run")
    if out is not None:
        write_outputs(result, out)
    return result


def _setup_notes(on_cuda: bool, compiler: str) -> list[str]:
    """What the reader of the numbers must know about this machine and compiler."""
    notes: list[str] = []
    if not on_cuda:
        notes.append(
            "no CUDA device: freezeframe graph modes run on the emulated backend (replays re-run "
            "recorded ops in Python), so their numbers show emulation overhead, not graph "
            "speed-ups; reduce-overhead is skipped; the bandwidth floor is a host-memory floor")
    if compiler == "eager":
        notes.append("compiler=eager: torch.compile and ff.compile use the eager backend "
                     "(no Inductor kernels); pass --compiler inductor for generated kernels")
    return notes


def split_contexts(contexts: Sequence[int], max_position: int,
                   block_size: int = 16) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(kept, skipped)``: sorted distinct context lengths that fit ``max_position`` with one
    block to spare, and those that do not."""
    ordered = sorted(set(contexts))
    limit = max_position - block_size
    return (tuple(c for c in ordered if c <= limit), tuple(c for c in ordered if c > limit))


def kv_read_bytes(config: LlamaConfig, elem_bytes: int, keys: int) -> int:
    """Bytes of keys and values one decode token reads over all layers when it reads ``keys``
    cache positions per layer (both K and V, every KV head)."""
    return keys * config.num_layers * 2 * config.num_kv_heads * config.resolved_head_dim \
        * elem_bytes


def _check_fits(shapes: StepShapes, preset: str, llama_config: LlamaConfig) -> None:
    """A :class:`ConfigError` when the longest request does not fit the preset's positions."""
    if shapes.max_model_len > llama_config.max_position:
        raise ConfigError(
            f"--context {shapes.context} / --prefill-len {shapes.prefill_len} leave no room in "
            f"the {preset} preset's {llama_config.max_position} positions (the longer one plus "
            f"one block of {shapes.block_size} must fit); use at most "
            f"{llama_config.max_position - shapes.block_size}")


def _add_speedups(result: dict[str, Any], batch_sizes: Sequence[int]) -> None:
    """``speedup_vs_eager`` on every decode row whose batch size eager was timed at."""
    eager_ms = {bs: result["modes"].get("eager", {}).get("decode", {}).get(str(bs), {})
                .get("median_ms") for bs in batch_sizes}
    for entry in result["modes"].values():
        for bs, row in entry.get("decode", {}).items():
            if eager_ms.get(int(bs)):
                row["speedup_vs_eager"] = eager_ms[int(bs)] / row["median_ms"]


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The sizes of the bench's steps; the ``capture`` GPU probe builds the same ones."""

    context: int  # tokens per decode request, the new one included
    prefill_len: int
    max_bs: int  # the largest decode batch; the mixed step adds one request to it
    mixed_chunk: int  # prompt tokens of the mixed step's extra request
    contexts: tuple[int, ...] = ()  # decode rows by context length (each fits the positions)
    attention_kernel: str = "auto"
    block_size: int = 16

    @classmethod
    def for_preset(cls, preset: str, max_bs: int, mixed_chunk: int, *,
                   context: int | None = None, prefill_len: int | None = None,
                   contexts: tuple[int, ...] = (), attention_kernel: str = "auto",
                   ) -> StepShapes:
        """Context and prefill length default by preset: 64 and 64 tiny, 1024 and 512 else."""
        tiny = preset == "tiny"
        return cls(context=context or (64 if tiny else 1024),
                   prefill_len=prefill_len or (64 if tiny else 512),
                   max_bs=max_bs, mixed_chunk=mixed_chunk, contexts=contexts,
                   attention_kernel=attention_kernel)

    @property
    def max_model_len(self) -> int:
        return max(self.context, self.prefill_len, *self.contexts) + self.block_size

    @property
    def blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_num_seqs(self) -> int:
        """Request rows of the largest step: the mixed step at the largest batch size."""
        return self.max_bs + 1

    @property
    def max_num_tokens(self) -> int:
        return max(self.prefill_len, self.max_bs + self.mixed_chunk)

    def cache_config(self) -> KVCacheConfig:
        """A KV cache with a row of blocks for each request the largest step has."""
        return KVCacheConfig(num_blocks=self.blocks_per_req * self.max_num_seqs,
                             block_size=self.block_size, max_model_len=self.max_model_len,
                             attention_kernel=self.attention_kernel)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class StepBuilder:
    """Builds the bench's steps on ``device``; request ``r`` owns the ``r``-th row of blocks."""

    shapes: StepShapes
    cache: KVCacheConfig
    device: torch.device

    def decode(self, bs: int, context: int | None = None) -> StepInputs:
        """``bs`` requests, each one new token after ``context - 1`` cached ones (default: the
        shapes' context)."""
        return build_step(self._decodes(bs, context), self.cache, device=self.device)

    def mixed(self, bs: int) -> StepInputs:
        """The decode step of ``bs`` requests plus the first prompt chunk of one more."""
        chunks = self._decodes(bs)
        chunks.append(RequestChunk(tuple(range(self.shapes.mixed_chunk)), 0, self._blocks(bs)))
        return build_step(chunks, self.cache, device=self.device)

    def prefill(self) -> StepInputs:
        """One request's whole prompt of ``prefill_len`` tokens."""
        prompt = tuple(i % 100 for i in range(self.shapes.prefill_len))
        return build_step([RequestChunk(prompt, 0, self._blocks(0))], self.cache,
                          device=self.device)

    def _decodes(self, bs: int, context: int | None = None) -> list[RequestChunk]:
        cached = (context or self.shapes.context) - 1
        return [RequestChunk((1 + r % 7,), cached, self._blocks(r)) for r in range(bs)]

    def _blocks(self, r: int) -> tuple[int, ...]:
        per_req = self.shapes.blocks_per_req
        return tuple(range(r * per_req, (r + 1) * per_req))


def graph_config(shapes: StepShapes, cudagraph_mode: str, compiler: str,
                 on_cuda: bool) -> CompilationConfig:
    """The freezeframe configuration of a graph mode sized for the steps of ``shapes``."""
    import freezeframe as ff

    return ff.CompilationConfig(
        mode="piecewise", backend=compiler, splitting_ops=[ATTENTION_OP],
        cudagraph_mode=cudagraph_mode, graph_backend="cuda" if on_cuda else "emulated",
        max_num_seqs=shapes.max_num_seqs, max_num_tokens=shapes.max_num_tokens,
    )


@dataclasses.dataclass(frozen=True)
class CompiledLlama:
    """``ff.compile`` of the Llama, the GraphRunner around it, and a step through the runner."""

    compiled: CompiledModel
    runner: GraphRunner
    forward: RunnerForward


def compile_with_runner(base: LlamaModel, config: CompilationConfig,
                        shapes: StepShapes, graph_memory_budget: int | None = None
                        ) -> CompiledLlama:
    """Wrap ``base`` for ``config``; it compiles on its first step, captures on ``capture()``
    (measuring and predicting graph memory first when a ``graph_memory_budget`` is given)."""
    import freezeframe as ff

    compiled = ff.compile(base, config, dynamic_arg_dims=dict(
        LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
    runner = ff.GraphRunner(compiled, config,
                            inputs=llama_runner_inputs(base, shapes.max_num_seqs),
                            progress=False, graph_memory_budget=graph_memory_budget)
    return CompiledLlama(compiled, runner, RunnerForward(runner, shapes.max_num_seqs))


def full_decode_launches(compiled: CompiledModel, num_reqs: int) -> int | None:
    """Launches one replay of the FULL uniform-decode graph for ``num_reqs`` one-token requests
    issues (the graph of the smallest captured size that holds them), or None without one.

    Emulated graphs record their launches: each recorded ATen op, or one per opaque kernel
    call (a Triton launch, a compiled piece), counts one. A CUDA graph is replayed once under
    ``torch.profiler`` and every device activity it shows (kernels, memcpy, memset) counts one.
    """
    from freezeframe.config import CUDAGraphMode
    from freezeframe.graphs.emulated import EmulatedGraph

    found: list[tuple[BatchDescriptor, Any]] = []
    for wrapper in compiled.graph_wrappers():
        if wrapper.runtime_mode is not CUDAGraphMode.FULL:
            continue
        for desc in wrapper.captured_descriptors:
            if desc.num_tokens >= num_reqs and (desc.num_reqs or num_reqs) >= num_reqs:
                found.append((desc, wrapper.graph_for(desc)))
    if not found:
        return None
    # a uniform-decode graph where the mode keys them apart (FULL_AND_PIECEWISE), else the
    # FULL graph a step of that many tokens replays (FULL)
    _, graph = min(found, key=lambda item: (not item[0].uniform, item[0].num_tokens))
    if isinstance(graph, EmulatedGraph):
        return len(graph.ops)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)


def _logits_of(forward: Callable[[StepInputs], torch.Tensor], step: StepInputs,
               model: LlamaModel) -> Callable[[], torch.Tensor]:
    """A call of one step: hidden states through ``forward``, then each request's logits."""
    rows = step.last_token_index()

    def run() -> torch.Tensor:
        with torch.no_grad():
            hidden = forward(step)
            return model.compute_logits(hidden[rows])
    return run


@dataclasses.dataclass(frozen=True)
class _Setup:
    """The choices made before the model is built."""

    device: torch.device
    compiler: str  # "eager" | "inductor"
    shapes: StepShapes
    batch_sizes: tuple[int, ...]  # sorted, without repeats


@dataclasses.dataclass(frozen=True)
class _CaptureTimes:
    """Startup of a graph mode (the JSON keys of a mode entry, in this order)."""

    compile_s: float
    capture_s: float
    graphs_captured: int


@dataclasses.dataclass(frozen=True)
class _Started:
    """A mode ready to time: its forward, the runner of the freezeframe modes and, for those
    that capture graphs, how long compiling and capturing took."""

    forward: Callable[[StepInputs], torch.Tensor]
    runner: GraphRunner | None = None
    capture: _CaptureTimes | None = None
    full_decode_launches: int | None = None  # of one FULL decode replay, where there is one


@dataclasses.dataclass(frozen=True)
class _Bench:
    """What every mode is measured with: the built model, its steps and the device bandwidth."""

    opts: BenchOptions
    setup: _Setup
    steps: StepBuilder
    base: LlamaModel
    build_s: float
    prefill: StepInputs
    bandwidth: float  # bytes/s
    progress: Progress

    @classmethod
    def build(cls, opts: BenchOptions, setup: _Setup, llama_config: LlamaConfig,
              progress: Progress) -> _Bench:
        """Build the model and the prefill step, then measure the memory bandwidth."""
        on_cuda = setup.device.type == "cuda"
        cache = setup.shapes.cache_config()
        progress.note(f"building the {opts.preset} Llama ({_count(llama_config.num_params())} "
                      f"parameters, {'bfloat16' if on_cuda else 'float32'}) on "
                      f"{setup.device}; modes: {', '.join(opts.modes)}; batch sizes: "
                      f"{', '.join(map(str, setup.batch_sizes))}")
        if not on_cuda and opts.preset != "tiny":
            progress.note(f"the {opts.preset} preset on a CPU takes minutes per mode (graph "
                          "modes are emulated); --preset tiny runs in seconds")
        t0 = time.perf_counter()
        base = build_llama(opts.preset, cache, device=setup.device, seed=opts.seed)
        build_s = time.perf_counter() - t0
        steps = StepBuilder(setup.shapes, cache, setup.device)
        prefill = steps.prefill()
        copy_bytes = (1 << 30) if on_cuda else (1 << 27)
        progress.note(f"built in {build_s:.1f} s; measuring memory bandwidth "
                      f"({copy_bytes >> 20} MiB copy)")
        bandwidth = measure_bandwidth(setup.device, copy_bytes)
        return cls(opts, setup, steps, base, build_s, prefill, bandwidth, progress)

    @property
    def on_cuda(self) -> bool:
        return self.setup.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return self.base.lm_head.weight.dtype

    @property
    def weight_bytes(self) -> int:
        return self.base.config.num_params() * (torch.finfo(self.dtype).bits // 8)

    @property
    def elem_bytes(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    def decode_read_bytes(self, bs: int, context: int | None = None) -> int:
        """Bytes a decode step of ``bs`` requests must read: the weights and every KV entry of
        ``context`` positions (default: the shapes' context)."""
        keys = context or self.setup.shapes.context
        return self.weight_bytes + bs * kv_read_bytes(self.base.config, self.elem_bytes, keys)

    def kv_bytes_by_context(self) -> dict[str, dict[str, int]]:
        """Per decode context: the KV bytes one token's attention reads on each path."""
        window = self.setup.shapes.blocks_per_req * self.setup.shapes.block_size
        cfg = self.base.config
        return {str(c): {"torch": kv_read_bytes(cfg, self.elem_bytes, window),
                         "triton": kv_read_bytes(cfg, self.elem_bytes, c)}
                for c in self.setup.shapes.contexts}

    def header(self, notes: list[str]) -> dict[str, Any]:
        """The result without its per-mode entries."""
        device = self.setup.device
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if self.on_cuda
            else platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "preset": self.opts.preset,
            "dtype": str(self.dtype).replace("torch.", ""),
            "compiler": self.setup.compiler,
            "context": self.setup.shapes.context,
            "contexts": list(self.setup.shapes.contexts),
            "max_model_len": self.setup.shapes.max_model_len,
            "attention_kernel": resolve_attention_kernel(self.setup.shapes.attention_kernel,
                                                         device),
            "kv_bytes_per_decode_token": self.kv_bytes_by_context(),
            "prefill_len": self.setup.shapes.prefill_len,
            "mixed_chunk": self.opts.mixed_chunk,
            "batch_sizes": list(self.setup.batch_sizes),
            "steps": self.opts.steps,
            "params": self.base.config.num_params(),
            "weight_bytes": self.weight_bytes,
            "bandwidth_bytes_per_s": self.bandwidth,
            "model_build_s": self.build_s,
            "notes": notes,
            "modes": {},
        }

    def run_mode(self, mode: str) -> tuple[dict[str, Any], list[torch.Tensor] | None]:
        """The mode's result entry, and its logits of the first decode step at each batch size
        (None when the mode is skipped)."""
        self.progress.start_mode(mode)
        if mode == "reduce-overhead" and not self.on_cuda:
            reason = "needs CUDA graphs (cudagraph trees); no CUDA device"
            self.progress.end_mode(f"skipped ({reason})")
            return {"skipped": reason}, None
        device = self.setup.device
        self.base.reset_cache()
        mem0 = _device_used(device)
        t0 = time.perf_counter()
        started = self._start(mode, t0)
        entry = dataclasses.asdict(started.capture) if started.capture is not None else {}
        if started.full_decode_launches is not None:
            entry["full_decode_launches"] = started.full_decode_launches
        first = self._first_logits(mode, started.forward)
        _sync(device)
        entry["startup_s"] = time.perf_counter() - t0
        entry["graph_memory_bytes"] = _device_used(device) - mem0 if self.on_cuda else None
        entry.update(self._time_steps(started.forward))
        if started.runner is not None:
            entry["runner_stats"] = started.runner.stats.snapshot()
        self.progress.end_mode(f"done in {time.perf_counter() - t0:.1f} s")
        return entry, first

    def _start(self, mode: str, t0: float) -> _Started:
        if mode == "eager":
            return _Started(EagerForward(self.base))
        if mode == "compile":
            return _Started(EagerForward(torch.compile(self.base, backend=self.setup.compiler)))
        if mode == "reduce-overhead":
            return _Started(EagerForward(torch.compile(self.base, mode="reduce-overhead",
                                                       dynamic=False)))
        return self._start_freezeframe(mode, t0)

    def _start_freezeframe(self, mode: str, t0: float) -> _Started:
        """Compile ``base`` with freezeframe and, unless ``mode`` is ``none``, capture its
        graphs; ``t0`` is when the mode's startup began."""
        shapes = self.setup.shapes
        llama = compile_with_runner(
            self.base, graph_config(shapes, mode.upper(), self.setup.compiler, self.on_cuda),
            shapes)
        self.progress.phase(f"compiling (trace, split, {self.setup.compiler} compiler)")
        # compile first, on a step of several tokens: Dynamo specialises a dynamic dim that it
        # first sees with size 1
        _logits_of(llama.forward, self.steps.mixed(shapes.max_bs), self.base)()
        if mode == "none":
            return _Started(llama.forward, llama.runner)
        _sync(self.setup.device)
        compile_s = time.perf_counter() - t0
        self.progress.phase(f"capturing graphs ({'CUDA' if self.on_cuda else 'emulated'})")
        t1 = time.perf_counter()
        report = llama.runner.capture()
        _sync(self.setup.device)
        capture = _CaptureTimes(compile_s, time.perf_counter() - t1, report.num_graphs)
        launches = full_decode_launches(llama.compiled, self.setup.batch_sizes[0])
        return _Started(llama.forward, llama.runner, capture, launches)

    def _first_logits(self, mode: str, forward: Callable[[StepInputs], torch.Tensor],
                      ) -> list[torch.Tensor]:
        """The first call of each decode step; the torch.compile modes compile lazily here."""
        self.progress.phase("first call at each batch size"
                            + (" (torch.compile compiles here)" if mode in TORCH_MODES[1:]
                               else ""))
        decodes = [self.steps.decode(bs) for bs in self.setup.batch_sizes]
        return [_logits_of(forward, step, self.base)().float().cpu() for step in decodes]

    def _time_steps(self, forward: Callable[[StepInputs], torch.Tensor]) -> dict[str, Any]:
        """The ``decode``, ``mixed`` and ``prefill_ms`` entries of a mode."""
        decode: dict[str, Any] = {}
        mixed: dict[str, Any] = {}
        for bs in self.setup.batch_sizes:
            self.progress.phase(f"timing decode and mixed steps at batch size {bs}")
            decode[str(bs)] = self._time_decode(forward, bs)
            mixed[str(bs)] = {"median_ms": self._median_ms(
                forward, self.steps.mixed(bs), max(1, self.opts.steps // 2), 1)}
        by_context: dict[str, Any] = {}
        bs = self.setup.batch_sizes[0]
        for context in self.setup.shapes.contexts:
            self.progress.phase(f"timing decode at context {context} (batch size {bs})")
            by_context[str(context)] = self._time_decode(forward, bs, context)
        self.progress.phase(f"timing a prefill of {self.setup.shapes.prefill_len} tokens")
        prefill_ms = self._median_ms(forward, self.prefill, max(1, self.opts.steps // 4), 1)
        return {"decode": decode, "decode_by_context": by_context, "mixed": mixed,
                "prefill_ms": prefill_ms}

    def _time_decode(self, forward: Callable[[StepInputs], torch.Tensor],
                     bs: int, context: int | None = None) -> dict[str, float]:
        """Median latency of a decode step and its share of the bandwidth floor."""
        ms = self._median_ms(forward, self.steps.decode(bs, context), self.opts.steps,
                             self.opts.warmup)
        floor_ms = self.decode_read_bytes(bs, context) / self.bandwidth * 1e3
        return {"median_ms": ms, "floor_ms": floor_ms, "floor_share": floor_ms / ms}

    def _median_ms(self, forward: Callable[[StepInputs], torch.Tensor], step: StepInputs,
                   steps: int, warmup: int) -> float:
        timer = _Timer(self.setup.device)
        return statistics.median(timer.measure(_logits_of(forward, step, self.base), steps,
                                               warmup))


# Largest |logits - eager logits| over the largest |eager logit| a mode may show: float32 runs
# the same math in another order; 16-bit types round every layer's activations.
MATCH_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
MATCH_TOLERANCE_16BIT = 5e-2


def _compare_with_eager(result: dict[str, Any], firsts: Mapping[str, list[torch.Tensor]],
                        dtype: torch.dtype, only: str | None = None) -> None:
    """Record, per mode, how far its logits are from eager's on the same steps
    (``max_rel_diff_vs_eager``) and whether that is within tolerance (``matches_eager``); a
    mode that does not match is named in the notes. ``only``: that mode alone (else every mode
    run so far). Nothing happens before the eager mode has run."""
    reference = firsts.get("eager")
    if reference is None:
        return
    tolerance = MATCH_TOLERANCE.get(dtype, MATCH_TOLERANCE_16BIT)
    result["match_tolerance"] = tolerance
    for mode, outs in firsts.items():
        if only is not None and mode != only:
            continue
        diff = max(float((got - want).abs().max()) / max(float(want.abs().max()), 1e-12)
                   for got, want in zip(outs, reference, strict=True))
        entry = result["modes"][mode]
        entry["max_rel_diff_vs_eager"] = diff
        entry["matches_eager"] = diff <= tolerance
        if diff > tolerance:
            result["notes"].append(
                f"{mode}: logits differ from eager's by {diff:.2e} of their largest value "
                f"(tolerance {tolerance:.0e}): a wrong answer, not a speed result")


def mismatched_modes(result: Mapping[str, Any]) -> list[str]:
    return [m for m, e in result["modes"].items() if e.get("matches_eager") is False]


def _count(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f} B"
    if n >= 10**6:
        return f"{n / 1e6:.1f} M"
    return f"{n:,}"


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table: one row per mode, decode latency per batch size, then the rest."""
    sizes = result["batch_sizes"]
    contexts = result["contexts"]
    head = ["mode", *[f"decode bs{b} ms" for b in sizes], "floor% bs1" if 1 in sizes else
            f"floor% bs{sizes[0]}", *[f"ctx{c} ms" for c in contexts],
            *([f"ctx{contexts[-1]}/{contexts[0]}"] if len(contexts) > 1 else []),
            f"mixed bs{sizes[-1]} ms", "prefill ms", "startup s", "launches", "vs eager"]
    rows = [head]
    for mode, e in result["modes"].items():
        if "skipped" in e:
            rows.append([mode, f"skipped: {e['skipped']}"])
            continue
        d = e["decode"]
        first = d[str(1 if 1 in sizes else sizes[0])]
        ctx = [e["decode_by_context"][str(c)]["median_ms"] for c in contexts]
        rows.append([mode, *[f"{d[str(b)]['median_ms']:.3f}" for b in sizes],
                     f"{100 * first['floor_share']:.1f}", *[f"{ms:.3f}" for ms in ctx],
                     *([f"{ctx[-1] / ctx[0]:.2f}x"] if len(ctx) > 1 else []),
                     f"{e['mixed'][str(sizes[-1])]['median_ms']:.3f}",
                     f"{e['prefill_ms']:.3f}", f"{e['startup_s']:.2f}",
                     str(e.get("full_decode_launches", "-")), _match_cell(e)])
    width = [max(len(r[i]) for r in rows if i < len(r) and len(r) == len(head))
             for i in range(len(head))]
    lines = []
    for r in rows:
        if len(r) != len(head):
            lines.append(f"{r[0]:<{width[0]}}  {r[1]}")
        else:
            lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(r, width, strict=True))))
    info = (f"{result['preset']} preset on {result['device']} ({result['dtype']}, torch "
            f"{result['torch']}, compiler {result['compiler']}, attention "
            f"{result['attention_kernel']}), context {result['context']}, max_model_len "
            f"{result['max_model_len']}, bandwidth "
            f"{result['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s")
    kv = [f"ctx{c}: torch {b['torch'] / 2**20:.3g} MiB, triton {b['triton'] / 2**20:.3g} MiB"
          for c, b in result["kv_bytes_per_decode_token"].items()]
    legend = [f"ctxN ms: decode at context N, batch size {sizes[0]}; launches: one FULL decode "
              "replay (recorded ops when emulated, profiled device activities on CUDA)"]
    if kv:
        legend.append("KV bytes one decode token reads (all layers): " + "; ".join(kv))
    return "\n".join([info, *lines, *legend, *[f"note: {n}" for n in result["notes"]]])


def _match_cell(entry: Mapping[str, Any]) -> str:
    if "matches_eager" not in entry:
        return "-"
    verdict = "ok" if entry["matches_eager"] else "DIFFERS"
    return f"{verdict} {entry['max_rel_diff_vs_eager']:.0e}"


def write_json(result: dict[str, Any], out: Path) -> Path:
    """results.json, written whole to a temporary name first and then renamed into place, so a
    reader (or a run killed while writing) never sees half a file."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / "results.json"
    partial = out / ".results.json.partial"
    partial.write_text(json.dumps(result, indent=2, default=str))
    os.replace(partial, target)
    return target


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    """results.json and, when matplotlib is installed, latency_vs_batch.png."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        result["notes"].append("matplotlib is not installed: no plot written "
                               "(pip install matplotlib)")
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode, e in result["modes"].items():
            if "decode" in e:
                sizes = sorted(int(b) for b in e["decode"])
                ax.plot(sizes, [e["decode"][str(b)]["median_ms"] for b in sizes], marker="o",
                        label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (decode requests)")
        ax.set_ylabel("median decode step (ms)")
        ax.set_title(f"freezeframe bench: {result['preset']} on {result['device']}")
        ax.legend()
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "latency_vs_batch.png", dpi=120)
        plt.close(fig)
        written.append(out / "latency_vs_batch.png")
    write_json(result, out)
    return written


def parse_list(text: str, kind: type = int) -> tuple[Any, ...]:
    return tuple(kind(part.strip()) for part in text.split(",") if part.strip())


def modes_from(text: str | Sequence[str]) -> tuple[str, ...]:
    parts = parse_list(text, str) if isinstance(text, str) else tuple(text)
    return tuple(p.lower().replace("_", "-") if p.lower().replace("_", "-") in TORCH_MODES
                 else p.lower().replace("-", "_") for p in parts)
