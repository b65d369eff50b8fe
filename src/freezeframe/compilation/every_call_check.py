"""The source of a :class:`~freezeframe.compilation.module_state.ModuleState`'s every-call check.

The every-call tier of the module-state check (see :mod:`freezeframe.compilation.module_state`)
runs before every call, so it is generated: one straight-line function per module layout, whose
condition is a chain of terms, each an identity test, a dict subscript or a ``len`` of a dict on
objects it reads by name from its globals. This module writes that source: the terms on the
submodules (flag, size, hooks, children), on the parameter and buffer slots, and on the user
attributes, after the root's and process-wide terms that ``module_state`` makes and before the
outside reads' (:mod:`~freezeframe.compilation.outside_reads`). Compiling it, and refreshing
its globals when only the objects moved, stays with ``ModuleState.refresh``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from freezeframe.compilation.module_state import ModuleState

__all__ = ["every_call_source"]


def every_call_source(state: ModuleState, root_terms: list[str], user: dict[str, Any],
                      below: tuple[dict[str, Any], ...], names: dict[str, Any]) -> str:
    """The source of the every-call tier of ``state`` as one function; the objects it reads
    by name (its globals) are added to ``names``. ``root_terms``: the terms on the root module
    and on process-wide state, which :mod:`~freezeframe.compilation.module_state` makes (it
    reads those settings), their objects already in ``names``. ``user`` and ``below`` are the
    root's and each submodule's user attributes as they are now. The function returns when
    nothing it reads moved, and calls ``changed`` (the owner's full check) otherwise.

    Every object it reads is a name of the function's globals (``handle_mark``, the root's
    attribute names and objects ``attr_0``/``held_0``..., each submodule's
    ``attr1_0``/``held1_0``...) and the only literals in its text are counts, so a refresh
    whose text is the same only updates those names. The check runs as straight-line
    bytecode the interpreter specialises (a dict subscript, ``len`` of a dict, an identity
    test): measured in place between a toy
    Llama's ops on the development CPU, about half of the same checks made through
    ``map``/``itemgetter`` loops, whose per-item calls dominate there. The root's
    ``__dict__`` and torch's global hook dicts are looked up on every call (either may be
    replaced); below the root, each submodule's ``__dict__`` is the one the trace saw. For a
    two-layer model with no hooks::

        def check():
            try:
                root = module.__dict__
                if not (root['training'] is not root_flag
                        or hook_handles.next_id != handle_mark
                        or len(root) != 31
                        or len(torch_module._global_forward_hooks) != 0 or ...
                        or root['_modules'] != root_children
                        or sub0['training'] is not flag0 or len(sub0) != 31
                        or ...
                        or sub3['training'] is not flag3 or len(sub3) != 17 or sub3['_modules']
                        or ...
                        or unhooked0 or unhooked1 or ...
                        or parent0['_modules'] != children0 or ...
                        or root[attr_0] is not held_0 or ...
                        or sub1[attr1_0] is not held1_0 or ...):
                    return
            except Exception:  # nn.Module's own attributes deleted...
                pass
            changed()

    Each part of the condition is made by its own helper, in this order: the root and the
    process-wide state (``root_terms``), the submodules, the parameters and buffers, the user
    attributes, and what forward reads from outside its modules.
    """
    terms = [*root_terms, *_submodule_terms(state, names), *_slot_terms(state, names),
             *_attribute_terms(user, below, state._reads, names), *state._outside.terms(names)]
    return ("def check():\n    try:\n        root = module.__dict__\n"
            "        if not (" + "\n                or ".join(terms) +
            "):\n            return\n    except Exception:\n        pass\n"
            "    changed()\n")


def _submodule_terms(state: ModuleState, names: dict[str, Any]) -> list[str]:
    """The every-call terms below the root, through the ``__dict__`` each submodule had at the
    trace: its flag and size (and, for a leaf, that it still has no children), each hook dict
    that was empty and is not, each traced hook dict's count, and each parent's children;
    adding the objects they read to ``names``."""
    terms = []
    for k, (flag, attrs, leaf) in enumerate(zip(state._sub_flags, state._sub_dicts,
                                                state._leaves, strict=True)):
        names[f"sub{k}"], names[f"flag{k}"] = attrs, flag
        term = f"sub{k}['training'] is not flag{k} or len(sub{k}) != {len(attrs)}"
        terms.append(term + f" or sub{k}['_modules']" if leaf else term)
    for k, hooks in enumerate(state._unhooked):
        names[f"unhooked{k}"] = hooks
        terms.append(f"unhooked{k}")
    for k, (hooks, count) in enumerate(state._traced_hooks):
        names[f"hooked{k}"] = hooks
        terms.append(f"len(hooked{k}) != {count}")
    parents = [d for d, leaf in zip(state._sub_dicts, state._leaves, strict=True) if not leaf]
    for k, attrs in enumerate(parents):
        names[f"parent{k}"], names[f"children{k}"] = attrs, dict(attrs["_modules"])
        terms.append(f"parent{k}['_modules'] != children{k}")
    return terms


def _slot_terms(state: ModuleState, names: dict[str, Any]) -> list[str]:
    """The every-call terms on parameters and buffers: each dict's size, and each slot's tensor
    (or None) and the address of its memory, as at the last refresh (a replaced or moved tensor
    is what a captured graph cannot see; the full tier decides what it means); adding the
    objects they read to ``names``."""
    terms = []
    index = {}
    for k, (_, slots) in enumerate(state._slot_dicts):
        names[f"slots{k}"], index[id(slots)] = slots, k
        terms.append(f"len(slots{k}) != {len(slots)}")
    for j, (_, slots, name, value, ptr) in enumerate(state._held):
        k = index[id(slots)]
        names[f"slot_{j}"], names[f"tensor_{j}"], names[f"ptr_{j}"] = name, value, ptr
        if value is None:
            terms.append(f"slots{k}[slot_{j}] is not None")
        else:
            terms.append(f"slots{k}[slot_{j}] is not tensor_{j} "
                         f"or tensor_{j}.data_ptr() != ptr_{j}")
    return terms


def _attribute_terms(user: dict[str, Any], below: tuple[dict[str, Any], ...],
                     reads: tuple[frozenset[str], ...], names: dict[str, Any]) -> list[str]:
    """The every-call terms on the user attributes of the root (``user``) and of each
    submodule (``below``): each still holds the same object; a tensor the trace reads as an
    input (``reads``, per module) also at the same memory, as a parameter; any other tensor
    (one forward stores) only a tensor still. Adds the names and objects read to ``names``."""
    terms = []
    for holder, tag, attrs, read in (
            ("root", "", user, reads[0]),
            *((f"sub{k}", str(k), a, reads[k + 1]) for k, a in enumerate(below))):
        for j, (name, value) in enumerate(attrs.items()):
            attr, held = f"attr{tag}_{j}", f"held{tag}_{j}"
            names[attr], names[held] = name, value
            if isinstance(value, torch.Tensor) and name in read:
                names[f"ptr{tag}_{j}"] = value.data_ptr()
                terms.append(f"{holder}[{attr}] is not {held} "
                             f"or {held}.data_ptr() != ptr{tag}_{j}")
            elif isinstance(value, torch.Tensor):  # (stored by forward: replayed anew)
                terms.append(f"not isinstance({holder}[{attr}], Tensor)")
            else:
                terms.append(f"{holder}[{attr}] is not {held}")
    return terms
