"""What every mode of the bench is measured with (:class:`Workload`): the reference Llama built
once, its steps, the device's bandwidth and the floor of each decode step; and one mode run on
it (:meth:`Workload.run_mode`): started, its first logits kept for the check against eager, its
rows timed (:mod:`rows`), and, for a graph mode, its capture report with the graph pool's
refitted prediction set beside the measurement (the model is
:func:`~freezeframe.runtime.graph_memory.predict_pool`) and the profiler table of one FULL
decode replay (:mod:`profile`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from freezeframe.bench.measure import (
    StepBuilder,
    StepShapes,
    device_used,
    full_decode_graph,
    kv_read_bytes,
    logits_of,
    measure_bandwidth,
    sync,
)
from freezeframe.bench.modes import TORCH_MODES, Started, start_mode
from freezeframe.bench.options import BenchOptions
from freezeframe.bench.profile import profile_replay
from freezeframe.bench.progress import Progress
from freezeframe.bench.rows import RowTimer, rows_of
from freezeframe.errors import ConfigError
from freezeframe.models import LlamaConfig, LlamaModel, build_llama
from freezeframe.models.attention import resolve_attention_kernel
from freezeframe.models.inputs import StepInputs
from freezeframe.models.llama_tp import TPLlamaModel, shard_llama
from freezeframe.models.parallel import TensorParallel
from freezeframe.runtime.graph_memory import CapturedGraph, predict_pool

__all__ = ["Setup", "Workload"]


@dataclasses.dataclass(frozen=True)
class Setup:
    """The choices made before the model is built."""

    device: torch.device
    compiler: str  # "eager" | "inductor"
    shapes: StepShapes
    batch_sizes: tuple[int, ...]  # sorted, without repeats


@dataclasses.dataclass(frozen=True)
class Workload:
    """What every mode is measured with: the built model, its steps and the device bandwidth."""

    opts: BenchOptions
    setup: Setup
    steps: StepBuilder
    base: LlamaModel
    build_s: float
    prefill: StepInputs
    bandwidth: float  # bytes/s
    progress: Progress

    @classmethod
    def build(cls, opts: BenchOptions, setup: Setup, llama_config: LlamaConfig,
              progress: Progress) -> Workload:
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
            "grid": self.opts.grid,
            "tensor_parallel": self.opts.tp,
            "weight_bytes": self.weight_bytes,
            "bandwidth_bytes_per_s": self.bandwidth,
            "model_build_s": self.build_s,
            "notes": notes,
            "modes": {},
        }

    def run_mode(self, mode: str, checkpoint: Callable[[dict[str, Any]], None]
                 ) -> tuple[dict[str, Any], dict[int, torch.Tensor] | None]:
        """The mode's result entry, and its logits of the first decode step at each batch size
        it runs (None when the mode is skipped). ``checkpoint`` is given the entry so far after
        each timed row, so a run stopped in the middle keeps the rows it timed."""
        self.progress.start_mode(mode)
        if mode == "reduce-overhead" and not self.on_cuda:
            reason = "needs CUDA graphs (cudagraph trees); no CUDA device"
            self.progress.end_mode(f"skipped ({reason})")
            return {"skipped": reason}, None
        device = self.setup.device
        self.base.reset_cache()
        mem0 = device_used(device)
        t0 = time.perf_counter()
        sizes = rows_of(mode, self.setup.batch_sizes)
        skips = _cudagraph_skips()
        started = start_mode(mode, self.base, self.steps, compiler=self.setup.compiler,
                             launch_bs=self.setup.batch_sizes[0], progress=self.progress,
                             t0=t0, batch_sizes=self.setup.batch_sizes)
        entry = dataclasses.asdict(started.capture) if started.capture is not None else {}
        if started.full_decode_launches is not None:
            entry["full_decode_launches"] = started.full_decode_launches
        first = self._first_logits(mode, started.forward, sizes)
        sync(device)
        entry["startup_s"] = time.perf_counter() - t0
        entry["graph_memory_bytes"] = device_used(device) - mem0 if self.on_cuda else None
        if mode == "reduce-overhead":  # graphs Inductor declined to capture (it logs why)
            entry["cudagraph_skips"] = _cudagraph_skips() - skips
        if started.report is not None:
            entry["capture"] = _capture_json(started)
        checkpoint(entry)
        runner = started.runner
        rows = RowTimer(self.steps, self.base, started.forward, self.floor_ms, self.opts.steps,
                        self.opts.warmup, read_planned=None if runner is None else
                        functools.partial(runner.stats.get, "steps_planned"))
        self._time_rows(mode, rows, entry, checkpoint)
        entry.update(rows.counts())
        profile = self._profile(started)
        if profile is not None:
            entry["full_decode_profile"] = profile
        if started.runner is not None:
            entry["runner_stats"] = started.runner.stats.snapshot()
        self.progress.end_mode(f"done in {time.perf_counter() - t0:.1f} s")
        return entry, first

    def floor_ms(self, bs: int, context: int | None) -> float:
        """The bandwidth floor of a decode step of ``bs`` requests at ``context`` tokens."""
        return self.decode_read_bytes(bs, context) / self.bandwidth * 1e3

    def _first_logits(self, mode: str, forward: Callable[[StepInputs], torch.Tensor],
                      sizes: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """The first call of each decode step; the torch.compile modes compile lazily here."""
        self.progress.phase("first call at each batch size"
                            + (" (torch.compile compiles here)" if mode in TORCH_MODES[1:]
                               else ""))
        return {bs: logits_of(forward, self.steps.decode(bs), self.base)().float().cpu()
                for bs in sizes}

    def _time_rows(self, mode: str, rows: RowTimer, entry: dict[str, Any],
                   checkpoint: Callable[[dict[str, Any]], None]) -> None:
        """The ``decode``, ``decode_by_context``, ``decode_grid``, ``mixed`` and
        ``prefill_ms`` entries the mode times (see rows.py), each written as it is timed."""
        sizes = rows_of(mode, self.setup.batch_sizes)
        limited = sizes != self.setup.batch_sizes or mode == "reduce-overhead"
        decode, mixed = entry.setdefault("decode", {}), entry.setdefault("mixed", {})
        for bs in sizes:
            self.progress.phase(f"timing decode and mixed steps at batch size {bs}")
            decode[str(bs)] = rows.decode(bs)
            checkpoint(entry)
            if not limited:
                mixed[str(bs)] = {"median_ms": rows.median_ms(
                    self.steps.mixed(bs), max(1, self.opts.steps // 2), 1)}
            checkpoint(entry)
        if limited:
            return
        contexts = self.setup.shapes.contexts
        by_context = entry.setdefault("decode_by_context", {})
        grid = entry.setdefault("decode_grid", {}) if self.opts.grid else None
        for context in contexts:
            self.progress.phase(f"timing decode at context {context}")
            by_context[str(context)] = rows.decode(sizes[0], context)
            if grid is not None:
                grid[str(context)] = {str(bs): rows.decode(bs, context) for bs in sizes}
            checkpoint(entry)
        self.progress.phase(f"timing a prefill of {self.setup.shapes.prefill_len} tokens")
        entry["prefill_ms"] = rows.median_ms(self.prefill, max(1, self.opts.steps // 4), 1)

    def _profile(self, started: Started) -> dict[str, Any] | None:
        """The profiler table of one FULL decode replay at the smallest batch size and the
        shapes' context (that step is staged through the runner first), or None."""
        if started.compiled is None:
            return None
        bs = self.setup.batch_sizes[0]
        graph = full_decode_graph(started.compiled, bs)
        if graph is None:
            return None
        self.progress.phase(f"profiling one FULL decode replay (batch size {bs})")
        logits_of(started.forward, self.steps.decode(bs), self.base)()
        profile = profile_replay(graph.replay, self.shape.num_layers, self.on_cuda)
        return {"batch_size": bs, "context": self.setup.shapes.context, **profile.to_json(),
                "table": profile.table()}


