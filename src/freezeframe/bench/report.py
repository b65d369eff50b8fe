"""What a bench run reports: the notes, each mode's logits against eager's, speed-ups,
results.json and the plot (the plain-text table is ``table``'s).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from freezeframe.bench.table import format_table

__all__ = ["MATCH_TOLERANCE", "MATCH_TOLERANCE_16BIT", "add_speedups", "compare_with_eager",
           "format_table", "mismatched_modes", "setup_notes", "write_json", "write_outputs"]


def setup_notes(on_cuda: bool, compiler: str, tp: int = 1) -> list[str]:
    """What the reader of the numbers must know about this machine, the compiler and, with
    ``tp`` ranks, tensor parallelism."""
    notes: list[str] = []
    if tp > 1 and on_cuda:
        notes.append(f"tensor parallel over {tp} GPUs (NCCL): each rank holds 1/{tp} of every "
                     "layer; two all-reduces per decoder layer run inside the graphs; the "
                     "times are rank 0's")
    elif tp > 1:
        notes.append(f"tensor parallel over {tp} CPU processes (gloo over loopback TCP) with "
                     "emulated graphs: these times show emulation and communication overhead, "
                     "not speed; the times are rank 0's")
    if not on_cuda:
        notes.append(
            "no CUDA device: freezeframe graph modes run on the emulated backend (replays re-run "
            "recorded ops in Python), so their numbers show emulation overhead, not graph "
            "speed-ups; reduce-overhead is skipped; the bandwidth floor is a host-memory floor")
    if compiler == "eager":
        notes.append("compiler=eager: torch.compile and ff.compile use the eager backend "
                     "(no Inductor kernels); pass --compiler inductor for generated kernels")
    return notes


# Largest |logits - eager logits| over the largest |eager logit| a mode may show: float32 runs
# the same math in another order; 16-bit types round every layer's activations.
MATCH_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
MATCH_TOLERANCE_16BIT = 5e-2


def compare_with_eager(result: dict[str, Any], firsts: Mapping[str, Mapping[int, torch.Tensor]],
                       dtype: torch.dtype, only: str | None = None) -> None:
    """Record, per mode, how far its logits are from eager's on the same steps (each decode
    batch size both ran: ``max_rel_diff_vs_eager``) and whether that is within tolerance
    (``matches_eager``); a mode that does not match is named in the notes. ``only``: that
    mode alone (else every mode run so far). Nothing happens before the eager mode has run."""
    reference = firsts.get("eager")
    if reference is None:
        return
    tolerance = MATCH_TOLERANCE.get(dtype, MATCH_TOLERANCE_16BIT)
    result["match_tolerance"] = tolerance
    for mode, outs in firsts.items():
        shared = [bs for bs in outs if bs in reference]
        if (only is not None and mode != only) or not shared:
            continue
        diff = max(float((outs[bs] - reference[bs]).abs().max())
                   / max(float(reference[bs].abs().max()), 1e-12) for bs in shared)
        entry = result["modes"][mode]
        entry["max_rel_diff_vs_eager"] = diff
        entry["matches_eager"] = diff <= tolerance
        if diff > tolerance:
            result["notes"].append(
                f"{mode}: logits differ from eager's by {diff:.2e} of their largest value "
                f"(tolerance {tolerance:.0e}): a wrong answer, not a speed result")


def mismatched_modes(result: Mapping[str, Any]) -> list[str]:
    return [m for m, e in result["modes"].items() if e.get("matches_eager") is False]


def add_speedups(result: dict[str, Any], batch_sizes: Sequence[int]) -> None:
    """``speedup_vs_eager`` on every decode row whose batch size eager was timed at."""
    eager_ms = {bs: result["modes"].get("eager", {}).get("decode", {}).get(str(bs), {})
                .get("median_ms") for bs in batch_sizes}
    for entry in result["modes"].values():
        for bs, row in entry.get("decode", {}).items():
            if eager_ms.get(int(bs)):
                row["speedup_vs_eager"] = eager_ms[int(bs)] / row["median_ms"]


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
