"""When a runner captures its graphs: all at start, on first need, or behind the traffic.

``GraphRunner(..., capture_policy=...)``:

    "eager"        capture() captures every graph the dispatcher owns before it returns
                   (the default; vLLM's behaviour). Startup pays for every size.
    "lazy"         capture() captures nothing. A step whose graph is not captured yet runs
                   without a graph (unpadded, counted ``fallback_not_captured``); the
                   ``lazy_warmups + 1``-th step of that graph key captures it first and replays
                   it. Sizes that never occur cost nothing.
    "background"   capture() starts a thread that captures every graph in the dispatcher's
                   order (PIECEWISE first, then FULL, largest first) while the caller's steps
                   run; a step whose graph is not captured yet runs without one.
                   ``runner.wait_for_capture()`` joins the thread (and raises what it raised).

Rules for lazy and background capture (the same as for capture(), one graph at a time):

* A capture holds the runner's lock for one graph key: its warm-ups, the capture pass and the
  restore of the model's buffers. A step never runs concurrently with a capture on the same
  runner; it waits (``stats.capture_waits`` counts the waits on the background thread) and
  then runs on the buffers the capture left filled with the inputs' fill values.
* The model's capture window is open only during that one capture, so a step never captures
  on its own by accident.
* On CUDA the background thread captures with ``capture_error_mode="thread_local"``: the
  caller's other threads may keep using the GPU (sampling, other models) while it captures;
  with the default ``"global"`` mode any of their CUDA calls would invalidate the capture.
  Their allocations come from the regular pool, not the graph pool (the capture stream's
  allocations alone go there).
* Before the first step, two eager passes at the two smallest capture sizes tell the runner how
  each output follows the padded size (what eager capture learns from all its sizes), so the
  first steps are cut to their real rows as they would be after an eager capture.
* A capture that raises frees every graph the runner captured (as a failed capture() does);
  the failed key is never tried again (its steps run without a graph, counted
  ``fallback_capture_failed``) and the others are captured again as they come. In lazy mode
  the step that triggered it raises the error; in background mode the thread stops, logs it
  and ``wait_for_capture()`` raises it.
* Background capture with ``dp_sync=True`` is refused: data-parallel ranks must capture the
  same graphs at the same steps (their collectives are part of the graphs); lazy capture is
  deterministic and allowed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from freezeframe.batch import GraphKey
from freezeframe.errors import ConfigError

__all__ = ["CapturePolicy", "DeferredCaptures"]



class CapturePolicy(enum.Enum):
    EAGER = "eager"
    LAZY = "lazy"
    BACKGROUND = "background"

    @classmethod
    def parse(cls, value: CapturePolicy | str) -> CapturePolicy:
        if isinstance(value, CapturePolicy):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ConfigError(
                f"capture_policy={value!r} is not a capture policy; use one of "
                f"{[p.value for p in cls]}") from None


class DeferredCaptures:
    """The graph keys a lazy or background runner has not captured yet, in capture order, and
    how often each was needed."""

    def __init__(self, order: Iterable[GraphKey], warmups: int) -> None:
        self.order: tuple[GraphKey, ...] = tuple(order)
        self.warmups = warmups
        self._pending: dict[GraphKey, int] = dict.fromkeys(self.order, 0)  # key -> sightings
        self.failed: set[GraphKey] = set()

    def __bool__(self) -> bool:
        return bool(self._pending) or bool(self.failed)

    def waiting(self, key: GraphKey) -> bool:
        """Whether a step of ``key`` has no graph yet (pending or failed)."""
        return key in self._pending or key in self.failed

    def due(self, key: GraphKey) -> bool:
        """A step of ``key`` arrived: whether it should capture first (lazy policy)."""
        if key in self.failed:
            return False
        seen = self._pending[key] = self._pending[key] + 1
        return seen > self.warmups

    def captured(self, key: GraphKey) -> None:
        self._pending.pop(key, None)

    def failed_on(self, key: GraphKey) -> None:
        """A capture of ``key`` raised and every graph was freed: ``key`` is never tried
        again, every other key waits to be captured again."""
        self.failed.add(key)
        self._pending = {k: 0 for k in self.order if k not in self.failed}

    def restart(self) -> None:
        """Every graph was dropped (parameters replaced): every key that had been captured
        waits to be captured again; a key that failed stays failed."""
        self._pending = {k: self._pending.get(k, 0) for k in self.order
                         if k not in self.failed}

    def next(self) -> GraphKey | None:
        """The first key still to capture, in capture order."""
        return next(iter(self._pending), None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def __repr__(self) -> str:
        return f"DeferredCaptures(pending={len(self._pending)}, failed={len(self.failed)})"

