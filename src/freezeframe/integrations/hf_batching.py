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

Each :meth:`Batcher.step` is one flat step of the model (``CompiledCausalLM.step``): the tokens
of every request that is decoding (one, or ``1 + k`` when it verifies ``k`` speculative
candidates), then prompt tokens of requests that are prefilling (a long prompt in chunks), then
prompts of waiting requests admitted while a cache row is free, up to ``max_num_tokens`` tokens.
No padding is computed. A step where every request brings the model's decode query length
(``1 + num_speculative_tokens``) is a uniform decode step (FULL graphs serve those). A request's
tokens are picked by transformers' own processors and warpers for its settings, with its own
history (:mod:`~freezeframe.integrations.hf_processing`); it finishes on a stop token
(``finish_reason="eos"``), at its length (``"length"``), on another stopping criterion
(``"stop"``), by :meth:`Batcher.abort` (``"aborted"``) or when its own code raised
(``"error"``), and its cache row is free for the next step.

**Owners.** ``lm.generate`` runs on the same batcher: each call owns its requests, which
:meth:`Batcher.step`, :meth:`Batcher.take_finished` and :meth:`Batcher.has_unfinished` never
hand to the caller (and the caller's never to a ``generate``); both may run at once, from one
thread or several (the batcher holds a lock for each step). :meth:`Batcher.requests` lists
everything it holds.

**Faults.** A model step that raises changes nothing (its requests run again at the next step).
A processor or stopping criterion that raises ends its own request (``"error"``; the token a
criterion was judging is its last, sent like any other), the others of the step go on; for the
caller's requests :meth:`Batcher.step` then raises it (the other tokens of that step come with
the next step), a ``generate`` raises it after removing its requests. Ctrl-C in a criterion
ends its request so and is raised at once; in a processor (no token made yet) it changes
nothing.

