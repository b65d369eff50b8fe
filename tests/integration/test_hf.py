"""Hugging Face transformers models, unmodified, through ``ff.hf.compile``.

Tiny random models (2 layers, hidden 64, no downloads). Each is decoded greedily by HF itself
(``model.generate``, SDPA attention, HF's dynamic cache) and by freezeframe (one trace, split at
``freezeframe_hf::attention``, emulated graphs per padded token count, our static cache), at
batch sizes 1, 3 (padded to 4) and 8. Tolerance: every step's logits within 1e-5 of the largest
logit's magnitude (float32), and the generated tokens identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def _hf_greedy(model: torch.nn.Module, prompts: torch.Tensor) -> tuple[torch.Tensor, list]:
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, [x.float() for x in out.logits]


def _compile(model: torch.nn.Module, **kwargs: object) -> hf.CompiledCausalLM:
    return ff.hf.compile(model, max_batch_size=8, max_cache_len=32, max_num_tokens=64,
                         capture_sizes=CAPTURE_SIZES, backend="eager",
                         graph_backend="emulated", **kwargs)


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
        out = lm.generate(prompts[batch], NEW, output_logits=True)
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
    out = lm.generate(prompts, NEW, output_logits=True)
    assert torch.equal(out.sequences, sequences)
    for ours, theirs in zip(out.logits, logits, strict=True):
        assert (ours - theirs).abs().max().item() <= REL_TOL * theirs.abs().max().item()
    # the 15-token prefill runs without graphs; the 3 decode steps replay FULL graphs of 4
    assert (lm.stats.steps_full, lm.stats.steps_piecewise, lm.stats.fallback_too_large) == \
        (3, 0, 1)


def test_the_model_called_directly_after_compile_is_still_hf() -> None:
    # "freezeframe" attention without freezeframe's step metadata is HF's SDPA with HF's mask,
    # so a padded batch with a cache still gives what it gave before compile.
    model = _tiny("qwen2")
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
    sliding = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
        sliding_window=8, max_window_layers=1))
    with pytest.raises(ff.ConfigError, match=r"\['sliding_attention'\] layers"):
        ff.hf.compile(sliding)

    lm = _compile(model)  # nothing is traced until the first step
    with pytest.raises(ff.ConfigError, match="input_ids has 9 rows but max_batch_size is 8"):
        lm.generate(torch.zeros(9, 2, dtype=torch.long), 1)
    with pytest.raises(ff.ConfigError, match="need 33 cache positions but max_cache_len is 32"):
        lm.generate(torch.zeros(1, 30, dtype=torch.long), 4)
    with pytest.raises(ff.ConfigError, match=r"2-d torch\.long tensor"):
        lm.generate(torch.zeros(1, 3), 1)
    with pytest.raises(ff.ConfigError, match="max_new_tokens=0 must be an int >= 1"):
        lm.generate(torch.zeros(1, 3, dtype=torch.long), 0)
    assert lm.compiled.stats.graphs_traced == 0


def test_import_freezeframe_does_not_import_transformers() -> None:
    # ff.hf is public (in __all__) but resolved on first use; this process has used it
    assert ff.hf is hf
    code = "import sys, freezeframe as ff; print('hf' in ff.__all__, 'transformers' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    assert proc.stdout.split() == ["True", "False"]
