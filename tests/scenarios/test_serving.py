"""Continuous batching on graphs: every cudagraph mode serves exactly what eager serves, on
every graph backend present (the ``rig`` fixture).

One request trace (staggered arrivals, a chunked prefill, mixed and uniform-decode steps,
requests finishing at different steps) runs eagerly and through ``ff.compile`` + GraphRunner in
each mode; greedy tokens must be identical and every step's logits allclose.
"""

from __future__ import annotations

import pytest
import torch

import freezeframe as ff
from freezeframe.models import ATTENTION_OP, KVCacheConfig, LlamaModel, build_llama
from freezeframe.models.serving import (
    Request,
    RunnerForward,
    ServingDriver,
    ServingResult,
    llama_runner_inputs,
)
from freezeframe.runtime.runner import GraphRunner
from tests.scenarios.conftest import Rig

CACHE = KVCacheConfig(num_blocks=64, block_size=4, max_model_len=48)
MAX_SEQS, MAX_TOKENS = 4, 16
REQUESTS = [
    Request("a", (1, 2, 3, 4, 5), max_new_tokens=6),
    Request("b", (9,) * 11, max_new_tokens=4, arrival_step=1),
    Request("c", (7, 8), max_new_tokens=8, arrival_step=2),
    Request("d", tuple(range(20)), max_new_tokens=3, arrival_step=3),  # > budget: chunked
]


@pytest.fixture
def model(rig: Rig) -> LlamaModel:
    # a larger init spread than the default so greedy tokens differ from the input tokens;
    # float32 on every device (build_llama's CUDA default is bfloat16): the comparison below
    # is at 1e-4 and expects the same greedy tokens
    return build_llama("tiny", CACHE, seed=0, init_std=0.3, device=rig.device,
                       dtype=torch.float32)


@pytest.fixture
def eager(model: LlamaModel) -> ServingResult:
    return ServingDriver(model, max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS).run(
        REQUESTS)


def test_eager_trace_has_every_step_kind(eager: ServingResult) -> None:
    assert eager.step_kinds == ["mixed"] * 5 + ["decode"] * 5
    assert {k: len(v) for k, v in eager.outputs.items()} == {"a": 6, "b": 4, "c": 8, "d": 3}
    assert len(set(eager.outputs["a"])) > 1  # the model does not just echo one token


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_every_mode_serves_the_eager_tokens(
    rig: Rig, model: LlamaModel, eager: ServingResult, mode: str
) -> None:
    graphs = mode != "NONE"
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=[ATTENTION_OP], cudagraph_mode=mode,
        cudagraph_capture_sizes=[1, 2, 4, 8, 16] if graphs else None, graph_backend=rig.backend,
        max_num_seqs=MAX_SEQS, max_num_tokens=MAX_TOKENS,
    )
    compiled = ff.compile(
        model, cfg, dynamic_arg_dims=dict(LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0)
    )
    runner = GraphRunner(compiled, cfg, inputs=llama_runner_inputs(model, MAX_SEQS),
                         device=rig.device, progress=False, strict=graphs)
    runner.capture()
    served = ServingDriver(model, RunnerForward(runner, MAX_SEQS), max_num_seqs=MAX_SEQS,
                           max_num_batched_tokens=MAX_TOKENS).run(REQUESTS)

    # step_logits are host copies, taken as each step finished
    assert served.outputs == eager.outputs
    assert served.step_sampled == eager.step_sampled
    for got, want in zip(served.step_logits, eager.step_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    steps = runner.stats
    assert steps.steps == eager.num_steps == 10
    expected = {
        "NONE": {"steps_eager": 10},
        "PIECEWISE": {"steps_piecewise": 10},
        "FULL": {"steps_full": 10},
        "FULL_AND_PIECEWISE": {"steps_full": 5, "steps_piecewise": 5},  # decode vs mixed
    }[mode]
    assert {k: getattr(steps, k) for k in expected} == expected
    assert compiled.stats.graphs_traced == 1
    if graphs:
        # a piecewise step replays every capturable piece, a FULL step one graph
        pieces = compiled.stats.capturable_pieces
        assert pieces == 3
        full, piecewise = expected.get("steps_full", 0), expected.get("steps_piecewise", 0)
        assert compiled.stats.replays == full + piecewise * pieces