def _cudagraph_skips() -> int:
    """How many compiled graphs Inductor has run without CUDA graphs in this process (its
    ``cudagraph_skips`` counter): reduce-overhead falls back so when a graph mutates an input
    that is not a parameter or buffer, or holds a CPU tensor."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def _capture_json(started: Started) -> dict[str, Any]:
    """A capture report's figures: every graph, the totals, the runner's own prediction
    (made first where it had a budget) and the refitted pool prediction."""
    report = started.report
    assert report is not None
    refit = predict_pool([CapturedGraph(g.mode.name, g.descriptor.num_tokens, g.memory_bytes)
                          for g in report.graphs])
    return {
        "graphs": [{"mode": g.mode.name, "num_tokens": g.descriptor.num_tokens,
                    "num_reqs": g.descriptor.num_reqs, "uniform": g.descriptor.uniform,
                    "seconds": g.seconds, "memory_bytes": g.memory_bytes,
                    "predicted_bytes": g.predicted_bytes, "probe": g.probe}
                   for g in report.graphs],
        "seconds": report.seconds, "memory_bytes": report.memory_bytes,
        "runner_predicted_bytes": report.predicted_bytes,
        "runner_prediction_error": report.prediction_error,
        "refit": refit.to_json() if refit is not None else None,
        "refit_summary": refit.describe() if refit is not None else None,
        "summary": report.summary(),
    }


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
