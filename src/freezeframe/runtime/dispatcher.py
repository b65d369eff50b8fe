"""The dispatcher: which graph (if any) a step of ``num_tokens`` tokens runs, and under which key.

The dispatcher is the single source of truth for the graphs a runner may capture and replay.
It derives every valid key from the config once, at construction, and afterwards answers two
questions with dictionary lookups only:

* :meth:`Dispatcher.dispatch` - for a step of a given size and kind, the runtime mode (FULL,
  PIECEWISE or NONE) and the padded :class:`~freezeframe.batch.BatchDescriptor` the graph
  wrappers will key on;
* :meth:`Dispatcher.capture_descriptors` - every key, grouped by mode in the order they should be
  captured (PIECEWISE first, then FULL, each largest first so that smaller graphs reuse the memory
  pool the larger ones grew).

Key shapes. PIECEWISE graphs never contain attention, so their keys are *relaxed*: only the token
count and the LoRA case matter (``num_reqs=None``, ``uniform=False``). FULL graphs contain the
whole forward, attention included, whose metadata depends on the request layout, so their keys
keep ``num_reqs`` (and ``uniform``): a uniform-decode key has ``num_tokens // q`` requests of
``q = 1 + num_speculative_tokens`` tokens each, a mixed key ``min(num_tokens, max_num_seqs)``.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from freezeframe.batch import BatchDescriptor, mixed_step_reqs
from freezeframe.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    check_piecewise_compilation,
)
from freezeframe.errors import ConfigError
from freezeframe.sizes import padding_table

__all__ = ["Dispatcher", "LoraCase", "lora_cases", "runtime_modes"]

logger = logging.getLogger(__name__)

_NONE = CUDAGraphMode.NONE
_PIECEWISE = CUDAGraphMode.PIECEWISE
_FULL = CUDAGraphMode.FULL
_MEMO_LIMIT = 1 << 16  # dispatch answers remembered (a step's arguments are small ints)


@dataclass(frozen=True, order=True)
class LoraCase:
    """One LoRA variant graphs are captured for: ``(has_lora, num_active_loras)``."""

    has_lora: bool
    num_active_loras: int


def lora_cases(max_loras: int, specialize: bool, num_speculative_tokens: int) -> list[LoraCase]:
    """The LoRA variants every capture size gets a graph for.

    * No LoRA configured (``max_loras == 0``): one case, no LoRA.
    * Specialised (``cudagraph_specialize_lora``): the no-LoRA case, every power of two up to
      ``max_loras`` and ``max_loras + 1`` (``max_loras=4`` gives counts ``[0, 1, 2, 4, 5]``). A
      step with ``k`` active adapters replays the smallest captured count ``>= k``, so the kernels
      launch a grid close to the real adapter count instead of always the worst case.
    * Not specialised: one LoRA graph for ``max_loras + 1`` adapters that serves *every* step,
      LoRA or not (the LoRA kernels must no-op for an empty adapter slot, as vLLM's do).
    * With speculative decoding only ``max_loras`` is captured (plus the no-LoRA case when
      specialised), mirroring vLLM, which avoids several LoRA graphs there.
    """
    if max_loras <= 0:
        return [LoraCase(False, 0)]
    if num_speculative_tokens > 0:
        cases = [LoraCase(True, max_loras)]
        return [LoraCase(False, 0), *cases] if specialize else cases
    if not specialize:
        return [LoraCase(True, max_loras + 1)]
    counts = [n for n in range(1, max_loras + 1) if n & (n - 1) == 0] + [max_loras + 1]
    return [LoraCase(False, 0), *(LoraCase(True, n) for n in counts)]



def runtime_modes(invalid_modes: Collection[CUDAGraphMode]) -> frozenset[CUDAGraphMode]:
    """``invalid_modes`` (of a step or a runner) as a frozenset, checked: only the runtime
    graph modes PIECEWISE and FULL can be ruled out (a ConfigError, a ValueError, otherwise)."""
    modes = frozenset(invalid_modes)
    for m in modes:
        if m not in (_PIECEWISE, _FULL):
            raise ConfigError(
                f"invalid_modes may hold PIECEWISE and FULL only, got {m!r}; eager (NONE) is "
                "always possible and config modes such as FULL_AND_PIECEWISE are not runtime "
                "modes")
    return modes

class Dispatcher:
    """Valid graph keys for one config, padding, and the choice of runtime mode per step.

    Construction fails with :class:`~freezeframe.errors.ConfigError` when the config asks for
    piecewise graphs without piecewise compilation (the config itself rejects that combination;
    the dispatcher checks again because it may be handed a config built around validation).
    """

    def __init__(self, config: CompilationConfig) -> None:
        self.config = config
        mode = config.cudagraph_mode
        compile_mode = CompilationMode.parse(config.mode)
        if not isinstance(mode, CUDAGraphMode):
            raise ConfigError(
                f"Dispatcher needs a resolved CompilationConfig; cudagraph_mode is {mode!r}. "
                "Build the config with ff.CompilationConfig(...)")
        check_piecewise_compilation(mode, compile_mode, config.splitting_ops)
        self.cudagraph_mode: CUDAGraphMode = mode
        self.uniform_decode_query_len: int = 1 + config.num_speculative_tokens
        self.capture_sizes: tuple[int, ...] = tuple(config.cudagraph_capture_sizes or ())
        self.max_capture_size: int = self.capture_sizes[-1] if self.capture_sizes else 0
        self.max_num_seqs: int = config.max_num_seqs
        # padded size of every token count 0..max_capture_size: one index per step
        self._padded: list[int] = padding_table(self.capture_sizes)
        self.lora_cases: tuple[LoraCase, ...] = tuple(lora_cases(
            config.max_loras, config.cudagraph_specialize_lora, config.num_speculative_tokens))
        # Sorted LoRA counts a step's adapter count rounds up to (specialised case only).
        self._lora_counts = sorted({c.num_active_loras for c in self.lora_cases if c.has_lora})
        self._keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {_PIECEWISE: set(), _FULL: set()}
        self._memo: dict[tuple[Any, ...], tuple[CUDAGraphMode, BatchDescriptor]] = {}
        if mode is not _NONE and self.capture_sizes:
            self._build_keys()

    # -- keys ------------------------------------------------------------------------------
    def _build_keys(self) -> None:
        mode, q = self.cudagraph_mode, self.uniform_decode_query_len
        mixed = mode.mixed_mode()
        if mixed is not _NONE:
            for size in self.capture_sizes:
                for case in self.lora_cases:
                    desc = self._descriptor(size, False, case)
                    self._keys[mixed].add(
                        desc.relax_for_piecewise() if mixed is _PIECEWISE else desc)
        # A separate FULL routine for uniform-decode batches: sizes that hold whole requests of
        # q tokens and no more requests than the scheduler ever runs at once.
        if mode.separate_routine() and mode.decode_mode() is _FULL:
            for size in self.capture_sizes:
                if size < q or size > q * self.max_num_seqs or size % q:
                    continue
                for case in self.lora_cases:
                    self._keys[_FULL].add(self._descriptor(size, True, case))

    def _descriptor(self, padded: int, uniform: bool, case: LoraCase) -> BatchDescriptor:
        q = self.uniform_decode_query_len
        num_reqs = padded // q if uniform else mixed_step_reqs(padded, self.max_num_seqs)
        return BatchDescriptor(num_tokens=padded, num_reqs=num_reqs, uniform=uniform,
                               has_lora=case.has_lora, num_active_loras=case.num_active_loras)

    def keys(self, mode: CUDAGraphMode) -> frozenset[BatchDescriptor]:
        """The valid keys of one runtime mode (PIECEWISE or FULL)."""
        return frozenset(self._keys.get(mode, ()))

    @property
    def num_keys(self) -> int:
        return sum(len(v) for v in self._keys.values())

    # -- dispatch --------------------------------------------------------------------------
    def effective_lora_case(self, has_lora: bool, num_active_loras: int) -> LoraCase:
        """The captured LoRA case a step with this adapter state replays."""
        if num_active_loras < 0:
            raise ValueError(f"num_active_loras must be >= 0, got {num_active_loras}")
        if self.config.max_loras <= 0:
            return LoraCase(has_lora, num_active_loras if has_lora else 0)
        specialised = any(not c.has_lora for c in self.lora_cases)
        if not specialised:
            # One LoRA graph serves every step (see lora_cases).
            return self.lora_cases[0]
        if not has_lora:
            return LoraCase(False, 0)
        if self.config.num_speculative_tokens > 0:
            return LoraCase(True, self.config.max_loras)
        i = bisect.bisect_left(self._lora_counts, max(num_active_loras, 1))
        if i == len(self._lora_counts):
            return LoraCase(True, num_active_loras)  # more adapters than captured: no key
        return LoraCase(True, self._lora_counts[i])

    def dispatch(self, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False,
                 num_active_loras: int = 0,
                 invalid_modes: Collection[CUDAGraphMode] = frozenset(),
                 ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and padded descriptor for a step of ``num_tokens`` tokens.

        ``uniform_decode`` says every request in the step has exactly ``1 +
        num_speculative_tokens`` tokens. ``invalid_modes`` excludes runtime modes for this step
        (for example FULL when the attention backend cannot run the batch inside a full graph).
        Preference: the exact FULL key, then the mixed FULL key, then the PIECEWISE key, then no
        graph with the *unpadded* descriptor.

        The keys are fixed when the dispatcher is built, so the answer for the same arguments is
        always the same: it is worked out once and looked up afterwards (a step's dispatch is
        one dictionary lookup).
        """
        # keyed by exact types too: True == 1 must not find the answer for 1 tokens
        memo_key = (num_tokens, type(num_tokens), uniform_decode, has_lora, num_active_loras,
                    invalid_modes)
        try:
            return self._memo[memo_key]
        except (KeyError, TypeError):  # TypeError: an unhashable invalid_modes
            pass
        answer = self._dispatch(num_tokens, uniform_decode, has_lora, num_active_loras,
                                invalid_modes)
        if len(self._memo) < _MEMO_LIMIT:
            with contextlib.suppress(TypeError):
                self._memo[memo_key] = answer
        return answer

    def _dispatch(self, num_tokens: int, uniform_decode: bool, has_lora: bool,
                  num_active_loras: int, invalid_modes: Collection[CUDAGraphMode],
                  ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise TypeError(f"num_tokens must be an int, got {num_tokens!r}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        invalid = runtime_modes(invalid_modes)
        case = self.effective_lora_case(has_lora, num_active_loras)
        eager = BatchDescriptor(num_tokens=num_tokens, has_lora=has_lora,
                                num_active_loras=num_active_loras if has_lora else 0)
        if (self.num_keys == 0 or num_tokens == 0 or num_tokens > self.max_capture_size):
            return _NONE, eager
        padded = self._padded[num_tokens]  # num_tokens <= max_capture_size
        q = self.uniform_decode_query_len
        uniform = bool(uniform_decode) and padded % q == 0
        exact = self._descriptor(padded, uniform, case)
        mixed = self._descriptor(padded, False, case) if uniform else exact
        if _FULL not in invalid:
            if exact in self._keys[_FULL]:
                return _FULL, exact
            if mixed in self._keys[_FULL]:
                return _FULL, mixed
        if _PIECEWISE not in invalid:
            relaxed = exact.relax_for_piecewise()
            if relaxed in self._keys[_PIECEWISE]:
                return _PIECEWISE, relaxed
        return _NONE, eager

    def why_no_graph(self, num_tokens: int, uniform_decode: bool = False,
                     has_lora: bool = False, num_active_loras: int = 0,
                     invalid_modes: Collection[CUDAGraphMode] = frozenset()) -> str:
        """Why :meth:`dispatch` gives a step with these arguments no graph, as a fallback
        reason (``runtime/report.py``): ``graphs_off`` (cudagraph_mode NONE), ``too_large``
        (above the largest capture size), ``mode_invalid`` (a graph exists, but its mode is
        in ``invalid_modes``), ``mode_off`` (the config's mode covers no batch of this size
        and kind: FULL_DECODE_ONLY and a mixed batch), ``no_key`` (it covers plain batches of
        this size, but not this LoRA case)."""
        if self.cudagraph_mode is _NONE:
            return "graphs_off"
        if num_tokens > self.max_capture_size:
            return "too_large"
        if invalid_modes and self.dispatch(num_tokens, uniform_decode, has_lora,
                                           num_active_loras)[0] is not _NONE:
            return "mode_invalid"
        if self.dispatch(num_tokens, uniform_decode)[0] is _NONE:
            return "mode_off"
        return "no_key"

    # -- capture order ---------------------------------------------------------------------
    def capture_descriptors(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """Every key to capture: ``[(PIECEWISE, descs), (FULL, descs)]`` (modes without keys are
        left out), each list largest first. Graphs captured later can reuse pool memory the
        larger ones allocated, which keeps the pool near the size of the largest graph."""
        out: list[tuple[CUDAGraphMode, list[BatchDescriptor]]] = []
        for mode in (_PIECEWISE, _FULL):
            keys = self._keys[mode]
            if keys:
                out.append((mode, sorted(keys, key=_capture_order)))
        return out

    def __repr__(self) -> str:
        pw, full = len(self._keys[_PIECEWISE]), len(self._keys[_FULL])
        return (f"Dispatcher(mode={self.cudagraph_mode.name}, sizes={list(self.capture_sizes)}, "
                f"piecewise_keys={pw}, full_keys={full})")


def _capture_order(desc: BatchDescriptor) -> tuple[int, int, bool, int]:
    return (-desc.num_tokens, -(desc.num_reqs or 0), not desc.has_lora, -desc.num_active_loras)
