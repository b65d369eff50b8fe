"""Host time per layer of the attention op and of a planned PIECEWISE step, side by side with a
planned FULL step, on the CPU.

    python scripts/attention_host_time.py [--layers 4] [--rounds 40]

Runs from the repository root without PYTHONPATH (this checkout's ``src`` goes first on
``sys.path``). The reference Llama (tiny preset, ``--layers`` layers, its attention on the
Triton path) behind two GraphRunners on the emulated backend, one with PIECEWISE graphs and one
with FULL graphs, each captured at 2 tokens and stepped once (so its step is planned). Then the
recorded work of every graph is dropped and every Triton kernel's launch does nothing: what is
left of a step is its host path, which is what a GPU's step cannot hide when the host is slower
than the kernels. Timed interleaved, round by round, in CPU time of this thread:

  op          one layer's ``freezeframe::attention`` call (its OpOverload, inference mode, the
              arguments the model passed it in a decode step of 2 requests)
  piecewise   a planned PIECEWISE decode step: the pieces' empty replays and every layer's op
  full        a planned FULL decode step: one empty replay

and printed: each row's best and median per call, the PIECEWISE step's host time per layer
((piecewise - full) / layers), the op's share of it, and piecewise / full. The op's launches
are counted out, not timed: on a GPU each costs Triton's launcher (bound once per shape here)
on top. A benchmark script, not a test; compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # this checkout's freezeframe, and its tests/
os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (no GPU here)

import torch  # noqa: E402
from tests.helpers.launches import attention_triton_kernels  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import freezeframe as ff  # noqa: E402
from freezeframe.models import ATTENTION_OP, KVCacheConfig, LlamaModel, build_llama  # noqa: E402
from freezeframe.models.inputs import RequestChunk, build_step  # noqa: E402
from freezeframe.models.llama import LlamaConfig  # noqa: E402
from freezeframe.models.serving import llama_runner_inputs  # noqa: E402
from freezeframe.runtime.runner import GraphRunner  # noqa: E402

CACHE = KVCacheConfig(num_blocks=32, block_size=16, max_model_len=256, attention_kernel="triton")


def _silence_triton_launches() -> None:
    """Every Triton kernel of the attention op's modules launches nothing (its ``run``)."""
    for kernel in attention_triton_kernels():
        kernel.run = lambda *args, **kwargs: None


class _FirstOpCall(TorchDispatchMode):
    """Keeps the arguments of the first attention-op call it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.args: tuple[Any, ...] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.ops.freezeframe.attention.default and self.args is None:
            self.args = tuple(args)
        return func(*args, **(kwargs or {}))


def _runner(layers: int, mode: str, step_args: tuple[torch.Tensor, ...]) -> GraphRunner:
    model = build_llama(LlamaConfig.preset("tiny", num_layers=layers), CACHE, seed=0)
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", splitting_ops=[ATTENTION_OP],
                               cudagraph_mode=mode, graph_backend="emulated",
                               cudagraph_capture_sizes=[1, 2, 4], max_num_tokens=4,
                               max_num_seqs=2, use_cache=False)
    compiled = ff.compile(model, cfg, dynamic_arg_dims=dict(
        LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
    runner = GraphRunner(compiled, cfg, inputs=llama_runner_inputs(model, 2), progress=False)
    runner.capture()
    runner(*step_args, uniform_decode=True)
    runner(*step_args, uniform_decode=True)
    assert runner.planned_shapes == 1, "the decode step was not planned"
    _, desc = runner.dispatcher.dispatch(2, uniform_decode=True)
    for wrapper in compiled.graph_wrappers():
        graph = wrapper.graph_for(desc)
        if graph is not None:
            graph._steps = []  # its recorded work dropped: an empty replay
    return runner


def _per_call_us(variants: dict[str, Callable[[], Any]], rounds: int,
                 iters: int) -> dict[str, list[float]]:
    """Every round's per-call time of each variant, the variants interleaved round by round,
    in this thread's CPU time (time waiting for a core does not count)."""
    for fn in variants.values():
        for _ in range(50):
            fn()
    samples: dict[str, list[float]] = {key: [] for key in variants}
    for _ in range(rounds):
        for key, fn in variants.items():
            start = time.thread_time()
            for _ in range(iters):
                fn()
            samples[key].append((time.thread_time() - start) / iters * 1e6)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _silence_triton_launches()
    step = build_step([RequestChunk((7,), 40, tuple(range(4))),
                       RequestChunk((4,), 90, tuple(range(4, 10)))], CACHE)
    piecewise = _runner(args.layers, "piecewise", step.args)
    full = _runner(args.layers, "full", step.args)
    catch = _FirstOpCall()
    with torch.inference_mode():
        with catch:
            piecewise(*step.args, uniform_decode=True)
        op_args = catch.args
        assert op_args is not None
        op = torch.ops.freezeframe.attention.default
        samples = _per_call_us({
            "op": lambda: op(*op_args),
            "piecewise": lambda: piecewise(*step.args, uniform_decode=True),
            "full": lambda: full(*step.args, uniform_decode=True),
        }, args.rounds, args.iters)
    best = {key: min(values) for key, values in samples.items()}
    median = {key: statistics.median(values) for key, values in samples.items()}
    print(f"decode step of 2 requests, tiny preset, {args.layers} layers, Triton attention "
          f"(launches do nothing), emulated graphs emptied; {args.rounds} rounds x "
          f"{args.iters} calls")
    for key in samples:
        print(f"  {key:10s} best {best[key]:8.1f} us   median {median[key]:8.1f} us")
    for name, rows in (("best", best), ("median", median)):
        per_layer = (rows["piecewise"] - rows["full"]) / args.layers
        print(f"{name}: PIECEWISE host per layer {per_layer:.1f} us, the op {rows['op']:.1f} us "
              f"of it ({rows['op'] / per_layer:.0%}); piecewise / full "
              f"{rows['piecewise'] / rows['full']:.2f}")


if __name__ == "__main__":
    main()
