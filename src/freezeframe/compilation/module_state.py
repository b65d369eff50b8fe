"""The module's own Python state that a trace bakes in, and the check that it still holds.

Dynamo reads more than the arguments when it traces ``forward``: every submodule's train/eval
flag, the hooks registered on it, and plain attributes such as ``self.eps`` or ``self.scale``
become constants of the graph. torch.compile guards all of them on every call; freezeframe
drops Dynamo's guards after the trace (they cost more per call than a whole replay), so it
checks this state itself, in two tiers::

    every call           the root module: its ``training`` flag, its hooks, its direct
                         submodules and which object each of its attributes holds (an
                         attribute set, added or deleted, a tensor attribute that is no
                         tensor any more); every submodule's ``training`` flag, attributes
                         (the same way), number of attributes (one added or deleted,
                         ``forward`` set on it) and
                         children (a submodule replaced at any depth, a child added to one
                         that had none, as ``torch.nn.utils.parametrize`` does); a hook
                         registered anywhere (torch's process-wide hook-handle counter moved,
                         or a submodule's hook dict that was empty is not) or one the trace
                         saw removed; and the global module hooks
                         (``torch.nn.modules.module.register_module_forward_hook``...).
                         Generated as one straight-line function per module layout
                         (:mod:`~freezeframe.compilation.every_call_check` writes it, from
                         the root's and the process-wide terms made here): about 3 us alone
                         on the development machine's CPU for the two-layer toy Llama,
                         7-11 us between its ops.
                         A hit runs the full tier (which refreshes these when nothing
                         differs).
    the full tier        every submodule's flag, forward hooks and attributes, compared with
                         the snapshot taken after the first trace: on each call that needs a
                         new route (a new call structure or size side), when the every-call
                         tier saw a change, and on every call when the config has
                         ``debug=True``

What is compared, per submodule: ``training``; the forward and forward-pre hooks (by identity);
every attribute in its ``__dict__`` other than what ``nn.Module`` keeps there itself (so
``self.scale`` and ``self._steps`` alike), by the rule of :mod:`freezeframe.compilation.values`
(numbers and strings by type and value, containers item by item, small objects such as a config
dataclass field by field, functions and large objects by identity), except tensors, compared by
dtype, device and rank (the trace reads them as inputs). Parameters and buffers are not part of
it: the trace reads them as inputs, so in-place updates and replacements are seen. A config
object changed in place (``model.cfg.eps = 1e-3``) is therefore caught by the full tier only.
Not checked at all: a module's class changed in place (``m.lin.__class__ = Other``, without
the child that ``torch.nn.utils.parametrize`` adds along with it).

A difference is never served from the stale trace: :meth:`ModuleState.difference` names it and
the caller raises. A forward that changes its own attributes while it runs (a Python step
counter) is caught at the first trace: the trace would replay the first call's value forever.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.hooks import RemovableHandle as _hook_handles

from freezeframe.cache.key import autocast_settings
from freezeframe.compilation.every_call_check import every_call_source
from freezeframe.compilation.outside_reads import OutsideReads
from freezeframe.compilation.values import Same, describe, token

__all__ = ["ModuleState", "has_uninitialised_lazy"]

def _tensor_token(value: torch.Tensor) -> tuple[Any, ...]:
    # The trace reads a tensor attribute as an input (as it does parameters), and a forward
    # that stores a tensor (self.last = out) has the store replayed on every call: only what
    # the graph was made for counts.
    return ("tensor", value.dtype, value.device, value.dim())


def _read_tensor_token(value: torch.Tensor) -> tuple[Any, ...]:
    # A tensor attribute the trace reads as an input: its code was made for its shape too.
    return ("tensor", value.dtype, value.device, value.dim(), tuple(value.shape))


def _is_tensor_token(tok: Any) -> bool:
    return isinstance(tok, tuple) and len(tok) in (4, 5) and tok[0] == "tensor"


def _describe_tensor(tok: Any) -> str | None:
    if _is_tensor_token(tok):
        if len(tok) == 5:
            return f"a {tok[1]} tensor of shape {list(tok[4])} on {tok[2]}"
        return f"a {tok[1]} tensor of {tok[3]} dims on {tok[2]}"
    return None


def _describe(tok: Any) -> str:
    return describe(tok, _describe_tensor)


# What nn.Module itself keeps in an instance's __dict__ (parameters, buffers, submodules and
# hooks are compared their own way); everything else there is the user's state.
_TORCH_OWN = frozenset(vars(nn.Module())) | {
    "training", "_is_full_backward_hook", "_compiled_call_impl", "_initialize_hook",
    "_load_hook", "__orig_class__"}


def _user_attrs(module: nn.Module | dict[str, Any]) -> dict[str, Any]:
    """The user's attributes of a module (or of its ``__dict__``)."""
    attrs = module if isinstance(module, dict) else vars(module)
    return {name: value for name, value in attrs.items()
            if name not in _TORCH_OWN and not name.startswith("__")}



