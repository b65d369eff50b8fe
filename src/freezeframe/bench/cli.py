"""``freezeframe bench``: the reference Llama under eager, torch.compile and freezeframe modes."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark the reference Llama: eager vs torch.compile vs freezeframe graph modes",
        description="Time decode, mixed and prefill steps of the reference Llama per mode and "
                    "batch size; report startup, graph memory and the share of the bandwidth "
                    "floor. Prints a table, writes results.json and latency_vs_batch.png.",
    )
    p.add_argument("--preset", choices=["tiny", "1b"], default="tiny")
    p.add_argument("--batch-sizes", default="1,2,4,8",
                   help="comma-separated decode batch sizes (default 1,2,4,8)")
    p.add_argument("--modes", default=None,
                   help="comma-separated subset of: eager, compile, reduce-overhead, none, "
                        "piecewise, full, full_and_piecewise (default: all)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--context", type=int, default=None,
                   help="decode context length per request (default 64 tiny, 1024 1b)")
    p.add_argument("--prefill-len", type=int, default=None)
    p.add_argument("--compiler", choices=["eager", "inductor"], default=None,
                   help="default: inductor on CUDA, eager on CPU (Inductor on CPU is slow)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--out", default="bench_out", help="directory for results.json and the plot")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from freezeframe.bench.run import (
        ALL_MODES,
        BenchOptions,
        format_table,
        modes_from,
        parse_list,
        run_bench,
    )

    opts = BenchOptions(
        preset=args.preset,
        batch_sizes=parse_list(args.batch_sizes),
        modes=modes_from(args.modes) if args.modes else ALL_MODES,
        steps=args.steps,
        warmup=args.warmup,
        context=args.context,
        prefill_len=args.prefill_len,
        compiler=args.compiler,
        device=args.device,
        out=args.out,
    )
    result = run_bench(opts)
    print(format_table(result))
    print(f"wrote {args.out}/results.json" + (
        "" if any("matplotlib" in n for n in result["notes"])
        else f" and {args.out}/latency_vs_batch.png"))
    return 0
