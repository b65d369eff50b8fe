"""A trace's conditions on dynamic sizes: recorded while Dynamo traces, checked per call.

Dynamo records a condition for every Python decision ``forward`` makes on a symbolic size (``if
x.shape[0] > 4:``, an equality between two arguments' rows); trace-once drops Dynamo's guards,
so the conditions are kept as data (:class:`SizeConditions`, read inside the backend by
:func:`size_conditions_now`, or loaded with a saved trace) and evaluated per call instead
(:class:`SizeGuards`, which the router asks which trace serves a call's sizes).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SizeConditions", "SizeGuards", "is_size_equality", "size_conditions_now"]


@dataclasses.dataclass(frozen=True)
class SizeConditions:
    """The trace's conditions on dynamic sizes (Python branches on them): (sympy expression,
    where in the user's code), and which (argument, dim) each size symbol stands for."""

    conditions: tuple[tuple[Any, str], ...] = ()
    symbols: Mapping[Any, tuple[str, int]] = dataclasses.field(default_factory=dict)


_USER_LOC_RE = re.compile(r"^(?P<code>.*?)\s+#\s+(?P<file>\S+):(?P<line>\d+) in (?P<fn>\S+)$")


def is_size_equality(expr: Any) -> bool:
    """``Eq(s0, s1)``: two dynamic sizes the trace found equal (rows of two arguments)."""
    import sympy

    return (isinstance(expr, sympy.Eq) and isinstance(expr.lhs, sympy.Symbol)
            and isinstance(expr.rhs, sympy.Symbol))


def _from_user_branch(guard: Any) -> bool:
    """Whether Dynamo added ``guard`` while evaluating the user's own Python on a size (an
    ``if``, ``bool()``, ``assert`` on ``x.shape[0]``), as opposed to the 0/1 and contiguity
    assumptions torch's shape functions make, which trace-once deliberately ignores."""
    frame = getattr(getattr(guard, "sloc", None), "framework_loc", None)
    filename = getattr(frame, "filename", None) or (frame if isinstance(frame, str) else "")
    return f"_dynamo{os.sep}variables{os.sep}" in filename


def _user_location(text: str | None) -> str:
    """``file:line in fn (`code`)`` from Dynamo's ``code  # file:line in fn``."""
    if not text:
        return "an unknown line"
    match = _USER_LOC_RE.match(text.strip())
    if match is None:
        return text.strip()
    path = match["file"].lstrip(".").lstrip("/")
    return f"{os.path.basename(path)}:{match['line']} in {match['fn']} (`{match['code']}`)"


def size_conditions_now(dims: Mapping[str, Sequence[int]]) -> SizeConditions:
    """The shape guards on the dynamic dims (``dims``) of the trace Dynamo is making (read
    inside the backend, where the tracing context still holds the shape environment)."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    shape_env = getattr(getattr(ctx, "fake_mode", None), "shape_env", None)
    if shape_env is None:
        return SizeConditions()
    symbols: dict[Any, tuple[str, int]] = {}
    for sym, sources in getattr(shape_env, "var_to_sources", {}).items():
        for source in sources:
            base = getattr(source, "base", None)
            name = getattr(base, "local_name", None)
            idx = getattr(source, "idx", None)
            prop = getattr(getattr(source, "prop", None), "name", None)
            if isinstance(name, str) and name in dims and isinstance(idx, int) \
                    and prop == "SIZE":
                symbols[sym] = (name, idx)
                break
    conditions: list[tuple[Any, str]] = []
    for guard in getattr(shape_env, "guards", ()):
        free: set[Any] = getattr(guard.expr, "free_symbols", set())
        if free and free <= symbols.keys() and (is_size_equality(guard.expr)
                                                or _from_user_branch(guard)):
            sloc = getattr(guard, "sloc", None)
            conditions.append((guard.expr,
                               _user_location(getattr(sloc, "maybe_user_loc", None))))
    return SizeConditions(tuple(conditions), symbols)


class SizeGuards:
    """The conditions a trace placed on dynamic sizes, as a predicate over a call's sizes.

    Dynamo records a condition for every Python decision on a symbolic size (``if
    x.shape[0] > 4:``); trace-once drops them, so here they are evaluated per call instead
    (memoised per distinct sizes, so each batch size costs one evaluation).
    """

    def __init__(self, conditions: Sequence[tuple[Any, str]],
                 symbols: Mapping[Any, tuple[str, int]],
                 only_sizes: Mapping[tuple[str, int], int] | None = None) -> None:
        self.conditions = list(conditions)  # (sympy expression, where in the user's code)
        self._symbols = dict(symbols)
        self._only = dict(only_sizes or {})
        self._memo: dict[tuple[int, ...], bool] = {}
        self._keys = sorted({*self._symbols.values(), *self._only})

    @classmethod
    def of_trace(cls, conditions: Sequence[tuple[Any, str]],
                 symbols: Mapping[Any, tuple[str, int]],
                 traced_at: Mapping[tuple[str, int], int], inductor: bool) -> SizeGuards:
        """The guards of a trace made at sizes ``traced_at``. With Inductor, a trace made at
        size 1 serves size 1 only: Inductor specialises code on a size-1 dim even when Dynamo
        kept it symbolic, so another size traces again."""
        only = {where: 1 for where, n in traced_at.items() if n == 1} if inductor else {}
        return cls(conditions, symbols, only)

    @property
    def trivial(self) -> bool:
        return not self.conditions and not self._only

    def accepts(self, sizes: Mapping[tuple[str, int], int]) -> bool:
        if self.trivial:
            return True
        try:
            probe = tuple(sizes[k] for k in self._keys)
        except KeyError:
            return False
        hit = self._memo.get(probe)
        if hit is None:
            hit = self._evaluate(dict(zip(self._keys, probe, strict=True)))
            self._memo[probe] = hit
        return hit

    def _evaluate(self, sizes: Mapping[tuple[str, int], int]) -> bool:
        import sympy

        for key, size in self._only.items():
            if sizes[key] != size:
                return False
        subs = {sym: sympy.Integer(sizes[where]) for sym, where in self._symbols.items()}
        for expr, _ in self.conditions:
            value = expr.xreplace(subs)
            if value is not sympy.true and not bool(value):
                return False
        return True
