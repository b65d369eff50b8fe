"""A saved trace serves only the sizes its Python branches allowed: the conditions a trace put
on the batch size are saved with it and checked before a warm start uses it (found by the
differential suite: a warm start served every size from the first side of `x.shape[0] > 2`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.compilation import CompiledModel


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.shape[0] > 2:
            h = h * 3
        return h


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FREEZEFRAME_DISABLE_CACHE", raising=False)


def _start(root: Path, sizes: list[int]) -> CompiledModel:
    eager = Branchy()
    model = ff.compile(Branchy(), ff.CompilationConfig(mode="piecewise", backend="eager",
                                                       cache_dir=str(root)))
    for n in sizes:
        x = torch.randn(n, 4)
        with torch.no_grad():
            torch.testing.assert_close(model(x), eager(x), msg=lambda m, n=n: f"size {n}: {m}")
    return model


@pytest.mark.filterwarnings("ignore:.*branches on a dynamic size")
def test_a_warm_start_uses_a_saved_trace_only_for_the_sizes_it_serves(tmp_path: Path) -> None:
    cold = _start(tmp_path, [3])
    assert cold.stats.artifacts_saved == 1
    warm = _start(tmp_path, [1, 3, 5, 2, 1])  # size 1 is on the other side of the branch
    assert warm.num_traces == 2
    # size 1 did not take the size-3 trace; its own trace then took the entry's one saved-trace
    # slot (both sides share a key), so size 3 did not find its side either
    assert (warm.stats.saved_trace_rejected, warm.stats.traces_loaded) == (2, 0)
    again = _start(tmp_path, [4, 6])
    assert (again.stats.traces_loaded, again.num_traces) == (1, 1)
