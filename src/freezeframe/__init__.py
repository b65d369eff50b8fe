"""freezeframe: trace once, split, compile per shape, capture CUDA graphs per padded batch size.

Importing the package has no side effects: it touches no CUDA state and patches nothing. The
public names are resolved lazily so ``import freezeframe`` stays cheap.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from freezeframe._version import __version__

# The public surface: fifteen names, every error type a call can raise, and the errors, ubatch
# and hf submodules. Name -> module that defines it.
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

# The rest of freezeframe.errors: a user catches these, so they sit beside the three above.
_ERRORS = ("CacheError", "CaptureError", "CompileError", "FallbackError",
           "GraphMemoryBudgetError", "MicroBatchError", "ShapeOutOfRangeError", "VerifyError")

# Names 0.1.0 also reached as ``ff.<name>``, now read from their home module. They still resolve,
# with a DeprecationWarning naming that module, until 0.2.0 removes them.
_MOVED = {
    "Stats": "freezeframe.stats",
    "Range": "freezeframe.sizes",
    "ForwardContext": "freezeframe.context",
    "get_forward_context": "freezeframe.context",
    "current_compile_range": "freezeframe.compilation",
    "CompiledModel": "freezeframe.compilation",
    "Dispatcher": "freezeframe.runtime",
}

# public submodules -> the module each names, imported on first attribute access
# (``ff.ubatch.yield_to_comm()``, ``ff.errors.CaptureError``: every error type is there;
# ``ff.hf.compile(model)``: Hugging Face models, which imports transformers only then)
_SUBMODULES = {"errors": "freezeframe.errors", "ubatch": "freezeframe.ubatch",
               "hf": "freezeframe.integrations.hf"}

__all__ = sorted([*_EXPORTS, *_ERRORS, *_SUBMODULES, "__version__"])

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe import errors, ubatch
    from freezeframe.batch import BatchDescriptor
    from freezeframe.compilation import compile
    from freezeframe.config import CompilationConfig, CompilationMode, CUDAGraphMode
    from freezeframe.context import forward_context
    from freezeframe.errors import (
        CacheError,
        CaptureError,
        CompileError,
        ConfigError,
        FallbackError,
        FreezeframeError,
        GraphMemoryBudgetError,
        InputMismatchError,
        MicroBatchError,
        ShapeOutOfRangeError,
        VerifyError,
    )
    from freezeframe.graphs.breakable import graph_break
    from freezeframe.integrations import hf
    from freezeframe.planning import plan_capture_sizes
    from freezeframe.runtime import GraphRunner, Requests, Static, Tokens


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    if name in _MOVED:
        warnings.warn(f"freezeframe.{name} is deprecated and goes in 0.2.0: import it from "
                      f"{_MOVED[name]} (from {_MOVED[name]} import {name})",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    module = _EXPORTS.get(name) or ("freezeframe.errors" if name in _ERRORS else None)
    if module is None:
        raise AttributeError(f"module 'freezeframe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
