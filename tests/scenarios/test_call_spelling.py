"""One graph, however its call is spelled: ``model(x=a)`` after a capture of ``model(a)``, or
the reverse, replays it (found by the matrix audit of issue 42: the FULL graph compared the
argument lists and refused with InputMismatchError). Through the low-level forward context, for
a traced model and one without a trace, on every graph backend present."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import freezeframe as ff
from tests.helpers import silly  # noqa: F401  (registers silly::attention)
from tests.scenarios.conftest import Rig


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, gain: float = 2.0) -> torch.Tensor:
        h = self.lin(x)
        out = torch.empty_like(h)
        torch.ops.silly.attention(h, h, h, out)
        return out * gain


@pytest.mark.parametrize("first", ["keyword", "positional"])
@pytest.mark.parametrize(("mode", "graphs"), [("piecewise", "full"), ("piecewise", "piecewise"),
                                              ("none", "full"), ("none", "piecewise")])
def test_positional_and_keyword_calls_share_one_graph(rig: Rig, mode: str, graphs: str,
                                                      first: str) -> None:
    module = Scale().to(rig.device)
    model = ff.compile(module, rig.config(graphs, mode=mode, cudagraph_capture_sizes=[4]))
    runtime = ff.CUDAGraphMode.FULL if graphs == "full" else ff.CUDAGraphMode.PIECEWISE
    x = rig.randn(4, 4, generator=torch.Generator().manual_seed(1))
    spellings = [lambda: model(x=x), lambda: model(x, gain=2.0), lambda: model(x)]
    if first == "positional":
        spellings.reverse()
    with torch.no_grad():
        want = rig.host(module(x))
        for call in [spellings[0]] * 3 + spellings:  # warm-up, capture, replays
            with ff.forward_context(ff.BatchDescriptor(4), mode=runtime):
                torch.testing.assert_close(rig.host(call()), want)
    # one graph (traced PIECEWISE: one per capturable piece), captured once
    assert model.stats.get("graphs_captured") == (2 if (mode, graphs) == ("piecewise",
                                                                         "piecewise") else 1)