One host read-back per step (the picked tokens: stopping and the next step's inputs need them).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from freezeframe.errors import ConfigError
from freezeframe.integrations.hf_processing import pick
from freezeframe.integrations.hf_requests import (
    Chunk,
    Finished,
    Live,
    Model,
    NewToken,
    Owner,
    RequestInfo,
    check_prompt,
    make_request,
    request_settings,
    spec_width,
)
from freezeframe.integrations.hf_sampling import NoiseDraws, SamplingParams
from freezeframe.integrations.hf_settings import Settings
from freezeframe.integrations.hf_speculation import Proposer, accept

__all__ = ["Batcher", "Finished", "NewToken", "RequestInfo"]


class Batcher:
    """Continuous batching over one ``CompiledCausalLM`` (see the module docstring)."""

    def __init__(self, model: Model) -> None:
        self._model = model
        self._waiting: deque[Live] = deque()
        self._running: list[Live] = []
        self._free_rows = list(range(model.max_batch_size))
        self._finished: list[Finished] = []  # the caller's, not yet taken
        self._outbox: list[NewToken] = []  # the caller's tokens made in others' steps
        self._errors: list[BaseException] = []  # the caller's requests' faults, to raise
        self._ids = itertools.count()
        self._known: set[str] = set()  # ids of requests not yet taken
        self._owned: dict[str, Owner] = {}  # generate's request ids
        self._shared: dict[object, tuple[object, Any]] = {}  # history-free lists per params
        self._lock = threading.RLock()

    # -- requests in -------------------------------------------------------------------------
    def add(self, prompt: Sequence[int] | torch.Tensor,
            params: SamplingParams | Any | None = None, *, request_id: str | None = None,
            generator: torch.Generator | None = None, keep_logits: bool = False,
            keep_scores: bool = False, logits_processor: Sequence[Any] | None = None,
            stopping_criteria: Sequence[Any] | None = None) -> str:
        """Queue a request; it joins at the next :meth:`step` with a free cache row. Returns
        its id (``request_id``, or a new one no other request holds). ``params`` is a
        :class:`SamplingParams` or a transformers ``GenerationConfig`` (its unset fields from
        ``model.generation_config``, as ``generate`` resolves them; lengths count from this
        prompt; ``prompt_lookup_num_tokens`` speculates, ``output_scores`` and
        ``output_logits`` keep them, ``num_return_sequences > 1`` is refused: a request is one
        sequence); ``logits_processor`` and ``stopping_criteria`` are HF's lists, merged in as
        ``generate`` merges them and called with this request's history. ``generator`` seeds
        its sampling (default: the device's default generator)."""
        tokens = check_prompt(self._model, prompt)
        resolved, key = request_settings(self._model, params, len(tokens), logits_processor,
                                         stopping_criteria)
        keep_logits = keep_logits or bool(resolved.config.output_logits)
        keep_scores = keep_scores or bool(resolved.config.output_scores)
        noise = NoiseDraws(1, generator, self._model.device) if resolved.do_sample else None
        with self._lock:
            live = self.make(tokens, resolved, padded=tokens, padding=None, owner=None,
                             noise=noise, keep_logits=keep_logits, keep_scores=keep_scores,
                             request_id=request_id, share=key)
            self.enqueue([live])
        return live.request_id

    def make(self, tokens: list[int], resolved: Settings, *, padded: list[int],
             padding: int | None, owner: Owner | None, noise: NoiseDraws | None = None,
             member: int = 0, keep_logits: bool = False, keep_scores: bool = False,
             request_id: str | None = None, share: object | None = None) -> Live:
        """A request, checked, not yet queued (``generate`` makes all of its rows first, then
        queues them at once with :meth:`enqueue`): see ``hf_requests.make_request``."""
        rid = request_id if request_id is not None else self._new_id()
        if not isinstance(rid, str) or rid in self._known:
            raise ConfigError(f"Batcher.add: request_id={rid!r} must be a str not in use")
        return make_request(self._model, self._shared, rid, tokens, resolved, padded=padded,
                            padding=padding, owner=owner, noise=noise, member=member,
                            keep_logits=keep_logits, keep_scores=keep_scores, share=share)

    def _new_id(self) -> str:
        while True:
            rid = f"req-{next(self._ids)}"
            if rid not in self._known:
                return rid

    def enqueue(self, lives: Sequence[Live]) -> None:
        """Queue requests made by :meth:`make` (ids checked again: all or none)."""
        with self._lock:
            ids = [live.request_id for live in lives]
            if len(set(ids)) != len(ids) or any(i in self._known for i in ids):
                raise ConfigError(f"Batcher: request ids {ids} are not distinct and free")
            for live in lives:
                self._known.add(live.request_id)
                if live.owner is not None:
                    self._owned[live.request_id] = live.owner
                    live.owner.live += 1
                self._waiting.append(live)

    def abort(self, request_id: str) -> bool:
        """End one of the caller's unfinished requests now (``finish_reason="aborted"``),
        freeing its cache row; False when the caller has no such request waiting or running."""
        with self._lock:
            for queue in (self._waiting, self._running):
                for live in queue:
                    if live.request_id == request_id and live.owner is None:
                        queue.remove(live)
                        self._finish(live, "aborted")
                        return True
        return False

    def drop(self, owner: Owner) -> None:
        """Remove every request of ``owner`` (a ``generate`` that failed or ended), wherever
        it is, freeing its cache rows."""
        with self._lock:
            for queue in (self._waiting, self._running):
                for live in [x for x in queue if x.owner is owner]:
                    queue.remove(live)
                    self._release(live)
            for rid in [r for r, o in self._owned.items() if o is owner]:
                del self._owned[rid]
                self._known.discard(rid)
            owner.live = 0

    # -- what it holds -----------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Whether requests the caller added are waiting or running (a ``generate``'s are
        its own), or tokens others' steps made for them wait for the next :meth:`step`."""
        with self._lock:
            return bool(self._outbox or self._errors) or any(
                live.owner is None for live in (*self._waiting, *self._running))

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a cache row (the caller's and any ``generate``'s)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a cache row (the caller's and any ``generate``'s)."""
        return len(self._running)

    def requests(self) -> list[RequestInfo]:
        """Every request the batcher holds: waiting, running, finished and not yet taken."""
        with self._lock:
            out = [self._info(live, state) for state, queue in
                   (("waiting", self._waiting), ("running", self._running))
                   for live in queue]
            out += [RequestInfo(f.request_id, "finished", "caller", len(f.prompt),
                                len(f.tokens)) for f in self._finished]
            for owner in {id(o): o for o in self._owned.values()}.values():
                out += [RequestInfo(f.request_id, "finished", "generate", len(f.prompt),
                                    len(f.tokens)) for f in owner.finished.values()]
            return out

    @staticmethod
    def _info(live: Live, state: str) -> RequestInfo:
        return RequestInfo(live.request_id, state, "caller" if live.owner is None else
                           "generate", len(live.prompt), live.new_tokens)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[NewToken]:
        """Run one flat step; returns the tokens it made for the caller's requests (and any
        that steps run by a ``generate`` made for them), in order. Runs nothing and returns
        ``[]`` without unfinished requests. Raises what one of the caller's requests' own
        code raised (that request then ends with ``"error"``)."""
        with self._lock:
            self.advance()
            made, self._outbox = self._outbox, []
            if self._errors:
                error, self._errors = self._errors[0], []
                self._outbox = made
                raise error
            return made

    def collect(self, owner: Owner) -> list[NewToken]:
        """The tokens made for ``owner`` (a ``generate``) since it last looked, running a step
        first when there are none (another thread's step may have made them)."""
        with self._lock:
            if not owner.tokens and owner.live > 0 and owner.error is None \
                    and not self.advance():
                raise RuntimeError("generate: the batcher made no step with requests of this "
                                   "call left (a bug: please report it)")
            tokens, owner.tokens = owner.tokens, []
            return tokens

    def advance(self) -> bool:
        """One step of the model for every request, tokens routed to their owners; False
        when there was nothing to run."""
        with self._lock:
            chunks = self._schedule()
            if not chunks:
                return False
            self._propose([c for c in chunks if c.live.proposer is not None and
                           c.live.computed >= len(c.live.prompt)])
            ids: list[int] = []
            positions: list[int] = []
            rows: list[int] = []
            for chunk in chunks:
                live, start = chunk.live, chunk.live.computed
                chunk.first = len(ids)
                fed = live.tokens[start:] + chunk.candidates
                ids += fed[:chunk.count]
                positions += range(start, start + chunk.count)
                rows += [live.row] * chunk.count
            query = 1 + self._model.num_speculative_tokens
            uniform = all(c.count == query and c.live.computed >= len(c.live.prompt)
                          for c in chunks)
            logits = self._model.step(ids, positions, rows, uniform_decode=uniform)
            # (decided before a prompt chunk moves its request's computed tokens on: after,
            # a chunk that ends short of the prompt would look as if it reached its end)
            picking = [c for c in chunks if c.samples]
            plain = [c for c in picking if c.live.proposer is None
                     or c.live.computed < len(c.live.prompt)]
            for chunk in chunks:
                if not any(chunk is c for c in picking):
                    chunk.live.computed += chunk.count
            if plain:
                last = torch.tensor([c.first + c.count - 1 for c in plain], device=logits.device)
                self._pick(plain, logits[last].float())
            for chunk in picking:
                if not any(chunk is c for c in plain) and chunk.live in self._running:
                    self._verify(chunk, logits[chunk.first:chunk.first + chunk.count].float())
            # (once every row of the step has its tokens: a row ended early would lose its own)
            for owner in {id(c.live.owner): c.live.owner for c in chunks
                          if c.live.owner is not None}.values():
                self._end_if_all_stopped(owner)
            return True

    def _schedule(self) -> list[Chunk]:
        budget = self._model.max_num_tokens
        chunks: list[Chunk] = []
        prompt_done = [live for live in self._running if live.computed >= len(live.prompt)]
        prefilling = [live for live in self._running if live.computed < len(live.prompt)]
        for live in prompt_done:
            count = len(live.tokens) - live.computed
            if live.proposer is not None:  # the last token and k candidates
                count += spec_width(self._model, live.settings)
            if 0 < count <= budget:
                chunks.append(Chunk(live, count))
                budget -= count
        for live in prefilling:
            count = min(len(live.tokens) - live.computed, budget)
            if count > 0:
                chunks.append(Chunk(live, count))
                budget -= count
        while self._waiting and self._free_rows and budget > 0:
            live = self._waiting.popleft()
            live.row = self._free_rows.pop(0)
            self._running.append(live)
            count = min(len(live.tokens), budget)
            chunks.append(Chunk(live, count))
            budget -= count
        return chunks

    def _propose(self, chunks: list[Chunk]) -> None:
        """The speculative candidates of each verifying chunk (padded to its width with
        copies of the last token: a uniform step; only matches are ever accepted)."""
        if not chunks:
            return
        proposals = Proposer.propose_all(
            [(c.live.proposer, c.live.decoder, c.live.row, c.live.tokens) for c in chunks])
        for chunk, candidates in zip(chunks, proposals, strict=True):
            width = chunk.count - 1
            chunk.candidates = list(candidates[:width])
            chunk.candidates += [chunk.live.tokens[-1]] * (width - len(chunk.candidates))
            chunk.proposed = len(candidates[:width])

    def _pick(self, chunks: list[Chunk], rows: torch.Tensor) -> None:
        """Pick a token for each chunk's request from its logits row (``rows[i]``)."""
        lives = [c.live for c in chunks]
        vocab = int(rows.shape[-1])
        noise = [live.noise.take(live.member, live.new_tokens, vocab, rows.device)
                 if live.noise is not None else None for live in lives]
        tokens, scores, errors = pick([live.decoder for live in lives], rows, noise)
        for i, error in errors.items():
            self._fail(lives[i], error)
        for i, (live, token) in enumerate(zip(lives, tokens, strict=True)):
            if i not in errors:
                self._append(live, token, rows[i], scores[i])

    def _verify(self, chunk: Chunk, rows: torch.Tensor) -> None:
        """Accept the longest run of candidates the model picks itself, then its own next
        token (greedy: the tokens plain decoding makes)."""
        live = chunk.live
        try:
            picked = accept(live.decoder, rows, chunk.candidates[:chunk.proposed])
        except Exception as exc:
            self._fail(live, exc)
            return
        for token, raw, score in picked:
            if live not in self._running or not self._append(live, token, raw, score):
                break

    def _append(self, live: Live, token: int, raw: torch.Tensor,
                score: torch.Tensor) -> bool:
        """Give ``live`` its next token; False when that ended it."""
        live.tokens.append(token)
        live.computed = len(live.tokens) - 1
        live.decoder.append(token)
        if live.noise is not None:
            live.noise.done(live.member, live.new_tokens)
        if live.keep_logits:
            live.logits.append(raw.clone())
        if live.keep_scores:
            live.scores.append(score.clone())
        settings_ = live.settings
        reason = "eos" if token in settings_.stop_ids else \
            "length" if live.new_tokens >= settings_.max_new_tokens else None
        if reason is None:
            try:
                kept = tuple(s[None] for s in live.scores) if live.keep_scores else None
                reason = "stop" if live.decoder.stops(kept) else None
            except BaseException as exc:  # (Ctrl-C too: the token is the request's, sent)
                self._send(NewToken(live.request_id, token, live.new_tokens - 1, True, "error"),
                           live.owner)
                self._fail(live, exc, queue=isinstance(exc, Exception))
                if not isinstance(exc, Exception):
                    raise
                return False
        going = reason == "stop" and live.owner is not None and not settings_.stop_ids
        if going and live.stopped is None:  # HF decodes such a row on until its batch ends
            live.stopped = live.new_tokens
        self._send(NewToken(live.request_id, token, live.new_tokens - 1,
                            reason is not None and not going, reason), live.owner)
        if reason is not None and not going:
            self._running.remove(live)
            self._finish(live, reason)
        return reason is None or going

    def _end_if_all_stopped(self, owner: Owner) -> None:
        """Finish a call's rows once each was stopped and has its token of the column where the
        last of them stopped: HF's loop ends there, every row decoding up to it (a row that
        runs behind, waiting for a cache row or prefilling in chunks, decodes on to it)."""
        rows = [x for x in (*self._waiting, *self._running) if x.owner is owner]
        ends = [x.stopped for x in rows if x.stopped is not None]
        width = max([*ends, owner.widest])
        if rows and len(ends) == len(rows) and all(x.new_tokens >= width for x in rows):
            for x in rows:
                (self._waiting if x in self._waiting else self._running).remove(x)
                owner.tokens.append(NewToken(x.request_id, x.tokens[-1], x.new_tokens - 1,
                                             True, "stop"))
                self._finish(x, "stop")

    def _send(self, made: NewToken, owner: Owner | None) -> None:
        (owner.tokens if owner is not None else self._outbox).append(made)

    def _fail(self, live: Live, error: BaseException, queue: bool = True) -> None:
        """End ``live`` with ``error`` (raised by its own code); the caller's :meth:`step`
        raises it later unless ``queue`` is False (it is being raised now)."""
        if live in self._running:
            self._running.remove(live)
        self._finish(live, "error", error)
        if live.owner is None:
            if queue:
                self._errors.append(error)
        elif live.owner.error is None:
            live.owner.error = error

    def _release(self, live: Live) -> None:
        if live.row >= 0:
            self._free_rows.append(live.row)
            self._free_rows.sort()
            live.row = -1
        if live.noise is not None:
            live.noise.leave(live.member)

    def _finish(self, live: Live, reason: str, error: BaseException | None = None) -> None:
        self._release(live)
        done = Finished(live.request_id, live.prompt, tuple(live.tokens[len(live.prompt):]),
                        reason, tuple(live.logits), tuple(live.scores), error)
        if live.owner is None:
            self._finished.append(done)
        else:
            live.owner.finished[live.request_id] = done
            live.owner.widest = max(live.owner.widest, live.new_tokens if live.stopped is None
                                    else live.stopped)
            live.owner.live -= 1

    # -- requests out ------------------------------------------------------------------------
    def take_finished(self) -> list[Finished]:
        """The caller's requests that finished since the last call, in the order they
        finished (a ``generate``'s are its own)."""
        with self._lock:
            done, self._finished = self._finished, []
            self._known.difference_update(f.request_id for f in done)
            return done


