"""``CompiledCausalLM.generate``: HF ``generate``'s arguments and results, on the
:class:`~freezeframe.integrations.hf_batching.Batcher`.

What is HF's here, so that the same model gives the same tokens:

* **Settings** are resolved as HF resolves them (:mod:`~freezeframe.integrations.hf_settings`:
  the ``generation_config`` argument, then ``model.generation_config``, then HF's defaults,
  the keyword arguments over all; 20 new tokens when no length is given), and every token is
  picked by transformers' own processors, warpers and stopping criteria
  (:mod:`~freezeframe.integrations.hf_processing`). What needs another decoding loop is refused.
* **Padding.** ``attention_mask`` (or, without one, the ``pad_token_id`` positions when the pad
  token is not a stop token, as HF infers it) marks each row's prompt: one run of ones, padded
  on the left or on the right. Each row is served as its own prompt (a flat ragged step, no pad
  tokens computed); the processors see the row as HF does (its padding, then the prompt);
  ``sequences`` is ``input_ids`` as given followed by the new tokens.
* **Rows.** ``num_return_sequences`` repeats each row that many times (``repeat_interleave``,
  as HF). A row that stops (a stop token or another criterion) is finished; its later columns
  hold ``pad_token_id``. Generation ends when every row is finished.
* **Sampling** draws, per new-token column, one ``[rows, vocab]`` noise tensor from
  ``generator`` (default: the device's default generator), as ``torch.multinomial`` does in
  HF's sampling loop; so a seeded generator here and ``torch.manual_seed`` before HF's
  ``generate`` give the same tokens where the logits agree.
* **Results.** The token tensor, or with ``return_dict_in_generate=True`` transformers'
  ``GenerateDecoderOnlyOutput`` with ``scores`` (``output_scores``) and ``logits``
  (``output_logits``): per column, ``[rows, vocab]`` float32, NaN in a row already finished
  (HF holds the values of its pad-token continuation there).
* **Streamer.** ``streamer.put(input_ids)`` (rows repeated) first, then one ``[rows]`` tensor
  per column, then ``streamer.end()``: HF's streamer protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from freezeframe.errors import ConfigError
from freezeframe.integrations.hf_batching import Batcher
from freezeframe.integrations.hf_requests import Finished, Owner, check_greedy, prompt_lookup
from freezeframe.integrations.hf_sampling import NoiseDraws
from freezeframe.integrations.hf_settings import Settings, Speculation, resolve, settings

__all__ = ["GenerateCall", "generate"]


class _Streamer(Protocol):
    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


class GenerateCall:
    """``generate``'s arguments beyond ``inputs`` and the keyword arguments."""

    def __init__(self, generation_config: Any = None, logits_processor: Any = None,
                 stopping_criteria: Any = None, prefix_allowed_tokens_fn: Any = None,
                 assistant_model: Any = None, streamer: _Streamer | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.generation_config = generation_config
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.prefix_allowed_tokens_fn = prefix_allowed_tokens_fn
        self.assistant_model = assistant_model
        self.streamer = streamer
        self.generator = generator


# generate's own arguments a caller may pass through **kwargs (HF pops them the same way)
_REFUSED_ARGS = {
    "synced_gpus": "synced_gpus=True (ff.hf runs one process's requests)",
    "negative_prompt_ids": "negative_prompt_ids (classifier-free guidance)",
    "negative_prompt_attention_mask": "negative_prompt_attention_mask (classifier-free "
                                      "guidance)",
    "custom_generate": "custom_generate (another decoding loop)",
    "assistant_tokenizer": "assistant_tokenizer (a draft model with another tokenizer)",
}


def generate(lm: Any, input_ids: Any, call: GenerateCall, kwargs: dict[str, Any]) -> Any:
    """Decode ``input_ids`` (``[batch, width]``) as HF's ``model.generate`` would (module
    docstring), every row a request of ``lm.batcher``."""
    for name, what in _REFUSED_ARGS.items():
        value = kwargs.pop(name, None)
        if value is not None and value is not False:
            raise ConfigError(f"generate: {what} is not supported by ff.hf; use HF's own "
                              "model.generate for it")
    if input_ids is None:
        input_ids = kwargs.pop("input_ids", None)
    mask = kwargs.pop("attention_mask", None)
    tokenizer = kwargs.pop("tokenizer", None)
    batch, width = _check_input_ids(input_ids)
    model = lm.model
    cfg, unused = resolve(getattr(model, "config", None),
                          getattr(model, "generation_config", None), call.generation_config,
                          kwargs, width)
    if unused:
        raise ConfigError(
            f"generate: {sorted(unused)} are neither generation settings nor arguments ff.hf "
            "takes (model inputs other than input_ids and attention_mask are not passed to "
            "the model: its steps are flat token batches); check the spelling or drop them")
    spec = _speculation(lm, cfg, call.assistant_model)
    resolved = settings(cfg, width, logits_processor=call.logits_processor,
                        stopping_criteria=call.stopping_criteria,
                        prefix_allowed_tokens_fn=call.prefix_allowed_tokens_fn,
                        tokenizer=tokenizer, speculation=spec)
    copies = int(cfg.num_return_sequences or 1)
    host = input_ids.detach().cpu()
    spans = _prompt_spans(host, mask, resolved.pad_token_id, resolved.stop_ids)
    if copies > 1:
        host = host.repeat_interleave(copies, dim=0)
        spans = [s for s in spans for _ in range(copies)]
    padded = any(span != (0, width) for span in spans)  # (HF drops an all-ones mask)
    return _run(lm.batcher, lm.device, host, spans, resolved, call, padded,
                input_ids.device, batch * copies)


def _speculation(lm: Any, cfg: Any, assistant: Any) -> Speculation | None:
    if assistant is None:
        return prompt_lookup(lm, cfg)
    check_greedy("assistant_model", cfg)
    if assistant is not None:
        draft = lm.draft(assistant)
        k = lm.num_speculative_tokens or int(getattr(cfg, "num_assistant_tokens", None) or 5)
        return Speculation(num_tokens=k, draft=draft)
    return prompt_lookup(lm, cfg)


def _run(batcher: Batcher, device: torch.device, host: torch.Tensor,
         spans: list[tuple[int, int]], resolved: Settings, call: GenerateCall, padded: bool,
         out_device: torch.device, rows: int) -> Any:
    """Queue every row, step until all are finished, and build HF's result; on any exception
    (a streamer, a processor, a refused step, Ctrl-C) the call's requests leave the batcher."""
    cfg = resolved.config
    noise = NoiseDraws(rows, call.generator, device) if resolved.do_sample else None
    owner = Owner()
    keep_logits = bool(cfg.return_dict_in_generate and cfg.output_logits)
    keep_scores = bool(cfg.return_dict_in_generate and cfg.output_scores)
    share = object()  # the call's rows share a history-free processor list
    try:
        lives = []
        for row, (start, end) in enumerate(spans):
            tokens = host[row, start:end].tolist()
            pads = host[row, :start].tolist() + host[row, end:].tolist()
            lives.append(batcher.make(tokens, resolved, padded=pads + tokens,
                                      padding=len(pads) if padded else None, owner=owner,
                                      noise=noise, member=row, keep_logits=keep_logits,
                                      keep_scores=keep_scores, share=share))
        batcher.enqueue(lives)
        columns = _Columns([live.request_id for live in lives], resolved.pad_token_id,
                           call.streamer)
        if call.streamer is not None:
            call.streamer.put(host)
        while owner.live > 0:
            tokens = batcher.collect(owner)
            if owner.error is not None:
                raise owner.error
            for token in tokens:
                columns.add(token.request_id, token.token, token.finished,
                            token.finish_reason)
            columns.emit_ready()
        if owner.error is not None:
            raise owner.error
        finished = [owner.finished[live.request_id] for live in lives]
        columns.emit_ready(final=True)
        if call.streamer is not None:
            call.streamer.end()
    finally:
        batcher.drop(owner)
    new = torch.tensor(columns.table(), dtype=host.dtype).reshape(-1, rows).T
    sequences = torch.cat([host, new], dim=1).to(out_device)
    if not cfg.return_dict_in_generate:
        return sequences
    return _output(sequences, finished, new.shape[1], keep_scores, keep_logits)


def _output(sequences: torch.Tensor, finished: list[Finished], width: int, scores: bool,
            logits: bool) -> Any:
    from transformers import generation

    output: Any = generation.GenerateDecoderOnlyOutput
    return output(
        sequences=sequences,
        scores=_columns([f.scores for f in finished], width) if scores else None,
        logits=_columns([f.logits for f in finished], width) if logits else None)


def _check_input_ids(input_ids: object) -> tuple[int, int]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
            or input_ids.dtype != torch.long:
        got = (f"a {input_ids.dim()}-d {input_ids.dtype} tensor"
               if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__)
        raise ConfigError(f"generate: input_ids must be a 2-d torch.long tensor [batch, "
                          f"prompt], got {got}")
    batch, width = int(input_ids.shape[0]), int(input_ids.shape[1])
    if batch < 1 or width < 1:
        raise ConfigError(f"generate: input_ids has shape {tuple(input_ids.shape)}; give at "
                          "least one prompt of at least one token")
    return batch, width


def _prompt_spans(ids: torch.Tensor, mask: torch.Tensor | None, pad: int | None,
                  stop_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Each row's prompt as ``(start, end)`` columns of ``ids``: the ones of ``mask`` (or, with
    none, the tokens other than ``pad`` when HF would infer the mask so), which must be one run
    per row."""
    if mask is None:
        if pad is None or pad in stop_ids or not bool((ids == pad).any()):
            return [(0, ids.shape[1])] * ids.shape[0]  # HF infers no mask
        marks = torch.ne(ids, pad)
        source = f"the pad_token_id={pad} positions"
    else:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ConfigError(f"generate: attention_mask must be a tensor shaped like "
                              f"input_ids {tuple(ids.shape)}, got {got}")
        marks = mask.detach().cpu().bool()
        source = "attention_mask"
    spans = []
    for row, values in enumerate(marks.tolist()):
        ones = [i for i, v in enumerate(values) if v]
        if not ones or ones[-1] - ones[0] + 1 != len(ones):
            what = "no prompt token" if not ones else "a gap between prompt tokens"
            raise ConfigError(
                f"generate: row {row} of {source} has {what}; each row's prompt must be one "
                "run of ones, padded on the left or on the right (pass attention_mask when "
                "the pad token also occurs inside prompts)")
        spans.append((ones[0], ones[-1] + 1))
    return spans


class _Columns:
    """The new tokens as columns, as HF's loop makes them: column ``k`` is ready once every
    row has its ``k``-th token or has finished before it (then ``pad``); ready columns go to
    the streamer in order. A row stopped by a criterion while others go on keeps its later
    tokens (HF decodes it on); the columns end where the last row ended."""

    def __init__(self, ids: list[str], pad: int | None, streamer: _Streamer | None) -> None:
        self._rows: dict[str, list[int]] = {rid: [] for rid in ids}
        self._order = ids
        self._pad = 0 if pad is None else pad
        self._streamer = streamer
        self._sent = 0
        self._done: set[str] = set()
        self._ended: dict[str, int] = {}  # tokens a row had when it first ended

    def add(self, request_id: str, token: int, finished: bool, reason: str | None) -> None:
        tokens = self._rows[request_id]
        if finished and reason == "stop" and request_id in self._ended:
            self._done.add(request_id)  # (the end of a stopped row: no new token)
            return
        tokens.append(token)
        if reason is not None:
            self._ended.setdefault(request_id, len(tokens))
        if finished:
            self._done.add(request_id)

    def width(self) -> int:
        return max(self._ended.get(rid, len(t)) for rid, t in self._rows.items())

    def emit_ready(self, final: bool = False) -> None:
        ready = self.width() if final else min(
            (len(t) for rid, t in self._rows.items() if rid not in self._done),
            default=self.width())
        while self._sent < ready:
            if self._streamer is not None:
                self._streamer.put(torch.tensor(self._column(self._sent)))
            self._sent += 1

    def _column(self, k: int) -> list[int]:
        return [t[k] if k < len(t) else self._pad for t in map(self._rows.get, self._order)
                if t is not None]

    def table(self) -> list[list[int]]:
        return [self._column(k) for k in range(self.width())]


def _columns(per_row: list[tuple[torch.Tensor, ...]], width: int) -> tuple[torch.Tensor, ...]:
    """Per column, the ``[rows, vocab]`` values its tokens came from (NaN rows for rows
    finished before it)."""
    first = next(r[0] for r in per_row if r)
    return tuple(torch.stack([r[k] if k < len(r) else torch.full_like(first, float("nan"))
                              for r in per_row]) for k in range(width))
