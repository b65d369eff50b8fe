"""``freezeframe cache clear`` removes exactly what it was told to, and only when asked: an
answer of "n", or no terminal to ask on, removes nothing; an unknown key is an error; clearing
one entry keeps the others and their saved traces usable."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.cache import inspect as ff_inspect
from freezeframe.cli import main
from freezeframe.compilation import CompiledModel


class Scaled(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _compiled(root: Path, scale: float) -> CompiledModel:
    torch.manual_seed(0)
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", cache_dir=str(root))
    return ff.compile(Scaled(scale), cfg)


def _two_entries(root: Path) -> list[str]:
    """Two instances of one class with different scales: two entries under one pointer."""
    for scale in (2.0, 3.0):
        model = _compiled(root, scale)
        model(torch.ones(3, 4))
        assert model.stats.artifacts_saved == 1
    keys = sorted(e.key for e in ff_inspect.list_entries(root))
    assert len(keys) == 2
    return keys


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FREEZEFRAME_DISABLE_CACHE", raising=False)


class _Stdin(io.StringIO):
    def __init__(self, text: str, tty: bool) -> None:
        super().__init__(text)
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize("answer", ["n\n", "\n", "no\n"])
def test_an_answer_other_than_yes_removes_nothing(tmp_path: Path, answer: str,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    keys = _two_entries(tmp_path)
    monkeypatch.setattr("sys.stdin", _Stdin(answer, tty=True))
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"remove every entry under {tmp_path}? [y/N] nothing removed" in out
    assert sorted(e.key for e in ff_inspect.list_entries(tmp_path)) == keys


def test_yes_on_a_terminal_removes_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _two_entries(tmp_path)
    monkeypatch.setattr("sys.stdin", _Stdin("y\n", tty=True))
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert f"removed 2 entries from {tmp_path}" in capsys.readouterr().out
    assert ff_inspect.list_entries(tmp_path) == []
    assert list((tmp_path / "models").glob("*.json")) == []


def test_without_a_terminal_it_refuses_unless_told_yes(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    keys = _two_entries(tmp_path)
    monkeypatch.setattr("sys.stdin", _Stdin("y\n", tty=False))  # piped: nobody was asked
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"freezeframe cache: error: refusing to remove every entry under {tmp_path} "
                   "without asking, and stdin is not a terminal to ask on; nothing was removed. "
                   "Pass -y (--yes) to remove without asking\n")
    assert sorted(e.key for e in ff_inspect.list_entries(tmp_path)) == keys
    assert main(["cache", "clear", "--dir", str(tmp_path), "--yes"]) == 0
    assert ff_inspect.list_entries(tmp_path) == []


def test_an_unknown_key_is_an_error_and_removes_nothing(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    keys = _two_entries(tmp_path)
    assert main(["cache", "clear", "--dir", str(tmp_path), "-y", keys[0], "0123456789abcdef"]
                ) == 2
    assert "no cache entry '0123456789abcdef'" in capsys.readouterr().err
    assert sorted(e.key for e in ff_inspect.list_entries(tmp_path)) == keys


def _eager(scale: float, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    with torch.no_grad():
        return Scaled(scale)(x)


def test_clearing_one_entry_keeps_the_other_and_its_saved_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = _two_entries(tmp_path)
    assert main(["cache", "clear", "--dir", str(tmp_path), "-y", keys[0]]) == 0
    assert f"removed 1 entry from {tmp_path}" in capsys.readouterr().out
    assert [e.key for e in ff_inspect.list_entries(tmp_path)] == [keys[1]]
    (pointer,) = (tmp_path / "models").glob("*.json")
    assert [e["key"] for e in json.loads(pointer.read_text())["entries"]] == [
        keys[1]]
    loaded = []
    x = torch.randn(5, 4)
    for scale in (2.0, 3.0):  # one warm-starts from the kept entry, the other traces again
        model = _compiled(tmp_path, scale)
        torch.testing.assert_close(model(x), _eager(scale, x))
        loaded.append(model.stats.traces_loaded)
    assert sorted(loaded) == [0, 1]


def test_info_on_an_unknown_key_is_an_error_like_clear(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    keys = _two_entries(tmp_path)
    assert main(["cache", "info", "--dir", str(tmp_path), keys[0], "abc"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"freezeframe cache: error: no cache entry 'abc' under {tmp_path} (see "
                   "`freezeframe cache list` for the keys)\n")
    assert main(["cache", "info", "--dir", str(tmp_path), keys[0]]) == 0
    assert capsys.readouterr().out.startswith(f"entry {keys[0]}")
