"""GraphRunner steps give eager's answer where a runner could easily not: capture's dummy steps
leave no trace in the model's buffers, an output that is not token-shaped is not cut to the real
rows, inputs sharing memory are refused when the model writes one, a capture under the
force_eager stance is refused instead of capturing nothing, and the caller's frozen objects stay
frozen. Every scenario runs on every graph backend present (the ``rig`` fixture)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import CompilationConfig
from freezeframe.errors import CaptureError, ConfigError, InputMismatchError
from freezeframe.runtime import GraphRunner, Static, Tokens
from tests.helpers.silly import attention
from tests.scenarios.conftest import Rig

MODES = ["piecewise", "full", "full_and_piecewise"]


def config(rig: Rig, mode: str, **kw: Any) -> CompilationConfig:
    fields: dict[str, Any] = dict(cudagraph_capture_sizes=[1, 2, 4, 8], max_num_tokens=8,
                                  max_num_seqs=8)
    fields.update(kw)
    return rig.config(mode, **fields)


def arange(rig: Rig, n: float, *shape: int) -> torch.Tensor:
    return torch.arange(n, device=rig.device).reshape(*shape)


def ones(rig: Rig, *shape: int) -> torch.Tensor:
    return torch.ones(*shape, device=rig.device)


class Counting(nn.Module):
    """Counts its calls and the tokens it has seen in buffers, as a running statistic does."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("tokens_seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.tokens_seen.add_((x[:, 0] >= 0).sum())  # padded rows hold -1
        return attention(x, x, x) + self.calls


@pytest.mark.parametrize("mode", MODES)
def test_capture_leaves_the_model_buffers_as_eager_would(rig: Rig, mode: str) -> None:
    """Capture runs warm-ups and captures for every size (dummy steps eager never made):
    afterwards the buffers hold what they held before."""
    cfg = config(rig, mode)
    mine, theirs = Counting().to(rig.device), Counting().to(rig.device)
    runner = GraphRunner(ff.compile(mine, cfg), cfg, progress=False, device=rig.device,
                         inputs={"x": Tokens(2, fill=-1.0)})
    runner.capture()
    assert (mine.calls.item(), mine.tokens_seen.item()) == (0.0, 0.0)
    assert runner.stats.buffers_restored == 2
    x = ones(rig, 3, 2)
    assert torch.equal(rig.host(runner(x)), rig.host(theirs(x)))
    assert (mine.calls.item(), mine.tokens_seen.item()) == (1.0, 3.0)


class WithTable(nn.Module):
    """Returns token rows, a row derived from a Static input, and a weight-shaped table: the
    last two have a fixed dim 0 (4) that equals the padded size of a 3-token step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(16.0).reshape(4, 4), requires_grad=False)

    def forward(self, x: torch.Tensor, meta: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return attention(x @ self.w, x, x), meta * 2, self.w * 1


@pytest.mark.parametrize("mode", MODES)
def test_outputs_whose_dim0_does_not_follow_the_step_are_not_cut(rig: Rig, mode: str) -> None:
    cfg = config(rig, mode)
    runner = GraphRunner(ff.compile(WithTable().to(rig.device), cfg,
                                    dynamic_arg_dims={"x": 0}), cfg,
                         inputs={"x": Tokens(4), "meta": Static(4)}, device=rig.device,
                         progress=False)
    runner.capture()
    x, meta = arange(rig, 12.0, 3, 4), arange(rig, 4.0, 4)
    got, want = runner(x, meta), WithTable().to(rig.device)(x, meta)
    assert [tuple(t.shape) for t in got] == [(3, 4), (4,), (4, 4)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(rig.host(a), rig.host(b))


class Clipped(nn.Module):
    """Returns at most four rows: dim 0 follows the step up to 4 (1, 2, 4, 4 at the sizes
    1, 2, 4, 8), so it is cut to the real rows wherever it is the padded size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(x * 2, x, x)[:4]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8])
def test_an_output_clipped_to_fixed_rows_is_cut_where_it_follows_the_step(rig: Rig, mode: str,
                                                                          n: int) -> None:
    cfg = config(rig, mode)
    runner = GraphRunner(ff.compile(Clipped(), cfg), cfg, progress=False, device=rig.device,
                         inputs={"x": Tokens(2, fill=-7.0)})
    runner.capture()
    x = arange(rig, 2.0 * n, n, 2)
    got = rig.host(runner(x))
    assert tuple(got.shape) == (min(n, 4), 2)
    assert torch.equal(got, rig.host(Clipped()(x)))


