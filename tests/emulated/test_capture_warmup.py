# Stays: emulated-only (it captures by running, so just the first capture is warmed up).
"""The warm-up before capture on a backend that captures by running (``emulated``): the
record-only policy (every key run once before its capture) is in
tests/scenarios/test_capture_warmup.py, on every backend."""

from __future__ import annotations

import freezeframe as ff
from freezeframe import CompilationConfig
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.toy_models import SillyModel

SIZES = [1, 2, 4, 8]


def config(mode: str) -> CompilationConfig:
    return CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
        cudagraph_mode=mode, graph_backend="emulated", cudagraph_capture_sizes=SIZES,
        max_num_tokens=12, max_num_seqs=8)


def test_a_capturing_backend_keeps_its_single_first_warmup() -> None:
    """On the emulated backend (which captures by running) only the very first capture is
    preceded by a warm-up, as before."""
    cfg = config("piecewise")
    runner = GraphRunner(ff.compile(SillyModel(), cfg), cfg, inputs={"x": Tokens(3)},
                         progress=False)
    runner.capture()
    assert runner.stats.warmups == 1
