"""Micro-batched execution on CPU: threads, the baton, per-thread forward contexts, failure
unwinding, and FULL graphs captured across micro-batches on the emulated backend."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import forward_context, get_forward_context
from freezeframe.errors import MicroBatchError
from freezeframe.graphs.emulated import EmulatedBackend
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan, plan_micro_batches

HIDDEN = 4


class CommModel(nn.Module):
    """Token-wise model with a simulated communication between two layers.

    Integer-valued weights keep every result exact, so split and unsplit outputs compare with
    ``torch.equal``. ``log`` records (micro-batch index, phase) in the order the phases ran.
    """

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randint(-3, 4, (HIDDEN, HIDDEN), generator=g).float(),
                               requires_grad=False)
        self.w2 = nn.Parameter(torch.randint(-3, 4, (HIDDEN, HIDDEN), generator=g).float(),
                               requires_grad=False)
        self.log: list[tuple[int | None, str]] = []
        self.calls = 0
        self.fail_in: int | None = None  # micro-batch index that raises in its comm phase

    def _where(self) -> int | None:
        ctx = get_forward_context()
        return None if ctx is None else ctx.micro_batch_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, HIDDEN]
        self.calls += 1
        me = self._where()
        h = x @ self.w1
        self.log.append((me, "compute1"))
        ff.ubatch.yield_to_comm()
        if self.fail_in is not None and me == self.fail_in:
            raise ValueError(f"boom in micro-batch {me}")
        h = h * 2 + 1  # the "all-to-all": token-wise, so slicing commutes with it
        self.log.append((me, "comm"))
        ff.ubatch.yield_to_compute()
        y = torch.relu(h @ self.w2)
        self.log.append((me, "compute2"))
        return y


def _cfg(n: int = 2) -> CompilationConfig:
    return CompilationConfig(micro_batching=True, num_micro_batches=n,
                             micro_batch_decode_threshold=2, micro_batch_prefill_threshold=4)


def _inputs(tokens: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, (tokens, HIDDEN), generator=g).float()


def _plan(tokens_per_req: list[int], padded: int, n: int = 2,
          reqs_padded: int | None = None) -> MicroBatchPlan:
    plan = plan_micro_batches(_cfg(n), tokens_per_req, padded, reqs_padded)
    assert plan is not None
    return plan


@pytest.fixture
def model() -> Iterator[CommModel]:
    with torch.inference_mode():
        yield CommModel()


def _step(wrapper: Any, x: torch.Tensor, plan: MicroBatchPlan | None,
          mode: CUDAGraphMode = CUDAGraphMode.NONE) -> torch.Tensor:
    desc = BatchDescriptor(num_tokens=x.shape[0])
    with torch.inference_mode(), forward_context(desc, mode=mode, micro_batches=plan):
        return wrapper(x)


def test_micro_batched_equals_unsplit(model: CommModel) -> None:
    x = _inputs(10)
    with torch.inference_mode():
        expected = model(x)
    wrapper = MicroBatchWrapper(model, timeout_s=30)
    plan = _plan([3, 5, 2], 10)  # request 1 straddles the cut at 5
    out = _step(wrapper, x, plan)
    assert torch.equal(out, expected)
    assert wrapper.stats.micro_batched_steps == 1


def test_three_micro_batches_equal_unsplit(model: CommModel) -> None:
    x = _inputs(12)
    with torch.inference_mode():
        expected = model(x)
    wrapper = MicroBatchWrapper(model, timeout_s=30)
    out = _step(wrapper, x, _plan([2, 7, 1], 12, n=3))
    assert torch.equal(out, expected)


def test_yield_points_order_compute_and_comm(model: CommModel) -> None:
    wrapper = MicroBatchWrapper(model, timeout_s=30)
    _step(wrapper, _inputs(8), _plan([4, 4], 8))
    # micro-batch 1 computes while micro-batch 0 communicates, and so on
    assert model.log == [
        (0, "compute1"), (1, "compute1"), (0, "comm"), (1, "comm"),
        (0, "compute2"), (1, "compute2"),
    ]
    assert wrapper.last_trace == [
        (0, "start"), (0, "to_comm"), (1, "start"), (1, "to_comm"),
        (0, "to_compute"), (1, "to_compute"), (0, "end"), (1, "end"),
    ]


def test_each_thread_has_its_own_forward_context(model: CommModel) -> None:
    seen: list[tuple[str, int, Any, Any]] = []
    lock = threading.Lock()

    def probe(x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        assert ctx is not None
        with lock:
            seen.append((threading.current_thread().name, ctx.batch_descriptor.num_tokens,
                         ctx.micro_batch, ctx.mode))
        assert ctx.micro_batches is None
        ff.ubatch.yield_()
        return model(x)

    plan = _plan([1] * 6, 8, reqs_padded=8)  # padded: 6 tokens -> 8, 6 requests -> 8
    wrapper = MicroBatchWrapper(probe, timeout_s=30)
    desc = BatchDescriptor(num_tokens=8)
    with torch.inference_mode(), forward_context(desc, mode=CUDAGraphMode.NONE, user="kept",
                                                 micro_batches=plan):
        wrapper(_inputs(8))
        # the caller's context is untouched
        outer = get_forward_context()
        assert outer is not None and outer.micro_batches is plan
    assert sorted(seen, key=lambda s: s[0]) == [
        ("freezeframe-ubatch-0", 4, plan.padded_slices[0], CUDAGraphMode.NONE),
        ("freezeframe-ubatch-1", 4, plan.padded_slices[1], CUDAGraphMode.NONE),
    ]
    assert plan.padded_slices[1].num_reqs == 4  # 2 real + 2 padding requests


def test_yield_points_are_noops_outside_micro_batches(model: CommModel) -> None:
    assert not ff.ubatch.in_micro_batch() and ff.ubatch.current_micro_batch() is None
    ff.ubatch.yield_()
    with ff.ubatch.comm_section():
        pass
    with torch.inference_mode():
        model(_inputs(3))  # calls both yield points


def test_uneven_yields_do_not_hang() -> None:
    def uneven(x: torch.Tensor) -> torch.Tensor:
        ctx = ff.ubatch.current_micro_batch()
        assert ctx is not None
        for _ in range(3 if ctx.index == 0 else 0):
            ff.ubatch.yield_()
        return x + 1

    wrapper = MicroBatchWrapper(uneven, timeout_s=10)
    x = _inputs(8)
    out = _step(wrapper, x, _plan([4, 4], 8))
    assert torch.equal(out, x + 1)


@pytest.mark.parametrize("failing", [0, 1])
def test_failing_thread_unwinds_the_others(model: CommModel, failing: int) -> None:
    model.fail_in = failing
    wrapper = MicroBatchWrapper(model, timeout_s=30)
    before = threading.active_count()
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"boom in micro-batch {failing}"):
        _step(wrapper, _inputs(8), _plan([4, 4], 8))
    # unwound by the abort, not by the 30 s timeout
    assert time.monotonic() - start < 5.0
    assert threading.active_count() == before
    # the sibling never reached its second compute phase
    assert [p for p in model.log if p[1] == "compute2"] == []
    # the wrapper is reusable after a failure
    model.fail_in = None
    model.log.clear()
    x = _inputs(8)
    with torch.inference_mode():
        expected = model(x)
    assert torch.equal(_step(wrapper, x, _plan([4, 4], 8)), expected)


def test_stuck_thread_becomes_a_clear_error_not_a_hang() -> None:
    release = threading.Event()

    def stuck(x: torch.Tensor) -> torch.Tensor:
        ctx = ff.ubatch.current_micro_batch()
        assert ctx is not None
        if ctx.index == 0:
            release.wait(3.0)  # never yields: blocks outside any yield point
        else:
            ff.ubatch.yield_()
        return x

    wrapper = MicroBatchWrapper(stuck, timeout_s=0.3)
    start = time.monotonic()
    try:
        with pytest.raises(MicroBatchError, match="micro-batch 0 of 2 did not finish"):
            _step(wrapper, _inputs(8), _plan([4, 4], 8))
    finally:
        release.set()
    assert time.monotonic() - start < 5.0


def test_sm_partition_hook_wraps_comm_sections(model: CommModel) -> None:
    events: list[tuple[int, str]] = []

    class Partition:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            events.append((self.index, "enter"))

        def __exit__(self, *exc: object) -> None:
            events.append((self.index, "exit"))

    wrapper = MicroBatchWrapper(model, timeout_s=30, sm_partition=Partition)
    _step(wrapper, _inputs(8), _plan([4, 4], 8))
    assert events == [(0, "enter"), (0, "exit"), (1, "enter"), (1, "exit")]


# -- FULL graphs across micro-batches (emulated backend) ----------------------------------------


def test_full_graph_captured_across_micro_batches_then_replayed(model: CommModel) -> None:
    stats = ff.Stats()
    wrapper = MicroBatchWrapper(model, backend=EmulatedBackend(), stats=stats, timeout_s=30)
    plan = _plan([3, 5], 8)
    static_x = _inputs(8, seed=1)  # the static input buffer the graph is captured on

    with stats.expect(graphs_captured=1, replays=0, micro_batched_steps=1):
        captured = _step(wrapper, static_x, plan, CUDAGraphMode.FULL)
    assert wrapper.captured_descriptors == [ff.BatchDescriptor(num_tokens=8)]
    calls = model.calls

    # new data written into the static buffer, then a replay: no threads, no Python
    for seed in (2, 3):
        static_x.copy_(_inputs(8, seed=seed))
        with torch.inference_mode():
            expected = CommModel()(static_x)  # same weights (same seed)
        threads_before = threading.active_count()
        with stats.expect(graphs_captured=0, replays=1):
            out = _step(wrapper, static_x, plan, CUDAGraphMode.FULL)
        assert threading.active_count() == threads_before
        assert model.calls == calls  # the model's Python did not run again
        assert torch.equal(out, expected)
        assert out is captured  # replay writes into the captured output


def test_tensors_slice_extras_made_before_the_capture_live_as_long_as_the_split_graph(
        model: CommModel) -> None:
    """slice_extras makes each micro-batch's metadata before the capture begins (outside the
    graph's pool); the graph reads that memory on every replay, so the wrapper keeps it until
    the graph is dropped (on CUDA, freeing it let the next allocation take it)."""
    made: list[weakref.ref[torch.Tensor]] = []

    def extras(index: int, sl: Any, parent: Any) -> dict[str, Any]:
        t = torch.full((1,), float(index))
        made.append(weakref.ref(t))
        return {"offset": t}

    wrapper = MicroBatchWrapper(model, backend=EmulatedBackend(), timeout_s=30,
                                slice_extras=extras)
    _step(wrapper, _inputs(8), _plan([4, 4], 8), CUDAGraphMode.FULL)
    gc.collect()
    assert len(made) == 2 and all(ref() is not None for ref in made)
    wrapper.clear()
    gc.collect()
    assert all(ref() is None for ref in made)


def test_split_graph_replay_copies_a_new_input_tensor_in(model: CommModel) -> None:
    """The split graph goes through GraphWrapper, so a replay given a new tensor (not the
    captured buffer) copies it in and answers for it, instead of replaying stale data."""
    stats = ff.Stats()
    wrapper = MicroBatchWrapper(model, backend=EmulatedBackend(), stats=stats, timeout_s=30)
    plan = _plan([4, 4], 8)
    _step(wrapper, _inputs(8, seed=1), plan, CUDAGraphMode.FULL)
    x = _inputs(8, seed=7)
    with torch.inference_mode():
        expected = CommModel()(x)
    with stats.expect(replays=1, graphs_captured=0, replay_input_copies=1):
        out = _step(wrapper, x, plan, CUDAGraphMode.FULL)
    assert torch.equal(out, expected)


def test_split_graph_records_launches_in_schedule_order(model: CommModel) -> None:
    """On the emulated backend every thread records into the one capture, so the graph holds
    micro-batch 0's first matmul, then 1's, then 0's communication... as the baton ran them."""
    wrapper = MicroBatchWrapper(model, backend=EmulatedBackend(), timeout_s=30)
    _step(wrapper, _inputs(8), _plan([4, 4], 8), CUDAGraphMode.FULL)
    assert wrapper._graphs is not None
    graph = wrapper._graphs.graph_for(BatchDescriptor(num_tokens=8))
    assert graph is not None
    ops = [op.removeprefix("aten.") for op in graph.ops]  # type: ignore[attr-defined]
    # per micro-batch: matmul, (mul, add), matmul, relu; 0 and 1 interleave at each yield
    # point; the main thread's cat comes last
    assert ops == ["matmul.default", "matmul.default", "mul.Tensor", "add.Tensor",
                   "mul.Tensor", "add.Tensor", "matmul.default", "relu.default",
                   "matmul.default", "relu.default", "cat.default"]


