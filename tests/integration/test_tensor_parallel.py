"""Tensor parallelism on two gloo ranks (CPU, loopback only): TP=2 serves what TP=1 serves.

Every rank builds the same TP=1 Llama from a seed, serves one request trace with it eagerly
(the reference), then serves the trace with its TP=2 shard (weights cut from the TP=1
``state_dict``): eagerly, and through ``ff.compile`` + ``GraphRunner`` on emulated graphs in
PIECEWISE and FULL mode (captured in lockstep), where the all-reduces after the row-parallel
layers and the vocab-parallel embedding are recorded inside the graphs and run again on every
replay. The trace has a prefill-only step, mixed steps (a chunked prefill beside decodes) and
uniform decode steps. Greedy tokens must be identical and every step's logits equal within
float tolerance (a row-parallel layer adds its partial sums in another order than one matmul).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from freezeframe.errors import ConfigError
from freezeframe.models import KVCacheConfig, LlamaConfig
from freezeframe.models.llama_tp import local_config, shard_llama_state_dict
from freezeframe.models.parallel import TensorParallel
from freezeframe.models.serving import Request
from tests.helpers.ranks import run_ranks

CACHE = KVCacheConfig(num_blocks=64, block_size=4, max_model_len=48)
MAX_SEQS, MAX_TOKENS = 4, 16
SIZES = [1, 2, 4, 8, 16]
REQUESTS = [
    Request("a", (1, 2, 3, 4, 5), max_new_tokens=6),
    Request("b", (9,) * 11, max_new_tokens=4, arrival_step=1),
    Request("c", (7, 8), max_new_tokens=8, arrival_step=2),
    Request("d", tuple(range(20)), max_new_tokens=3, arrival_step=3),  # > budget: chunked
]
# PIECEWISE_SPLIT: PIECEWISE graphs with every collective a splitting op (run between pieces)
GRAPH_MODES = ("PIECEWISE", "FULL", "PIECEWISE_SPLIT")


def _step_kind(step: Any) -> str:
    """prefill (nothing cached yet for any request), decode (uniform) or mixed."""
    if step.uniform_decode:
        return "decode"
    qsl, seq_lens = step.host.query_start_loc, step.host.seq_lens
    fresh = all(qsl[i + 1] - qsl[i] == seq_lens[i] for i in range(step.num_reqs))
    return "prefill" if fresh else "mixed"


def _serve(model: Any, forward: Any, kinds: list[str] | None = None) -> dict[str, Any]:
    from freezeframe.models.serving import ServingDriver

    def recorded(step: Any) -> Any:
        if kinds is not None:
            kinds.append(_step_kind(step))
        return forward(step)

    result = ServingDriver(model, recorded, max_num_seqs=MAX_SEQS,
                           max_num_batched_tokens=MAX_TOKENS).run(REQUESTS)
    return {"outputs": result.outputs, "sampled": result.step_sampled,
            "logits": [t.tolist() for t in result.step_logits]}


def _through_graphs(model: Any, mode: str) -> dict[str, Any]:
    import freezeframe as ff
    from freezeframe.models import ATTENTION_OP, LlamaModel
    from freezeframe.models.parallel import COLLECTIVE_SPLITTING_OPS
    from freezeframe.models.serving import RunnerForward, llama_runner_inputs

    split = mode == "PIECEWISE_SPLIT"
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", cudagraph_mode="PIECEWISE" if split else mode,
        splitting_ops=[ATTENTION_OP, *(COLLECTIVE_SPLITTING_OPS if split else ())],
        cudagraph_capture_sizes=SIZES, graph_backend="emulated", max_num_seqs=MAX_SEQS,
        max_num_tokens=MAX_TOKENS)
    compiled = ff.compile(model, cfg, dynamic_arg_dims=dict(
        LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
    runner = ff.GraphRunner(compiled, cfg, inputs=llama_runner_inputs(model, MAX_SEQS),
                            progress=False, strict=True, lockstep=True)
    report = runner.capture()
    served = _serve(model, RunnerForward(runner, MAX_SEQS))
    served["counts"] = {
        "graphs": report.num_graphs, "traced": compiled.stats.graphs_traced,
        "pieces": compiled.stats.capturable_pieces, "replays": compiled.stats.replays,
        "steps_full": runner.stats.steps_full, "steps_piecewise": runner.stats.steps_piecewise}
    return served


def _tp_worker(rank: int, world: int) -> dict[str, Any]:
    from freezeframe.cache.key import torch_factors
    from freezeframe.models import build_llama
    from freezeframe.models.llama_tp import shard_llama
    from freezeframe.models.serving import EagerForward

    # a larger init spread than the default so greedy tokens differ from the input tokens
    full = build_llama("tiny", CACHE, seed=0, init_std=0.3)
    kinds: list[str] = []
    results: dict[str, Any] = {"tp1": _serve(full, EagerForward(full), kinds), "kinds": kinds}
    shard = shard_llama(full, TensorParallel.from_group())
    del full
    results["kv_heads"] = shard.local.num_kv_heads
    results["cache_factors"] = torch_factors().get("distributed")
    results["eager"] = _serve(shard, EagerForward(shard))
    for mode in GRAPH_MODES:
        results[mode] = _through_graphs(shard, mode)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_tp_worker, 2, deadline_s=120.0)


@pytest.mark.slow
def test_the_trace_has_prefill_mixed_and_decode_steps(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["kinds"] == ["prefill"] + ["mixed"] * 4 + ["decode"] * 5
    assert [r["kv_heads"] for r in ranks] == [1, 1]  # tiny: 2 KV heads, one per rank


@pytest.mark.slow
@pytest.mark.parametrize("run", ["eager", *GRAPH_MODES])
def test_tp2_serves_the_tp1_tokens_and_logits(ranks: list[dict[str, Any]], run: str) -> None:
    for rank, res in enumerate(ranks):
        want, got = res["tp1"], res[run]
        assert got["outputs"] == want["outputs"], rank
        assert got["sampled"] == want["sampled"], rank
        for step, (a, b) in enumerate(zip(got["logits"], want["logits"], strict=True)):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4,
                                       msg=lambda m, s=step, r=rank: f"rank {r} step {s}: {m}")
    # the logits are all-gathered: both ranks hold the very same values
    assert ranks[0][run]["logits"] == ranks[1][run]["logits"]


@pytest.mark.slow
def test_each_rank_has_a_cache_key_of_its_own(ranks: list[dict[str, Any]]) -> None:
    assert [r["cache_factors"] for r in ranks] == [
        {"rank": rank, "world_size": 2, "backend": "gloo"} for rank in range(2)]
    # one process keeps the key it always had: no distributed factor at all
    from freezeframe.cache.key import distributed_factors, torch_factors

    assert distributed_factors() == {} and "distributed" not in torch_factors()


@pytest.mark.slow
def test_graphs_replayed_every_step(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        # PIECEWISE: 3 pieces around 2 attention ops, one replay each per step
        assert res["PIECEWISE"]["counts"] == {
            "graphs": 5, "traced": 1, "pieces": 3, "replays": 30, "steps_full": 0,
            "steps_piecewise": 10}
        assert res["FULL"]["counts"] == {
            "graphs": 5, "traced": 1, "pieces": 3, "replays": 10, "steps_full": 10,
            "steps_piecewise": 0}
        # split also at the collectives (the embedding's all-reduce and two per layer, each
        # with its wait): 8 captured pieces between them, one replay each per step
        assert res["PIECEWISE_SPLIT"]["counts"] == {
            "graphs": 5, "traced": 1, "pieces": 8, "replays": 80, "steps_full": 0,
            "steps_piecewise": 10}


def test_sharding_refuses_what_does_not_divide() -> None:
    cfg = LlamaConfig.preset("tiny")  # 4 heads, 2 KV heads, vocab 256
    tp4 = TensorParallel(rank=0, size=4, group_name="0")
    with pytest.raises(ConfigError, match=r"LlamaConfig.num_kv_heads=2 is not divisible by "
                                          r"the tensor-parallel size 4"):
        local_config(cfg, tp4)
    odd_vocab = LlamaConfig.preset("tiny", vocab_size=255)
    with pytest.raises(ConfigError,
                       match=r"vocab_size=255 .*TensorParallel\(vocab_parallel=False\)"):
        local_config(odd_vocab, TensorParallel(rank=1, size=2, group_name="0"))
    whole = local_config(odd_vocab, TensorParallel(1, 2, "0", vocab_parallel=False))
    assert (whole.vocab_size, whole.num_heads, whole.num_kv_heads, whole.head_dim) == (
        255, 2, 1, 16)
    with pytest.raises(ConfigError, match=r"rank=2 must lie in \[0, size=2\)"):
        TensorParallel(rank=2, size=2, group_name="0")
    with pytest.raises(ConfigError, match=r"'extra\.weight' is no tensor"):
        shard_llama_state_dict({"extra.weight": torch.zeros(1)}, cfg,
                               TensorParallel(0, 2, "0"))


def test_shards_tile_the_full_weights() -> None:
    """Rank 0's and rank 1's slices put back together are the TP=1 tensors."""
    from freezeframe.models import build_llama

    full = build_llama("tiny", CACHE, seed=0)
    state = full.state_dict()
    parts = [shard_llama_state_dict(state, full.config, TensorParallel(r, 2, "0"))
             for r in range(2)]
    d, h, kv, inter = 16, 4, 2, 128
    qkv = [p["layers.0.attn.qkv_proj.weight"] for p in parts]
    assert [t.shape[0] for t in qkv] == [(h // 2 + kv) * d] * 2
    q = torch.cat([t[: h // 2 * d] for t in qkv])
    k = torch.cat([t[h // 2 * d : (h // 2 + 1) * d] for t in qkv])
    v = torch.cat([t[(h // 2 + 1) * d :] for t in qkv])
    assert torch.equal(torch.cat([q, k, v]), state["layers.0.attn.qkv_proj.weight"])
    gate_up = [p["layers.1.mlp.gate_up_proj.weight"] for p in parts]
    gate = torch.cat([t[: inter // 2] for t in gate_up])
    up = torch.cat([t[inter // 2 :] for t in gate_up])
    assert torch.equal(torch.cat([gate, up]), state["layers.1.mlp.gate_up_proj.weight"])
    for name in ("layers.0.attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert torch.equal(torch.cat([p[name] for p in parts], dim=1), state[name])
    assert torch.equal(torch.cat([p["embed_tokens.weight"] for p in parts]),
                       state["embed_tokens.weight"])
    assert torch.equal(parts[1]["norm.weight"], state["norm.weight"])
