"""GraphRunner end to end on the emulated graph backend (CPU): every mode, every size, padded-row
safety, fallback accounting, strict mode, input validation, the capture window and report."""

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
from freezeframe.errors import (
    CaptureError,
    ConfigError,
    FallbackError,
    InputMismatchError,
    ShapeOutOfRangeError,
)
from freezeframe.runtime import GraphRunner, Requests, Static, Tokens
from tests.helpers.silly import attention, get_counter, reset_counter
from tests.helpers.toy_models import KeepsLast, SillyModel

NONE, PW, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
SIZES = [1, 2, 4, 8]
MAX_TOKENS = 12


def config(mode: str, **kw: Any) -> CompilationConfig:
    fields: dict[str, Any] = dict(
        mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
        cudagraph_mode=mode, graph_backend="emulated", cudagraph_capture_sizes=SIZES,
        max_num_tokens=MAX_TOKENS, max_num_seqs=8)
    fields.update(kw)
    return CompilationConfig(**fields)


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
def test_every_mode_matches_eager_for_every_size(mode: str) -> None:
    cfg = config(mode)
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    report = runner.capture()
    runner_graphs, model_graphs = CAPTURES[mode]
    assert report.num_graphs == runner_graphs
    assert runner.stats.captures == runner_graphs
    assert model.stats.graphs_captured == model_graphs
    eager = SillyModel()
    torch.manual_seed(0)
    expected_modes: dict[CUDAGraphMode, int] = {NONE: 0, PW: 0, FULL: 0}
    for n in range(1, MAX_TOKENS + 1):
        for uniform in (False, True):
            x = torch.randn(n, 3)
            want_mode = runner.dispatcher.dispatch(n, uniform)[0]
            if not runner.graphs_available:
                want_mode = NONE
            expected_modes[want_mode] += 1
            want = eager(x)
            reset_counter()
            y = runner(x, uniform_decode=uniform)
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


def test_piecewise_replays_read_new_data_every_step() -> None:
    cfg = config("piecewise")
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    runner.capture()
    with model.stats.expect(replays=3 * 3, graphs_captured=0):
        for value in (1.0, 2.0, 3.0):
            x = torch.full((3, 3), value)
            assert torch.equal(runner(x), 9 * x + 19)


def test_capture_frees_graphs_captured_outside_the_runner() -> None:
    """Graphs from low-level forward_context calls read the caller's tensors; a runner that
    replayed them would return stale results, so capture() frees and recaptures them."""
    cfg = config("piecewise")
    model = ff.compile(SillyModel(), cfg)
    model(torch.randn(4, 3))  # trace
    mine = torch.zeros(2, 3)
    with ff.forward_context(BatchDescriptor(num_tokens=2), mode=PW):
        model(mine)  # captures 3 piece graphs on `mine`
    assert model.stats.graphs_captured == 3
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    runner.capture()
    assert runner.stats.foreign_graphs_dropped == 3
    x = torch.full((2, 3), 5.0)
    assert torch.equal(runner(x), 9 * x + 19)


# -- padded rows -----------------------------------------------------------------------------
class CacheWriter(nn.Module):
    """Writes every real token into a cache row chosen by its slot id and scales by a per-token
    divisor. Padded rows carry slot -1 and divisor 1: the write masks them out (a plain
    ``cache[slots] = x`` would write row -1, the *last real row*) and the division stays
    finite (a zero divisor would give inf)."""

    def __init__(self, num_slots: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(num_slots, hidden))

    def forward(self, x: torch.Tensor, slots: torch.Tensor,
                divisor: torch.Tensor) -> torch.Tensor:
        keep = (slots >= 0).to(x.dtype).unsqueeze(-1)            # (tokens, 1)
        self.cache.index_add_(0, slots.clamp(min=0), x * keep)   # padded rows add zeros
        return x / divisor.unsqueeze(-1)                         # (tokens, hidden)


