"""The kernel launches of one decode step of the reference Llama, counted on the CPU.

    python scripts/launch_census.py [--layers 2] [--split-kv auto|on|off]

Runs from the repository root without PYTHONPATH (this checkout's ``src`` and the repository
root, for ``tests.helpers``, go first on ``sys.path``). The tiny preset, its attention on the
Triton kernels (in Triton's interpreter), compiled with the eager compiler and split at the
attention op; one decode step of two requests is counted (tests/helpers/launches.py): aten ops
that launch a GPU kernel in each piece between the ops, the aten and Triton launches inside each
op, and the kernels Inductor generates for each piece (read from its generated code, not
compiled). Prints the counts per piece, per layer, and a 16-layer step (the 1B preset's depth)
made of the first piece, 15 per-layer pieces, the last piece and 16 ops. A counting script, not
a benchmark: no time is measured. tests/unit/test_launch_census.py holds the budget.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # this checkout's freezeframe, and its tests/
os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (no GPU here)

import torch  # noqa: E402
from tests.helpers.launches import (  # noqa: E402
    LaunchCensus,
    attention_triton_kernels,
    inductor_kernels,
)

import freezeframe as ff  # noqa: E402
from freezeframe.models import ATTENTION_OP, KVCacheConfig, LlamaModel, build_llama  # noqa: E402
from freezeframe.models import attention as attention_module  # noqa: E402
from freezeframe.models.inputs import RequestChunk, build_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (at least 2)")
    parser.add_argument("--split-kv", default=None, help="KVCacheConfig.split_kv, if it has one")
    args = parser.parse_args()
    extra = {} if args.split_kv is None else {"split_kv": args.split_kv}
    cache = KVCacheConfig(num_blocks=16, block_size=4, max_model_len=32,
                          attention_kernel="triton", **extra)
    from freezeframe.models.llama import LlamaConfig

    model = build_llama(LlamaConfig.preset("tiny", num_layers=args.layers), cache, seed=0)
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", splitting_ops=[ATTENTION_OP],
                               cudagraph_mode="none", use_cache=False)
    compiled = ff.compile(model, cfg, dynamic_arg_dims=dict(
        LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
    step = build_step([RequestChunk((7,), 5, (0, 1)), RequestChunk((4,), 9, (2, 3, 4))], cache)
    census = LaunchCensus(torch.ops.freezeframe.attention.default, attention_module._attention,
                          attention_triton_kernels())
    with torch.no_grad():
        compiled(*step.args)
        with census:
            compiled(*step.args)
    pieces = [piece for piece in compiled.pieces if piece.capturable]
    fused = [inductor_kernels(piece.graph) for piece in pieces]
    print(f"decode step of 2 requests, tiny preset, {args.layers} layers, Triton attention "
          f"(interpreted), split_kv={args.split_kv or 'default'}")
    for i, (piece, eager, kernels) in enumerate(zip(pieces, census.pieces, fused, strict=True)):
        print(f"piece {i} ({piece.name}): {sum(eager.values())} eager aten launches, "
              f"{len(kernels)} Inductor kernels: {', '.join(kernels)}")
        if i < len(census.op_aten):
            print(f"  op {i}: {sum(census.op_aten[i].values())} aten launches "
                  f"{dict(census.op_aten[i])}, Triton {dict(census.op_triton[i])}")
    op = census.op_launches(0)
    layer_eager = sum(census.pieces[1].values()) + op
    layer_inductor = len(fused[1]) + op
    print(f"per layer: eager {layer_eager} launches, Inductor {layer_inductor} "
          f"({len(fused[1])} in the piece + {op} in the op)")
    step16 = len(fused[0]) + 15 * len(fused[1]) + len(fused[-1]) + 16 * op
    print(f"16-layer step with Inductor: {step16} launches, {step16 / 16:.2f} per layer")


if __name__ == "__main__":
    main()
