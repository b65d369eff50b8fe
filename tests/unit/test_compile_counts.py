"""The exact compile counts of vLLM's toy-model tests (research notes §7.3-7.6, §7.9), with the
eager compiler, and outputs equal to the uncompiled model."""

from __future__ import annotations

import copy

import pytest
import torch

import freezeframe as ff
from freezeframe.sizes import Range
from tests.helpers import silly
from tests.helpers.toy_models import (
    AttnSandwich,
    LlamaConfig,
    OuterWithTwoInner,
    SillyModel,
    ToyLlama,
    TwoSubmodulesModel,
    tractable_reference,
)

ZERO = dict(graphs_traced=0, pieces=0, capturable_pieces=0, backend_compilations=0,
            inductor_compiles=0, eager_compiles=0)


def config(**changes):
    # use_cache=False: these counts describe a cold compile (vLLM's tests disable the cache too)
    base = dict(mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
                cudagraph_mode="none", use_cache=False)
    base.update(changes)
    return ff.CompilationConfig(**base)


def counts(*models):
    names = ZERO.keys()
    return {n: sum(m.stats.get(n) for m in models) for n in names}


def expected(graphs, pieces, capturable, compilations, *, inductor=0, eager=None):
    return dict(graphs_traced=graphs, pieces=pieces, capturable_pieces=capturable,
                backend_compilations=compilations, inductor_compiles=inductor,
                eager_compiles=compilations if eager is None else eager)


# -- §7.3 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("graph_mode", ["none", "piecewise"])
def test_simple_model_counts_and_output(graph_mode):
    cfg = config(cudagraph_mode=graph_mode, cudagraph_copy_inputs=True,
                 cudagraph_capture_sizes=[1, 2])
    model = ff.compile(SillyModel(), cfg)
    with model.stats.expect(**expected(1, 5, 3, 3)):
        model(torch.randn(100))             # the one trace, dynamic batch dim
        model(torch.randn(2))
        model(torch.randn(1))
    silly.reset_counter()
    out = model(torch.zeros(2))
    assert silly.get_counter() == 2          # both attentions ran, eagerly
    assert torch.equal(out, torch.full((2,), 19.0))
    assert [p.is_splitting_op for p in model.pieces] == [False, True, False, True, False]


# -- §7.4 -------------------------------------------------------------------------------------
def _llama_inputs(n=16):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (n,), generator=gen), torch.arange(n)


def _run_llama(model):
    outs = []
    for n in (16, 2, 1):                    # warm-up (the trace), then two smaller sizes
        ids, pos = _llama_inputs(n)
        outs.append(model(ids, pos))
    return outs


def test_toy_llama_no_compile_counts_nothing():
    lc = LlamaConfig(num_layers=12)
    model = ff.compile(ToyLlama(lc), config(mode="none"))
    _run_llama(model)
    assert counts(model) == ZERO


def test_toy_llama_without_split_is_one_piece():
    lc = LlamaConfig(num_layers=12)
    eager = ToyLlama(lc)
    model = ff.compile(copy.deepcopy(eager), config(splitting_ops=None))
    outs = _run_llama(model)
    assert counts(model) == expected(1, 1, 1, 1)
    for out, ref in zip(outs, _run_llama(eager), strict=True):
        assert torch.allclose(out, ref)


def test_toy_llama_split_25_pieces_13_capturable():
    lc = LlamaConfig(num_layers=12)
    eager = ToyLlama(lc)
    model = ff.compile(copy.deepcopy(eager), config())
    outs = _run_llama(model)
    # the first and last pieces are unlike the 11 alike middle ones: 3 distinct are compiled
    assert counts(model) == expected(1, 25, 13, 13, eager=3)
    assert model.stats.distinct_pieces == 3 and model.stats.pieces_reused == 10
    assert len(model.pieces) == 25
    assert [p.index for p in model.pieces] == list(range(25))
    assert sum(p.capturable for p in model.pieces) == 13
    assert all(p.is_splitting_op == (p.index % 2 == 1) for p in model.pieces)
    for out, ref in zip(outs, _run_llama(eager), strict=True):
        assert torch.isfinite(ref).all()
        assert torch.allclose(out, ref)