@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_padded_rows_are_reset_finite_and_never_touch_real_rows(graph_mode: str) -> None:
    cfg = CompilationConfig(mode="none", cudagraph_mode=graph_mode, graph_backend="emulated",
                            cudagraph_capture_sizes=SIZES, max_num_tokens=MAX_TOKENS)
    module = CacheWriter(num_slots=16, hidden=2)
    model = ff.compile(module, cfg)
    runner = GraphRunner(model, cfg, progress=False, outputs="none", inputs={
        "x": Tokens(2),
        "slots": Tokens(dtype=torch.long, fill=-1),
        "divisor": Tokens(fill=1.0),
    })
    runner.capture()
    module.cache.zero_()  # capture passes were dummy steps that wrote nothing real

    # A large step fills 8 rows with data, then a 3-token step pads to 4.
    runner(torch.full((8, 2), 5.0), torch.arange(8), torch.full((8,), 2.0))
    module.cache.zero_()
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    out = runner(x, torch.tensor([15, 3, 7]), torch.tensor([1.0, 2.0, 4.0]))

    padded = 4 if graph_mode == "full" else 3  # without graphs a step is not padded
    assert out.shape == (padded, 2)  # outputs="none": the padded rows are visible
    assert torch.isfinite(out).all()
    assert torch.equal(out[:3], x / torch.tensor([[1.0], [2.0], [4.0]]))
    if graph_mode == "full":
        assert torch.equal(out[3], torch.zeros(2))
        # The padded row holds the fills, not the stale 8-token step.
        assert runner.buffers["x"][3].tolist() == [0.0, 0.0]
        assert runner.buffers["slots"][3].item() == -1
        assert runner.buffers["divisor"][3].item() == 1.0
    expected = torch.zeros(16, 2)
    expected[15], expected[3], expected[7] = x[0], x[1], x[2]
    assert torch.equal(module.cache, expected)  # row 15 once, nothing else touched


class Recorder(nn.Module):
    """A plain module (no graphs of its own) that records the forward context it runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[CUDAGraphMode, BatchDescriptor | None, dict[str, Any],
                              tuple[int | None, int | None], int]] = []

    def forward(self, x: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        ctx = ff.get_forward_context()
        assert ctx is not None
        self.seen.append((ctx.mode, ctx.batch_descriptor, dict(ctx.extras),
                          (ctx.num_tokens_unpadded, ctx.num_reqs_unpadded), seq_lens.shape[0]))
        return x * 2


def test_context_exposes_real_sizes_and_requests_are_padded_for_full_keys() -> None:
    """The real sizes are typed fields of the context; ``extras`` holds only the caller's."""
    cfg = config("full_and_piecewise")
    rec = Recorder()
    runner = GraphRunner(rec, cfg, progress=False, outputs="tokens",
                         inputs={"x": Tokens(2), "seq_lens": Requests(fill=0)})
    # Uniform decode of 3 requests -> FULL key with 4 requests; mixed 5 tokens -> PIECEWISE.
    y = runner(torch.ones(3, 2), torch.tensor([5, 6, 7], dtype=torch.int32), uniform_decode=True,
               extras={"tag": "decode"})
    assert torch.equal(y, torch.full((3, 2), 2.0))
    mode, desc, extras, real, reqs_rows = rec.seen[-1]
    assert (mode, desc) == (FULL, BatchDescriptor(4, 4, uniform=True))
    assert (extras, real) == ({"tag": "decode"}, (3, 3))
    assert reqs_rows == 4
    assert runner.buffers["seq_lens"][:4].tolist() == [5, 6, 7, 0]
    # A PIECEWISE key ignores the request count, so the pieces see as many request rows as
    # they were captured with (min(padded tokens, max_num_seqs)), the padded ones at the fill.
    runner(torch.ones(5, 2), torch.tensor([2, 3], dtype=torch.int32))
    mode, desc, extras, real, reqs_rows = rec.seen[-1]
    assert (mode, desc, reqs_rows) == (PW, BatchDescriptor(8), min(8, cfg.max_num_seqs))
    assert (extras, real) == ({}, (5, 2))
    assert runner.buffers["seq_lens"][:4].tolist() == [2, 3, 0, 0]


# -- fallbacks --------------------------------------------------------------------------------
def plain_runner(mode: str, **kw: Any) -> GraphRunner:
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in CompilationConfig.field_names()}
    return GraphRunner(Recorder(), config(mode, **cfg_kw), progress=False,
                       inputs={"x": Tokens(2), "seq_lens": Requests()}, **kw)


def step(runner: GraphRunner, n: int, **kw: Any) -> Any:
    reqs = kw.pop("reqs", 1)
    return runner(torch.ones(n, 2), torch.ones(reqs, dtype=torch.int32), **kw)


