"""GraphRunner end to end: every graph mode at every size equals eager, capture (its report, its
order, warm-ups, the closed window, the frozen garbage collector, graphs captured elsewhere or by
earlier steps), the lifetime of replayed outputs, the forward context a step runs in, and eager
fallbacks counted by reason (and raised in strict mode). Every scenario runs on every graph
backend present (the ``rig`` fixture)."""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import BatchDescriptor, CompilationConfig, CUDAGraphMode
from freezeframe.context import get_forward_context
from freezeframe.errors import CaptureError, ConfigError, FallbackError
from freezeframe.runtime import GraphRunner, Requests, Tokens
from tests.helpers.silly import attention, get_counter, reset_counter
from tests.helpers.toy_models import SillyModel
from tests.scenarios.conftest import Rig
from tests.scenarios.runners import MAX_TOKENS, SIZES, config, same, silly_runner

NONE, PW, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


# -- every mode, every size ------------------------------------------------------------------
# mode -> (graphs the runner captures, graphs the model's wrappers capture: 3 capturable pieces)
CAPTURES = {
    "none": (0, 0),
    "piecewise": (4, 12),
    "full": (4, 4),
    "full_decode_only": (4, 4),
    "full_and_piecewise": (8, 16),
}


@pytest.mark.parametrize("mode", list(CAPTURES))
def test_every_mode_matches_eager_for_every_size(rig: Rig, mode: str) -> None:
    model, runner = silly_runner(rig, mode)
    report = runner.capture()
    runner_graphs, model_graphs = CAPTURES[mode]
    assert report.num_graphs == runner_graphs
    assert runner.stats.captures == runner_graphs
    assert model.stats.graphs_captured == model_graphs
    eager = SillyModel().to(rig.device)
    torch.manual_seed(0)
    expected_modes: dict[CUDAGraphMode, int] = {NONE: 0, PW: 0, FULL: 0}
    for n in range(1, MAX_TOKENS + 1):
        for uniform in (False, True):
            x = rig.randn(n, 3)
            want_mode = runner.dispatcher.dispatch(n, uniform)[0]
            if not runner.graphs_available:
                want_mode = NONE
            expected_modes[want_mode] += 1
            want = rig.host(eager(x))
            reset_counter()
            y = rig.host(runner(x, uniform_decode=uniform))
            assert y.shape == (n, 3)
            assert torch.equal(y, want), (mode, n, uniform)
            # The splitting op runs outside every graph except a FULL one.
            assert get_counter() == (0 if want_mode is FULL else 2), (mode, n, uniform)
    assert runner.stats.steps == 2 * MAX_TOKENS
    assert runner.stats.steps_full == expected_modes[FULL]
    assert runner.stats.steps_piecewise == expected_modes[PW]
    assert runner.stats.steps_eager == expected_modes[NONE]
    assert model.stats.graphs_captured == model_graphs  # steps replay, never capture
    assert model.stats.graphs_traced == 1


def test_piecewise_replays_read_new_data_every_step(rig: Rig) -> None:
    model, runner = silly_runner(rig, "piecewise")
    runner.capture()
    with model.stats.expect(replays=3 * 3, graphs_captured=0):
        for value in (1.0, 2.0, 3.0):
            x = torch.full((3, 3), value, device=rig.device)
            assert same(rig, runner(x), 9 * x + 19)


def test_capture_frees_graphs_captured_outside_the_runner(rig: Rig) -> None:
    """Graphs from low-level forward_context calls read the caller's tensors; a runner that
    replayed them would return stale results, so capture() frees and recaptures them."""
    cfg = config(rig, "piecewise")
    model = ff.compile(SillyModel().to(rig.device), cfg)
    model(rig.randn(4, 3))  # trace
    mine = rig.zeros(2, 3)
    with ff.forward_context(BatchDescriptor(num_tokens=2), mode=PW):
        model(mine)  # captures 3 piece graphs on `mine`
    assert model.stats.graphs_captured == 3
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False)
    runner.capture()
    assert runner.stats.foreign_graphs_dropped == 3
    x = torch.full((2, 3), 5.0, device=rig.device)
    assert same(rig, runner(x), 9 * x + 19)


