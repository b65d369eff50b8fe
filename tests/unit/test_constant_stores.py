"""A forward whose only Python side effects are constant stores on a library's module-level
object is saved, and the saved trace repeats the stores (constant_stores.py); any other store
keeps the trace unsaved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import freezeframe as ff
from freezeframe.compilation import CompiledModel
from tests.helpers import global_flags
from tests.helpers.global_flags import FLAGS


class Resets(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return global_flags.reset_flags(self.lin(x))


class KeepsSum(Resets):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return global_flags.keep_sum(self.lin(x))


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FREEZEFRAME_DISABLE_CACHE", raising=False)


def _compile(module: torch.nn.Module, root: Path) -> CompiledModel:
    return ff.compile(module, ff.CompilationConfig(mode="dynamo_trace_once", backend="eager",
                                                   cache_dir=str(root)))


def test_constant_stores_are_saved_and_repeated_by_the_warm_start(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Resets().eval()
    x = torch.randn(3, 4)
    cold = _compile(module, tmp_path)
    with torch.no_grad():
        want = module(x)
        assert torch.equal(cold(x), want)
    assert (cold.stats.traces_not_saved, cold.stats.traces_loaded) == (0, 0)
    warm = _compile(module, tmp_path)
    FLAGS.collecting, FLAGS.collected = True, "stale"  # what the stores must undo
    with torch.no_grad():
        assert torch.equal(warm(x), want)
    assert warm.stats.traces_loaded == 1
    assert (FLAGS.collecting, FLAGS.collected) == (False, None)
    FLAGS.collecting = True  # every call repeats them, as Dynamo's code does
    x5 = torch.randn(5, 4)
    with torch.no_grad():
        got = warm(x5)
        assert FLAGS.collecting is False
        assert torch.equal(got, module(x5))


def test_a_store_of_a_computed_value_keeps_the_trace_unsaved(tmp_path: Path) -> None:
    module = KeepsSum().eval()
    cold = _compile(module, tmp_path)
    with torch.no_grad():
        cold(torch.randn(3, 4))
    assert FLAGS.collected == 10
    assert (cold.stats.traces_not_saved, cold.stats.traces_loaded) == (1, 0)
    warm = _compile(module, tmp_path)
    with torch.no_grad():
        warm(torch.randn(2, 4))
    assert (warm.stats.traces_loaded, FLAGS.collected) == (0, 7)
