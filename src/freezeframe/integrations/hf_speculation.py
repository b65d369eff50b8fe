"""Speculative decoding for ``ff.hf``, Hugging Face's way, on graphs.

A request that speculates decodes in verification steps: its last token and ``k`` candidate
tokens, ``1 + k`` tokens at consecutive positions of its cache row. The model's logits at those
positions say, greedily, which token follows each prefix: the candidates are accepted up to the
first one the model would not have picked, and the model's own pick there (or after the last
candidate) is the bonus token (:func:`accept`). So the tokens are exactly plain greedy
decoding's, and a step is ``1 + k`` tokens per request, however many candidates there were
(short proposals are padded with copies of the last token, whose logits are never used): a
uniform decode step of query length ``1 + num_speculative_tokens``, which the graphs captured
for that query length (``CompilationConfig.num_speculative_tokens``) replay as FULL graphs.

The candidates come from (:class:`Proposer`):

* **prompt lookup** (``prompt_lookup_num_tokens``): transformers' own
  ``PromptLookupCandidateGenerator`` over the request's tokens (the longest recent n-gram that
  occurred before, and what followed it);
* **a draft model** (``assistant_model``, the same tokenizer): an ``ff.hf`` model of its own,
  on its own graphs and cache (same rows as the main model's), whose greedy continuation is the
  proposal. Its cache keeps up with the accepted tokens: a proposal step feeds it the tokens it
  has not seen (one, or two after a full acceptance; the whole prompt the first time), then
  ``k - 1`` single-token steps.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from freezeframe.integrations.hf_processing import Decoder
from freezeframe.integrations.hf_settings import Settings

try:
    from transformers.generation import PromptLookupCandidateGenerator
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"freezeframe.integrations.hf needs Hugging Face transformers: {exc}; "
                      "install it with pip install 'freezeframe[hf]'") from None

__all__ = ["Proposer", "accept"]


class Proposer:
    """Where one request's candidates come from: the prompt (``draft`` None) or a draft
    model (an ``ff.hf`` ``CompiledCausalLM``)."""

    def __init__(self, settings: Settings, decoder: Decoder, vocab_size: int | None,
                 device: torch.device) -> None:
        spec = settings.speculation
        assert spec is not None
        self.num_tokens = spec.num_tokens
        self.draft = spec.draft
        self.device = device
        self.seen = 0  # draft: tokens whose keys and values are in the draft's cache
        self.lookup: Any = None
        if self.draft is None:
            stop = torch.tensor(list(settings.stop_ids), device=device) \
                if settings.stop_ids else None
            # (older transformers take no processors: they cannot skip banned candidates)
            screens = {"logits_processor": decoder.processors, "vocab_size": vocab_size} \
                if len(decoder.processors) and "logits_processor" in inspect.signature(
                    PromptLookupCandidateGenerator).parameters else {}
            self.lookup = PromptLookupCandidateGenerator(
                eos_token_id=stop, num_output_tokens=spec.num_tokens,
                max_matching_ngram_size=spec.max_matching_ngram_size,
                max_length=int(settings.config.max_length), **screens)

    def _look_up(self, tokens: list[int]) -> list[int]:
        assert self.lookup is not None
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        candidate_ids, _ = self.lookup.get_candidates(ids)
        return [int(t) for t in candidate_ids[0, len(tokens):].tolist()]

    @staticmethod
    def propose_all(jobs: Sequence[tuple[Proposer | None, Decoder, int, list[int]]]
                    ) -> list[list[int]]:
        """The candidates of each ``(proposer, decoder, cache row, tokens)``: prompt lookups
        one by one, draft proposals batched per draft model."""
        out: list[list[int]] = [[] for _ in jobs]
        drafts: dict[int, list[int]] = {}
        for i, (proposer, _, _, tokens) in enumerate(jobs):
            assert proposer is not None
            if proposer.draft is None:
                out[i] = proposer._look_up(tokens)
            else:
                drafts.setdefault(id(proposer.draft), []).append(i)
        for members in drafts.values():
            proposals = _draft_round([jobs[i] for i in members])
            for i, proposal in zip(members, proposals, strict=True):
                out[i] = proposal
        return out


def _draft_round(jobs: Sequence[tuple[Any, Decoder, int, list[int]]]) -> list[list[int]]:
    """``k`` greedy tokens of the draft model after each job's tokens, for all jobs at once."""
    draft = jobs[0][0].draft
    k = jobs[0][0].num_tokens
    proposals: list[list[int]] = [[] for _ in jobs]
    # catch up: the tokens each request's draft cache has not seen (in steps of its budget)
    pending = []
    for proposer, _, row, tokens in jobs:
        proposer.seen = min(proposer.seen, len(tokens) - 1)
        pending.append((proposer, row, tokens))
    last_logits: dict[int, torch.Tensor] = {}
    while any(p.seen < len(t) for p, _, t in pending):
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        ends: list[tuple[int, int]] = []
        budget = draft.max_num_tokens
        for j, (proposer, row, tokens) in enumerate(pending):
            count = min(len(tokens) - proposer.seen, budget)
            if count <= 0:
                continue
            ids += tokens[proposer.seen:proposer.seen + count]
            positions += range(proposer.seen, proposer.seen + count)
            rows += [row] * count
            budget -= count
            proposer.seen += count
            if proposer.seen == len(tokens):
                ends.append((j, len(ids) - 1))
        logits = draft.step(ids, positions, rows)
        for j, at in ends:
            last_logits[j] = logits[at].clone()
    order = sorted(last_logits)
    picked = torch.stack([last_logits[j] for j in order]).argmax(-1).tolist()
    for j, token in zip(order, picked, strict=True):
        proposals[j].append(int(token))
    for _ in range(k - 1):
        ids = [proposals[j][-1] for j in range(len(pending))]
        positions = [len(t) + len(proposals[j]) - 1 for j, (_, _, t) in enumerate(pending)]
        rows = [row for _, row, _ in pending]
        logits = draft.step(ids, positions, rows, uniform_decode=draft.num_speculative_tokens == 0)
        for j, token in enumerate(logits.argmax(-1).tolist()):
            proposals[j].append(int(token))
        for proposer, _, _ in pending:
            proposer.seen += 1
    return proposals


def accept(decoder: Decoder, rows: torch.Tensor,
           candidates: Sequence[int]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """The tokens a verification step gives (module docstring): ``rows`` are the ``[1 + k,
    vocab]`` float32 logits after the last token and each candidate; returns ``(token, logits,
    processed scores)`` per token, the accepted candidates then the bonus token."""
    out = []
    if decoder.plain_greedy:
        picks = rows[:len(candidates) + 1].argmax(-1).tolist()
        for j, token in enumerate(picks):
            out.append((int(token), rows[j], rows[j]))
            if j >= len(candidates) or token != candidates[j]:
                break
        return out
    for j in range(len(candidates) + 1):
        scores = decoder.process(rows[j:j + 1], extra=candidates[:j])
        token = int(scores.argmax(-1))
        out.append((token, rows[j], scores[0]))
        if j >= len(candidates) or token != candidates[j]:
            break
    return out
