"""The graph pool's memory predicted from a few large captures, set beside what was measured.

What the H100 run of 2026-11-26 showed (docs/results/h100-80gb-hbm3-2026-11-26, run 2: the 1B
preset's default ladder, 33 graphs, 340 MiB): in the one pool a model's CUDA graphs share, the
first graphs captured take the pool's working set (34 MiB at one token, 52 MiB more at 130
tokens); every PIECEWISE graph captured after them keeps its pieces' outputs for its own size,
about 0.2 MiB per token for that model (26 MiB at 128 tokens, 2 MiB at 8), so the pool grows
with the *sum* of the PIECEWISE sizes, not with the largest graph alone; FULL graphs added
almost nothing; and below about 8 tokens the growth moves in whole 2 MiB segments, so the
runner's probes at 1, 2 and 4 tokens could not fit a slope (it predicted 162 MiB).

The model refitted on that::

    pool ~= T + sum over graphs of b[mode] * tokens

``b[mode]`` is fitted, per mode, on the two largest graphs of that mode captured after the
largest PIECEWISE graph (the *anchor*, which brings the working set): large probes, whose growth
is many segments. ``T`` is what the graphs up to and including the anchor took beyond their own
``b * tokens``: the working set. Only the anchor, the graphs before it and the probes are read;
the prediction for the whole capture is then set beside the measured growth of every graph.
Where graphs hold their own memory (the emulated backend) the same fit applies: ``T`` is then
about nothing and the total a sum, so the code runs in CI, where its figures mean nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["CapturedGraph", "PoolPrediction", "predict_pool"]

#: graphs per mode the slope is fitted on
PROBES_PER_MODE = 2


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """One graph of a capture, in capture order: its mode, padded tokens and measured growth."""

    mode: str  # "PIECEWISE" | "FULL"
    tokens: int
    memory_bytes: int


@dataclasses.dataclass(frozen=True)
class PoolPrediction:
    """The refitted prediction of a whole capture and the measurement beside it."""

    working_set_bytes: float  # T
    bytes_per_token: dict[str, float]  # b, per mode
    anchor: int  # index (capture order) of the largest PIECEWISE graph
    probes: tuple[int, ...]  # indices of the graphs the slopes were fitted on
    predicted_bytes: int
    measured_bytes: int

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, or None when nothing was measured."""
        if self.measured_bytes <= 0:
            return None
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    def to_json(self) -> dict[str, Any]:
        return {"working_set_bytes": round(self.working_set_bytes),
                "bytes_per_token": {m: round(b, 1) for m, b in self.bytes_per_token.items()},
                "anchor": self.anchor, "probes": list(self.probes),
                "predicted_bytes": self.predicted_bytes, "measured_bytes": self.measured_bytes,
                "error": self.error}

    def describe(self) -> str:
        slopes = ", ".join(f"{m} {b / 2**20:.3f} MiB/token"
                           for m, b in self.bytes_per_token.items())
        error = self.error
        return (f"pool predicted {self.predicted_bytes / 2**20:.1f} MiB from graphs "
                f"{sorted({self.anchor, *self.probes})} (working set "
                f"{self.working_set_bytes / 2**20:.1f} MiB; {slopes}), measured "
                f"{self.measured_bytes / 2**20:.1f} MiB"
                + (f" ({error:+.1%})" if error is not None else ""))


def predict_pool(graphs: Sequence[CapturedGraph]) -> PoolPrediction | None:
    """The refitted prediction for ``graphs`` (in capture order; see the module docstring), or
    None for an empty capture."""
    if not graphs:
        return None
    piecewise = [i for i, g in enumerate(graphs) if g.mode == "PIECEWISE"]
    candidates = piecewise or list(range(len(graphs)))
    anchor = max(candidates, key=lambda i: (graphs[i].tokens, -i))
    slopes: dict[str, float] = {}
    probes: list[int] = []
    for mode in dict.fromkeys(g.mode for g in graphs):
        after = [i for i, g in enumerate(graphs) if g.mode == mode and i > anchor]
        chosen = sorted(after, key=lambda i: (-graphs[i].tokens, i))[:PROBES_PER_MODE]
        tokens = sum(graphs[i].tokens for i in chosen)
        slopes[mode] = sum(graphs[i].memory_bytes for i in chosen) / tokens if tokens else 0.0
        probes += chosen
    kept = [slopes[g.mode] * g.tokens for g in graphs]
    working_set = sum(g.memory_bytes for g in graphs[:anchor + 1]) - sum(kept[:anchor + 1])
    return PoolPrediction(
        working_set_bytes=working_set, bytes_per_token=slopes, anchor=anchor,
        probes=tuple(sorted(probes)), predicted_bytes=round(working_set + sum(kept)),
        measured_bytes=sum(g.memory_bytes for g in graphs))
