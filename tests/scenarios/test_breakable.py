"""Breakable PIECEWISE graphs (mode NONE and STOCK_TORCH_COMPILE): graphs without a trace, on
every graph backend present (the ``rig`` fixture).

The forward runs as written; the capture breaks at ``silly::attention`` (a splitting op) and at
``@ff.graph_break`` functions, which run eagerly between graph segments on every replay. The
counting op proves what ran outside the graphs; every output is compared with eager.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.compilation import CompiledModel
from freezeframe.config import CUDAGraphMode
from freezeframe.context import forward_context
from freezeframe.errors import CaptureError, ConfigError
from freezeframe.graphs.breakable import BreakableGraph
from freezeframe.models import ATTENTION_OP, KVCacheConfig, LlamaModel, build_llama
from freezeframe.models.serving import (
    Request,
    RunnerForward,
    ServingDriver,
    llama_runner_inputs,
)
from freezeframe.runtime import Tokens
from tests.helpers import silly
from tests.helpers.toy_models import SillyModel
from tests.scenarios.conftest import Rig

PW = CUDAGraphMode.PIECEWISE
NONE = CUDAGraphMode.NONE


def breakable_config(rig: Rig, mode: str = "none", cudagraph_mode: str = "piecewise",
                     **changes: Any) -> ff.CompilationConfig:
    return rig.config(cudagraph_mode, mode=mode, **changes)


def run(model: Any, mode: CUDAGraphMode, desc: int | BatchDescriptor | None,
        *args: torch.Tensor) -> Any:
    with forward_context(desc, mode=mode):
        return model(*args)


def graph_of(model: CompiledModel, size: int) -> BreakableGraph:
    wrapper = next(w for w in model.graph_wrappers() if w.runtime_mode is PW)
    graph = wrapper.graph_for(BatchDescriptor(size))
    assert isinstance(graph, BreakableGraph)
    return graph


# -- the silly model: no trace, breaks at the splitting op ----------------------------------
@pytest.mark.parametrize("mode", ["none", "stock_torch_compile"])
def test_silly_model_breaks_at_attention_and_replays_the_eager_answer(rig: Rig,
                                                                       mode: str) -> None:
    model = ff.compile(SillyModel().to(rig.device), breakable_config(rig, mode))
    buf = rig.zeros(8)
    silly.reset_counter()
    for size in (2, 1):
        buf[:size].copy_(rig.randn(size))
        run(model, PW, size, buf[:size])  # captures (the wrapper warms up 0 times)
        run(model, PW, size, buf[:size])  # replays
    assert model.stats.graphs_captured == 2
    assert silly.get_counter() == 8  # 2 attentions x (capture + replay) x 2 sizes
    graph = graph_of(model, 2)
    assert graph.num_segments == 3
    assert len(graph.breaks) == 2
    for size in (1, 2):
        x = rig.randn(size)
        buf[:size].copy_(x)
        before = silly.get_counter()
        out = rig.host(run(model, PW, size, buf[:size]))
        assert silly.get_counter() == before + 2  # the breaks ran eagerly on the replay
        torch.testing.assert_close(out, rig.host(9 * x + 19))
    assert model.stats.replays == 4


def test_a_break_that_returns_a_new_tensor_is_copied_into_the_captured_one(rig: Rig) -> None:
    class Functional(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            h = silly.attention(h, h, h)  # returns a tensor it allocated (not an out= arg)
            return h + 1

    model = ff.compile(Functional().to(rig.device), breakable_config(rig))
    buf = rig.zeros(4)
    buf[:2].copy_(rig.randn(2))
    run(model, PW, 2, buf[:2])  # captures
    for _ in range(3):
        x = rig.randn(2)
        buf[:2].copy_(x)
        torch.testing.assert_close(rig.host(run(model, PW, 2, buf[:2])), rig.host(6 * x + 1))


# -- @ff.graph_break --------------------------------------------------------------------------
CALLS: list[int] = []


@ff.graph_break
def data_dependent_scale(h: torch.Tensor) -> torch.Tensor:
    """Python that no graph can hold (a value read back to the host), run eagerly."""
    CALLS.append(1)
    peak = float(h.abs().max().item())
    return h / (peak + 1.0)


class WithDecoratedBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 4)
        self.down = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = silly.attention(h, h, h)
        h = data_dependent_scale(h)
        return self.down(h).relu()


@pytest.mark.parametrize("mode", ["none", "stock_torch_compile"])
def test_a_graph_break_function_runs_eagerly_on_every_replay(rig: Rig, mode: str) -> None:
    torch.manual_seed(0)
    module = WithDecoratedBreak().to(rig.device)
    cfg = breakable_config(rig, mode, cudagraph_capture_sizes=[1, 2, 4])
    model = ff.compile(module, cfg)
    runner = ff.GraphRunner(model, cfg, inputs={"x": Tokens(4)}, progress=False, strict=True)
    report = runner.capture()
    assert [(g.segments, g.breaks) for g in report.graphs] == [
        (3, ("silly::attention", "@graph_break data_dependent_scale"))] * 3
    CALLS.clear()
    for n in (1, 3, 4, 2):
        x = rig.randn(n, 4)
        got = rig.host(runner(x))
        with torch.no_grad():
            want = rig.host(module(x))
        torch.testing.assert_close(got, want)
    assert len(CALLS) == 8  # one per replay, one per eager reference call
    assert runner.stats.steps_piecewise == 4


def test_outside_a_capture_a_graph_break_function_is_the_function() -> None:
    CALLS.clear()
    h = torch.tensor([1.0, -3.0])
    torch.testing.assert_close(data_dependent_scale(h), h / 4.0)
    assert CALLS == [1]


# -- safety: host syncs inside a segment -------------------------------------------------------
class SyncsInForward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + 1
        if h.sum() > 0:  # bool(tensor) inside the captured region
            h = h * 2
        return silly.attention(h, h, h)


def test_a_host_sync_inside_a_segment_is_refused_with_the_line_and_the_fix(rig: Rig) -> None:
    model = ff.compile(SyncsInForward().to(rig.device), breakable_config(rig))
    buf = rig.zeros(4)
    buf.copy_(rig.randn(4).abs())
    model.module(buf[:2])  # eagerly the read is allowed
    with pytest.raises(CaptureError) as exc:
        run(model, PW, 2, buf[:2])
    text = str(exc.value)
    assert "bool(tensor)" in text
    assert "test_breakable.py" in text and "in forward" in text
    assert "@ff.graph_break" in text and "splitting_ops" in text
    assert model.stats.graphs_captured == 0


@pytest.mark.parametrize("sync", ["item", "tolist", "print"])
def test_every_kind_of_host_read_is_refused_on_every_backend(rig: Rig, sync: str) -> None:
    class Reads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if sync == "item":
                x.sum().item()
            elif sync == "tolist":
                x.tolist()
            else:
                print(x)
            return silly.attention(x, x, x)

    model = ff.compile(Reads().to(rig.device), breakable_config(rig))
    buf = rig.zeros(2)
    with pytest.raises(CaptureError, match="back to the host"):
        run(model, PW, 2, buf)


# -- the runner, every size of the ladder, a forward Dynamo cannot trace ----------------------
class DynamoBreaks(nn.Module):
    """A forward that does not trace as one graph: ff.compile's PIECEWISE mode refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).tanh()
        torch._dynamo.graph_break()  # (e.g. third-party Python Dynamo does not support)
        h = silly.attention(h, h, h)
        return self.b(h)


