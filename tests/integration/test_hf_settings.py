"""Every generation setting ``lm.generate`` honours, against Hugging Face's own ``generate``.

Tiny random models (2 layers, vocab 128, nothing downloaded) of four families, each served once
for the module on emulated breakable PIECEWISE graphs (``trace=False``: no Dynamo, which
tests/integration/test_hf.py covers; here the question is the tokens each setting gives). Every
case generates for the same left-padded ragged batch (prompts of 6, 3 and 5 tokens) with HF and
with ``ff.hf``, and the token tensors must be identical; greedy cases also check that the
setting changed HF's output (so a setting ignored would fail), sampling cases use
``torch.manual_seed(s)`` for HF and ``torch.Generator().manual_seed(s)`` for ours. Every setting
runs on Llama; a representative set on Qwen2, Gemma 2 and GPT-2. Refused settings are
ConfigErrors naming them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs Hugging Face transformers: pip install 'freezeframe[hf]'")

import freezeframe as ff  # noqa: E402
from freezeframe.integrations import hf  # noqa: E402

VOCAB, NEW = 128, 6
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
LENGTHS = [6, 3, 5]
WIDTH = max(LENGTHS)


def _family(name: str) -> Any:
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))
    if name == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **TINY, head_dim=16, sliding_window=4, attn_logit_softcapping=2.0))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=None,
        eos_token_id=None, pad_token_id=None))


_SERVED: dict[str, tuple[Any, hf.CompiledCausalLM]] = {}


def _served(name: str) -> tuple[Any, hf.CompiledCausalLM]:
    """The family's model and its ff.hf form, compiled once for the module."""
    if name not in _SERVED:
        model = _family(name).eval()
        lm = ff.hf.compile(model, max_batch_size=8, max_cache_len=40, max_num_tokens=64,
                           capture_sizes=[1, 2, 4, 8], graph_backend="emulated",
                           trace=False, progress=False)
        _SERVED[name] = (model, lm)
    return _SERVED[name]


@pytest.fixture(scope="module", autouse=True)
def _forget() -> Any:
    yield
    _SERVED.clear()
    _FREE.clear()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (len(LENGTHS), WIDTH),
                        generator=torch.Generator().manual_seed(7))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        mask[row, WIDTH - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


_FREE: dict[int, torch.Tensor] = {}


def _free(model: Any) -> torch.Tensor:
    """The model's unconstrained greedy tokens for the batch (``[3, NEW]``)."""
    if id(model) not in _FREE:
        _FREE[id(model)] = _hf(model, max_new_tokens=NEW, do_sample=False)[:, WIDTH:]
    return _FREE[id(model)]


def _hf(model: Any, seed: int | None = None, **kwargs: Any) -> Any:
    ids, mask = _batch()
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)


def _ours(lm: hf.CompiledCausalLM, seed: int | None = None, **kwargs: Any) -> Any:
    ids, mask = _batch()
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out = lm.generate(ids, attention_mask=mask, pad_token_id=0, generator=gen, **kwargs)
    assert not lm.batcher.requests()  # nothing left behind
    return out


class _Ban(transformers.LogitsProcessor):
    """A caller's processor: bans one token."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_fill(1, torch.tensor([self.token]), float("-inf"))


class _StopAfter(transformers.StoppingCriteria):
    """A caller's criterion: a row ends once it has ``length`` tokens and its last is even."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return (input_ids[:, -1] % 2 == 0) & (input_ids.shape[-1] >= self.length)


