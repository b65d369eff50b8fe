"""Fault injection for a compiled model used directly (``ff.compile`` and calls inside
``ff.forward_context``): an exception at the trace, the piece compile, a warm-up, a capture or
a replay. After each, no global state is left behind, the same model's next calls equal
eager's (the failed stage is simply done again), and a fresh model compiles and runs. Every
scenario runs on every graph backend present (the ``rig`` fixture)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import freezeframe as ff
from freezeframe.compilation import CompiledModel
from freezeframe.compilation.compilers import EagerCompiler
from freezeframe.errors import CaptureError, CompileError
from freezeframe.graphs import CaptureWindow, GraphWrapper
from freezeframe.graphs.backend import resolve_backend
from freezeframe.stats import Stats
from tests.helpers.faults import (
    FAULT_TYPES,
    FAULTS,
    FULL,
    NONE,
    PW,
    FaultyModel,
    _assert_clean,
    rig_inputs,
)
from tests.scenarios.conftest import Rig

SPLIT = "fffaults::comm"


pytestmark = pytest.mark.usefixtures("faults_disarmed")
inputs = rig_inputs


def eager(rig: Rig, x: torch.Tensor) -> torch.Tensor:
    """A host copy of eager's output."""
    with torch.no_grad():
        return rig.host(FaultyModel().to(rig.device)(x))


def _config(rig: Rig, graph_mode: str = "piecewise", **changes: object) -> ff.CompilationConfig:
    return rig.config(graph_mode, splitting_ops=[SPLIT], cudagraph_capture_sizes=[2, 4],
                      **changes)


def _step(rig: Rig, model: CompiledModel, mode: ff.CUDAGraphMode, tokens: int,
          buffer: torch.Tensor, seed: int) -> torch.Tensor:
    """One step the way the README's low-level flow makes it: new data written into the
    static buffer, the padded view passed; returns a host copy of the real rows."""
    x = inputs(rig, tokens, seed)
    buffer[:tokens].copy_(x)
    buffer[tokens:].zero_()
    padded = 2 if tokens <= 2 else 4
    desc = ff.BatchDescriptor(num_tokens=padded) if mode is not NONE else None
    with ff.forward_context(desc, mode=mode):
        out = model(buffer[:padded] if mode is not NONE else buffer[:tokens])
    return rig.host(out[:tokens])


def _assert_works(rig: Rig, model: CompiledModel, mode: ff.CUDAGraphMode) -> None:
    buffer = rig.zeros(4, 4)
    for seed, tokens in enumerate([3, 4, 2, 1, 3]):
        torch.testing.assert_close(_step(rig, model, mode, tokens, buffer, seed),
                                   eager(rig, inputs(rig, tokens, seed))[:tokens])
    fresh = ff.compile(FaultyModel().to(rig.device), _config(rig, mode.name.lower()))
    for seed, tokens in enumerate([4, 3, 4]):
        torch.testing.assert_close(_step(rig, fresh, mode, tokens, buffer, seed),
                                   eager(rig, inputs(rig, tokens, seed)))


def test_a_fault_while_tracing(rig: Rig, clean: dict[str, Any]) -> None:
    frozen = gc.get_freeze_count()
    model = ff.compile(FaultyModel().to(rig.device), _config(rig))
    FAULTS.armed = "trace"
    with pytest.raises(FAULT_TYPES, match="injected at trace"):
        model(inputs(rig, 3, 0))
    _assert_clean(frozen, clean)
    assert model.num_traces == 0 and model.stats.graphs_traced == 0
    _assert_works(rig, model, PW)
    assert model.num_traces == 1


