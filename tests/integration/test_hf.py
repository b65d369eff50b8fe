"""Hugging Face transformers models, unmodified, through ``ff.hf.compile``.

Tiny random models (2 layers, hidden 64, no downloads). Each is decoded greedily by HF itself
(``model.generate``, SDPA attention, HF's dynamic cache) and by freezeframe (one trace, split at
``freezeframe_hf::attention``, emulated graphs per padded token count, our static cache), at
batch sizes 1, 3 (padded to 4) and 8. Tolerance: every step's logits within 1e-5 of the largest
logit's magnitude (float32), and the generated tokens identical.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs Hugging Face transformers: pip install 'freezeframe[hf]'")

import freezeframe as ff  # noqa: E402
from freezeframe.integrations import hf  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VOCAB, PROMPT, NEW = 128, 5, 4
CAPTURE_SIZES = [1, 2, 4, 8]
REL_TOL = 1e-5
# no special tokens: generate() must not stop early or pad
NO_SPECIAL = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            **NO_SPECIAL)
        return transformers.LlamaForCausalLM(config).eval()
    if family == "qwen2":
        config = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            **NO_SPECIAL)
        return transformers.Qwen2ForCausalLM(config).eval()
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64, **NO_SPECIAL)
    return transformers.GPT2LMHeadModel(config).eval()


def _hf_greedy(model: Any, prompts: torch.Tensor) -> tuple[torch.Tensor, list]:
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, [x.float() for x in out.logits]


def _compile(model: torch.nn.Module, **kwargs: Any) -> hf.CompiledCausalLM:
    options: dict[str, Any] = {"max_batch_size": 8, "max_cache_len": 32, "max_num_tokens": 64,
                               "capture_sizes": CAPTURE_SIZES, "backend": "eager",
                               "graph_backend": "emulated", **kwargs}
    return ff.hf.compile(model, **options)


# batch size -> (piecewise steps, steps above the largest capture size, padded tokens) for a
# 5-token prompt and 4 new tokens: the prefill is batch * 5 tokens (5 pads to 8; 15 and 40 are
# above 8 and run without graphs), then 3 decode steps of batch tokens (3 pads to 4).
EXPECTED_STEPS = {1: (1 + 3, 0, 3), 3: (3, 1, 3 * 1), 8: (3, 1, 0)}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_greedy_decode_matches_hf_eager_on_graphs_per_padded_batch(family: str) -> None:
    model = _tiny(family)
    gen = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(0, VOCAB, (b, PROMPT), generator=gen) for b in EXPECTED_STEPS}
    expected = {b: _hf_greedy(model, p) for b, p in prompts.items()}  # before compile

    lm = _compile(model)
    report = lm.capture()
    pieces = lm.compiled.pieces
    assert [p.is_splitting_op for p in pieces] == [False, True, False, True, False]
    assert sorted(g.descriptor.num_tokens for g in report.graphs) == CAPTURE_SIZES
    assert report.count(ff.CUDAGraphMode.PIECEWISE) == 4
    assert lm.compiled.stats.graphs_captured == 3 * 4  # 3 capturable pieces x 4 sizes
    for wrapper in lm.compiled.graph_wrappers():
        assert sorted(d.num_tokens for d in wrapper.captured_descriptors) == CAPTURE_SIZES

    for batch, (piecewise, too_large, padded) in EXPECTED_STEPS.items():
        before = (lm.stats.steps_piecewise, lm.stats.fallback_too_large,
                  lm.stats.padded_tokens, lm.compiled.stats.replays)
        out = lm.generate(prompts[batch], NEW, output_logits=True,
                          return_dict_in_generate=True)
        sequences, logits = expected[batch]
        assert torch.equal(out.sequences, sequences), (batch, out.sequences, sequences)
        assert len(out.logits) == NEW
        for step, (ours, theirs) in enumerate(zip(out.logits, logits, strict=True)):
            error = (ours.float() - theirs).abs().max().item() / theirs.abs().max().item()
            assert error <= REL_TOL, (batch, step, error)
        after = (lm.stats.steps_piecewise, lm.stats.fallback_too_large,
                 lm.stats.padded_tokens, lm.compiled.stats.replays)
        assert [a - b for a, b in zip(after, before, strict=True)] == \
            [piecewise, too_large, padded, 3 * piecewise], batch
    # nothing was captured after capture(): every step replayed or ran without graphs
    assert lm.compiled.stats.graphs_captured == 12
    assert lm.compiled.stats.graphs_traced == 1


def test_full_and_piecewise_decode_replays_full_graphs() -> None:
    # The attention op needs no host sync, so a whole decode step is captured as one graph.
    model = _tiny("llama")
    prompts = torch.randint(0, VOCAB, (3, PROMPT), generator=torch.Generator().manual_seed(2))
    sequences, logits = _hf_greedy(model, prompts)
    lm = _compile(model, cudagraph_mode="full_and_piecewise")
    report = lm.capture()
    assert report.count(ff.CUDAGraphMode.FULL) == 4
    assert report.count(ff.CUDAGraphMode.PIECEWISE) == 4
    out = lm.generate(prompts, NEW, output_logits=True,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, sequences)
    for ours, theirs in zip(out.logits, logits, strict=True):
        assert (ours - theirs).abs().max().item() <= REL_TOL * theirs.abs().max().item()
    # the 15-token prefill runs without graphs; the 3 decode steps replay FULL graphs of 4
    assert (lm.stats.steps_full, lm.stats.steps_piecewise, lm.stats.fallback_too_large) == \
        (3, 0, 1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_without_a_trace_breakable_graphs_decode_like_hf(family: str) -> None:
    # trace=False: no Dynamo, no compiler; the forward runs as HF wrote it and its graphs
    # break at the attention op
    model = _tiny(family)
    prompts = torch.randint(0, VOCAB, (3, PROMPT), generator=torch.Generator().manual_seed(4))
    sequences, logits = _hf_greedy(model, prompts)
    lm = _compile(model, trace=False)
    assert lm.compiled.config.mode is ff.CompilationMode.NONE
    report = lm.capture()
    assert sorted(g.descriptor.num_tokens for g in report.graphs) == CAPTURE_SIZES
    assert {(g.segments, g.breaks) for g in report.graphs} == {
        (3, (hf.HF_ATTENTION_OP, hf.HF_ATTENTION_OP))}
    out = lm.generate(prompts, NEW, output_logits=True,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, sequences)
    for ours, theirs in zip(out.logits, logits, strict=True):
        assert (ours - theirs).abs().max().item() <= REL_TOL * theirs.abs().max().item()
    assert (lm.stats.steps_piecewise, lm.stats.fallback_too_large) == (3, 1)
    assert lm.compiled.stats.graphs_traced == 0


def test_the_model_called_directly_after_compile_is_still_hf() -> None:
    # "freezeframe" attention without freezeframe's step metadata is HF's SDPA with HF's mask,
    # so a padded batch with a cache still gives what it gave before compile.
    model: Any = _tiny("qwen2")
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    _compile(model)
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_bad_arguments_are_named() -> None:
    model = _tiny("gpt2")
    with pytest.raises(ff.ConfigError, match="max_cache_len=65 is above the model's "
                                             "max_position_embeddings=64"):
        ff.hf.compile(model, max_cache_len=65)
    with pytest.raises(ff.ConfigError, match="max_batch_size=0 must be an int >= 1"):
        ff.hf.compile(model, max_batch_size=0)
    cfg = ff.CompilationConfig(backend="eager", splitting_ops=["freezeframe::attention"])
    with pytest.raises(ff.ConfigError, match="does not name 'freezeframe_hf::attention'"):
        ff.hf.compile(model, cfg, max_cache_len=32)
    with pytest.raises(ff.ConfigError, match=r"\['backend'\] given together with config"):
        ff.hf.compile(model, ff.CompilationConfig(), max_cache_len=32, backend="eager")
    with pytest.raises(ff.ConfigError, match="only decoder-only causal LMs"):
        ff.hf.compile(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, add_cross_attention=True)))

    lm = _compile(model)  # nothing is traced until the first step
    with pytest.raises(ff.ConfigError, match="need 33 cache positions but max_cache_len is 32"):
        lm.generate(torch.zeros(1, 30, dtype=torch.long), 4)
    with pytest.raises(ff.ConfigError, match=r"2-d torch\.long tensor"):
        lm.generate(torch.zeros(1, 3), 1)
    with pytest.raises(ff.ConfigError, match="`max_new_tokens` must be greater than 0"):
        lm.generate(torch.zeros(1, 3, dtype=torch.long), 0)
    assert lm.compiled.stats.graphs_traced == 0


# -- what ff.hf refuses, and what it serves at the edge of what it refuses -----------------------
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, **NO_SPECIAL}


def _assert_generates_like_hf(model: torch.nn.Module, **kwargs: Any) -> hf.CompiledCausalLM:
    # 3 prompts of PROMPT tokens: a 15-token prefill (no graph), then decode steps of 3 rows
    prompts = torch.randint(0, VOCAB, (3, PROMPT), generator=torch.Generator().manual_seed(4))
    sequences, logits = _hf_greedy(model, prompts)
    lm = _compile(model, **kwargs)
    out = lm.generate(prompts, NEW, output_logits=True,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, sequences), (out.sequences, sequences)
    for ours, theirs in zip(out.logits, logits, strict=True):
        assert (ours - theirs).abs().max().item() <= REL_TOL * theirs.abs().max().item()
    return lm


def test_models_without_causal_self_attention_are_refused_at_compile() -> None:
    # Before: BertForMaskedLM was served with causal attention (logits off by 1.4e-2).
    bert = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 64,
            **NO_SPECIAL}
    torch.manual_seed(0)
    encoder = transformers.BertForMaskedLM(transformers.BertConfig(**bert)).eval()
    with pytest.raises(ff.ConfigError) as info:
        _compile(encoder)
    assert str(info.value) == (
        "ff.hf.compile: BertForMaskedLM is not a causal language model: its attention is "
        "bidirectional (BertSelfAttention.is_causal is False, config.is_decoder is False). "
        "ff.hf serves decoder-only causal LMs, whose every token attends only to itself and "
        "earlier tokens (LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel, ...); serve an "
        "encoder with ff.compile or ff.GraphRunner and an attention of your own")
    assert encoder.config._attn_implementation != hf.ATTN_IMPLEMENTATION  # left untouched
    classifier = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**TINY))
    with pytest.raises(ff.ConfigError, match=r"^ff.hf.compile: LlamaForSequenceClassification "
                                             r"is not a causal language model: it has no causal "
                                             r"LM head \(can_generate\(\) is False\)\. "):
        _compile(classifier)
    # the same architecture as a decoder (is_decoder=True: causal) is served, exactly
    decoder = transformers.BertLMHeadModel(transformers.BertConfig(**bert, is_decoder=True))
    _assert_generates_like_hf(decoder.eval())


def test_step_checks_every_index_on_the_host_before_anything_is_written() -> None:
    # Before: positions=-1 wrote NaN into the cache (every later generate on that row wrong),
    # seq_ids=8 landed in the padding row, positions=32 was a raw IndexError.
    model = _tiny("llama")
    lm = _assert_generates_like_hf(model)
    caches = (lm._flat.k_cache.clone(), lm._flat.v_cache.clone())
    steps = lm.stats.steps
    bad = [
        (([3], [-1], [0]), "step: positions[0] = -1 is outside [0, max_cache_len=32); a "
                           "position counts from 0 (the token's index in its sequence)"),
        (([3, 4], [0, 32], [1, 1]), "step: positions[1] = 32 is outside [0, max_cache_len=32); "
                                    "ff.hf.compile with max_cache_len >= 33 for sequences this "
                                    "long"),
        (([3], [0], [8]), "step: seq_ids[0] = 8 is outside [0, max_batch_size=8); ff.hf.compile "
                          "with max_batch_size >= 9 for that many rows"),
        (([3], [0], [-1]), "step: seq_ids[0] = -1 is outside [0, max_batch_size=8); seq_ids are "
                           "the cache rows of real sequences, from 0 (padding is the runner's)"),
        (([128], [0], [0]), "step: input_ids[0] = 128 is outside [0, the vocabulary size "
                            "(config.vocab_size)=128); pass token ids of this model's tokenizer"),
        (([3, 4], [0], [0, 0]), "step: input_ids, positions and seq_ids need one entry per "
                                "token, at least one, but have 2, 1 and 2 entries"),
        (([3], [0.0], [0]), "step: positions must be a 1-d integer tensor or a list of ints, "
                            "one entry per token; got a 1-d torch.float32 tensor"),
    ]
    for (ids, positions, rows), message in bad:
        for as_tensor in (True, False):
            args: list[Any] = [torch.tensor(a) if as_tensor else a for a in (ids, positions, rows)]
            with pytest.raises(ff.ConfigError) as info:
                lm.step(*args)
            assert str(info.value) == message
    assert lm.stats.steps == steps  # nothing reached the runner ...
    assert torch.equal(lm._flat.k_cache, caches[0]) and torch.equal(lm._flat.v_cache, caches[1])
    # ... and a list and a tensor of the same step give the same logits
    by_list = lm.step([5, 6], [0, 1], [7, 7]).clone()
    by_tensor = lm.step(torch.tensor([5, 6]), torch.tensor([0, 1]), torch.tensor([7, 7]))
    assert torch.equal(by_list, by_tensor)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([[5, 6]])).logits[0]
    assert (by_tensor - expected).abs().max().item() <= REL_TOL * expected.abs().max().item()


def test_sliding_window_attention_generates_like_hf() -> None:
    # 5 prompt tokens + 4 new ones: a window of 4 masks positions from the second new token on
    torch.manual_seed(0)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        **TINY, max_position_embeddings=64, sliding_window=4)).eval()
    lm = _assert_generates_like_hf(mistral, max_cache_len=16)
    assert lm.max_cache_len == 16
    # the window matters: the same weights with full attention make other logits
    full = transformers.MistralForCausalLM(transformers.MistralConfig(
        **TINY, max_position_embeddings=64, sliding_window=None)).eval()
    full.load_state_dict(mistral.state_dict())
    prompts = torch.randint(0, VOCAB, (3, PROMPT), generator=torch.Generator().manual_seed(4))
    assert not torch.allclose(torch.stack(_hf_greedy(full, prompts)[1]),
                              torch.stack(_hf_greedy(mistral, prompts)[1]))
    # Qwen2 with use_sliding_window=True: its second layer slides (max_window_layers=1)
    torch.manual_seed(0)
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **TINY, max_position_embeddings=64, use_sliding_window=True, sliding_window=3,
        max_window_layers=1))
    assert qwen.config.layer_types == ["full_attention", "sliding_attention"]
    _assert_generates_like_hf(qwen.eval(), max_cache_len=16)


def test_soft_capping_generates_like_hf() -> None:
    # Gemma 2: attention logit soft-capping, final logit soft-capping, sliding layers
    torch.manual_seed(0)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **TINY, head_dim=16, max_position_embeddings=64, sliding_window=3,
        attn_logit_softcapping=2.0)).eval()
    _assert_generates_like_hf(gemma, max_cache_len=16)


def _tiny_mixtral() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **TINY, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)).eval()


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise", "full"])
def test_mixture_of_experts_is_refused_with_graphs(mode: str) -> None:
    # Before: piecewise graphs generated other tokens than HF (row 3 of 4, third new token):
    # transformers' grouped-mm fallback reads the per-expert offsets with offs.tolist(), so the
    # captured graph replays the expert split of the step it captured.
    with pytest.raises(ff.ConfigError) as info:
        _compile(_tiny_mixtral(), cudagraph_mode=mode)
    assert str(info.value) == (
        f"ff.hf.compile: MixtralForCausalLM is a mixture-of-experts model (config."
        f"num_local_experts=4) and cudagraph_mode={mode.upper()} captures graphs; expert routing "
        "is data-dependent (which tokens go to which expert is read back to the host or "
        "becomes a shape), so a captured graph would freeze the routing of the step it "
        "captured and every replay would send tokens to the wrong experts. Pass trace=False "
        "with cudagraph_mode='piecewise' (breakable graphs; the experts run eagerly between "
        "them), cudagraph_mode='none' (compiled, no graphs), or serve it without ff.hf")


def test_mixture_of_experts_on_breakable_graphs_generates_like_hf() -> None:
    # the experts are breaks: they run eagerly at every replay, on the router's fresh choice
    lm = _assert_generates_like_hf(_tiny_mixtral(), trace=False, cudagraph_mode="piecewise")
    assert lm.stats.steps_piecewise == 3  # the three decode steps; the prefill is too large
    report = lm.capture()  # (captured at the first step: the report of that capture)
    assert [c.breaks for c in report.graphs] == [
        ("freezeframe_hf::attention", "@graph_break MixtralExperts.forward") * 2] * 4
    with pytest.raises(ff.ConfigError, match="Pass trace=False with cudagraph_mode='piecewise'"):
        _compile(_tiny_mixtral(), trace=False, cudagraph_mode="full_and_piecewise")


def test_mixture_of_experts_without_graphs_generates_like_hf() -> None:
    lm = _assert_generates_like_hf(_tiny_mixtral(), cudagraph_mode="none")
    assert (lm.stats.steps_eager, lm.stats.steps_piecewise, lm.stats.steps_full) == (4, 0, 0)


def test_import_freezeframe_does_not_import_transformers() -> None:
    # ff.hf is public (in __all__) but resolved on first use; this process has used it
    assert ff.hf is hf
    code = "import sys, freezeframe as ff; print('hf' in ff.__all__, 'transformers' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    assert proc.stdout.split() == ["True", "False"]


_WARM_CHILD = textwrap.dedent("""
    import json, sys, time
    sys.path[:0] = [{src!r}]
    import torch, transformers
    import freezeframe as ff
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    prompts = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(4))
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", cudagraph_mode="piecewise",
                               splitting_ops=[ff.hf.HF_ATTENTION_OP], graph_backend="emulated",
                               cudagraph_capture_sizes=[1, 2, 4, 8], max_num_tokens=64,
                               max_num_seqs=8, cache_dir={cache_dir!r})
    lm = ff.hf.compile(model, cfg, max_batch_size=8, max_cache_len=32, progress=False)
    out = lm.generate(prompts, 4)
    s = lm.compiled.stats
    print(json.dumps({{"tokens": out.tolist(), "loaded": s.traces_loaded,
                       "not_saved": s.traces_not_saved}}))