def test_split_step_cut_elsewhere_runs_without_the_graph(model: CommModel) -> None:
    stats = ff.Stats()
    wrapper = MicroBatchWrapper(model, backend=EmulatedBackend(), stats=stats, timeout_s=30)
    static_x = _inputs(8, seed=1)
    _step(wrapper, static_x, _plan([4, 4], 8), CUDAGraphMode.FULL)
    static_x.copy_(_inputs(8, seed=3))
    with torch.inference_mode():
        expected = CommModel()(static_x)
    with stats.expect(micro_batch_fallbacks=1, replays=0, graphs_captured=0,
                      micro_batched_steps=1):
        out = _step(wrapper, static_x, _plan([3, 5], 8), CUDAGraphMode.FULL)
    assert torch.equal(out, expected)
    with stats.expect(micro_batch_fallbacks=0, replays=1):
        out = _step(wrapper, static_x, _plan([4, 4], 8), CUDAGraphMode.FULL)
    assert torch.equal(out, expected)


def test_unsplit_step_at_a_split_captured_size_falls_back_eagerly(model: CommModel) -> None:
    unsplit_calls: list[int] = []

    def unsplit(x: torch.Tensor) -> torch.Tensor:  # stands in for the FULL GraphWrapper
        unsplit_calls.append(x.shape[0])
        return model(x)

    stats = ff.Stats()
    wrapper = MicroBatchWrapper(model, backend=EmulatedBackend(), unsplit=unsplit, stats=stats,
                                timeout_s=30)
    _step(wrapper, _inputs(8), _plan([4, 4], 8), CUDAGraphMode.FULL)

    x = _inputs(8, seed=5)
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
        out = _step(wrapper, x, None, CUDAGraphMode.FULL)  # the DP ranks declined this time
    assert torch.equal(out, expected)
    assert seen_modes == [CUDAGraphMode.NONE]  # nothing below tries to capture over the graph
    assert unsplit_calls == []

    # a size never captured split goes through the unsplit path as usual
    with stats.expect(micro_batch_fallbacks=0):
        _step(wrapper, _inputs(6), None, CUDAGraphMode.FULL)
    assert unsplit_calls == [6]


