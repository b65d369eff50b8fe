"""A signal that interrupts the main thread of a micro-batched step, under a compiled model used
directly (``ff.compile``, a MicroBatchWrapper, calls inside ``ff.forward_context``),
complementing the runner's fault tests: the micro-batch threads must be unwound before the
exception leaves the call. After it, no global state is left behind (no micro-batch thread
still running, dispatch modes, forward context, grad mode, compile stance, garbage collector),
and the same model and a fresh one give eager's outputs. Every scenario runs on every graph
backend present (the ``rig`` fixture)."""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
import torch

import freezeframe as ff
from freezeframe import CUDAGraphMode
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from freezeframe.runtime.ubatch.slicing import plan_micro_batches
from tests.helpers.faults import _assert_clean
from tests.helpers.toy_models import IntegerWeights
from tests.scenarios.conftest import Rig

NONE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.FULL
HIDDEN = 4
OP = "ffinterrupt::comm"


class Interrupted(BaseException):
    """What a signal handler raises in the main thread (as SIGINT raises KeyboardInterrupt)."""


class _Stall:
    """While armed, micro-batch 0 signals the main thread at the comm point, and then every
    micro-batch keeps passing the baton until ``release`` is set (or the step is aborted, which
    raises out of the yield)."""

    def __init__(self) -> None:
        self.armed = False
        self.release = threading.Event()
        self.signalled = 0

    def comm_point(self) -> None:
        if not self.armed or not ff.ubatch.in_micro_batch():
            return
        ctx = ff.ubatch.current_micro_batch()
        assert ctx is not None
        if ctx.index == 0 and self.signalled == 0:
            self.signalled += 1
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
        deadline = time.monotonic() + 60  # a bound, so a broken abort cannot hang the suite
        while not self.release.is_set() and time.monotonic() < deadline:
            ff.ubatch.yield_()


STALL = _Stall()


@torch.library.custom_op(OP, mutates_args=())
def _comm(x: torch.Tensor) -> torch.Tensor:
    """The communication of a micro-batch (``x * 2 + 1``), between yield points."""
    ff.ubatch.yield_to_comm()
    STALL.comm_point()
    out = x * 2 + 1
    ff.ubatch.yield_to_compute()
    return out


@_comm.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Model(IntegerWeights):
    """Token-wise and integer-valued (exact results): linear, the comm op, relu(linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(_comm(x @ self.w1) @ self.w2)


def inputs(rig: Rig, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, (tokens, HIDDEN), generator=g).float().to(rig.device)


def eager(rig: Rig, x: torch.Tensor) -> torch.Tensor:
    """A host copy of eager's output."""
    with torch.no_grad():
        return rig.host(Model().to(rig.device)(x))


@pytest.fixture(autouse=True)
def _stall_disarmed() -> Iterator[None]:
    STALL.armed, STALL.signalled = False, 0
    STALL.release.clear()
    yield
    STALL.armed = False
    STALL.release.set()  # whatever a failed test left waiting goes on


@pytest.fixture
def interrupt_handler() -> Iterator[None]:
    def raise_interrupted(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(f"signal {signum}")

    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    yield
    signal.signal(signal.SIGUSR1, previous)


CAPTURE_SIZE = 8


def _ubatch_config(rig: Rig, graph_mode: str) -> ff.CompilationConfig:
    return rig.config(
        graph_mode, mode="dynamo_trace_once", splitting_ops=[],
        cudagraph_capture_sizes=[CAPTURE_SIZE], max_num_tokens=16, max_num_seqs=16,
        micro_batching=True, micro_batch_decode_threshold=2, micro_batch_prefill_threshold=2)


class _Split:
    """A compiled model behind a MicroBatchWrapper, driven the low-level way: a static buffer
    of CAPTURE_SIZE rows, a plan of two 4-token requests, a forward context per step."""

    def __init__(self, rig: Rig, graph_mode: str) -> None:
        self.rig = rig
        self.config = _ubatch_config(rig, graph_mode)
        self.model = ff.compile(Model().to(rig.device), self.config)
        self.wrapper = MicroBatchWrapper.for_runner(self.model, self.config)
        self.wrapper.timeout_s = 60
        self.mode = FULL if graph_mode == "full" else NONE
        self.buffer = rig.zeros(CAPTURE_SIZE, HIDDEN)
        self.model(inputs(rig, CAPTURE_SIZE, seed=0))  # the first call traces (unsplit)

    def step(self, seed: int) -> torch.Tensor:
        """One step; a host copy of its output."""
        self.buffer.copy_(inputs(self.rig, CAPTURE_SIZE, seed))
        plan = plan_micro_batches(self.config, [4, 4], CAPTURE_SIZE, sync=False)
        assert plan is not None and plan.num_micro_batches == 2
        with ff.forward_context(ff.BatchDescriptor(num_tokens=CAPTURE_SIZE), mode=self.mode,
                                micro_batches=plan):
            return self.rig.host(self.wrapper(self.buffer))

    def check(self, seeds: range) -> None:
        for seed in seeds:
            assert torch.equal(self.step(seed),
                               eager(self.rig, inputs(self.rig, CAPTURE_SIZE, seed))), seed


@pytest.mark.parametrize("graph_mode", ["none", "full"])
@pytest.mark.usefixtures("interrupt_handler")
def test_an_interrupted_micro_batched_step_leaves_no_thread_running(
        rig: Rig, clean: dict[str, Any], graph_mode: str) -> None:
    """A signal (Ctrl-C, a deadline) raises in the main thread while it waits for the
    micro-batch threads (``full``: inside the split capture). The threads must be unwound
    before the exception leaves the call: a thread left running would go on writing into the
    buffers the next step uses."""
    frozen = gc.get_freeze_count()
    split = _Split(rig, graph_mode)
    STALL.armed = True
    with pytest.raises(Interrupted):
        split.step(seed=1)
    assert STALL.signalled == 1
    _assert_clean(frozen, clean)  # among others: no freezeframe-ubatch thread alive
    STALL.armed = False
    STALL.release.set()
    assert split.wrapper.captured_descriptors == []
    with split.model.stats.expect(graphs_captured=1 if graph_mode == "full" else 0):
        split.check(range(2, 6))
    assert [d.num_tokens for d in split.wrapper.captured_descriptors] == (
        [CAPTURE_SIZE] if graph_mode == "full" else [])
    _Split(rig, graph_mode).check(range(6, 9))
    _assert_clean(frozen, clean)
