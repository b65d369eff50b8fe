"""Where the graph backend only records (``cuda``), no graph key is captured before its code ran.

A CUDA capture records kernels without running them, so code whose first run happens inside a
capture does its lazy set-up there (Triton's compile and autotuning, cuBLAS handles and
workspaces, Inductor's first launch), which invalidates the capture. The runner therefore runs
every graph key at least once without a graph before capturing it: a warm-up pass in
``capture()``, and before ``capture()`` the first step of a key. Every scenario runs on every
graph backend present (the ``rig`` fixture); the emulated backend captures by running, so there
the ``records_only`` fixture makes it claim to record only (as ``cuda`` does): the runner's
policy is what these tests check.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import freezeframe as ff
from freezeframe import CompilationConfig
from freezeframe.graphs.emulated import EmulatedBackend
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.toy_models import SillyModel
from tests.scenarios.conftest import Rig

SIZES = [1, 2, 4, 8]


@pytest.fixture
def records_only(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # the wrapper then replays each new graph once after capturing it, as on cuda (which
    # records only already)
    if rig.backend == "emulated":
        monkeypatch.setattr(EmulatedBackend, "capture_computes", False)


def config(rig: Rig, mode: str, **kw: Any) -> CompilationConfig:
    return rig.config(mode, cudagraph_capture_sizes=SIZES, max_num_tokens=12, max_num_seqs=8,
                      **kw)


def same(rig: Rig, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of host copies (a replayed output is overwritten by the next replay)."""
    return torch.equal(rig.host(a), rig.host(b))


@pytest.mark.parametrize("mode, keys", [("piecewise", 4), ("full", 4),
                                        ("full_and_piecewise", 8)])
def test_capture_warms_up_every_key_once_before_capturing_it(rig: Rig, records_only: None,
                                                             mode: str, keys: int) -> None:
    cfg = config(rig, mode)
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False)
    report = runner.capture()
    assert report.num_graphs == keys
    assert runner.stats.warmups == keys  # one per key, none more (cudagraph_num_of_warmups=0)
    for n in (1, 3, 8):
        x = rig.randn(n, 3)
        torch.testing.assert_close(rig.host(runner(x)), rig.host(SillyModel()(x)), rtol=0,
                                   atol=0)


def test_configured_warmups_are_not_added_to(rig: Rig, records_only: None) -> None:
    cfg = config(rig, "piecewise", cudagraph_num_of_warmups=2)
    runner = GraphRunner(ff.compile(SillyModel(), cfg), cfg, inputs={"x": Tokens(3)},
                         device=rig.device, progress=False)
    runner.capture()
    assert runner.stats.warmups == 2 * len(SIZES)


def test_a_step_before_capture_runs_its_key_once_without_a_graph(rig: Rig,
                                                                 records_only: None) -> None:
    cfg = config(rig, "piecewise")
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False)
    x = torch.full((3, 3), 2.0, device=rig.device)
    assert same(rig, runner(x), 9 * x + 19)  # the first step of key 4: a warm-up
    assert (runner.stats.warmups, runner.stats.steps_eager) == (1, 1)
    assert model.stats.graphs_captured == 0
    assert same(rig, runner(x), 9 * x + 19)  # the second captures (3 pieces) and replays
    assert model.stats.graphs_captured == 3
    assert runner.stats.steps_piecewise == 1
    y = torch.full((2, 3), -1.0, device=rig.device)  # key 2: warmed up first too
    assert same(rig, runner(y), 9 * y + 19)
    assert (runner.stats.warmups, model.stats.graphs_captured) == (2, 3)
    runner.capture()  # key 4 keeps its graphs; the other keys are warmed and captured
    assert model.stats.graphs_captured == 3 * len(SIZES)
    assert runner.stats.warmups == 2 + len(SIZES) - 1 - 1  # keys 1 and 8 (2 was warmed)
    assert same(rig, runner(x), 9 * x + 19)


def test_a_strict_runner_warms_up_before_capture_without_calling_it_a_fallback(
        rig: Rig, records_only: None) -> None:
    cfg = config(rig, "piecewise")
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False, strict=True)
    x = torch.ones(4, 3, device=rig.device)
    assert same(rig, runner(x), 9 * x + 19)
    assert same(rig, runner(x), 9 * x + 19)
    assert (runner.stats.warmups, model.stats.graphs_captured) == (1, 3)
