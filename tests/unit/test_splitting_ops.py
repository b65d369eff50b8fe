"""Splitting-op names are checked against torch's op registry: a name that resolves to no
registered op is a ConfigError at ``ff.compile`` (naming the closest registered names); a
registered op the trace never calls is a warning, counted once per op in
``stats.splitting_ops_unused``."""

from __future__ import annotations

import logging

import pytest
import torch

import freezeframe as ff


@torch.library.custom_op("ffsplitops::attention", mutates_args=("out",))
def _attention(q: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q.softmax(-1))


@_attention.register_fake
def _(q: torch.Tensor, out: torch.Tensor) -> None:
    return None


@torch.library.custom_op("ffsplitops::gate", mutates_args=())
def _gate(x: torch.Tensor) -> torch.Tensor:
    return x.sigmoid()


@_gate.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _Block(torch.nn.Module):
    """linear -> ffsplitops::attention -> linear; never calls ffsplitops::gate."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 8)
        self.down = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.up(x)
        out = torch.empty_like(q)
        torch.ops.ffsplitops.attention(q, out)
        return self.down(out)


def _config(*ops: str) -> ff.CompilationConfig:
    return ff.CompilationConfig(mode="piecewise", backend="eager", splitting_ops=list(ops),
                                cudagraph_mode="none", use_cache=False)


def _run(model: torch.nn.Module, module: torch.nn.Module, n: int = 3) -> None:
    x = torch.randn(n, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), module(x))


# -- names that resolve to no registered op ---------------------------------------------------
def test_misspelled_op_is_a_config_error_naming_the_closest_op() -> None:
    with pytest.raises(ff.ConfigError) as info:
        ff.compile(_Block(), _config("ffsplitops::atn"), dynamic_arg_dims={"x": 0})
    assert str(info.value) == (
        "splitting_ops: 'ffsplitops::atn' is not a registered op; did you mean "
        "'ffsplitops::attention' or 'ffsplitops::gate'? (ops registered in namespace "
        "'ffsplitops': attention, gate). Fix the name, or import the module that registers the "
        "op (torch.library.custom_op or Library.define) before ff.compile")


def test_unknown_namespace_names_the_closest_namespace_and_op() -> None:
    with pytest.raises(ff.ConfigError) as info:
        ff.compile(_Block(), _config("ffsplitop::attention"), dynamic_arg_dims={"x": 0})
    message = str(info.value)
    assert message.startswith("splitting_ops: 'ffsplitop::attention': no op is registered in "
                              "namespace 'ffsplitop'; did you mean 'ffsplitops::attention'?")
    assert "closest namespaces: 'ffsplitops'" in message


def test_unknown_overload_lists_the_overloads() -> None:
    with pytest.raises(ff.ConfigError) as info:
        ff.compile(_Block(), _config("ffsplitops::attention.fast"), dynamic_arg_dims={"x": 0})
    assert str(info.value).startswith(
        "splitting_ops: 'ffsplitops::attention.fast': op 'ffsplitops::attention' has no "
        "overload 'fast'; its overloads are ['default']")


def test_dotted_spelling_is_checked_too() -> None:
    # vLLM's "ns.op" form is rewritten to "ns::op" by the config, then checked the same way.
    with pytest.raises(ff.ConfigError, match=r"'ffsplitops::atn' is not a registered op; did "
                                             r"you mean 'ffsplitops::attention' or"):
        ff.compile(_Block(), _config("ffsplitops.atn"), dynamic_arg_dims={"x": 0})


def test_every_bad_name_is_reported_at_once() -> None:
    with pytest.raises(ff.ConfigError) as info:
        ff.compile(_Block(), _config("ffsplitops::atn", "ffsplitops::gat"),
                   dynamic_arg_dims={"x": 0})
    message = str(info.value)
    assert message.startswith(
        "splitting_ops: 'ffsplitops::atn' is not a registered op; did you mean "
        "'ffsplitops::attention' or 'ffsplitops::gate'? (ops registered in namespace "
        "'ffsplitops': attention, gate); 'ffsplitops::gat' is not a registered op; did you mean "
        "'ffsplitops::gate'? (ops registered in namespace 'ffsplitops': attention, gate). Fix "
        "the name")


def test_valid_spellings_split_the_model() -> None:
    for name in ("ffsplitops::attention", "ffsplitops.attention"):
        module = _Block().eval()
        model = ff.compile(module, _config(name), dynamic_arg_dims={"x": 0})
        _run(model, module)
        assert [p.is_splitting_op for p in model.pieces] == [False, True, False]
        assert model.stats.splitting_ops_unused == 0


def test_op_registered_after_the_config_but_before_compile_is_accepted() -> None:
    cfg = _config("ffsplitops_late::attention", "ffsplitops::attention")
    lib = torch.library.Library("ffsplitops_late", "DEF")
    try:
        lib.define("attention(Tensor x) -> Tensor")
        module = _Block().eval()
        model = ff.compile(module, cfg, dynamic_arg_dims={"x": 0})
        _run(model, module)
        # registered but never called by the model
        assert model.stats.splitting_ops_unused == 1
    finally:
        lib._destroy()


def test_no_check_when_the_graph_is_not_split() -> None:
    # Splitting ops only matter in mode PIECEWISE; other modes never split.
    cfg = ff.CompilationConfig(mode="dynamo_trace_once", backend="eager",
                               splitting_ops=["ffsplitops::atn"], use_cache=False)
    module = _Block().eval()
    model = ff.compile(module, cfg, dynamic_arg_dims={"x": 0})
    _run(model, module)
    assert model.stats.splitting_ops_unused == 0


# -- registered ops the trace never calls --------------------------------------------------------
def test_op_missing_from_the_trace_warns_and_counts_once(
        ff_logs: pytest.LogCaptureFixture) -> None:
    module = _Block().eval()
    model = ff.compile(module, _config("ffsplitops::attention", "ffsplitops::gate"),
                       dynamic_arg_dims={"x": 0})
    for n in (3, 5, 2):
        _run(model, module, n)
    assert model.stats.splitting_ops_unused == 1
    warnings = [r.getMessage() for r in ff_logs.records if r.levelno == logging.WARNING]
    assert warnings == [
        "tests.unit.test_splitting_ops._Block: splitting op 'ffsplitops::gate' never appears "
        "in the traced graph, so nothing is split at it; check that forward calls "
        "torch.ops.ffsplitops.gate, or remove it from splitting_ops"]
    assert [p.is_splitting_op for p in model.pieces] == [False, True, False]


def test_overload_name_that_the_trace_does_not_call_says_why(
        ff_logs: pytest.LogCaptureFixture) -> None:
    # Dynamo records the packet (torch.ops.ns.op), which an overload-specific name never matches.
    module = _Block().eval()
    model = ff.compile(module, _config("ffsplitops::attention.default"),
                       dynamic_arg_dims={"x": 0})
    _run(model, module)
    assert model.stats.splitting_ops_unused == 1
    assert len(model.pieces) == 1
    warnings = [r.getMessage() for r in ff_logs.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].endswith(
        "an overload-specific name matches only calls of that overload "
        "(torch.ops.ffsplitops.attention.default(...)); write 'ffsplitops::attention' to match "
        "every call of the op")


def test_two_unused_ops_count_two(ff_logs: pytest.LogCaptureFixture) -> None:
    lib = torch.library.Library("ffsplitops_two", "DEF")
    try:
        lib.define("a(Tensor x) -> Tensor")
        lib.define("b(Tensor x) -> Tensor")
        module = _Block().eval()
        model = ff.compile(module, _config("ffsplitops_two::a", "ffsplitops::attention",
                                           "ffsplitops_two::b"), dynamic_arg_dims={"x": 0})
        _run(model, module)
        assert model.stats.splitting_ops_unused == 2
        warned = [r.getMessage().split("'")[1] for r in ff_logs.records
                  if r.levelno == logging.WARNING]
        assert warned == ["ffsplitops_two::a", "ffsplitops_two::b"]
    finally:
        lib._destroy()