def test_graphs_captured_outside_the_runner_after_it_was_made_are_freed_too(rig: Rig) -> None:
    """The same low-level capture, made after the runner existed: capture() used to keep those
    graphs (it looked only at what the model held when the runner was made), and each step
    then copied its input into the caller's tensor ``mine``, overwriting it. A graph is the
    runner's only when one of its own steps captured it."""
    cfg = config(rig, "piecewise")
    model = ff.compile(SillyModel().to(rig.device), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False)
    model(rig.randn(4, 3))  # trace
    mine = rig.zeros(2, 3)
    with ff.forward_context(BatchDescriptor(num_tokens=2), mode=PW):
        model(mine)  # captures 3 piece graphs on `mine`
    runner.capture()
    assert runner.stats.foreign_graphs_dropped == 3
    x = torch.full((2, 3), 5.0, device=rig.device)
    assert same(rig, runner(x), 9 * x + 19)
    assert same(rig, mine, torch.zeros(2, 3, device=rig.device))  # the caller's, untouched


class RowSum(nn.Module):
    """Every row plus the sum of the rows: padding rows (fill 0) add nothing, so a padding row
    holding anything else shows in every output row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(x, x, x) + x.sum(0, keepdim=True)


def rows(rig: Rig, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, (n, 3), generator=g).float().to(rig.device)


@pytest.mark.parametrize("policy", ["eager", "lazy"])
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_two_runners_on_one_model_each_replay_their_own_graphs(rig: Rig, mode: str,
                                                               policy: str) -> None:
    """Graphs are kept per owner. A second runner's capture() freed the first runner's graphs,
    whose window was closed, so every step of the first raised; and a runner replayed the
    other's graphs, copying its inputs into the other's buffers, whose next step of the same
    shape read them as padding."""
    cfg = config(rig, mode)
    model = ff.compile(RowSum().to(rig.device), cfg)

    def runner(**kw: Any) -> GraphRunner:
        return GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                           progress=False, **kw)

    first, second = runner(), runner(capture_policy=policy)
    first.capture()
    assert same(rig, first(rows(rig, 3, 0)), RowSum()(rows(rig, 3, 0)))
    second.capture()
    assert same(rig, first(rows(rig, 3, 1)), RowSum()(rows(rig, 3, 1)))
    third = runner()
    third.capture()
    # 4 real rows from one runner, then 3 from another: only its own padding row may be read
    order = ((third, 3), (second, 4), (third, 3), (first, 4), (third, 3), (second, 3),
             (first, 4), (second, 3))
    for step, (who, n) in enumerate(order):
        x = rows(rig, n, step)
        assert same(rig, who(x), RowSum()(x)), step
    assert first.stats.foreign_graphs_dropped == 0 and third.stats.steps_eager == 0


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_runner_made_after_another_captured_steps_before_its_own_capture(rig: Rig,
                                                                          mode: str) -> None:
    """The capture window belongs to the model, and the first runner's capture() closed it:
    the second runner's steps before its own capture() raised instead of capturing on its
    buffers, as the first runner's did."""
    cfg = config(rig, mode)
    model = ff.compile(RowSum().to(rig.device), cfg)
    first = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                        progress=False)
    first.capture()
    second = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False)
    for step in range(3):
        for who in (second, first):
            x = rows(rig, 3, step)
            assert same(rig, who(x), RowSum()(x)), step
    second.capture()
    with ff.forward_context(BatchDescriptor(num_tokens=2), mode=mode), \
            pytest.raises(CaptureError, match="the capture window is closed"):
        model(rows(rig, 2, 0))  # low-level calls still meet the closed window
    for step in range(2):
        for who in (second, first):
            x = rows(rig, 4, step)
            assert same(rig, who(x), RowSum()(x)), step
    # where the backend only records (cuda), the second runner's first step of its key was
    # that key's warm-up, without a graph
    warmups = 1 if rig.backend == "cuda" else 0
    assert (first.stats.steps_eager, second.stats.steps_eager) == (0, warmups)


def test_a_low_level_call_after_capture_never_replays_the_runners_graphs(rig: Rig) -> None:
    """A low-level forward_context call at a captured size used to replay the runner's graph,
    copying its 4 rows into the runner's static buffer, whose next 3-row step then read the
    4th as padding. Now it finds no graph of its own and, the window being closed, raises."""
    cfg = config(rig, "piecewise")
    model = ff.compile(RowSum().to(rig.device), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False)
    runner.capture()
    x = rows(rig, 3, 1)
    assert same(rig, runner(x), RowSum()(x))
    with ff.forward_context(BatchDescriptor(num_tokens=4), mode=PW), \
            pytest.raises(CaptureError, match="the capture window is closed"):
        model(torch.full((4, 3), 100.0, device=rig.device))
    assert same(rig, runner(x), RowSum()(x))


