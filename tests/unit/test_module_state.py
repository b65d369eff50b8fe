"""The module's Python state after the first call (train/eval, hooks, plain attributes): a change
is refused with a clear error, never answered from the stale trace."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import CompilationConfig, CompileError
from freezeframe.compilation.module_state import ModuleState
from tests.helpers.global_hooks import refused_under_a_global_hook


def _config(**kw: Any) -> CompilationConfig:
    fields: dict[str, Any] = dict(mode="piecewise", backend="eager", cudagraph_mode="none",
                                  use_cache=False)
    fields.update(kw)
    return CompilationConfig(**fields)


class Scaled(nn.Module):
    """Reads every kind of state a trace bakes in: BatchNorm (train/eval), a plain float
    attribute, a list attribute, and whatever hooks are registered."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.scale = 2.0
        self.offsets = [1.0, 0.0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale_of(self.bn(self.lin(x))) + self.offsets[0]

    def scale_of(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


def _pair() -> tuple[Scaled, Scaled]:
    mine, theirs = Scaled().eval(), Scaled().eval()
    theirs.load_state_dict(mine.state_dict())
    return mine, theirs


def _set_scale(m: Scaled) -> None:
    m.scale = 5.0


def _set_offset(m: Scaled) -> None:
    m.offsets[0] = 3.0  # in place: the list is compared item by item


def _set_negative_zero(m: Scaled) -> None:
    m.scale = -0.0


def _hook_root(m: Scaled) -> None:
    m.register_forward_hook(lambda mod, i, o: o * 10)


def _hook_sub(m: Scaled) -> None:
    m.lin.register_forward_hook(lambda mod, i, o: o + 100)


def _train_sub(m: Scaled) -> None:
    m.bn.train()


def _new_attr(m: Scaled) -> None:
    m.scale_of = lambda x: x  # type: ignore[attr-defined]  # hides the class's method


def _replace_sub(m: Scaled) -> None:
    m.lin = nn.Linear(4, 4)


CHANGES: dict[str, tuple[Callable[[Scaled], None], str]] = {
    "train": (lambda m: m.train(), r"model\.training was False at the trace and is True"),
    "scale": (_set_scale, r"model\.scale was 2\.0 at the trace and is 5\.0 now"),
    "negative zero": (_set_negative_zero, r"model\.scale was 2\.0 at the trace and is -0\.0"),
    "list item": (_set_offset,
                  r"model\.offsets was \[1\.0, 0\.0\] at the trace and is \[3\.0, 0\.0\] now"),
    "root hook": (_hook_root, r"model had 0 forward hook\(s\) at the trace and has 1"),
    "submodule hook": (_hook_sub, r"model\.lin had 0 forward hook"),
    "submodule train": (_train_sub, r"model\.bn\.training was False"),
    "new attribute": (_new_attr, r"model\.scale_of was set after the trace"),
    "submodule replaced": (_replace_sub, r"a submodule was added, removed or replaced"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_the_trace_is_refused_with_debug(change: str) -> None:
    """With ``debug=True`` every call compares the whole state."""
    mine, theirs = _pair()
    model = ff.compile(mine, _config(debug=True))
    x = torch.randn(3, 4)
    assert torch.equal(model(x), theirs(x).detach())
    apply, message = CHANGES[change]
    apply(mine)
    with pytest.raises(CompileError, match=message):
        model(x)
    assert model.num_traces == 1


@pytest.mark.parametrize("change", ["train", "root hook"])
def test_root_mode_and_hooks_are_checked_on_every_call(change: str) -> None:
    """The every-call tier: the root's train/eval flag; a hook on the root is caught at the
    next new route (here the same call: it must still not be served stale)."""
    mine, _ = _pair()
    model = ff.compile(mine, _config())
    x = torch.randn(3, 4)
    model(x)
    apply, message = CHANGES[change]
    apply(mine)
    if change == "train":
        with pytest.raises(CompileError, match=message):
            model(x)
    with pytest.raises(CompileError, match=message):
        model(torch.randn(4, 3).t())  # a strided input: a new route


def test_a_global_module_hook_is_caught_on_every_call() -> None:
    mine, _ = _pair()
    model = ff.compile(mine, _config())
    x = torch.randn(3, 4)
    model(x)
    refused_under_a_global_hook(model, x)
    model(x)  # removed again: the state is as traced


def test_a_root_attribute_set_or_hook_added_is_caught_at_the_next_call() -> None:
    """The every-call tier follows which object each root attribute holds and the root's
    hooks: ``model.scale = 5.0`` or ``model._steps = 1`` on a routed structure is refused at
    once, not at the next new route."""
    for change, message in [(_set_scale, r"model\.scale was 2\.0 at the trace and is 5\.0"),
                            (lambda m: setattr(m, "offsets", [7.0]), r"model\.offsets was "),
                            (_hook_root, r"model had 0 forward hook\(s\)")]:
        mine, _ = _pair()
        model = ff.compile(mine, _config())
        model(torch.randn(3, 4))
        change(mine)
        with pytest.raises(CompileError, match=message):
            model(torch.randn(3, 4))


@pytest.mark.parametrize("debug", [False, True])
def test_attributes_forward_never_reads_may_change(debug: bool) -> None:
    """Found by the matrix: setting an attribute forward never reads (a step counter kept on
    the module, a note) refused every later call. Only what the trace read counts: an
    attribute set, added or deleted that it never read is served; one added over a name of
    the class (hiding its method) is not."""
    mine, theirs = _pair()
    mine.note = "first"  # type: ignore[attr-defined]
    mine.lin.calls = 0  # type: ignore[attr-defined]
    model = ff.compile(mine, _config(debug=debug))
    x = torch.randn(3, 4)
    assert torch.equal(model(x), theirs(x).detach())
    for step in range(3):
        mine.note = f"step {step}"  # type: ignore[attr-defined]
        mine.lin.calls += 1  # type: ignore[operator]
        mine.added = step  # type: ignore[attr-defined]
        assert torch.equal(model(x), theirs(x).detach())
    del mine.note
    assert torch.equal(model(x), theirs(x).detach())
    assert model.stats.retraces == 0
    _new_attr(mine)
    with pytest.raises(CompileError, match=r"model\.scale_of was set after the trace"):
        model(x)


def test_a_root_attribute_set_to_an_equal_value_is_served() -> None:
    mine, theirs = _pair()
    model = ff.compile(mine, _config())
    model(torch.randn(3, 4))
    mine.scale = float("2.0")  # another object, the same value
    mine.offsets = [1.0, 0.0]
    x = torch.randn(3, 4)
    assert torch.equal(model(x), theirs(x).detach())
    assert model.stats.retraces == 0


def test_a_submodule_attribute_set_is_refused_on_the_next_call() -> None:
    """Every call compares which object each submodule attribute holds, so a call of a
    routed structure is refused as well."""
    mine, _ = _pair()
    model = ff.compile(mine, _config())
    model(torch.randn(3, 4))
    model(torch.randn(3, 4))
    mine.bn.momentum = 0.5
    with pytest.raises(CompileError, match=r"model\.bn\.momentum was 0\.1 at the trace and "
                                           r"is 0\.5 now"):
        model(torch.randn(3, 4))


def test_an_object_changed_in_place_is_caught_at_the_next_new_route() -> None:
    """Without debug, an attribute's object changed in place (a list item, a config field)
    is compared when a call needs a new route; a call of a routed structure is served
    without that scan (documented)."""
    mine, _ = _pair()
    model = ff.compile(mine, _config())
    model(torch.randn(3, 4))
    mine.offsets[0] = 3.0
    model(torch.randn(3, 4))  # routed: served without the scan
    with pytest.raises(CompileError, match=r"model\.offsets was \[1\.0, 0\.0\] at the trace "
                                           r"and is \[3\.0, 0\.0\] now"):
        model(torch.randn(4, 3).t())


def test_changes_made_before_the_first_call_and_parameter_updates_are_fine() -> None:
    mine, theirs = _pair()
    model = ff.compile(mine, _config(debug=True))
    for m in (mine, theirs):
        m.scale = 3.0
        m.lin.register_forward_hook(lambda mod, i, o: o + 1)
    x = torch.randn(5, 4)
    assert torch.equal(model(x), theirs(x).detach())
    with torch.no_grad():
        for m in (mine, theirs):
            m.lin.weight.mul_(2)  # parameters are inputs of the trace, not baked in
            m.bn.running_mean.add_(1)
    assert torch.equal(model(x), theirs(x).detach())
    assert model.stats.retraces == 0


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.calls


def test_a_forward_that_changes_its_own_attributes_is_refused() -> None:
    """Eager returns x*1, x*2, ...; a trace would return the first call's x*1 forever."""
    model = ff.compile(Counter(), _config())
    with pytest.raises(CompileError, match=r"forward changes the module's own Python state "
                                           r"while it runs \(model\.calls was 0 at the trace"):
        model(torch.ones(2, 2))


def test_a_lazy_module_initialised_by_the_first_call_is_fine() -> None:
    torch.manual_seed(0)
    lazy = nn.Sequential(nn.LazyLinear(3))
    model = ff.compile(lazy, _config(debug=True), dynamic_arg_dims={"input": 0})
    x = torch.randn(4, 5)
    out = model(x)
    assert torch.equal(out, lazy(x).detach())
    assert torch.equal(model(x[:2]), lazy(x[:2]).detach())


def test_snapshot_tokens_compare_values_and_identities() -> None:
    m = Scaled()
    m.cfg = object()  # type: ignore[attr-defined]
    m.nan = float("nan")  # type: ignore[attr-defined]
    state = ModuleState(m)
    assert state.difference() is None  # NaN equals NaN, the object equals itself
    m.nan = float("nan")  # type: ignore[attr-defined]
    assert state.difference() is None
    m.cfg = object()  # type: ignore[attr-defined]
    assert state.difference() is not None and state.difference().startswith(
        "model.cfg was an object of type object at 0x")
    m.scale = 2  # same value, another type
    m.cfg = state._subs[0].attrs["cfg"].obj  # type: ignore[attr-defined]
    assert state.difference() == "model.scale was 2.0 at the trace and is 2 now"


class KeepsLast(nn.Module):
    """Stores its last output for inspection: the store is replayed with each call's tensor,
    so this is not a change the trace baked in."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.last = y * 2
        return y


def test_a_forward_that_stores_a_tensor_attribute_is_fine() -> None:
    mine = KeepsLast()
    model = ff.compile(mine, _config(debug=True))
    for n in (3, 5, 2):
        x = torch.randn(n, 4)
        out = model(x)
        assert torch.equal(out, mine.lin(x).detach())
        assert mine.last is not None and torch.equal(mine.last, out * 2)


@dataclasses.dataclass
class Eps:
    eps: float = 1.0


class WithConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = Eps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cfg.eps


def test_a_config_object_changed_in_place_is_caught_by_the_full_tier() -> None:
    """Compared field by field, not by identity: the same object with another eps would
    have been served by the trace that baked eps=1.0 in."""
    mine = WithConfig()
    model = ff.compile(mine, _config(debug=True))
    x = torch.randn(3, 4)
    assert torch.equal(model(x), x)
    mine.cfg.eps = 3.0
    with pytest.raises(CompileError, match=r"model\.cfg was Eps\(eps=1\.0\) at the trace and is "
                                           r"Eps\(eps=3\.0\) now"):
        model(x)


class PrivateCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._calls += 1
        return x * self._calls


def test_a_private_attribute_counts_as_state() -> None:
    """Attributes whose names start with ``_`` were never compared: the trace replayed
    ``x * 1`` for every later call."""
    model = ff.compile(PrivateCounter(), _config())
    with pytest.raises(CompileError, match=r"forward changes the module's own Python state "
                                           r"while it runs \(model\._calls was 0 at the trace"):
        model(torch.ones(2, 2))


class LazyTable(nn.Module):
    """Builds a tensor attribute at its first call (a common cache pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.table: torch.Tensor | None = None
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.arange(4.0)
        return self.lin(x) + self.table


def test_forward_that_sets_a_tensor_attribute_once_and_weight_norm_hooks_are_fine() -> None:
    """A tensor attribute is a trace input (compared by dtype, device and rank), so neither a
    lazily built table nor the pre-hook of the old ``weight_norm``, which sets
    ``module.weight`` before every call, is a change the trace baked in."""
    torch.manual_seed(0)
    lazy = LazyTable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        normed = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 4)))
    for module, dims in ((lazy, None), (normed, {"input": 0})):
        model = ff.compile(module, _config(debug=True), dynamic_arg_dims=dims)
        for n in (3, 3, 5):
            x = torch.randn(n, 4)
            assert torch.equal(model(x), module(x).detach())
        assert model.stats.retraces == 0


def test_hooks_on_the_compiled_module_itself_are_refused_and_a_later_one_is_caught() -> None:
    """A trace of forward skips the root's own hooks, so a hook registered there before the
    first call would never run: refused, with where to register it instead. A submodule's
    hook swapped for another (same count) after the trace is caught at the next call."""
    mine, _ = _pair()
    handle = mine.register_forward_hook(lambda mod, i, o: o * 10)
    model = ff.compile(mine, _config())
    with pytest.raises(CompileError, match=r"has forward hook\(s\) registered on itself.*"
                                           r"register_forward_hook"):
        model(torch.randn(3, 4))
    handle.remove()
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), mine(x), rtol=0, atol=0)
    mine, _ = _pair()
    handle = mine.lin.register_forward_hook(lambda mod, i, o: o * 10)
    model = ff.compile(mine, _config())
    torch.testing.assert_close(model(x), mine(x), rtol=0, atol=0)
    handle.remove()
    mine.lin.register_forward_hook(lambda mod, i, o: o * 100)
    with pytest.raises(CompileError, match=r"lin had 1 forward hook\(s\) at the trace and has "
                                           r"1 different one\(s\) now"):
        model(x)


