# Stays: emulated-only (it reads the ops the emulated backend recorded into the split graph).
"""The order a split FULL graph records its launches in on the emulated backend, which records
through a per-thread dispatch mode: every micro-batch thread records into the one capture. The
micro-batched scenarios that hold on every backend are tests/scenarios/test_ubatch.py and
tests/scenarios/test_ubatch_graphs.py."""

from __future__ import annotations

import torch

from freezeframe.batch import BatchDescriptor
from freezeframe.config import CUDAGraphMode
from freezeframe.graphs.emulated import EmulatedBackend
from freezeframe.runtime.ubatch.overlap import MicroBatchWrapper
from tests.scenarios.conftest import Rig
from tests.scenarios.test_ubatch import CommModel, inputs, make_plan, step

EMULATED = Rig("emulated", "cpu")


def test_split_graph_records_launches_in_schedule_order() -> None:
    """On the emulated backend every thread records into the one capture, so the graph holds
    micro-batch 0's first matmul, then 1's, then 0's communication... as the baton ran them."""
    with torch.inference_mode():
        model = CommModel()
    wrapper = MicroBatchWrapper(model, backend=EmulatedBackend(), timeout_s=30)
    step(wrapper, inputs(EMULATED, 8), make_plan([4, 4], 8), CUDAGraphMode.FULL)
    assert wrapper._graphs is not None
    graph = wrapper._graphs.graph_for(BatchDescriptor(num_tokens=8))
    assert graph is not None
    ops = [op.removeprefix("aten.") for op in graph.ops]  # type: ignore[attr-defined]
    # per micro-batch: matmul, (mul, add), matmul, relu; 0 and 1 interleave at each yield
    # point; the main thread's cat comes last
    assert ops == ["matmul.default", "matmul.default", "mul.Tensor", "add.Tensor",
                   "mul.Tensor", "add.Tensor", "matmul.default", "relu.default",
                   "matmul.default", "relu.default", "cat.default"]