@pytest.mark.parametrize("mode", ["none", "stock_torch_compile"])
def test_a_model_dynamo_cannot_trace_is_served_at_every_size_of_the_ladder(rig: Rig,
                                                                          mode: str) -> None:
    torch.manual_seed(1)
    module = DynamoBreaks().to(rig.device)
    cfg = breakable_config(rig, mode, cudagraph_capture_sizes=None,
                           max_cudagraph_capture_size=64, max_num_tokens=64)
    model = ff.compile(module, cfg)
    runner = ff.GraphRunner(model, cfg, inputs={"x": Tokens(8)}, progress=False, strict=True)
    report = runner.capture()
    sizes = list(cfg.cudagraph_capture_sizes)
    assert sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert report.num_graphs == len(sizes)
    for n in range(1, 65):
        x = rig.randn(n, 8)
        got = rig.host(runner(x))
        with torch.no_grad():
            want = rig.host(module(x))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert runner.stats.steps_piecewise == 64
    assert runner.stats.fallback_too_large == 0


def test_piecewise_mode_refuses_that_model_and_names_mode_none(rig: Rig) -> None:
    model = ff.compile(DynamoBreaks().to(rig.device), rig.config("piecewise"))
    with pytest.raises(ff.CompileError, match="cannot be traced as one graph"):
        model(rig.randn(2, 8))


