"""What ``GraphRunner(..., verify=N)`` costs, side by side in one run.

    python scripts/verify_cost.py [--rounds 30] [--layers 2]

Runs from the repository root without PYTHONPATH: this checkout's ``src`` and the repository
root (for ``tests.helpers``) go first on ``sys.path``.

Two runners over the same ToyLlama (eager compiler, FULL graphs on the emulated backend, capture
size 8): one with ``verify=rounds`` (every timed step is a verified step: the graph step, one
eager forward on copies of the inputs and the comparison), one without. Their steps are timed
alternately, so both see the same machine. It prints the median step of each, the difference,
and the eager forward alone: a verified step costs about one eager forward more, plus the copies
of the model's buffers. A benchmark script, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # this checkout's freezeframe, and its tests/

from tests.helpers.toy_models import LlamaConfig, ToyLlama  # noqa: E402

import freezeframe as ff  # noqa: E402
from freezeframe.runtime import GraphRunner, Tokens  # noqa: E402


def runner_for(module: torch.nn.Module, verify: int) -> GraphRunner:
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
        cudagraph_mode="full", graph_backend="emulated", cudagraph_capture_sizes=[8],
        max_num_tokens=8, max_num_seqs=8, use_cache=False)
    long = {"dtype": torch.long}
    runner = GraphRunner(ff.compile(module, cfg), cfg, progress=False, verify=verify,
                         inputs={"input_ids": Tokens(**long), "positions": Tokens(**long)})
    runner.capture()
    return runner


def main() -> int:
    parser = argparse.ArgumentParser(prog="verify_cost.py", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    module = ToyLlama(LlamaConfig(num_layers=args.layers, hidden_size=64, mlp_size=128))
    verified = runner_for(module, verify=args.rounds + 1)
    plain = runner_for(module, verify=0)
    ids = torch.randint(0, 100, (6,))
    pos = torch.arange(6)
    for runner in (verified, plain):
        runner(ids, pos)  # the first step of the shape plans it
    times: dict[str, list[float]] = {"verified": [], "plain": [], "eager": []}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, call in (("verified", lambda: verified(ids, pos)),
                               ("plain", lambda: plain(ids, pos)),
                               ("eager", lambda: module(ids, pos))):
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(f"ToyLlama({args.layers} layers), 6 tokens padded to 8, {args.rounds} rounds")
    print(f"  graph step            {med['plain']:8.1f} us")
    print(f"  verified graph step   {med['verified']:8.1f} us")
    print(f"  verify adds           {med['verified'] - med['plain']:8.1f} us "
          f"({med['verified'] / med['plain']:.2f}x)")
    print(f"  eager forward alone   {med['eager']:8.1f} us")
    checked = verified.stats.verified_steps
    print(f"  verified steps: {checked}, mismatches: {verified.stats.verify_mismatches}")
    return 0 if checked == args.rounds + 1 and verified.stats.verify_mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
