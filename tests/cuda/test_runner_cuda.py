"""GraphRunner on real CUDA graphs: every size equals eager, and capture reports device memory."""

from __future__ import annotations

import pytest
import torch

import freezeframe as ff
from freezeframe import CUDAGraphMode
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.silly import get_counter, reset_counter
from tests.helpers.toy_models import SillyModel

pytestmark = pytest.mark.cuda

SIZES = [1, 2, 4, 8, 16]
MAX_TOKENS = 24


@pytest.mark.parametrize("mode", ["piecewise", "full", "full_and_piecewise"])
def test_cuda_runner_matches_eager_for_every_size(mode: str) -> None:
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
        cudagraph_mode=mode, graph_backend="cuda", cudagraph_capture_sizes=SIZES,
        max_num_tokens=MAX_TOKENS, max_num_seqs=16, cudagraph_num_of_warmups=1)
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(64)}, device="cuda", progress=False)
    report = runner.capture()
    assert report.num_graphs == runner.dispatcher.num_keys
    assert report.device.startswith("cuda")
    assert report.memory_bytes > 0  # the graphs took pool memory (free-memory delta)
    eager = SillyModel()
    for n in range(1, MAX_TOKENS + 1):
        x = torch.randn(n, 64, device="cuda")
        want = eager(x)
        graph_mode = runner.dispatcher.dispatch(n)[0]
        reset_counter()
        y = runner(x)
        torch.cuda.synchronize()
        assert get_counter() == (0 if graph_mode is CUDAGraphMode.FULL else 2), n
        torch.testing.assert_close(y, want)
    assert runner.stats.fallback_too_large == MAX_TOKENS - max(SIZES)


def test_a_step_before_capture_warms_its_key_up_before_capturing_it() -> None:
    """A CUDA capture records kernels without running them: the first step of a key runs
    without a graph (its lazy set-up happens there), the second captures."""
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
        cudagraph_mode="piecewise", graph_backend="cuda", cudagraph_capture_sizes=SIZES,
        max_num_tokens=MAX_TOKENS, max_num_seqs=16)
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(64)}, device="cuda", progress=False)
    x = torch.randn(3, 64, device="cuda")
    want = SillyModel()(x)
    torch.testing.assert_close(runner(x), want)
    assert (runner.stats.warmups, model.stats.graphs_captured) == (1, 0)
    torch.testing.assert_close(runner(x), want)
    assert model.stats.graphs_captured == 3
    report = runner.capture()
    assert report.num_graphs == len(SIZES)
    assert runner.stats.warmups == len(SIZES)  # one per key: key 4 was warmed by the step
    torch.testing.assert_close(runner(x), want)
