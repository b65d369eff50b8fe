"""A compiled model remembers where a call of one exact shape went (signature.exact_key) and
sends the next such call straight there, with each piece's compiled entry for that shape bound
in when it has no graphs (direct_call.sized_call). Every answer must still be eager's: a call
that differs in anything routing reads (shape, strides, dtype, a plain value, aliasing, the
autograd mode) must not be sent where another went, and the module-state check still runs."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.compilation import model as model_module
from freezeframe.compilation import routing
from freezeframe.compilation.direct_call import shared_reads
from freezeframe.compilation.signature import exact_key
from freezeframe.errors import CompileError, ConfigError
from tests.helpers.global_hooks import refused_under_a_global_hook
from tests.helpers.silly import attention


def config(**overrides: Any) -> ff.CompilationConfig:
    base: dict[str, Any] = dict(mode="piecewise", backend="eager", cudagraph_mode="none",
                                splitting_ops=["silly::attention"], use_cache=False)
    base.update(overrides)
    return ff.CompilationConfig(**base)


class Net(nn.Module):
    """Two splitting ops, so three capturable pieces; its answer depends on every input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None,
                k: int = 1) -> torch.Tensor:
        h = attention(self.lin(x), x, x)
        if y is not None:
            h = h + 2 * y
        h = attention(self.out(h), h, h)
        return h * k


def _warm(module: nn.Module, *args: Any) -> Any:
    """``module`` compiled and called three times on ``args``: the first call traces, the
    second builds the direct call, the third is remembered, so the next one is served from
    the memory."""
    model = ff.compile(module, config())
    with torch.no_grad():
        for _ in range(3):
            model(*args)
    return model


