"""A call of a module: whether it may skip ``nn.Module.__call__`` (the one definition of
"hooked"), and its one spelling for a graph.

A compiled model's remembered call (``CompiledModel.__call__``) and a runner's planned step go
straight to a trace or a replay. That is the same work ``nn.Module.__call__`` would do only when
``__call__`` would run nothing but ``forward``; this module says when, for every caller::

    hooked(module)                 any hook __call__ runs: the module's forward, forward-pre,
                                   backward and backward-pre hooks, or torch's global ones
    may_skip_module_call(module)   not hooked, no ``forward`` set on the instance (a wrapper
                                   such as accelerate's), no ``module.compile()`` call
                                   implementation, and not inside someone else's trace
                                   (Dynamo, TorchScript)

A caller with conditions of its own (the compiled model's memo must hold a call) adds them. A
caller that runs the forward its own way keeps the hooks with :func:`call_with_forward` (the
verify reference, a micro-batched step).

A FULL graph holds the argument list of its capture; ``model(x=x)`` and ``model(x)`` are the
same call, so :class:`PositionalForm` spells both the same way before they reach one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

__all__ = ["PositionalForm", "bare_forward", "call_eagerly", "call_with_forward", "hooked",
           "may_skip_module_call"]

_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state


def hooked(module: nn.Module) -> bool:
    """Whether ``nn.Module.__call__`` of ``module`` would run a hook: one registered on the
    module itself (forward, forward-pre, backward, backward-pre) or globally
    (``torch.nn.modules.module.register_module_forward_hook`` and its kin)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks
                or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks)


def may_skip_module_call(module: nn.Module) -> bool:
    """Whether a call of ``module`` may go straight to its forward's work (a remembered trace,
    a planned replay) without ``nn.Module.__call__``: that call would run nothing else (see
    :func:`hooked`), ``forward`` is the class's (none set on the instance), no compiled call
    implementation is installed (``module.compile()``), and no one else is tracing this call
    (Dynamo, TorchScript), which must see the module called."""
    return not (hooked(module) or _is_compiling() or _tracing_state() is not None
                or "forward" in module.__dict__
                or module._compiled_call_impl is not None)


def call_eagerly(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """``model(*args, **kwargs)`` as a plain call runs it, through ``nn.Module.__call__`` (the
    model's hooks and torch's global ones, a pre-hook's new inputs), with the uncompiled
    ``model.module`` in place of the compiled forward: the eager reference of a step (verify
    mode)."""
    module = model.module
    assert isinstance(module, nn.Module)
    return call_with_forward(model, module, args, kwargs)


def bare_forward(model: nn.Module) -> Callable[..., Any]:
    """What ``nn.Module.__call__`` of ``model`` calls between its hooks: a ``forward`` set on
    the instance (a wrapper's), else the class's."""
    forward = model.__dict__.get("forward")
    return forward if forward is not None else type(model).forward.__get__(model)


def call_with_forward(model: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: Mapping[str, Any]) -> Any:
    """``model(*args, **kwargs)`` as ``nn.Module.__call__`` runs it (the model's hooks and
    torch's global ones, a pre-hook's new inputs, a forward hook's new output), with
    ``forward`` in place of the model's forward: a caller that runs the forward its own way
    (a micro-batched step) keeps the hooks a plain call runs. ``forward`` is set on the
    instance for the call and taken away after it, as if it never was (a call of the model
    meanwhile, ``forward`` itself through :func:`bare_forward` taken before, goes its own
    way)."""
    attrs = model.__dict__
    saved = attrs.get("forward", _ABSENT)
    attrs["forward"] = forward
    try:
        # (_call_impl: the hooks and forward; not a compiled call implementation)
        return nn.Module._call_impl(model, *args, **kwargs)
    finally:
        if saved is _ABSENT:
            attrs.pop("forward", None)
        else:
            attrs["forward"] = saved
        if "_armed_at" in attrs:
            attrs["_armed_at"] = -1  # (a compiled model works out its short cut again)


_ABSENT = object()


class PositionalForm:
    """A call of ``forward`` spelled one way: every positional parameter passed positionally,
    in order (a keyword argument naming one moved there, a default filling one left out), so
    that ``f(x=a)``, ``f(a)`` and ``f(a, gain=2.0)`` with that default reach a graph alike. A
    call that cannot be spelled so (a required parameter left out) is left as it is."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        params = inspect.signature(forward).parameters.values()
        self._names = [p.name for p in params
                       if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._defaults = {p.name: p.default for p in params
                          if p.default is not inspect.Parameter.empty}

    def __call__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not kwargs and len(args) >= len(self._names):
            return args, {}
        rest = dict(kwargs)
        out = list(args)
        for name in self._names[len(args):]:
            if name in rest:
                out.append(rest.pop(name))
            elif name in self._defaults:
                out.append(self._defaults[name])
            else:
                return args, dict(kwargs)
        return tuple(out), rest
