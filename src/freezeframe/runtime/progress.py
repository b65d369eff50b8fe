"""The progress of a graph capture, on stderr: a bar on a terminal, plain lines elsewhere.

A tqdm bar redraws itself with carriage returns; a log file or a CI log keeps every frame, one
long line of them. So, as ``freezeframe bench`` does (:mod:`freezeframe.bench.progress`), the
bar is drawn only where it can be redrawn: a stream that is a terminal, or a Jupyter notebook
(where tqdm draws a widget instead of writing frames). Anywhere else each tenth of the work is
one plain line (``Capturing graphs: 6/51``), at most ten lines per capture plus the first. tqdm
is optional: without it the output is those lines, never an error.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, Protocol, TextIO

__all__ = ["ProgressBar", "capture_progress"]

DESCRIPTION = "Capturing graphs"


class ProgressBar(Protocol):
    def update(self, n: int = 1) -> None: ...


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


class _Lines:
    """``Capturing graphs: DONE/TOTAL`` at the start and each time another tenth is done."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self._total = total
        self._stream = stream
        self._done = 0
        self._write()

    def update(self, n: int = 1) -> None:
        before = self._tenths()
        self._done += n
        if self._tenths() > before or self._done == self._total:
            self._write()

    def _tenths(self) -> int:
        return self._done * 10 // self._total if self._total else 10

    def _write(self) -> None:
        self._stream.write(f"{DESCRIPTION}: {self._done}/{self._total}\n")
        self._stream.flush()


@contextlib.contextmanager
def capture_progress(total: int, enabled: bool, *,
                     stream: TextIO | None = None) -> Iterator[ProgressBar]:
    """A progress display over ``total`` graphs on ``stream`` (default: ``sys.stderr`` as it
    is when called); ``enabled=False`` shows nothing. Call ``update(1)`` per graph."""
    if not enabled or total <= 0:
        yield _NoBar()
        return
    out = stream if stream is not None else sys.stderr
    bar_class = _bar_class(out)
    if bar_class is None:
        yield _Lines(total, out)
        return
    bar = bar_class(total=total, desc=DESCRIPTION, unit="graph", leave=False, file=out)
    try:
        yield bar
    finally:
        bar.close()


def _bar_class(stream: TextIO) -> Any:
    """tqdm's class when a bar can be redrawn on ``stream``, else None."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    notebook = any(cls.__module__ == "tqdm.notebook" for cls in tqdm.__mro__)
    return tqdm if notebook or _isatty(stream) else None


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False
