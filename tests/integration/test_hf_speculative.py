"""Speculative decoding on graphs: prompt lookup and a draft model, verified ``1 + k`` tokens
per request in uniform decode steps that replay FULL graphs keyed on that query length.

A tiny Llama served with ``num_speculative_tokens=3`` and FULL_AND_PIECEWISE emulated graphs
(breakable, no Dynamo: the verification keys are what is tested). The tokens must be plain
greedy decoding's (HF's own ``generate``), and the step counts exact: the prefill (30 tokens,
above the largest graph: no graph), then one FULL step per verification round, as many rounds
as an independent replay of HF's ``PromptLookupCandidateGenerator`` over the greedy tokens
says (prompt lookup), or ``ceil((new - 1) / (k + 1))`` with a draft that is the model itself
(every candidate accepted).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs Hugging Face transformers: pip install 'freezeframe[hf]'")

import freezeframe as ff  # noqa: E402
from freezeframe.integrations import hf  # noqa: E402

K, NEW = 3, 12
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
PROMPTS = torch.tensor([[5, 6, 7, 8, 9] * 3, [9, 8, 7, 6, 5] * 3])  # repetitive: lookups hit


@pytest.fixture(scope="module")
def llama() -> Any:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()


@pytest.fixture(scope="module")
def greedy(llama: Any) -> torch.Tensor:
    with torch.no_grad():
        return llama.generate(PROMPTS, max_new_tokens=NEW, do_sample=False)


@pytest.fixture(scope="module")
def lm(llama: Any) -> hf.CompiledCausalLM:
    lm = ff.hf.compile(llama, max_batch_size=4, max_cache_len=40, max_num_tokens=64,
                       capture_sizes=[4, 8, 16], graph_backend="emulated",
                       cudagraph_mode="full_and_piecewise", num_speculative_tokens=K,
                       trace=False, progress=False)
    report = lm.capture()
    # the decode keys are uniform steps of 1, 2 and 4 requests of 1 + K tokens
    assert sorted((g.descriptor.num_tokens, g.descriptor.num_reqs, g.descriptor.uniform)
                  for g in report.graphs if g.mode is ff.CUDAGraphMode.FULL) == [
        (4, 1, True), (8, 2, True), (16, 4, True)]
    return lm


def _lookup_rounds(sequence: list[int], width: int) -> int:
    """Verification rounds prompt lookup takes to make ``sequence[width:]``: HF's candidate
    generator over each prefix, accepted up to the first candidate that is not the token."""
    lookup = transformers.generation.PromptLookupCandidateGenerator(
        num_output_tokens=K, max_matching_ngram_size=2, max_length=width + NEW)
    length, rounds = width + 1, 0  # the prefill makes the first token
    while length < width + NEW:
        ids = torch.tensor([sequence[:length]])
        candidates = lookup.get_candidates(ids)[0][0, length:].tolist()
        accepted = 0
        while accepted < len(candidates) and candidates[accepted] == sequence[length + accepted]:
            accepted += 1
        length = min(length + accepted + 1, width + NEW)
        rounds += 1
    return rounds


def _steps(lm: hf.CompiledCausalLM) -> tuple[int, int, int, int]:
    s = lm.stats
    return s.steps, s.steps_full, s.steps_piecewise, s.steps_eager


def test_prompt_lookup_matches_greedy_and_verifies_on_full_graphs(
        lm: hf.CompiledCausalLM, greedy: torch.Tensor) -> None:
    before = _steps(lm)
    out = lm.generate(PROMPTS, max_new_tokens=NEW, prompt_lookup_num_tokens=K)
    assert torch.equal(out, greedy)
    rounds = max(_lookup_rounds(row, PROMPTS.shape[1]) for row in greedy.tolist())
    assert rounds < NEW - 1  # the lookups saved steps
    after = _steps(lm)
    assert [a - b for a, b in zip(after, before, strict=True)] == [1 + rounds, rounds, 0, 1]
    # fewer candidates than the graphs verify: padded to a uniform step all the same
    out = lm.generate(PROMPTS[:1], max_new_tokens=NEW, prompt_lookup_num_tokens=1)
    assert torch.equal(out, greedy[:1])
    assert lm.stats.steps_full - after[1] == lm.stats.steps - after[0] - 1


def test_a_draft_model_matches_greedy_on_full_graphs(lm: hf.CompiledCausalLM, llama: Any,
                                                     greedy: torch.Tensor) -> None:
    same = copy.deepcopy(llama)  # proposes what the model picks: every candidate accepted
    before = _steps(lm)
    out = lm.generate(PROMPTS, max_new_tokens=NEW, assistant_model=same)
    assert torch.equal(out, greedy)
    rounds = math.ceil((NEW - 1) / (K + 1))
    assert [a - b for a, b in zip(_steps(lm), before, strict=True)] == [1 + rounds, rounds, 0, 1]
    draft = lm.draft(same)  # compiled once, kept for the next call
    assert draft is lm.draft(same) and draft.stats.steps_full > 0
    # another draft (other weights): other proposals, the same tokens
    torch.manual_seed(1)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**TINY, "num_hidden_layers": 1})).eval()
    before = _steps(lm)
    assert torch.equal(lm.generate(PROMPTS, max_new_tokens=NEW, assistant_model=other), greedy)
    steps, full, piecewise, eager = (a - b for a, b in zip(_steps(lm), before, strict=True))
    assert (full, piecewise, eager) == (steps - 1, 0, 1)


def test_speculation_with_processors_and_stop_tokens_is_plain_greedy(
        lm: hf.CompiledCausalLM, llama: Any) -> None:
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "repetition_penalty": 1.5,
              "eos_token_id": 80}
    with torch.no_grad():
        expected = llama.generate(PROMPTS, **kwargs)
    assert torch.equal(lm.generate(PROMPTS, prompt_lookup_num_tokens=K, **kwargs), expected)


def test_speculation_arguments_are_checked(lm: hf.CompiledCausalLM, llama: Any) -> None:
    with pytest.raises(ff.ConfigError, match="prompt_lookup_num_tokens=4 is more than the "
                                             "num_speculative_tokens=3"):
        lm.generate(PROMPTS, max_new_tokens=2, prompt_lookup_num_tokens=4)
    with pytest.raises(ff.ConfigError, match="assistant_model is the model itself"):
        lm.generate(PROMPTS, max_new_tokens=2, assistant_model=llama)
    wide = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, "vocab_size": 130}))
    with pytest.raises(ff.ConfigError, match="vocabulary has 130 tokens, this model's 128"):
        lm.generate(PROMPTS, max_new_tokens=2, assistant_model=wide)
    assert not lm.batcher.requests()
