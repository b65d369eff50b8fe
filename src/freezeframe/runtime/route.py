"""Where a runner step goes: its runtime mode, padded descriptor and padded sizes, through
every reason it may run without a graph (each counted in ``fallback_<reason>`` and logged once,
or raised by a strict runner).

The dispatcher (:mod:`freezeframe.runtime.dispatcher`) holds the one runtime-mode rule; this
adds what only a runner knows: its data-parallel agreement on the size, its per-step and
per-runner invalid modes, whether graphs exist on this machine, whether capture failed,
compiling is off, or the capture policy has not captured the step's key yet, and whether the
key needs a warm-up step first.
"""

from __future__ import annotations

import logging
from typing import Any

from freezeframe.batch import BatchDescriptor, GraphKey, mixed_step_reqs
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.errors import FallbackError, InputMismatchError
from freezeframe.runtime.capture import Capturer
from freezeframe.runtime.dispatcher import Dispatcher
from freezeframe.runtime.dist import agree_across_ranks
from freezeframe.runtime.plan import Route, StepCall, StepOptions
from freezeframe.runtime.report import FALLBACK_REASONS
from freezeframe.stats import Stats

__all__ = ["StepRouter"]

# the runner's logger: its messages are GraphRunner's, filtered by that name
logger = logging.getLogger("freezeframe.runtime.runner")

_NONE, _PIECEWISE = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE
_GRAPH_MODES = frozenset({_PIECEWISE, CUDAGraphMode.FULL})


class StepRouter:
    """Routes a runner's steps (see the module docstring)."""

    def __init__(self, config: CompilationConfig, dispatcher: Dispatcher, capturer: Capturer,
                 stats: Stats, options: StepOptions, graphs_available: bool) -> None:
        self._config, self._dispatcher, self._capturer = config, dispatcher, capturer
        self._stats, self._options = stats, options
        self._graphs_available = graphs_available
        self._logged_reasons: set[str] = set()

    def route(self, call: StepCall, num_tokens: int, reqs: int | None) -> Route:
        """Dispatch the step, through every reason it may run without a graph."""
        step_tokens, uniform = num_tokens, bool(call.uniform_decode)
        if self._options.dp_sync:
            step_tokens, uniform = agree_across_ranks(num_tokens, uniform,
                                                      self._options.dp_group)
        base = self._options.invalid_modes
        invalid = base | frozenset(call.invalid_modes) if call.invalid_modes else base
        lora = (call.has_lora, call.num_active_loras)
        mode, desc = self._dispatch(step_tokens, uniform, *lora, invalid)
        capturer = self._capturer
        key = (mode, desc)
        if mode is not _NONE and capturer.capture_failed:
            mode, desc = self._without_graph(key, "capture_failed", step_tokens, uniform, *lora)
        elif mode is not _NONE and capturer.deferred and capturer.deferred.waiting(key):
            reason = capturer.deferred_step(key)
            if reason is not None:
                mode, desc = self._without_graph(key, reason, step_tokens, uniform, *lora)
        if mode is not _NONE and capturer.warms_up_first((mode, desc)):
            # before capture(), a step of a key nothing ran yet would capture that key's code
            # on its first run (the window is open): it runs without a graph, as a warm-up
            mode, desc = self._dispatcher.dispatch(step_tokens, uniform, *lora,
                                                   invalid_modes=_GRAPH_MODES)
        padded_tokens = desc.num_tokens if mode is not _NONE else step_tokens
        padded_reqs = desc.num_reqs if desc.num_reqs is not None else reqs
        if mode is _PIECEWISE and reqs is not None:
            # A piecewise graph's key ignores the request count, so its pieces were captured
            # with the request rows the capture gave them; every step of that size passes as
            # many (the padded rows hold the fill value), never fewer, which a replay would
            # read as stale rows.
            padded_reqs = mixed_step_reqs(padded_tokens, self._config.max_num_seqs)
        if reqs is not None and padded_reqs is not None and reqs > padded_reqs:
            raise InputMismatchError(
                f"step has {reqs} requests but the graph key {desc} holds {padded_reqs}; with "
                f"uniform_decode=True every request must have exactly "
                f"{self._dispatcher.uniform_decode_query_len} tokens")
        return Route(mode, desc, padded_tokens, padded_reqs, uniform)

    def _dispatch(self, num_tokens: int, uniform: bool, has_lora: bool, num_active_loras: int,
                  invalid: frozenset[CUDAGraphMode]) -> tuple[CUDAGraphMode, BatchDescriptor]:
        d = self._dispatcher
        off = not self._graphs_available or self._capturer.compile_disabled
        mode, desc = d.dispatch(num_tokens, uniform, has_lora, num_active_loras,
                                invalid_modes=_GRAPH_MODES if off else invalid)
        if mode is _NONE:
            reason = self._fallback_reason(num_tokens, uniform, has_lora, num_active_loras,
                                           invalid)
            self._fallback(reason, num_tokens=num_tokens, uniform=uniform, desc=desc,
                           invalid=sorted(m.name for m in invalid))
        return mode, desc

    def _fallback_reason(self, num_tokens: int, uniform: bool, has_lora: bool,
                         num_active_loras: int, invalid: frozenset[CUDAGraphMode]) -> str:
        d = self._dispatcher
        if d.cudagraph_mode is not _NONE and not self._graphs_available:
            return "graphs_unavailable"
        if d.cudagraph_mode is not _NONE and self._capturer.compile_disabled:
            return "compile_disabled"
        return d.why_no_graph(num_tokens, uniform, has_lora, num_active_loras, invalid)

    def _without_graph(self, key: GraphKey, reason: str, num_tokens: int, uniform: bool,
                       has_lora: bool, num_active_loras: int
                       ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The step's graph (``key``) cannot run: dispatch it without a graph, counted and
        logged as ``reason`` (strict runners raise)."""
        mode, desc = self._dispatcher.dispatch(num_tokens, uniform, has_lora,
                                               num_active_loras, invalid_modes=_GRAPH_MODES)
        self._fallback(reason, num_tokens=num_tokens, uniform=uniform, desc=key[1],
                       invalid=[])
        return mode, desc

    def _fallback(self, reason: str, **info: Any) -> None:
        self._stats.inc(f"fallback_{reason}")
        level, template = FALLBACK_REASONS[reason]
        message = template.format(
            backend=self._config.graph_backend, max_size=self._dispatcher.max_capture_size,
            mode=self._dispatcher.cudagraph_mode.name, policy=self._options.policy_name,
            **info)
        if self._options.strict:
            raise FallbackError(
                f"step would run without a graph ({reason}): {message}. The runner is strict; "
                "construct it with strict=False to allow eager fallbacks")
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            logger.log(level, "GraphRunner eager fallback (%s, logged once): %s", reason, message)
