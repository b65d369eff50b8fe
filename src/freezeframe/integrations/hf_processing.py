"""How a request of ``ff.hf`` turns logits into its next token: Hugging Face's own logits
processors, warpers and stopping criteria, applied to that request with its own token history.

:func:`processors` builds the ``LogitsProcessorList`` HF's ``generate`` would build for the
resolved settings (:mod:`~freezeframe.integrations.hf_settings`), from transformers' public
classes and in HF's order: sequence bias, repetition penalties, n-gram bans, bad words, minimum
lengths, the prefix constraint, forced tokens, invalid values, length penalty, suppressed
tokens; then the caller's ``logits_processor`` list merged as HF merges it (one of a class HF
built replaces HF's at its place, the others follow); then, when sampling, the warpers
(temperature, top-h, top-k, top-p, min-p, typical, epsilon, eta); last, renormalisation.
:func:`criteria` builds the ``StoppingCriteriaList`` (length, time, stop strings, stop tokens,
the caller's merged in).

Each request gets its own lists, built for its row as HF builds them for the batch (the
prompt's padding, its index in the batch, its prompt width), and called with ``input_ids`` of
shape ``[1, length]``: the request's history (the row's padding as HF sees it, the prompt, the
tokens so far). So a request in a continuous batch sees what its row sees in HF's ``generate``,
whatever else shares its step. A list of only history-free, row-wise classes (the warpers,
suppressed tokens, renormalisation) is shared by the requests of one call and applied to their
rows at once; greedy decoding with no processor is one ``argmax`` for the whole step.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from freezeframe.errors import ConfigError
from freezeframe.integrations.hf_settings import Settings

try:
    from transformers import generation as _hf_generation
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"freezeframe.integrations.hf needs Hugging Face transformers: {exc}; "
                      "install it with pip install 'freezeframe[hf]'") from None

__all__ = ["Decoder", "Row", "criteria", "pick", "processors", "row_wise"]

_gen: Any = _hf_generation  # (transformers' annotations are narrower than its classes take)

# Classes whose call reads only the scores, row by row: a list of these alone is applied to
# several requests' rows at once (what it does to a row does not depend on the others).
_ROW_WISE = tuple(getattr(_gen, name) for name in (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper",
    "SuppressTokensLogitsProcessor", "InfNanRemoveLogitsProcessor", "LogitNormalization")
    if hasattr(_gen, name))


class Row:
    """What HF knows of one row of its batch when it builds the processors: its index
    (``prefix_allowed_tokens_fn``'s ``batch_id``), its ids as HF holds them (``[1, width]``:
    padding, then the prompt) and how many of them are padding."""

    __slots__ = ("index", "padded", "padding")

    def __init__(self, index: int, padded: torch.Tensor, padding: int | None) -> None:
        self.index = index
        self.padded = padded  # [1, width] long
        self.padding = padding  # leading pads (None: the call had no padding at all)


def _stop_tensor(settings: Settings, device: torch.device) -> torch.Tensor | None:
    ids = settings.stop_ids
    return torch.tensor(list(ids), dtype=torch.long, device=device) if ids else None


def _accepts(cls: type, name: str) -> bool:
    return name in inspect.signature(cls).parameters


def _repetition_penalty(penalty: float, row: Row, device: torch.device) -> Any:
    """HF's repetition penalty for ``row``: its padding is exempt where HF's generate exempts it
    (the releases whose processor takes the padding lengths as a tensor, 5.24 on; before,
    padding tokens were penalised like any other)."""
    cls = _gen.RepetitionPenaltyLogitsProcessor
    if row.padding is not None and _accepts(cls, "prompt_ignore_length"):
        try:
            return cls(penalty, prompt_ignore_length=torch.tensor([row.padding], device=device))
        except ValueError:  # (an int only: this release's generate passes none)
            pass
    return cls(penalty)


def _content(settings: Settings, row: Row, device: torch.device) -> list[Any]:
    """The processors HF builds from the config before the caller's list is merged in."""
    cfg, width, eos = settings.config, row.padded.shape[1], _stop_tensor(settings, device)
    made: list[Any] = []
    if cfg.sequence_bias is not None:
        made.append(_gen.SequenceBiasLogitsProcessor(sequence_bias=cfg.sequence_bias))
    if cfg.encoder_repetition_penalty not in (None, 1.0):
        made.append(_gen.EncoderRepetitionPenaltyLogitsProcessor(
            float(cfg.encoder_repetition_penalty), encoder_input_ids=row.padded.to(device)))
    if cfg.repetition_penalty not in (None, 1.0):
        made.append(_repetition_penalty(float(cfg.repetition_penalty), row, device))
    if cfg.no_repeat_ngram_size:
        made.append(_gen.NoRepeatNGramLogitsProcessor(cfg.no_repeat_ngram_size))
    if cfg.encoder_no_repeat_ngram_size:
        made.append(_gen.EncoderNoRepeatNGramLogitsProcessor(
            cfg.encoder_no_repeat_ngram_size, row.padded.to(device)))
    if cfg.bad_words_ids is not None:
        made.append(_gen.NoBadWordsLogitsProcessor(cfg.bad_words_ids, eos))
    if cfg.min_length and cfg.min_length > width and eos is not None:  # (else a no-op)
        made.append(_gen.MinLengthLogitsProcessor(cfg.min_length, eos, device=device))
    if cfg.min_new_tokens and eos is not None:
        made.append(_gen.MinNewTokensLengthLogitsProcessor(width, cfg.min_new_tokens, eos,
                                                           device=device))
    fn = settings.prefix_allowed_tokens_fn
    if fn is not None:
        index = row.index
        made.append(_gen.PrefixConstrainedLogitsProcessor(
            lambda _batch_id, ids: fn(index, ids), 1))
    if cfg.forced_bos_token_id is not None:
        made.append(_gen.ForcedBOSTokenLogitsProcessor(cfg.forced_bos_token_id))
    if cfg.forced_eos_token_id is not None:
        made.append(_gen.ForcedEOSTokenLogitsProcessor(cfg.max_length, cfg.forced_eos_token_id,
                                                       device=device))
    if cfg.remove_invalid_values is True:
        made.append(_gen.InfNanRemoveLogitsProcessor())
    if cfg.exponential_decay_length_penalty is not None:
        made.append(_gen.ExponentialDecayLengthPenalty(cfg.exponential_decay_length_penalty,
                                                       eos, width))
    if cfg.suppress_tokens is not None:
        made.append(_gen.SuppressTokensLogitsProcessor(cfg.suppress_tokens, device=device))
    if cfg.begin_suppress_tokens is not None:
        begin = width if width > 1 or cfg.forced_bos_token_id is None else width + 1
        made.append(_gen.SuppressTokensAtBeginLogitsProcessor(cfg.begin_suppress_tokens, begin,
                                                              device=device))
    return made