def test_toy_llama_tractable_closed_form():
    lc = LlamaConfig(num_layers=2, tractable_init=True)
    model = ff.compile(ToyLlama(lc), config())
    for n in (16, 2, 1, 7):
        ids, pos = _llama_inputs(n)
        assert torch.allclose(model(ids, pos), tractable_reference(lc, ids, pos))
    assert counts(model) == expected(1, 5, 3, 3)


# -- §7.5 -------------------------------------------------------------------------------------
def test_two_separately_compiled_submodules():
    cfg = config()
    compiled = []

    def wrap(module):
        compiled.append(ff.compile(module, cfg))
        return compiled[-1]

    model = TwoSubmodulesModel(wrap)
    eager = TwoSubmodulesModel()
    eager.load_state_dict({k.replace(".module.", "."): v
                           for k, v in model.state_dict().items()})
    xs = [torch.randn(n, 128) for n in (32, 2, 1, 17)]
    outs = [model(x).clone() for x in xs]
    assert counts(*compiled) == expected(2, 6, 4, 4)
    for x, out in zip(xs, outs, strict=True):
        assert torch.allclose(out, eager(x), atol=1e-6)
        # same ops in the same order: bitwise equal to the uncompiled module
        assert torch.equal(out, eager(x))


def test_two_submodules_mode_none_counts_nothing():
    compiled = []

    def wrap(module):
        compiled.append(ff.compile(module, config(mode="none")))
        return compiled[-1]

    model = TwoSubmodulesModel(wrap)
    model(torch.randn(4, 128))
    assert counts(*compiled) == ZERO


# -- §7.6 -------------------------------------------------------------------------------------
def test_sandwich_counts():
    model = ff.compile(AttnSandwich(), config())
    x = torch.randn(6, 4)
    assert torch.equal(model(x), AttnSandwich()(x))
    assert counts(model) == expected(1, 3, 2, 2)


def test_sandwich_not_compiled_counts_nothing():
    model = ff.compile(AttnSandwich(), config(mode="none"))
    model(torch.randn(6, 4))
    assert counts(model) == ZERO


def test_outer_compiled_inlines_the_inner_modules():
    model = ff.compile(OuterWithTwoInner(), config())
    x = torch.randn(5, 3)
    silly.reset_counter()
    assert torch.equal(model(x), OuterWithTwoInner()(x))
    assert silly.get_counter() == 6          # 3 attentions in the compiled model + 3 eager
    assert counts(model) == expected(1, 7, 4, 4)


def test_inner_modules_compiled_separately():
    compiled = []

    def wrap(module):
        compiled.append(ff.compile(module, config()))
        return compiled[-1]

    model = OuterWithTwoInner(wrap)
    x = torch.randn(5, 3)
    assert torch.equal(model(x), OuterWithTwoInner()(x))
    assert torch.equal(model(x[:2]), OuterWithTwoInner()(x[:2]))
    assert counts(*compiled) == expected(2, 6, 4, 4)
    # each instance traced on its own
    assert [m.stats.graphs_traced for m in compiled] == [1, 1]


# -- §7.9 -------------------------------------------------------------------------------------
def test_compile_ranges_counts():
    cfg = config(splitting_ops=None, compile_ranges_endpoints=[8, 32],
                 compile_sizes=[16, 64, 128], max_num_tokens=8192)
    assert [(r.start, r.end) for r in cfg.compile_ranges()] == [(1, 8), (9, 32), (33, 8192)]
    model = ff.compile(AttnSandwich(), cfg)
    with model.stats.expect(**expected(1, 1, 1, 6)):
        for n in (64, 1, 4, 16, 24, 48, 64, 8192):
            x = torch.randn(n, 4)
            assert torch.equal(model(x), AttnSandwich()(x))
    backend = model._variants[0].backend.piece_backends[0]
    assert sorted(backend.entries) == sorted(
        [Range(1, 8), Range(9, 32), Range(33, 8192), Range(16, 16),
         Range(64, 64), Range(128, 128)])


def test_stock_torch_compile_counts():
    model = ff.compile(AttnSandwich(), config(mode="stock_torch_compile"))
    x = torch.randn(6, 4)
    assert torch.equal(model(x), AttnSandwich()(x))
    assert model.stats.graphs_traced == 1
    assert model.stats.pieces == 0
