"""A model compiled with ``inference_mode=False`` runs in the caller's autograd mode, and one
caller may switch: graphs captured inside ``torch.inference_mode()`` serve later calls under
``torch.no_grad()`` or with grad on, and the reverse.

A capture inside inference mode used to allocate the graph's memory (a piece's outputs) as
inference tensors; at a later call outside inference mode the splitting op that runs eagerly
between the pieces wrote into one and raised torch's "Inplace update to inference tensor
outside InferenceMode" (full matrix seeds 24, 109 and 289), where eager answers. Each call is
compared with eager, and an answer outside inference mode must take an in-place change as
eager's does."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch

import freezeframe as ff
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.toy_models import SillyModel
from tests.scenarios.conftest import Rig

MODES: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}


def _x(rig: Rig, step: int) -> torch.Tensor:
    return torch.arange(8.0, device=rig.device).reshape(4, 2) + step


def _check(rig: Rig, got: torch.Tensor, step: int, mode: str) -> None:
    want = SillyModel()(_x(rig, step))
    assert torch.equal(rig.host(got), rig.host(want))
    if mode != "inference":  # eager's answer here takes an in-place change: so must ours
        assert not got.is_inference()
        got.add_(1.0)
        assert torch.equal(rig.host(got), rig.host(want + 1.0))


@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
@pytest.mark.parametrize("order", [("inference", "no_grad", "grad", "inference", "no_grad"),
                                   ("no_grad", "inference", "no_grad")])
def test_a_low_level_call_in_each_mode_answers_as_eager(rig: Rig, graph_mode: str,
                                                        order: tuple[str, ...]) -> None:
    model = ff.compile(SillyModel(), rig.config(graph_mode, cudagraph_capture_sizes=[4]),
                       inference_mode=False)
    mode = ff.CUDAGraphMode[graph_mode.upper()]
    for step, name in enumerate(order):
        with MODES[name](), ff.forward_context(ff.BatchDescriptor(num_tokens=4), mode=mode):
            got = model(_x(rig, step))  # a new tensor each call: copied into the captured one
        _check(rig, got, step, name)
    assert model.stats.graphs_captured >= 1


def test_a_runner_captured_in_inference_mode_steps_outside_it(rig: Rig) -> None:
    """Full seed 109's class: the runner's capture() and first step in inference mode."""
    cfg = rig.config("full_and_piecewise", cudagraph_capture_sizes=[2, 4], max_num_tokens=4)
    runner = GraphRunner(ff.compile(SillyModel(), cfg, inference_mode=False), cfg,
                         inputs={"x": Tokens(2)}, device=rig.device, progress=False)
    with torch.inference_mode():
        runner.capture()
    for step, name in enumerate(("inference", "no_grad", "inference", "no_grad")):
        with MODES[name]():
            got = runner(_x(rig, step)[:3])
        assert torch.equal(rig.host(got), rig.host(SillyModel()(_x(rig, step)[:3])))


def test_an_inference_tensor_captured_outside_inference_mode_takes_new_values(
        rig: Rig) -> None:
    """The captured argument is an inference tensor (made in inference mode, passed under
    no_grad, where eager reads it fine): a later call's new tensor is copied into it, which
    only inference mode may do."""
    model = ff.compile(SillyModel(), rig.config("full", cudagraph_capture_sizes=[4]),
                       inference_mode=False)
    with torch.inference_mode():
        captured = _x(rig, 1).clone()
    for step, x in enumerate((_x(rig, 0), captured, _x(rig, 2), _x(rig, 3))):
        with torch.no_grad(), ff.forward_context(ff.BatchDescriptor(num_tokens=4),
                                                 mode=ff.CUDAGraphMode.FULL):
            got = model(x)
        assert torch.equal(rig.host(got), rig.host(SillyModel()(_x(rig, step))))
    assert model.stats.graphs_captured == 1
    assert torch.equal(rig.host(captured), rig.host(_x(rig, 1)))  # put back after each copy
