"""Micro-batched execution through MicroBatchWrapper, without graphs: threads, the baton, the
yield points' order, per-thread forward contexts, failure unwinding (a raising micro-batch, a
stuck one) and the SM-partition hook. On a GPU each micro-batch launches its compute on the
caller's stream and its communication on the wrapper's comm stream; results are read after the
caller's stream finished (``rig.host``). FULL graphs captured across micro-batches are in
tests/scenarios/test_ubatch_graphs.py. Every scenario runs on every graph backend present (the
``rig`` fixture)."""

from __future__ import annotations

import threading
import time
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
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from freezeframe.runtime.ubatch.slicing import MicroBatchPlan, plan_micro_batches
from tests.scenarios.conftest import Rig

HIDDEN = 4


class CommModel(nn.Module):
    """Token-wise model with a simulated communication between two layers.

    Integer-valued weights keep every result exact, so split and unsplit outputs compare with
    ``torch.equal``. ``log`` records (micro-batch index, phase) in the order the phases ran.
    """

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randint(-3, 4, (HIDDEN, HIDDEN), generator=g).float()
                               .to(device), requires_grad=False)
        self.w2 = nn.Parameter(torch.randint(-3, 4, (HIDDEN, HIDDEN), generator=g).float()
                               .to(device), requires_grad=False)
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


def split_config(n: int = 2) -> CompilationConfig:
    """What plan_micro_batches reads: ``n`` micro-batches, split from 2 (decode) / 4 tokens."""
    return CompilationConfig(micro_batching=True, num_micro_batches=n,
                             micro_batch_decode_threshold=2, micro_batch_prefill_threshold=4)


def inputs(rig: Rig, tokens: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, (tokens, HIDDEN), generator=g).float().to(rig.device)


def make_plan(tokens_per_req: list[int], padded: int, n: int = 2,
              reqs_padded: int | None = None) -> MicroBatchPlan:
    plan = plan_micro_batches(split_config(n), tokens_per_req, padded, reqs_padded)
    assert plan is not None
    return plan


def step(wrapper: Any, x: torch.Tensor, plan: MicroBatchPlan | None,
         mode: CUDAGraphMode = CUDAGraphMode.NONE) -> torch.Tensor:
    desc = BatchDescriptor(num_tokens=x.shape[0])
    with torch.inference_mode(), forward_context(desc, mode=mode, micro_batches=plan):
        return wrapper(x)


