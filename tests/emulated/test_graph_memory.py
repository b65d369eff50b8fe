"""Graph memory on the emulated backend: what a graph holds (exact bytes, counted by hand), the
prediction from a few measured sizes (runtime/graph_memory.py) on the reference models, and
GraphRunner's graph_memory_budget (refusal leaves nothing behind)."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

import freezeframe as ff
from freezeframe import CompilationConfig, CUDAGraphMode
from freezeframe.batch import BatchDescriptor
from freezeframe.errors import CaptureError, ConfigError, GraphMemoryBudgetError
from freezeframe.graphs.emulated import EmulatedBackend
from freezeframe.models import ATTENTION_OP, KVCacheConfig, LlamaModel, build_llama
from freezeframe.models.serving import llama_runner_inputs
from freezeframe.runtime import GraphRunner, Tokens
from freezeframe.runtime.graph_memory import (
    fit_linear,
    format_bytes,
    measurement_plan,
    predict_graph_memory,
)
from tests.helpers.toy_models import LlamaConfig, SillyModel, ToyLlama

FULL, PW = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE
F32 = 4  # bytes


# -- what one emulated graph holds ------------------------------------------------------------
def test_emulated_graph_counts_each_storage_it_allocated_once() -> None:
    x, w = torch.randn(4, 3), torch.randn(3, 5)

    def region() -> torch.Tensor:
        y = x @ w                      # new [4, 5]: 80 bytes
        y.add_(1)                      # in place: no new memory
        t = y.t()                      # a view of y: no new memory
        z = torch.relu(t)              # new [5, 4]: 80 bytes
        out = torch.empty(4, 5)        # allocated, written by an out= op: 80 bytes
        torch.mul(z.t(), 2, out=out)
        spare = torch.empty(7)         # allocated but held by nothing: not counted
        del spare
        return out.view(20)            # the output is a view of `out`: counted once

    graph, out = EmulatedBackend().capture(region)
    assert graph.memory_bytes == 3 * 4 * 5 * F32 == 240
    assert graph.ops == ["aten.mm.default", "aten.add_.Tensor", "aten.relu.default",
                         "aten.mul.out"]
    # the inputs and weights the graph reads existed before it: not its memory
    graph.replay()
    assert torch.equal(out, ((x @ w + 1).relu() * 2).view(20))


def test_emulated_graph_counts_an_allocated_output_nothing_writes_during_capture() -> None:
    x = torch.randn(6, 2)

    def region() -> tuple[torch.Tensor, torch.Tensor]:
        # a piece before a splitting op: the op fills `out` after the graph, the graph keeps it
        return x + 1, torch.empty(6, 8)

    graph, _ = EmulatedBackend().capture(region)
    assert graph.memory_bytes == (6 * 2 + 6 * 8) * F32 == 240


# -- what the runner reports, by hand -----------------------------------------------------------
def silly_config(graphs: str = "full_and_piecewise", **kw: Any) -> CompilationConfig:
    fields: dict[str, Any] = dict(
        mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
        cudagraph_mode=graphs, graph_backend="emulated", cudagraph_capture_sizes=[1, 2, 4, 8],
        max_num_tokens=8, max_num_seqs=8, use_cache=False)
    fields.update(kw)
    return CompilationConfig(**fields)


def silly_runner(graphs: str = "full_and_piecewise", **kw: Any
                 ) -> tuple[ff.compilation.CompiledModel, GraphRunner]:
    cfg = silly_config(graphs)
    model = ff.compile(SillyModel(), cfg)
    return model, GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False, **kw)


# SillyModel on [n, 3] float32 rows (12 bytes per token per tensor). Its FULL graph holds 11
# tensors: x+1, +2, the attention output buffer, attention's q+k and +v, -2, -1, the second
# buffer and its two adds, +1. Its three PIECEWISE graphs hold 7: (x+1, +2, buffer), (-2, -1,
# buffer), (+1); attention runs between them and its adds are in no graph.
SILLY_FULL_PER_TOKEN = 11 * 3 * F32  # 132
SILLY_PW_PER_TOKEN = 7 * 3 * F32     # 84


def test_runner_reports_each_graphs_exact_emulated_memory() -> None:
    model, runner = silly_runner()
    report = runner.capture()
    assert [(g.mode, g.descriptor.num_tokens, g.memory_bytes) for g in report.graphs] == (
        [(PW, n, SILLY_PW_PER_TOKEN * n) for n in (8, 4, 2, 1)]
        + [(FULL, n, SILLY_FULL_PER_TOKEN * n) for n in (8, 4, 2, 1)])
    assert report.memory_bytes == 15 * (84 + 132) == 3240
    assert sum(w.memory_bytes() for w in model.graph_wrappers()) == 3240
    # each emulated graph keeps its own tensors: the per-piece graphs of size 8
    assert sorted(w.graph_for(BatchDescriptor(8)).memory_bytes  # type: ignore[union-attr]
                  for w in model.graph_wrappers() if w.runtime_mode is PW) == [96, 288, 288]


def test_graphs_of_a_dropped_runner_are_freed() -> None:
    """Graphs are kept per owner (each runner its own), and an owner is held weakly: runners
    made, captured and dropped one after another on one model leave the graph memory of one
    runner, not of all of them. Two live runners hold twice that."""
    cfg = silly_config("full_and_piecewise")
    model = ff.compile(SillyModel(), cfg)

    def held() -> int:
        return sum(w.memory_bytes() for w in model.graph_wrappers())

    for _ in range(2):
        runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
        runner.capture()
        x = torch.ones(3, 3)
        assert torch.equal(runner(x), SillyModel()(x))
        del runner
        gc.collect()
        assert held() == 0  # the runner's graphs went with it
    first = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    second = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    first.capture()
    second.capture()
    assert held() == 2 * 3240
    assert (first.stats.foreign_graphs_dropped, second.stats.foreign_graphs_dropped) == (0, 0)
    # dropped without a collection (a runner sits in reference cycles): the next capture()
    # collects before it measures, so its report counts its own graphs only
    del first
    third = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    assert third.capture().memory_bytes == 3240
    assert held() == 2 * 3240


def test_without_a_budget_the_order_is_largest_first_and_predicted_after() -> None:
    _, runner = silly_runner()
    report = runner.capture()
    # predicted from sizes 1 (measured), 2 and 4 (the line) of each mode: exactly linear
    assert [(g.descriptor.num_tokens, g.predicted_bytes, g.probe) for g in report.graphs
            if g.mode is FULL] == [(8, 1056, False), (4, 528, True), (2, 264, True),
                                   (1, 132, True)]
    assert report.predicted_bytes == report.memory_bytes == 3240
    assert report.prediction_error == 0.0 and report.worst_graph_error == 0.0
    assert report.budget_bytes is None
    assert report.summary() == (
        f"captured 8 graphs (4 piecewise, 4 full) in {report.seconds:.2f} s, using 3.16 KiB "
        "of cpu memory; predicted 3.16 KiB (error +0.0%, worst graph 0.0%)")


def test_lazy_capture_adds_each_graphs_memory_to_the_report() -> None:
    _, runner = silly_runner("full", capture_policy="lazy", lazy_warmups=0)
    runner.capture()
    runner(torch.ones(3, 3))  # pads to 4
    runner(torch.ones(1, 3))
    assert [(g.descriptor.num_tokens, g.memory_bytes) for g in runner.report.graphs] == [
        (4, 528), (1, 132)]
    assert runner.report.memory_bytes == 660
    assert runner.report.prediction is None  # lazy capture predicts nothing


# -- the prediction on the reference models ----------------------------------------------------
def test_toy_llama_memory_is_linear_and_predicted_exactly() -> None:
    lc = LlamaConfig(hidden_size=32, mlp_size=64, vocab_size=64, num_layers=2)
    cfg = silly_config(cudagraph_capture_sizes=[1, 2, 4, 8, 16], max_num_tokens=16,
                       max_num_seqs=16)
    model = ff.compile(ToyLlama(lc), cfg)
    runner = GraphRunner(model, cfg, progress=False, graph_memory_budget=10**6, inputs={
        "input_ids": Tokens(dtype=torch.long, fill=0),
        "positions": Tokens(dtype=torch.long, fill=0)})
    report = runner.capture()
    # Floats per token, by hand (hidden 32, mlp 64). The embedding: 32. A layer: h+1 32, qkv 96,
    # positions as float 1, q+pos 32, k+pos 32, attention buffer 32, o_proj 32, +residual 32,
    # h+1 32, gate_up 128, relu 64, gate*relu 64, down 32 = 609, plus attention's q+k and +v
    # (64) in a FULL graph only; the second layer adds h+residual (32).
    full, pw = (32 + 673 + 705) * F32, (32 + 609 + 641) * F32
    assert (full, pw) == (5640, 5128)
    assert [(g.mode, g.descriptor.num_tokens, g.memory_bytes) for g in report.graphs] == [
        (PW, 1, pw), (PW, 2, 2 * pw), (PW, 4, 4 * pw), (FULL, 1, full), (FULL, 2, 2 * full),
        (FULL, 4, 4 * full),  # measured first (a budget), smallest first
        (PW, 16, 16 * pw), (PW, 8, 8 * pw), (FULL, 16, 16 * full), (FULL, 8, 8 * full)]
    assert [g.predicted_bytes for g in report.graphs] == [g.memory_bytes for g in report.graphs]
    assert report.prediction_error == 0.0
    assert [(f.mode, f.fit.intercept, f.fit.slope, f.fit.sizes)
            for f in report.prediction.fits] == [(PW, 0.0, pw, (2, 4)), (FULL, 0.0, full, (2, 4))]


def test_tiny_llama_prediction_error() -> None:
    cache = KVCacheConfig(num_blocks=32, block_size=4, max_model_len=32)
    model = build_llama("tiny", cache, seed=0)
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=[ATTENTION_OP],
        cudagraph_mode="full_and_piecewise", graph_backend="emulated",
        cudagraph_capture_sizes=[1, 2, 4, 8], max_num_tokens=8, max_num_seqs=8, use_cache=False)
    compiled = ff.compile(model, cfg, dynamic_arg_dims=dict(
        LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
    runner = GraphRunner(compiled, cfg, inputs=llama_runner_inputs(model, 8), progress=False,
                         graph_memory_budget=2**30)
    report = runner.capture()
    graphs = {(g.mode, g.descriptor.num_tokens): g for g in report.graphs}
    # PIECEWISE: about 11956 bytes per token (the attention op rotates q and k itself, so no
    # piece keeps a rotated copy); measured, a few bytes off the line at one token. The first
    # piece holds the step's token layout, whose tokens-by-requests comparison grows a little
    # faster than the tokens while the requests grow with them
    assert [graphs[PW, n].memory_bytes for n in (1, 2, 4, 8)] == [11954, 23904, 47816, 95688]
    pw8 = graphs[PW, 8]
    assert pw8.predicted_bytes == 95640 and not pw8.probe  # 48 bytes (0.05%) under
    # FULL (decode keys, attention inside): the one predicted graph within 0.05%
    full8 = graphs[FULL, 8]
    assert not full8.probe and full8.predicted_bytes is not None
    assert abs(full8.predicted_bytes - full8.memory_bytes) / full8.memory_bytes < 5e-4
    assert report.prediction_error is not None and abs(report.prediction_error) < 2e-4
    # the total counts measured sizes as measured, and predicts the two sizes not measured
    assert report.predicted_bytes == report.memory_bytes - full8.memory_bytes \
        + full8.predicted_bytes - pw8.memory_bytes + pw8.predicted_bytes


# -- the budget -------------------------------------------------------------------------------
def test_over_budget_refuses_names_the_prediction_and_leaves_nothing_behind(
        caplog: pytest.LogCaptureFixture) -> None:
    model, runner = silly_runner(graph_memory_budget=3239)
    frozen = gc.get_freeze_count()
    with pytest.raises(GraphMemoryBudgetError) as err:
        runner.capture()
    assert isinstance(err.value, CaptureError)
    assert str(err.value) == (
        "graph_memory_budget=3239 bytes (3.16 KiB): capturing the 8 graphs of capture sizes "
        "[1, 2, 4, 8] is predicted to need 3240 bytes (3.16 KiB, summed over graphs), from the "
        "6 smallest graphs, captured and measured first. Largest: FULL 8 tokens, 8 reqs, "
        "decode: 1.03 KiB; PIECEWISE 8 tokens: 672 B; FULL 4 tokens, 4 reqs, decode: 528 B. "
        "Nothing was kept (the measured graphs were freed). Fix: capture fewer or smaller sizes "
        "(cudagraph_capture_sizes, max_cudagraph_capture_size), choose sizes under the budget "
        "with `freezeframe plan`, or raise graph_memory_budget")
    # the 6 probes were captured (3 pieces x 3 sizes + 3 FULL graphs), then all freed
    assert model.stats.graphs_captured == 12
    assert all(w.captured_descriptors == [] and w.memory_bytes() == 0
               for w in model.graph_wrappers())
    assert runner.report is None and not runner.captured
    assert not model.capture_window.is_open
    assert gc.get_freeze_count() == frozen and gc.isenabled()
    assert runner.stats.capture_failures == 1
    # until a capture succeeds, steps run without graphs (they would otherwise reach the closed
    # capture window), counted and logged
    x = torch.arange(9.0).reshape(3, 3)
    with caplog.at_level(logging.WARNING, logger="freezeframe.runtime.runner"), \
            runner.stats.expect(fallback_capture_failed=2, steps_eager=2, steps_full=0), \
            model.stats.expect(graphs_captured=0):
        assert torch.equal(runner(x, uniform_decode=True), SillyModel()(x))
        assert torch.equal(runner(x), SillyModel()(x))
    assert "failed earlier (the error was raised then)" in caplog.text
    # a later capture with a budget that fits captures everything
    runner.graph_memory_budget = 3240
    report = runner.capture()
    assert (report.num_graphs, report.memory_bytes, report.budget_bytes) == (8, 3240, 3240)
    assert report.summary().endswith("(error +0.0%, worst graph 0.0%), budget 3.16 KiB")
    x = torch.arange(9.0).reshape(3, 3)
    with runner.stats.expect(steps_full=1):
        assert torch.equal(runner(x, uniform_decode=True), SillyModel()(x))


def test_budget_captures_the_measured_sizes_first() -> None:
    _, runner = silly_runner(graph_memory_budget=10**6)
    report = runner.capture()
    assert [(g.mode, g.descriptor.num_tokens, g.probe) for g in report.graphs] == [
        (PW, 1, True), (PW, 2, True), (PW, 4, True), (FULL, 1, True), (FULL, 2, True),
        (FULL, 4, True), (PW, 8, False), (FULL, 8, False)]


@pytest.mark.parametrize("policy", ["lazy", "background"])
def test_budget_with_lazy_or_background_capture_is_refused(policy: str) -> None:
    with pytest.raises(ConfigError, match=(
            f"graph_memory_budget=1000 with capture_policy='{policy}': the budget is checked "
            "by capture\\(\\) before it captures every size")):
        silly_runner(graph_memory_budget=1000, capture_policy=policy)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1GiB"])
def test_budget_must_be_a_byte_count(bad: Any) -> None:
    with pytest.raises(ConfigError, match=(
            f"graph_memory_budget: expected a number of bytes \\(an int >= 0\\) or None, got "
            f"{bad!r}")):
        silly_runner(graph_memory_budget=bad)


def test_refusal_is_logged_as_a_failed_capture(caplog: pytest.LogCaptureFixture) -> None:
    _, runner = silly_runner(graph_memory_budget=0)
    caplog.set_level(logging.WARNING, logger="freezeframe.runtime.runner")
    with pytest.raises(GraphMemoryBudgetError, match="predicted to need 3240 bytes"):
        runner.capture()
    assert [r.getMessage() for r in caplog.records] == [
        "GraphRunner.capture failed; its graphs were freed, and capture() may be called again"]


# -- the prediction itself --------------------------------------------------------------------
def test_fit_linear_is_least_squares_and_clamped() -> None:
    fit = fit_linear([(2, 110), (4, 210), (8, 410)])
    assert (fit.intercept, fit.slope, fit.sizes) == (10.0, 50.0, (2, 4, 8))
    assert fit.at(16) == 810
    noisy = fit_linear([(1, 0), (2, 2), (3, 1)])  # slope 0.5, intercept 0
    assert (noisy.intercept, noisy.slope) == pytest.approx((0.0, 0.5))
    falling = fit_linear([(2, 100), (4, 50)])
    assert falling.at(16) == 0  # never negative
    one = fit_linear([(4, 400)])  # one size: proportional to tokens
    assert (one.intercept, one.slope, one.at(32)) == (0.0, 100.0, 3200)
    with pytest.raises(ValueError, match="at least one"):
        fit_linear([])


def key(mode: CUDAGraphMode, n: int, uniform: bool = False, lora: int = 0
        ) -> tuple[CUDAGraphMode, BatchDescriptor]:
    reqs = None if mode is PW else n
    return mode, BatchDescriptor(n, reqs, uniform, has_lora=lora > 0, num_active_loras=lora)


def test_measurement_plan_takes_size_one_and_two_more_per_family() -> None:
    keys = [key(PW, n) for n in (16, 8, 4, 2, 1)] + [key(FULL, n, True) for n in (8, 4)] + [
        key(FULL, n, False) for n in (16, 8, 1)] + [key(PW, n, lora=2) for n in (16, 8)]
    assert measurement_plan(keys) == [key(PW, 1), key(PW, 2), key(PW, 4), key(FULL, 4, True),
                                      key(FULL, 8, True), key(FULL, 1), key(FULL, 8),
                                      key(FULL, 16), key(PW, 8, lora=2), key(PW, 16, lora=2)]
    with pytest.raises(ConfigError, match="per_family: expected an int >= 1, got 0"):
        measurement_plan(keys, per_family=0)


def test_prediction_sums_or_pools_and_fits_each_family() -> None:
    keys = [key(PW, n) for n in (32, 16, 4, 2, 1)] + [key(FULL, n, True) for n in (8, 2, 1)]
    measured = {key(PW, 1): 90, key(PW, 2): 200, key(PW, 4): 400,
                key(FULL, 1, True): 1000, key(FULL, 2, True): 2000}
    summed = predict_graph_memory(keys, measured)
    # PW: fitted on 2 and 4 only (100 per token); size one kept as measured (90)
    assert [(s.descriptor.num_tokens, s.predicted_bytes, s.measured_bytes)
            for s in summed.sizes] == [(32, 3200, None), (16, 1600, None), (4, 400, 400),
                                       (2, 200, 200), (1, 100, 90), (8, 8000, None),
                                       (2, 2000, 2000), (1, 1000, 1000)]
    assert summed.total_bytes == 3200 + 1600 + 400 + 200 + 90 + 8000 + 2000 + 1000
    assert [s.descriptor.num_tokens for s in summed.largest(2)] == [8, 32]
    pooled = predict_graph_memory(keys, measured, pooled=True, per_graph_overhead_bytes=64)
    assert pooled.total_bytes == 8000 + 7 * 64
    assert pooled.for_key(*key(PW, 16)).expected_bytes == 1600
    assert pooled.describe(1) == (
        "8.25 KiB predicted for 8 graphs (one shared pool: the largest graph plus 64 B per "
        "other graph); largest: FULL 8 tokens, 8 reqs, decode: 7.81 KiB")
    assert summed.mib_by_size() == {1: 1090 / 2**20, 2: 2200 / 2**20, 4: 400 / 2**20,
                                    8: 8000 / 2**20, 16: 1600 / 2**20, 32: 3200 / 2**20}
    # a family with nothing measured borrows its mode's line
    borrowed = predict_graph_memory([key(PW, 8, lora=1)], {key(PW, 2): 200, key(PW, 4): 400})
    assert borrowed.sizes[0].predicted_bytes == 800
    with pytest.raises(KeyError, match="no prediction for the FULL graph"):
        summed.for_key(*key(FULL, 4, True))


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (84, 1024, 3240, 5 * 2**20, 3 * 2**30)] == [
        "84 B", "1.00 KiB", "3.16 KiB", "5.00 MiB", "3.00 GiB"]