def test_a_replaced_root_submodule_is_caught_at_the_next_call() -> None:
    mine, _ = _pair()
    model = ff.compile(mine, _config())
    model(torch.randn(3, 4))
    mine.lin = nn.Linear(4, 4)
    with pytest.raises(CompileError, match=r"a submodule was added, removed or replaced"):
        model(torch.randn(3, 4))


def test_a_global_hook_of_the_trace_removed_is_caught() -> None:
    """The every-call tier counts hooks: one removed lowers the count, one added moves torch's
    hook-handle counter, so a removal followed by another registration is seen too."""
    handle = nn.modules.module.register_module_forward_hook(lambda mod, i, o: o)
    try:
        mine, _ = _pair()
        model = ff.compile(mine, _config())
        x = torch.randn(3, 4)
        model(x)
        model(x)
    finally:
        handle.remove()
    with pytest.raises(CompileError, match="global module hooks"):
        model(x)
    refused_under_a_global_hook(model, x)  # and with another registered


@pytest.mark.parametrize("modes", ["all train", "mixed"])
def test_a_flag_switched_among_submodules_of_either_mode_is_caught(modes: str) -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.b(self.a(x)))

    module = Two().train()
    if modes == "mixed":
        module.a.eval()
    model = ff.compile(module, _config())
    x = torch.randn(3, 4)
    for _ in range(3):
        torch.testing.assert_close(model(x), module(x))
    module.b.train(False)
    with pytest.raises(CompileError, match=r"model\.b\.training was True at the trace"):
        model(x)
    module.b.train(True)
    torch.testing.assert_close(model(x), module(x))


