"""The runner's lock: steps, ``capture()`` and the background capture run one at a time.

One ``threading.Lock`` and who holds it. Entering is a non-blocking try first (about 0.1 us
when nobody holds it); a thread that must wait is told what it waited for, because that decides
what the runner does next: waiting for the background capture of one graph is expected
(``capture_waits``), waiting for another thread's step means threads share the runner and its
outputs must be copied from then on (``lock_waits``). A thread entering again from inside its
own step (a model that calls its own runner) gets an error, not a deadlock.
"""

from __future__ import annotations

import threading
from threading import get_ident

from freezeframe.errors import FreezeframeError
from freezeframe.stats import Stats

__all__ = ["StepLock"]


class StepLock:
    """See the module docstring. ``background`` is the ident of the background capture
    thread, while there is one."""

    __slots__ = ("_lock", "_stats", "background", "last_holder", "owner")

    def __init__(self, stats: Stats) -> None:
        self._lock = threading.Lock()
        self._stats = stats
        self.owner: int | None = None  # the thread holding the lock, while it does
        self.last_holder: int | None = None  # the thread that took the lock last (kept)
        self.background: int | None = None

    def enter(self, what: str) -> bool:
        """Take the lock for ``what`` (``"a step"``, ``"capture()"``); True when this waited
        for another thread's step (not for the background capture)."""
        waited = False
        if not self._lock.acquire(blocking=False):
            waited = self._wait(what)
        self.owner = self.last_holder = get_ident()
        return waited

    def hold(self) -> None:
        """Take the lock for the background capture: it waits for steps as a matter of
        course, which is neither counted nor a sign of threads sharing the runner."""
        self._lock.acquire()
        self.owner = self.last_holder = get_ident()

    def exit(self) -> None:
        self.owner = None
        self._lock.release()

    def _wait(self, what: str) -> bool:
        if self.owner == get_ident():
            raise FreezeframeError(
                f"GraphRunner: {what} was started from inside a step or capture on the same "
                "thread (the model called its own runner); the static buffers hold the outer "
                "call, so the inner one cannot run. Call the runner only from outside it")
        self._lock.acquire()
        if self.background is not None and self.last_holder == self.background:
            # it waited for the background capture of one graph, not for another step
            self._stats.inc("capture_waits")
            return False
        self._stats.inc("lock_waits")
        return True
