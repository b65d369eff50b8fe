"""The benchmark behind ``freezeframe bench``: the reference Llama under every way to run it.

Modes: ``eager``; ``compile`` (``torch.compile`` default); ``reduce-overhead``
(``torch.compile(mode="reduce-overhead")``, CUDA only); and freezeframe ``none``,
``piecewise``, ``full``, ``full_and_piecewise`` (``ff.compile`` + GraphRunner), and
``breakable``, ``full_and_breakable`` (the same graphs without a trace: mode NONE, PIECEWISE
graphs captured breakable at the attention op). For each mode
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

This module runs it: the options, the model built once, and the loop over modes. How a mode is
built and started is in ``modes``, how steps are built and timed in ``measure``, and what is
reported (the eager check, the table, results.json, the plot) in ``report``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from freezeframe.bench.measure import (
    StepBuilder,
    StepShapes,
    Timer,
    device_used,
    kv_read_bytes,
    logits_of,
    measure_bandwidth,
    split_contexts,
    sync,
)
from freezeframe.bench.modes import ALL_MODES, TORCH_MODES, TP_MODES, start_mode
from freezeframe.bench.progress import Progress
from freezeframe.bench.report import (
    add_speedups,
    compare_with_eager,
    setup_notes,
    write_json,
    write_outputs,
)
from freezeframe.errors import ConfigError
from freezeframe.models import LlamaConfig, LlamaModel, build_llama
from freezeframe.models.attention import check_attention_kernel, resolve_attention_kernel
from freezeframe.models.inputs import StepInputs
from freezeframe.models.llama_tp import TPLlamaModel, shard_llama
from freezeframe.models.parallel import TensorParallel

__all__ = ["DEFAULT_CONTEXTS", "BenchOptions", "prepare_out_dir", "resolve_device", "run_bench"]

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
    tp: int = 1  # tensor-parallel ranks (bench/tp.py launches them)

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in ALL_MODES]
        if bad:
            raise ConfigError(f"--modes: unknown mode(s) {bad}; choose from {list(ALL_MODES)}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"--tp must be an int >= 1, got {self.tp!r}")
        bad = [m for m in self.modes if m not in TP_MODES] if self.tp > 1 else []
        if bad:
            raise ConfigError(f"--tp {self.tp}: mode(s) {bad} do not run tensor-parallel; "
                              f"choose from {list(TP_MODES)}")
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


def run_bench(opts: BenchOptions, progress: Progress | None = None) -> dict[str, Any]:
    """Run everything ``opts`` asks for; returns the JSON-able result (also written to disk).

    ``progress`` reports each phase while it runs (default: silent). The device and the output
    directory are checked before anything is built.
    """
    progress = progress if progress is not None else Progress(len(opts.modes), enabled=False)
    device = resolve_device(opts.device)
    compiler = opts.compiler or ("inductor" if device.type == "cuda" else "eager")
    notes = setup_notes(device.type == "cuda", compiler, opts.tp)
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
        compare_with_eager(result, firsts, bench.dtype,
                           only=None if mode == "eager" else mode)
        add_speedups(result, batch_sizes)
        if out is not None:  # after every mode, so a run stopped early keeps what it did
            write_json(result, out)
    if "eager" not in firsts:
        result["notes"].append("outputs not checked: the eager mode was not run")
    if out is not None:
        write_outputs(result, out)
    return result


def _check_fits(shapes: StepShapes, preset: str, llama_config: LlamaConfig) -> None:
    """A :class:`ConfigError` when the longest request does not fit the preset's positions."""
    if shapes.max_model_len > llama_config.max_position:
        raise ConfigError(
            f"--context {shapes.context} / --prefill-len {shapes.prefill_len} leave no room in "
            f"the {preset} preset's {llama_config.max_position} positions (the longer one plus "
            f"one block of {shapes.block_size} must fit); use at most "
            f"{llama_config.max_position - shapes.block_size}")


@dataclasses.dataclass(frozen=True)
class _Setup:
    """The choices made before the model is built."""

    device: torch.device
    compiler: str  # "eager" | "inductor"
    shapes: StepShapes
    batch_sizes: tuple[int, ...]  # sorted, without repeats


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
        if opts.tp > 1:  # every rank built the same model from the seed; it keeps its shard
            base = shard_llama(base, _tensor_parallel(opts.tp))
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
    def shape(self) -> LlamaConfig:
        """The shapes this process holds: a tensor-parallel rank's share, else the model's."""
        return self.base.local if isinstance(self.base, TPLlamaModel) else self.base.config

    @property
    def weight_bytes(self) -> int:
        return self.shape.num_params() * (torch.finfo(self.dtype).bits // 8)

    @property
    def elem_bytes(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    def decode_read_bytes(self, bs: int, context: int | None = None) -> int:
        """Bytes a decode step of ``bs`` requests must read: the weights and every KV entry of
        ``context`` positions (default: the shapes' context)."""
        keys = context or self.setup.shapes.context
        return self.weight_bytes + bs * kv_read_bytes(self.shape, self.elem_bytes, keys)

    def kv_bytes_by_context(self) -> dict[str, dict[str, int]]:
        """Per decode context: the KV bytes one token's attention reads on each path."""
        window = self.setup.shapes.blocks_per_req * self.setup.shapes.block_size
        cfg = self.shape
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
            "tensor_parallel": self.opts.tp,
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
        mem0 = device_used(device)
        t0 = time.perf_counter()
        started = start_mode(mode, self.base, self.steps, compiler=self.setup.compiler,
                             launch_bs=self.setup.batch_sizes[0], progress=self.progress,
                             t0=t0)
        entry = dataclasses.asdict(started.capture) if started.capture is not None else {}
        if started.full_decode_launches is not None:
            entry["full_decode_launches"] = started.full_decode_launches
        first = self._first_logits(mode, started.forward)
        sync(device)
        entry["startup_s"] = time.perf_counter() - t0
        entry["graph_memory_bytes"] = device_used(device) - mem0 if self.on_cuda else None
        entry.update(self._time_steps(started.forward))
        if started.runner is not None:
            entry["runner_stats"] = started.runner.stats.snapshot()
        self.progress.end_mode(f"done in {time.perf_counter() - t0:.1f} s")
        return entry, first

    def _first_logits(self, mode: str, forward: Callable[[StepInputs], torch.Tensor],
                      ) -> list[torch.Tensor]:
        """The first call of each decode step; the torch.compile modes compile lazily here."""
        self.progress.phase("first call at each batch size"
                            + (" (torch.compile compiles here)" if mode in TORCH_MODES[1:]
                               else ""))
        decodes = [self.steps.decode(bs) for bs in self.setup.batch_sizes]
        return [logits_of(forward, step, self.base)().float().cpu() for step in decodes]

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
        timer = Timer(self.setup.device)
        return statistics.median(timer.measure(logits_of(forward, step, self.base), steps,
                                               warmup))


def _tensor_parallel(size: int) -> TensorParallel:
    """This process's place in the world group, which must have ``size`` ranks."""
    tp = TensorParallel.from_group()
    if tp.size != size:
        raise ConfigError(f"--tp {size}: the process group has {tp.size} ranks; launch --tp "
                          "ranks (see freezeframe.bench.tp)")
    return tp


def _count(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f} B"
    if n >= 10**6:
        return f"{n / 1e6:.1f} M"
    return f"{n:,}"
