"""Graph memory per capture size, predicted from a few measured captures.

A runner captures one graph per key (mode, padded descriptor). Before it captures them all, it
can capture a few small ones, measure the memory each took, and predict the rest: a refusal
then comes before the memory is spent, instead of an out-of-memory error halfway through.

The model. A graph's memory is the activations its capture allocated (intermediates and
outputs), and every activation of a step has the step's tokens as a dimension (hidden states,
MLP inputs, logits) or none (a fixed workspace, a scalar). So within one *family* of keys
(same mode, same uniform-decode flag, same LoRA case) the bytes are affine in the token count::

    bytes(tokens) ~= a + b * tokens        (least squares over the measured sizes, >= 0)

Keys of other families hold other work (a FULL graph holds attention's metadata, a PIECEWISE
one does not; a LoRA graph holds adapter intermediates), so each family gets its own line.
:func:`measurement_plan` picks what to measure: the two smallest sizes of each family above one
token (the cheapest to capture, and two points fix a line), and the one-token size too when the
family has it. One token is off the line: a tensor with a dimension of one is contiguous
whatever its strides, so a ``.contiguous()`` or ``reshape`` after a transpose that copies at
every other size returns a view at size one (the tiny Llama's piecewise graphs hold 256 bytes
less at one token than the line through the larger sizes). So size one is measured, counted as
measured, and left out of the line whenever two larger sizes are there to fit it.
Where a step's request count stops following its tokens (mixed FULL keys have
``min(tokens, max_num_seqs)`` requests), request-sized tensors bend the line; the report's
predicted-vs-actual columns show how much.

The total. How per-graph memory adds up depends on the backend:

* ``emulated`` (and any backend whose graphs hold their own tensors): every graph keeps its
  own activations, so the total is the **sum** over graphs.
* ``cuda``: all graphs of a model share one memory pool, and they are captured largest first,
  so a smaller graph reuses the blocks the larger ones left; only one graph replays at a time.
  :func:`predict_graph_memory` counts the pool as the **largest** graph's memory plus a
  per-graph overhead: ``max + overhead * (n - 1)``, the least the pool will need.

The pool a whole capture took (:func:`predict_pool`, refitted on the H100 run of 2026-11-26,
``docs/results/h100-80gb-hbm3-2026-11-26``, run 2: the 1B preset's default ladder, 33 graphs,
340 MiB, which ``max + overhead`` from the runner's small probes put at 162 MiB). In the one
pool, the first graphs captured take the pool's working set (34 MiB at one token, 52 MiB more
at 130 tokens); every PIECEWISE graph captured after them keeps its pieces' outputs for its own
size, about 0.2 MiB per token for that model (26 MiB at 128 tokens, 2 MiB at 8), so the pool
grows with the *sum* of the PIECEWISE sizes, not with the largest graph alone; FULL graphs
added almost nothing; and below about 8 tokens the growth moves in whole 2 MiB segments, so
probes at 1, 2 and 4 tokens cannot fit a slope. So::

    pool ~= T + sum over graphs of b[mode] * tokens

``b[mode]`` is fitted, per mode, on the two largest graphs of that mode captured after the
largest PIECEWISE graph (the *anchor*, which brings the working set): large probes, whose growth
is many segments. ``T`` is what the graphs up to and including the anchor took beyond their own
``b * tokens``: the working set. Only the anchor, the graphs before it and the probes are read;
the bench sets the prediction for the whole capture beside the measured growth of every graph.
Where graphs hold their own memory (the emulated backend) the same fit applies: ``T`` is then
about nothing and the total a sum, so the code runs in CI, where its figures mean nothing.
The runner's budget cannot use this fit yet: its probes are the smallest keys, captured first
(:func:`measurement_plan`); the fit needs the anchor and two large graphs per mode first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from freezeframe.batch import BatchDescriptor, GraphKey
from freezeframe.config import CUDAGraphMode
from freezeframe.errors import ConfigError

__all__ = [
    "CapturedGraph",
    "FamilyFit",
    "GraphMemoryPrediction",
    "LinearFit",
    "PoolPrediction",
    "SizePrediction",
    "family_of",
    "fit_linear",
    "format_bytes",
    "measurement_plan",
    "predict_graph_memory",
    "predict_pool",
]

# (mode, uniform decode, has LoRA, active LoRAs): keys whose memory lies on one line
Family = tuple[CUDAGraphMode, bool, bool, int]


def family_of(key: GraphKey) -> Family:
    """The family of a graph key: keys that differ only in their token (and request) count."""
    mode, desc = key
    return (mode, desc.uniform, desc.has_lora, desc.num_active_loras)


@dataclasses.dataclass(frozen=True)
class LinearFit:
    """``bytes ~= intercept + slope * tokens``, fitted on ``sizes`` (token counts)."""

    intercept: float
    slope: float
    sizes: tuple[int, ...]

    def at(self, tokens: int) -> int:
        """The predicted bytes at ``tokens``, rounded, never negative."""
        return max(0, round(self.intercept + self.slope * tokens))


def fit_linear(samples: Sequence[tuple[int, int]]) -> LinearFit:
    """The least-squares line through ``(tokens, bytes)`` samples.

    Two or more distinct token counts give the ordinary least-squares line. One distinct count
    gives the line through the origin (bytes proportional to tokens): with one point nothing
    tells a fixed part from a per-token part, and proportional is the safer guess for larger
    sizes (it never predicts less than the measured bytes per token).
    """
    if not samples:
        raise ValueError("fit_linear needs at least one (tokens, bytes) sample")
    n = len(samples)
    xs = [float(t) for t, _ in samples]
    ys = [float(b) for _, b in samples]
    sizes = tuple(sorted({t for t, _ in samples}))
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0.0:
        slope = mean_y / mean_x if mean_x else 0.0
        return LinearFit(intercept=0.0 if mean_x else mean_y, slope=slope, sizes=sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    return LinearFit(intercept=mean_y - slope * mean_x, slope=slope, sizes=sizes)


@dataclasses.dataclass(frozen=True)
class FamilyFit:
    """The line fitted for one family of keys (see :func:`family_of`)."""

    mode: CUDAGraphMode
    uniform: bool
    has_lora: bool
    num_active_loras: int
    fit: LinearFit


@dataclasses.dataclass(frozen=True)
class SizePrediction:
    """One graph key's predicted memory; ``measured_bytes`` when it was one of the measured
    captures the prediction was made from (its ``predicted_bytes`` is still the line's value
    there, so the fit's error at the measured sizes shows too)."""

    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    predicted_bytes: int
    measured_bytes: int | None = None

    @property
    def expected_bytes(self) -> int:
        """What the total counts for this key: the measurement where there is one."""
        return self.measured_bytes if self.measured_bytes is not None else self.predicted_bytes

    def describe(self) -> str:
        d = self.descriptor
        reqs = "" if d.num_reqs is None else f", {d.num_reqs} reqs"
        lora = f", {d.num_active_loras} loras" if d.has_lora else ""
        kind = ", decode" if d.uniform else ""
        return (f"{self.mode.name} {d.num_tokens} tokens{reqs}{kind}{lora}: "
                f"{format_bytes(self.expected_bytes)}")


@dataclasses.dataclass(frozen=True)
class GraphMemoryPrediction:
    """The predicted graph memory of every key of a capture, in capture order.

    ``total_bytes`` is what the whole capture is predicted to add: the sum of every key's
    ``expected_bytes`` when graphs hold their own memory (``pooled=False``), or the largest
    one plus ``per_graph_overhead_bytes`` per other graph when they share one pool
    (``pooled=True``, CUDA); see the module docstring.
    """

    sizes: tuple[SizePrediction, ...]
    fits: tuple[FamilyFit, ...]
    pooled: bool
    per_graph_overhead_bytes: int
    total_bytes: int

    def for_key(self, mode: CUDAGraphMode, descriptor: BatchDescriptor) -> SizePrediction:
        for size in self.sizes:
            if size.mode is mode and size.descriptor == descriptor:
                return size
        raise KeyError(f"no prediction for the {mode.name} graph of {descriptor}")

    def mib_by_size(self) -> dict[int, float]:
        """Per token count, the expected MiB of all its graphs (every mode and request layout):
        the ``memory={size: MiB}`` that ``ff.plan_capture_sizes`` and ``freezeframe plan
        --graph-mib`` take (they interpolate between the sizes given)."""
        out: dict[int, float] = {}
        for size in self.sizes:
            n = size.descriptor.num_tokens
            out[n] = out.get(n, 0.0) + size.expected_bytes / 2**20
        return dict(sorted(out.items()))

    def largest(self, n: int = 3) -> list[SizePrediction]:
        """The ``n`` keys predicted to take the most memory, largest first."""
        return sorted(self.sizes, key=lambda s: -s.expected_bytes)[:n]

    def describe(self, n: int = 3) -> str:
        rule = ("one shared pool: the largest graph plus "
                f"{format_bytes(self.per_graph_overhead_bytes)} per other graph" if self.pooled
                else "the sum over graphs, each holding its own memory")
        largest = "; ".join(s.describe() for s in self.largest(n))
        return (f"{format_bytes(self.total_bytes)} predicted for {len(self.sizes)} graphs "
                f"({rule}); largest: {largest}")


def measurement_plan(keys: Sequence[GraphKey], per_family: int = 2) -> list[GraphKey]:
    """The keys to capture first and measure: per family, its one-token key if it has one and
    the ``per_family`` smallest keys above one token (by tokens, then requests), smallest
    first; families in the order they first appear."""
    if isinstance(per_family, bool) or not isinstance(per_family, int) or per_family < 1:
        raise ConfigError(f"measurement_plan per_family: expected an int >= 1, got "
                          f"{per_family!r}")
    by_family: dict[Family, list[GraphKey]] = {}
    for key in keys:
        by_family.setdefault(family_of(key), []).append(key)
    plan: list[GraphKey] = []
    for members in by_family.values():
        members = sorted(members, key=lambda k: (k[1].num_tokens, k[1].num_reqs or 0))
        ones = [k for k in members if k[1].num_tokens <= 1]
        plan.extend(ones + [k for k in members if k[1].num_tokens > 1][:per_family])
    return plan


def predict_graph_memory(keys: Sequence[GraphKey], measured: Mapping[GraphKey, int], *,
                         pooled: bool = False,
                         per_graph_overhead_bytes: int = 0) -> GraphMemoryPrediction:
    """Predict the memory of every key in ``keys`` from the ``measured`` bytes of some of them.

    Each family's line is fitted on its own measured keys (those above one token when it has
    two such sizes); a family with none borrows the line of the measured keys of its mode (or
    of all measured keys). ``pooled`` picks how the total
    adds up (see :class:`GraphMemoryPrediction`)."""
    if not measured:
        raise ValueError("predict_graph_memory needs the measured memory of at least one key")
    if isinstance(per_graph_overhead_bytes, bool) or not isinstance(per_graph_overhead_bytes,
                                                                    int) \
            or per_graph_overhead_bytes < 0:
        raise ConfigError(f"per_graph_overhead_bytes: expected an int >= 0, got "
                          f"{per_graph_overhead_bytes!r}")
    samples: dict[Family, list[tuple[int, int]]] = {}
    for (mode, desc), nbytes in measured.items():
        samples.setdefault(family_of((mode, desc)), []).append((desc.num_tokens, nbytes))
    fits = {fam: fit_linear(_on_the_line(points)) for fam, points in samples.items()}

    def line(key: GraphKey) -> LinearFit:
        fam = family_of(key)
        if fam not in fits:
            same_mode = [p for f, pts in samples.items() if f[0] is key[0] for p in pts]
            fits[fam] = fit_linear(same_mode or [p for pts in samples.values() for p in pts])
        return fits[fam]

    sizes = tuple(
        SizePrediction(mode=mode, descriptor=desc,
                       predicted_bytes=line((mode, desc)).at(desc.num_tokens),
                       measured_bytes=measured.get((mode, desc)))
        for mode, desc in keys)
    expected = [s.expected_bytes for s in sizes]
    if not expected:
        total = 0
    elif pooled:
        total = max(expected) + per_graph_overhead_bytes * (len(expected) - 1)
    else:
        total = sum(expected)
    family_fits = tuple(FamilyFit(mode=f[0], uniform=f[1], has_lora=f[2], num_active_loras=f[3],
                                  fit=fit) for f, fit in fits.items())
    return GraphMemoryPrediction(sizes=sizes, fits=family_fits, pooled=pooled,
                                 per_graph_overhead_bytes=per_graph_overhead_bytes,
                                 total_bytes=total)


def _on_the_line(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The samples to fit: those above one token when two distinct such sizes are there (see
    the module docstring on size one), else all."""
    larger = [p for p in points if p[0] > 1]
    return larger if len({t for t, _ in larger}) >= 2 else points


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1 (``"1.50 MiB"``, ``"84 B"``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


# -- the pool a whole capture took (CUDA), refitted -------------------------------------------

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
