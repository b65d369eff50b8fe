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

With ``grid`` decode is also timed at every context and batch size (issue 44's sweep); the
Hugging Face modes (``hf-eager``, ``hf-compile``, ``ff-hf``, ``ff-hf-lookup``) time
``generate`` on a Hugging Face Llama of the preset's shapes beside them (``hf_modes``). After the
modes, ``comparisons`` sets the figures side by side: each decode row against the best peer
(eager, torch.compile, reduce-overhead), PIECEWISE against FULL, context 4096 against 128,
breakable against traced, freezeframe's FULL against reduce-overhead, ff.hf against HF.

This module runs it: the device and output checks and the loop over modes, each written as
it goes (after every timed row), a mode that raises recorded with its error while the others
run. The options are in ``options``, the model and one mode's run in ``workload``, how a mode
is built and started in ``modes``, which rows it times in ``rows``, and what is reported (the
eager check, the comparisons, the table, results.json, the plot) in ``report`` and
``compare``.
"""

from __future__ import annotations

import logging
import os
import tempfile
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from freezeframe.bench.compare import add_comparisons
from freezeframe.bench.hf_modes import HFBench
from freezeframe.bench.measure import StepShapes, split_contexts
from freezeframe.bench.modes import HF_MODES
from freezeframe.bench.options import DEFAULT_CONTEXTS, BenchOptions
from freezeframe.bench.progress import Progress
from freezeframe.bench.report import (
    add_speedups,
    compare_with_eager,
    setup_notes,
    write_json,
    write_outputs,
)
from freezeframe.bench.workload import Setup, Workload
from freezeframe.errors import ConfigError
from freezeframe.models import LlamaConfig

__all__ = ["DEFAULT_CONTEXTS", "BenchOptions", "prepare_out_dir", "resolve_device", "run_bench"]

logger = logging.getLogger(__name__)


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
    bench = Workload.build(opts, Setup(device, compiler, shapes, batch_sizes), llama_config,
                           progress)
    result = bench.header(notes)
    _run_modes(opts, bench, result, out)
    if out is not None:
        write_outputs(result, out)
    return result


def _run_modes(opts: BenchOptions, bench: Workload, result: dict[str, Any],
               out: Path | None) -> None:
    """Each mode in turn, its entry written after every timed row and again when it ends; a
    mode that raises keeps what it timed, with its ``error``, and the next mode runs."""
    # each mode's logits of its first decode step at each batch size, compared with eager's
    firsts: dict[str, Mapping[int, torch.Tensor]] = {}
    result["unfinished_modes"] = list(opts.modes)
    hf = HFBench(opts.preset, bench.setup.device, opts.hf_new_tokens, opts.seed) \
        if any(m in HF_MODES for m in opts.modes) else None

    def checkpoint(mode: str, entry: dict[str, Any]) -> None:
        result["modes"][mode] = entry
        if out is not None:
            write_json(result, out)

    for mode in opts.modes:
        live: list[dict[str, Any]] = [{}]  # the mode's entry as it grows

        def keep(entry: dict[str, Any], mode: str = mode,
                 live: list[dict[str, Any]] = live) -> None:
            live[0] = entry
            checkpoint(mode, {**entry, "unfinished": True})

        try:
            if hf is not None and mode in HF_MODES:
                bench.progress.start_mode(mode)
                entry, first = _hf_mode(hf, mode, keep), None
                bench.progress.end_mode("done")
            else:
                entry, first = bench.run_mode(mode, keep)
        except Exception as exc:  # one mode's failure must not lose the others
            logger.error("bench mode %s failed:\n%s", mode, traceback.format_exc())
            entry, first = {**live[0], "error": f"{type(exc).__name__}: {exc}"[:2000]}, None
            bench.progress.end_mode(f"failed: {type(exc).__name__}")
        result["unfinished_modes"].remove(mode)
        if first is not None:
            firsts[mode] = first
        result["modes"][mode] = entry
        # each mode once, as soon as it and eager have run
        compare_with_eager(result, firsts, bench.dtype,
                           only=None if mode == "eager" else mode)
        add_speedups(result, bench.setup.batch_sizes)
        add_comparisons(result)
        checkpoint(mode, entry)
    if "eager" not in firsts:
        result["notes"].append("outputs not checked: the eager mode was not run")


def _hf_mode(hf: HFBench, mode: str, keep: Any) -> dict[str, Any]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed (pip install transformers)"}
    return hf.run(mode, keep)


def _check_fits(shapes: StepShapes, preset: str, llama_config: LlamaConfig) -> None:
    """A :class:`ConfigError` when the longest request does not fit the preset's positions."""
    if shapes.max_model_len > llama_config.max_position:
        raise ConfigError(
            f"--context {shapes.context} / --prefill-len {shapes.prefill_len} leave no room in "
            f"the {preset} preset's {llama_config.max_position} positions (the longer one plus "
            f"one block of {shapes.block_size} must fit); use at most "
            f"{llama_config.max_position - shapes.block_size}")