def test_capture_outside_window_is_refused(model: CommModel) -> None:
    class Closed:
        is_open = False

    wrapper = MicroBatchWrapper(model, backend=EmulatedBackend(), window=Closed(), timeout_s=30)
    with pytest.raises(ff.CaptureError, match="capture window is closed"):
        _step(wrapper, _inputs(8), _plan([4, 4], 8), CUDAGraphMode.FULL)
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
    def __init__(self) -> None:
        super().__init__()
        base = CommModel()
        self.w1, self.w2 = base.w1, base.w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fake_comm(x @ self.w1)
        return torch.relu(h @ self.w2)


def _e2e_config(**kw: Any) -> CompilationConfig:
    fields: dict[str, Any] = dict(
        mode="dynamo_trace_once", backend="eager", cudagraph_mode="full",
        graph_backend="emulated", cudagraph_capture_sizes=[8], max_num_tokens=8,
        max_num_seqs=8, micro_batching=True, micro_batch_decode_threshold=2,
        micro_batch_prefill_threshold=2)
    fields.update(kw)
    return CompilationConfig(**fields)


def _e2e_runner(module: nn.Module) -> tuple[Any, Any]:
    """``module`` compiled with :func:`_e2e_config`, behind a captured micro-batching runner."""
    from freezeframe.runtime import GraphRunner, Tokens

    cfg = _e2e_config()
    model = ff.compile(module, cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(HIDDEN)}, progress=False)
    assert runner.micro_batches is not None
    runner.micro_batches.timeout_s = 60
    runner.capture()
    return model, runner


