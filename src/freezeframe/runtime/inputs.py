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
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from freezeframe.errors import ConfigError, InputMismatchError, ShapeOutOfRangeError

__all__ = ["STEP_OPTIONS", "InputChecker", "InputKind", "InputSpec", "Requests", "Static", "Tokens",
           "input_specs"]

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

# Keyword arguments of GraphRunner.__call__; an input may not take one of these names.
STEP_OPTIONS = frozenset({"uniform_decode", "has_lora", "num_active_loras", "num_reqs",
                          "invalid_modes", "extras"})


def input_specs(inputs: Any) -> dict[str, InputSpec]:
    """``inputs`` checked (identifiers, not step options, at least one ``Tokens``) and named."""
    if not isinstance(inputs, Mapping) or not inputs:
        raise ConfigError("inputs: give a mapping of input name -> ff.runtime.Tokens(...) / "
                          "Requests(...) / Static(...), with at least one Tokens input")
    specs: dict[str, InputSpec] = {}
    for name, spec in inputs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"inputs: name {name!r} is not a Python identifier")
        if name in STEP_OPTIONS:
            raise ConfigError(f"inputs: name {name!r} is reserved for a step option "
                              f"({sorted(STEP_OPTIONS)}); rename the input")
        if not isinstance(spec, InputSpec):
            raise ConfigError(f"inputs[{name!r}]: expected ff.runtime.Tokens(...), "
                              f"Requests(...) or Static(...), got {spec!r}")
        specs[name] = spec.named(name)
    if not any(s.kind == "tokens" for s in specs.values()):
        raise ConfigError("inputs: at least one input must be Tokens(...): the runner reads "
                          "the step size from the token dimension")
    return specs




class InputChecker:
    """A runner's step inputs bound to their names and checked against their specs: the one
    place a step's token and request counts come from."""

    def __init__(self, specs: Mapping[str, InputSpec], device: torch.device, *,
                 max_num_tokens: int, max_num_seqs: int, query_len: int) -> None:
        self.specs = specs
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.query_len = query_len  # tokens per request of a uniform decode step

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        names = list(self.specs)
        if len(args) > len(names):
            raise InputMismatchError(
                f"step got {len(args)} positional inputs but the runner has {len(names)} "
                f"({names})")
        values = dict(zip(names, args, strict=False))
        for name, value in kwargs.items():
            if name not in self.specs:
                raise InputMismatchError(f"step got an unknown input {name!r}; the runner's "
                                         f"inputs are {names}")
            if name in values:
                raise InputMismatchError(f"input {name!r} given both by position and by name")
            values[name] = value
        missing = [n for n in names if n not in values]
        if missing:
            raise InputMismatchError(f"step is missing input(s) {missing}; the runner's inputs "
                                     f"are {names}")
        return values

    def validate(self, values: Mapping[str, Any], num_reqs: int | None,
                  uniform_decode: bool) -> tuple[int, int | None]:
        """Check every input against its spec; the step's token and request counts."""
        tokens: tuple[str, int] | None = None
        reqs: tuple[str, int] | None = None
        for name, spec in self.specs.items():
            n = self._check(name, spec, values[name])
            if n is None:
                continue
            seen, what = (tokens, "tokens") if spec.kind == "tokens" else (reqs, "requests")
            if seen is not None and seen[1] != n:
                raise InputMismatchError(
                    f"inputs {seen[0]!r} and {name!r} disagree on the number of {what}: "
                    f"{seen[1]} vs {n}")
            if spec.kind == "tokens":
                tokens = tokens or (name, n)
            else:
                reqs = reqs or (name, n)
        assert tokens is not None  # construction requires a Tokens input
        num_tokens = tokens[1]
        max_tokens = self.max_num_tokens
        if not 1 <= num_tokens <= max_tokens:
            raise ShapeOutOfRangeError(
                f"input {tokens[0]!r} has {num_tokens} tokens; a step needs 1..max_num_tokens="
                f"{max_tokens} tokens (split larger batches or raise max_num_tokens)")
        if reqs is not None and num_reqs is not None and num_reqs != reqs[1]:
            raise InputMismatchError(
                f"num_reqs={num_reqs} disagrees with input {reqs[0]!r}, which has {reqs[1]} rows")
        count = reqs[1] if reqs is not None else num_reqs
        if count is not None:
            self._check_requests(count, num_tokens, uniform_decode)
        return num_tokens, count

    def _check(self, name: str, spec: InputSpec, t: Any) -> int | None:
        """Refuse a value that does not fit its spec; its row count (None for a static one)."""
        if not isinstance(t, torch.Tensor):
            raise InputMismatchError(
                f"input {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != spec.dtype:
            raise InputMismatchError(
                f"input {name!r}: expected dtype {spec.dtype}, got {t.dtype}; convert it "
                f"(tensor.to({spec.dtype})) or declare the input with dtype={t.dtype}")
        if t.device != self.device:
            raise InputMismatchError(
                f"input {name!r}: expected device {self.device}, got {t.device}; move it "
                f"first (tensor.to({str(self.device)!r}))")
        if spec.kind == "static":
            if tuple(t.shape) != spec.shape:
                raise InputMismatchError(
                    f"input {name!r}: static input expected shape {list(spec.shape)}, got "
                    f"{list(t.shape)}")
            return None
        if t.dim() != 1 + len(spec.shape) or tuple(t.shape[1:]) != spec.shape:
            raise InputMismatchError(
                f"input {name!r}: expected shape [{spec.kind}, "
                f"{', '.join(map(str, spec.shape))}]".replace(", ]", "]")
                + f", got {list(t.shape)}; the trailing shape must be {list(spec.shape)}")
        return int(t.shape[0])

    def _check_requests(self, count: int, num_tokens: int, uniform_decode: bool) -> None:
        if not 0 <= count <= self.max_num_seqs:
            raise ShapeOutOfRangeError(
                f"step has {count} requests; at most max_num_seqs="
                f"{self.max_num_seqs} fit the request buffers")
        if count > num_tokens:
            raise InputMismatchError(
                f"step has {count} requests but only {num_tokens} tokens; every request "
                "needs at least one token")
        q = self.query_len
        if uniform_decode and count * q != num_tokens:
            raise InputMismatchError(
                f"uniform_decode=True needs num_tokens == num_reqs * {q}, got {num_tokens} "
                f"tokens for {count} requests")