def _eq(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- the key -----------------------------------------------------------------------------------
def test_the_key_tells_apart_everything_a_route_depends_on() -> None:
    x = torch.randn(4, 3)
    base = exact_key((x,), {}, False)
    assert base == exact_key((torch.randn(4, 3),), {}, False)
    for other in (torch.randn(5, 3), torch.randn(4, 3, dtype=torch.float64),
                  torch.randn(3, 4).t(), torch.randn(4, 3).requires_grad_()):
        assert exact_key((other,), {}, False) != base
    # keyword names and plain values count; a bool is not the int it equals
    assert exact_key((), {"x": x}, False) != exact_key((), {"y": x}, False)
    assert exact_key((x, 1), {}, False) != exact_key((x, True), {}, False)
    assert exact_key((x, 1), {}, False) != exact_key((x, 2), {}, False)
    # which tensors share storage counts
    a, b = torch.randn(8), torch.randn(8)
    assert exact_key((a, b), {}, False) != exact_key((a, a), {}, False)
    assert exact_key((a, b), {}, False) == exact_key((torch.randn(8), torch.randn(8)), {}, False)
    # the autograd mode counts only where asked
    with torch.no_grad():
        off = exact_key((x,), {}, True)
    assert exact_key((x,), {}, True) != off
    assert exact_key((x,), {}, True)[-1] is True and off[-1] is False


def test_calls_the_key_cannot_hold_take_the_long_way() -> None:
    x = torch.randn(2)
    for args in ((x, 0.5), (x, [x]), (nn.Parameter(x),), (x, object())):
        assert exact_key(args, {}, False) is None


# -- the compiled model ------------------------------------------------------------------------
def test_a_shape_seen_before_goes_straight_to_its_route_and_answers_as_eager() -> None:
    module = Net()
    model = ff.compile(module, config())
    with torch.no_grad():
        for n in (5, 3, 3, 5, 7, 3):
            x = torch.randn(n, 4)
            _eq(model(x), module(x))
        # 5 traced, 3 built the direct call; 3, 5, 7 were remembered once each
        assert sorted(key[0][0] for key in model._exact) == [3, 5, 7]
        assert model.num_traces == 1


def test_a_remembered_call_binds_the_compiled_entry_of_its_own_size() -> None:
    module = Net()
    model = ff.compile(module, config(compile_sizes=[4], max_num_tokens=16))
    with torch.no_grad():
        for n in (6, 6, 4, 9, 4, 9, 6):
            x = torch.randn(n, 4)
            _eq(model(x), module(x))
    variant = model._variants[0]
    names = [p.name for p in variant.backend.pieces if p.capturable]
    for key, call in model._exact.items():
        n = key[0][0]
        stitching = call.__func__.__globals__["_ff_stitched"].__self__
        bound = [stitching.__dict__[name] for name in names]
        assert bound == [b.runnable_for(n) for b in variant.backend.piece_backends]
    # size 4 has its own compiled entry; 6 and 9 share the range's, and one stitching copy
    assert len(variant.sized) == 2


def test_calls_that_differ_only_in_what_the_key_holds_are_not_mixed_up() -> None:
    module = Net()
    model = ff.compile(module, config())
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with torch.no_grad():
        for _ in range(3):
            _eq(model(x, y), module(x, y))
            _eq(model(x, y, 3), module(x, y, 3))
            _eq(model(x, y=y), module(x, y=y))
            _eq(model(x, x), module(x, x))  # aliased: a trace of its own
            xt = torch.randn(4, 4).t()
            _eq(model(xt, y), module(xt, y))
            _eq(model(x, y, k=0.5), module(x, y, k=0.5))  # a float: no exact key


def test_the_module_state_check_still_runs_on_a_remembered_call() -> None:
    module = Net()
    x = torch.randn(3, 4)
    model = _warm(module, x)
    with torch.no_grad():
        assert model._exact
        module.lin = nn.Linear(4, 4)  # a root attribute replaced: the trace is refused
        with pytest.raises(CompileError, match="changed after its first call"):
            model(x)


def test_a_replaced_parameter_is_read_on_a_remembered_call() -> None:
    module = Net()
    x = torch.randn(3, 4)
    model = _warm(module, x)
    with torch.no_grad():
        module.out.weight = nn.Parameter(torch.randn(4, 4))
        _eq(model(x), module(x))
        module.out.weight.mul_(2)
        _eq(model(x), module(x))


def test_the_memory_is_emptied_when_full_and_answers_stay_right(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "MAX_EXACT_KEYS", 2)
    module = Net()
    model = ff.compile(module, config())
    with torch.no_grad():
        for n in (2, 2, 3, 4, 5, 6, 2, 3):
            x = torch.randn(n, 4)
            _eq(model(x), module(x))
            assert len(model._exact) <= 2


def test_threads_calling_different_shapes_each_get_their_own_answer() -> None:
    module = Net()
    model = ff.compile(module, config())
    with torch.no_grad():
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            with torch.no_grad():
                for _ in range(30):
                    x = torch.randn(n, 4)
                    _eq(model(x), module(x))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in (1, 3, 5, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_with_autograd_kept_the_mode_is_part_of_the_key() -> None:
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model = ff.compile(module, config(mode="dynamo_trace_once", splitting_ops=None),
                       {"input": 0}, inference_mode=False)
    x = torch.randn(3, 4)
    for _ in range(3):
        with torch.no_grad():
            off = model(x)
        assert not off.requires_grad
        _eq(off, module(x).detach())
        out = model(x)
        assert out.requires_grad  # not the no_grad route's answer
        out.sum().backward()
    grad = module[0].weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_hooks_on_the_compiled_model_still_run() -> None:
    module = Net()
    model = ff.compile(module, config())
    x = torch.randn(3, 4)
    seen: list[str] = []
    with torch.no_grad():
        for _ in range(3):
            model(x)
        pre = model.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        post = model.register_forward_hook(lambda m, args, out: seen.append("post") or out + 1)
        _eq(model(x), module(x * 2) + 1)
        pre.remove()
        post.remove()
        _eq(model(x), module(x))
    assert seen == ["post"]


def test_inside_another_torch_compile_it_is_traced_as_the_plain_module() -> None:
    module = Net()
    x = torch.randn(3, 4)
    model = _warm(module, x)
    with torch.no_grad():
        outer = torch.compile(lambda t: model(t) * 2, backend="eager")
        for n in (3, 5):
            t = torch.randn(n, 4)
            _eq(outer(t), module(t) * 2)


# -- reading the graph inputs --------------------------------------------------------------------
def test_shared_heads_of_the_sources_are_read_once() -> None:
    sources = ["L['self']._modules['a']._parameters['w']",
               "L['x'].size()[0]",
               "L['x']",
               "L['self']._modules['b']._modules['c']._parameters['w']",
               "L['self']._modules['b']._modules['c']._parameters['b']",
               "G['table'][0]"]
    lines, exprs = shared_reads(sources)
    assert lines == ["_ff_r0 = L['self']._modules",
                     "_ff_r1 = _ff_r0['b']._modules['c']._parameters"]
    assert exprs == ["_ff_r0['a']._parameters['w']", "L['x'].size()[0]", "L['x']",
                     "_ff_r1['w']", "_ff_r1['b']", "G['table'][0]"]


# -- found by attacking the remembered path ------------------------------------------------------
def test_a_forward_wrapped_on_the_instance_runs_on_every_call() -> None:
    module = Net()
    model = ff.compile(module, config())
    inner = model.forward
    model.forward = lambda *a, **k: inner(*a, **k) * 2  # as accelerate's hooks do
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 4)
            _eq(model(x), module(x) * 2)


def test_a_parameter_named_like_the_generated_code_keeps_its_value() -> None:
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor, _ff_stitched: torch.Tensor) -> torch.Tensor:
            return attention(x, x, x) + _ff_stitched

    module = Odd()
    model = ff.compile(module, config())
    with torch.no_grad():
        for _ in range(4):
            x, y = torch.randn(3, 4), torch.randn(3, 4)
            _eq(model(x, y), module(x, y))