def test_a_submodule_hook_stored_after_the_counter_was_refreshed_is_caught() -> None:
    """A call that sees the counter moved refreshes it; a hook another thread stores after
    that (torch makes the handle first) is seen in the submodule's hook dict."""
    mine, _ = _pair()
    model = ff.compile(mine, _config())
    x = torch.randn(3, 4)
    model(x)
    model(x)
    handle = torch.utils.hooks.RemovableHandle(mine.lin._forward_hooks)  # counter moved
    model(x)  # nothing stored yet: the full tier finds nothing and refreshes
    mine.lin._forward_hooks[handle.id] = lambda mod, i, o: o + 100
    with pytest.raises(CompileError, match=r"model\.lin had 0 forward hook"):
        model(x)
    handle.remove()
    model(x)


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
                                     nn.Sequential(nn.Linear(4, 4), nn.Tanh())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _replace_deep(m: Deep) -> None:
    m.blocks[1][1] = nn.Sigmoid()


def _delete_deep(m: Deep) -> None:
    del m.blocks[1]  # (ModuleList puts a new _modules dict in place)


def _wrap_sub_forward(m: Deep) -> None:
    inner = m.blocks[0].forward
    m.blocks[0].forward = lambda x: inner(x) * 0


@pytest.mark.parametrize("change", [_replace_deep, _delete_deep, _wrap_sub_forward])
def test_a_change_deep_inside_is_refused_on_a_routed_call(change: Callable[[Deep], None]
                                                          ) -> None:
    """A submodule replaced or deleted at any depth, or forward set on a submodule, would
    leave a routed call on the stale trace: the every-call tier counts each submodule's
    attributes and compares each parent's children."""
    module = Deep().eval()
    model = ff.compile(module, _config())
    x = torch.randn(3, 4)
    for _ in range(5):
        torch.testing.assert_close(model(x), module(x), rtol=0, atol=0)
    change(module)
    with pytest.raises(CompileError, match=r"replaced after the trace|forward was set"):
        model(x)