# greedy cases: name -> kwargs made from the unconstrained greedy output ``free`` ([3, NEW])
Case = Callable[[torch.Tensor], dict[str, Any]]
GREEDY: dict[str, Case] = {
    "repetition_penalty": lambda f: {"repetition_penalty": 3.0},
    "encoder_repetition_penalty": lambda f: {"encoder_repetition_penalty": 3.0},
    "no_repeat_ngram_size": lambda f: {"no_repeat_ngram_size": 1},
    # (the bias pulls a prompt token in; the ban keeps it out)
    "encoder_no_repeat_ngram_size": lambda f: {"encoder_no_repeat_ngram_size": 1,
                                               "sequence_bias": {(int(_batch()[0][0, 3]),): 9.0}},
    "bad_words_ids": lambda f: {"bad_words_ids": [[int(f[0, 0])], [int(f[1, 0]), int(f[1, 1])]]},
    "sequence_bias": lambda f: {"sequence_bias": {(int(f[2, 1]),): -50.0}},
    "min_length": lambda f: {"eos_token_id": int(f[0, 1]), "min_length": WIDTH + 4},
    "min_new_tokens": lambda f: {"eos_token_id": int(f[1, 0]), "min_new_tokens": 3},
    "forced_eos_token_id": lambda f: {"forced_eos_token_id": int(f[0, 0]) + 1},
    "exponential_decay_length_penalty": lambda f: {
        "eos_token_id": int(f[2, 3]), "exponential_decay_length_penalty": (1, 40.0)},
    "suppress_tokens": lambda f: {"suppress_tokens": [int(f[0, 2]), int(f[2, 2])]},
    "begin_suppress_tokens": lambda f: {"begin_suppress_tokens": [int(f[0, 0]), int(f[1, 0])]},
    "eos_token_id_list": lambda f: {"eos_token_id": [int(f[0, 2]), int(f[1, 4])]},
    "max_length": lambda f: {"max_length": WIDTH + 3, "max_new_tokens": None},
    "logits_processor": lambda f: {"logits_processor": transformers.LogitsProcessorList(
        [_Ban(int(f[1, 1]))])},
    "stopping_criteria": lambda f: {"stopping_criteria": transformers.StoppingCriteriaList(
        [_StopAfter(WIDTH + 2)])},
    "prefix_allowed_tokens_fn": lambda f: {
        "prefix_allowed_tokens_fn": lambda batch_id, ids: [int(ids[-1]) % 50 + batch_id, 7]},
    "max_time": lambda f: {"max_time": 0.0},
}
# no visible effect on greedy tokens (checked for equality only)
NEUTRAL: dict[str, dict[str, Any]] = {
    "renormalize_logits": {"renormalize_logits": True},
    "remove_invalid_values": {"remove_invalid_values": True},
    "temperature_when_greedy": {"temperature": 0.5, "top_k": 3},
}
SAMPLING: dict[str, dict[str, Any]] = {
    "defaults": {},
    "temperature": {"temperature": 0.7, "top_k": 0},
    "top_k_top_p": {"temperature": 1.3, "top_k": 20, "top_p": 0.9},
    "min_p": {"min_p": 0.1, "top_k": 0},
    "typical_p": {"typical_p": 0.9},
    "epsilon_cutoff": {"epsilon_cutoff": 0.01},
    "eta_cutoff": {"eta_cutoff": 0.01},
    "penalties": {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2},
    "num_return_sequences": {"num_return_sequences": 2},
}
if hasattr(transformers, "TopHLogitsWarper"):
    SAMPLING["top_h"] = {"top_h": 0.5, "top_k": 0}
OTHERS = ("qwen2", "gemma2", "gpt2")
GREEDY_ON_ALL = ("repetition_penalty", "bad_words_ids", "min_new_tokens")
SAMPLING_ON_ALL = ("penalties",)


@pytest.mark.parametrize(("family", "case"), [("llama", c) for c in GREEDY] + [
    (f, c) for f in OTHERS for c in GREEDY_ON_ALL])
def test_a_greedy_setting_gives_hfs_tokens(family: str, case: str) -> None:
    model, lm = _served(family)
    free = _free(model)
    kwargs = {"max_new_tokens": NEW, "do_sample": False, **GREEDY[case](free)}
    expected = _hf(model, **kwargs)
    assert not torch.equal(expected[:, WIDTH:WIDTH + free.shape[1]], free), \
        f"{case} changes nothing here: the case would not test it"
    assert torch.equal(_ours(lm, **kwargs), expected), case


def test_settings_that_keep_greedy_tokens_give_hfs_tokens() -> None:
    model, lm = _served("llama")
    for case, setting in NEUTRAL.items():
        kwargs = {"max_new_tokens": NEW, "do_sample": False, **setting}
        assert torch.equal(_ours(lm, **kwargs), _hf(model, **kwargs)), case


@pytest.mark.parametrize(("family", "case"), [("llama", c) for c in SAMPLING] + [
    (f, c) for f in OTHERS for c in SAMPLING_ON_ALL])
def test_seeded_sampling_with_a_setting_draws_hfs_tokens(family: str, case: str) -> None:
    model, lm = _served(family)
    seed = 100 + sorted(SAMPLING).index(case)
    kwargs = {"max_new_tokens": NEW, "do_sample": True, **SAMPLING[case]}
    expected = _hf(model, seed=seed, **kwargs)
    assert torch.equal(_ours(lm, seed=seed, **kwargs), expected), case


def test_the_models_generation_config_is_read_as_hf_reads_it() -> None:
    # Before: repetition_penalty (real checkpoints ship it) was ignored, and a call without a
    # length made 20 - width tokens where HF makes 20 new ones.
    model, lm = _served("llama")
    defaults = _hf(model, do_sample=False)
    assert defaults.shape == (3, WIDTH + 20)
    assert torch.equal(_ours(lm, do_sample=False), defaults)
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.max_new_tokens = NEW
    try:
        expected = _hf(model)
        assert expected.shape == (3, WIDTH + NEW)
        assert not torch.equal(expected, defaults[:, :WIDTH + NEW])
        assert torch.equal(_ours(lm), expected)
        # a generation_config argument: its fields, then the model's, then the call's
        given = transformers.GenerationConfig(no_repeat_ngram_size=1)
        expected = _hf(model, generation_config=given, max_new_tokens=4)
        assert torch.equal(_ours(lm, generation_config=given, max_new_tokens=4), expected)
    finally:
        model.generation_config.repetition_penalty = None
        model.generation_config.max_new_tokens = None