def test_two_views_of_one_storage_are_not_the_same_tensor_twice() -> None:
    module = Net()
    model = ff.compile(module, config())
    base = torch.randn(16, 4)
    with torch.no_grad():
        v = base[:4]
        for _ in range(4):
            _eq(model(v, v), module(v, v))
        a, b = base[:4], base[4:8]
        for _ in range(3):
            _eq(model(a, b), module(a, b))
    assert exact_key((v, v), {}, False) != exact_key((a, b), {}, False)


def test_a_submodule_switched_to_train_alone_is_caught() -> None:
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return attention(self.drop(x), x, x)

    module = Drop().eval()
    model = ff.compile(module, config())
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            _eq(model(x), module(x))
        module.drop.train()
        with pytest.raises(CompileError, match=r"drop.training was False at the trace"):
            model(x)
        module.drop.eval()
        _eq(model(x), module(x))


def test_a_hook_added_to_or_removed_from_a_submodule_is_caught() -> None:
    module = Net()
    handle = module.out.register_forward_hook(lambda m, i, o: o * 3)
    model = ff.compile(module, config())
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            _eq(model(x), module(x))
        handle.remove()  # the trace has the hook in it
        with pytest.raises(CompileError, match=r"out had 1 forward hook\(s\) at the trace"):
            model(x)
    module = Net()
    model = _warm(module, x)
    with torch.no_grad():
        module.lin.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
        with pytest.raises(CompileError, match=r"lin had 0 forward hook\(s\) at the trace"):
            model(x)