def test_the_every_call_check_is_generated_once_per_layout() -> None:
    """The every-call tier is one generated function: a hook registered elsewhere (which moves
    torch's hook-handle counter) or an attribute set to an equal new object only updates the
    values it compares with; an attribute torch keeps itself, added to a submodule, changes
    its layout and generates it anew. Either way the next call passes it, and the model's
    per-call check is the state's current one."""
    mine, theirs = _pair()
    model = ff.compile(mine, _config())
    x = torch.randn(3, 4)
    model(x)
    model(x)
    state = model._state
    assert state is not None
    full: list[int] = []
    difference = state.difference
    state.difference = lambda *a: full.append(1) or difference(*a)  # type: ignore[method-assign]
    check = state.check
    assert model._check is check
    check()
    assert full == []
    assert "sub0['training'] is not flag0" in state.source
    elsewhere = torch.ones(1, requires_grad=True).register_hook(lambda g: g)
    check()  # the counter moved: the full tier runs, finds nothing and refreshes
    assert full == [1]
    assert torch.equal(model(x), theirs(x).detach())
    assert state.check is check and model._check is check and full == [1]
    elsewhere.remove()
    mine.scale = float("2.0")  # another object, the same value
    assert torch.equal(model(x), theirs(x).detach())
    assert full == [1, 1]
    assert state.check is check
    check()
    assert full == [1, 1]
    mine.lin.__orig_class__ = nn.Linear  # type: ignore[attr-defined]  # (as typing sets it)
    assert torch.equal(model(x), theirs(x).detach())
    assert full == [1, 1, 1]
    assert state.check is not check and model._check is state.check
    state.check()
    assert full == [1, 1, 1]


