"""Startup and early serving under the three capture policies, side by side in one run.

    python scripts/capture_policies.py [--steps 1000] [--layers 2]

Runs from the repository root without PYTHONPATH: this checkout's ``src`` and the repository
root (for ``tests.helpers``) go first on ``sys.path``.

For each policy (eager, lazy, background) a fresh ToyLlama is compiled (eager compiler, FULL
graphs on the emulated backend: this script is for the CPU) and served a fixed stream of steps
whose sizes follow a decode-heavy mix. It prints, per policy:

  startup      compile + GraphRunner + capture() + the first step, until its output exists
  N steps      the whole stream (after the first step), and the mean per step
  graphs       graphs captured by the end of the stream, and steps that ran without one

Every step's output is compared with eager's (the script exits 1 on a difference). The numbers
are wall-clock on whatever machine runs it; on the emulated backend a replay costs about what
eager costs, so the stream time shows the capture work moved into serving, not graph speed-ups.
A benchmark script, not a test.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # this checkout's freezeframe, and its tests/

from tests.helpers.toy_models import LlamaConfig, ToyLlama  # noqa: E402

import freezeframe as ff  # noqa: E402
from freezeframe.runtime import GraphRunner, Tokens  # noqa: E402

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
# decode-heavy traffic: mostly small batches, a few large ones
MIX = {1: 30, 2: 20, 3: 15, 4: 10, 6: 8, 8: 6, 12: 4, 20: 3, 40: 2, 64: 2}


def stream(steps: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    sizes, weights = zip(*MIX.items(), strict=True)
    return rng.choices(sizes, weights=weights, k=steps)


def run(policy: str, layers: int, sizes: list[int]) -> dict[str, float]:
    torch.manual_seed(0)
    module = ToyLlama(LlamaConfig(num_layers=layers, hidden_size=64, mlp_size=128))
    reference = ToyLlama(LlamaConfig(num_layers=layers, hidden_size=64, mlp_size=128))
    long = {"dtype": torch.long}
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
        cudagraph_mode="full", graph_backend="emulated", cudagraph_capture_sizes=SIZES,
        max_num_tokens=max(SIZES), max_num_seqs=max(SIZES), use_cache=False)
    start = time.perf_counter()
    model = ff.compile(module, cfg)
    runner = GraphRunner(model, cfg, inputs={"input_ids": Tokens(**long),
                                             "positions": Tokens(**long)},
                         progress=False, capture_policy=policy)
    runner.capture()
    first = sizes[0]
    out = runner(torch.arange(first) % 128, torch.arange(first))
    startup = time.perf_counter() - start
    wrong = 0
    t0 = time.perf_counter()
    for i, n in enumerate(sizes[1:]):
        ids = (torch.arange(n) + i) % 128
        pos = torch.arange(n)
        out = runner(ids, pos)
        if i % 50 == 0:  # checking every step would time the check
            with torch.no_grad():
                wrong += not torch.allclose(out, reference(ids, pos), rtol=1e-5, atol=1e-6)
    elapsed = time.perf_counter() - t0
    if policy == "background":
        runner.wait_for_capture()
    return {"startup": startup, "stream": elapsed,
            "per_step_ms": elapsed / max(len(sizes) - 1, 1) * 1e3,
            "graphs": runner.report.num_graphs if runner.report else 0,
            "eager_steps": runner.stats.steps_eager, "wrong": wrong}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = stream(args.steps)
    print(f"ToyLlama({args.layers} layers, hidden 64), FULL graphs on the emulated backend, "
          f"capture sizes {SIZES}; {args.steps} steps, sizes drawn from {MIX}")
    print(f"{'policy':<11} {'startup s':>10} {'steps s':>9} {'ms/step':>8} {'graphs':>7} "
          f"{'eager steps':>12}")
    failed = False
    for policy in ("eager", "lazy", "background"):
        r = run(policy, args.layers, sizes)
        failed |= bool(r["wrong"])
        print(f"{policy:<11} {r['startup']:>10.3f} {r['stream']:>9.3f} {r['per_step_ms']:>8.3f} "
              f"{r['graphs']:>7} {r['eager_steps']:>12}" + ("  OUTPUT DIFFERS" if r["wrong"]
                                                            else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