def test_fallbacks_are_counted_by_reason_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    runner = plain_runner("full_decode_only", max_loras=2)
    caplog.set_level(logging.INFO, logger="freezeframe.runtime.runner")
    with runner.stats.expect(fallback_too_large=2, fallback_mode_off=1, fallback_mode_invalid=1,
                             fallback_no_key=1, steps=6, steps_eager=5, steps_full=1):
        step(runner, 10)
        step(runner, 11)
        step(runner, 4, reqs=2)                                      # mixed: decode-only mode
        step(runner, 4, reqs=4, uniform_decode=True, invalid_modes={FULL})
        step(runner, 4, reqs=4, uniform_decode=True, has_lora=True, num_active_loras=9)
        step(runner, 4, reqs=4, uniform_decode=True)                 # a graph step
    messages = [r.getMessage() for r in caplog.records if "eager fallback" in r.getMessage()]
    assert len(messages) == 4  # one per reason, not per step
    assert sum("too_large" in m for m in messages) == 1
    assert any("above the largest capture size 8" in m for m in messages)


def test_graphs_unavailable_is_a_counted_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner = plain_runner("full", graph_backend="auto")
    assert runner.capture().num_graphs == 0
    with runner.stats.expect(fallback_graphs_unavailable=1, steps_eager=1):
        step(runner, 4)


def test_strict_mode_raises_instead_of_falling_back() -> None:
    runner = plain_runner("full_and_piecewise", strict=True)
    step(runner, 8)  # a graph step is fine
    with pytest.raises(FallbackError, match=r"too_large.*largest capture size 8"):
        step(runner, 9)
    with pytest.raises(FallbackError, match="mode_invalid"):
        step(runner, 2, invalid_modes={FULL, PW})
    assert runner.stats.fallback_too_large == 1
    with pytest.raises(ConfigError, match="strict=True with cudagraph_mode NONE"):
        plain_runner("none", strict=True)


# -- capture ------------------------------------------------------------------------------------
class GcProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.freeze_counts: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = ff.get_forward_context()
        if ctx is not None and ctx.capturing:
            self.freeze_counts.append(gc.get_freeze_count())
        return x + 1


