"""FULL graphs across micro-batches: a split step captured whole (every micro-batch's work in one
graph, on the model's graph backend) and replayed without threads, the memory it reads kept as
long as it lives, new inputs copied in, and the counted fallbacks (a step cut elsewhere, an
unsplit step at a size captured split, a capture outside the window); then end to end through
``ff.compile`` and a GraphRunner with ``micro_batching`` on. The micro-batch model and helpers
are tests/scenarios/test_ubatch.py's. Every scenario runs on every graph backend present (the
``rig`` fixture)."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import get_forward_context
from freezeframe.graphs import CaptureWindow
from freezeframe.graphs.backend import GraphBackend, resolve_backend
from freezeframe.runtime import GraphRunner, Tokens
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from freezeframe.stats import Stats
from tests.scenarios.conftest import Rig
from tests.scenarios.test_ubatch import HIDDEN, CommModel, inputs, make_plan, same, step

FULL = CUDAGraphMode.FULL


def graph_backend(rig: Rig) -> GraphBackend:
    backend = resolve_backend(rig.backend)
    assert backend is not None
    return backend


@pytest.fixture
def model(rig: Rig) -> Iterator[CommModel]:
    with torch.inference_mode():
        yield CommModel(rig.device)


# -- FULL graphs across micro-batches ------------------------------------------------------------
def test_full_graph_captured_across_micro_batches_then_replayed(rig: Rig,
                                                                model: CommModel) -> None:
    stats = Stats()
    wrapper = MicroBatchWrapper(model, backend=graph_backend(rig), stats=stats, timeout_s=30)
    plan = make_plan([3, 5], 8)
    static_x = inputs(rig, 8, seed=1)  # the static input buffer the graph is captured on

    with stats.expect(graphs_captured=1, replays=0, micro_batched_steps=1):
        captured = step(wrapper, static_x, plan, FULL)
    assert wrapper.captured_descriptors == [ff.BatchDescriptor(num_tokens=8)]
    calls = model.calls

    # new data written into the static buffer, then a replay: no threads, no Python
    for seed in (2, 3):
        static_x.copy_(inputs(rig, 8, seed=seed))
        with torch.inference_mode():
            expected = CommModel(rig.device)(static_x)  # same weights (same seed)
        threads_before = threading.active_count()
        with stats.expect(graphs_captured=0, replays=1):
            out = step(wrapper, static_x, plan, FULL)
        assert threading.active_count() == threads_before
        assert model.calls == calls  # the model's Python did not run again
        assert same(rig, out, expected)
        assert out is captured  # replay writes into the captured output


def test_tensors_slice_extras_made_before_the_capture_live_as_long_as_the_split_graph(
        rig: Rig, model: CommModel) -> None:
    """slice_extras makes each micro-batch's metadata before the capture begins (outside the
    graph's pool); the graph reads that memory on every replay, so the wrapper keeps it until
    the graph is dropped (on CUDA, freeing it let the next allocation take it)."""
    made: list[weakref.ref[torch.Tensor]] = []

    def extras(index: int, sl: Any, parent: Any) -> dict[str, Any]:
        t = torch.full((1,), float(index), device=rig.device)
        made.append(weakref.ref(t))
        return {"offset": t}

    wrapper = MicroBatchWrapper(model, backend=graph_backend(rig), timeout_s=30,
                                slice_extras=extras)
    step(wrapper, inputs(rig, 8), make_plan([4, 4], 8), FULL)
    gc.collect()
    assert len(made) == 2 and all(ref() is not None for ref in made)
    wrapper.clear()
    gc.collect()
    assert all(ref() is None for ref in made)


def test_split_graph_replay_copies_a_new_input_tensor_in(rig: Rig, model: CommModel) -> None:
    """The split graph goes through GraphWrapper, so a replay given a new tensor (not the
    captured buffer) copies it in and answers for it, instead of replaying stale data."""
    stats = Stats()
    wrapper = MicroBatchWrapper(model, backend=graph_backend(rig), stats=stats, timeout_s=30)
    plan = make_plan([4, 4], 8)
    step(wrapper, inputs(rig, 8, seed=1), plan, FULL)
    x = inputs(rig, 8, seed=7)
    with torch.inference_mode():
        expected = CommModel(rig.device)(x)
    with stats.expect(replays=1, graphs_captured=0, replay_input_copies=1):
        out = step(wrapper, x, plan, FULL)
    assert same(rig, out, expected)


def test_split_step_cut_elsewhere_runs_without_the_graph(rig: Rig, model: CommModel) -> None:
    stats = Stats()
    wrapper = MicroBatchWrapper(model, backend=graph_backend(rig), stats=stats, timeout_s=30)
    static_x = inputs(rig, 8, seed=1)
    step(wrapper, static_x, make_plan([4, 4], 8), FULL)
    static_x.copy_(inputs(rig, 8, seed=3))
    with torch.inference_mode():
        expected = CommModel(rig.device)(static_x)
    with stats.expect(micro_batch_fallbacks=1, replays=0, graphs_captured=0,
                      micro_batched_steps=1):
        out = step(wrapper, static_x, make_plan([3, 5], 8), FULL)
    assert same(rig, out, expected)
    with stats.expect(micro_batch_fallbacks=0, replays=1):
        out = step(wrapper, static_x, make_plan([4, 4], 8), FULL)
    assert same(rig, out, expected)


def test_unsplit_step_at_a_split_captured_size_falls_back_eagerly(rig: Rig,
                                                                  model: CommModel) -> None:
    unsplit_calls: list[int] = []

    def unsplit(x: torch.Tensor) -> torch.Tensor:  # stands in for the FULL GraphWrapper
        unsplit_calls.append(x.shape[0])
        return model(x)

    stats = Stats()
    wrapper = MicroBatchWrapper(model, backend=graph_backend(rig), unsplit=unsplit, stats=stats,
                                timeout_s=30)
    step(wrapper, inputs(rig, 8), make_plan([4, 4], 8), FULL)

    x = inputs(rig, 8, seed=5)
    with torch.inference_mode():
        expected = model(x)
    seen_modes: list[CUDAGraphMode] = []
    original_forward = model.forward

    def spy(x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        assert ctx is not None
        seen_modes.append(ctx.mode)
        return original_forward(x)

    model.forward = spy  # type: ignore[method-assign]
    with stats.expect(micro_batch_fallbacks=1, graphs_captured=0, replays=0):
        out = step(wrapper, x, None, FULL)  # the DP ranks declined this time
    assert same(rig, out, expected)
    assert seen_modes == [CUDAGraphMode.NONE]  # nothing below tries to capture over the graph
    assert unsplit_calls == []

    # a size never captured split goes through the unsplit path as usual
    with stats.expect(micro_batch_fallbacks=0):
        step(wrapper, inputs(rig, 6), None, FULL)
    assert unsplit_calls == [6]


def test_capture_outside_window_is_refused(rig: Rig, model: CommModel) -> None:
    wrapper = MicroBatchWrapper(model, backend=graph_backend(rig),
                                window=CaptureWindow(is_open=False), timeout_s=30)
    with pytest.raises(ff.CaptureError, match="capture window is closed"):
        step(wrapper, inputs(rig, 8), make_plan([4, 4], 8), FULL)
    assert wrapper.captured_descriptors == []


# -- end to end: ff.compile + GraphRunner with micro_batching on ---------------------------------
@torch.library.custom_op("ffubatchtest::fake_comm", mutates_args=())
def fake_comm(x: torch.Tensor) -> torch.Tensor:
    """A "communication" op. Yield points live inside a custom op: Dynamo records the op as one
    call and never traces its Python, which runs (and yields) at execution time."""
    ff.ubatch.yield_to_comm()
    y = x * 2 + 1
    ff.ubatch.yield_to_compute()
    return y


@fake_comm.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class CompiledCommModel(nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        base = CommModel(device)
        self.w1, self.w2 = base.w1, base.w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fake_comm(x @ self.w1)
        return torch.relu(h @ self.w2)


def e2e_config(rig: Rig, **kw: Any) -> CompilationConfig:
    """One FULL graph of 8 tokens, captured split in two (no splitting ops: one whole graph)."""
    fields: dict[str, Any] = dict(
        mode="dynamo_trace_once", splitting_ops=None, cudagraph_capture_sizes=[8],
        max_num_tokens=8, max_num_seqs=8, micro_batching=True, micro_batch_decode_threshold=2,
        micro_batch_prefill_threshold=2)
    fields.update(kw)
    return rig.config("full", **fields)


def e2e_runner(rig: Rig, module: nn.Module) -> tuple[Any, GraphRunner]:
    """``module`` compiled with :func:`e2e_config`, behind a captured micro-batching runner."""
    cfg = e2e_config(rig)
    model = ff.compile(module, cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(HIDDEN)}, progress=False,
                         device=rig.device)
    assert runner.micro_batches is not None
    runner.micro_batches.timeout_s = 60
    runner.capture()
    return model, runner


def test_runner_captures_split_full_graph_and_replays_it(rig: Rig) -> None:
    cfg = e2e_config(rig)
    eager = CompiledCommModel(rig.device)
    model = ff.compile(eager, cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(HIDDEN)}, progress=False,
                         device=rig.device)
    assert runner.micro_batches is not None
    runner.micro_batches.timeout_s = 60
    with model.stats.expect(graphs_captured=1):
        runner.capture()
    assert runner.micro_batches is not None
    assert [d.num_tokens for d in runner.micro_batches.captured_descriptors] == [8]
    # split and unsplit graphs share the model's backend, so its one memory pool
    assert runner.micro_batches.backend is model.graph_backend
    # the first (tracing) call ran unsplit, outside any micro-batch thread
    assert model.stats.micro_batch_unsplit_first_calls == 1

    for tokens, seed in ((7, 11), (5, 12), (8, 13)):  # all pad to 8 and split at 4
        x = inputs(rig, tokens, seed=seed)
        with torch.inference_mode():
            expected = eager(x)
        with model.stats.expect(replays=1, graphs_captured=0, micro_batch_fallbacks=0):
            out = runner(x)
        assert same(rig, out, expected)

    # 3 tokens padded to 8: the cut at 4 would leave micro-batch 1 all padding, so the step
    # runs unsplit; its size was captured split, so it runs eagerly (counted)
    x = inputs(rig, 3, seed=14)
    with torch.inference_mode():
        expected = eager(x)
    with model.stats.expect(micro_batch_fallbacks=1, replays=0, graphs_captured=0):
        out = runner(x)
    assert same(rig, out, expected)


def test_runner_cuts_between_the_requests_it_is_given(rig: Rig) -> None:
    """``num_scheduled_tokens`` tells the runner where requests end; a step laid out other
    than the captured one (captured without request counts: one request) runs its
    micro-batches without the split graph, counted, and still gives eager's answer."""
    eager = CompiledCommModel(rig.device)
    model, runner = e2e_runner(rig, CompiledCommModel(rig.device))
    seen: list[tuple[int, int, int, int]] = []
    body = model.forward

    def spy(x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        assert ctx is not None and ctx.micro_batch is not None
        sl = ctx.micro_batch
        seen.append((sl.token_start, sl.token_stop, sl.req_start, sl.req_stop))
        return body(x)

    model.forward = spy  # type: ignore[method-assign]
    x = inputs(rig, 8, seed=31)
    with torch.inference_mode():
        expected = eager(x)
    with model.stats.expect(micro_batch_fallbacks=1, replays=0, micro_batched_steps=1):
        out = runner(x, num_scheduled_tokens=[3, 5], num_reqs=2)
    assert same(rig, out, expected)
    # request 1 (tokens 3..7) straddles the cut at 4: both micro-batches hold it
    assert sorted(seen) == [(0, 4, 0, 2), (4, 8, 1, 8)]


class WritingCommModel(CompiledCommModel):
    """Writes into its input before the communicating layer: ``x += 1``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        h = fake_comm(x @ self.w1)
        return torch.relu(h @ self.w2)


def test_runner_copies_back_inputs_written_by_micro_batches(rig: Rig) -> None:
    """Each micro-batch writes into its slice of the runner's static buffer; the caller's tensor
    gets the real rows back, in split replays and in the unsplit eager fallback."""
    eager = WritingCommModel(rig.device)
    model, runner = e2e_runner(rig, WritingCommModel(rig.device))
    for tokens, seed in ((7, 21), (8, 22), (3, 23)):
        x = inputs(rig, tokens, seed=seed)
        theirs = x.clone()
        with torch.inference_mode():
            expected = eager(theirs)
        out = runner(x)
        assert same(rig, out, expected), tokens
        assert same(rig, x, theirs), tokens
    assert model.stats.replays == 2 and model.stats.micro_batch_fallbacks == 1
    assert runner.stats.inputs_copied_back == 3


def test_a_micro_batched_step_runs_the_compiled_models_hooks_once(rig: Rig) -> None:
    """Found by the matrix (hooks_micro_batch): a split FULL step replayed its graph and
    skipped the compiled model's hooks. They run once around the whole step, as around a
    plain step: the pre-hook's new input is what is split, the forward hook sees the joined
    output."""
    eager = CompiledCommModel(rig.device)
    model, runner = e2e_runner(rig, CompiledCommModel(rig.device))
    calls: list[int] = []

    def pre(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = kwargs["x"] if "x" in kwargs else args[0]  # (the runner passes it by name)
        calls.append(x.shape[0])
        return (), {"x": x * 0.5}

    def post(_: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return out * 2 + 1

    for m in (model, eager):
        m.register_forward_pre_hook(pre, with_kwargs=True)
        m.register_forward_hook(post)
    for tokens, seed in ((7, 41), (8, 42)):
        x = inputs(rig, tokens, seed=seed)
        theirs = x.clone()
        with model.stats.expect(replays=1, micro_batched_steps=1, micro_batch_fallbacks=0):
            out = runner(x)
        with torch.inference_mode():
            expected = eager(theirs)
        assert same(rig, out, expected)
        assert same(rig, x, theirs)  # the hook's new input never reaches the caller's
    assert calls == [8, 7, 8, 8]  # the runner's padded step, eager's call: once each


def test_a_split_uniform_decode_step_at_a_size_captured_unsplit_replays_it(rig: Rig) -> None:
    """Found by the matrix (micro_batch_full_uniform): under cudagraph_mode FULL a
    uniform-decode step shares its graph key with a mixed step; capture() captured the size
    unsplit (a mixed step of 2 tokens stays under the prefill threshold), the uniform step
    split at the decode threshold and found no split graph: a CaptureError. It now replays
    the unsplit graph, counted."""
    cfg = e2e_config(rig, cudagraph_capture_sizes=[2, 4], micro_batch_prefill_threshold=4)
    eager = CompiledCommModel(rig.device)
    model = ff.compile(CompiledCommModel(rig.device), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(HIDDEN)}, progress=False,
                         device=rig.device)
    runner.capture()
    x = inputs(rig, 2, seed=51)
    with torch.inference_mode():
        expected = eager(x)
    with model.stats.expect(replays=1, micro_batch_fallbacks=1, graphs_captured=0):
        out = runner(x, uniform_decode=True, num_reqs=2)
    assert same(rig, out, expected)


def test_micro_batching_a_runner_with_a_requests_input_is_refused(rig: Rig) -> None:
    """Found by the matrix (micro_batch_requests): a micro-batch got its requests' rows of a
    Requests input while a Tokens input of request numbers counted from the step's first
    request: a raw IndexError, or another request's row."""
    cfg = e2e_config(rig)
    model = ff.compile(CompiledCommModel(rig.device), cfg)
    with pytest.raises(ff.ConfigError, match=r"Requests input 'bias'.*Static input"):
        GraphRunner(model, cfg, inputs={"x": Tokens(HIDDEN), "bias": ff.runtime.Requests(
            HIDDEN)}, progress=False, device=rig.device)


@dataclasses.dataclass
class RowsOut:
    rows: torch.Tensor
    twice: torch.Tensor


class DataclassCommModel(CompiledCommModel):
    """Returns a plain @dataclass, which torch's pytree does not know."""

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        y = super().forward(x)
        return RowsOut(y, y * 2)


def test_a_micro_batched_step_joins_a_dataclass_output(rig: Rig) -> None:
    """Found by the matrix (fast seed 53): the micro-batches' outputs were joined through
    torch's pytree, to which a dataclass is a leaf: the answer was micro-batch 0's rows."""
    eager = DataclassCommModel(rig.device)
    _, runner = e2e_runner(rig, DataclassCommModel(rig.device))
    for tokens, seed in ((7, 61), (8, 62)):
        x = inputs(rig, tokens, seed=seed)
        got = runner(x)
        with torch.inference_mode():
            want = eager(x)
        assert type(got) is RowsOut and tuple(got.rows.shape) == (tokens, HIDDEN)
        assert same(rig, got.rows, want.rows) and same(rig, got.twice, want.twice)


class KeepsOutput(CompiledCommModel):
    """Stores its output on itself (``self.last = out``)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self.last = torch.zeros(1, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fake_comm(x @ self.w1)
        out = torch.relu(h @ self.w2)
        self.last = out
        return out


def test_a_micro_batched_step_stores_its_whole_output_as_eager_does(rig: Rig) -> None:
    """Full seed 192: each micro-batch of a split step ran forward's ``self.last = out``, so the
    attribute held the last micro-batch's rows; a replay of the split FULL graph ran no Python
    at all, so it held what it held before (the capture's stores are put back). Both now
    bind the whole step's output, as one eager call of the batch does."""
    module = KeepsOutput(rig.device)
    _, runner = e2e_runner(rig, module)
    for tokens, cut in ((8, None), (8, [3, 5])):  # the split graph replayed; cut elsewhere: eager
        x = inputs(rig, tokens, seed=71)
        extra = {} if cut is None else {"num_scheduled_tokens": cut, "num_reqs": len(cut)}
        module.last = torch.zeros(1, device=rig.device)
        out = runner(x, **extra)
        assert module.last is out or same(rig, module.last, out)
        assert tuple(module.last.shape) == (tokens, HIDDEN)

