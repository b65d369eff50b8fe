"""Per-call overhead of a compiled model against calling its pieces directly.

    PYTHONPATH=src:. python scripts/call_overhead.py

Compiles toy models with the eager compiler (so the pieces themselves cost what eager costs)
and times, per call:
  eager       the original module
  compiled    CompiledModel(x): captured Dynamo bytecode -> stitching -> piece dispatch
  bytecode    the captured bytecode alone (no CompiledModel.forward around it)
  stitching   the stitching graph on the flat graph inputs (piece dispatch included)
  pieces      the stitching graph with each piece's entry bound directly (no dispatch)
The differences are the costs of each layer; a benchmark script, not a test.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from tests.helpers.toy_models import LlamaConfig, SillyModel, ToyLlama

import freezeframe as ff


def per_call_us(variants: dict[str, Callable[[], Any]], rounds: int = 15,
                iters: int = 400) -> dict[str, float]:
    """Best per-call time of each variant, measured interleaved round by round so that load
    from other processes on a shared machine hits every variant alike."""
    for fn in variants.values():
        for _ in range(100):
            fn()
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for key, fn in variants.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            best[key] = min(best[key], (time.perf_counter() - start) / iters * 1e6)
    return best


def measure(name: str, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", cudagraph_mode="none",
                               splitting_ops=["silly::attention"], use_cache=False)
    model = ff.compile(module, cfg)
    model(*args)
    backend = model._backend
    stitching = backend.stitching
    # The flat graph inputs, rebuilt from the sources Dynamo recorded for each placeholder.
    frame = dict(zip(inspect.signature(module.forward).parameters, args, strict=False))
    frame["self"] = module
    flat = []
    for node in stitching.graph.nodes:
        if node.op == "placeholder":
            flat.append(eval(node.meta["grapharg"].source.name, {"L": frame}))
    n = int(next(a for a in flat if isinstance(a, torch.Tensor)).shape[0])

    fast = model._trace._fast
    direct = {}
    names = [p.name for p in backend.pieces if p.capturable]
    for piece_name, pb in zip(names, backend.piece_backends, strict=True):
        direct[piece_name] = pb.runnable_for(n)
    pieces_stitching = copy.copy(stitching)
    for piece_name, fn in direct.items():      # plain attributes, as the backends are
        pieces_stitching._modules.pop(piece_name, None)
        pieces_stitching.__dict__[piece_name] = fn
    assert getattr(pieces_stitching, names[0]) is direct[names[0]]
    assert getattr(stitching, names[0]) is backend.piece_backends[0]
    rows = per_call_us({
        "eager": lambda: module(*args),
        "compiled": lambda: model(*args),
        "bytecode": lambda: fast(module, *args),
        "stitching": lambda: stitching.forward(*flat),
        "pieces": lambda: pieces_stitching.forward(*flat),
    })

    print(f"\n{name}: {len(backend.pieces)} pieces, {len(backend.piece_backends)} capturable")
    for key, us in rows.items():
        print(f"  {key:<10} {us:8.1f} us/call")
    print(f"  overhead compiled - pieces: {rows['compiled'] - rows['pieces']:.1f} us/call "
          f"({rows['compiled'] / rows['pieces']:.2f}x); of which piece dispatch "
          f"{rows['stitching'] - rows['pieces']:.1f} us, bytecode + arg gathering "
          f"{rows['bytecode'] - rows['stitching']:.1f} us, CompiledModel.forward "
          f"{rows['compiled'] - rows['bytecode']:.1f} us")


def main() -> None:
    torch.set_num_threads(1)
    with torch.inference_mode():
        measure("SillyModel(x: 8)", SillyModel(), (torch.randn(8),))
        cfg = LlamaConfig(num_layers=12, hidden_size=16, mlp_size=32, vocab_size=32)
        measure("ToyLlama(12 layers, 8 tokens)", ToyLlama(cfg),
                (torch.randint(0, 32, (8,)), torch.arange(8)))


if __name__ == "__main__":
    main()
