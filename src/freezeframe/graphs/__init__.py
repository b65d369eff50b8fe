"""Graph capture and replay: backends (cuda, emulated) and the wrapper that uses them.

The compile path obtains every graph wrapper through this package:
``resolve_backend(config)`` picks the backend (or ``None`` when graphs are off) and
``GraphWrapper(runnable, mode, backend, GraphOptions(...), stats=..., window=...)`` wraps a piece
or the whole forward; each captured graph's ``Replay`` is the one copy-in / replay / copy-back,
which the wrapper and a runner's planned steps both call. ``backend.prepare(runnable)`` readies
a compiled callable that launches its own kernels (the emulated backend records it as one
unit). ``Capturable`` is what a runner needs of a model that holds graphs.
"""

from __future__ import annotations

from freezeframe.graphs.backend import CapturedGraph, GraphBackend, resolve_backend
from freezeframe.graphs.capturable import Capturable
from freezeframe.graphs.replay import Replay, StaleReplay
from freezeframe.graphs.wrapper import CaptureWindow, GraphOptions, GraphWrapper

__all__ = [
    "Capturable",
    "CaptureWindow",
    "CapturedGraph",
    "GraphBackend",
    "GraphOptions",
    "GraphWrapper",
    "Replay",
    "StaleReplay",
    "resolve_backend",
]