def test_capture_report_order_warmups_window_and_gc_freeze(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = config("full_and_piecewise", cudagraph_num_of_warmups=2)
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    caplog.set_level(logging.INFO, logger="freezeframe.runtime.runner")
    report = runner.capture()
    assert [(g.mode, g.descriptor.num_tokens) for g in report.graphs] == (
        [(PW, n) for n in (8, 4, 2, 1)] + [(FULL, n) for n in (8, 4, 2, 1)])
    assert all(g.seconds >= 0 for g in report.graphs)
    # emulated graph memory (graph_memory tests): 7 piecewise / 11 full float32 [n, 3] tensors
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
        model(torch.ones(3, 3))

    probe = GcProbe()
    probe_runner = GraphRunner(probe, config("full"), inputs={"x": Tokens(1)}, progress=False)
    frozen_before = gc.get_freeze_count()
    probe_runner.capture()
    assert len(probe.freeze_counts) == 4 + 1  # four captures and one priming warm-up
    assert all(c > frozen_before for c in probe.freeze_counts)
    assert gc.get_freeze_count() == frozen_before


def test_outputs_are_overwritten_by_the_next_replay_unless_copied() -> None:
    cfg = config("full")
    for copy in (False, True):
        model = ff.compile(SillyModel(), cfg)
        runner = GraphRunner(model, cfg, inputs={"x": Tokens(1)}, progress=False,
                             copy_outputs=copy)
        runner.capture()
        first = runner(torch.zeros(4, 1))
        runner(torch.ones(4, 1))
        assert torch.equal(first, torch.full((4, 1), 19.0 if copy else 28.0)), copy


# -- validation ---------------------------------------------------------------------------------
def test_input_validation_names_the_input_expected_and_got() -> None:
    runner = GraphRunner(Recorder(), config("full"), progress=False,
                         inputs={"x": Tokens(2), "seq_lens": Requests(dtype=torch.int32)})
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(InputMismatchError, match=r"'x': expected dtype torch.float32, got "
                                                 r"torch.float64"):
        runner(torch.ones(2, 2, dtype=torch.float64), lens)
    with pytest.raises(InputMismatchError, match=r"'x': expected device cpu, got meta"):
        runner(torch.ones(2, 2, device="meta"), lens)
    with pytest.raises(InputMismatchError, match=r"'x': expected shape \[tokens, 2\], got "
                                                 r"\[2, 3\]"):
        runner(torch.ones(2, 3), lens)
    with pytest.raises(ShapeOutOfRangeError, match="0 tokens"):
        runner(torch.ones(0, 2), lens[:0])
    with pytest.raises(ShapeOutOfRangeError, match=r"13 tokens.*max_num_tokens=12"):
        runner(torch.ones(13, 2), lens)
    with pytest.raises(ShapeOutOfRangeError, match=r"9 requests.*max_num_seqs=8"):
        runner(torch.ones(10, 2), torch.ones(9, dtype=torch.int32))
    with pytest.raises(InputMismatchError, match="unknown input 'y'"):
        runner(torch.ones(2, 2), lens, y=lens)
    with pytest.raises(InputMismatchError, match=r"missing input\(s\) \['seq_lens'\]"):
        runner(torch.ones(2, 2))
    with pytest.raises(InputMismatchError, match="uniform_decode=True needs"):
        runner(torch.ones(3, 2), torch.ones(2, dtype=torch.int32), uniform_decode=True)
    with pytest.raises(ConfigError, match="reserved"):
        GraphRunner(Recorder(), config("full"), inputs={"x": Tokens(2), "extras": Static(1)})
    with pytest.raises(ConfigError, match="at least one input must be Tokens"):
        GraphRunner(Recorder(), config("full"), inputs={"seq_lens": Requests()})
    with pytest.raises(ConfigError, match="not finite"):
        Tokens(2, fill=float("nan"))
    with pytest.raises(ConfigError, match="changes to"):
        Tokens(dtype=torch.uint8, fill=-1)


# -- outputs, static inputs, positional calls ------------------------------------------------------
class TwoHeads(nn.Module):
    """Returns a per-token tensor, a per-request tensor and a static one."""

    def forward(self, x: torch.Tensor, seq_lens: torch.Tensor,
                scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x * scale, seq_lens * 2, scale + 0


def test_outputs_sliced_per_kind_static_inputs_and_positional_calls() -> None:
    cfg = CompilationConfig(mode="none", cudagraph_mode="full", graph_backend="emulated",
                            cudagraph_capture_sizes=SIZES, max_num_tokens=MAX_TOKENS,
                            max_num_seqs=8)
    model = ff.compile(TwoHeads(), cfg)
    example = torch.zeros(5, 2, dtype=torch.float16)
    inputs = {"x": ff.runtime.InputSpec.like(example), "seq_lens": Requests(dtype=torch.long),
              "scale": Static(2, dtype=torch.float16, fill=1)}
    runner = GraphRunner(model, inputs=inputs, outputs=("tokens", "requests", "none"),
                         call_positional=True, progress=False)
    assert runner.config is cfg  # taken from model.config
    runner.capture()
    x = torch.arange(10, dtype=torch.float16).reshape(5, 2)
    scale = torch.tensor([2.0, 3.0], dtype=torch.float16)
    tokens, reqs, static = runner(x, torch.tensor([2, 3]), scale)
    assert torch.equal(tokens, x * scale)                    # 5 of 8 padded rows
    assert torch.equal(reqs, torch.tensor([4, 6]))          # 2 of min(8, 8) request rows
    assert torch.equal(static, scale)
    assert model.stats.replays == 1
    with pytest.raises(InputMismatchError, match=r"static input expected shape \[2\]"):
        runner(x, torch.tensor([2, 3]), torch.ones(3, dtype=torch.float16))
    with pytest.raises(ConfigError, match="disagrees with the model's"):
        GraphRunner(model, config("piecewise"), inputs=inputs)


# -- inputs the model writes into ---------------------------------------------------------------
class InPlaceWriter(nn.Module):
    """Writes into three of its inputs, as a model updating a cache or its own state does:
    ``x += 1`` (a token input), ``seen[r] += 1`` per request (a request input) and a masked
    ``cache.index_add_`` (a static input; padded rows carry slot -1 and add zeros). Two
    attentions split it into pieces, so PIECEWISE graphs hold the writes too."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor, seen: torch.Tensor,
                cache: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        seen.add_(1)
        keep = (slots >= 0).to(x.dtype).unsqueeze(-1)
        cache.index_add_(0, slots.clamp(min=0), x * keep)
        h = attention(x, x, x)
        return attention(h, h, h) * 2


def _writer_inputs(n: int, reqs: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (n, 2), generator=g).float()
    slots = torch.randperm(6, generator=g)[:n] if n <= 6 else torch.arange(n) % 6
    seen = torch.randint(0, 9, (reqs,), generator=g, dtype=torch.int32)
    cache = torch.randint(-4, 5, (6, 2), generator=g).float()
    return x, slots, seen, cache


def writer_runner(cfg: CompilationConfig) -> tuple[Any, GraphRunner]:
    """:class:`InPlaceWriter` compiled with ``cfg`` behind a captured runner with one input of
    each kind."""
    model = ff.compile(InPlaceWriter(), cfg)
    runner = GraphRunner(model, cfg, progress=False, inputs={
        "x": Tokens(2), "slots": Tokens(dtype=torch.long, fill=-1),
        "seen": Requests(dtype=torch.int32), "cache": Static(6, 2)})
    runner.capture()
    return model, runner


@pytest.mark.parametrize("mode", list(CAPTURES))
def test_inputs_written_by_the_model_reach_the_caller_as_in_eager(mode: str) -> None:
    """A model that writes into an input tensor writes into the caller's tensor in eager; the
    runner runs it on its static copy, so it copies the written inputs back (real rows only)."""
    _, runner = writer_runner(config(mode))
    eager = InPlaceWriter()
    for step_no, (n, reqs) in enumerate([(3, 2), (8, 8), (1, 1), (5, 5), (11, 3), (4, 4)]):
        mine = _writer_inputs(n, reqs, seed=step_no)
        theirs = tuple(t.clone() for t in mine)
        want = eager(*theirs)
        got = runner(*mine, uniform_decode=(n == reqs))
        assert torch.equal(got, want), (mode, n)
        for name, a, b in zip(("x", "slots", "seen", "cache"), mine, theirs, strict=True):
            assert torch.equal(a, b), (mode, n, name)
    assert runner.stats.inputs_copied_back == 6 * 3


class VersionlessReplay(nn.Module):
    """Writes ``x += 1`` like a captured graph on CUDA does: the capture goes through the
    dispatcher (bumping ``x``'s version counter), a replay writes the memory behind its back
    (here through ``.data``, which shares the storage but not the version counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.captured: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = ff.get_forward_context()
        assert ctx is not None and ctx.batch_descriptor is not None
        n = ctx.batch_descriptor.num_tokens
        if ctx.mode is FULL and n in self.captured:
            x.data.add_(1)  # a replay: same memory, no version bump
        else:
            if ctx.mode is FULL:
                self.captured.add(n)
            x.add_(1)
        return x * 2


def test_inputs_a_replay_writes_without_the_dispatcher_are_copied_back() -> None:
    model = VersionlessReplay()
    runner = GraphRunner(model, config("full"), inputs={"x": Tokens(2)}, progress=False,
                         copy_outputs=True)
    runner.capture()
    assert model.captured == set(SIZES)
    for n in (3, 8, 12):  # 12 is above the largest capture size: eager, version bumped
        x = torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)
        want = (x + 1) * 2
        got = runner(x)
        assert torch.equal(got, want), n
        assert torch.equal(x, want / 2), n  # the caller's tensor was written, as in eager
    assert runner.stats.steps_full == 2 and runner.stats.inputs_copied_back == 3


# -- a token budget off the capture ladder -----------------------------------------------------
def test_a_step_of_the_whole_token_budget_replays_a_graph() -> None:
    """max_num_tokens=100 lies between the ladder's 96 and 104: the budget itself is captured,
    so a 100-token step replays a graph (a strict runner would raise on an eager fallback)."""
    cfg = CompilationConfig(mode="none", cudagraph_mode="full", graph_backend="emulated",
                            max_num_tokens=100, max_num_seqs=128)
    model = ff.compile(TwoHeads(), cfg)
    runner = GraphRunner(model, progress=False, strict=True, outputs=("tokens", "none", "none"),
                         inputs={"x": Tokens(2), "seq_lens": Requests(dtype=torch.long),
                                 "scale": Static(2, fill=1)})
    report = runner.capture()
    assert report.num_graphs == len(cfg.cudagraph_capture_sizes) == 16
    assert report.graphs[0].descriptor.num_tokens == 100
    scale = torch.tensor([2.0, 3.0])
    for n in (100, 97, 96, 1):
        x = torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)
        tokens, _, _ = runner(x, torch.ones(1, dtype=torch.long), scale)
        assert torch.equal(tokens, x * scale), n
    assert runner.stats.steps_full == 4
    assert model.stats.replays == 4


def test_graphs_the_runner_captured_in_steps_before_capture_are_kept() -> None:
    """A step before capture() captures on the runner's own buffers (the window is open until
    then); capture() used to free those as foreign and capture them again."""
    cfg = config("piecewise")
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    x = torch.full((3, 3), 2.0)
    assert torch.equal(runner(x), 9 * x + 19)
    assert model.stats.graphs_captured == 3  # 3 capturable pieces at padded size 4
    runner.capture()
    assert runner.stats.foreign_graphs_dropped == 0
    assert model.stats.graphs_captured == 3 * len(SIZES)
    assert torch.equal(runner(x), 9 * x + 19)


# -- the plan of a FULL step: made once per shape, then stage and replay ----------------------
def _full_runner() -> tuple[ff.compilation.CompiledModel, GraphRunner]:
    cfg = config("full", use_cache=False)
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    runner.capture()
    return model, runner


def test_full_steps_of_a_captured_shape_replay_without_routing_the_call() -> None:
    model, runner = _full_runner()
    runner(torch.zeros(3, 3))  # the first step of size 4 makes the plan
    signer = model._signer
    assert signer is not None

    def no_routing(*args: Any) -> Any:
        raise AssertionError("a planned FULL step routed its call through the model")

    signer.key = no_routing  # type: ignore[method-assign]
    for n, seed in ((3, 1), (4, 2), (3, 3)):
        x = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))
        with model.stats.expect(replays=1, graphs_captured=0):
            out = runner(x)
        with torch.no_grad():
            assert torch.equal(out, SillyModel()(x))


