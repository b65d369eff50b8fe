"""The reference Llama against a plain per-request implementation (no cache, no batching).

Every step's logits for every real token must match what an obviously-correct full-sequence
forward computes for that request, on each attention path (varlen with a host sync, varlen with
host metadata, static/capturable), for mixed batches, many decode steps and GQA/MQA/MHA shapes.
Padded tokens and request rows must stay finite and leave real cache slots untouched.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch

import freezeframe as ff
from freezeframe.errors import ConfigError
from freezeframe.models import (
    ATTENTION_OP,
    ATTN_METADATA_KEY,
    BlockAllocator,
    KVCacheConfig,
    LlamaConfig,
    LlamaModel,
    build_llama,
)
from freezeframe.models.inputs import RequestChunk, StepInputs, build_step

CACHE = KVCacheConfig(num_blocks=32, block_size=4, max_model_len=40)
PATHS = ("sync", "host", "static")


def reference_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` of one request, computed from scratch."""
    cfg = model.config
    d = cfg.resolved_head_dim
    n = len(tokens)
    x = model.embed_tokens.weight[torch.tensor(tokens)]
    pos = torch.arange(n, dtype=torch.float64)
    inv_freq = cfg.rope_theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = pos[:, None] * inv_freq[None, :]
    cos, sin = ang.cos().float(), ang.sin().float()

    def rope(t: torch.Tensor) -> torch.Tensor:  # [n, heads, d], rotate-half convention
        a, b = t[..., : d // 2], t[..., d // 2 :]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    causal = torch.ones(n, n).tril().bool()
    for layer in model.layers:
        h = rms(x, layer.input_norm.weight)
        wq, wk, wv = layer.attn.qkv_proj.weight.split(
            [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
        )
        q = rope((h @ wq.T).view(n, cfg.num_heads, d))
        k = rope((h @ wk.T).view(n, cfg.num_kv_heads, d))
        v = (h @ wv.T).view(n, cfg.num_kv_heads, d)
        group = cfg.num_heads // cfg.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
        x = x + attn @ layer.attn.o_proj.weight.T
        h = rms(x, layer.post_attn_norm.weight)
        gate, up = (h @ layer.mlp.gate_up_proj.weight.T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ layer.mlp.down_proj.weight.T
    return rms(x, model.norm.weight) @ model.lm_head.weight.T


@contextlib.contextmanager
def path_context(path: str, step: StepInputs) -> Iterator[None]:
    if path == "sync":
        yield
    elif path == "host":
        with ff.forward_context(None, **{ATTN_METADATA_KEY: step.host}):
            yield
    else:
        desc = ff.BatchDescriptor(num_tokens=len(step.tensors["input_ids"]))
        with ff.forward_context(desc, mode=ff.CUDAGraphMode.FULL):
            yield


def run(model: LlamaModel, step: StepInputs, path: str) -> torch.Tensor:
    with torch.no_grad(), path_context(path, step):
        return model.compute_logits(model(*step.args))


class Scenario:
    """Requests with known full sequences; each step checks every real token's logits."""

    def __init__(self, model: LlamaModel, cache: KVCacheConfig = CACHE) -> None:
        self.model = model
        self.alloc = BlockAllocator(cache)
        self.cache = cache
        self.seqs: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}

    def add(self, name: str, prompt: list[int]) -> None:
        self.seqs[name] = list(prompt)
        self.done[name] = 0
        self.blocks[name] = self.alloc.allocate(self.cache.max_model_len)

    def step(self, plan: dict[str, int], path: str, **pad: int) -> StepInputs:
        """Feed ``plan[name]`` new tokens of each request; greedy-extend finished prompts."""
        chunks = []
        for name, count in plan.items():
            start = self.done[name]
            chunks.append(RequestChunk(
                token_ids=tuple(self.seqs[name][start : start + count]),
                num_computed=start, blocks=tuple(self.blocks[name]),
            ))
        step = build_step(chunks, self.cache, **pad)
        logits = run(self.model, step, path)
        assert logits.isfinite().all()
        qsl = step.host.query_start_loc
        for i, (name, count) in enumerate(plan.items()):
            start = self.done[name]
            self.done[name] = start + count
            ref = reference_logits(self.model, self.seqs[name][: start + count])[start:]
            torch.testing.assert_close(logits[qsl[i] : qsl[i + 1]], ref, atol=2e-5, rtol=2e-5)
            if self.done[name] == len(self.seqs[name]):
                self.seqs[name].append(int(ref[-1].argmax()))
        return step


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return build_llama("tiny", CACHE, seed=0)


@pytest.mark.parametrize("path", PATHS)
def test_mixed_prefill_chunked_prefill_and_decode_match_reference(
    tiny: LlamaModel, path: str
) -> None:
    tiny.reset_cache()
    s = Scenario(tiny)
    s.add("a", [5, 17, 99, 3, 250, 8])
    s.add("b", [1, 2, 3])
    s.add("c", [40, 41, 42, 43, 44, 45, 46, 47, 48])
    s.step({"b": 3, "c": 4}, path)  # two prefills, c only partly (chunked prefill)
    s.step({"a": 6, "b": 1, "c": 5}, path)  # prefill + decode + rest of c, in one batch
    for _ in range(6):  # decode steps, contexts crossing several blocks
        s.step({"a": 1, "b": 1, "c": 1}, path)
    assert s.done == {"a": 12, "b": 10, "c": 15}


@pytest.mark.parametrize("kv_heads", [1, 2, 4])  # MQA, GQA, MHA
def test_gqa_shapes_match_reference(kv_heads: int) -> None:
    model = build_llama(LlamaConfig.preset("tiny", num_kv_heads=kv_heads), CACHE, seed=1)
    s = Scenario(model)
    s.add("a", list(range(7)))
    s.add("b", [9, 8])
    s.step({"a": 7, "b": 2}, "host")
    for path in PATHS:
        s.step({"a": 1, "b": 1}, path)


def _cache_state(model: LlamaModel) -> list[torch.Tensor]:
    sink = CACHE.sink_slot
    return [t[:sink].clone() for layer in model.layers
            for t in (layer.attn.k_cache, layer.attn.v_cache)]


@pytest.mark.parametrize("path", PATHS)
def test_padded_rows_are_finite_and_never_touch_real_slots(tiny: LlamaModel, path: str) -> None:
    chunks = [
        RequestChunk(token_ids=(1, 2, 3), num_computed=0, blocks=(2, 3)),
        RequestChunk(token_ids=(7,), num_computed=0, blocks=(5,)),
    ]
    tiny.reset_cache()
    plain = run(tiny, build_step(chunks, CACHE), path)
    after_plain = _cache_state(tiny)

    tiny.reset_cache()
    padded = build_step(chunks, CACHE, pad_tokens_to=11, pad_reqs_to=6)
    # a careless runner might fill padding with real-looking values: slot 0 and a garbage tail
    padded.tensors["slot_mapping"][4:] = 0
    padded.tensors["query_start_loc"][3:] = 0
    padded.tensors["input_ids"][4:] = 200
    with torch.no_grad(), path_context(path, padded):
        hidden = tiny(*padded.args)
    logits = tiny.compute_logits(hidden)
    assert logits.isfinite().all()
    torch.testing.assert_close(logits[:4], plain, atol=1e-5, rtol=1e-5)
    # Same slots written with the same values, up to float rounding: a matmul over 11 rows may
    # take another BLAS kernel than one over 4 (differences ~1e-7 on some CPUs).
    for a, b in zip(_cache_state(tiny), after_plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert torch.equal(a != 0, b != 0)  # no slot written that the plain step left empty
    assert int(tiny.layers[0].attn.k_cache[0].abs().sum()) == 0  # slot 0 belongs to no request


@pytest.mark.parametrize("path", PATHS)
def test_all_padding_batch_writes_nothing(tiny: LlamaModel, path: str) -> None:
    tiny.reset_cache()
    step = build_step([], CACHE, pad_tokens_to=4, pad_reqs_to=3)
    with torch.no_grad(), path_context(path, step):
        hidden = tiny(*step.args)
    assert hidden.shape == (4, 64) and hidden.isfinite().all()
    assert all(int(t.abs().sum()) == 0 for t in _cache_state(tiny))


def test_attention_is_one_opaque_node_per_layer_in_a_dynamo_trace(tiny: LlamaModel) -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    assert ATTENTION_OP == "freezeframe::attention"
    compiled = torch.compile(tiny, backend=backend, fullgraph=True, dynamic=True)
    step = build_step(
        [RequestChunk(token_ids=(1, 2), num_computed=0, blocks=(0,))], CACHE, pad_reqs_to=4
    )
    tiny.reset_cache()
    with torch.no_grad():
        out = compiled(*step.args)
        tiny.reset_cache()
        torch.testing.assert_close(out, tiny(*step.args))
    assert len(graphs) == 1
    attention_ops = (torch.ops.freezeframe.attention, torch.ops.freezeframe.attention.default)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(t in attention_ops for t in targets) == tiny.config.num_layers


def test_config_presets_and_errors() -> None:
    one_b = LlamaConfig.preset("1b")
    assert (one_b.hidden_size, one_b.num_layers, one_b.num_heads, one_b.num_kv_heads) == (
        2048, 16, 32, 8)
    assert (one_b.intermediate_size, one_b.vocab_size, one_b.rope_theta) == (8192, 128256, 5e5)
    assert 1.23e9 < one_b.num_params() < 1.24e9  # Llama-3.2-1B: 1.236 B with tied embeddings
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        LlamaConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match="unknown Llama preset"):
        LlamaConfig.preset("7b")
    with pytest.raises(ConfigError, match="max_model_len"):
        KVCacheConfig(max_model_len=0)
    with pytest.raises(ConfigError, match=r"exceeds LlamaConfig\.max_position"):
        build_llama("tiny", KVCacheConfig(max_model_len=4096))
    alloc = BlockAllocator(KVCacheConfig(num_blocks=2, block_size=4, max_model_len=16))
    with pytest.raises(ConfigError, match="only 2 are free"):
        alloc.allocate(12)


def test_build_is_seeded_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, b = build_llama("tiny", CACHE, seed=3), build_llama("tiny", CACHE, seed=3)
    c = build_llama("tiny", CACHE, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.layers[1].mlp.down_proj.weight, b.layers[1].mlp.down_proj.weight)
    assert not torch.equal(a.layers[1].mlp.down_proj.weight, c.layers[1].mlp.down_proj.weight)
    assert a.lm_head.weight is a.embed_tokens.weight
