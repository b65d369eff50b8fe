"""A request's sampling parameters (:class:`SamplingParams`) and the random draws of requests
that sample (:class:`NoiseDraws`).

:class:`SamplingParams` is the short form of a request's generation settings for
``lm.batcher.add``, under HF ``generate``'s names and defaults; it becomes a transformers
``GenerationConfig`` (:meth:`SamplingParams.generation_config`), whose processors and warpers
are transformers' own (:mod:`~freezeframe.integrations.hf_processing`).

A draw is made as ``torch.multinomial`` makes it for one sample: the token maximising
``probability / noise``, with ``noise`` exponentially distributed, drawn for the whole
``[rows, vocab]`` batch at once. Requests that share a generator form one :class:`NoiseDraws`:
the ``k``-th new token of every member uses row ``member`` of the ``k``-th draw, whichever
engine step produces it. So a batch of requests sampled together, whether they are prefilled in
one step or several and whatever else runs beside them, draws exactly what HF's ``generate``
draws from the same generator state for that batch, and gets its tokens where the logits agree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from freezeframe.errors import ConfigError

__all__ = ["NoiseDraws", "SamplingParams"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops, under HF ``generate``'s names and
    defaults (``top_k=50`` applies when sampling, as in HF).

    ``max_new_tokens`` tokens at most; ``eos_token_id`` (one id or several) ends a request as
    soon as it is generated (it is kept as the last token), but not before ``min_new_tokens``
    tokens: until then stop tokens cannot be picked. ``do_sample=False`` is greedy decoding and
    ignores ``temperature``, ``top_k`` and ``top_p``.
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    eos_token_id: int | Sequence[int] | None = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            self._refuse("max_new_tokens", self.max_new_tokens, "an int >= 1")
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            self._refuse("min_new_tokens", self.min_new_tokens,
                         "an int >= 0 (0: stop tokens may come first)")
        if not isinstance(self.do_sample, bool):
            self._refuse("do_sample", self.do_sample, "True or False")
        if not _is_number(self.temperature) or self.temperature <= 0:
            self._refuse("temperature", self.temperature,
                         "a number > 0 (for greedy decoding pass do_sample=False)")
        if not _is_int(self.top_k) or self.top_k < 0:
            self._refuse("top_k", self.top_k, "an int >= 0 (0: no top-k cut)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            self._refuse("top_p", self.top_p, "a number in (0, 1] (1: no top-p cut)")
        eos = self.eos_token_id
        ids: object = () if eos is None else (eos,) if _is_int(eos) else eos
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) \
                or not all(_is_int(i) and i >= 0 for i in ids):
            self._refuse("eos_token_id", eos, "a token id >= 0, a sequence of them, or None")
            return
        object.__setattr__(self, "eos_token_id", tuple(dict.fromkeys(ids)))

    @staticmethod
    def _refuse(field: str, value: object, rule: str) -> None:
        raise ConfigError(f"SamplingParams: {field}={value!r} must be {rule}")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple of distinct ids (empty: no stop token)."""
        return self.eos_token_id  # type: ignore[return-value]  # a tuple once checked

    def generation_config(self) -> Any:
        """These parameters as a transformers ``GenerationConfig`` (every field set: the
        model's ``generation_config`` is not consulted)."""
        from transformers import GenerationConfig

        sampling = {"temperature": self.temperature, "top_k": self.top_k,
                    "top_p": self.top_p} if self.do_sample else {}
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens, min_new_tokens=self.min_new_tokens or None,
            do_sample=self.do_sample, eos_token_id=list(self.stop_ids) or None, **sampling)

    def check_vocab(self, vocab_size: int | None) -> None:
        """Refuse a stop token outside the vocabulary (it could never be generated)."""
        bad = [i for i in self.stop_ids if vocab_size is not None and i >= vocab_size]
        if bad:
            raise ConfigError(f"SamplingParams: eos_token_id {bad[0]} is outside the "
                              f"vocabulary of {vocab_size} tokens; pass this model's stop "
                              "token (model.generation_config.eos_token_id)")


class NoiseDraws:
    """The exponential noise of ``members`` requests that sample with one generator: draw
    ``k`` is one ``[members, vocab]`` tensor, made when a member first needs its ``k``-th token
    and dropped once every member still running is past it (see the module docstring)."""

    def __init__(self, members: int, generator: torch.Generator | None,
                 device: torch.device) -> None:
        self._generator = generator
        # drawn where the generator lives (the default generator: the model's device)
        self._device = generator.device if generator is not None else device
        self._draws: dict[int, torch.Tensor] = {}
        self._made = 0  # draws made so far: the next one is draw self._made
        self._progress = [0] * members  # per member: tokens taken; math.inf once it left

    def take(self, member: int, index: int, vocab: int, device: torch.device) -> torch.Tensor:
        """Row ``member`` of draw ``index`` (``[vocab]`` on ``device``), drawing up to it."""
        while self._made <= index:
            noise = torch.empty((len(self._progress), vocab), dtype=torch.float32,
                                device=self._device)
            self._draws[self._made] = noise.exponential_(1.0, generator=self._generator)
            self._made += 1
        return self._draws[index][member].to(device, non_blocking=True)

    def done(self, member: int, count: int) -> None:
        """``member`` has ``count`` tokens: draws before ``count`` are no longer its."""
        self._progress[member] = count
        self._forget_passed()

    def leave(self, member: int) -> None:
        """``member`` takes no more tokens."""
        self._progress[member] = math.inf  # type: ignore[call-overload]
        self._forget_passed()

    def _forget_passed(self) -> None:
        passed = min(self._progress)
        for index in [i for i in self._draws if i < passed]:
            del self._draws[index]
