"""``freezeframe config``: resolve a compilation config and print what it means (or, with
``--json``, the resolved config and its cache key)."""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

from freezeframe.cli.files import read_config_text

__all__ = ["add_parser", "describe_config", "run_config"]


def add_parser(subparsers: Any) -> None:
    """Add ``config`` to a subparsers object."""
    p = subparsers.add_parser(
        "config", help="print the resolved compilation config",
        description="Resolve a compilation config (a vLLM compilation-config JSON with the "
                    "fields freezeframe supports is accepted as is) and print what it means.")
    p.add_argument("config", help="a JSON object, '-' to read it from stdin, or @FILE")
    p.add_argument("--json", action="store_true",
                   help="print the resolved config as JSON (with cache_key) instead")
    p.set_defaults(func=run_config)


def run_config(args: argparse.Namespace) -> int:
    from freezeframe.config import CompilationConfig

    cfg = CompilationConfig.from_json(read_config_text(args.config))
    if args.json:
        print(json.dumps({**cfg.to_dict(), "cache_key": cfg.cache_key()}, indent=2,
                         sort_keys=True))
    else:
        print(describe_config(cfg))
    return 0


def describe_config(cfg: Any) -> str:
    """A human-readable summary of a resolved :class:`CompilationConfig`."""
    from freezeframe.sizes import padding_intervals

    def wrap(text: str) -> str:
        return textwrap.fill(text, width=96, subsequent_indent=" " * 20)

    graph_mode = cfg.cudagraph_mode
    mode_text = graph_mode.name
    if graph_mode.separate_routine():
        mode_text += (f" (uniform decode: {graph_mode.decode_mode().name}, "
                      f"mixed: {graph_mode.mixed_mode().name})")
    sizes = cfg.cudagraph_capture_sizes
    if sizes:
        size_text = f"{len(sizes)} sizes, max {sizes[-1]}: " + " ".join(map(str, sizes))
        padding_text = (_padding_cells(padding_intervals(sizes))
                        + f"; 0 and above {sizes[-1]}: no graph (unpadded)")
    else:
        size_text = "none (CUDA graphs off)"
        padding_text = "none: every batch runs unpadded without a graph"
    if cfg.splitting_ops is None:
        ops_text = "none given (the graph is not split: one piece)"
    elif not cfg.splitting_ops:
        ops_text = "[] (no split)"
    else:
        ops_text = " ".join(cfg.splitting_ops)
    rows = [
        ("mode", f"{cfg.mode.name} ({int(cfg.mode)})"),
        ("backend", cfg.backend),
        ("splitting_ops", ops_text),
        ("cudagraph_mode", mode_text),
        ("graph_backend", cfg.graph_backend),
        ("capture sizes", size_text),
        ("padding", padding_text),
        ("compile ranges", " ".join(str(r) for r in cfg.compile_ranges())),
        ("compile sizes", " ".join(map(str, cfg.compile_sizes)) or "none"),
        ("batch limits", f"max_num_tokens={cfg.max_num_tokens} max_num_seqs={cfg.max_num_seqs} "
                         f"num_speculative_tokens={cfg.num_speculative_tokens} "
                         f"max_loras={cfg.max_loras}"),
        ("cache key", cfg.cache_key()),
    ]
    return "\n".join(wrap(f"{name:<19} {value}") for name, value in rows)


def _padding_cells(intervals: list[Any]) -> str:
    """``lo..hi->size`` cells; a run of 3+ evenly spaced sizes, each covering exactly its step,
    is folded into ``lo..hi->next multiple of STEP``-style cells to keep 51 sizes readable."""
    cells, i = [], 0
    while i < len(intervals):
        r, size = intervals[i]
        step = r.end - r.start + 1
        j = i
        while (j + 1 < len(intervals) and intervals[j + 1][0].end - intervals[j + 1][0].start
               + 1 == step and intervals[j + 1][1] == intervals[j][1] + step):
            j += 1
        if j - i >= 2:
            last = intervals[j]
            cells.append(f"{r.start}..{last[0].end}->{size},{size + step},..,{last[1]} "
                         f"(every {step})")
            i = j + 1
            continue
        cells.append(f"{r.start}->{size}" if r.is_single_size() else f"{r.start}..{r.end}->{size}")
        i += 1
    return " ".join(cells)
