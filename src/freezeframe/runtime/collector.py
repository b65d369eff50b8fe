"""The garbage collector held still around a capture.

A capture makes many short-lived Python objects, and a full collection among them is time
the capture waits. capture() of every key collects once and freezes the survivors
(:func:`gc_frozen`); one lazy or background capture while serving only pauses the collector
(:func:`gc_paused`), so as not to stall the steps with a full collection.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_frozen", "gc_paused"]


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Collect once, then freeze every surviving object out of the collector's reach for the
    duration, so the many short-lived objects of capture never trigger a full collection.

    ``gc.unfreeze()`` cannot tell our frozen objects from the caller's, so when the caller has
    frozen some already (a server calling ``gc.freeze()`` after start-up) the collector is
    paused instead, and left as it was found."""
    gc.collect()
    if gc.get_freeze_count() == 0:
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
        return
    with gc_paused():
        yield


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The collector paused for one capture during serving (no collection first: a lazy or
    background capture must not stall the steps with a full collection)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