def same(rig: Rig, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of host copies, taken once the caller's stream finished."""
    return torch.equal(rig.host(a), rig.host(b))


@pytest.fixture
def model(rig: Rig) -> Iterator[CommModel]:
    with torch.inference_mode():
        yield CommModel(rig.device)


def test_micro_batched_equals_unsplit(rig: Rig, model: CommModel) -> None:
    x = inputs(rig, 10)
    with torch.inference_mode():
        expected = model(x)
    wrapper = MicroBatchWrapper(model, timeout_s=30)
    plan = make_plan([3, 5, 2], 10)  # request 1 straddles the cut at 5
    out = step(wrapper, x, plan)
    assert same(rig, out, expected)
    assert wrapper.stats.micro_batched_steps == 1


def test_three_micro_batches_equal_unsplit(rig: Rig, model: CommModel) -> None:
    x = inputs(rig, 12)
    with torch.inference_mode():
        expected = model(x)
    wrapper = MicroBatchWrapper(model, timeout_s=30)
    out = step(wrapper, x, make_plan([2, 7, 1], 12, n=3))
    assert same(rig, out, expected)


def test_yield_points_order_compute_and_comm(rig: Rig, model: CommModel) -> None:
    wrapper = MicroBatchWrapper(model, timeout_s=30)
    step(wrapper, inputs(rig, 8), make_plan([4, 4], 8))
    # micro-batch 1 computes while micro-batch 0 communicates, and so on
    assert model.log == [
        (0, "compute1"), (1, "compute1"), (0, "comm"), (1, "comm"),
        (0, "compute2"), (1, "compute2"),
    ]
    assert wrapper.last_trace == [
        (0, "start"), (0, "to_comm"), (1, "start"), (1, "to_comm"),
        (0, "to_compute"), (1, "to_compute"), (0, "end"), (1, "end"),
    ]


def test_each_thread_has_its_own_forward_context(rig: Rig, model: CommModel) -> None:
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

    plan = make_plan([1] * 6, 8, reqs_padded=8)  # padded: 6 tokens -> 8, 6 requests -> 8
    wrapper = MicroBatchWrapper(probe, timeout_s=30)
    desc = BatchDescriptor(num_tokens=8)
    with torch.inference_mode(), forward_context(desc, mode=CUDAGraphMode.NONE, user="kept",
                                                 micro_batches=plan):
        wrapper(inputs(rig, 8))
        # the caller's context is untouched
        outer = get_forward_context()
        assert outer is not None and outer.micro_batches is plan
    assert sorted(seen, key=lambda s: s[0]) == [
        ("freezeframe-ubatch-0", 4, plan.padded_slices[0], CUDAGraphMode.NONE),
        ("freezeframe-ubatch-1", 4, plan.padded_slices[1], CUDAGraphMode.NONE),
    ]
    assert plan.padded_slices[1].num_reqs == 4  # 2 real + 2 padding requests


def test_yield_points_are_noops_outside_micro_batches(rig: Rig, model: CommModel) -> None:
    assert not ff.ubatch.in_micro_batch() and ff.ubatch.current_micro_batch() is None
    ff.ubatch.yield_()
    with ff.ubatch.comm_section():
        pass
    with torch.inference_mode():
        model(inputs(rig, 3))  # calls both yield points


def test_uneven_yields_do_not_hang(rig: Rig) -> None:
    def uneven(x: torch.Tensor) -> torch.Tensor:
        ctx = ff.ubatch.current_micro_batch()
        assert ctx is not None
        for _ in range(3 if ctx.index == 0 else 0):
            ff.ubatch.yield_()
        return x + 1

    wrapper = MicroBatchWrapper(uneven, timeout_s=10)
    x = inputs(rig, 8)
    out = step(wrapper, x, make_plan([4, 4], 8))
    assert same(rig, out, x + 1)


@pytest.mark.parametrize("failing", [0, 1])
def test_failing_thread_unwinds_the_others(rig: Rig, model: CommModel, failing: int) -> None:
    model.fail_in = failing
    wrapper = MicroBatchWrapper(model, timeout_s=30)
    before = threading.active_count()
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"boom in micro-batch {failing}"):
        step(wrapper, inputs(rig, 8), make_plan([4, 4], 8))
    # unwound by the abort, not by the 30 s timeout
    assert time.monotonic() - start < 5.0
    assert threading.active_count() == before
    # the sibling never reached its second compute phase
    assert [p for p in model.log if p[1] == "compute2"] == []
    # the wrapper is reusable after a failure
    model.fail_in = None
    model.log.clear()
    x = inputs(rig, 8)
    with torch.inference_mode():
        expected = model(x)
    assert same(rig, step(wrapper, x, make_plan([4, 4], 8)), expected)


def test_stuck_thread_becomes_a_clear_error_not_a_hang(rig: Rig) -> None:
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
            step(wrapper, inputs(rig, 8), make_plan([4, 4], 8))
    finally:
        release.set()
    assert time.monotonic() - start < 5.0


def test_sm_partition_hook_wraps_comm_sections(rig: Rig, model: CommModel) -> None:
    events: list[tuple[int, str]] = []

    class Partition:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            events.append((self.index, "enter"))

        def __exit__(self, *exc: object) -> None:
            events.append((self.index, "exit"))

    wrapper = MicroBatchWrapper(model, timeout_s=30, sm_partition=Partition)
    step(wrapper, inputs(rig, 8), make_plan([4, 4], 8))
    assert events == [(0, "enter"), (0, "exit"), (1, "enter"), (1, "exit")]