def test_runner_captures_split_full_graph_and_replays_it() -> None:
    from freezeframe.runtime import GraphRunner, Tokens

    cfg = _e2e_config()
    eager = CompiledCommModel()
    model = ff.compile(eager, cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(HIDDEN)}, progress=False)
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
        x = _inputs(tokens, seed=seed)
        with torch.inference_mode():
            expected = eager(x)
        with model.stats.expect(replays=1, graphs_captured=0, micro_batch_fallbacks=0):
            out = runner(x)
        assert torch.equal(out, expected)

    # 3 tokens padded to 8: the cut at 4 would leave micro-batch 1 all padding, so the step
    # runs unsplit; its size was captured split, so it runs eagerly (counted)
    x = _inputs(3, seed=14)
    with torch.inference_mode():
        expected = eager(x)
    with model.stats.expect(micro_batch_fallbacks=1, replays=0, graphs_captured=0):
        out = runner(x)
    assert torch.equal(out, expected)


def test_runner_cuts_between_the_requests_it_is_given() -> None:
    """``num_scheduled_tokens`` tells the runner where requests end; a step laid out other
    than the captured one (captured without request counts: one request) runs its
    micro-batches without the split graph, counted, and still gives eager's answer."""
    eager = CompiledCommModel()
    model, runner = _e2e_runner(CompiledCommModel())
    seen: list[tuple[int, int, int, int]] = []
    body = model.forward

    def spy(x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        assert ctx is not None and ctx.micro_batch is not None
        sl = ctx.micro_batch
        seen.append((sl.token_start, sl.token_stop, sl.req_start, sl.req_stop))
        return body(x)

    model.forward = spy  # type: ignore[method-assign]
    x = _inputs(8, seed=31)
    with torch.inference_mode():
        expected = eager(x)
    with model.stats.expect(micro_batch_fallbacks=1, replays=0, micro_batched_steps=1):
        out = runner(x, num_scheduled_tokens=[3, 5], num_reqs=2)
    assert torch.equal(out, expected)
    # request 1 (tokens 3..7) straddles the cut at 4: both micro-batches hold it
    assert sorted(seen) == [(0, 4, 0, 2), (4, 8, 1, 8)]


class WritingCommModel(CompiledCommModel):
    """Writes into its input before the communicating layer: ``x += 1``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        h = fake_comm(x @ self.w1)
        return torch.relu(h @ self.w2)


def test_runner_copies_back_inputs_written_by_micro_batches() -> None:
    """Each micro-batch writes into its slice of the runner's static buffer; the caller's tensor
    gets the real rows back, in split replays and in the unsplit eager fallback."""
    eager = WritingCommModel()
    model, runner = _e2e_runner(WritingCommModel())
    for tokens, seed in ((7, 21), (8, 22), (3, 23)):
        x = _inputs(tokens, seed=seed)
        theirs = x.clone()
        with torch.inference_mode():
            expected = eager(theirs)
        out = runner(x)
        assert torch.equal(out, expected), tokens
        assert torch.equal(x, theirs), tokens
    assert model.stats.replays == 2 and model.stats.micro_batch_fallbacks == 1
    assert runner.stats.inputs_copied_back == 3