""")


def test_a_warm_start_in_a_fresh_process_loads_the_trace(tmp_path: Path) -> None:
    # Before: never saved (transformers' output capturing stores constants on a module
    # global under Dynamo; a namedtuple, torch and a dataclass __init__ reached through
    # globals Dynamo installs per process), so every warm start traced with Dynamo again.
    code = _WARM_CHILD.format(src=str(Path(__file__).resolve().parents[2] / "src"),
                              cache_dir=str(tmp_path / "cache"))
    env = {k: v for k, v in os.environ.items() if k != "FREEZEFRAME_DISABLE_CACHE"}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert (cold["loaded"], cold["not_saved"]) == (0, 0)
    assert (warm["loaded"], warm["not_saved"]) == (1, 0)  # (its graph still counts as traced)
    assert warm["tokens"] == cold["tokens"]


def test_longrope_is_served_only_below_its_switch() -> None:
    # Before: a LongRoPE model (Phi-3 128k style) was served with any cache; HF picks the short
    # or long factors from the longest position of each forward of one sequence, while an
    # ff.hf step mixes sequences and prefills long prompts in chunks (logits off from HF's).
    head_dim = 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0] * (head_dim // 2), "long_factor": [4.0] * (head_dim // 2)}
    torch.manual_seed(0)
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **TINY, max_position_embeddings=64, original_max_position_embeddings=16,
        rope_parameters=rope)).eval()
    with pytest.raises(ff.ConfigError, match=r"Phi3ForCausalLM uses LongRoPE, .* Pass "
                                             r"max_cache_len <= 16 \(every sequence then uses"):
        _compile(phi3, max_cache_len=17, trace=False)
    fresh = copy.deepcopy(phi3)  # never called yet
    _assert_generates_like_hf(phi3, max_cache_len=16, trace=False)
    # Before: a model compiled before its first forward raised ff.CompileError at the first
    # step ("rotary_emb.long_inv_freq was set after the trace": HF's rotary module sets it
    # lazily, inside the step). ff.hf runs one token through the model before compiling it.
    lm = _compile(fresh, max_cache_len=16, trace=False)
    prompts = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(5))
    out = lm.generate(prompts, NEW)
    assert torch.equal(out, _hf_greedy(fresh, prompts)[0])


def test_dynamic_ntk_rope_is_served_within_its_cached_positions() -> None:
    # Before: ff.hf.compile of a dynamic-NTK RoPE model failed in Dynamo with "Data-dependent
    # branching" inside HF's per-call frequency update, naming nothing the user set. Within the
    # positions the module has cached the update never changes the frequencies, so ff.hf runs
    # the rotary embedding without it and matches HF's tokens and logits.
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **TINY, max_position_embeddings=32, rope_parameters=rope)).eval()
    grown = copy.deepcopy(llama)
    _assert_generates_like_hf(llama, max_cache_len=32, trace=False)
    # A module HF already grew past its original positions would reset on the next shorter
    # sequence: refused by name, before anything is changed.
    grown.model.rotary_emb.max_seq_len_cached = 48
    with pytest.raises(ff.ConfigError, match=r"model\.rotary_emb \(LlamaRotaryEmbedding\): its "
                                             r"dynamic NTK RoPE was already grown to 48"):
        _compile(grown, max_cache_len=32, trace=False)
    assert "forward" not in grown.model.rotary_emb.__dict__