def test_a_planned_full_step_still_refuses_a_changed_module() -> None:
    model, runner = _full_runner()
    runner(torch.zeros(3, 3))
    model.module.scale = 2.0  # an attribute forward could read: the trace baked the old state
    with pytest.raises(ff.CompileError, match="the module changed after its first call"):
        runner(torch.zeros(3, 3))


def test_a_planned_full_step_whose_graph_was_dropped_goes_back_through_the_model() -> None:
    model, runner = _full_runner()
    x = torch.ones(3, 3)
    assert torch.equal(runner(x), torch.full((3, 3), 28.0))
    for wrapper in model.graph_wrappers():
        wrapper.clear()
    with pytest.raises(ff.CaptureError, match="capture window is closed"):
        runner(x)  # the plan's graph is gone; the model may not capture during serving
    with model.capture_window.opened(), model.stats.expect(graphs_captured=1, replays=0):
        assert torch.equal(runner(x), torch.full((3, 3), 28.0))
    with model.stats.expect(graphs_captured=0, replays=1):
        assert torch.equal(runner(2 * x), torch.full((3, 3), 37.0))


def test_planned_steps_count_and_answer_as_the_first_step_of_their_shape_did() -> None:
    """Steps of a planned shape (plan.py) stage new data every time and are counted
    exactly as steps that take the whole way."""
    model, runner = _full_runner()
    for step, n in enumerate([3, 3, 4, 3, 1, 3, 8, 3]):
        x = torch.randn(n, 3, generator=torch.Generator().manual_seed(step))
        padded = next(s for s in SIZES if s >= n)
        with runner.stats.expect(steps=1, steps_full=1, padded_tokens=padded - n), \
                model.stats.expect(replays=1, graphs_captured=0):
            out = runner(x)
        with torch.no_grad():
            assert torch.equal(out, SillyModel()(x)), (step, n)
    # the counters read the same through every view of them
    snap = runner.stats.snapshot()
    assert (snap["steps"], runner.stats.steps, runner.stats["steps_full"]) == (8, 8, 8)
    assert snap["padded_tokens"] == runner.stats.get("padded_tokens") == 5  # five 3s padded to 4


