"""``freezeframe demo``: compile the built-in example model, run it for several batch sizes and
check each output against eager."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from freezeframe.cli import int_at_least, int_list
from freezeframe.errors import ConfigError

if TYPE_CHECKING:  # torch and the compile stage are imported only when the demo runs
    from freezeframe.compilation import CompiledModel

__all__ = ["add_parser", "run_demo"]


def add_parser(subparsers: Any) -> None:
    """Add ``demo`` to a subparsers object."""
    p = subparsers.add_parser(
        "demo", help="compile and run the built-in example model",
        description="Compile the built-in example model (split at freezeframe_example::mix), "
                    "run it for several batch sizes and check the outputs against eager.")
    p.add_argument("--backend", default="eager", choices=["eager", "inductor"],
                   help="compiler for each piece (default: eager)")
    p.add_argument("--layers", type=int_at_least(1), default=2,
                   help="number of layers (default: 2)")
    p.add_argument("--hidden", type=int_at_least(1), default=32,
                   help="hidden size (default: 32)")
    p.add_argument("--sizes", type=int_list(1), default=(1, 2, 3, 8, 17, 64),
                   help="comma-separated batch sizes to run (default: 1,2,3,8,17,64)")
    p.add_argument("--max-num-tokens", type=int_at_least(1), default=256,
                   help="largest batch the config allows (default: 256)")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    import torch

    import freezeframe as ff
    from freezeframe.models.example import MIX_OP, ExampleMLP

    sizes = list(args.sizes)
    too_big = [s for s in sizes if s > args.max_num_tokens]
    if too_big:
        raise ConfigError(f"--sizes: {too_big} exceed --max-num-tokens={args.max_num_tokens}; "
                          "raise --max-num-tokens or drop them")
    cfg = ff.CompilationConfig(mode="piecewise", backend=args.backend, splitting_ops=[MIX_OP],
                               cudagraph_mode="none", max_num_tokens=args.max_num_tokens)
    module = ExampleMLP(hidden_size=args.hidden, num_layers=args.layers).eval()
    model = ff.compile(module, cfg, dynamic_arg_dims={"x": 0})
    print(f"freezeframe demo: ExampleMLP(hidden={args.hidden}, layers={args.layers}), "
          f"split at {MIX_OP}, compiler {cfg.backend}")

    failures = 0
    with torch.no_grad():
        for i, n in enumerate(sizes):
            x = module.example_input(n)                  # [n, hidden]
            start = time.perf_counter()
            got = model(x)
            elapsed = time.perf_counter() - start
            want = module(x)
            if i == 0:
                print(f"first call (trace + split + compile + run): {elapsed:.3f} s")
                _print_pieces(model)
            ok = got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
            diff = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
            failures += not ok
            print(f"  batch {n:>5}: {'ok  ' if ok else 'FAIL'} max |compiled - eager| = "
                  f"{diff:.2e}  ({elapsed * 1e3:.2f} ms)")
    stats = model.stats.snapshot()
    print("stats: " + " ".join(f"{k}={v}" for k, v in sorted(stats.items())))
    if failures:
        print(f"{failures} of {len(sizes)} batch sizes differ from eager", file=sys.stderr)
        return 1
    print(f"all {len(sizes)} batch sizes match eager")
    return 0


def _print_pieces(model: CompiledModel) -> None:
    pieces = model.pieces
    capturable = sum(1 for p in pieces if p.capturable)
    print(f"pieces: {len(pieces)} ({capturable} capturable)")
    for p in pieces:
        kind = "splitting op (eager)" if p.is_splitting_op else "compiled"
        ops = sum(1 for node in p.graph.graph.nodes
                  if node.op in ("call_function", "call_method", "call_module"))
        print(f"  piece {p.index}: {p.name} {kind}, {ops} ops")
