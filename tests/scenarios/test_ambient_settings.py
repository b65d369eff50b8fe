"""Process-wide settings a capture depends on, changed between calls: autocast's dtype.

A trace and a captured graph are made for the autocast state of their first call. Autocast
switched on or off was seen by every path; a change of its dtype (bfloat16 -> float16) while
it stays on was not: every path replayed the graph of the old dtype, a silent wrong answer
(a float16 call answered in bfloat16). A traced model now refuses the call by name, as it
refuses autocast switched on after its trace; breakable graphs (which have no trace to keep)
are dropped and captured again."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.errors import CompileError
from tests.helpers.silly import attention
from tests.scenarios.conftest import Rig


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randint(-2, 3, (2, 2), generator=g).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(x @ self.w, x, x)


def _call(rig: Rig, model: nn.Module, dtype: torch.dtype | None, mode: str) -> torch.Tensor:
    x = torch.arange(8.0, device=rig.device).reshape(4, 2)
    device = "cuda" if rig.device == "cuda" else "cpu"
    with torch.autocast(device, dtype=dtype, enabled=dtype is not None), \
            ff.forward_context(ff.BatchDescriptor(num_tokens=4),
                               mode=ff.CUDAGraphMode[mode.upper()]):
        return model(x)


def _eager(rig: Rig, module: nn.Module, dtype: torch.dtype | None) -> torch.Tensor:
    x = torch.arange(8.0, device=rig.device).reshape(4, 2)
    device = "cuda" if rig.device == "cuda" else "cpu"
    with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=dtype is not None):
        return module(x)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_traced_model_refuses_an_autocast_dtype_change_by_name(rig: Rig, mode: str) -> None:
    module = Linear().to(rig.device)
    model = ff.compile(module, rig.config(mode, cudagraph_capture_sizes=[4]))
    got = _call(rig, model, torch.bfloat16, mode)
    assert got.dtype == torch.bfloat16
    assert torch.equal(rig.host(got), rig.host(_eager(rig, module, torch.bfloat16)))
    with pytest.raises(CompileError, match=r"autocast on \w+ was on \(torch\.bfloat16\) at the "
                                           r"trace and is on \(torch\.float16\) for this call"):
        _call(rig, model, torch.float16, mode)
    got = _call(rig, model, torch.bfloat16, mode)  # the trace's settings: served again
    assert torch.equal(rig.host(got), rig.host(_eager(rig, module, torch.bfloat16)))


@pytest.mark.parametrize("compile_mode", ["none", "stock_torch_compile"])
def test_breakable_graphs_follow_an_autocast_dtype_change(rig: Rig, compile_mode: str) -> None:
    module = Linear().to(rig.device)
    model = ff.compile(module, rig.config("piecewise", mode=compile_mode,
                                          cudagraph_capture_sizes=[4]))
    for dtype in (torch.bfloat16, torch.float16, None, torch.bfloat16):
        got = _call(rig, model, dtype, "piecewise")
        want = _eager(rig, module, dtype)
        assert got.dtype == want.dtype
        assert torch.equal(rig.host(got), rig.host(want))