def _global_state() -> dict[str, Any]:
    """The process-wide torch settings a trace bakes into its code: autocast (on or off, and
    its dtype, per device type) and the default dtype and device (the dtype and device of a
    tensor ``forward`` makes without naming them). Grad mode is part of a call's key instead,
    and calls run in inference mode."""
    return {"the default dtype": torch.get_default_dtype(),
            "the default device": str(torch.get_default_device()), **autocast_settings()}


def _global_hook_ids() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The handle ids of the global module hooks. Ids are never reused, so one hook removed
    and another added differs."""
    return (tuple(_torch_module._global_forward_hooks),
            tuple(_torch_module._global_forward_pre_hooks))


_training = operator.itemgetter("training")


def _slot_meta(value: Any) -> tuple[Any, ...] | None:
    """What a parameter or buffer slot holds, as far as the trace is concerned: None, or the
    tensor's dtype, device and shape (another tensor of the same kind is read as an input)."""
    if value is None:
        return None
    return (value.dtype, value.device, tuple(value.shape))


def _describe_slot(meta: tuple[Any, ...] | None) -> str:
    if meta is None:
        return "None"
    dtype, device, shape = meta
    return f"a {dtype} tensor of shape {list(shape)} on {device}"


class _SubmoduleState:
    __slots__ = ("attrs", "hooks", "slots", "training")

    def __init__(self, module: nn.Module, reads: Collection[str] = ()) -> None:
        """``reads``: the tensor attributes the trace reads as inputs, compared by shape too
        (the trace's code was made for it)."""
        self.training = module.training
        self.hooks = tuple(Same(h) for h in (*module._forward_pre_hooks.values(),
                                             *module._forward_hooks.values()))
        self.attrs = {name: token(value, _read_tensor_token if name in reads else _tensor_token)
                      for name, value in _user_attrs(module).items()}
        # parameters and buffers, by name: None or the tensor's kind (see _slot_meta)
        self.slots = {name: _slot_meta(value)
                      for name, value in (*module._parameters.items(),
                                          *module._buffers.items())}

    def difference(self, now: _SubmoduleState, where: str, tensor_stores: bool = False,
                   reads: frozenset[str] | None = None, cls: type = object) -> str | None:
        """What differs, in words, or None. ``reads``: the attributes the trace read (None:
        every one counts); another is no difference, unless it was added over a name of the
        module's class ``cls`` (an instance attribute that now hides a method or constant)."""
        if now.training != self.training:
            return (f"{where}.training was {self.training} at the trace and is "
                    f"{now.training} now (model.train() / model.eval())")
        if now.hooks != self.hooks:
            return (f"{where} had {len(self.hooks)} forward hook(s) at the trace and has "
                    f"{len(now.hooks)} different one(s) now")
        for name in sorted(self.slots.keys() | now.slots.keys()):
            if name not in now.slots:
                return f"{where}.{name} (a parameter or buffer) was deleted after the trace"
            if name not in self.slots:
                return (f"{where}.{name} was registered as a parameter or buffer after the "
                        "trace")
            if now.slots[name] != self.slots[name]:
                return (f"{where}.{name} was {_describe_slot(self.slots[name])} at the trace "
                        f"and is {_describe_slot(now.slots[name])} now")
        for name in sorted(self.attrs.keys() | now.attrs.keys()):
            if tensor_stores and _is_tensor_token(now.attrs.get(name)):
                continue  # forward stored a tensor: replayed with the new value every call
            if reads is not None and name not in reads and (
                    name in self.attrs or not hasattr(cls, name)):
                continue  # the trace never read it
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

    def __init__(self, module: nn.Module, *, every_call: bool = True,
                 outside: OutsideReads | None = None,
                 tensor_reads: Collection[tuple[int, str]] | None = None,
                 attr_reads: Collection[tuple[int, str]] | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        """``every_call=False``: a snapshot for :meth:`difference` only. ``outside``: the
        class attributes and globals forward read (:class:`OutsideReads`). ``tensor_reads``:
        the plain tensor attributes the trace reads as inputs, each (module id, name),
        followed as parameters are (:meth:`moved_tensors`; another shape is a difference);
        None, for a module run without a trace: every tensor attribute is followed for moves,
        none by shape (forward may store one). ``attr_reads``: every attribute the trace read
        (None: every one counts; see ``_SubmoduleState.difference``). ``on_change``: what
        :attr:`check` calls when its every-call tier sees a change (the owner's full check)."""
        self.module = module
        self._on_change = on_change if on_change is not None else _nothing
        self._outside = outside if outside is not None else OutsideReads.none(module)
        self._every_call = every_call
        self.training = module.training
        self._global_ids = _global_hook_ids()
        self._global_state = _global_state()
        self._modules = tuple(module.named_modules(remove_duplicate=False))
        # per module, the names of the tensor attributes followed for moves, and of those
        # compared by shape too
        self._reads, self._shaped = _tensor_reads(self._modules, tensor_reads)
        self._attr_reads = tuple(
            None if attr_reads is None else
            frozenset(n for owner, n in attr_reads if owner == id(m))
            for _, m in self._modules)
        self._subs = tuple(_SubmoduleState(m, r) for (_, m), r in zip(self._modules,
                                                                         self._shaped,
                                                                         strict=True))
        # Below the root, every call: each submodule's train/eval flag, read from its __dict__
        # (nn.Module's __getattr__ makes an attribute read several times slower than a dict
        # lookup), and the hooks the trace saw, by count (one removed). Both stay as they are
        # here: a change is a difference of the full tier, never refreshed.
        self._sub_dicts = tuple(vars(sub) for _, sub in self._modules[1:])
        self._sub_flags = tuple(map(_training, self._sub_dicts))
        self._traced_hooks = tuple((hooks, len(hooks)) for _, sub in self._modules[1:]
                                   for hooks in (sub._forward_hooks, sub._forward_pre_hooks)
                                   if hooks)
        # and every hook dict that was empty, read on every call as well: torch moves the
        # handle counter before it stores a hook, so a hook another thread registers while
        # a call refreshes the counter lands after it, and only the dict itself shows it
        self._unhooked = tuple(hooks for _, sub in self._modules[1:]
                               for hooks in (sub._forward_hooks, sub._forward_pre_hooks)
                               if not hooks)
        # and which submodules had no children (one added to such a leaf, as
        # torch.nn.utils.parametrize or an adapter does, is seen in its _modules dict)
        self._leaves = tuple(not d.get("_modules") for d in self._sub_dicts)
        # every module's parameter and buffer dicts (the root's first), and what they held at
        # the last refresh: (where, dict, name, tensor or None, its data address)
        self._slot_dicts = tuple((where, dicts) for name, m in self._modules
                                 for where in (_where(name),)
                                 for dicts in (m._parameters, m._buffers))
        self._held: tuple[tuple[str, dict[str, Any], str, Any, int], ...] = ()
        # the every-call check and its source
        self._made: tuple[Callable[[], None], str] | None = None
        self.check: Callable[[], None]
        self.source = ""
        self.refresh()

    def refresh(self) -> None:
        """Take the every-call tier's references again, after a full check found nothing
        changed (an attribute set to an equal new value, an internal attribute torch added,
        a hook registered elsewhere). :attr:`check` is generated anew only when its text
        changes (a count, an attribute added that the full tier accepts); otherwise the
        objects it compares with are updated in its globals. An owner keeping :attr:`check`
        takes it again after each refresh."""
        if not self._every_call:
            return
        # a hook added anywhere: every hook handle takes the next id of one process-wide
        # counter (which other hooks, a tensor's, also move: the full tier then finds
        # nothing). Read before the hooks are counted: registering moves it first.
        handle_mark = _hook_handles.next_id
        self._held = tuple((where, slots, name, value,
                            value.data_ptr() if value is not None else 0)
                           for where, slots in self._slot_dicts
                           for name, value in list(slots.items()))
        # the tensor attributes read as inputs, as parameters are (where, the module's dict)
        self._held_attrs = tuple(
            (_where(path), attrs, name, value, value.data_ptr())
            for (path, m), reads in zip(self._modules, self._reads, strict=True)
            for attrs in (vars(m),) for name in sorted(reads)
            if isinstance(value := attrs.get(name), torch.Tensor))
        self._outside.refresh()
        names: dict[str, Any] = {}
        source = every_call_source(self, _root_terms(self, names), _user_attrs(self.module),
                                   tuple(map(_user_attrs, self._sub_dicts)), names)
        names["handle_mark"] = handle_mark
        names["changed"] = self._on_change
        made = self._made
        if made is None or made[1] != source:
            exec(compile(source, f"<every-call check of {type(self.module).__name__}>",
                         "exec"), names)
            # (one tuple: two threads refreshing at once leave a check and its source that
            # belong together, whichever wrote last)
            made = self._made = (names["check"], source)
        else:
            made[0].__globals__.update(names)
        self.check, self.source = made

    def moved_tensors(self) -> list[str]:
        """The parameters and buffers that, since the last refresh, were replaced by other
        tensors (``m.lin.weight = nn.Parameter(w)``, ``load_state_dict(..., assign=True)``,
        ``m.buf = t``) or whose memory moved (``p.data = t``): where each is, by name. Not a
        difference for the trace, which reads them as inputs on every call; a captured graph
        reads the old memory (see CompiledModel's graph drop)."""
        return [f"{where}.{name}" for where, slots, name, value, ptr in
                (*self._held, *self._held_attrs)
                if slots.get(name) is not value
                or (value is not None and value.data_ptr() != ptr)] + self._outside.moved()

    def difference(self, tensor_stores: bool = False) -> str | None:
        """The full tier: what differs from the snapshot, in words, or None.
        ``tensor_stores``: an attribute that now holds a tensor is not a difference (the check
        after the first call: a forward that stores a tensor has the store replayed)."""
        if _global_hook_ids() != self._global_ids:
            return ("the global module hooks (torch.nn.modules.module."
                    "register_module_forward_hook / _pre_hook) changed after the trace")
        now = _global_state()
        for name, then in self._global_state.items():
            if now[name] != then:
                return (f"{name} was {then} at the trace and is {now[name]} for this call (a "
                        "setting the trace's code was made for: call under the settings of "
                        "the first call)")
        modules = tuple(self.module.named_modules(remove_duplicate=False))
        if [n for n, _ in modules] != [n for n, _ in self._modules] or any(
                a is not b for (_, a), (_, b) in zip(modules, self._modules, strict=True)):
            return "a submodule was added, removed or replaced after the trace"
        for (name, sub), before, shaped, reads in zip(modules, self._subs, self._shaped,
                                                      self._attr_reads, strict=True):
            why = before.difference(_SubmoduleState(sub, shaped), _where(name), tensor_stores,
                                    reads, type(sub))
            if why is not None:
                return why
        return self._outside.difference()


def _tensor_reads(modules: tuple[tuple[str, nn.Module], ...],
                  reads: Collection[tuple[int, str]] | None
                  ) -> tuple[tuple[frozenset[str], ...], tuple[frozenset[str], ...]]:
    """Per module, the tensor attributes followed for moves and those compared by shape (see
    ``ModuleState``'s ``tensor_reads``)."""
    followed = tuple(frozenset(n for n, v in _user_attrs(m).items()
                               if isinstance(v, torch.Tensor)
                               and (reads is None or (id(m), n) in reads))
                     for _, m in modules)
    return followed, followed if reads is not None else tuple(frozenset() for _ in modules)


def _root_terms(state: ModuleState, names: dict[str, Any]) -> list[str]:
    """The every-call terms on the root module and on process-wide state (the root's flag,
    size, hooks and children; the hook-handle counter, the global module hooks, autocast and
    the default dtype), adding the objects they read, and the builtins every term may read, to
    ``names``."""
    module = state.module
    names.update({"hook_handles": _hook_handles, "len": len,
                  "isinstance": isinstance, "Tensor": torch.Tensor,
                  "module": module, "torch_module": _torch_module,
                  "root_flag": state.training,
                  "root_children": dict(module._modules),
                  "any_autocast": torch._C._is_any_autocast_enabled,
                  "autocast_at_trace": any(
                      v != "off" for k, v in state._global_state.items()
                      if k.startswith("autocast")),
                  "global_state": _global_state, "state_at_trace": state._global_state,
                  "default_dtype": torch.get_default_dtype,
                  "dtype_at_trace": state._global_state["the default dtype"]})
    return ["root['training'] is not root_flag",
            # process-wide settings the trace's code was made for (see _global_state)
            "any_autocast() is not autocast_at_trace",
            # autocast on at the trace: its dtype and device type too (read only then)
            "autocast_at_trace and global_state() != state_at_trace",
            "default_dtype() is not dtype_at_trace",
            "hook_handles.next_id != handle_mark",
            f"len(root) != {len(vars(module))}",
            "len(torch_module._global_forward_hooks) != "
            f"{len(_torch_module._global_forward_hooks)}",
            "len(torch_module._global_forward_pre_hooks) != "
            f"{len(_torch_module._global_forward_pre_hooks)}",
            f"len(root['_forward_pre_hooks']) != {len(module._forward_pre_hooks)}",
            f"len(root['_forward_hooks']) != {len(module._forward_hooks)}",
            # dicts compare their values by identity first (nn.Module has no __eq__)
            "root['_modules'] != root_children"]


def _nothing() -> None:
    return None


def has_uninitialised_lazy(module: nn.Module) -> bool:
    """Whether a lazy submodule (``nn.LazyLinear``...) still waits for its first call, which
    changes its attributes (``in_features``) legitimately."""
    return any(isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()
               for m in module.modules())


def _where(name: str) -> str:
    return f"model.{name}" if name else "model"