def test_a_root_dict_replaced_is_still_read() -> None:
    mine, _ = _pair()
    model = ff.compile(mine, _config())
    x = torch.randn(3, 4)
    model(x)
    model(x)
    mine.__dict__ = dict(mine.__dict__)  # same contents, another dict
    model(x)
    mine.scale = 3.0
    with pytest.raises(CompileError, match=r"model\.scale was 2\.0 at the trace and is 3\.0"):
        model(x)


def test_the_global_hook_dicts_replaced_are_seen() -> None:
    from torch.nn.modules import module as torch_module
    saved = torch_module._global_forward_hooks
    handle = torch_module.register_module_forward_hook(
        lambda mod, i, o: o * 2 if isinstance(mod, nn.Linear) else None)
    try:
        torch_module._global_forward_hooks = type(saved)()  # the hooks off
        mine, _ = _pair()
        model = ff.compile(mine, _config())
        x = torch.randn(3, 4)
        model(x)
        model(x)
        torch_module._global_forward_hooks = saved  # on again; no handle was made
        with pytest.raises(CompileError, match="global module hooks"):
            model(x)
    finally:
        torch_module._global_forward_hooks = saved
        handle.remove()


def test_a_training_flag_that_is_no_bool_is_compared_by_identity() -> None:
    mine, theirs = _pair()
    mine.lin.training = 0  # type: ignore[assignment]
    model = ff.compile(mine, _config())
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SyntaxWarning)
        for _ in range(3):
            assert torch.equal(model(x), theirs(x).detach())
    state = model._state
    assert state is not None
    full: list[int] = []
    state.difference = lambda *a: full.append(1)  # type: ignore[method-assign,assignment]
    state.check()
    assert full == []  # the cheap tier compares the flag by identity and sees no change