# -- FULL and breakable PIECEWISE together ------------------------------------------------------
def test_full_and_piecewise_serves_decode_from_full_and_the_rest_breakable(rig: Rig) -> None:
    torch.manual_seed(2)
    module = WithDecoratedBreak().to(rig.device)

    class Plain(nn.Module):  # FULL graphs hold the attention too: no Python break inside
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inner.up(x)
            h = silly.attention(h, h, h)
            return self.inner.down(h).relu()

    plain = Plain()
    cfg = breakable_config(rig, "none", "full_and_piecewise", cudagraph_capture_sizes=[1, 2, 4],
                           max_num_seqs=4)
    model = ff.compile(plain, cfg)
    runner = ff.GraphRunner(model, cfg, inputs={"x": Tokens(4)}, progress=False, strict=True)
    report = runner.capture()
    assert (report.count(CUDAGraphMode.PIECEWISE), report.count(CUDAGraphMode.FULL)) == (3, 3)
    for n, uniform in ((1, True), (3, False), (4, True), (2, False)):
        x = rig.randn(n, 4)
        got = rig.host(runner(x, uniform_decode=uniform))
        with torch.no_grad():
            want = rig.host(plain(x))
        torch.testing.assert_close(got, want)
    assert (runner.stats.steps_full, runner.stats.steps_piecewise) == (2, 2)


# -- the reference Llama, served -----------------------------------------------------------------
CACHE = KVCacheConfig(num_blocks=64, block_size=4, max_model_len=48)
REQUESTS = [
    Request("a", (1, 2, 3, 4, 5), max_new_tokens=6),
    Request("b", (9,) * 11, max_new_tokens=4, arrival_step=1),
    Request("c", (7, 8), max_new_tokens=8, arrival_step=2),
]