class Flattened(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(x * 2, x, x).flatten()


def test_a_flattened_per_token_output_is_refused_where_it_holds_padding(rig: Rig) -> None:
    """dim 0 = 2 x the padded size: cutting the first 2 x n elements is right for flatten()
    but not for repeat(), so the runner says so instead of returning the padding rows (8
    elements for eager's 6)."""
    cfg = config(rig, "full_and_piecewise")
    runner = GraphRunner(ff.compile(Flattened(), cfg), cfg, progress=False, device=rig.device,
                         inputs={"x": Tokens(2)})
    runner.capture()
    x = arange(rig, 8.0, 4, 2)
    # no padding at a captured size
    assert torch.equal(rig.host(runner(x)), rig.host(Flattened()(x)))
    with pytest.raises(ConfigError, match=r"output 0 \(a tensor of shape \(8,\)\) has a dim 0 of "
                                          r"2 x the padded token count.*outputs='none'"):
        runner(x[:3])


class WritesX(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return attention(y * 2, y, y)


class ReadsBoth(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return attention(x + y, x, y)


@pytest.mark.parametrize("captured", [True, False])
def test_one_tensor_passed_as_two_inputs_the_model_writes_is_refused(rig: Rig,
                                                                     captured: bool) -> None:
    """Eagerly ``y`` sees the write into ``x`` (the same tensor); two staging buffers would
    not. A step of a captured size knows the write from the capture and refuses before
    running; an uncaptured one finds it from the version counters after the step."""
    cfg = config(rig, "full_and_piecewise")
    runner = GraphRunner(ff.compile(WritesX(), cfg), cfg, progress=False, device=rig.device,
                         inputs={"x": Tokens(2), "y": Tokens(2)})
    if captured:
        runner.capture()
    t = ones(rig, 3, 2)
    with pytest.raises(InputMismatchError, match=r"inputs 'x' and 'y' share memory and the "
                                                 r"model writes into 'x'.*y=y\.clone\(\)"):
        runner(t, t)
    a, b = ones(rig, 3, 2), ones(rig, 3, 2)
    assert torch.equal(rig.host(runner(a, b)),
                       rig.host(WritesX()(ones(rig, 3, 2), ones(rig, 3, 2))))
    assert torch.equal(rig.host(a), torch.full((3, 2), 2.0))


def test_one_tensor_passed_as_two_inputs_nothing_writes_is_fine(rig: Rig) -> None:
    cfg = config(rig, "full_and_piecewise")
    runner = GraphRunner(ff.compile(ReadsBoth(), cfg), cfg, progress=False, device=rig.device,
                         inputs={"x": Tokens(2), "y": Tokens(2)})
    runner.capture()
    t = arange(rig, 6.0, 3, 2)
    assert torch.equal(rig.host(runner(t, t)), rig.host(ReadsBoth()(t, t)))


@pytest.mark.parametrize("captured", [True, False])
def test_disjoint_views_of_one_storage_are_independent_inputs(rig: Rig,
                                                              captured: bool) -> None:
    """``t[:3]`` and ``t[3:]`` share a storage but no byte: eagerly the write into x does
    not show through y, so the runner's separate staging gives eager's answer."""
    cfg = config(rig, "full_and_piecewise")
    runner = GraphRunner(ff.compile(WritesX(), cfg), cfg, progress=False, device=rig.device,
                         inputs={"x": Tokens(2), "y": Tokens(2)})
    if captured:
        runner.capture()
    t, e = arange(rig, 12.0, 6, 2), arange(rig, 12.0, 6, 2)
    got, want = runner(t[:3], t[3:]), WritesX()(e[:3], e[3:])
    assert torch.equal(rig.host(got), rig.host(want))
    assert torch.equal(rig.host(t), rig.host(e))


def test_interleaved_column_views_are_independent_inputs(rig: Rig) -> None:
    """``q, k = qkv.split(...)`` along the last dim: their byte ranges interleave, but they
    share no element, so a write into q does not show through k eagerly either."""
    cfg = config(rig, "full_and_piecewise")
    runner = GraphRunner(ff.compile(WritesX(), cfg), cfg, progress=False, device=rig.device,
                         inputs={"x": Tokens(2), "y": Tokens(2)})
    runner.capture()
    t, e = arange(rig, 12.0, 3, 4), arange(rig, 12.0, 3, 4)
    got, want = runner(*t.split([2, 2], dim=-1)), WritesX()(*e.split([2, 2], dim=-1))
    assert torch.equal(rig.host(got), rig.host(want))
    assert torch.equal(rig.host(t), rig.host(e))


class AddsOne(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return attention(x * 10, x, x)


@pytest.mark.parametrize("inference", [True, False])
def test_an_output_passed_back_in_to_a_model_that_writes_its_input(rig: Rig,
                                                                   inference: bool) -> None:
    """The second step's input is the first step's output (a view of the runner's output
    memory). Writing the input back used to overwrite the new answer (25 for 300), and
    outside inference mode it raised "Inplace update to inference tensor"."""
    cfg = config(rig, "full_and_piecewise")
    runner = GraphRunner(ff.compile(AddsOne(), cfg), cfg, progress=False, device=rig.device,
                         inputs={"x": Tokens(2)})
    runner.capture()
    mode = torch.inference_mode() if inference else torch.no_grad()
    with mode:
        first, eager_first = runner(ones(rig, 3, 2)), AddsOne()(ones(rig, 3, 2))
        second, eager_second = runner(first), AddsOne()(eager_first)
    assert torch.equal(rig.host(second), rig.host(eager_second))
    # the write into the input reached it
    assert torch.equal(rig.host(first), rig.host(eager_first))


def test_overlapping_views_the_model_writes_are_refused(rig: Rig) -> None:
    cfg = config(rig, "full_and_piecewise")
    runner = GraphRunner(ff.compile(WritesX(), cfg), cfg, progress=False, device=rig.device,
                         inputs={"x": Tokens(2), "y": Tokens(2)})
    runner.capture()
    t = arange(rig, 12.0, 6, 2)
    with pytest.raises(InputMismatchError, match=r"inputs 'x' and 'y' share memory"):
        runner(t[:4], t[2:])


class Plain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(x * 3, x, x)


def test_capture_under_force_eager_is_refused_and_the_runner_still_works(rig: Rig) -> None:
    """It used to report graphs while none were captured, and later steps raised."""
    cfg = config(rig, "full_and_piecewise")
    model = ff.compile(Plain(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(2)}, device=rig.device,
                         progress=False)
    x = arange(rig, 6.0, 3, 2)
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(CaptureError, match=r"stance is force_eager, so the model runs "
                                               r"eagerly and would capture no graph"):
            runner.capture()
        assert torch.equal(rig.host(runner(x)), rig.host(Plain()(x)))
    assert not runner.captured
    report = runner.capture()
    assert report.num_graphs == 8
    assert torch.equal(rig.host(runner(x)), rig.host(Plain()(x)))
    assert model.stats.replays == 1


def test_with_compiling_disabled_for_the_process_capture_captures_nothing_and_steps_serve(
        rig: Rig, ff_logs: pytest.LogCaptureFixture) -> None:
    """TORCH_COMPILE_DISABLE=1 means 'run my program without compiling': capture() used to
    raise; it captures nothing, says so once, and every step runs eagerly."""
    cfg = config(rig, "full_and_piecewise")
    model = ff.compile(Plain(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(2)}, device=rig.device,
                         progress=False)
    with torch._dynamo.config.patch(disable=True):
        report = runner.capture()
        assert report.num_graphs == 0
        for n in (3, 1, 3):
            x = arange(rig, 2.0 * n, n, 2)
            assert torch.equal(rig.host(runner(x)), rig.host(Plain()(x)))
    assert runner.stats.get("fallback_compile_disabled") == 3
    assert model.stats.get("graphs_captured") == 0
    assert model.stats.get("compile_disabled") == 3
    messages = [r.getMessage() for r in ff_logs.records]
    assert sum("compiling is disabled for the process" in m for m in messages) == 2  # capture,
    # and the first step's fallback, each once


def test_capture_keeps_the_callers_frozen_objects_frozen(rig: Rig) -> None:
    """``gc.unfreeze()`` after capture used to unfreeze what a server froze at start-up."""
    cfg = config(rig, "piecewise")
    runner = GraphRunner(ff.compile(Plain(), cfg), cfg, inputs={"x": Tokens(2)},
                         device=rig.device, progress=False)
    sentinel: list[int] = [1, 2]  # a tracked object the caller froze
    gc.freeze()
    try:
        assert not any(o is sentinel for o in gc.get_objects())
        runner.capture()
        assert not any(o is sentinel for o in gc.get_objects())  # still frozen
        assert gc.isenabled()
    finally:
        gc.unfreeze()


class _Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def test_a_stock_torch_compile_capture_leaves_later_compiles_of_the_class_working(
        rig: Rig) -> None:
    """The emulated recorder used to make Dynamo skip the frame it saw under the capture and
    mark forward's code object (every instance's) as never to compile again: every later
    ff.compile and torch.compile(fullgraph=True) of the class failed."""
    cfg = ff.CompilationConfig(mode="stock_torch_compile", backend="eager",
                               cudagraph_mode="full", graph_backend=rig.backend,
                               cudagraph_capture_sizes=[1, 2, 4], max_num_tokens=8)
    module = _Lin().to(rig.device)
    runner = GraphRunner(ff.compile(module, cfg), cfg, inputs={"x": Tokens(2)},
                         device=rig.device, progress=False)
    assert runner.capture().num_graphs == 3
    for n in (3, 1, 4):
        x = rig.randn(n, 2)
        with torch.no_grad():
            torch.testing.assert_close(rig.host(runner(x)), rig.host(module(x)))
    x = rig.randn(3, 2)
    again = ff.compile(_Lin().to(rig.device), config(rig, "none"))
    with torch.no_grad():
        torch.testing.assert_close(rig.host(again(x)), rig.host(_Lin().to(rig.device)(x)))
        compiled = torch.compile(_Lin().to(rig.device), fullgraph=True, backend="eager")
        torch.testing.assert_close(rig.host(compiled(x)), rig.host(_Lin().to(rig.device)(x)))