def _warpers(settings: Settings, device: torch.device) -> list[Any]:
    cfg = settings.config
    if not cfg.do_sample:
        return []
    made: list[Any] = []
    if cfg.temperature is not None and cfg.temperature != 1.0:
        made.append(_gen.TemperatureLogitsWarper(cfg.temperature))
    if getattr(cfg, "top_h", None) is not None:
        made.append(_gen.TopHLogitsWarper(top_h=cfg.top_h))
    if cfg.top_k is not None and cfg.top_k != 0:
        made.append(_gen.TopKLogitsWarper(top_k=cfg.top_k, min_tokens_to_keep=1))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        made.append(_gen.TopPLogitsWarper(top_p=cfg.top_p, min_tokens_to_keep=1))
    if cfg.min_p is not None:
        made.append(_gen.MinPLogitsWarper(min_p=cfg.min_p, min_tokens_to_keep=1))
    if cfg.typical_p is not None and cfg.typical_p < 1.0:
        made.append(_gen.TypicalLogitsWarper(mass=cfg.typical_p, min_tokens_to_keep=1))
    if cfg.epsilon_cutoff is not None and 0.0 < cfg.epsilon_cutoff < 1.0:
        made.append(_gen.EpsilonLogitsWarper(epsilon=cfg.epsilon_cutoff, min_tokens_to_keep=1))
    if cfg.eta_cutoff is not None and 0.0 < cfg.eta_cutoff < 1.0:
        made.append(_gen.EtaLogitsWarper(epsilon=cfg.eta_cutoff, min_tokens_to_keep=1,
                                         device=device))
    return made


def _merge(built: list[Any], custom: Sequence[Any]) -> list[Any]:
    """HF's merge of a caller's list into the one it built: a custom object of a class HF
    built takes that one's place; the other custom objects follow, in their order."""
    merged = [next((c for c in custom if type(c) is type(b)), b) for b in built]
    return merged + [c for c in custom if not any(c is m for m in merged)]


def processors(settings: Settings, row: Row, device: torch.device) -> Any:
    """The ``LogitsProcessorList`` HF's ``generate`` builds for ``row`` (module docstring)."""
    try:
        made = _merge(_content(settings, row, device), settings.logits_processor)
        made += _warpers(settings, device)
        if settings.config.renormalize_logits is True:
            made.append(_gen.LogitNormalization())
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"generate: transformers refused a generation setting: {exc}") \
            from None
    return _gen.LogitsProcessorList(made)


def row_wise(processor_list: Sequence[Any]) -> bool:
    """Whether every processor of the list reads only the scores, row by row."""
    return all(type(p) in _ROW_WISE for p in processor_list)


def criteria(settings: Settings) -> Any:
    """The ``StoppingCriteriaList`` HF builds, or None when it holds only the length and stop
    token checks, which the batcher makes itself (``max_new_tokens``, ``stop_ids``)."""
    cfg = settings.config
    made: list[Any] = [_gen.MaxLengthCriteria(max_length=cfg.max_length)]
    plain = True
    if cfg.max_time is not None:
        made.append(_gen.MaxTimeCriteria(max_time=cfg.max_time))
        plain = False
    if cfg.stop_strings is not None:
        if settings.tokenizer is None:
            raise ConfigError(
                f"generate: stop_strings={cfg.stop_strings!r} needs the model's tokenizer to "
                "find them; pass tokenizer=... (as HF's generate asks)")
        made.append(_gen.StopStringCriteria(stop_strings=cfg.stop_strings,
                                            tokenizer=settings.tokenizer))
        plain = False
    if settings.stop_ids:
        made.append(_gen.EosTokenCriteria(eos_token_id=list(settings.stop_ids)))
    if settings.stopping_criteria:
        made = _merge(made, settings.stopping_criteria)
        plain = False
    return None if plain else _gen.StoppingCriteriaList(made)


