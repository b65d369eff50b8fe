"""A global module hook registered after a trace: every compiled call must refuse it."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from freezeframe.errors import CompileError


def refused_under_a_global_hook(model: Any, *args: Any) -> None:
    """Register a global forward hook (which reaches the submodules a trace inlined), check
    that calling ``model(*args)`` is refused, and remove the hook again, even on failure."""
    handle = nn.modules.module.register_module_forward_hook(lambda mod, i, o: o)
    try:
        with pytest.raises(CompileError, match="global module hooks"):
            model(*args)
    finally:
        handle.remove()
