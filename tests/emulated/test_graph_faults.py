"""Faults in the graph machinery that only the emulated backend, or a fake of torch.cuda, can
inject on CPU: a replay of a captured graph that raises after running half of its recorded
steps (an emulated graph's steps are Python; a CUDA graph replays as one launch), after which
no global state is left behind (dispatch modes, forward context, grad mode, compile stance,
garbage collector) and the same model and a fresh one give eager's outputs; and the cuda
backend's handling of an error raised inside a capture, checked against the recording fake of
torch.cuda. The backend-independent fault scenarios are in tests/scenarios (the interrupted
micro-batched step: tests/scenarios/test_interrupted_micro_batch.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import CUDAGraphMode
from freezeframe.graphs.cuda import CudaBackend, is_capture_violation
from freezeframe.graphs.emulated import EmulatedGraph
from tests.helpers.faults import _assert_clean
from tests.helpers.toy_models import IntegerWeights
from tests.unit.test_graph_backends import FakeCuda, FakeStream

NONE, PW, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
HIDDEN = 4
OP = "ffgraphfaults::comm"


@torch.library.custom_op(OP, mutates_args=())
def _comm(x: torch.Tensor) -> torch.Tensor:
    """The splitting op (``x * 2 + 1``)."""
    return x * 2 + 1


@_comm.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Model(IntegerWeights):
    """Token-wise and integer-valued (exact results): linear, the comm op, relu(linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(_comm(x @ self.w1) @ self.w2)


def _inputs(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, (tokens, HIDDEN), generator=g).float()


def _eager(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return Model()(x)


# -- a replay that raises -------------------------------------------------------------------------
def _config(graph_mode: str) -> ff.CompilationConfig:
    return ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=[OP], cudagraph_mode=graph_mode,
        graph_backend="emulated", cudagraph_capture_sizes=[2, 4], use_cache=False)


def _step(model: nn.Module, mode: CUDAGraphMode, tokens: int, buffer: torch.Tensor,
          seed: int) -> torch.Tensor:
    """A low-level step: the data written into the static buffer, padded to a capture size."""
    x = _inputs(tokens, seed)
    buffer[:tokens].copy_(x)
    buffer[tokens:].zero_()
    padded = 2 if tokens <= 2 else 4
    with ff.forward_context(ff.BatchDescriptor(num_tokens=padded), mode=mode):
        return model(buffer[:padded])[:tokens].clone()


def _check(model: nn.Module, mode: CUDAGraphMode, seeds: range) -> None:
    buffer = torch.zeros(4, HIDDEN)
    for seed in seeds:
        tokens = 1 + seed % 4
        assert torch.equal(_step(model, mode, tokens, buffer, seed),
                           _eager(_inputs(tokens, seed))), seed


@pytest.mark.parametrize("graph_mode", ["piecewise", "full", "full_and_piecewise"])
def test_a_replay_that_raises_leaves_the_graphs_working(graph_mode: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second replay raises after it ran half of its recorded steps (a device error in
    the middle of a graph). The graphs stay; the next replay computes everything again."""
    frozen = gc.get_freeze_count()
    mode = FULL if graph_mode == "full" else PW
    model = ff.compile(Model(), _config(graph_mode))
    buffer = torch.zeros(4, HIDDEN)
    _step(model, NONE, 3, buffer, seed=0)  # traces
    _step(model, mode, 3, buffer, seed=1)  # captures
    graphs = [list(w.captured_descriptors) for w in model.graph_wrappers()]
    real = EmulatedGraph.replay

    def half_then_raise(self: EmulatedGraph) -> None:
        monkeypatch.setattr(EmulatedGraph, "replay", real)  # once
        self._steps[0].run()
        raise RuntimeError("injected at replay")

    monkeypatch.setattr(EmulatedGraph, "replay", half_then_raise)
    with pytest.raises(RuntimeError, match="injected at replay"):
        _step(model, mode, 4, buffer, seed=2)
    assert EmulatedGraph.replay is real
    _assert_clean(frozen)
    assert [list(w.captured_descriptors) for w in model.graph_wrappers()] == graphs
    with model.stats.expect(graphs_captured=0):
        assert torch.equal(_step(model, mode, 4, buffer, seed=3), _eager(_inputs(4, 3)))
    _check(model, mode, range(4, 12))
    _check(ff.compile(Model(), _config(graph_mode)), mode, range(12, 16))
    _assert_clean(frozen)


# -- the cuda backend's reading of an error raised inside a capture --------------------------------
@pytest.mark.parametrize(("message", "violation"), [
    ("CUDA error: operation not permitted when stream is capturing", True),
    ("CUDA error: operation failed due to a previous error during capture", True),
    ("Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture", True),
    ("injected at capture", False),  # the captured code's own error: reaches the caller as is
    ("CUDA error: an illegal memory access was encountered", False),
])
def test_only_cuda_refusing_a_capture_becomes_a_capture_error(message: str,
                                                              violation: bool) -> None:
    assert is_capture_violation(RuntimeError(message)) is violation
    assert is_capture_violation(ValueError(message)) is False
    assert is_capture_violation(ff.CaptureError(message)) is False


@pytest.fixture(params=[True, False], ids=["default-stream", "runner-stream"])
def fake_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """The recording fake of torch.cuda from tests/unit/test_graph_backends.py, installed."""
    fake = FakeCuda(current_is_default=request.param)
    for name in ("CUDAGraph", "current_device", "current_stream", "default_stream", "Stream",
                 "graph_pool_handle", "synchronize", "empty_cache", "stream", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_a_capture_is_ended_on_its_own_stream_whatever_the_code_left_current(
        fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked on CPU against the recording fake of torch.cuda: the captured code switches the
    current stream and raises. ``capture_end`` must run on the stream the capture began on
    (torch refuses any other, and the stream would stay capturing), the code's own error
    reaches the caller unchanged, and the caller's stream is current again."""
    ends: list[str] = []
    monkeypatch.setattr(fake_cuda.CUDAGraph, "capture_end",
                        lambda self: ends.append(fake_cuda.current.name))
    caller = fake_cuda.current
    capture_stream = "side" if caller is fake_cuda.default else caller.name

    def switches_and_raises() -> None:
        fake_cuda.current = FakeStream("other")
        raise RuntimeError("injected at capture")

    with pytest.raises(RuntimeError, match=r"^injected at capture$"):
        CudaBackend().capture(switches_and_raises, gc_disable=True)
    assert ends == [capture_stream]
    assert fake_cuda.current is caller

    def switches() -> str:
        fake_cuda.current = FakeStream("other")
        return "done"

    ends.clear()
    assert CudaBackend().capture(switches, gc_disable=True)[1] == "done"
    assert ends == [capture_stream]
    assert fake_cuda.current is caller
