"""A compiled model with ``inference_mode=False`` used in a graph step while autograd records.

A replayed graph records no autograd history, so such a step cannot give eager's answer (the
output's gradient). It must be refused up front with one clear CaptureError naming the fix,
before any piece runs: a forward whose first piece needs no gradient used to capture that
piece and only then fail at the next one, leaving its graph behind; and a graph captured while
nothing needed a gradient used to be replayed once the parameters did, silently returning an
output without a gradient. After the refusal no global state is left behind, and the same model
under ``torch.no_grad()`` and a fresh model give eager's outputs. Every scenario runs on every
graph backend present (the ``rig`` fixture); the tests turn grad on themselves (the ``cuda``
rig runs each test under ``no_grad``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import CUDAGraphMode
from freezeframe.errors import CaptureError
from tests.helpers.faults import _assert_clean
from tests.scenarios.conftest import Rig

NONE, PW, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
HIDDEN = 4
OP = "ffautogradfaults::comm"
REFUSED = (r"while autograd is recording \(.+\).*ff\.compile\(\.\.\., inference_mode=False\)"
           r".*torch\.no_grad\(\) or torch\.inference_mode\(\)")


class _Calls:
    n = 0


@torch.library.custom_op(OP, mutates_args=())
def _comm(x: torch.Tensor) -> torch.Tensor:
    """The splitting op (``x * 2 + 1``); counts its eager runs, so a test sees whether any of
    the forward ran."""
    _Calls.n += 1
    return x * 2 + 1


@_comm.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _comm_backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    return grad * 2


_comm.register_autograd(_comm_backward)


class Model(nn.Module):
    """The first piece (``x * 3``) has no parameter, so it needs no gradient; the last piece's
    weight does. Integer-valued, so outputs and gradients compare exactly."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randint(-3, 4, (HIDDEN, HIDDEN), generator=g).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(_comm(x * 3) @ self.w)


def inputs(rig: Rig, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, (tokens, HIDDEN), generator=g).float().to(rig.device)


def eager(rig: Rig, tokens: int, seed: int) -> torch.Tensor:
    """A host copy of eager's output for ``inputs(rig, tokens, seed)``."""
    return rig.host(Model().to(rig.device)(inputs(rig, tokens, seed)))


def _config(rig: Rig, graph_mode: str) -> ff.CompilationConfig:
    return rig.config(graph_mode, splitting_ops=[OP], cudagraph_capture_sizes=[2, 4])


def _graph_step(rig: Rig, model: nn.Module, mode: CUDAGraphMode, tokens: int,
                buffer: torch.Tensor, seed: int) -> torch.Tensor:
    """A low-level step: the data written into the static buffer, padded to a capture size;
    returns a host copy of the real rows."""
    buffer[:tokens].copy_(inputs(rig, tokens, seed))
    buffer[tokens:].zero_()
    padded = 2 if tokens <= 2 else 4
    with ff.forward_context(ff.BatchDescriptor(num_tokens=padded), mode=mode):
        return rig.host(model(buffer[:padded])[:tokens])


def _check_no_grad(rig: Rig, model: nn.Module, mode: CUDAGraphMode, seeds: range) -> None:
    buffer = rig.zeros(4, HIDDEN)
    with torch.no_grad():
        for seed in seeds:
            tokens = 1 + seed % 4
            assert torch.equal(_graph_step(rig, model, mode, tokens, buffer, seed),
                               eager(rig, tokens, seed)), seed


@pytest.fixture(autouse=True)
def _count_from_zero() -> Iterator[None]:
    _Calls.n = 0
    yield


def _mode(graph_mode: str) -> CUDAGraphMode:
    return FULL if graph_mode == "full" else PW


