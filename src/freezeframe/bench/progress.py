"""What the benchmark is doing, on stderr, while it runs (a 1b run on a CPU takes minutes).

:class:`Progress` has two kinds of output: :meth:`~Progress.note` lines, which always appear
(what is being built, each mode starting and finishing), and :meth:`~Progress.phase` updates
(the step inside a mode). Where tqdm is installed and the stream is a terminal, a bar over the
modes shows the phase in its postfix and notes are written above it; otherwise every note and
every phase is a plain ``bench: ...`` line. tqdm is optional: without it the output is plain
lines, never an error.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["Progress"]


def _tqdm_class() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """Progress of one benchmark run over ``num_modes`` modes; ``enabled=False`` is silent."""

    def __init__(self, num_modes: int, *, enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._num_modes = num_modes
        self._index = 0
        self._mode = ""
        self._bar: Any = None
        if enabled and _isatty(self._stream):
            tqdm = _tqdm_class()
            if tqdm is not None:
                self._bar = tqdm(total=num_modes, desc="bench", unit="mode",
                                 file=self._stream, leave=False)

    # -- output ---------------------------------------------------------------------------
    def note(self, text: str) -> None:
        """A line that always appears (above the bar when there is one)."""
        if not self.enabled:
            return
        line = f"bench: {self._prefix()}{text}"
        if self._bar is not None:
            self._bar.write(line, file=self._stream)
        else:
            print(line, file=self._stream, flush=True)

    def phase(self, text: str) -> None:
        """The step now running: the bar's postfix, or a plain line without a bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self._mode}: {text}" if self._mode else text)
        else:
            self.note(text)

    def start_mode(self, mode: str) -> None:
        """Mode number ``index + 1`` of ``num_modes`` begins."""
        self._index += 1
        self._mode = mode

    def end_mode(self, text: str) -> None:
        """The current mode is done: a note, and the bar moves on."""
        self.note(text)
        self._mode = ""
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------------------
    def _prefix(self) -> str:
        return f"[{self._index}/{self._num_modes}] {self._mode}: " if self._mode else ""


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False
