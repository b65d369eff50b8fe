"""Continuous batching over an ``ff.hf`` model: requests join and leave between steps.

:class:`Batcher` (``lm.batcher``) is the loop a server runs::

    batcher = lm.batcher
    batcher.add([5, 9, 2], SamplingParams(max_new_tokens=8), request_id="a")
    while batcher.has_unfinished():
        for token in batcher.step():        # the tokens this step made: stream them
            print(token.request_id, token.token)
        batcher.add(...)                    # new requests join between steps
        for done in batcher.take_finished():
            print(done.request_id, done.tokens, done.finish_reason)

Each :meth:`Batcher.step` is one flat step of the model (``CompiledCausalLM.step``): one token
of every request that is decoding, then prompt tokens of requests that are prefilling (a long
prompt in chunks), then prompts of waiting requests admitted while a cache row is free, up to
``max_num_tokens`` tokens in all. No padding is computed: a step of 3 decoding requests and a
5-token prompt is an 8-token step (padded only to the graph's capture size). A step where every
request brings one token is a uniform decode step (FULL graphs serve those). A request's tokens
are picked by :mod:`~freezeframe.integrations.hf_sampling` from the logits of its last token;
it finishes on a stop token (``finish_reason="eos"``), at ``max_new_tokens`` (``"length"``) or
by :meth:`Batcher.abort` (``"aborted"``), and its cache row is free for the next step.

One host read-back per step (the picked tokens: stopping and the next step's inputs need them).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from freezeframe.errors import ConfigError
from freezeframe.integrations.hf_sampling import NoiseDraws, SamplingParams, pick_tokens

__all__ = ["Batcher", "Finished", "NewToken", "Request"]


class _Model(Protocol):
    """What the batcher needs of a ``CompiledCausalLM``."""

    max_batch_size: int
    max_cache_len: int

    @property
    def max_num_tokens(self) -> int: ...

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def device(self) -> torch.device: ...

    def step(self, input_ids: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
             *, uniform_decode: bool = False) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt (token ids) and how to continue it."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class NewToken:
    """A token a step made: the ``index``-th new token of ``request_id``; ``finished`` when it
    was the request's last (``finish_reason`` then says why)."""

    request_id: str
    token: int
    index: int
    finished: bool
    finish_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Finished:
    """A request that left: its new ``tokens`` (a stop token that ended it included) and why
    (``"eos"``, ``"length"`` or ``"aborted"``). ``logits`` holds the float32 logits each token
    was picked from (``[vocab]`` each) when the request was added with ``keep_logits=True``."""

    request_id: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    finish_reason: str
    logits: tuple[torch.Tensor, ...] = ()


@dataclasses.dataclass
class _Live:
    """A request between :meth:`Batcher.add` and its end."""

    request: Request
    noise: NoiseDraws | None
    member: int  # its row in the noise draws
    keep_logits: bool
    tokens: list[int]  # prompt, then new tokens
    row: int = -1  # its cache row once admitted
    computed: int = 0  # tokens whose keys and values are in the cache
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - len(self.request.prompt)


