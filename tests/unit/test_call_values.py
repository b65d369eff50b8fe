"""Plain Python arguments a trace specialises on: every value that gives another result in eager
is another structure (its own trace), and a value seen before reuses its trace."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.compilation.signature import ObjectSpec, Signer, ValueSpec
from freezeframe.errors import CompileError


def config() -> ff.CompilationConfig:
    return ff.CompilationConfig(mode="piecewise", backend="eager", cudagraph_mode="none",
                                use_cache=False)


class Times(nn.Module):
    def forward(self, x: torch.Tensor, k: Any) -> torch.Tensor:
        return x * k


class Divide(nn.Module):
    def forward(self, x: torch.Tensor, k: float) -> torch.Tensor:
        return x / k


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


def test_int_float_and_bool_of_equal_value_are_three_structures() -> None:
    """``x * 1`` keeps an int tensor's dtype, ``x * 1.0`` makes it float."""
    model, eager = ff.compile(Times(), config()), Times()
    x = torch.arange(6).reshape(3, 2)
    for k in (1, 1.0, True, 1, 1.0):
        assert _same(model(x, k), eager(x, k)), k
    assert model.num_traces == 3


def test_negative_zero_is_not_zero() -> None:
    model, eager = ff.compile(Divide(), config()), Divide()
    x = torch.ones(3, 2)
    for k in (0.0, -0.0, 0.0):
        assert torch.equal(model(x, k), eager(x, k)), k
    assert model.num_traces == 2


def test_nan_reuses_its_trace() -> None:
    """``nan != nan``: without a canonical key every call with a NaN would trace again."""
    model = ff.compile(Times(), config())
    x = torch.ones(3, 2)
    for _ in range(MAX := 12):
        out = model(x, float("nan"))
    assert torch.isnan(out).all() and MAX == 12
    assert (model.num_traces, model.stats.retraces) == (1, 0)


class Act(enum.Enum):
    RELU = "relu"
    TANH = "tanh"


class ByEnum(nn.Module):
    def forward(self, x: torch.Tensor, act: Act) -> torch.Tensor:
        return torch.relu(x) if act is Act.RELU else torch.tanh(x)