class Adaptable(nn.Module):
    """A submodule without children that uses an adapter once one has been added."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter = self._modules.get("adapter")
        y = x @ self.weight
        return y if adapter is None else y + adapter(x)


class WithAdaptable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Adaptable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_a_child_added_to_a_submodule_without_children_is_refused() -> None:
    mine = WithAdaptable()
    model = ff.compile(mine, _config())
    x = torch.randn(3, 4)
    model(x)
    model(x)
    mine.block.adapter = nn.Linear(4, 4)  # eager now adds it; the trace has no adapter
    with pytest.raises(CompileError, match="submodule was added, removed or replaced"):
        model(x)


class OddlyNamed(nn.Module):
    """A root attribute whose name is no Python identifier (set through setattr)."""

    def __init__(self) -> None:
        super().__init__()
        setattr(self, "scale factor", 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * getattr(self, "scale factor")


def test_an_attribute_named_like_no_identifier_is_checked_on_every_call() -> None:
    mine = OddlyNamed()
    model = ff.compile(mine, _config())
    x = torch.randn(3, 4)
    assert torch.equal(model(x), x * 2.0)
    assert torch.equal(model(x), x * 2.0)
    setattr(mine, "scale factor", 3.0)
    with pytest.raises(CompileError, match=r"model\.scale factor was 2\.0 at the trace and is "
                                           r"3\.0 now"):
        model(x)


def test_a_parametrization_registered_after_the_trace_is_refused() -> None:
    """torch.nn.utils.parametrize moves the weight into a child module of the layer (which had
    no children): refused with the change named, where a raw KeyError 'weight' came out of
    the parameter read before."""
    from torch.nn.utils import parametrizations

    mine, _ = _pair()
    model = ff.compile(mine, _config())
    x = torch.randn(3, 4)
    model(x)
    model(x)
    parametrizations.orthogonal(mine.lin)
    with pytest.raises(CompileError, match="a submodule was added, removed or replaced"):
        model(x)


class _MakesOnes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.ones(x.shape[0], 1)  # dtype from the default dtype


@pytest.mark.parametrize("setting", ["autocast", "default dtype"])
def test_a_process_wide_setting_the_trace_was_made_for_is_refused_when_it_changed(
        setting: str) -> None:
    """autocast and the default dtype change what forward computes; the trace baked in the
    first call's settings, so a call under others is refused by name, not answered."""
    model = ff.compile(_MakesOnes(), _config())
    x = torch.randn(3, 8)
    model(x)
    expected = {"autocast": r"autocast on cpu was off at the trace and is on "
                            r"\(torch\.bfloat16\) for this call",
                "default dtype": r"the default dtype was torch\.float32 at the trace and is "
                                 r"torch\.float64 for this call"}[setting]
    before = torch.get_default_dtype()
    try:
        with pytest.raises(CompileError, match=expected):
            if setting == "autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(x)
            else:
                torch.set_default_dtype(torch.float64)
                model(x.double())
    finally:
        torch.set_default_dtype(before)
    with torch.no_grad():  # and back under the first call's settings, served again
        torch.testing.assert_close(model(x), _MakesOnes()(x))


# -- class attributes forward reads (found by the matrix: class_attribute_read_by_forward) ----
class _Base(nn.Module):
    BIAS = 3.0


class _Leaf(nn.Module):
    FACTOR = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.FACTOR


class ReadsClass(_Base):
    """Reads class attributes through ``self``: its own, a base class's, a submodule's."""

    OFFSET = 1.0

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.leaf = _Leaf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leaf(self.lin(x)) + self.OFFSET + self.BIAS


def _reads_class_pair() -> tuple[type[ReadsClass], nn.Module, nn.Module]:
    """A fresh subclass per test (the class attributes are changed), and two instances."""
    cls = type("ReadsClassCopy", (ReadsClass,), {})
    mine, theirs = cls(), cls()
    theirs.load_state_dict(mine.state_dict())
    return cls, mine, theirs


