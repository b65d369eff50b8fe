"""GraphRunner inputs and outputs end to end: padded rows hold their fills and never touch the real
rows, bad inputs are refused naming the input, what was expected and what came, outputs are cut
per kind (tokens, requests, none) with static inputs and positional calls, inputs the model
writes into reach the caller as in eager (also when a replay writes without the dispatcher), and
a step of the whole token budget replays a graph. Every scenario runs on every graph backend
present (the ``rig`` fixture)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import CompilationConfig, CUDAGraphMode
from freezeframe.context import get_forward_context
from freezeframe.errors import ConfigError, InputMismatchError, ShapeOutOfRangeError
from freezeframe.runtime import GraphRunner, Requests, Static, Tokens
from tests.helpers.silly import attention
from tests.scenarios.conftest import Rig
from tests.scenarios.runners import SIZES, config
from tests.scenarios.test_runner_modes import CAPTURES, Recorder

FULL = CUDAGraphMode.FULL


def whole_model_config(rig: Rig, graph_mode: str, **kw: Any) -> CompilationConfig:
    """Mode NONE: no trace, the whole module in one graph (no split)."""
    return config(rig, graph_mode, mode="none", splitting_ops=None, **kw)


def on(rig: Rig, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(rig.device) for t in tensors)


# -- padded rows -----------------------------------------------------------------------------
class CacheWriter(nn.Module):
    """Writes every real token into a cache row chosen by its slot id and scales by a per-token
    divisor. Padded rows carry slot -1 and divisor 1: the write masks them out (a plain
    ``cache[slots] = x`` would write row -1, the *last real row*) and the division stays
    finite (a zero divisor would give inf)."""

    cache: torch.Tensor

    def __init__(self, num_slots: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(num_slots, hidden))

    def forward(self, x: torch.Tensor, slots: torch.Tensor,
                divisor: torch.Tensor) -> torch.Tensor:
        keep = (slots >= 0).to(x.dtype).unsqueeze(-1)            # (tokens, 1)
        self.cache.index_add_(0, slots.clamp(min=0), x * keep)   # padded rows add zeros
        return x / divisor.unsqueeze(-1)                         # (tokens, hidden)


@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_padded_rows_are_reset_finite_and_never_touch_real_rows(rig: Rig,
                                                                graph_mode: str) -> None:
    cfg = whole_model_config(rig, graph_mode, max_num_seqs=256)
    module = CacheWriter(num_slots=16, hidden=2).to(rig.device)
    model = ff.compile(module, cfg)
    runner = GraphRunner(model, cfg, progress=False, outputs="none", device=rig.device, inputs={
        "x": Tokens(2),
        "slots": Tokens(dtype=torch.long, fill=-1),
        "divisor": Tokens(fill=1.0),
    })
    runner.capture()
    module.cache.zero_()  # capture passes were dummy steps that wrote nothing real

    # A large step fills 8 rows with data, then a 3-token step pads to 4.
    runner(*on(rig, torch.full((8, 2), 5.0), torch.arange(8), torch.full((8,), 2.0)))
    module.cache.zero_()
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    out = rig.host(runner(*on(rig, x, torch.tensor([15, 3, 7]), torch.tensor([1.0, 2.0, 4.0]))))

    padded = 4 if graph_mode == "full" else 3  # without graphs a step is not padded
    assert out.shape == (padded, 2)  # outputs="none": the padded rows are visible
    assert torch.isfinite(out).all()
    assert torch.equal(out[:3], x / torch.tensor([[1.0], [2.0], [4.0]]))
    if graph_mode == "full":
        assert torch.equal(out[3], torch.zeros(2))
        # The padded row holds the fills, not the stale 8-token step.
        assert rig.host(runner.buffers["x"][3]).tolist() == [0.0, 0.0]
        assert rig.host(runner.buffers["slots"][3]).item() == -1
        assert rig.host(runner.buffers["divisor"][3]).item() == 1.0
    expected = torch.zeros(16, 2)
    expected[15], expected[3], expected[7] = x[0], x[1], x[2]
    assert torch.equal(rig.host(module.cache), expected)  # row 15 once, nothing else touched


# -- validation ---------------------------------------------------------------------------------
def test_input_validation_names_the_input_expected_and_got(rig: Rig) -> None:
    runner = GraphRunner(Recorder(), config(rig, "full"), progress=False, device=rig.device,
                         inputs={"x": Tokens(2), "seq_lens": Requests(dtype=torch.int32)})

    def ones(*shape: int, **kw: Any) -> torch.Tensor:
        return torch.ones(*shape, **{"device": rig.device, **kw})

    lens = ones(1, dtype=torch.int32)
    with pytest.raises(InputMismatchError, match=r"'x': expected dtype torch.float32, got "
                                                 r"torch.float64"):
        runner(ones(2, 2, dtype=torch.float64), lens)
    with pytest.raises(InputMismatchError, match=rf"'x': expected device "
                                                 rf"{re.escape(str(runner.device))}, got meta"):
        runner(ones(2, 2, device="meta"), lens)
    with pytest.raises(InputMismatchError, match=r"'x': expected shape \[tokens, 2\], got "
                                                 r"\[2, 3\]"):
        runner(ones(2, 3), lens)
    with pytest.raises(ShapeOutOfRangeError, match="0 tokens"):
        runner(ones(0, 2), lens[:0])
    with pytest.raises(ShapeOutOfRangeError, match=r"13 tokens.*max_num_tokens=12"):
        runner(ones(13, 2), lens)
    with pytest.raises(ShapeOutOfRangeError, match=r"9 requests.*max_num_seqs=8"):
        runner(ones(10, 2), ones(9, dtype=torch.int32))
    with pytest.raises(InputMismatchError, match="unknown input 'y'"):
        runner(ones(2, 2), lens, y=lens)
    with pytest.raises(InputMismatchError, match=r"missing input\(s\) \['seq_lens'\]"):
        runner(ones(2, 2))
    with pytest.raises(InputMismatchError, match="uniform_decode=True needs"):
        runner(ones(3, 2), ones(2, dtype=torch.int32), uniform_decode=True)
    with pytest.raises(ConfigError, match="reserved"):
        GraphRunner(Recorder(), config(rig, "full"), device=rig.device,
                    inputs={"x": Tokens(2), "extras": Static(1)})
    with pytest.raises(ConfigError, match="at least one input must be Tokens"):
        GraphRunner(Recorder(), config(rig, "full"), device=rig.device,
                    inputs={"seq_lens": Requests()})
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


def test_outputs_sliced_per_kind_static_inputs_and_positional_calls(rig: Rig) -> None:
    cfg = whole_model_config(rig, "full")
    model = ff.compile(TwoHeads(), cfg)
    example = torch.zeros(5, 2, dtype=torch.float16, device=rig.device)
    inputs = {"x": ff.runtime.InputSpec.like(example), "seq_lens": Requests(dtype=torch.long),
              "scale": Static(2, dtype=torch.float16, fill=1)}
    runner = GraphRunner(model, inputs=inputs, outputs=("tokens", "requests", "none"),
                         call_positional=True, device=rig.device, progress=False)
    assert runner.config is cfg  # taken from model.config
    runner.capture()
    x = torch.arange(10, dtype=torch.float16).reshape(5, 2)
    scale = torch.tensor([2.0, 3.0], dtype=torch.float16)
    tokens, reqs, static = (rig.host(t) for t in runner(*on(rig, x, torch.tensor([2, 3]),
                                                            scale)))
    assert torch.equal(tokens, x * scale)                    # 5 of 8 padded rows
    assert torch.equal(reqs, torch.tensor([4, 6]))          # 2 of min(8, 8) request rows
    assert torch.equal(static, scale)
    assert model.stats.replays == 1
    with pytest.raises(InputMismatchError, match=r"static input expected shape \[2\]"):
        runner(*on(rig, x, torch.tensor([2, 3]), torch.ones(3, dtype=torch.float16)))
    with pytest.raises(ConfigError, match="disagrees with the model's"):
        GraphRunner(model, config(rig, "piecewise"), inputs=inputs, device=rig.device)


def test_a_step_of_the_whole_token_budget_replays_a_graph(rig: Rig) -> None:
    """max_num_tokens=100 lies between the ladder's 96 and 104: the budget itself is captured,
    so a 100-token step replays a graph (a strict runner would raise on an eager fallback)."""
    cfg = whole_model_config(rig, "full", cudagraph_capture_sizes=None, max_num_tokens=100,
                             max_num_seqs=128)
    model = ff.compile(TwoHeads(), cfg)
    runner = GraphRunner(model, progress=False, strict=True, outputs=("tokens", "none", "none"),
                         device=rig.device,
                         inputs={"x": Tokens(2), "seq_lens": Requests(dtype=torch.long),
                                 "scale": Static(2, fill=1)})
    report = runner.capture()
    assert report.num_graphs == len(cfg.cudagraph_capture_sizes or ()) == 16
    assert report.graphs[0].descriptor.num_tokens == 100
    scale = torch.tensor([2.0, 3.0])
    for n in (100, 97, 96, 1):
        x = torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)
        tokens, _, _ = runner(*on(rig, x, torch.ones(1, dtype=torch.long), scale))
        assert torch.equal(rig.host(tokens), x * scale), n
    assert runner.stats.steps_full == 4
    assert model.stats.replays == 4


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


def writer_inputs(n: int, reqs: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Integer-valued inputs on the CPU (so sums are exact in any order)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (n, 2), generator=g).float()
    slots = torch.randperm(6, generator=g)[:n] if n <= 6 else torch.arange(n) % 6
    seen = torch.randint(0, 9, (reqs,), generator=g, dtype=torch.int32)
    cache = torch.randint(-4, 5, (6, 2), generator=g).float()
    return x, slots, seen, cache


def writer_runner(cfg: CompilationConfig,
                  device: torch.device | str = "cpu") -> tuple[Any, GraphRunner]:
    """:class:`InPlaceWriter` compiled with ``cfg`` behind a captured runner with one input of
    each kind."""
    model = ff.compile(InPlaceWriter(), cfg)
    runner = GraphRunner(model, cfg, progress=False, device=device, inputs={
        "x": Tokens(2), "slots": Tokens(dtype=torch.long, fill=-1),
        "seen": Requests(dtype=torch.int32), "cache": Static(6, 2)})
    runner.capture()
    return model, runner


@pytest.mark.parametrize("mode", list(CAPTURES))
def test_inputs_written_by_the_model_reach_the_caller_as_in_eager(rig: Rig, mode: str) -> None:
    """A model that writes into an input tensor writes into the caller's tensor in eager; the
    runner runs it on its static copy, so it copies the written inputs back (real rows only)."""
    _, runner = writer_runner(config(rig, mode), rig.device)
    eager = InPlaceWriter()
    for step_no, (n, reqs) in enumerate([(3, 2), (8, 8), (1, 1), (5, 5), (11, 3), (4, 4)]):
        mine = on(rig, *writer_inputs(n, reqs, seed=step_no))
        theirs = tuple(t.clone() for t in mine)
        want = rig.host(eager(*theirs))
        got = rig.host(runner(*mine, uniform_decode=(n == reqs)))
        assert torch.equal(got, want), (mode, n)
        for name, a, b in zip(("x", "slots", "seen", "cache"), mine, theirs, strict=True):
            assert torch.equal(rig.host(a), rig.host(b)), (mode, n, name)
    assert runner.stats.inputs_copied_back == 6 * 3


class VersionlessReplay(nn.Module):
    """Writes ``x += 1`` like a captured graph on CUDA does: the capture goes through the
    dispatcher (bumping ``x``'s version counter), a replay writes the memory behind its back
    (here through ``.data``, which shares the storage but not the version counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.captured: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        assert ctx is not None and ctx.batch_descriptor is not None
        n = ctx.batch_descriptor.num_tokens
        if ctx.mode is FULL and n in self.captured:
            x.data.add_(1)  # a replay: same memory, no version bump
        else:
            if ctx.mode is FULL:
                self.captured.add(n)
            x.add_(1)
        return x * 2


def test_inputs_a_replay_writes_without_the_dispatcher_are_copied_back(rig: Rig) -> None:
    model = VersionlessReplay()
    runner = GraphRunner(model, config(rig, "full"), inputs={"x": Tokens(2)}, progress=False,
                         device=rig.device, copy_outputs=True)
    runner.capture()
    assert model.captured == set(SIZES)
    for n in (3, 8, 12):  # 12 is above the largest capture size: eager, version bumped
        x = torch.arange(2 * n, dtype=torch.float32, device=rig.device).reshape(n, 2)
        want = rig.host((x + 1) * 2)
        got = rig.host(runner(x))
        assert torch.equal(got, want), n
        assert torch.equal(rig.host(x), want / 2), n  # the caller's tensor was written, as
        # in eager
    assert runner.stats.steps_full == 2 and runner.stats.inputs_copied_back == 3
