"""Micro-batch overlap on a real GPU: one micro-batch's (simulated) communication on the comm
stream runs while the other micro-batch computes on the compute stream.

The timeline is measured with CUDA timing events recorded around every phase; the assertions are
structural (dependencies respected, intervals that must overlap do overlap), never timing
thresholds. Set ``FF_UBATCH_TIMELINE=/path.json`` to write the measured timeline.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import forward_context, get_forward_context
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan, plan_micro_batches
from freezeframe.stats import Stats

pytestmark = pytest.mark.cuda

HIDDEN = 64
SPIN_CYCLES = 20_000_000  # ~10 ms on a ~2 GHz GPU: long enough to see overlap clearly


class OverlapModel(nn.Module):
    """compute -> (yield) simulated communication -> (yield) compute.

    Each phase spins one single-block kernel (``torch.cuda._sleep``) so phases are long and
    occupy almost no SMs: two of them on different streams can always run together. The
    "communication" copies the activations into a fresh buffer on the comm stream, as an
    all-to-all would. With ``timed`` set, CUDA timing events bracket every phase on the stream
    it runs on.
    """

    def __init__(self, timed: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randint(-2, 3, (HIDDEN, HIDDEN), generator=g).float()
                               .cuda(), requires_grad=False)
        self.w2 = nn.Parameter(torch.randint(-2, 3, (HIDDEN, HIDDEN), generator=g).float()
                               .cuda(), requires_grad=False)
        self.timed = timed
        self.events: dict[tuple[int, str], tuple[torch.cuda.Event, torch.cuda.Event]] = {}
        self.streams: dict[tuple[int, str], Any] = {}

    def _phase(self, name: str, fn: Any) -> Any:
        ctx = get_forward_context()
        index = -1 if ctx is None or ctx.micro_batch_index is None \
                else ctx.micro_batch_index
        stream = torch.cuda.current_stream()
        self.streams[(index, name)] = stream
        if not self.timed:
            return fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        out = fn()
        end.record(stream)
        self.events[(index, name)] = (start, end)
        return out

    def _comm(self, h: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SPIN_CYCLES)
        received = torch.empty_like(h)
        received.copy_(h)  # the simulated communication kernel
        return received

    def _compute(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SPIN_CYCLES)
        return h @ w

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, HIDDEN]
        h = self._phase("compute1", lambda: self._compute(x, self.w1))
        ff.ubatch.yield_to_comm()
        h = self._phase("comm", lambda: self._comm(h))
        ff.ubatch.yield_to_compute()
        return self._phase("compute2", lambda: torch.relu(self._compute(h, self.w2)))


def _plan(tokens: int) -> MicroBatchPlan:
    cfg = CompilationConfig(micro_batching=True, micro_batch_decode_threshold=2,
                            micro_batch_prefill_threshold=2)
    plan = plan_micro_batches(cfg, [1] * tokens, tokens, tokens, uniform_decode=True)
    assert plan is not None
    return plan


def _inputs(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (tokens, HIDDEN), generator=g).float().cuda()


def _step(wrapper: Any, x: torch.Tensor, plan: MicroBatchPlan,
          mode: CUDAGraphMode = CUDAGraphMode.NONE) -> torch.Tensor:
    with torch.inference_mode(), forward_context(BatchDescriptor(num_tokens=x.shape[0]),
                                                 mode=mode, micro_batches=plan):
        return wrapper(x)


def test_comm_of_one_micro_batch_overlaps_compute_of_the_other() -> None:
    model = OverlapModel(timed=True)
    wrapper = MicroBatchWrapper(model, timeout_s=120)
    x = _inputs(16, seed=1)
    with torch.inference_mode():
        expected = OverlapModel(timed=False)(x)
    torch.cuda.synchronize()

    origin = torch.cuda.Event(enable_timing=True)
    origin.record()
    out = _step(wrapper, x, _plan(16))
    torch.cuda.synchronize()
    assert torch.equal(out, expected)

    t = {key: (origin.elapsed_time(s), origin.elapsed_time(e))
         for key, (s, e) in model.events.items()}
    if os.environ.get("FF_UBATCH_TIMELINE"):
        with open(os.environ["FF_UBATCH_TIMELINE"], "w") as f:
            json.dump({f"ubatch{k[0]}:{k[1]}": v for k, v in sorted(t.items())}, f, indent=1)

    # streams: compute phases on the caller's stream, communication on the wrapper's comm stream
    compute = torch.cuda.current_stream()
    comm = wrapper._comm_stream
    assert comm is not None and comm != compute
    for i in (0, 1):
        assert model.streams[(i, "compute1")] == compute
        assert model.streams[(i, "comm")] == comm
        assert model.streams[(i, "compute2")] == compute

    eps = 1e-3  # ms: event timestamps of dependent work may coincide
    start, end = 0, 1
    for i in (0, 1):
        # dependencies: communication after its own compute, compute2 after its own comm
        assert t[(i, "compute1")][end] <= t[(i, "comm")][start] + eps
        assert t[(i, "comm")][end] <= t[(i, "compute2")][start] + eps

    def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return a[start] < b[end] and b[start] < a[end]

    # the point of micro-batching: 0's communication runs during 1's compute, and
    # 1's communication during 0's second compute
    assert overlap(t[(0, "comm")], t[(1, "compute1")])
    assert overlap(t[(1, "comm")], t[(0, "compute2")])
    # ordering on each stream follows micro-batch order
    assert t[(0, "compute1")][end] <= t[(1, "compute1")][start] + eps
    assert t[(0, "comm")][end] <= t[(1, "comm")][start] + eps
    assert wrapper.last_trace == [
        (0, "start"), (0, "to_comm"), (1, "start"), (1, "to_comm"),
        (0, "to_compute"), (1, "to_compute"), (0, "end"), (1, "end"),
    ]


def test_split_cuda_graph_capture_and_replay() -> None:
    from freezeframe.graphs.cuda import CudaBackend

    model = OverlapModel(timed=False)
    stats = Stats()
    wrapper = MicroBatchWrapper(model, backend=CudaBackend(), stats=stats, timeout_s=120)
    plan = _plan(16)
    static_x = _inputs(16, seed=1)
    # warm up outside the capture (cuBLAS handles, allocator blocks)
    _step(wrapper, static_x, plan)
    torch.cuda.synchronize()
    with stats.expect(graphs_captured=1):
        captured = _step(wrapper, static_x, plan, CUDAGraphMode.FULL)
    torch.cuda.synchronize()
    for seed in (2, 3):
        static_x.copy_(_inputs(16, seed=seed))
        with torch.inference_mode():
            expected = OverlapModel(timed=False)(static_x)
        with stats.expect(replays=1, graphs_captured=0):
            out = _step(wrapper, static_x, plan, CUDAGraphMode.FULL)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert out is captured  # replay writes into the captured output


def test_a_tensor_the_comm_stream_reads_is_not_handed_to_the_compute_stream_early() -> None:
    """``h = comm(h)`` drops the compute stream's tensor while the comm kernel still reads it;
    the stream-use recorder a comm section enters keeps the allocator from giving its block to
    the compute stream's next allocation until the comm stream is past it."""
    from freezeframe.runtime.ubatch.schedule import _CommStreamUses

    compute = torch.cuda.current_stream()
    comm = torch.cuda.Stream()
    h = torch.ones(1 << 20, device="cuda")  # 4 MiB, allocated on the compute stream
    address = h.data_ptr()
    comm.wait_stream(compute)
    with torch.cuda.stream(comm), _CommStreamUses(comm, compute):
        torch.cuda._sleep(SPIN_CYCLES)  # the comm stream is busy well past the next lines
        received = h * 2  # the "communication" reads h on the comm stream
    del h
    again = torch.empty(1 << 20, device="cuda")  # the compute stream's next allocation
    assert again.data_ptr() != address
    compute.wait_stream(comm)
    assert float(received[0].item()) == 2.0