def test_graphs_the_runner_captured_in_steps_before_capture_are_kept(rig: Rig) -> None:
    """A step before capture() captures on the runner's own buffers (the window is open until
    then); capture() used to free those as foreign and capture them again."""
    model, runner = silly_runner(rig, "piecewise")
    x = torch.full((3, 3), 2.0, device=rig.device)
    assert same(rig, runner(x), 9 * x + 19)
    # Where the backend only records (cuda), that first step of key 4 was its warm-up and
    # this one captures; where it captures by running (emulated), the first captured.
    assert same(rig, runner(x), 9 * x + 19)
    assert model.stats.graphs_captured == 3  # 3 capturable pieces at padded size 4
    runner.capture()
    assert runner.stats.foreign_graphs_dropped == 0
    assert model.stats.graphs_captured == 3 * len(SIZES)
    assert same(rig, runner(x), 9 * x + 19)


# -- capture ------------------------------------------------------------------------------------
class GcProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.freeze_counts: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx is not None and ctx.capturing:
            self.freeze_counts.append(gc.get_freeze_count())
        return x + 1


def test_capture_report_order_warmups_window_and_gc_freeze(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    model, runner = silly_runner(rig, "full_and_piecewise", cudagraph_num_of_warmups=2)
    caplog.set_level(logging.INFO, logger="freezeframe.runtime.runner")
    report = runner.capture()
    assert [(g.mode, g.descriptor.num_tokens) for g in report.graphs] == (
        [(PW, n) for n in (8, 4, 2, 1)] + [(FULL, n) for n in (8, 4, 2, 1)])
    assert all(g.seconds >= 0 for g in report.graphs)
    if rig.backend == "emulated":  # each emulated graph holds its own tensors (graph_memory
        # tests): 7 piecewise / 11 full float32 [n, 3] tensors; on cuda they share one pool
        assert [g.memory_bytes for g in report.graphs] == [84 * n for n in (8, 4, 2, 1)] + [
            132 * n for n in (8, 4, 2, 1)]
    assert report.seconds >= sum(g.seconds for g in report.graphs)
    assert runner.stats.warmups == 2 * 8
    assert sum("captured 8 graphs (4 piecewise, 4 full)" in r.getMessage()
               for r in caplog.records) == 1
    assert runner.capture() is report  # captured once
    # The window is closed: a descriptor nobody captured raises instead of capturing.
    assert not model.capture_window.is_open
    with pytest.raises(CaptureError), ff.forward_context(BatchDescriptor(3, 3), mode=FULL):
        model(torch.ones(3, 3, device=rig.device))

    probe = GcProbe()
    probe_runner = GraphRunner(probe, config(rig, "full"), inputs={"x": Tokens(1)},
                               device=rig.device, progress=False)
    frozen_before = gc.get_freeze_count()
    probe_runner.capture()
    # one priming warm-up where the backend captures by running (emulated), one per key where
    # it only records (cuda)
    warmups = 1 if rig.backend == "emulated" else 4
    assert probe_runner.stats.warmups == warmups
    assert len(probe.freeze_counts) == 4 + warmups  # four captures and the warm-ups
    assert all(c > frozen_before for c in probe.freeze_counts)
    assert gc.get_freeze_count() == frozen_before


def test_outputs_are_overwritten_by_the_next_replay_unless_copied(rig: Rig) -> None:
    for copy in (False, True):
        cfg = config(rig, "full")
        model = ff.compile(SillyModel().to(rig.device), cfg)
        runner = GraphRunner(model, cfg, inputs={"x": Tokens(1)}, device=rig.device,
                             progress=False, copy_outputs=copy)
        runner.capture()
        first = runner(rig.zeros(4, 1))
        runner(torch.ones(4, 1, device=rig.device))
        assert torch.equal(rig.host(first), torch.full((4, 1), 19.0 if copy else 28.0)), copy


# -- the forward context of a step ------------------------------------------------------------
class Recorder(nn.Module):
    """A plain module (no graphs of its own) that records the forward context it runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[CUDAGraphMode, BatchDescriptor | None, dict[str, Any],
                              tuple[int | None, int | None], int]] = []

    def forward(self, x: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        assert ctx is not None
        self.seen.append((ctx.mode, ctx.batch_descriptor, dict(ctx.extras),
                          (ctx.num_tokens_unpadded, ctx.num_reqs_unpadded), seq_lens.shape[0]))
        return x * 2


def test_context_exposes_real_sizes_and_requests_are_padded_for_full_keys(rig: Rig) -> None:
    """The real sizes are typed fields of the context; ``extras`` holds only the caller's."""
    cfg = config(rig, "full_and_piecewise")
    rec = Recorder()
    runner = GraphRunner(rec, cfg, progress=False, outputs="tokens", device=rig.device,
                         inputs={"x": Tokens(2), "seq_lens": Requests(fill=0)})
    # captured first: where the backend only records (cuda), a key's first step before
    # capture() is its warm-up, run in mode NONE
    runner.capture()
    # Uniform decode of 3 requests -> FULL key with 4 requests; mixed 5 tokens -> PIECEWISE.
    y = runner(torch.ones(3, 2, device=rig.device),
               torch.tensor([5, 6, 7], dtype=torch.int32, device=rig.device),
               uniform_decode=True, extras={"tag": "decode"})
    assert torch.equal(rig.host(y), torch.full((3, 2), 2.0))
    mode, desc, extras, real, reqs_rows = rec.seen[-1]
    assert (mode, desc) == (FULL, BatchDescriptor(4, 4, uniform=True))
    assert (extras, real) == ({"tag": "decode"}, (3, 3))
    assert reqs_rows == 4
    assert rig.host(runner.buffers["seq_lens"][:4]).tolist() == [5, 6, 7, 0]
    # A PIECEWISE key ignores the request count, so the pieces see as many request rows as
    # they were captured with (min(padded tokens, max_num_seqs)), the padded ones at the fill.
    runner(torch.ones(5, 2, device=rig.device),
           torch.tensor([2, 3], dtype=torch.int32, device=rig.device))
    mode, desc, extras, real, reqs_rows = rec.seen[-1]
    assert (mode, desc, reqs_rows) == (PW, BatchDescriptor(8), min(8, cfg.max_num_seqs))
    assert (extras, real) == ({}, (5, 2))
    assert rig.host(runner.buffers["seq_lens"][:4]).tolist() == [2, 3, 0, 0]


# -- fallbacks --------------------------------------------------------------------------------
def plain_runner(rig: Rig, mode: str, **kw: Any) -> GraphRunner:
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in CompilationConfig.field_names()}
    return GraphRunner(Recorder(), config(rig, mode, **cfg_kw), progress=False,
                       device=rig.device, inputs={"x": Tokens(2), "seq_lens": Requests()},
                       **kw)


