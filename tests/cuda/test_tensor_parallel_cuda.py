"""Tensor parallelism on two GPUs (NCCL): TP=2 serves what TP=1 serves, with the all-reduces
captured inside real CUDA graphs (PIECEWISE and FULL) and, with COLLECTIVE_SPLITTING_OPS, run
between the pieces. The gloo version of the same checks runs on every CPU
(tests/integration/test_tensor_parallel.py); this one needs a machine with two GPUs and has not
run yet (the GPU machines lent so far have one)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.ranks import run_ranks
from tests.integration.test_tensor_parallel import (
    CACHE,
    MAX_SEQS,
    MAX_TOKENS,
    REQUESTS,
    SIZES,
    _serve,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (NCCL tensor parallelism)")]

RUNS = ("PIECEWISE", "FULL", "PIECEWISE_SPLIT")


def _worker(rank: int, world: int) -> dict[str, Any]:
    import freezeframe as ff
    from freezeframe.models import ATTENTION_OP, LlamaModel, build_llama
    from freezeframe.models.llama_tp import shard_llama
    from freezeframe.models.parallel import COLLECTIVE_SPLITTING_OPS, TensorParallel
    from freezeframe.models.serving import EagerForward, RunnerForward, llama_runner_inputs

    device = torch.device("cuda", rank)
    full = build_llama("tiny", CACHE, seed=0, init_std=0.3, device=device)
    results: dict[str, Any] = {"tp1": _serve(full, EagerForward(full))}
    shard = shard_llama(full, TensorParallel.from_group())
    del full
    for run in RUNS:
        split = run == "PIECEWISE_SPLIT"
        cfg = ff.CompilationConfig(
            mode="piecewise", backend="eager", graph_backend="cuda",
            cudagraph_mode="PIECEWISE" if split else run,
            splitting_ops=[ATTENTION_OP, *(COLLECTIVE_SPLITTING_OPS if split else ())],
            cudagraph_capture_sizes=SIZES, max_num_seqs=MAX_SEQS, max_num_tokens=MAX_TOKENS)
        compiled = ff.compile(shard, cfg, dynamic_arg_dims=dict(
            LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
        runner = ff.GraphRunner(compiled, cfg, inputs=llama_runner_inputs(shard, MAX_SEQS),
                                device=device, progress=False, strict=True, lockstep=True)
        report = runner.capture()
        results[run] = _serve(shard, RunnerForward(runner, MAX_SEQS))
        results[run]["graphs"] = report.num_graphs
        results[run]["graph_steps"] = runner.stats.steps_full + runner.stats.steps_piecewise
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_worker, 2, deadline_s=600.0, backend="nccl")


@pytest.mark.parametrize("run", RUNS)
def test_tp2_on_two_gpus_serves_the_tp1_tokens_and_logits(ranks: list[dict[str, Any]],
                                                          run: str) -> None:
    assert len(REQUESTS) == 4
    for rank, res in enumerate(ranks):
        want, got = res["tp1"], res[run]
        assert got["outputs"] == want["outputs"], rank
        assert (got["graphs"], got["graph_steps"]) == (5, 10), rank
        for step, (a, b) in enumerate(zip(got["logits"], want["logits"], strict=True)):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=1e-3,
                                       msg=lambda m, s=step, r=rank: f"rank {r} step {s}: {m}")
