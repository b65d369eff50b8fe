"""The module's own Python state that a trace bakes in, and the check that it still holds.

Dynamo reads more than the arguments when it traces ``forward``: every submodule's train/eval
flag, the hooks registered on it, and plain attributes such as ``self.eps`` or ``self.scale``
become constants of the graph. torch.compile guards all of them on every call; freezeframe
drops Dynamo's guards after the trace (they cost more per call than a whole replay), so it
checks this state itself, in two tiers::

    every call           the root module's ``training`` flag and the number of global module
                         hooks (``torch.nn.modules.module.register_module_forward_hook``...):
                         three reads, about 0.1 us
    at the full checks   every submodule's flag, forward hooks and public attributes, compared
                         with the snapshot taken after the first trace: on each call that needs
                         a new route (a new call structure or size side), and on every call
                         when the config has ``debug=True``

What is compared, per submodule: ``training``; the forward and forward-pre hooks (by identity);
every attribute whose name does not start with ``_``: numbers, strings and None by value
(``-0.0`` and ``0.0`` differ, NaN equals NaN), lists, tuples and dicts of them item by item,
tensors by dtype, device and rank (the trace reads them as inputs), anything else (config
objects, functions) by identity. Parameters and buffers are not
part of it: the trace reads them as inputs, so in-place updates and replacements are seen.

A difference is never served from the stale trace: :meth:`ModuleState.difference` names it and
the caller raises. A forward that changes its own public attributes while it runs (a Python step
counter) is caught at the first trace: the trace would replay the first call's value forever.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.nn.modules.lazy import LazyModuleMixin

__all__ = ["ModuleState", "has_uninitialised_lazy"]

# How deep lists/dicts inside an attribute are compared item by item; deeper ones by identity.
_MAX_DEPTH = 4
_MAX_ITEMS = 256


class _Same:
    """Compares equal only to a token of the very same object (identity, not ``==``); holds a
    reference, so the id cannot be reused by a new object while the snapshot lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<{type(self.obj).__qualname__} object at {id(self.obj):#x}>"


def _token(value: Any, depth: int = 0) -> Any:
    """A comparable stand-in for an attribute value (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return (type(value), value)
    if isinstance(value, float):
        # repr tells -0.0 from 0.0 and makes every NaN equal
        return (float, repr(value) if math.isnan(value) or value == 0 else value)
    if isinstance(value, torch.Tensor):
        # The trace reads a tensor attribute as an input (as it does parameters), and a
        # forward that stores a tensor (self.last = out) has the store replayed on every call:
        # only what the graph was made for counts.
        return ("tensor", value.dtype, value.device, value.dim())
    if depth < _MAX_DEPTH:
        if isinstance(value, (list, tuple)) and len(value) <= _MAX_ITEMS:
            return (type(value), tuple(_token(v, depth + 1) for v in value))
        if type(value) is dict and len(value) <= _MAX_ITEMS:
            return (dict, tuple((_token(k, depth + 1), _token(v, depth + 1))
                                for k, v in value.items()))
    return _Same(value)


def _is_tensor_token(token: Any) -> bool:
    return isinstance(token, tuple) and len(token) == 4 and token[0] == "tensor"


def _describe(token: Any) -> str:
    if isinstance(token, _Same):
        return repr(token)
    if _is_tensor_token(token):
        return f"a {token[1]} tensor of {token[3]} dims on {token[2]}"

    if isinstance(token, tuple) and len(token) == 2 and isinstance(token[0], type):
        kind, value = token
        if kind is float and isinstance(value, str):
            return value
        if isinstance(value, tuple) and kind in (list, tuple, dict):
            if len(value) > 8:
                return f"a {kind.__name__} of {len(value)} items"
            if kind is dict:
                return "{" + ", ".join(f"{_describe(k)}: {_describe(v)}" for k, v in value) + "}"
            items = ", ".join(_describe(v) for v in value)
            return f"[{items}]" if kind is list else f"({items})"
        return repr(value)
    return repr(token)


def _global_hook_counts() -> tuple[int, int]:
    return (len(_torch_module._global_forward_hooks),
            len(_torch_module._global_forward_pre_hooks))


def _global_hooks() -> tuple[_Same, ...]:
    return tuple(_Same(h) for hooks in (_torch_module._global_forward_hooks,
                                        _torch_module._global_forward_pre_hooks)
                 for h in hooks.values())


class _SubmoduleState:
    __slots__ = ("attrs", "hooks", "training")

    def __init__(self, module: nn.Module) -> None:
        self.training = module.training
        self.hooks = tuple(_Same(h) for h in (*module._forward_pre_hooks.values(),
                                              *module._forward_hooks.values()))
        self.attrs = {name: _token(value) for name, value in vars(module).items()
                      if not name.startswith("_") and name != "training"}

    def difference(self, now: _SubmoduleState, where: str,
                   tensor_stores: bool = False) -> str | None:
        if now.training != self.training:
            return (f"{where}.training was {self.training} at the trace and is "
                    f"{now.training} now (model.train() / model.eval())")
        if now.hooks != self.hooks:
            return (f"{where} had {len(self.hooks)} forward hook(s) at the trace and has "
                    f"{len(now.hooks)} different one(s) now")
        for name in sorted(self.attrs.keys() | now.attrs.keys()):
            if tensor_stores and _is_tensor_token(now.attrs.get(name)):
                continue  # forward stored a tensor: replayed with the new value every call
            if name not in now.attrs:
                return f"{where}.{name} was deleted after the trace"
            if name not in self.attrs:
                return f"{where}.{name} was set after the trace"
            if now.attrs[name] != self.attrs[name]:
                return (f"{where}.{name} was {_describe(self.attrs[name])} at the trace and "
                        f"is {_describe(now.attrs[name])} now")
        return None


class ModuleState:
    """A snapshot of ``module``'s Python state; see the module docstring."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.training = module.training
        self.global_counts = _global_hook_counts()
        self._global_hooks = _global_hooks()
        self._modules = tuple(module.named_modules(remove_duplicate=False))
        self._subs = tuple(_SubmoduleState(m) for _, m in self._modules)

    def changed_cheaply(self) -> bool:
        """The every-call tier: root train/eval flag and global hook counts."""
        return (self.module.training is not self.training
                or _global_hook_counts() != self.global_counts)

    def difference(self, tensor_stores: bool = False) -> str | None:
        """The full tier: what differs from the snapshot, in words, or None.
        ``tensor_stores``: an attribute that now holds a tensor is not a difference (the check
        after the first call: a forward that stores a tensor has the store replayed)."""
        if _global_hooks() != self._global_hooks:
            return ("the global module hooks (torch.nn.modules.module."
                    "register_module_forward_hook / _pre_hook) changed after the trace")
        modules = tuple(self.module.named_modules(remove_duplicate=False))
        if [n for n, _ in modules] != [n for n, _ in self._modules] or any(
                a is not b for (_, a), (_, b) in zip(modules, self._modules, strict=True)):
            return "a submodule was added, removed or replaced after the trace"
        for (name, sub), before in zip(modules, self._subs, strict=True):
            why = before.difference(_SubmoduleState(sub), _where(name), tensor_stores)
            if why is not None:
                return why
        return None


def has_uninitialised_lazy(module: nn.Module) -> bool:
    """Whether a lazy submodule (``nn.LazyLinear``...) still waits for its first call, which
    changes its attributes (``in_features``) legitimately."""
    return any(isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()
               for m in module.modules())


def _where(name: str) -> str:
    return f"model.{name}" if name else "model"
