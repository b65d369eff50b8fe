"""Write examples/histogram_decode.json: the step sizes of a simulated decode-serving day.

Requests arrive at random (Poisson) and each decodes a random number of tokens (geometric, mean
200), one token per step, at most 256 at a time (max_num_seqs); a step's size is the number of
requests decoding in it. The day has a quiet hour (0.05 arrivals per step, about 10 requests
decoding), a busy stretch (0.4 per step, about 80) and a peak (1.0 per step, up to the 256 cap),
so the histogram has the low, middle and top modes that a fixed ladder serves unevenly.
Deterministic: a fixed seed, so rerunning rewrites the same file.

    python3 examples/make_histogram_decode.py
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

MAX_NUM_SEQS = 256
MEAN_TOKENS = 200
PHASES = [(0.05, 6000), (0.4, 8000), (1.0, 4000), (0.4, 4000)]  # (arrivals per step, steps)


def poisson(rng: random.Random, rate: float) -> int:
    """Knuth's product-of-uniforms draw (fine for small rates)."""
    limit, k, p = math.exp(-rate), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def simulate(seed: int = 18) -> Counter[int]:
    rng = random.Random(seed)
    waiting, running, sizes = 0, [], Counter()
    for rate, steps in PHASES:
        for _ in range(steps):
            waiting += poisson(rng, rate)
            while waiting and len(running) < MAX_NUM_SEQS:
                waiting -= 1
                running.append(1 + int(rng.expovariate(1 / MEAN_TOKENS)))
            if running:
                sizes[len(running)] += 1
            running = [left - 1 for left in running if left > 1]
    return sizes


def main() -> None:
    sizes = simulate()
    out = Path(__file__).with_name("histogram_decode.json")
    out.write_text(json.dumps({str(s): sizes[s] for s in sorted(sizes)}, indent=0) + "\n")
    print(f"wrote {out}: {sum(sizes.values())} steps, {len(sizes)} sizes, "
          f"{min(sizes)}..{max(sizes)}")


if __name__ == "__main__":
    main()