@pytest.mark.parametrize(("target", "name", "where"), [
    (None, "OFFSET", r"ReadsClassCopy\.OFFSET"),  # set on the class itself
    (_Base, "BIAS", r"ReadsClassCopy\.BIAS"),  # on the base class forward reads it from
    (_Leaf, "FACTOR", r"_Leaf\.FACTOR"),  # on a submodule's class
])
@pytest.mark.parametrize("mode", ["piecewise", "dynamo_trace_once"])
def test_a_class_attribute_forward_reads_changed_after_the_trace_is_refused(
        target: type | None, name: str, where: str, mode: str) -> None:
    """Found by the matrix: ``type(module).OFFSET = 2.5`` after the trace was answered from
    the trace, which baked 1.0 in. The every-call check follows the class attributes forward
    read (taken from the trace's guards), so even a routed call is refused."""
    cls, mine, theirs = _reads_class_pair()
    model = ff.compile(mine, _config(mode=mode))
    x = torch.randn(3, 4)
    for _ in range(2):  # the second call is routed (the every-call tier only)
        before = model(x)
        assert torch.equal(before, theirs(x).detach())
    holder = target if target is not None else cls
    old = getattr(holder, name)
    setattr(holder, name, 2.5)
    try:
        assert not torch.equal(theirs(x), before)  # eager reads 2.5 now
        with pytest.raises(CompileError, match=rf"class attribute {where} that forward reads "
                                               rf"was {old!r} at the trace and is 2\.5 now"):
            model(x)
        setattr(holder, name, float(repr(old)))  # back to an equal value: served again
        assert torch.equal(model(x), theirs(x).detach())
        assert model.stats.retraces == 0
    finally:
        setattr(holder, name, old)


def test_a_class_attribute_shadowed_on_the_subclass_is_refused() -> None:
    """``self.BIAS`` is looked up from the instance's class: a value set on the subclass
    hides the base class's, and is a change too."""
    cls, mine, _ = _reads_class_pair()
    model = ff.compile(mine, _config())
    model(torch.randn(3, 4))
    cls.BIAS = -1.0
    with pytest.raises(CompileError, match=r"ReadsClassCopy\.BIAS that forward reads was 3\.0 "
                                           r"at the trace and is -1\.0 now"):
        model(torch.randn(3, 4))


def test_class_attributes_forward_does_not_read_are_not_checked() -> None:
    cls, mine, theirs = _reads_class_pair()
    cls.UNUSED = 1
    model = ff.compile(mine, _config())
    x = torch.randn(3, 4)
    model(x)
    cls.UNUSED = 2
    cls.training_note = "anything"
    assert torch.equal(model(x), theirs(x).detach())


def test_a_trace_loaded_from_the_cache_checks_the_class_attributes_too(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo does not run on a warm start: the class attributes come from the saved
    trace's checks."""
    monkeypatch.delenv("FREEZEFRAME_DISABLE_CACHE", raising=False)
    cls, mine, theirs = _reads_class_pair()
    cfg = _config(use_cache=True, cache_dir=str(tmp_path / "cache"))
    x = torch.randn(3, 4)
    ff.compile(cls(), cfg)(x)
    model = ff.compile(mine, cfg)
    assert torch.equal(model(x), theirs(x).detach())
    assert model.stats.traces_loaded == 1
    cls.OFFSET = 7.0
    with pytest.raises(CompileError, match=r"ReadsClassCopy\.OFFSET that forward reads was "
                                           r"1\.0 at the trace and is 7\.0 now"):
        model(x)


FACTOR = 1.5


class ReadsGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * FACTOR


def test_a_trace_loaded_from_the_cache_checks_the_globals_too(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo does not run on a warm start: the globals come from the saved trace's checks,
    and a global changed after the load is refused as after a trace."""
    global FACTOR
    monkeypatch.delenv("FREEZEFRAME_DISABLE_CACHE", raising=False)
    monkeypatch.setattr(sys.modules[__name__], "FACTOR", 1.5)
    cfg = _config(use_cache=True, cache_dir=str(tmp_path / "cache"))
    x = torch.randn(3, 4)
    ff.compile(ReadsGlobal(), cfg)(x)
    mine = ReadsGlobal()
    model = ff.compile(mine, cfg)
    assert torch.equal(model(x), mine(x).detach())
    assert model.stats.traces_loaded == 1
    FACTOR = 2.5
    with pytest.raises(CompileError, match=r"the global FACTOR \(of module "
                                           r".*test_module_state\), which forward reads, was "
                                           r"1\.5 at the trace and is 2\.5 now"):
        model(x)
