"""freezeframe: trace once, split, compile per shape, capture CUDA graphs per padded batch size.

Importing the package has no side effects: it touches no CUDA state and patches nothing. The
public names are resolved lazily so ``import freezeframe`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from freezeframe._version import __version__

# The public surface (at most 15 names, plus the errors, ubatch and hf submodules): name ->
# module that defines it.
_EXPORTS = {
    "compile": "freezeframe.compilation",
    "CompilationConfig": "freezeframe.config",
    "CompilationMode": "freezeframe.config",
    "CUDAGraphMode": "freezeframe.config",
    "GraphRunner": "freezeframe.runtime",
    "Tokens": "freezeframe.runtime",
    "Requests": "freezeframe.runtime",
    "Static": "freezeframe.runtime",
    "forward_context": "freezeframe.context",
    "BatchDescriptor": "freezeframe.batch",
    "plan_capture_sizes": "freezeframe.planning",
    "FreezeframeError": "freezeframe.errors",
    "ConfigError": "freezeframe.errors",
    "InputMismatchError": "freezeframe.errors",
    "graph_break": "freezeframe.graphs.breakable",
}

# Reachable here so code written against earlier releases keeps working, but not part of the
# surface (not in __all__ or dir()): import them from the module named (``ff.errors``: every
# error type; ``model.stats``/``runner.stats`` are the Stats a user reads;
# ``freezeframe.compilation.current_compile_range`` for a custom pass).
_ALSO = {
    "CompileError": "freezeframe.errors",
    "Stats": "freezeframe.stats",
    "current_compile_range": "freezeframe.compilation",
    "CaptureError": "freezeframe.errors",
    "Range": "freezeframe.sizes",
    "ForwardContext": "freezeframe.context",
    "get_forward_context": "freezeframe.context",
    "CompiledModel": "freezeframe.compilation",
    "Dispatcher": "freezeframe.runtime",
    "ShapeOutOfRangeError": "freezeframe.errors",
    "FallbackError": "freezeframe.errors",
    "CacheError": "freezeframe.errors",
}

# public submodules -> the module each names, imported on first attribute access
# (``ff.ubatch.yield_to_comm()``, ``ff.errors.CaptureError``: every error type is there;
# ``ff.hf.compile(model)``: Hugging Face models, which imports transformers only then)
_SUBMODULES = {"errors": "freezeframe.errors", "ubatch": "freezeframe.ubatch",
               "hf": "freezeframe.integrations.hf"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe import errors, ubatch
    from freezeframe.batch import BatchDescriptor
    from freezeframe.compilation import CompiledModel, compile, current_compile_range
    from freezeframe.config import CompilationConfig, CompilationMode, CUDAGraphMode
    from freezeframe.context import ForwardContext, forward_context, get_forward_context
    from freezeframe.errors import (
        CacheError,
        CaptureError,
        CompileError,
        ConfigError,
        FallbackError,
        FreezeframeError,
        InputMismatchError,
        ShapeOutOfRangeError,
    )
    from freezeframe.graphs.breakable import graph_break
    from freezeframe.integrations import hf
    from freezeframe.planning import plan_capture_sizes
    from freezeframe.runtime import Dispatcher, GraphRunner, Requests, Static, Tokens
    from freezeframe.sizes import Range
    from freezeframe.stats import Stats


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    module = _EXPORTS.get(name) or _ALSO.get(name)
    if module is None:
        raise AttributeError(f"module 'freezeframe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
