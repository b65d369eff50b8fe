"""The compile path with graphs on: which wrappers it builds and the capture counts of vLLM's
toy-model tests (research notes §7.3-7.5). Every scenario runs on every graph backend present
(the ``rig`` fixture)."""

from __future__ import annotations

from typing import Any

import torch

import freezeframe as ff
from freezeframe.compilation.piecewise import PiecewiseBackend
from tests.helpers import silly
from tests.helpers.toy_models import (
    LlamaConfig,
    SillyModel,
    ToyLlama,
    TwoSubmodulesModel,
    tractable_reference,
)
from tests.scenarios.conftest import Rig

PIECEWISE = ff.CUDAGraphMode.PIECEWISE
FULL = ff.CUDAGraphMode.FULL


def silly_model(rig: Rig, cudagraph_mode: str = "piecewise", **changes: Any) -> Any:
    return ff.compile(SillyModel().to(rig.device), rig.config(cudagraph_mode, **changes))


def test_simple_model_captures_each_piece_per_size(rig: Rig) -> None:
    model = silly_model(rig, cudagraph_copy_inputs=True)
    with model.stats.expect(graphs_traced=1, pieces=5, capturable_pieces=3,
                            backend_compilations=3, graphs_captured=6):
        model(rig.randn(100))                         # no context: compile only
        with ff.forward_context(2, mode=PIECEWISE):
            model(rig.randn(2))                       # capture size 2
        with ff.forward_context(1, mode=PIECEWISE):
            model(rig.randn(1))                       # capture size 1
        silly.reset_counter()
        with ff.forward_context(2, mode=PIECEWISE):
            # a new tensor: copy_inputs puts it into the captured buffer first
            out = model(rig.zeros(2))
    assert silly.get_counter() == 2                   # attention ran outside the graphs
    assert torch.equal(rig.host(out), torch.full((2,), 19.0))


def test_piece_wrappers_follow_the_contract(rig: Rig) -> None:
    model = silly_model(rig)
    model(rig.randn(4))
    wrappers = model.graph_wrappers()
    assert len(wrappers) == 3
    assert all(w.runtime_mode is PIECEWISE for w in wrappers)
    assert all(isinstance(w.unwrap(), PiecewiseBackend) for w in wrappers)
    assert [w.options.log for w in wrappers] == [True, False, False]
    assert [w.options.gc_disable for w in wrappers] == [False, True, True]
    assert [w.options.weak_ref_output for w in wrappers] == [False, False, True]
    assert all(w.window is model.capture_window for w in wrappers)


def test_graph_mode_none_builds_no_wrappers(rig: Rig) -> None:
    model = silly_model(rig, "none")
    x = rig.zeros(2)
    model(rig.randn(4))
    with model.stats.expect(graphs_captured=0), ff.forward_context(2, mode=PIECEWISE):
        assert torch.equal(rig.host(model(x)), torch.full((2,), 19.0))
    assert model.graph_wrappers() == []


def test_full_graph_wraps_the_whole_forward(rig: Rig) -> None:
    model = silly_model(rig, "full")
    wrappers = model.graph_wrappers()
    assert [w.runtime_mode for w in wrappers] == [FULL]
    x = rig.randn(2)
    model(rig.randn(8))
    with model.stats.expect(graphs_captured=1), ff.forward_context(2, mode=FULL):
        model(x)
    x.zero_()
    with ff.forward_context(2, mode=FULL):
        assert torch.equal(rig.host(model(x)), torch.full((2,), 19.0))


@torch.no_grad()  # serving runs without autograd; graphs record no backward
def _llama_run(rig: Rig, model: Any, n_layers_cfg: LlamaConfig) -> torch.Tensor:
    """vLLM's run_model: warm up at 16, capture 2 then 1, zero the static input in place,
    replay 2."""
    ids = torch.zeros(16, dtype=torch.long, device=rig.device)
    pos = torch.arange(16, device=rig.device)
    model(ids, pos)
    for n in (2, 1):
        with ff.forward_context(n, mode=PIECEWISE):
            model(ids[:n], pos[:n])
    ids[:2].zero_()
    with ff.forward_context(2, mode=PIECEWISE):
        return rig.host(model(ids[:2], pos[:2]))


def test_toy_llama_split_captures_26_graphs(rig: Rig) -> None:
    lc = LlamaConfig(num_layers=12)
    eager = ToyLlama(lc).to(rig.device)
    model = ff.compile(ToyLlama(lc).to(rig.device), rig.config())
    with model.stats.expect(graphs_traced=1, pieces=25, capturable_pieces=13,
                            backend_compilations=13, graphs_captured=26):
        out = _llama_run(rig, model, lc)
    ids = torch.zeros(2, dtype=torch.long, device=rig.device)
    assert torch.allclose(out, rig.host(eager(ids, torch.arange(2, device=rig.device))))


def test_toy_llama_tractable_with_graphs(rig: Rig) -> None:
    lc = LlamaConfig(num_layers=2, tractable_init=True)
    model = ff.compile(ToyLlama(lc).to(rig.device), rig.config())
    out = _llama_run(rig, model, lc)
    ids, pos = torch.zeros(2, dtype=torch.long), torch.arange(2)
    assert torch.allclose(out, tractable_reference(lc, ids, pos))
    assert model.stats.graphs_captured == 2 * 3


def _two_submodules(rig: Rig, cfg: ff.CompilationConfig) -> tuple[torch.nn.Module, list[Any]]:
    compiled: list[Any] = []

    def wrap(module: torch.nn.Module) -> Any:
        compiled.append(ff.compile(module, cfg))
        return compiled[-1]

    return TwoSubmodulesModel(wrap).to(rig.device), compiled


@torch.no_grad()
def _two_run(rig: Rig, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    model(rig.randn(32, 128))
    x = rig.randn(2, 128)
    for n in (2, 1):
        with ff.forward_context(n, mode=PIECEWISE):
            model(x[:n])
    with ff.forward_context(2, mode=PIECEWISE):
        return rig.host(model(x)), x


def test_two_submodules_capture_8_graphs_and_match_no_graphs(rig: Rig) -> None:
    model, compiled = _two_submodules(rig, rig.config())
    out, x = _two_run(rig, model)
    total = {k: sum(m.stats.get(k) for m in compiled)
             for k in ("graphs_traced", "pieces", "capturable_pieces", "backend_compilations",
                       "graphs_captured")}
    assert total == dict(graphs_traced=2, pieces=6, capturable_pieces=4,
                         backend_compilations=4, graphs_captured=8)

    plain, plain_compiled = _two_submodules(rig, rig.config("none"))
    plain.load_state_dict(model.state_dict())
    _two_run(rig, plain)
    assert sum(m.stats.graphs_captured for m in plain_compiled) == 0
    assert sum(m.stats.backend_compilations for m in plain_compiled) == 4
    eager = TwoSubmodulesModel().to(rig.device)
    eager.load_state_dict({k.replace(".module.", "."): v
                           for k, v in model.state_dict().items()})
    assert torch.allclose(out, rig.host(eager(x)), atol=1e-6)
    assert torch.equal(out, rig.host(plain(x)))
