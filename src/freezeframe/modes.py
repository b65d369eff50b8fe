"""The compilation modes and CUDA-graph modes, and which of them go together.

:class:`CompilationMode` says how the forward is compiled (not at all, plain ``torch.compile``,
traced once and compiled whole, traced once and split at the splitting ops);
:class:`CUDAGraphMode` which graphs are captured (none, per piece, the whole forward, or one
for uniform-decode steps and another for the rest). Both parse vLLM's spellings. The config
(:mod:`freezeframe.config`) holds one of each, resolved; :func:`check_piecewise_compilation`
is the rule that PIECEWISE graphs need something to cut the forward at.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence

from freezeframe.errors import ConfigError

__all__ = ["CUDAGraphMode", "CompilationMode", "check_piecewise_compilation"]


class CompilationMode(enum.IntEnum):
    """How much of the compile pipeline runs.

    NONE: the module itself. STOCK_TORCH_COMPILE: plain ``torch.compile`` (guards, recompiles).
    DYNAMO_TRACE_ONCE: one Dynamo trace reused for every size, whole graph to the compiler.
    PIECEWISE: one trace, split at splitting ops, each piece compiled per range/size
    (vLLM calls this VLLM_COMPILE; that name is accepted).
    """

    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    PIECEWISE = 3

    @classmethod
    def parse(cls, value: CompilationMode | int | str | None) -> CompilationMode:
        """Ints 0-3, names in any case, vLLM's names; ``None`` (vLLM's "default") is PIECEWISE."""
        if isinstance(value, CompilationMode):
            return value
        if value is None:
            return cls.PIECEWISE
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        elif isinstance(value, str):
            name = value.strip().upper()
            if name in _MODE_ALIASES:
                return cls[_MODE_ALIASES[name]]
            if name.isdigit():
                return cls.parse(int(name))
            if name in cls.__members__:
                return cls[name]
        valid = ", ".join(f"{m.name} ({m.value})" for m in cls)
        raise ConfigError(
            f"mode: unknown compilation mode {value!r}; valid modes are {valid}, in any case "
            f"(aliases: {', '.join(sorted(_MODE_ALIASES))})")


# vLLM spellings of the modes: today's VLLM_COMPILE and the older CompilationLevel names.
_MODE_ALIASES = {
    "VLLM_COMPILE": "PIECEWISE",
    "NO_COMPILATION": "NONE",
    "DYNAMO_AS_IS": "STOCK_TORCH_COMPILE",
    "DYNAMO_ONCE": "DYNAMO_TRACE_ONCE",
}


class CUDAGraphMode(enum.Enum):
    """Which graphs to capture. A tuple value is a *separate routine*: its first element is the
    mode for uniform-decode batches, its second the mode for mixed batches."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    @classmethod
    def parse(cls, value: CUDAGraphMode | str | int | Sequence[int]) -> CUDAGraphMode:
        """A mode from its name (any case), its value, or any form vLLM prints one in: the
        value (``2``, or the pair ``[2, 1]`` / ``(2, 1)`` of a separate routine, as a JSON dump
        of vLLM's config writes it), ``"CUDAGraphMode.FULL"``, its repr
        ``"<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>"``, or such a value as text."""
        if isinstance(value, CUDAGraphMode):
            return value
        given = value
        if isinstance(value, str):
            name = value.strip().strip("<>").split(":")[0].strip().upper()
            name = name.removeprefix("CUDAGRAPHMODE.")
            if name in cls.__members__:
                return cls[name]
            pair = re.fullmatch(r"[\[(]?\s*(\d+)\s*(?:,\s*(\d+)\s*)?[\])]?", value.strip())
            if pair is not None:
                numbers = [int(g) for g in pair.groups() if g is not None]
                value = numbers[0] if len(numbers) == 1 else tuple(numbers)
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            for member in (cls.FULL_DECODE_ONLY, cls.FULL_AND_PIECEWISE):
                if member.value == tuple(value):
                    return member
        elif isinstance(value, int) and not isinstance(value, bool):
            for member in (cls.NONE, cls.PIECEWISE, cls.FULL):
                if member.value == value:
                    return member
        valid = ", ".join(m.name for m in cls)
        raise ConfigError(
            f"cudagraph_mode: unknown CUDA-graph mode {given!r}; valid modes are {valid} "
            "(any case), their values 0, 1, 2, [2, 0] and [2, 1], or vLLM's printed forms "
            "(\"CUDAGraphMode.FULL\", \"<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>\")"
        )

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        if mode.separate_routine():
            raise ValueError(f"has_mode takes a runtime mode, got {mode.name}")
        return mode in (self.decode_mode(), self.mixed_mode())

    def requires_piecewise_compilation(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def max_cudagraph_mode(self) -> CUDAGraphMode:
        if self.separate_routine():
            return CUDAGraphMode(max(self.value))
        return self

    def has_full_cudagraphs(self) -> bool:
        return self.max_cudagraph_mode() is CUDAGraphMode.FULL

    def has_piecewise_cudagraphs(self) -> bool:
        return self.requires_piecewise_compilation()

    @staticmethod
    def valid_runtime_modes() -> frozenset[CUDAGraphMode]:
        """The modes a step can run in (a forward context's mode); the others are config
        modes that the dispatcher resolves to one of these per step."""
        return frozenset({CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL})


def check_piecewise_compilation(graph_mode: CUDAGraphMode, mode: CompilationMode,
                                splitting_ops: Sequence[str] | None) -> None:
    """PIECEWISE graphs need something to cut the forward at. Under mode PIECEWISE that is
    the traced graph split at ``splitting_ops`` (so they must not be empty); under mode NONE
    and STOCK_TORCH_COMPILE it is a *breakable* capture, which breaks the running forward at
    the splitting ops and at ``@ff.graph_break`` functions (see freezeframe.graphs.breakable).
    DYNAMO_TRACE_ONCE compiles one whole graph: it has no PIECEWISE graphs. Raise for a
    ``cudagraph_mode`` with PIECEWISE graphs that ``mode`` cannot give."""
    if not graph_mode.requires_piecewise_compilation():
        return
    if mode in (CompilationMode.NONE, CompilationMode.STOCK_TORCH_COMPILE):
        return  # breakable capture
    if mode is not CompilationMode.PIECEWISE or (splitting_ops is not None
                                                 and len(splitting_ops) == 0):
        raise ConfigError(
            f"cudagraph_mode {graph_mode.name} captures piecewise graphs, which needs mode "
            f"PIECEWISE and a graph split at splitting_ops (or a breakable capture: mode NONE "
            f"or STOCK_TORCH_COMPILE), but mode is {mode.name} and "
            f"splitting_ops={splitting_ops!r}; set mode='piecewise' (and keep splitting_ops "
            "non-empty), mode='none' for graphs that break at the splitting ops without a "
            "trace, or choose cudagraph_mode FULL, FULL_DECODE_ONLY or NONE")
