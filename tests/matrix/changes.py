"""The changes a case makes to a module between calls (cases.CHANGES says each in words).

A change is applied to the module the compiled path serves; the eager reference of the next
call is a copy of that module made after the change, so every change is seen by both sides
alike. What cannot be copied with the module is kept here and given to the copy: hooks
registered on the compiled model itself, and the process-wide settings (autocast, the default
dtype) the next calls run under.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tests.matrix import models
from tests.matrix.cases import Change
from tests.matrix.oracle import children, rebuild


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    items = children(value)
    if items is None:
        return value
    return rebuild(value, [map_tensors(v, fn) for _, v in items])


def _twice_plus_one(t: torch.Tensor) -> torch.Tensor:
    return t * 2 + 1 if t.is_floating_point() else t


def _half(t: torch.Tensor) -> torch.Tensor:
    return t * 0.5 if t.is_floating_point() else t


def forward_hook(module: nn.Module, args: Any, out: Any) -> Any:
    return map_tensors(out, _twice_plus_one)


def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return map_tensors(args, _half), map_tensors(kwargs, _half)


def copy_module(module: nn.Module) -> nn.Module:
    """``copy.deepcopy``, also of a module holding a tensor that autograd produced (a stored
    output): such a tensor is copied detached, as deepcopy refuses non-leaf tensors."""
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(module, memo)


class Changer:
    """Applies :class:`Change` events to ``module`` (and ``compiled``, for hooks on the compiled
    model), and holds what the eager reference needs besides a copy of the module."""

    def __init__(self, module: nn.Module, compiled: Any, seed: int) -> None:
        self.module = module
        self.compiled = compiled
        self.seed = seed
        self.model_hooks: list[tuple[str, Any]] = []  # (kind, fn) on the compiled model
        self.handles: list[tuple[Any, tuple[str, Any] | None]] = []
        self.dtype = torch.float32
        self.autocast = False
        self.default64 = False
        self.happened: set[str] = set()  # the change kinds applied so far
        self.fault = False  # the next call runs with the fault switch armed

    # -- what the next calls run under ------------------------------------------------------
    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        before = torch.get_default_dtype()
        with contextlib.ExitStack() as stack:
            if self.autocast:
                stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            if self.default64:
                torch.set_default_dtype(torch.float64)
            try:
                yield
            finally:
                torch.set_default_dtype(before)

    def reference(self) -> nn.Module:
        """A copy of the module as it is now, with the compiled model's hooks."""
        ref = copy_module(self.module)
        for kind, fn in self.model_hooks:
            if kind == "pre":
                ref.register_forward_pre_hook(fn, with_kwargs=True)
            else:
                ref.register_forward_hook(fn)
        return ref

    # -- changes ----------------------------------------------------------------------------
    def apply(self, change: Change, index: int) -> None:
        self.happened.add(change.kind)
        getattr(self, "_" + change.kind)(change.target, index)

    def take_fault(self) -> bool:
        """Whether the next call runs with the fault armed (once)."""
        fault, self.fault = self.fault, False
        return fault

    def undo_globals(self) -> None:
        """What a change set outside the module goes back (after the case)."""
        models.GAIN = models.BASE_GAIN
        models.FAULT.armed = False

    def _values(self, like: torch.Tensor, index: int, salt: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 7919 + index * 101 + salt)
        if not like.is_floating_point():
            return like.detach().clone()
        return (torch.randn(like.shape, generator=gen) * 0.3).to(like.dtype)

    def _params(self) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
        return [(owner_name, owner, name, p)
                for owner_name, owner in self.module.named_modules()
                for name, p in owner.named_parameters(recurse=False)]

    def param_names(self) -> list[str]:
        return [f"{o}.{n}" if o else n for o, _, n, _ in self._params()]

    def _param(self, target: int) -> tuple[nn.Module, str, nn.Parameter]:
        found = self._params()
        if not found:
            raise LookupError("the model has no parameter")
        _, owner, name, p = found[target % len(found)]
        return owner, name, p

    def _linears(self) -> list[tuple[str, nn.Linear]]:
        return [(n, m) for n, m in self.module.named_modules() if isinstance(m, nn.Linear)]

    def _scale_data(self, target: int, index: int) -> None:
        self._param(target)[2].data.mul_(2)

    def _add_no_grad(self, target: int, index: int) -> None:
        with torch.no_grad():
            self._param(target)[2].add_(0.25)

    def _replace_param(self, target: int, index: int) -> None:
        owner, name, p = self._param(target)
        setattr(owner, name, nn.Parameter(self._values(p, index), requires_grad=p.requires_grad))

    def _p_data_assign(self, target: int, index: int) -> None:
        p = self._param(target)[2]
        p.data = self._values(p, index)

    def _new_state(self, index: int) -> dict[str, torch.Tensor]:
        state = self.module.state_dict()
        return {k: self._values(v, index, salt=i) for i, (k, v) in enumerate(state.items())}

    def _load_state_dict_assign(self, target: int, index: int) -> None:
        self.module.load_state_dict(self._new_state(index), assign=True)

    def _load_state_dict(self, target: int, index: int) -> None:
        self.module.load_state_dict(self._new_state(index))

    def _bias_none(self, target: int, index: int) -> None:
        linears = [m for _, m in self._linears() if m.bias is not None]
        if linears:
            linears[target % len(linears)].bias = None

    def _register_buffer(self, target: int, index: int) -> None:
        subs = list(self.module.modules())
        subs[target % len(subs)].register_buffer(f"extra{index}", torch.ones(1, dtype=self.dtype))

    def _swap_submodule(self, target: int, index: int) -> None:
        linears = self._linears()
        if not linears:
            return
        path, old = linears[target % len(linears)]
        parent_path, _, name = path.rpartition(".")
        parent = self.module.get_submodule(parent_path)
        with torch.random.fork_rng():
            torch.manual_seed(self.seed + index)
            new = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
        setattr(parent, name, new.to(old.weight.dtype))

    def _train(self, target: int, index: int) -> None:
        self.module.train()

    def _eval(self, target: int, index: int) -> None:
        self.module.eval()

    def _register(self, handle: Any, entry: tuple[str, Any] | None) -> None:
        self.handles.append((handle, entry))
        if entry is not None:
            self.model_hooks.append(entry)

    def _hook_model_fwd(self, target: int, index: int) -> None:
        self._register(self.compiled.register_forward_hook(forward_hook), ("fwd", forward_hook))

    def _hook_model_pre(self, target: int, index: int) -> None:
        handle = self.compiled.register_forward_pre_hook(pre_hook, with_kwargs=True)
        self._register(handle, ("pre", pre_hook))

    def _hook_root_fwd(self, target: int, index: int) -> None:
        self._register(self.module.register_forward_hook(forward_hook), None)

    def _hook_sub_fwd(self, target: int, index: int) -> None:
        subs = [m for _, m in self.module.named_modules()][1:] or [self.module]
        self._register(subs[target % len(subs)].register_forward_hook(forward_hook), None)

    def _remove_hook(self, target: int, index: int) -> None:
        if not self.handles:
            return
        handle, entry = self.handles.pop()
        handle.remove()
        if entry is not None:
            self.model_hooks.remove(entry)

    def _to_float64(self, target: int, index: int) -> None:
        self.module.to(torch.float64)
        self.dtype = torch.float64

    def _autocast_on(self, target: int, index: int) -> None:
        self.autocast = True

    def _autocast_off(self, target: int, index: int) -> None:
        self.autocast = False

    def _default_dtype64(self, target: int, index: int) -> None:
        self.default64 = True

    def _default_dtype32(self, target: int, index: int) -> None:
        self.default64 = False

    def _to_float32(self, target: int, index: int) -> None:
        self.module.to(torch.float32)
        self.dtype = torch.float32

    def _class_attr(self, target: int, index: int) -> None:
        type(self.module).OFFSET = 2.5  # type: ignore[attr-defined]

    def _restore_class_attr(self, target: int, index: int) -> None:
        type(self.module).OFFSET = 1.0  # type: ignore[attr-defined]

    def _instance_attr(self, target: int, index: int) -> None:
        name = "scale" if hasattr(self.module, "scale") else "note"
        setattr(self.module, name, 3.0)

    def _restore_attr(self, target: int, index: int) -> None:
        if "note" in vars(self.module):
            del self.module.note
        elif hasattr(self.module, "scale"):
            self.module.scale = 2.0

    def _module_global(self, target: int, index: int) -> None:
        models.GAIN = 3.0

    def _restore_global(self, target: int, index: int) -> None:
        models.GAIN = models.BASE_GAIN

    def _tensor_attr_replaced(self, target: int, index: int) -> None:
        gain = self.module.gain
        self.module.gain = torch.linspace(-1.0, 1.0, gain.shape[0]).to(gain.dtype)

    def _tensor_attr_inplace(self, target: int, index: int) -> None:
        self.module.gain.mul_(1.5)

    def _fault(self, target: int, index: int) -> None:
        self.fault = True

    def _gen_config(self, target: int, index: int) -> None:
        config = self.module.generation_config
        config.repetition_penalty = 1.3
        config.no_repeat_ngram_size = 2

    def _equal_attr(self, target: int, index: int) -> None:
        if hasattr(self.module, "scale"):
            self.module.scale = float(repr(self.module.scale))