def test_a_fault_while_compiling_a_piece(rig: Rig, clean: dict[str, Any],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    frozen = gc.get_freeze_count()
    real = EagerCompiler.compile
    calls = [0]

    def fails_once(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:  # the second piece
            raise RuntimeError("injected at compile")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(EagerCompiler, "compile", fails_once)
    model = ff.compile(FaultyModel().to(rig.device), _config(rig))
    with pytest.raises(CompileError, match=r"eager failed to compile piece \d for sizes "
                                           r"\[1, 8192\]: RuntimeError: injected at compile"):
        model(inputs(rig, 3, 0))
    _assert_clean(frozen, clean)
    _assert_works(rig, model, PW)


def test_a_warm_up_that_raised_does_not_count_as_one(rig: Rig) -> None:
    """A graph wrapper's warm-ups run the piece eagerly before its capture; one that failed
    is made again, so the capture never follows a warm-up that did not happen."""
    calls: list[str] = []

    def piece(x: torch.Tensor) -> torch.Tensor:
        calls.append("run")
        if len(calls) == 1:
            raise RuntimeError("injected at warm-up")
        return x * 2

    stats = Stats()
    backend = resolve_backend(rig.backend)
    assert backend is not None
    wrapper = GraphWrapper(piece, PW, backend, stats=stats, window=CaptureWindow(),
                           num_warmups=1)
    x = torch.ones(2, device=rig.device)
    with ff.forward_context(2, mode=PW):
        with pytest.raises(RuntimeError, match="injected at warm-up"):
            wrapper(x)
        with stats.expect(graphs_captured=0):
            assert rig.host(wrapper(x)).tolist() == [2.0, 2.0]  # the warm-up, again
        with stats.expect(graphs_captured=1):
            wrapper(x)
        x.fill_(3.0)
        assert rig.host(wrapper(x)).tolist() == [6.0, 6.0]


@pytest.mark.parametrize("graph_mode", ["piecewise", "full", "full_and_piecewise"])
def test_a_fault_during_a_capture_leaves_no_graph_and_the_next_call_captures(
        rig: Rig, clean: dict[str, Any], graph_mode: str) -> None:
    frozen = gc.get_freeze_count()
    mode = FULL if graph_mode == "full" else PW
    model = ff.compile(FaultyModel().to(rig.device), _config(rig, graph_mode))
    buffer = rig.zeros(4, 4)
    _step(rig, model, NONE, 3, buffer, 0)
    FAULTS.armed = "replay"  # the first call with this descriptor captures
    with pytest.raises(FAULT_TYPES, match="injected at replay"):
        _step(rig, model, mode, 3, buffer, 1)
    _assert_clean(frozen, clean)
    # the piece before the op captured completely (a valid graph, replayed next time); the
    # graph that failed was not stored
    captured = [len(w.captured_descriptors) for w in model.graph_wrappers()]
    # the wrappers: the pieces', then (full_and_piecewise) the whole forward's FULL one
    assert captured == {"piecewise": [1, 0], "full": [0], "full_and_piecewise": [1, 0, 0]}[
        graph_mode]
    assert model.stats.graphs_captured == (1 if mode is PW else 0)
    _assert_works(rig, model, mode)


def test_a_fault_during_a_replay_leaves_the_graphs_usable(rig: Rig,
                                                          clean: dict[str, Any]) -> None:
    frozen = gc.get_freeze_count()
    model = ff.compile(FaultyModel().to(rig.device), _config(rig))
    buffer = rig.zeros(4, 4)
    _step(rig, model, NONE, 3, buffer, 0)
    _step(rig, model, PW, 3, buffer, 1)  # captures
    kept = [list(w.captured_descriptors) for w in model.graph_wrappers()]
    FAULTS.armed = "replay"  # the op runs between the piece replays
    with pytest.raises(FAULT_TYPES, match="injected at replay"):
        _step(rig, model, PW, 3, buffer, 2)
    _assert_clean(frozen, clean)
    assert [list(w.captured_descriptors) for w in model.graph_wrappers()] == kept
    with model.stats.expect(graphs_captured=0):
        torch.testing.assert_close(_step(rig, model, PW, 4, buffer, 3),
                                   eager(rig, inputs(rig, 4, 3)))
    _assert_works(rig, model, PW)


@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_capture_while_autograd_records_is_one_clear_error(rig: Rig, clean: dict[str, Any],
                                                          graph_mode: str) -> None:
    """With inference_mode=False and grad on, a graph cannot be captured: a replay records no
    autograd history. Refused before anything is stored, and the same model captures once
    autograd is off."""
    frozen = gc.get_freeze_count()
    mode = PW if graph_mode == "piecewise" else FULL
    module = FaultyModel().to(rig.device).requires_grad_(True)
    model = ff.compile(module, _config(rig, graph_mode), inference_mode=False)
    buffer = rig.zeros(4, 4)
    x = inputs(rig, 3, 0)
    with torch.enable_grad():  # the cuda rig runs the test under no_grad
        # no graph: autograd works as in eager
        torch.testing.assert_close(rig.host(model(x)), eager(rig, x))
        assert model(x).requires_grad
        with pytest.raises(CaptureError, match=r"while autograd is recording .*call under "
                                               r"torch.no_grad\(\) or torch.inference_mode\(\)"):
            _step(rig, model, mode, 3, buffer, 1)
    _assert_clean(frozen, clean)
    assert all(w.captured_descriptors == [] for w in model.graph_wrappers())
    with torch.no_grad():
        for seed, tokens in enumerate([3, 4, 3]):
            torch.testing.assert_close(_step(rig, model, mode, tokens, buffer, seed),
                                       eager(rig, inputs(rig, tokens, seed)))
    # the graphs captured after the refused capture are replayed (counts per piece)
    assert model.stats.replays == {"piecewise": 4, "full": 1}[graph_mode]
