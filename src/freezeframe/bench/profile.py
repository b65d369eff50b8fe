"""The profiler's view of one graph replay: which kernels it launches, how many of each, how
long they take, and the launches per layer (the census issue 44 asks for, measured where the
graph runs).

On CUDA the replay runs under ``torch.profiler`` with CUDA activity, and every device activity
it shows (kernel, memcpy, memset) is one launch, timed by the device. Without CUDA the graph is
emulated: its replay re-runs the recorded ops in Python, profiled with CPU activity, and each
top-level op is one launch (what an emulated graph counts as its launches); those times are the
host's and say nothing about a GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ProfileRow", "ReplayProfile", "profile_replay"]

#: kernel names are cut to this many characters in the table (C++ template names run long)
NAME_CHARS = 100


@dataclasses.dataclass(frozen=True)
class ProfileRow:
    """One kernel (or, emulated, one op) of the replay: how often it ran and for how long."""

    name: str
    count: int
    total_us: float


@dataclasses.dataclass(frozen=True)
class ReplayProfile:
    """Every launch of one replay, grouped by name, longest total first."""

    activity: str  # "cuda": device activities; "cpu": the emulated replay's top-level ops
    launches: int
    total_us: float
    num_layers: int
    rows: tuple[ProfileRow, ...]

    @property
    def launches_per_layer(self) -> float:
        return self.launches / self.num_layers

    def to_json(self, top: int = 40) -> dict[str, Any]:
        """The JSON form, with the ``top`` longest rows (and how many were left out)."""
        return {"activity": self.activity, "launches": self.launches,
                "launches_per_layer": round(self.launches_per_layer, 2),
                "total_us": round(self.total_us, 1), "num_layers": self.num_layers,
                "rows": [dataclasses.asdict(r) | {"total_us": round(r.total_us, 2)}
                         for r in self.rows[:top]],
                "rows_left_out": max(0, len(self.rows) - top)}

    def table(self, top: int = 12) -> list[str]:
        """Plain-text lines: a header, then the ``top`` longest rows."""
        what = "kernels (CUDA activity)" if self.activity == "cuda" else \
            "ops of the emulated replay (CPU activity; host times)"
        lines = [f"{self.launches} launches in one replay ({self.launches_per_layer:.1f} per "
                 f"layer over {self.num_layers} layers), {self.total_us:.1f} us in all; "
                 f"{what}:", f"{'count':>6} {'total us':>10}  name"]
        lines += [f"{r.count:>6} {r.total_us:>10.1f}  {r.name}" for r in self.rows[:top]]
        if len(self.rows) > top:
            lines.append(f"  ... {len(self.rows) - top} more")
        return lines


def profile_replay(replay: Callable[[], Any], num_layers: int, cuda: bool) -> ReplayProfile:
    """Run ``replay`` once under the profiler (see the module docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[activity]) as prof:
        replay()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [e for e in prof.events()
                  if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    grouped: dict[str, list[float]] = {}
    for event in events:
        grouped.setdefault(event.name[:NAME_CHARS], []).append(event.time_range.elapsed_us())
    rows = sorted((ProfileRow(name, len(times), float(sum(times)))
                   for name, times in grouped.items()), key=lambda r: (-r.total_us, r.name))
    return ReplayProfile(activity="cuda" if cuda else "cpu", launches=len(events),
                         total_us=float(sum(r.total_us for r in rows)),
                         num_layers=max(1, num_layers), rows=tuple(rows))
