"""``freezeframe plan``: choose capture sizes from a histogram of batch sizes, compare them with
vLLM's default ladder, and optionally write them as a config and plot them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from freezeframe.cli import int_at_least
from freezeframe.cli.files import check_output_file, read_file
from freezeframe.errors import ConfigError

__all__ = ["add_parser", "format_plan_table", "run_plan"]


def add_parser(subparsers: Any) -> None:
    """Add ``plan`` to a subparsers object."""
    p = subparsers.add_parser(
        "plan", help="choose capture sizes from a histogram of batch sizes",
        description="Choose the capture sizes that minimise the expected padded work of a "
                    "histogram of step sizes within a budget, and compare them with vLLM's "
                    "default ladder. HISTOGRAM is a JSON object of batch size -> step count, "
                    '{"1": 120, "3": 40, ...}, or the same object under a "histogram" key.')
    p.add_argument("histogram", metavar="HISTOGRAM.json", help="the histogram file")
    p.add_argument("--max-sizes", type=int_at_least(1), default=None,
                   help="capture at most N sizes")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="keep the estimated graph memory of the sizes within M MiB")
    p.add_argument("--max-size", type=int_at_least(1), default=None,
                   help="the largest size to capture (default: the largest in the histogram)")
    p.add_argument("--step-times", metavar="FILE", default=None,
                   help="measured step time per size, JSON {size: time} (default: 16 + padded "
                        "tokens); interpolated between the sizes given")
    p.add_argument("--graph-mib", metavar="FILE", default=None,
                   help="measured graph memory per size in MiB, JSON {size: MiB} (default: "
                        "6 MiB + 8 KiB per token)")
    p.add_argument("--out", metavar="CONFIG.json", default=None,
                   help="write the planned sizes as a compilation config")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="plot the histogram and each ladder's padding (needs matplotlib)")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from freezeframe import planning

    if args.budget_mib is not None and not args.budget_mib >= 0:
        raise ConfigError(f"--budget-mib: must be a number >= 0, got {args.budget_mib}")
    if args.plot is not None:  # before the work, so a missing matplotlib costs nothing
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            raise ConfigError("--plot: matplotlib is not installed; pip install matplotlib (or "
                              "freezeframe[bench]), or leave out --plot") from None
    for flag, path, example in (("--out", args.out, "config.json"),
                                ("--plot", args.plot, "plan.png")):
        if path is not None:  # before the work, so a bad path does not cost the run
            check_output_file(path, flag, example)
    histogram = planning.read_histogram(read_file(args.histogram, "HISTOGRAM"), args.histogram)
    models = {}
    for name, flag in (("step_times", "--step-times"), ("graph_mib", "--graph-mib")):
        path = getattr(args, name)
        if path is not None:
            models[name] = planning.read_size_map(read_file(path, flag), f"{flag} {path}",
                                                  name, "number")
    cost, memory = models.get("step_times"), models.get("graph_mib")
    plan = planning.plan_capture_sizes(histogram, max_sizes=args.max_sizes,
                                       budget_mib=args.budget_mib, cost=cost, memory=memory,
                                       max_size=args.max_size)
    default = planning.evaluate_ladder(histogram, planning.default_ladder(), cost=cost,
                                       memory=memory)
    limits = [f"<= {args.max_sizes} sizes" if args.max_sizes else "",
              f"<= {args.budget_mib:g} MiB" if args.budget_mib is not None else ""]
    label = "plan" + (f" ({', '.join(x for x in limits if x)})" if any(limits) else "")
    sizes = sorted(s for s, c in histogram.items() if c)
    print(f"{args.histogram}: {plan.steps} steps, {len(sizes)} distinct sizes from {sizes[0]} "
          f"to {sizes[-1]}, {plan.real_tokens / plan.steps:.2f} tokens per step")
    print(format_plan_table([(label, plan), (f"vLLM default (to {default.max_size})", default)],
                            measured=cost is not None))
    print("plan sizes: " + " ".join(map(str, plan.sizes)))
    if args.out is not None:
        try:
            Path(args.out).write_text(json.dumps(plan.config_dict(), indent=2) + "\n",
                                      encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--out: cannot write {args.out!r}: {exc.strerror}") from None
        print(f"wrote {args.out} (freezeframe config @{args.out} shows what it captures)")
    if args.plot is not None:
        _plot_plan(histogram, [(label, plan), ("vLLM default", default)], args.plot)
        print(f"wrote {args.plot}")
    return 0


def format_plan_table(rows: Sequence[tuple[str, Any]], *, measured: bool = False) -> str:
    """One line per ladder: sizes, padding waste, padded tokens and step cost per step, graph
    memory, steps above the ladder (which run without a graph)."""
    cost_head = "step time/step" if measured else "cost/step"
    header = (f"{'ladder':<28} {'sizes':>5} {'padding waste':>13} {'padded tokens/step':>18} "
              f"{cost_head:>14} {'graph MiB':>9} {'steps without graph':>19}")
    lines = [header]
    for name, plan in rows:
        lines.append(f"{name:<28} {len(plan.sizes):>5} {plan.waste:>13.2%} "
                     f"{plan.expected_padded_tokens:>18.2f} {plan.expected_work:>14.2f} "
                     f"{plan.total_memory_mib:>9.1f} {plan.uncovered_steps:>19}")
    return "\n".join(lines)


def _plot_plan(histogram: dict[int, int], rows: Sequence[tuple[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(s for s, c in histogram.items() if c)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.bar(sizes, [histogram[s] for s in sizes], width=1.0, color="0.6")
    top.set_ylabel("steps")
    top.set_title("observed batch sizes")
    for name, plan in rows:
        padding = []
        for s in sizes:
            rung = next((r for r in plan.sizes if r >= s), s)
            padding.append(rung - s)
        bottom.step(sizes, padding, where="mid",
                    label=f"{name}: {len(plan.sizes)} sizes, {plan.total_memory_mib:.0f} MiB, "
                          f"waste {plan.waste:.2%}")
    bottom.set_xlabel("batch size (tokens)")
    bottom.set_ylabel("padding per step (tokens)")
    bottom.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise ConfigError(f"--plot: cannot write {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)