def test_a_planned_shape_still_refuses_inputs_of_another_dtype_or_kind() -> None:
    _, runner = _full_runner()
    x = torch.ones(3, 3)
    runner(x)
    runner(x)  # planned now
    with pytest.raises(InputMismatchError, match=r"input 'x': expected dtype torch.float32, "
                       r"got torch.float64"):
        runner(x.double())
    with pytest.raises(InputMismatchError, match=r"expected a torch\.Tensor, got ndarray"):
        runner(x.numpy())
    assert torch.equal(runner(x), torch.full((3, 3), 28.0))  # and the plan still serves


def test_planned_steps_by_name_and_with_copied_outputs() -> None:
    cfg = config("full", use_cache=False)
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, copy_outputs=True,
                         progress=False)
    runner.capture()
    first = runner(torch.ones(3, 3))
    second = runner(torch.zeros(3, 3))  # planned: a copy, not the static output again
    third = runner(x=torch.full((3, 3), 2.0))  # by name: the whole way, same answer
    assert torch.equal(first, torch.full((3, 3), 28.0))
    assert torch.equal(second, torch.full((3, 3), 19.0))
    assert torch.equal(third, torch.full((3, 3), 37.0))
    assert model.stats.replays == 3


# -- the plan of a PIECEWISE step: the piece chain without the model's Python ----------------
def _piecewise_runner(module: nn.Module | None = None,
                      **kw: Any) -> tuple[ff.compilation.CompiledModel, GraphRunner]:
    cfg = config("piecewise", use_cache=False)
    model = ff.compile(module if module is not None else SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False, **kw)
    runner.capture()
    return model, runner


