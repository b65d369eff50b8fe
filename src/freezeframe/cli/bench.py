"""``freezeframe bench``: the reference Llama under eager, torch.compile and freezeframe modes
(:mod:`freezeframe.bench` runs it; this is its arguments, its printed table and exit status)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from freezeframe.cli import int_at_least, int_list

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    """Add ``bench`` to a subparsers object."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark the reference Llama: eager vs torch.compile vs freezeframe graph modes",
        description="Time decode, mixed and prefill steps of the reference Llama per mode and "
                    "batch size; report startup, graph memory and the share of the bandwidth "
                    "floor. Prints a table, writes results.json and latency_vs_batch.png "
                    "(the plot needs matplotlib). Progress goes to stderr (a bar with tqdm on a "
                    "terminal, plain lines otherwise).",
    )
    p.add_argument("--preset", choices=["tiny", "1b"], default="tiny")
    p.add_argument("--batch-sizes", type=int_list(1), default=(1, 2, 4, 8),
                   help="comma-separated decode batch sizes (default 1,2,4,8)")
    p.add_argument("--modes", default=None,
                   help="comma-separated subset of: eager, compile, reduce-overhead, none, "
                        "piecewise, full, full_and_piecewise, breakable, full_and_breakable "
                        "(default: all of these), and the Hugging Face generate modes hf-eager, "
                        "hf-compile, ff-hf, ff-hf-lookup (run when named; need transformers)")
    p.add_argument("--steps", type=int_at_least(1), default=20,
                   help="timed steps per measurement (default 20)")
    p.add_argument("--warmup", type=int_at_least(0), default=3,
                   help="untimed steps before each measurement (default 3)")
    p.add_argument("--context", type=int_at_least(1), default=None,
                   help="decode context length per request (default 64 tiny, 1024 1b)")
    p.add_argument("--contexts", type=int_list(1), default=(128, 1024, 4096),
                   help="comma-separated decode context lengths timed side by side at the "
                        "smallest batch size (default 128,1024,4096; lengths beyond the "
                        "preset's positions are skipped and named in the notes)")
    p.add_argument("--grid", action="store_true",
                   help="also time decode at every context and batch size")
    p.add_argument("--mixed-chunk", type=int_at_least(1), default=16,
                   help="prompt tokens of the mixed step's extra request (default 16)")
    p.add_argument("--hf-new-tokens", type=int_at_least(2), default=64,
                   help="tokens each Hugging Face mode's generate adds per prompt (default 64)")
    p.add_argument("--attention-kernel", choices=["auto", "torch", "triton"], default="auto",
                   help="who reads the KV cache: auto (triton on CUDA when installed, else "
                        "torch), torch (the pure-torch reference paths) or triton (our paged "
                        "kernel; on CPU only under TRITON_INTERPRET=1, for checks, not speed)")
    p.add_argument("--prefill-len", type=int_at_least(1), default=None,
                   help="prefill length in tokens (default 64 tiny, 512 1b)")
    p.add_argument("--compiler", choices=["eager", "inductor"], default=None,
                   help="default: inductor on CUDA, eager on CPU (Inductor on CPU is slow)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--tp", type=int_at_least(1), default=1,
                   help="tensor-parallel ranks (default 1). Under torchrun (--nproc-per-node "
                        "N) each rank is one of its processes; without it the bench spawns N "
                        "processes itself. On the CPU the ranks talk over gloo and graphs are "
                        "emulated: the times are overhead, not speed. Modes: eager, none, "
                        "piecewise, full, full_and_piecewise (the default with --tp)")
    p.add_argument("--out", default="bench_out", help="directory for results.json and the plot")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from freezeframe.bench.modes import ALL_MODES, DEFAULT_MODES, TP_MODES, modes_from
    from freezeframe.bench.progress import Progress
    from freezeframe.bench.report import format_table, mismatched_modes
    from freezeframe.bench.run import BenchOptions, run_bench
    from freezeframe.errors import ConfigError

    if args.modes is not None and not args.modes.strip(","):
        raise ConfigError(f"--modes: give at least one of {list(ALL_MODES)}")
    if not args.out.strip():
        raise ConfigError("--out: give a directory for results.json and the plot")
    opts = BenchOptions(
        preset=args.preset,
        batch_sizes=tuple(args.batch_sizes),
        modes=modes_from(args.modes) if args.modes else (
            TP_MODES if args.tp > 1 else DEFAULT_MODES),
        steps=args.steps,
        warmup=args.warmup,
        context=args.context,
        contexts=tuple(args.contexts),
        attention_kernel=args.attention_kernel,
        prefill_len=args.prefill_len,
        mixed_chunk=args.mixed_chunk,
        grid=args.grid,
        hf_new_tokens=args.hf_new_tokens,
        compiler=args.compiler,
        device=args.device,
        out=args.out,
        tp=args.tp,
    )
    if opts.tp > 1:
        from freezeframe.bench.tp import run_tp_bench

        tp_result = run_tp_bench(opts, args.quiet)
        if tp_result is None:  # a rank other than 0 under torchrun: rank 0 reports
            return 0
        result = tp_result
    else:
        with Progress(len(opts.modes), enabled=not args.quiet) as progress:
            result = run_bench(opts, progress)
    print(format_table(result))
    print(f"wrote {args.out}/results.json" + (
        "" if any("matplotlib" in n for n in result["notes"])
        else f" and {args.out}/latency_vs_batch.png"))
    wrong = mismatched_modes(result)
    if wrong:
        print(f"freezeframe bench: error: {', '.join(wrong)} gave other logits than eager "
              "(see the notes above)", file=sys.stderr)
        return 1
    return 0