@pytest.mark.parametrize("graph_mode", ["piecewise", "full", "full_and_piecewise"])
def test_a_graph_step_while_autograd_records_is_refused_before_any_piece_runs(
        rig: Rig, clean: dict[str, Any], graph_mode: str) -> None:
    frozen = gc.get_freeze_count()
    recording = dict(clean, grad=True)  # the global state expected while grad is on
    mode = _mode(graph_mode)
    with torch.enable_grad():  # the cuda rig runs the test under no_grad
        model = ff.compile(Model().to(rig.device), _config(rig, graph_mode),
                           inference_mode=False)
        reference = Model().to(rig.device)
        x = inputs(rig, 3, 0)
        # Without graphs autograd works as in eager: the same output and the same gradient.
        out = model(x)
        expected = reference(x)
        assert torch.equal(rig.host(out), rig.host(expected))
        out.sum().backward()
        expected.sum().backward()
        assert model.module.w.grad is not None and reference.w.grad is not None
        assert torch.equal(rig.host(model.module.w.grad), rig.host(reference.w.grad))
        runs = _Calls.n

        buffer = rig.zeros(4, HIDDEN)
        with pytest.raises(CaptureError, match=REFUSED) as refused:
            _graph_step(rig, model, mode, 3, buffer, seed=1)
        assert "parameter 'w' requires grad" in str(refused.value)
        assert _Calls.n == runs  # refused up front: no piece, no splitting op ran
        assert [w.captured_descriptors for w in model.graph_wrappers()] == \
            [[] for _ in model.graph_wrappers()]
        assert model.stats.graphs_captured == 0
        _assert_clean(frozen, recording)

        # An input that needs a gradient is refused the same way, even with frozen weights.
        model.module.w.requires_grad_(False)
        with pytest.raises(CaptureError, match=REFUSED) as refused, \
                ff.forward_context(ff.BatchDescriptor(num_tokens=4), mode=mode):
            model(inputs(rig, 4, 1).requires_grad_(True))
        assert "argument 'x' requires grad" in str(refused.value)
        model.module.w.requires_grad_(True)
        assert _Calls.n == runs

        _check_no_grad(rig, model, mode, range(2, 10))
        assert model.stats.graphs_captured == {"piecewise": 4, "full": 2,
                                               "full_and_piecewise": 4}[graph_mode]
        _check_no_grad(rig, ff.compile(Model().to(rig.device), _config(rig, graph_mode)), mode,
                       range(10, 14))
        _assert_clean(frozen, recording)
    _assert_clean(frozen, clean)


@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_a_graph_captured_without_gradients_is_not_replayed_once_they_are_needed(
        rig: Rig, clean: dict[str, Any], graph_mode: str) -> None:
    """Captured with frozen weights and grad on (nothing needed a gradient then); once the
    weights need one, a replay would return an output without a gradient, where eager's has
    one."""
    frozen = gc.get_freeze_count()
    recording = dict(clean, grad=True)  # the global state expected while grad is on
    mode = _mode(graph_mode)
    with torch.enable_grad():  # the cuda rig runs the test under no_grad
        model = ff.compile(Model().to(rig.device).requires_grad_(False),
                           _config(rig, graph_mode), inference_mode=False)
        buffer = rig.zeros(4, HIDDEN)
        model(inputs(rig, 4, 0))  # traces
        captured = model.stats.graphs_captured
        assert torch.equal(_graph_step(rig, model, mode, 4, buffer, seed=1), eager(rig, 4, 1))
        assert model.stats.graphs_captured > captured
        model.module.requires_grad_(True)
        with model.stats.expect(replays=0, graphs_captured=0), \
                pytest.raises(CaptureError, match=REFUSED):
            _graph_step(rig, model, mode, 4, buffer, seed=2)
        _assert_clean(frozen, recording)
        model.module.requires_grad_(False)
        with model.stats.expect(graphs_captured=0):  # the graphs captured before replay
            assert torch.equal(_graph_step(rig, model, mode, 4, buffer, seed=3),
                               eager(rig, 4, 3))
    _assert_clean(frozen, clean)
