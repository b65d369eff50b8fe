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


class _Scaled(torch.nn.Module):
    """A linear layer (cuBLAS) split by the silly attention, on one device."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tests.helpers.silly import attention

        h = self.proj(x)
        return self.proj(attention(h, h, h)) * 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("policy", ["eager", "background"])
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_runner_on_the_second_gpu_captures_there_whatever_device_is_current(
        mode: str, policy: str) -> None:
    """A cuda:1 runner called from a thread whose current device is 0 (every thread starts
    there, the background capture's too): its captures must record on cuda:1's stream, or the
    graphs are empty, the kernels run eagerly while capturing, and replays return stale
    outputs. Two inputs in a row at the same size tell a working replay from a stale one."""
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
        cudagraph_mode=mode, graph_backend="cuda", cudagraph_capture_sizes=[2, 4],
        max_num_tokens=4, max_num_seqs=4, cudagraph_num_of_warmups=1)
    module = _Scaled().to("cuda:1")
    eager = _Scaled().to("cuda:1")
    eager.load_state_dict(module.state_dict())
    with torch.cuda.device(0):
        runner = GraphRunner(ff.compile(module, cfg), cfg, inputs={"x": Tokens(64)},
                             device="cuda:1", progress=False, capture_policy=policy)
        report = runner.capture()
        if policy == "background":
            report = runner.wait_for_capture(timeout=120)
        assert report.num_graphs == 2
        for seed in range(3):
            x = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)).to("cuda:1")
            with torch.no_grad():
                want = eager(x)
            got = runner(x)
            torch.cuda.synchronize(1)
            torch.testing.assert_close(got, want)
        assert torch.cuda.current_device() == 0
    assert runner.stats.steps_eager == 0
