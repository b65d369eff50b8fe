"""``CompiledCausalLM.generate``: HF ``generate``'s arguments and result, on the
:class:`~freezeframe.integrations.hf_batching.Batcher`.

What is HF's here, so that the same model gives the same tokens:

* **Defaults** come from ``model.generation_config`` (``eos_token_id``, ``pad_token_id``,
  ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``max_new_tokens``), then HF's own
  (``top_k=50``, ``max_length=20``). ``pad_token_id`` falls back on the first stop token.
* **Padding.** ``attention_mask`` (or, without one, the ``pad_token_id`` positions when the pad
  token is not a stop token, as HF infers it) marks each row's prompt: one run of ones, padded
  on the left or on the right. Each row is served as its own prompt (a flat ragged step, no pad
  tokens computed); ``sequences`` is ``input_ids`` as given followed by the new tokens.
* **Stopping per row.** A row that made a stop token is finished; its later columns hold
  ``pad_token_id``. Generation ends when every row is finished or has ``max_new_tokens``.
* **Sampling** draws, per new-token column, one ``[batch, vocab]`` noise tensor from
  ``generator`` (default: the device's default generator), as ``torch.multinomial`` does in
  HF's sampling loop; so a seeded generator here and ``torch.manual_seed`` before HF's
  ``generate`` give the same tokens where the logits agree.
* **Streamer.** ``streamer.put(input_ids)`` first, then one ``[batch]`` tensor per column, then
  ``streamer.end()``: HF's streamer protocol (``TextStreamer`` works for one row).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from freezeframe.errors import ConfigError
from freezeframe.integrations.hf_batching import Batcher, Finished
from freezeframe.integrations.hf_sampling import NoiseDraws, SamplingParams

__all__ = ["MODEL_DEFAULT", "GenerateOptions", "Generation", "generate"]


class _ModelDefault:
    def __repr__(self) -> str:
        return "MODEL_DEFAULT"


#: "the model's own": ``generate(eos_token_id=MODEL_DEFAULT)`` (the default) reads
#: ``model.generation_config``; ``None`` means none.
MODEL_DEFAULT: Any = _ModelDefault()
# HF's defaults where the model's generation config leaves a field unset
_HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                "max_length": 20}


class _Streamer(Protocol):
    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Generation:
    """What ``generate`` returns: ``sequences`` ``[batch, prompt + new]`` (``input_ids`` as
    given, then the new tokens; ``pad_token_id`` after a row's stop token) and, with
    ``output_logits=True``, one ``[batch, vocab]`` float32 tensor per new-token column: the
    logits each token was picked from (NaN in a row already finished; HF's ``output_logits``
    holds the logits of its pad tokens there)."""

    sequences: torch.Tensor
    logits: tuple[torch.Tensor, ...] = ()


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """``generate``'s keyword arguments as given (``None`` / :data:`MODEL_DEFAULT`: unset)."""

    max_new_tokens: int | None = None
    attention_mask: torch.Tensor | None = None
    min_new_tokens: int = 0
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: Any = MODEL_DEFAULT
    pad_token_id: Any = MODEL_DEFAULT
    generator: torch.Generator | None = None
    streamer: _Streamer | None = None
    output_logits: bool = False


def generate(batcher: Batcher, config: Any, max_batch_size: int, device: torch.device,
             input_ids: torch.Tensor, options: GenerateOptions) -> Generation:
    """Decode ``input_ids`` (``[batch, prompt]``) as HF's ``model.generate`` would (see the
    module docstring) with ``config`` (the model's ``generation_config``) for defaults, every
    row a request of ``batcher``."""
    batch, width = _check_input_ids(input_ids, max_batch_size)
    if batcher.has_unfinished():
        raise ConfigError(
            f"generate: lm.batcher has {batcher.num_waiting + batcher.num_running} unfinished "
            "requests; generate shares its cache rows: step them to the end (or abort them) "
            "first")
    params, pad = _params(config, options, width)
    host_ids = input_ids.detach().cpu()
    spans = _prompt_spans(host_ids, options.attention_mask, pad, params.stop_ids)
    noise = NoiseDraws(batch, options.generator, device) if params.do_sample else None
    ids = [batcher.add_request(host_ids[row, start:end], params, noise=noise, member=row,
                               keep_logits=options.output_logits)
           for row, (start, end) in enumerate(spans)]
    streamer = options.streamer
    if streamer is not None:
        streamer.put(host_ids)
    columns = _Columns(ids, pad, streamer)
    while batcher.has_unfinished():
        for token in batcher.step():
            columns.add(token.request_id, token.token, token.finished)
        columns.emit_ready()
    done = {f.request_id: f for f in batcher.take_finished()}
    finished = [done[rid] for rid in ids]
    columns.emit_ready(final=True)
    if streamer is not None:
        streamer.end()
    new = torch.tensor(columns.table(), dtype=input_ids.dtype).reshape(batch, -1)
    sequences = torch.cat([host_ids, new], dim=1).to(input_ids.device)
    logits = _logits_columns(finished, new.shape[1]) if options.output_logits else ()
    return Generation(sequences=sequences, logits=logits)


def _check_input_ids(input_ids: object, max_batch_size: int) -> tuple[int, int]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
            or input_ids.dtype != torch.long:
        got = (f"a {input_ids.dim()}-d {input_ids.dtype} tensor"
               if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__)
        raise ConfigError(f"generate: input_ids must be a 2-d torch.long tensor [batch, "
                          f"prompt], got {got}")
    batch, width = int(input_ids.shape[0]), int(input_ids.shape[1])
    if not 1 <= batch <= max_batch_size:
        raise ConfigError(
            f"generate: input_ids has {batch} rows but max_batch_size is {max_batch_size}; "
            f"pass at most that many prompts (lm.batcher queues any number), or ff.hf.compile "
            f"with max_batch_size={max(batch, 1)}")
    if width < 1:
        raise ConfigError("generate: input_ids has 0 prompt tokens; give at least 1")
    return batch, width


def _params(config: Any, options: GenerateOptions,
            width: int) -> tuple[SamplingParams, int | None]:
    """The request parameters and pad token of this call: each option as given, else the
    model's generation config, else HF's default."""
    def pick(name: str, given: Any) -> Any:
        if given is not None:
            return given
        own = getattr(config, name, None)
        return own if own is not None else _HF_DEFAULTS.get(name)

    new = options.max_new_tokens
    if new is None:
        new = getattr(config, "max_new_tokens", None)
        if new is None:  # HF: max_length counts the prompt (padding included)
            new = pick("max_length", None) - width
            if new < 1:
                raise ConfigError(
                    f"generate: the prompt width {width} leaves no new token under max_length="
                    f"{new + width} (model.generation_config); pass max_new_tokens")
    if isinstance(new, bool) or not isinstance(new, int) or new < 1:
        raise ConfigError(f"generate: max_new_tokens={new!r} must be an int >= 1")
    eos = options.eos_token_id
    if eos is MODEL_DEFAULT:
        eos = getattr(config, "eos_token_id", None)
    params = SamplingParams(
        max_new_tokens=new, min_new_tokens=options.min_new_tokens,
        do_sample=bool(pick("do_sample", options.do_sample)),
        temperature=pick("temperature", options.temperature),
        top_k=pick("top_k", options.top_k), top_p=pick("top_p", options.top_p),
        eos_token_id=eos)
    pad = options.pad_token_id
    if pad is MODEL_DEFAULT:
        pad = getattr(config, "pad_token_id", None)
    if pad is None and params.stop_ids:
        pad = params.stop_ids[0]  # as HF: finished rows are padded with the stop token
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
        raise ConfigError(f"generate: pad_token_id={pad!r} must be a token id >= 0 or None")
    return params, pad


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
    the streamer in order."""

    def __init__(self, ids: list[str], pad: int | None, streamer: _Streamer | None) -> None:
        self._rows: dict[str, list[int]] = {rid: [] for rid in ids}
        self._order = ids
        self._pad = pad
        self._streamer = streamer
        self._sent = 0
        self._done: set[str] = set()

    def add(self, request_id: str, token: int, finished: bool) -> None:
        self._rows[request_id].append(token)
        if finished:
            self._done.add(request_id)

    def emit_ready(self, final: bool = False) -> None:
        if final:
            self._done = set(self._order)
        ready = min((len(t) for rid, t in self._rows.items() if rid not in self._done),
                    default=max(len(t) for t in self._rows.values()))
        while self._sent < ready:
            if self._streamer is not None:
                self._streamer.put(torch.tensor(self._column(self._sent)))
            self._sent += 1

    def _column(self, k: int) -> list[int]:
        column = []
        for rid in self._order:
            tokens = self._rows[rid]
            if k < len(tokens):
                column.append(tokens[k])
            elif self._pad is not None:
                column.append(self._pad)
            else:  # rows only end early on a stop token, which sets a pad
                raise AssertionError("a row ended early without a pad token")
        return column

    def table(self) -> list[list[int]]:
        width = max(len(t) for t in self._rows.values())
        return [self._column_row(rid, width) for rid in self._order]

    def _column_row(self, rid: str, width: int) -> list[int]:
        tokens = self._rows[rid]
        return tokens + [self._pad if self._pad is not None else 0] * (width - len(tokens))


def _logits_columns(finished: list[Finished], width: int) -> tuple[torch.Tensor, ...]:
    """Per column, the ``[batch, vocab]`` logits its tokens were picked from (NaN rows for
    rows finished before it)."""
    first = next(f.logits[0] for f in finished if f.logits)
    columns = []
    for k in range(width):
        rows = [f.logits[k] if k < len(f.logits) else torch.full_like(first, float("nan"))
                for f in finished]
        columns.append(torch.stack(rows))
    return tuple(columns)