def test_return_dict_scores_and_logits_are_hfs() -> None:
    model, lm = _served("llama")
    free = _free(model)
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": int(free[1, 2]),
              "repetition_penalty": 2.0, "return_dict_in_generate": True,
              "output_scores": True, "output_logits": True}
    theirs, ours = _hf(model, **kwargs), _ours(lm, **kwargs)
    assert type(ours) is type(theirs)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert (ours.attentions, ours.hidden_states) == (None, None)
    alive = torch.ones(3, len(theirs.scores), dtype=torch.bool)
    alive[1, 3:] = False  # row 1 made its stop token third
    for mine, hfs in ((ours.scores, theirs.scores), (ours.logits, theirs.logits)):
        assert len(mine) == len(hfs) == NEW
        for k, (a, b) in enumerate(zip(mine, hfs, strict=True)):
            assert a.shape == b.shape == (3, VOCAB)
            assert torch.isnan(a[~alive[:, k]]).all()
            rows = alive[:, k]
            torch.testing.assert_close(a[rows], b[rows].float(), rtol=0, atol=1e-4)
    plain = _ours(lm, max_new_tokens=2, output_scores=True)  # no return_dict: a tensor, as HF
    assert isinstance(plain, torch.Tensor) and plain.shape == (3, WIDTH + 2)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"num_beams": 2}, "num_beams=2 asks for beam search"),
    ({"force_words_ids": [[5]]}, r"force_words_ids=\[\[5\]\] asks for constrained beam search"),
    ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha=0.6 asks for contrastive search"),
    ({"dola_layers": "high"}, "dola_layers='high' asks for DoLa decoding"),
    ({"guidance_scale": 1.5}, "guidance_scale=1.5 asks for classifier-free guidance"),
    ({"token_healing": True}, "token_healing=True asks for token healing"),
    ({"output_hidden_states": True}, "output_hidden_states=True asks for per-layer outputs"),
    ({"assistant_early_exit": 1}, "assistant_early_exit=1 asks for a speculative decoding"),
    ({"synced_gpus": True}, "synced_gpus=True .* is not supported by ff.hf"),
    ({"negative_prompt_ids": torch.ones(1, 2, dtype=torch.long)}, "negative_prompt_ids"),
    ({"position_ids": torch.zeros(3, WIDTH, dtype=torch.long)},
     r"\['position_ids'\] are neither generation settings nor arguments ff.hf takes"),
    ({"prompt_lookup_num_tokens": 2, "do_sample": True},
     "prompt_lookup_num_tokens=2 with do_sample=True: ff.hf's speculative decoding is greedy"),
    ({"stop_strings": ["ab"]}, "stop_strings=\\['ab'\\] needs the model's tokenizer"),
])
def test_what_ff_hf_does_not_run_is_refused_by_name(kwargs: dict[str, Any], named: str) -> None:
    _, lm = _served("llama")
    with pytest.raises(ff.ConfigError, match=named):
        _ours(lm, max_new_tokens=2, **kwargs)
    assert not lm.batcher.requests()


def test_the_batcher_serves_each_request_as_hf_serves_it_alone() -> None:
    # requests with their own settings join at different steps of one continuous batch
    model, lm = _served("qwen2")
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 3, 7)]
    batcher = lm.batcher
    batcher.add(prompts[0], ff.hf.SamplingParams(max_new_tokens=5), request_id="greedy")
    batcher.step()
    batcher.add(prompts[1], transformers.GenerationConfig(
        max_new_tokens=6, repetition_penalty=2.5, no_repeat_ngram_size=1), request_id="config")
    batcher.step()
    batcher.add(prompts[2], ff.hf.SamplingParams(max_new_tokens=4, do_sample=True, top_k=10),
                request_id="sampled", generator=torch.Generator().manual_seed(5))
    while batcher.has_unfinished():
        batcher.step()
    done = {f.request_id: f for f in batcher.take_finished()}
    with torch.no_grad():
        want = {
            "greedy": model.generate(torch.tensor([prompts[0]]), max_new_tokens=5,
                                     do_sample=False),
            "config": model.generate(torch.tensor([prompts[1]]), max_new_tokens=6,
                                     do_sample=False, repetition_penalty=2.5,
                                     no_repeat_ngram_size=1),
        }
        torch.manual_seed(5)
        want["sampled"] = model.generate(torch.tensor([prompts[2]]), max_new_tokens=4,
                                         do_sample=True, top_k=10)
    for rid, prompt in zip(("greedy", "config", "sampled"), prompts, strict=True):
        assert list(done[rid].tokens) == want[rid][0, len(prompt):].tolist(), rid
        assert done[rid].finish_reason == "length"
