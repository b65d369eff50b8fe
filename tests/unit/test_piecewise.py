"""Per-piece compile entries (ranges and concrete sizes), size dispatch, compilers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.compilation.backend import _CopyInputs
from freezeframe.compilation.compilers import CompilerManager, EagerCompiler, current_compile_range
from freezeframe.errors import CompileError
from freezeframe.sizes import Range
from freezeframe.stats import Stats
from tests.helpers.toy_models import AttnSandwich, SillyModel


def config(**changes):
    base = dict(mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
                cudagraph_mode="none", use_cache=False)
    base.update(changes)
    return ff.CompilationConfig(**base)


class Recording:
    """A compiler that records what it was asked to compile and which entry each call ran."""

    name = "recording"

    def __init__(self):
        self.compiled = []   # (piece_index, range, example_inputs)
        self.ran = []        # range of the entry each call used

    def compile(self, graph, example_inputs, compile_range, piece_index):
        self.compiled.append((piece_index, compile_range, list(example_inputs)))
        ran = self.ran

        def run(*args):
            ran.append(compile_range)
            return graph(*args)

        return run


def _recorded(module, cfg):
    model = ff.compile(module, cfg)
    rec = Recording()
    model.manager.compiler = rec
    return model, rec


# -- entries and dispatch -------------------------------------------------------------------
def test_exact_size_wins_over_its_range():
    cfg = config(splitting_ops=None, compile_ranges_endpoints=[8, 32],
                 compile_sizes=[16, 64], max_num_tokens=128)
    model, rec = _recorded(AttnSandwich(), cfg)
    for n in (64, 1, 8, 9, 16, 17, 32, 33, 64, 128):
        x = torch.randn(n, 2)
        assert torch.equal(model(x), AttnSandwich()(x))
    assert [c[1] for c in rec.compiled] == [Range(1, 8), Range(9, 32), Range(33, 128),
                                            Range(16, 16), Range(64, 64)]
    assert rec.ran == [Range(64, 64), Range(1, 8), Range(1, 8), Range(9, 32), Range(16, 16),
                       Range(9, 32), Range(9, 32), Range(33, 128), Range(64, 64),
                       Range(33, 128)]
    assert model.stats.backend_compilations == 5


def test_ranges_compile_symbolic_and_sizes_static():
    cfg = config(splitting_ops=None, compile_ranges_endpoints=[8], compile_sizes=[16],
                 max_num_tokens=64)
    model, rec = _recorded(AttnSandwich(), cfg)
    model(torch.randn(20, 3))

    def symbolic(inputs):
        return any(isinstance(s, torch.SymInt) for t in inputs if isinstance(t, torch.Tensor)
                   for s in t.shape)

    kinds = {r: symbolic(inputs) for _, r, inputs in rec.compiled}
    assert kinds == {Range(1, 8): True, Range(9, 64): True, Range(16, 16): False}
    static = next(inputs for _, r, inputs in rec.compiled if r == Range(16, 16))
    assert [tuple(t.shape) for t in static if isinstance(t, torch.Tensor)] == [(16, 3)]
    assert all(type(t) is torch.Tensor for t in static if isinstance(t, torch.Tensor))


def test_every_capturable_piece_gets_every_entry():
    cfg = config(compile_ranges_endpoints=[4], compile_sizes=[2])
    model, rec = _recorded(SillyModel(), cfg)
    model(torch.randn(6))
    assert sorted((i, r.start, r.end) for i, r, _ in rec.compiled) == [
        (i, s, e) for i in (0, 2, 4) for s, e in ((1, 4), (2, 2), (5, 8192))]
    assert model.stats.backend_compilations == 9


def test_size_outside_every_range_is_a_clear_error():
    model = ff.compile(AttnSandwich(), config(splitting_ops=None, max_num_tokens=64))
    model(torch.randn(8, 2))
    with pytest.raises(ff.ShapeOutOfRangeError) as err:
        model(torch.randn(65, 2))
    msg = str(err.value)
    assert "65" in msg and "[1, 64]" in msg and "max_num_tokens" in msg
    assert "Raise max_num_tokens" in msg
    with pytest.raises(ff.ShapeOutOfRangeError, match="skip empty batches"):
        model(torch.randn(0, 2))


# -- a user's own splitting op ---------------------------------------------------------------
@torch.library.custom_op("ffuser::scale_rows", mutates_args=())
def _scale_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w.sum() + 1


@_scale_rows.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.lin1 = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin1(x))
        h = torch.ops.ffuser.scale_rows(h, self.lin2.weight)
        h = self.lin2(h).reshape(x.shape[0], 2, 4)          # uses the symbolic size
        h = torch.ops.ffuser.scale_rows(h, h[:1])
        return h.flatten(1) + torch.arange(x.shape[0]).unsqueeze(1)


@pytest.mark.parametrize("mode", ["piecewise", "dynamo_trace_once"])
def test_user_splitting_op_matches_eager_for_every_size(mode):
    max_tokens = 24
    cfg = config(mode=mode, splitting_ops=["ffuser::scale_rows"], max_num_tokens=max_tokens,
                 compile_ranges_endpoints=[8], compile_sizes=[4])
    eager = UserModel()
    model = ff.compile(UserModel(), cfg)
    model(torch.randn(max_tokens, 8))
    for n in range(1, max_tokens + 1):
        x = torch.randn(n, 8)
        assert torch.equal(model(x), eager(x)), n
    if mode == "piecewise":
        assert (len(model.pieces), sum(p.capturable for p in model.pieces)) == (5, 3)
        assert model.stats.backend_compilations == 3 * 3
    else:
        assert model.stats.backend_compilations == 1


# -- compilers and the manager ----------------------------------------------------------------
class _FakeCache:
    def __init__(self, hit):
        self.hit = hit
        self.saved = []

    def load(self, compiler, graph, example_inputs, compile_range, piece_index):
        return self.hit

    def recover(self, error):
        return False

    def save(self, compiler, graph, example_inputs, compile_range, piece_index, runnable):
        self.saved.append((piece_index, compile_range))


class _FailsOnce:
    """A compiler whose first compile fails, as one reading a damaged cache file does."""

    name = "flaky"

    def __init__(self):
        self.calls = 0

    def compile(self, graph, example_inputs, compile_range, piece_index):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("Failed to import /cache/inductor/ab/cab.py")
        return graph


class _Recovers(_FakeCache):
    def __init__(self, can):
        super().__init__(hit=None)
        self.can = can
        self.errors = []

    def recover(self, error):
        self.errors.append(str(error))
        return self.can


def test_manager_compiles_once_more_after_the_cache_recovered():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    compiler, cache = _FailsOnce(), _Recovers(can=True)
    assert CompilerManager(compiler, Stats(), cache=cache).compile(gm, [], Range(1, 8), 0) is gm
    assert compiler.calls == 2 and cache.errors == ["Failed to import /cache/inductor/ab/cab.py"]
    compiler, cache = _FailsOnce(), _Recovers(can=False)  # nothing repaired: the error stands
    with pytest.raises(CompileError, match="flaky failed to compile piece 0 for sizes"):
        CompilerManager(compiler, Stats(), cache=cache).compile(gm, [], Range(1, 8), 0)
    assert compiler.calls == 1


def test_manager_counts_cache_hits_as_backend_compilations():
    stats = Stats()
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    hit = CompilerManager(EagerCompiler(stats), stats, cache=_FakeCache(hit=len))
    assert hit.compile(gm, [], Range(1, 8), 0) is len
    assert stats.snapshot() == {"backend_compilations": 1}
    cache = _FakeCache(hit=None)
    miss = CompilerManager(EagerCompiler(stats), stats, cache=cache)
    compiled = miss.compile(gm, [], Range(1, 8), 3)  # the eager compiler: gm's own forward
    assert compiled.__self__ is gm and compiled.__func__ is type(gm).forward
    assert cache.saved == [(3, Range(1, 8))]
    assert stats.snapshot() == {"backend_compilations": 2, "eager_compiles": 1}


def test_compile_range_is_visible_only_during_compile():
    assert current_compile_range() is None


def test_unimportable_inductor_pass_is_a_config_error():
    cfg = config(backend="inductor", inductor_passes={"p": "no_such_module.fn"})
    with pytest.raises(ff.ConfigError, match=r"inductor_passes\['p'\]: cannot import"):
        ff.compile(AttnSandwich(), cfg)


def test_copy_inputs_uses_static_buffers():
    seen = []

    def fn(n, x, w):
        seen.append(x)
        return x * w

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    sym = mode.shape_env.create_unbacked_symint()
    fake_x = torch.empty_strided((sym, 3), (3, 1), device="meta")   # (n, 3), n symbolic
    with mode:
        fake_w = torch.empty(3)
    shim = _CopyInputs(fn, [sym, fake_x, fake_w], capacity=10)
    w = torch.ones(3)
    a = shim(2, torch.full((2, 3), 2.0), w)
    b = shim(5, torch.full((5, 3), 3.0), w)
    assert torch.equal(a, torch.full((2, 3), 2.0)) and torch.equal(b, torch.full((5, 3), 3.0))
    assert seen[0].data_ptr() == seen[1].data_ptr()     # one static buffer
    with pytest.raises(ff.ShapeOutOfRangeError, match="raise max_num_tokens"):
        shim(11, torch.ones(11, 3), w)


# -- real Inductor ---------------------------------------------------------------------------




class _AsksForARestart(_FailsOnce):
    """Raises Dynamo's restart signal, as Inductor's scalar tensorification does."""

    def compile(self, graph, example_inputs, compile_range, piece_index):
        self.calls += 1
        raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()


def test_dynamos_restart_signal_passes_through_unwrapped():
    """Wrapped in a CompileError, Dynamo cannot catch it to trace again (torch.compile(...,
    backend="freezeframe", dynamic=True) of an HF Llama failed that way)."""
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    compiler, cache = _AsksForARestart(), _Recovers(can=True)
    with pytest.raises(torch._dynamo.exc.TensorifyScalarRestartAnalysis):
        CompilerManager(compiler, Stats(), cache=cache).compile(gm, [], Range(1, 8), 0)
    assert compiler.calls == 1 and cache.errors == []  # not a damaged cache either
