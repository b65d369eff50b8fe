"""Input specs: how a :class:`~freezeframe.runtime.GraphRunner` sizes, fills and checks each input.

A captured graph reads its inputs from fixed addresses, so the runner owns one static buffer per
dynamic input and copies each step's data into it. To do that it must know, per input, which
dimension grows with the batch and what a *padded* row should hold:

* :func:`Tokens` - one row per token (hidden states, token ids, positions, slot mappings);
  the buffer has ``max_num_tokens`` rows.
* :func:`Requests` - one row per request (sequence lengths, block tables, sampling indices);
  the buffer has ``max_num_seqs`` rows.
* :func:`Static` - a fixed-shape tensor (user metadata, a flag tensor) copied whole each step.

The ``fill`` value is what padded rows hold. It must keep the model finite on those rows and make
them harmless to real rows: zeros for activations, ``-1`` for slot ids that an attention op skips,
``0`` for sequence lengths, and so on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from freezeframe.errors import ConfigError

__all__ = ["InputKind", "InputSpec", "Requests", "Static", "Tokens"]

InputKind = Literal["tokens", "requests", "static"]
_KINDS = ("tokens", "requests", "static")


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One runner input. ``shape`` is the trailing shape (after the batch dimension) for
    ``tokens``/``requests`` inputs and the full shape for ``static`` ones."""

    kind: InputKind
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    fill: bool | int | float = 0
    name: str = ""
    """Set by the runner from the key of its ``inputs`` mapping."""

    def __post_init__(self) -> None:
        where = f"input {self.name!r}" if self.name else "InputSpec"
        if self.kind not in _KINDS:
            raise ConfigError(f"{where}: kind {self.kind!r} is not one of {list(_KINDS)}")
        shape = tuple(self.shape)
        for d in shape:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise ConfigError(f"{where}: shape entries must be ints >= 0, got {shape}")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"{where}: dtype must be a torch.dtype, got {self.dtype!r}")
        fill = self.fill
        if not isinstance(fill, (bool, int, float)):
            raise ConfigError(f"{where}: fill must be a number, got {fill!r}")
        if isinstance(fill, float) and not math.isfinite(fill):
            raise ConfigError(
                f"{where}: fill {fill} is not finite; padded rows must never carry NaN or inf "
                "into the model, so pick a finite value such as 0")
        try:
            stored = torch.tensor(fill, dtype=self.dtype).item()
        except (RuntimeError, OverflowError, TypeError) as exc:
            raise ConfigError(f"{where}: fill {fill!r} cannot be stored as {self.dtype}: "
                              f"{exc}") from None
        if stored != fill:
            raise ConfigError(f"{where}: fill {fill!r} changes to {stored!r} when stored as "
                              f"{self.dtype}; choose a fill the dtype can hold exactly")

    def named(self, name: str) -> InputSpec:
        return dataclasses.replace(self, name=name)

    def buffer_shape(self, max_num_tokens: int, max_num_seqs: int) -> tuple[int, ...]:
        if self.kind == "tokens":
            return (max_num_tokens, *self.shape)
        if self.kind == "requests":
            return (max_num_seqs, *self.shape)
        return self.shape

    @classmethod
    def like(cls, example: torch.Tensor, kind: InputKind = "tokens",
             fill: bool | int | float = 0) -> InputSpec:
        """A spec inferred from an example tensor: its dtype and, for dynamic kinds, the shape
        after its first (batch) dimension."""
        if not isinstance(example, torch.Tensor):
            raise ConfigError(f"InputSpec.like needs a tensor, got {type(example).__name__}")
        if kind != "static" and example.dim() == 0:
            raise ConfigError(f"InputSpec.like: a {kind} input needs a batch dimension; the "
                              "example is a 0-d tensor")
        shape = tuple(example.shape) if kind == "static" else tuple(example.shape[1:])
        return cls(kind=kind, shape=shape, dtype=example.dtype, fill=fill)


def Tokens(*shape: int, dtype: torch.dtype = torch.float32,
           fill: bool | int | float = 0) -> InputSpec:
    """An input with one row per token: ``Tokens(hidden)`` is a ``[num_tokens, hidden]`` tensor,
    ``Tokens(dtype=torch.long)`` a ``[num_tokens]`` one."""
    return InputSpec("tokens", tuple(shape), dtype, fill)


def Requests(*shape: int, dtype: torch.dtype = torch.int32,
             fill: bool | int | float = 0) -> InputSpec:
    """An input with one row per request, e.g. ``Requests(dtype=torch.int32)`` for
    ``seq_lens`` of shape ``[num_reqs]``."""
    return InputSpec("requests", tuple(shape), dtype, fill)


def Static(*shape: int, dtype: torch.dtype = torch.float32,
           fill: bool | int | float = 0) -> InputSpec:
    """A fixed-shape input copied whole each step (its shape never changes)."""
    return InputSpec("static", tuple(shape), dtype, fill)
