"""Predicted against measured graph memory, on the emulated backend (no GPU needed).

    PYTHONPATH=src:. python scripts/graph_memory.py [--sizes 1,2,4,8,16,32,64] [--mode MODE]

Compiles freezeframe's tiny Llama (models.build_llama("tiny")) with the eager compiler and
captures every graph through a GraphRunner with a graph-memory budget (twice the total a first
capture measured), so the runner measures size one and the two smallest sizes above it of each
family first, predicts the rest, then captures them. It prints, per graph, the predicted bytes,
the measured bytes (the emulated graph's own accounting: the tensors it keeps) and the error,
then the totals and the fitted lines. A table to paste, not a test.
"""

from __future__ import annotations

import argparse
import platform

import torch

import freezeframe as ff
from freezeframe.models import ATTENTION_OP, KVCacheConfig, LlamaModel, build_llama
from freezeframe.models.serving import llama_runner_inputs
from freezeframe.runtime import CaptureReport, GraphRunner
from freezeframe.runtime.graph_memory import format_bytes

MAX_SEQS = 8


def capture(sizes: list[int], mode: str, budget: int | None) -> CaptureReport:
    model = build_llama("tiny", KVCacheConfig(num_blocks=64, block_size=4, max_model_len=64),
                        seed=0)
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=[ATTENTION_OP], cudagraph_mode=mode,
        cudagraph_capture_sizes=sizes, graph_backend="emulated", max_num_seqs=MAX_SEQS,
        max_num_tokens=max(sizes), use_cache=False)
    compiled = ff.compile(model, cfg, dynamic_arg_dims=dict(
        LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
    runner = GraphRunner(compiled, cfg, inputs=llama_runner_inputs(model, MAX_SEQS),
                         progress=False, graph_memory_budget=budget)
    return runner.capture()


def table(report: CaptureReport) -> str:
    lines = ["| mode | tokens | reqs | measured first | predicted (B) | measured (B) | error |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for g in report.graphs:
        d = g.descriptor
        assert g.predicted_bytes is not None
        error = (g.predicted_bytes - g.memory_bytes) / g.memory_bytes if g.memory_bytes else 0.0
        lines.append(f"| {g.mode.name} | {d.num_tokens} | "
                     f"{'-' if d.num_reqs is None else d.num_reqs} | "
                     f"{'yes' if g.probe else 'no'} | {g.predicted_bytes} | {g.memory_bytes} | "
                     f"{error:+.2%} |")
    assert report.prediction is not None and report.prediction_error is not None
    lines.append("")
    lines.append(f"total: predicted {report.prediction.total_bytes} B "
                 f"({format_bytes(report.prediction.total_bytes)}), measured "
                 f"{report.memory_bytes} B ({format_bytes(report.memory_bytes)}), error "
                 f"{report.prediction_error:+.2%}")
    for family in report.prediction.fits:
        kind = "decode" if family.uniform else "mixed"
        lines.append(f"line {family.mode.name} {kind}: {family.fit.intercept:.1f} B + "
                     f"{family.fit.slope:.1f} B/token (fitted on sizes {list(family.fit.sizes)})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--mode", default="full_and_piecewise")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.manual_seed(0)
    # a first capture without a budget tells the total; the second, with a budget of twice
    # that, takes the budget path (smallest sizes first, predict, then the rest)
    measured = capture(sizes, args.mode, None).memory_bytes
    report = capture(sizes, args.mode, 2 * measured)
    print(f"tiny Llama, cudagraph_mode={args.mode}, sizes {sizes}, max_num_seqs={MAX_SEQS}, "
          f"emulated backend, torch {torch.__version__}, {platform.machine()} CPU "
          f"({torch.get_num_threads()} threads)")
    print()
    print(table(report))


if __name__ == "__main__":
    main()
