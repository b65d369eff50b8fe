"""A fault in the middle of an Inductor compile (a user's post-grad pass raising while Inductor
lowers a piece): one clear error naming the piece, and nothing of Inductor's state left behind
(its config patch, Dynamo's tracing context, the fake mode on the dispatch stack); the same
model's next call compiles again and equals eager, and so does a fresh model."""

from __future__ import annotations

import gc

import pytest
import torch
import torch._inductor.config as inductor_config
from torch import fx, nn

import freezeframe as ff
from freezeframe.errors import CompileError
from tests.helpers.faults import _assert_clean


class _Armed:
    on = False
    fired = 0


def _faulty_pass(graph: fx.Graph) -> None:
    if _Armed.on:
        _Armed.on = False
        _Armed.fired += 1
        raise RuntimeError("injected at an inductor pass")


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randint(-3, 4, (4, 4), generator=g).float(),
                              requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w) * 2 + 1


def _inputs(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, (tokens, 4), generator=g).float()


@pytest.mark.inductor
def test_a_fault_inside_an_inductor_compile_leaves_nothing_behind() -> None:
    frozen = gc.get_freeze_count()
    cfg = ff.CompilationConfig(mode="dynamo_trace_once", backend="inductor",
                               cudagraph_mode="none", use_cache=False,
                               inductor_passes={"faulty": _faulty_pass},
                               # a hit in Inductor's own cache (an earlier run) skips the pass
                               inductor_compile_config={"force_disable_caches": True})
    model = ff.compile(Model(), cfg)
    _Armed.on, _Armed.fired = True, 0
    # Dynamo wraps our CompileError in its BackendCompilerFailed unless the compiled model
    # unwraps it; either way the message is ours and names the piece and the cause.
    with pytest.raises((CompileError, torch._dynamo.exc.BackendCompilerFailed),
                       match=r"inductor failed to compile piece 0 .*injected at an inductor "
                             r"pass"):
        model(_inputs(3, 0))
    assert _Armed.fired == 1
    _assert_clean(frozen)
    assert inductor_config.post_grad_custom_post_pass is None
    assert torch._guards.TracingContext.try_get() is None
    assert model.num_traces == 0
    for seed, tokens in enumerate([3, 5, 2, 8]):
        x = _inputs(tokens, seed)
        assert torch.equal(model(x), Model()(x)), tokens
    assert model.num_traces == 1
    fresh = ff.compile(Model(), cfg)
    assert torch.equal(fresh(_inputs(6, 9)), Model()(_inputs(6, 9)))
    _assert_clean(frozen)