def test_a_root_tensor_attribute_set_to_none_is_named() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mask = torch.ones(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return attention(x * self.mask, x, x)

    module = Masked()
    model = ff.compile(module, config())
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            _eq(model(x), module(x))
        module.mask = None
        with pytest.raises(CompileError, match=r"mask was a torch.float32 tensor .* is None"):
            model(x)


def test_replacing_the_compiled_models_module_is_refused() -> None:
    model = ff.compile(Net(), config())
    with pytest.raises(ConfigError, match=r"module cannot be replaced.*ff.compile\(new_module"):
        model.module = Net()


# -- the short cut of __call__, worked out once ------------------------------------------------
def test_two_tensor_keys_tell_apart_two_storages_one_storage_and_one_tensor() -> None:
    base = torch.randn(16)
    a, b = base[:8], base[8:]
    two, shared, same = (exact_key(args, {}, False) for args in (
        (torch.randn(8), torch.randn(8)), (a, b), (a, a)))
    assert len({two, shared, same}) == 3
    assert same == exact_key((b, b), {}, False)
    assert shared == exact_key((b, a), {}, False)
    # a key of two tensors is never one of one tensor and an int, or of three values
    assert exact_key((a, 8), {}, False) != two
    assert exact_key((a, b, None), {}, False) != shared


@pytest.mark.parametrize("change", ["forward wrapped", "forward hook", "global hook",
                                    "module.compile"])
def test_what_is_set_on_a_warm_model_is_seen_at_its_next_call(change: str) -> None:
    """Once warm, a call skips nn.Module.__call__ while nothing has moved torch's hook-handle
    counter or set an attribute of the compiled model; each of these changes must be seen on
    the very next call."""
    module = Net()
    x = torch.randn(3, 4)
    model = _warm(module, x)
    with torch.no_grad():
        model(x)
        assert model._armed_at == torch.utils.hooks.RemovableHandle.next_id
        handle = None
        if change == "forward wrapped":
            inner = model.forward
            model.forward = lambda *a, **k: inner(*a, **k) * 2
            want = module(x) * 2
        elif change == "forward hook":
            handle = model.register_forward_hook(lambda m, args, out: out - 1)
            want = module(x) - 1
        elif change == "global hook":
            refused_under_a_global_hook(model, x)
            _eq(model(x), module(x))
            return
        else:
            model.compile(backend="eager")
            want = module(x)
        try:
            for _ in range(2):
                _eq(model(x), want)
        finally:
            if handle is not None:
                handle.remove()
        if change == "forward hook":
            _eq(model(x), module(x))


# -- another thread changing the model while a call works out its short cut --------------------
def test_a_hook_stored_after_its_handle_moved_the_counter_still_runs() -> None:
    """register_forward_hook makes the handle (moving the counter) before it stores the hook:
    a call from another thread in between arms at the new count, so the stored hook must be
    seen by reading the hook dict itself."""
    module = Net()
    x = torch.randn(3, 4)
    model = _warm(module, x)
    with torch.no_grad():
        handle = torch.utils.hooks.RemovableHandle(model._forward_hooks)  # step one
        model(x)  # "the other thread": arms at the moved counter
        model._forward_hooks[handle.id] = lambda m, args, out: out * 0  # step two
        for _ in range(2):
            _eq(model(x), module(x) * 0)
        handle.remove()
        _eq(model(x), module(x))


def test_forward_set_while_a_call_arms_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    module = Net()
    x = torch.randn(3, 4)
    model = _warm(module, x)
    model.__dict__["_armed_at"] = -1  # as after any attribute set: the next call arms
    checks = model_module.may_skip_module_call
    inner = model.forward

    def set_between(self: Any) -> bool:
        ok = checks(self)
        if "forward" not in self.__dict__:  # "another thread" sets forward after the check
            self.forward = lambda *a, **k: inner(*a, **k) * 2
        return ok

    monkeypatch.setattr(model_module, "may_skip_module_call", set_between)
    with torch.no_grad():
        model(x)
        monkeypatch.undo()
        for _ in range(2):
            _eq(model(x), module(x) * 2)


# -- the check of the last remembered call (signature.SameCall) --------------------------------
def test_a_call_like_the_last_in_all_but_one_property_is_not_sent_its_way() -> None:
    """After a warm call of two distinct tensors, each call differs from it in one property
    the exact key holds; each must get its own answer, and the one alike must be served by
    the last call's check."""
    module = Net()
    base = torch.randn(16, 4)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    model = _warm(module, a, b)
    others = [(a, a), (base[:4], base[4:8]), (a, torch.randn(4, 4).t()),
              (a, torch.randn(5, 4)), (a, b.double()), (a, b.clone().requires_grad_()),
              (a,), (a, b, 2), (a, torch.randn(8, 4)[::2])]
    with torch.no_grad():
        for other in others:
            for _ in range(3):
                try:
                    want = module(*other)
                except Exception as exc:  # eager refuses it too: so must the model
                    with pytest.raises(type(exc)):
                        model(*other)
                    break
                _eq(model(*other), want)
                _eq(model(a, b), module(a, b))
        twin = (torch.randn(4, 4), torch.randn(4, 4))
        model(*twin)
        last = model._last
        assert last is not None and last.count == 2 and last.check(*twin)
        _eq(model(*twin), module(*twin))


def test_the_last_calls_check_made_in_one_autograd_mode_is_not_trusted_in_another() -> None:
    module = Net()
    x = torch.randn(3, 4)
    model = _warm(module, x)
    with torch.no_grad():
        model(x)
    with torch.inference_mode():
        assert model._last is not None and not model._last.check(x)
        _eq(model(x), module(x))
        # made anew in this mode: the next call of the mode is recognised
        assert model._last is not None and model._last.check(x)
        _eq(model(x), module(x))
    _eq(model(x), module(x).detach())


def test_two_views_of_one_storage_after_two_tensors_are_keyed_as_their_own_call() -> None:
    """Storage sharing is the one thing the C++ tensor check does not see (it does see one
    tensor passed twice): a call of two views of one storage after calls of two tensors must
    be keyed and routed as a call of its own, as it would be without the check."""

    class Writes(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x.mul_(2)
            return attention(x + y, x, x)

    module = Writes()
    model = ff.compile(module, config())
    with torch.no_grad():
        for _ in range(4):
            a, b = torch.randn(3, 4), torch.randn(3, 4)
            a2, b2 = a.clone(), b.clone()
            _eq(model(a, b), module(a2, b2))
            _eq(a, a2)
        two = model._last
        assert two is not None
        c = torch.randn(3, 4)
        assert not two.check(c, c)  # one tensor twice: the tensor check sees that itself
        for _ in range(4):  # (traced, its direct call built, then remembered)
            base = torch.randn(6, 4)
            base2 = base.clone()
            _eq(model(base[:3], base[3:]), module(base2[:3], base2[3:]))
            _eq(base, base2)
    assert exact_key((base[:3], base[3:]), {}, False) in model._exact