def step(rig: Rig, runner: GraphRunner, n: int, **kw: Any) -> Any:
    reqs = kw.pop("reqs", 1)
    return runner(torch.ones(n, 2, device=rig.device),
                  torch.ones(reqs, dtype=torch.int32, device=rig.device), **kw)


def test_fallbacks_are_counted_by_reason_and_logged_once(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    runner = plain_runner(rig, "full_decode_only", max_loras=2)
    # captured first: where the backend only records (cuda), the graph step's key would
    # otherwise be warmed up by it (counted as an eager step) instead of replayed
    runner.capture()
    caplog.set_level(logging.INFO, logger="freezeframe.runtime.runner")
    with runner.stats.expect(fallback_too_large=2, fallback_mode_off=1, fallback_mode_invalid=1,
                             fallback_no_key=1, steps=6, steps_eager=5, steps_full=1):
        step(rig, runner, 10)
        step(rig, runner, 11)
        step(rig, runner, 4, reqs=2)                                 # mixed: decode-only mode
        step(rig, runner, 4, reqs=4, uniform_decode=True, invalid_modes={FULL})
        step(rig, runner, 4, reqs=4, uniform_decode=True, has_lora=True, num_active_loras=9)
        step(rig, runner, 4, reqs=4, uniform_decode=True)            # a graph step
    messages = [r.getMessage() for r in caplog.records if "eager fallback" in r.getMessage()]
    assert len(messages) == 4  # one per reason, not per step
    assert sum("too_large" in m for m in messages) == 1
    assert any("above the largest capture size 8" in m for m in messages)


def test_graphs_unavailable_is_a_counted_fallback(rig: Rig,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    auto = dataclasses.replace(rig, backend="auto")  # graph_backend="auto", on rig's device
    runner = plain_runner(auto, "full")
    assert runner.capture().num_graphs == 0
    with runner.stats.expect(fallback_graphs_unavailable=1, steps_eager=1):
        step(auto, runner, 4)


def test_strict_mode_raises_instead_of_falling_back(rig: Rig) -> None:
    runner = plain_runner(rig, "full_and_piecewise", strict=True)
    step(rig, runner, 8)  # a graph step is fine
    with pytest.raises(FallbackError, match=r"too_large.*largest capture size 8"):
        step(rig, runner, 9)
    with pytest.raises(FallbackError, match="mode_invalid"):
        step(rig, runner, 2, invalid_modes={FULL, PW})
    assert runner.stats.fallback_too_large == 1
    with pytest.raises(ConfigError, match="strict=True with cudagraph_mode NONE"):
        plain_runner(rig, "none", strict=True)