def test_planned_piecewise_steps_replay_the_pieces_and_call_the_ops() -> None:
    model, runner = _piecewise_runner()
    runner(torch.zeros(3, 3))  # the first step of each input shape makes its plan
    runner(torch.zeros(4, 3))
    signer = model._signer
    assert signer is not None

    def no_routing(*args: Any) -> Any:
        raise AssertionError("a planned PIECEWISE step routed its call through the model")

    signer.key = no_routing  # type: ignore[method-assign]
    for step, n in enumerate([3, 4, 3, 3]):
        x = torch.randn(n, 3, generator=torch.Generator().manual_seed(step))
        reset_counter()
        with runner.stats.expect(steps=1, steps_piecewise=1, padded_tokens=4 - n), \
                model.stats.expect(replays=3, graphs_captured=0):
            out = runner(x)
        assert get_counter() == 2  # both silly::attention calls ran, between the pieces
        with torch.no_grad():
            assert torch.equal(out, SillyModel()(x)), step


def test_a_planned_piecewise_step_still_refuses_a_changed_module() -> None:
    model, runner = _piecewise_runner()
    runner(torch.zeros(3, 3))
    model.module.scale = 2.0
    with pytest.raises(ff.CompileError, match="the module changed after its first call"):
        runner(torch.zeros(3, 3))


def test_a_planned_piecewise_step_whose_graphs_were_dropped_goes_back_through_the_model(
) -> None:
    model, runner = _piecewise_runner()
    x = torch.ones(3, 3)
    assert torch.equal(runner(x), torch.full((3, 3), 28.0))
    for wrapper in model.graph_wrappers():
        wrapper.clear()
    reset_counter()
    with pytest.raises(ff.CaptureError, match="capture window is closed"):
        runner(x)
    assert get_counter() == 0  # the plan noticed before running any op
    with model.capture_window.opened(), model.stats.expect(graphs_captured=3):
        assert torch.equal(runner(x), torch.full((3, 3), 28.0))
    with model.stats.expect(graphs_captured=0, replays=3):
        assert torch.equal(runner(2 * x), torch.full((3, 3), 37.0))


class DictOut(nn.Module):
    """A dict output with a constant beside the tensors: the plan rebuilds it every step."""

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = attention(x + 1, x, x)
        return {"h": h * 2, "tag": 7, "x2": x * 2}


def test_a_planned_piecewise_step_rebuilds_the_output_structure() -> None:
    _, runner = _piecewise_runner(DictOut())
    for step, n in enumerate([3, 3, 2, 3]):
        x = torch.randn(n, 3, generator=torch.Generator().manual_seed(step))
        out = runner(x)
        with torch.no_grad():
            want = DictOut()(x)
        assert out.keys() == want.keys() and out["tag"] == 7
        assert torch.equal(out["h"], want["h"]) and torch.equal(out["x2"], want["x2"]), step


def test_a_forward_with_a_python_side_effect_is_not_planned() -> None:
    module = KeepsLast()
    _, runner = _piecewise_runner(module)
    for n in (3, 3, 3):
        x = torch.full((n, 3), float(n))
        out = runner(x)
        assert torch.equal(out, 3 * x + 1)
        assert module.last is not None and torch.equal(module.last[:n], 3 * x + 1)
    assert runner.planned_shapes == 0


class WritesInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        x.add_(1)
        return out


def test_a_model_that_writes_its_input_copies_it_back_at_every_step() -> None:
    """Its capture saw the write, so its steps are never planned: each copies the real rows
    back, as eager would have written them."""
    cfg = CompilationConfig(mode="dynamo_trace_once", backend="eager", cudagraph_mode="full",
                            graph_backend="emulated", cudagraph_capture_sizes=SIZES,
                            max_num_tokens=MAX_TOKENS, max_num_seqs=8, use_cache=False)
    runner = GraphRunner(ff.compile(WritesInput(), cfg), cfg, inputs={"x": Tokens()},
                         progress=False)
    runner.capture()
    for _ in range(4):
        x = torch.ones(3)
        with runner.stats.expect(inputs_copied_back=1, steps_full=1):
            assert torch.equal(runner(x), torch.full((3,), 2.0))
        assert torch.equal(x, torch.full((3,), 2.0))


class TwoOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"a": x * 2, "b": [x + 1, x - 1]}


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_planned_step_returns_new_containers_the_caller_may_change(mode: str) -> None:
    """A caller that pops a key from one step's dict (or appends to its list) does not find
    the next step's output changed: every step builds its containers anew, planned or not."""
    cfg = config(mode, use_cache=False)
    runner = GraphRunner(ff.compile(TwoOutputs(), cfg), cfg, inputs={"x": Tokens(3)},
                         progress=False)
    runner.capture()
    for step in range(4):
        x = torch.full((3, 3), float(step))
        out = runner(x)
        assert sorted(out) == ["a", "b"] and len(out["b"]) == 2, step
        assert torch.equal(out["a"], 2 * x) and torch.equal(out["b"][1], x - 1), step
        out.pop("a")
        out["b"].append(out["b"][0])
    assert runner.planned_shapes == 1  # the later steps were planned


def test_a_planned_step_that_sees_an_input_written_finishes_the_whole_way() -> None:
    """The guard behind a PIECEWISE plan (its splitting ops run their Python every step):
    should a planned step move an input buffer's version counter after all, the step copies
    the write back and the plan is dropped."""
    _, runner = _piecewise_runner()
    runner(torch.ones(3, 3))
    runner(torch.ones(3, 3))
    plans = runner._stepper.plans  # (a fault injected into the one plan)
    (key, plan), = plans.items()
    replay = plan.replay

    def writes() -> Any:
        out = replay()
        runner.buffers["x"][:3].add_(1)
        return out

    plans[key] = dataclasses.replace(plan, replay=writes)
    x = torch.ones(3, 3)
    with runner.stats.expect(inputs_copied_back=1, steps_piecewise=1):
        assert torch.equal(runner(x), torch.full((3, 3), 28.0))
    assert torch.equal(x, torch.full((3, 3), 2.0))
    assert key not in plans
    x = torch.ones(3, 3)
    assert torch.equal(runner(x), torch.full((3, 3), 28.0))  # planned again, from scratch
    assert torch.equal(x, torch.ones(3, 3))


def test_planned_steps_reset_the_padding_an_earlier_shape_wrote() -> None:
    """A planned step skips resetting its padding only while its shape was the last one
    staged: a larger step in between wrote those rows, and the next planned step of the
    smaller shape fills them again (the model reads every row, padding included)."""
    _, runner = _full_runner()
    runner(torch.ones(3, 3))
    runner(torch.ones(3, 3))  # planned: 3 rows padded to 4
    assert runner.planned_shapes == 1
    for step, n in enumerate([3, 4, 3, 3, 2, 3, 8, 3]):
        x = torch.randn(n, 3, generator=torch.Generator().manual_seed(step))
        out = runner(x)
        with torch.no_grad():
            assert torch.equal(out, SillyModel()(x)), (step, n)
        pad = next(s for s in SIZES if s >= n)
        assert torch.equal(runner.buffers["x"][n:pad], torch.zeros(pad - n, 3)), (step, n)


class ReadsPadding(nn.Module):
    """Every row gets the sum over all rows the model sees, padding included, then the model
    writes into its input (padding included): the runner must hand it padding rows that hold
    the fill value at every step, whatever earlier steps (or the model) left there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + x.sum()
        x.add_(1)
        return out


@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_padding_rows_hold_the_fill_at_every_step(graph_mode: str) -> None:
    cfg = CompilationConfig(mode="dynamo_trace_once", backend="eager", cudagraph_mode=graph_mode,
                            graph_backend="emulated", cudagraph_capture_sizes=SIZES,
                            max_num_tokens=MAX_TOKENS, max_num_seqs=8, use_cache=False)
    model = ff.compile(ReadsPadding(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens()}, progress=False)
    runner.capture()
    eager = ReadsPadding()
    # the first two steps: the model's write into the padding row must be reset before the
    # second; then a larger step leaves rows behind that smaller ones must not see
    for step, n in enumerate([3, 3, 7, 3, 3, 1, 3, 8, 2, 3, 3]):
        mine = torch.arange(1.0, n + 1) * (step + 1)
        theirs = mine.clone()
        with torch.no_grad():
            want = eager(theirs)
        assert torch.equal(runner(mine), want), (step, n)
        assert torch.equal(mine, theirs), (step, n)  # the write reached the caller's rows only