class Decoder:
    """One request's token picking and stopping: its processors and criteria, and its history
    on the device when they read it.

    ``shared``: the call's history-free list, when the request's would be that (then
    :attr:`batch_key` groups it with the call's other requests)."""

    def __init__(self, settings: Settings, row: Row, device: torch.device,
                 capacity: int, shared: tuple[object, Any] | None = None) -> None:
        self.settings = settings
        self.criteria = criteria(settings)
        self.batch_key: object | None = None
        if shared is not None:
            self.batch_key, self.processors = shared
        else:
            self.processors = processors(settings, row, device)
        self.history: torch.Tensor | None = None
        self.length = int(row.padded.shape[1])
        if (self.batch_key is None and len(self.processors)) or self.criteria is not None:
            self.history = torch.empty((1, capacity), dtype=torch.long, device=device)
            self.history[:, :self.length] = row.padded.to(device)

    @property
    def plain_greedy(self) -> bool:
        """Greedy, with no processor: one argmax."""
        return not self.settings.do_sample and not len(self.processors)

    def process(self, scores: torch.Tensor, extra: Sequence[int] = ()) -> torch.Tensor:
        """This request's processors over ``scores`` (``[1, vocab]`` float32), its history
        followed by ``extra`` tokens (candidates being verified) as ``input_ids``."""
        if not len(self.processors):
            return scores
        history = self.history
        if history is None:  # a shared, history-free list: the ids are not read
            return self.processors(torch.zeros((1, 1), dtype=torch.long,
                                               device=scores.device), scores)  # type: ignore
        end = self.length + len(extra)
        if extra:
            history[0, self.length:end] = torch.tensor(list(extra), device=history.device)
        return self.processors(history[:, :end], scores)  # type: ignore[no-any-return]

    def append(self, token: int) -> None:
        if self.history is not None:
            self.history[0, self.length] = token
        self.length += 1

    def stops(self, scores: tuple[torch.Tensor, ...] | None) -> bool:
        """Whether the caller's or HF's further criteria end the request after its last token
        (``scores``: the request's processed scores so far when it keeps them, as HF passes)."""
        if self.criteria is None or self.history is None:
            return False
        done = self.criteria(self.history[:, :self.length], scores)
        return bool(done.any()) if isinstance(done, torch.Tensor) else bool(done)


def pick(decoders: Sequence[Decoder], logits: torch.Tensor,
         noise: Sequence[torch.Tensor | None],
         ) -> tuple[list[int], torch.Tensor, dict[int, Exception]]:
    """The next token of each request (``decoders[i]`` over row ``i`` of ``logits``,
    ``[n, vocab]`` float32; ``noise[i]`` its ``[vocab]`` draw when it samples). Returns the
    tokens, the processed scores ``[n, vocab]`` and what a request's processors raised (by
    row; its token is then meaningless). Requests sharing a batch key are processed as one
    batch, plain greedy ones by one argmax."""
    scores = logits
    groups: dict[object, list[int]] = {}
    alone: list[int] = []
    errors: dict[int, Exception] = {}
    for i, dec in enumerate(decoders):
        if dec.plain_greedy:
            continue
        if dec.batch_key is not None:
            groups.setdefault(dec.batch_key, []).append(i)
        else:
            alone.append(i)
    if groups or alone:
        scores = logits.clone()
        for rows in groups.values():
            index = torch.tensor(rows, device=logits.device)
            try:
                scores[index] = decoders[rows[0]].process(logits[index])
            except Exception as exc:  # (the request's own code: reported, not raised)
                errors.update(dict.fromkeys(rows, exc))
        for i in alone:
            try:
                scores[i:i + 1] = decoders[i].process(logits[i:i + 1])
            except Exception as exc:
                errors[i] = exc
    sampled = [i for i, dec in enumerate(decoders) if dec.settings.do_sample]
    if not sampled:
        return scores.argmax(dim=-1).tolist(), scores, errors
    choice = scores.argmax(dim=-1)
    index = torch.tensor(sampled, device=logits.device)
    draws = torch.stack([_noise_of(noise, i) for i in sampled])
    probs = scores[index].softmax(dim=-1)
    choice[index] = (probs / draws).argmax(dim=-1)
    return choice.tolist(), scores, errors


def _noise_of(noise: Sequence[torch.Tensor | None], row: int) -> torch.Tensor:
    drawn = noise[row]
    if drawn is None:
        raise ValueError(f"pick: row {row} samples but was given no noise")
    return drawn
