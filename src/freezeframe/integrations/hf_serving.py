"""A minimal asynchronous front for ``lm.batcher``: one ``async`` iterator of tokens per
request, one task stepping the batcher while any request is unfinished.

::

    server = ff.hf.AsyncFront(lm.batcher)

    async def handle(prompt):
        async for token in server.stream(prompt, ff.hf.SamplingParams(max_new_tokens=16)):
            ...  # send it to the client

A step is the model's work, run on the event loop's thread (a step is milliseconds on a GPU):
between two steps the loop runs everyone else, so new requests join the next step and every
stream gets its tokens as they are made. A stream the consumer leaves early (``break``, a
cancelled task) aborts its request, freeing its cache row. A request whose own code raised (a
processor, a stopping criterion) raises that error from its stream; the other streams go on. A
step that fails for all (the model step raised: a refused module change, a device error) raises
its error from every open stream and aborts their requests; a later stream starts stepping
again.
The front owns the caller's side of the batcher: do not step it elsewhere meanwhile
(``lm.generate`` may still run beside it, from another thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from freezeframe.integrations.hf_batching import Batcher, NewToken

__all__ = ["AsyncFront"]

_END = None


class AsyncFront:
    """Streams of tokens over one :class:`~freezeframe.integrations.hf_batching.Batcher`
    (see the module docstring)."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self._queues: dict[str, asyncio.Queue[NewToken | BaseException | None]] = {}
        self._task: asyncio.Task[None] | None = None

    async def stream(self, prompt: Sequence[int] | torch.Tensor, params: Any = None,
                     **add: Any) -> AsyncIterator[int]:
        """The new tokens of one request (``Batcher.add``'s arguments), as they are made."""
        rid = self.batcher.add(prompt, params, **add)
        queue: asyncio.Queue[NewToken | BaseException | None] = asyncio.Queue()
        self._queues[rid] = queue
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._steps())
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item.token
        finally:
            self._queues.pop(rid, None)
            self.batcher.abort(rid)  # (False when it finished: nothing to do)
            self._collect()

    async def _steps(self) -> None:
        while self.batcher.has_unfinished():
            failure: Exception | None = None
            try:
                made = self.batcher.step()
            except Exception as exc:  # (one request's error, or the step's own)
                made, failure = [], exc
            for token in made:
                queue = self._queues.get(token.request_id)
                if queue is not None:
                    queue.put_nowait(token)
            ended = self._collect()
            if failure is not None and not any(error is failure for error in ended):
                self._fail_all(failure)  # the model step failed: retrying would spin
                return
            await asyncio.sleep(0)  # let the streams and new requests run
        self._collect()

    def _collect(self) -> list[BaseException]:
        """Hand each finished request's end (or its error) to its stream; returns the
        errors."""
        errors = []
        for done in self.batcher.take_finished():
            queue = self._queues.get(done.request_id)
            if done.error is not None:
                errors.append(done.error)
            if queue is not None:
                queue.put_nowait(done.error if done.error is not None else _END)
        return errors

    def _fail_all(self, failure: Exception) -> None:
        """A step failed for every request (the model step raised): each open stream raises
        it and its request is aborted."""
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(failure)
            self.batcher.abort(rid)
        self._collect()
