"""Registering the reference models' custom ops with ``torch.library``'s low-level API.

A splitting op runs eagerly between the captured graphs on every step, so the cost of *calling*
it is host time on every step. ``torch.library.custom_op`` wraps each call in Python (binding
the arguments, checking autograd): on the development CPU about 51 µs per call under
``torch.no_grad()``, against about 7 µs for the same body defined with ``Library.define`` and
registered with ``Library.impl`` (the comparison is in ``docs/results/cpu-2026-11-25.md``). So
the library's own ops are defined here at that level:

* the schema is written out, with ``Tensor(a!)`` marking each argument the op writes into (what
  ``mutates_args`` says for ``custom_op``);
* the body is the ``CompositeExplicitAutograd`` kernel (every device), run with grad mode off:
  there is no autograd formula (the ops are for inference, and graphs record no autograd
  history anyway);
* the fake kernel, which shape propagation and Dynamo use, is registered beside it.

Registration is process-wide, as every ``torch.library`` op is: a module imported a second time
under another name finds its op defined and reuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["define_op"]


def define_op(qualname: str, schema: str, kernel: Callable[..., Any],
              fake: Callable[..., Any]) -> torch.library.Library | None:
    """Define ``qualname`` (``"namespace::name"``) with the argument ``schema`` (``"(Tensor x,
    Tensor(a!) out) -> ()"``), ``kernel`` as its implementation on every device and ``fake`` as
    its fake kernel. Returns the ``Library`` holding the registration (keep it referenced for as
    long as the op is used), or None when the op was defined already."""
    namespace, name = qualname.split("::")
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
        return None  # defined already (this module imported again under another name)
    except RuntimeError:
        pass
    library = torch.library.Library(namespace, "FRAGMENT")
    library.define(f"{name}{schema}")

    def without_autograd(*args: Any, **kwargs: Any) -> Any:
        # No autograd formula: the body runs with grad mode off, so an op it calls with an
        # out= argument accepts inputs that require grad (as custom_op's wrapper allows).
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return kernel(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(grad)

    library.impl(name, without_autograd, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=library)
    return library