@pytest.mark.parametrize("mode", ["none", "stock_torch_compile"])
def test_the_reference_llama_is_served_with_breakable_graphs(rig: Rig, mode: str) -> None:
    model = build_llama("tiny", CACHE, seed=0, init_std=0.3, device=rig.device)
    eager = ServingDriver(model, max_num_seqs=4, max_num_batched_tokens=16).run(REQUESTS)
    cfg = ff.CompilationConfig(
        mode=mode, backend="eager", splitting_ops=[ATTENTION_OP], cudagraph_mode="piecewise",
        cudagraph_capture_sizes=[1, 2, 4, 8, 16], graph_backend=rig.backend, max_num_seqs=4,
        max_num_tokens=16, use_cache=False)
    compiled = ff.compile(model, cfg, dynamic_arg_dims=dict(LlamaModel.DYNAMIC_ARG_DIMS,
                                                           seq_lens=0, block_tables=0))
    runner = ff.GraphRunner(compiled, cfg, inputs=llama_runner_inputs(model, 4),
                            progress=False, strict=True)
    report = runner.capture()
    layers = len(model.layers)
    assert {(g.segments, len(g.breaks)) for g in report.graphs} == {(layers + 1, layers)}
    served = ServingDriver(model, RunnerForward(runner, 4), max_num_seqs=4,
                           max_num_batched_tokens=16).run(REQUESTS)
    assert served.outputs == eager.outputs
    for got, want in zip(served.step_logits, eager.step_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert runner.stats.steps_piecewise == eager.num_steps


# -- the config ----------------------------------------------------------------------------------
def test_breakable_configs_resolve_and_trace_once_piecewise_is_still_refused() -> None:
    cfg = ff.CompilationConfig(mode="none", cudagraph_mode="piecewise",
                               splitting_ops=["silly::attention"])
    assert (cfg.cudagraph_mode, cfg.splitting_ops) == (PW, ("silly::attention",))
    cfg = ff.CompilationConfig(mode="stock_torch_compile", cudagraph_mode="full_and_piecewise")
    assert cfg.cudagraph_mode is CUDAGraphMode.FULL_AND_PIECEWISE
    with pytest.raises(ConfigError, match="mode='none' for graphs that break"):
        ff.CompilationConfig(mode="dynamo_trace_once", cudagraph_mode="piecewise")


def test_a_misspelt_splitting_op_is_refused_at_compile_time(rig: Rig) -> None:
    with pytest.raises(ConfigError, match="silly::attention"):
        ff.compile(SillyModel(), breakable_config(rig, splitting_ops=["silly::atention"]))


def test_without_graphs_mode_none_is_the_module() -> None:
    model = ff.compile(SillyModel(), ff.CompilationConfig(mode="none"))
    assert model.graph_wrappers() == []
    torch.testing.assert_close(model(torch.zeros(3)), torch.full((3,), 19.0))


# -- everywhere graphs are: lazy capture, verify mode, replaced weights ------------------------
def test_lazy_capture_and_verify_mode_cover_breakable_graphs(rig: Rig) -> None:
    torch.manual_seed(3)
    module = WithDecoratedBreak().to(rig.device)
    cfg = breakable_config(rig, cudagraph_capture_sizes=[1, 2, 4])
    runner = ff.GraphRunner(ff.compile(module, cfg), cfg, inputs={"x": Tokens(4)},
                            progress=False, capture_policy="lazy", lazy_warmups=1, verify=2)
    runner.capture()
    for n in (3, 3, 3, 1, 1, 1):
        x = rig.randn(n, 4)
        got = rig.host(runner(x))
        with torch.no_grad():
            torch.testing.assert_close(got, rig.host(module(x)))
    assert runner.stats.captures == 2  # sizes 4 and 1, each on its second step
    assert (runner.stats.verified_steps, runner.stats.verify_mismatches) == (4, 0)


OFFSET = [0.0]


class ReadsAPythonGlobal(nn.Module):
    """A value read in Python is frozen into the graph: the failure a missing break causes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silly.attention(x, x, x) + OFFSET[0]


def test_verify_mode_catches_python_a_graph_froze(rig: Rig) -> None:
    cfg = breakable_config(rig, cudagraph_capture_sizes=[2])
    module = ReadsAPythonGlobal().to(rig.device)
    runner = ff.GraphRunner(ff.compile(module, cfg), cfg, inputs={"x": Tokens()},
                            progress=False, verify=3)
    runner.capture()
    OFFSET[0] = 0.0
    runner(rig.randn(2))  # as captured: agrees with eager
    OFFSET[0] = 5.0
    try:
        with pytest.raises(ff.errors.VerifyError, match="differs from eager"):
            runner(rig.randn(2))
    finally:
        OFFSET[0] = 0.0
    assert runner.stats.verify_mismatches == 1


def test_replaced_weights_drop_breakable_graphs_and_they_are_captured_again(rig: Rig) -> None:
    torch.manual_seed(4)
    module = WithDecoratedBreak().to(rig.device)
    cfg = breakable_config(rig, cudagraph_capture_sizes=[2, 4])
    model = ff.compile(module, cfg)
    runner = ff.GraphRunner(model, cfg, inputs={"x": Tokens(4)}, progress=False)
    runner.capture()
    x = rig.randn(2, 4)
    runner(x)
    with torch.no_grad():
        module.down.weight = nn.Parameter(torch.randn(4, 4, device=rig.device))
    got = rig.host(runner(x))
    with torch.no_grad():
        torch.testing.assert_close(got, rig.host(module(x)))
    assert model.stats.graphs_dropped_weights == 1
    assert runner.stats.recaptures == 1
