"""The capture progress display: a tqdm bar only where it can be redrawn (a terminal), plain
lines in a log file or pipe, nothing when disabled; tqdm is optional."""

from __future__ import annotations

import io
import sys

import pytest

import freezeframe as ff
from freezeframe.runtime import GraphRunner, Tokens
from freezeframe.runtime.progress import capture_progress
from tests.helpers.toy_models import SillyModel


class _Terminal(io.StringIO):
    """A stream that says it is a terminal (where a bar is redrawn in place)."""

    def isatty(self) -> bool:
        return True


def _capture(total: int, stream: io.StringIO, enabled: bool = True) -> None:
    with capture_progress(total, enabled, stream=stream) as bar:
        for _ in range(total):
            bar.update(1)


def test_a_log_file_gets_a_plain_line_per_tenth() -> None:
    log = io.StringIO()
    _capture(25, log)
    # the start, then each time floor(10 * done / 25) moves on: 3, 5, 8, 10, ... 25
    assert log.getvalue().splitlines() == [
        f"Capturing graphs: {done}/25" for done in (0, 3, 5, 8, 10, 13, 15, 18, 20, 23, 25)]
    assert "\r" not in log.getvalue()


def test_few_graphs_get_a_line_each() -> None:
    log = io.StringIO()
    _capture(2, log)
    assert log.getvalue() == "Capturing graphs: 0/2\nCapturing graphs: 1/2\nCapturing graphs: 2/2\n"


def test_disabled_or_nothing_to_capture_writes_nothing() -> None:
    for total, enabled in ((5, False), (0, True)):
        log = _Terminal()
        _capture(total, log, enabled)
        assert log.getvalue() == ""


def test_a_terminal_gets_a_tqdm_bar() -> None:
    tqdm = pytest.importorskip("tqdm")
    term = _Terminal()
    with capture_progress(3, True, stream=term) as bar:
        assert isinstance(bar, tqdm.tqdm)
        bar.update(3)
    assert "\rCapturing graphs" in term.getvalue()  # redrawn in place, then cleared


def test_a_terminal_without_tqdm_gets_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # `from tqdm.auto import ...` fails
    term = _Terminal()
    _capture(1, term)
    assert term.getvalue() == "Capturing graphs: 0/1\nCapturing graphs: 1/1\n"


def test_runner_capture_writes_plain_lines_to_a_log(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")  # the bar that must not reach a log file
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager",
                               splitting_ops=["silly::attention"], cudagraph_mode="piecewise",
                               graph_backend="emulated", cudagraph_capture_sizes=[1, 2, 4, 8],
                               max_num_tokens=8, max_num_seqs=8, use_cache=False)
    runner = GraphRunner(ff.compile(SillyModel(), cfg), cfg, inputs={"x": Tokens(3)},
                         progress=True)
    log = io.StringIO()  # stderr redirected to a file: not a terminal
    monkeypatch.setattr(sys, "stderr", log)
    assert runner.capture().num_graphs == 4
    assert log.getvalue() == "".join(f"Capturing graphs: {done}/4\n" for done in range(5))
