"""What a bench run reports: the notes, each mode's logits against eager's, speed-ups, the
plain-text table, results.json and the plot.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

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


def compare_with_eager(result: dict[str, Any], firsts: Mapping[str, list[torch.Tensor]],
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


def add_speedups(result: dict[str, Any], batch_sizes: Sequence[int]) -> None:
    """``speedup_vs_eager`` on every decode row whose batch size eager was timed at."""
    eager_ms = {bs: result["modes"].get("eager", {}).get("decode", {}).get(str(bs), {})
                .get("median_ms") for bs in batch_sizes}
    for entry in result["modes"].values():
        for bs, row in entry.get("decode", {}).items():
            if eager_ms.get(int(bs)):
                row["speedup_vs_eager"] = eager_ms[int(bs)] / row["median_ms"]


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
    tp = result.get("tensor_parallel", 1)
    where = f"{tp} tensor-parallel ranks of {result['device']}" if tp > 1 else result["device"]
    info = (f"{result['preset']} preset on {where} ({result['dtype']}, torch "
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