class ByFunction(nn.Module):
    def forward(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
        return fn(x) + 1


class ByRows(nn.Module):
    def forward(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        return x[:, rows] * 2


class Settings:
    """A plain (non-dataclass) object whose attribute forward reads."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


class BySettings(nn.Module):
    def forward(self, x: torch.Tensor, settings: Settings) -> torch.Tensor:
        return x * settings.scale


@dataclasses.dataclass
class Frozen:
    scale: float


class ByDataclass(nn.Module):
    def forward(self, x: torch.Tensor, settings: Frozen) -> torch.Tensor:
        return x * settings.scale


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


CASES: dict[str, tuple[type[nn.Module], list[Any], int]] = {
    # (module, the argument of successive calls, traces expected)
    "enum": (ByEnum, [Act.RELU, Act.TANH, Act.RELU], 2),
    "function": (ByFunction, [torch.sin, torch.cos, _double, torch.sin], 3),
    "slice": (ByRows, [slice(0, 2), slice(1, 4), slice(None, None, 2), slice(0, 2)], 3),
    "plain object": (BySettings, [Settings(2.0), Settings(5.0), Settings(2.0)], 2),
    "dataclass": (ByDataclass, [Frozen(2.0), Frozen(5.0), Frozen(2.0)], 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_another_value_of_a_non_primitive_argument_is_another_structure(case: str) -> None:
    """These used to be compared by type only: the second value was served by the first
    value's trace (relu for tanh, sin for cos, rows 0:2 for 1:4, scale 2 for 5)."""
    module, values, traces = CASES[case]
    model, eager = ff.compile(module(), config()), module()
    x = torch.randn(3, 4)
    for value in values:
        assert torch.equal(model(x, value), eager(x, value)), (case, value)
    assert model.num_traces == traces


def test_a_new_function_every_call_ends_in_a_clear_error() -> None:
    model = ff.compile(ByFunction(), config())
    x = torch.randn(3, 4)
    with pytest.raises(CompileError, match=r"trace number 9.*fn=the function "
                                           r".*<lambda> at 0x.*pass the same function or "
                                           r"object each call"):
        for i in range(9):
            model(x, lambda t, i=i: t * i)
    assert model.num_traces == 8


def test_identity_keys_hold_their_object() -> None:
    """A key holds the object it compares by identity, so its id is never reused while the
    key lives (a freed object's id given to a new one would match a stale trace)."""
    signer = Signer(ByFunction().forward, {"x": (0,)}, grad_matters=False)
    fn = lambda t: t  # noqa: E731
    key = signer.key((torch.ones(2, 2), fn), {})
    spec = signer.signature((torch.ones(2, 2), fn), {}).arg("fn")
    assert isinstance(spec, ObjectSpec) and spec.ref.obj is fn
    del fn
    assert key[1].obj(3) == 3  # still alive through the key


def test_value_specs_compare_by_type_and_canonical_value() -> None:
    assert ValueSpec(1) != ValueSpec(1.0) != ValueSpec(True)
    assert ValueSpec(0.0) != ValueSpec(-0.0)
    assert ValueSpec(float("nan")) == ValueSpec(float("nan"))
    assert ValueSpec(Act.RELU) == ValueSpec(Act.RELU) != ValueSpec(Act.TANH)


class Slotted:
    __slots__ = ("scale",)

    def __init__(self, scale: float) -> None:
        self.scale = scale


class BySlotted(nn.Module):
    def forward(self, x: torch.Tensor, settings: Slotted) -> torch.Tensor:
        return x * settings.scale


@dataclasses.dataclass
class WithSet:
    scale: float
    tags: set[str]


class ByTags(nn.Module):
    def forward(self, x: torch.Tensor, settings: WithSet) -> torch.Tensor:
        return x * (settings.scale + len(settings.tags) + (10 if "b" in settings.tags else 0))


class Scaler:
    def __init__(self, k: float) -> None:
        self.k = k

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.k


def _scale(t: torch.Tensor, k: float) -> torch.Tensor:
    return t * k


class ByLongList(nn.Module):
    def forward(self, x: torch.Tensor, ids: list[int]) -> torch.Tensor:
        return x * ids[-1]


RETRACE_FREE: dict[str, tuple[type[nn.Module], list[Callable[[], Any]], int]] = {
    # (module, fresh equal-or-not argument per call, traces expected): a fresh object equal to
    # an earlier one reuses its trace; they used to be compared by identity and retraced on
    # every call until the limit
    "numpy scalar": (Times, [lambda: np.float32(2.0), lambda: np.float32(2.0),
                             lambda: np.float64(2.0), lambda: np.float32(3.0),
                             lambda: np.float32("nan"), lambda: np.float32("nan")], 4),
    "bound method": (ByFunction, [lambda: Scaler(2.0).apply, lambda: Scaler(2.0).apply,
                                  lambda: Scaler(3.0).apply], 2),
    "partial": (ByFunction, [lambda: functools.partial(_scale, k=2.0),
                             lambda: functools.partial(_scale, k=2.0),
                             lambda: functools.partial(_scale, k=3.0)], 2),
    "slots object": (BySlotted, [lambda: Slotted(2.0), lambda: Slotted(2.0),
                                 lambda: Slotted(3.0)], 2),
    "dataclass with a set": (ByTags, [lambda: WithSet(1.0, {"a", "b"}),
                                      lambda: WithSet(1.0, {"a", "b"}),
                                      lambda: WithSet(1.0, {"a", "c"})], 2),
    "long list": (ByLongList, [lambda: list(range(1000)), lambda: list(range(1000)),
                               lambda: [*range(999), 5]], 2),
}


@pytest.mark.parametrize("case", list(RETRACE_FREE))
def test_fresh_equal_arguments_reuse_their_trace(case: str) -> None:
    module, makers, traces = RETRACE_FREE[case]
    model, eager = ff.compile(module(), config()), module()
    x = torch.randn(3, 4)
    for make in makers:
        value = make()
        assert torch.allclose(model(x, value), eager(x, value), equal_nan=True), (case, value)
    assert model.num_traces == traces


def test_a_partial_with_other_arguments_is_another_structure() -> None:
    """A partial has no attributes of its own: compared as an object with an empty __dict__,
    every partial of one function shared the first one's trace (k=2 served k=3)."""
    model, eager = ff.compile(ByFunction(), config()), ByFunction()
    x = torch.ones(3, 4)
    for k in (2.0, 3.0):
        fn = functools.partial(_scale, k=k)
        assert torch.equal(model(x, fn), eager(x, fn)), k
    assert model.num_traces == 2


class ByNested(nn.Module):
    def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return x + extra["bias"]


def test_a_nested_tensor_that_follows_the_batch_is_named_in_the_error() -> None:
    """Only top-level tensors have dynamic dims: a tensor in a dict whose dim 0 follows the
    batch fixes the batch dim. The error named a pinned size and a `==` test the user never
    wrote; it names the nested tensor and the fix."""
    model = ff.compile(ByNested(), config())
    with pytest.raises(CompileError, match=r"pins a dynamic size to 3 .*that is a size of "
                                           r"extra\['bias'\] \(shape \(3, 2\)\), a tensor inside "
                                           r"a list, tuple or dict argument.*Pass that tensor as "
                                           r"an argument of forward of its own"):
        model(torch.ones(3, 2), {"bias": torch.ones(3, 2)})
    bias = torch.arange(2.0)  # a nested tensor of fixed size is fine
    for n in (3, 5):
        x = torch.ones(n, 2)
        assert torch.equal(model(x, {"bias": bias}), ByNested()(x, {"bias": bias}))
    assert model.num_traces == 1


class Iterates(nn.Module):
    def forward(self, x: torch.Tensor, items: Any) -> torch.Tensor:
        acc = x
        for v in items:
            acc = acc * 2 + v  # order matters
        return acc


@dataclasses.dataclass
class Derived:
    base: float

    def __post_init__(self) -> None:
        self.scale = self.base * 2  # an attribute that is not a field


class ByDerived(nn.Module):
    def forward(self, x: torch.Tensor, settings: Derived) -> torch.Tensor:
        return x * settings.scale


class ByKeyedTable(nn.Module):
    def forward(self, x: torch.Tensor, table: dict[tuple[int, int], float]) -> torch.Tensor:
        return x * table[(1, 2)]


def test_value_rules_that_gave_wrong_answers_or_retraced() -> None:
    """Sets go by iteration order (what forward sees); a dataclass by every attribute, not
    only its fields; a dict's tuple keys by value; a numpy float's sign of zero counts."""
    x = torch.ones(2, 2)
    a, b = {1, 9}, {9, 1}
    model = ff.compile(Iterates(), config())
    for items in (a, b, [1, 9], [9, 1]):
        assert torch.equal(model(x, items), Iterates()(x, items)), items
    changed = Derived(1.0)
    changed.scale = 7.0
    model = ff.compile(ByDerived(), config())
    for settings in (Derived(1.0), changed):
        assert torch.equal(model(x, settings), ByDerived()(x, settings))
    model = ff.compile(ByKeyedTable(), config())
    for _ in range(10):  # a fresh dict with fresh tuple keys each call: one trace
        assert torch.equal(model(x, {(1, 2): 3.0}), x * 3)
    assert model.num_traces == 1
    model = ff.compile(Divide(), config())
    for k in (np.float64(0.0), np.float64(-0.0)):
        assert torch.equal(model(x, k), Divide()(x, k)), k  # inf, then -inf
    assert model.num_traces == 2


class ReadsProperty:
    def __init__(self) -> None:
        self.scale = 2.0

    @property
    def broken(self) -> float:
        raise RuntimeError("not available")


def test_an_object_whose_attributes_raise_is_compared_by_identity() -> None:
    obj = ReadsProperty()
    obj.__dict__["broken"] = 1.0  # a property shadowing an instance attribute raises on read
    model = ff.compile(BySettings(), config())
    x = torch.ones(2, 2)
    assert torch.equal(model(x, obj), x * 2)  # type: ignore[arg-type]
    assert torch.equal(model(x, obj), x * 2)  # type: ignore[arg-type]
    assert model.num_traces == 1


class Pair(nn.Module):
    def forward(self, x: torch.Tensor, pair: list[torch.Tensor]) -> torch.Tensor:
        pair[0].add_(1)
        return x + pair[1]


def test_tensors_shared_inside_a_list_are_another_structure() -> None:
    """Aliasing among nested tensors is part of the key, as among top-level ones: a trace of
    ``[a, a]`` (the write shows through the second) served ``[c, d]`` with 20 for 10."""
    model = ff.compile(Pair(), config())
    for aliased in (True, False, True):
        a, b = torch.ones(2), torch.ones(2)
        e, f = torch.ones(2), torch.ones(2)
        got = model(torch.zeros(2, 2), [a, a] if aliased else [a, b])
        want = Pair()(torch.zeros(2, 2), [e, e] if aliased else [e, f])
        assert torch.equal(got, want), aliased
    assert model.num_traces == 2