@dataclasses.dataclass(frozen=True)
class _Chunk:
    live: _Live
    count: int  # tokens of this request in the step, from live.computed on

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last known token (so a token is picked)."""
        return self.live.computed + self.count == len(self.live.tokens)


class Batcher:
    """Continuous batching over one ``CompiledCausalLM`` (see the module docstring). Owns the
    model's cache rows: ``lm.generate`` runs on the same batcher and refuses to start while
    requests added here are unfinished."""

    def __init__(self, model: _Model) -> None:
        self._model = model
        self._waiting: deque[_Live] = deque()
        self._running: list[_Live] = []
        self._free_rows = list(range(model.max_batch_size))
        self._finished: list[Finished] = []
        self._ids = itertools.count()
        self._known: set[str] = set()  # ids of requests not yet taken with take_finished

    # -- requests in -------------------------------------------------------------------------
    def add(self, prompt: Sequence[int] | torch.Tensor, params: SamplingParams | None = None,
            *, request_id: str | None = None, generator: torch.Generator | None = None,
            keep_logits: bool = False) -> str:
        """Queue a request; it joins at the next :meth:`step` with a free cache row. Returns
        its id (``request_id``, or a new one). ``generator`` seeds its sampling (default: the
        device's default generator)."""
        params = params if params is not None else SamplingParams()
        noise = NoiseDraws(1, generator, self._model.device) if params.do_sample else None
        return self.add_request(prompt, params, request_id=request_id, noise=noise,
                                keep_logits=keep_logits)

    def add_request(self, prompt: Sequence[int] | torch.Tensor, params: SamplingParams, *,
                    request_id: str | None = None, noise: NoiseDraws | None = None,
                    member: int = 0, keep_logits: bool = False) -> str:
        """:meth:`add` with the noise draws it samples from given: row ``member`` of ``noise``,
        shared with other requests (how ``generate`` samples a batch as HF does)."""
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"Batcher.add: params must be a SamplingParams, got "
                              f"{type(params).__name__}")
        if params.do_sample and noise is None:
            raise ConfigError("Batcher.add_request: params.do_sample=True needs noise draws")
        tokens = self._prompt(prompt)
        params.check_vocab(self._model.vocab_size)
        needed = len(tokens) + params.max_new_tokens - 1  # the last token is never cached
        if needed > self._model.max_cache_len:
            raise ConfigError(
                f"Batcher.add: a prompt of {len(tokens)} tokens and max_new_tokens="
                f"{params.max_new_tokens} need {needed} cache positions but max_cache_len is "
                f"{self._model.max_cache_len}; ff.hf.compile with max_cache_len={needed}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(rid, str) or rid in self._known:
            raise ConfigError(f"Batcher.add: request_id={rid!r} must be a str not in use")
        self._known.add(rid)
        request = Request(rid, tuple(tokens), params)
        self._waiting.append(_Live(request, noise, member, keep_logits, list(tokens)))
        return rid

    def _prompt(self, prompt: Sequence[int] | torch.Tensor) -> list[int]:
        values = prompt.tolist() if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 \
            else list(prompt) if isinstance(prompt, (list, tuple)) else None
        vocab = self._model.vocab_size
        if not values or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
            raise ConfigError(f"Batcher.add: prompt must be a non-empty list or 1-d tensor of "
                              f"token ids, got {_describe(prompt)}")
        bad = next((t for t in values if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise ConfigError(f"Batcher.add: prompt token {bad} is outside [0, vocab_size="
                              f"{vocab}); pass token ids of this model's tokenizer")
        return values

    def abort(self, request_id: str) -> bool:
        """End an unfinished request now (``finish_reason="aborted"``), freeing its cache row;
        False when no such request is waiting or running."""
        for queue in (self._waiting, self._running):
            for live in queue:
                if live.request.request_id == request_id:
                    queue.remove(live)
                    self._finish(live, "aborted")
                    return True
        return False

    # -- the step ----------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def step(self) -> list[NewToken]:
        """Run one flat step; returns the tokens it made, in the order of the step's requests.
        Does nothing (returns ``[]``) without unfinished requests."""
        chunks = self._schedule()
        if not chunks:
            return []
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        last: list[int] = []  # flat index of each sampling chunk's last token
        for chunk in chunks:
            live, start = chunk.live, chunk.live.computed
            ids += live.tokens[start:start + chunk.count]
            positions += range(start, start + chunk.count)
            rows += [live.row] * chunk.count
            if chunk.samples:
                last.append(len(ids) - 1)
        uniform = all(chunk.count == 1 for chunk in chunks)
        sampling = [chunk.live for chunk in chunks if chunk.samples]  # (before computed moves)
        logits = self._model.step(ids, positions, rows, uniform_decode=uniform)
        for chunk in chunks:
            chunk.live.computed += chunk.count
        if not sampling:
            return []
        picked = logits[torch.tensor(last, device=logits.device)].float()
        return self._take_tokens(sampling, picked)

    def _schedule(self) -> list[_Chunk]:
        budget = self._model.max_num_tokens
        chunks: list[_Chunk] = []
        decoding = [live for live in self._running if live.computed >= len(live.request.prompt)]
        prefilling = [live for live in self._running if live.computed < len(live.request.prompt)]
        for live in decoding + prefilling:
            count = min(len(live.tokens) - live.computed, budget)
            if count > 0:
                chunks.append(_Chunk(live, count))
                budget -= count
        while self._waiting and self._free_rows and budget > 0:
            live = self._waiting.popleft()
            live.row = self._free_rows.pop(0)
            self._running.append(live)
            count = min(len(live.tokens), budget)
            chunks.append(_Chunk(live, count))
            budget -= count
        return chunks

    def _take_tokens(self, sampling: list[_Live], picked: torch.Tensor) -> list[NewToken]:
        """Pick each sampling request's token from its logits (``picked``, ``[n, vocab]``),
        append it, and finish the requests that stop."""
        vocab = int(picked.shape[-1])
        noise = [live.noise.take(live.member, live.new_tokens, vocab, picked.device)
                 if live.noise is not None else None for live in sampling]
        tokens = pick_tokens(picked, [live.request.params for live in sampling],
                             [live.new_tokens for live in sampling], noise).tolist()
        made = []
        for i, (live, token) in enumerate(zip(sampling, tokens, strict=True)):
            live.tokens.append(token)
            if live.keep_logits:
                live.logits.append(picked[i].clone())
            params = live.request.params
            reason = "eos" if token in params.stop_ids else \
                "length" if live.new_tokens >= params.max_new_tokens else None
            made.append(NewToken(live.request.request_id, token, live.new_tokens - 1,
                                 reason is not None, reason))
            if reason is not None:
                self._running.remove(live)
                self._finish(live, reason)
        return made

    def _finish(self, live: _Live, reason: str) -> None:
        if live.row >= 0:
            self._free_rows.append(live.row)
            self._free_rows.sort()
        if live.noise is not None:
            live.noise.leave(live.member)
        request = live.request
        self._finished.append(Finished(
            request.request_id, request.prompt, tuple(live.tokens[len(request.prompt):]),
            reason, tuple(live.logits)))

    # -- requests out ------------------------------------------------------------------------
    def take_finished(self) -> list[Finished]:
        """The requests that finished since the last call, in the order they finished."""
        done, self._finished = self._finished, []
        self._known.difference_update(f.request_id for f in done)
        return done


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-d {value.dtype} tensor"
    return repr(value) if isinstance(value, (list, tuple)) else type(value).__name__
