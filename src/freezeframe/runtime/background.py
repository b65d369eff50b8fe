"""Background capture: a thread that captures the pending graph keys behind the steps.

The thread takes the runner's lock for one key at a time (its warm-ups, capture and undo, as
capture() does for each key), lets a waiting step have the lock between two keys, and stops
when no key is pending. An exception stops it: it is logged, kept, and raised by
``runner.wait_for_capture()`` (see :mod:`freezeframe.runtime.capture_policy` for the policy's
rules).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from freezeframe.batch import GraphKey
from freezeframe.runtime.capture_policy import DeferredCaptures
from freezeframe.runtime.lock import StepLock

__all__ = ["BackgroundCapture"]

# the runner's logger: its messages are GraphRunner's, filtered by that name
logger = logging.getLogger("freezeframe.runtime.runner")


class BackgroundCapture:
    """The background thread of one runner (restarted after every graph was dropped) and the
    exception that stopped it, if one did."""

    def __init__(self, deferred: DeferredCaptures, lock: StepLock,
                 capture_one: Callable[[GraphKey], None]) -> None:
        self._deferred, self._lock, self._capture_one = deferred, lock, capture_one
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def ensure_running(self) -> None:
        """Start the thread, unless one is running."""
        if self._thread is not None and self._thread.is_alive():
            return
        thread = threading.Thread(target=self._capture_behind,
                                  name="freezeframe-background-capture", daemon=True)
        self._thread = thread
        thread.start()

    def _capture_behind(self) -> None:
        """The thread: capture every pending key in order, one per lock hold."""
        deferred = self._deferred
        self._lock.background = threading.get_ident()
        while True:
            self._lock.hold()
            try:
                key = deferred.next()
                if key is None:
                    return
                self._capture_one(key)
            except BaseException as exc:
                self.error = exc
                logger.warning("GraphRunner: background capture stopped: %s: %s "
                               "(wait_for_capture() raises it)", type(exc).__name__, exc)
                return
            finally:
                self._lock.exit()
            time.sleep(0)  # let a waiting step have the lock before the next capture

    def wait(self, timeout: float | None) -> None:
        """Join the thread; raise TimeoutError if it still runs after ``timeout`` seconds,
        else what stopped it, if anything did."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"background capture still running after {timeout} s "
                                   f"({self._deferred.num_pending} graphs left)")
        if self.error is not None:
            raise self.error
