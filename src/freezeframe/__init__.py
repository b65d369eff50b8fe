"""freezeframe: trace once, split, compile per shape, capture CUDA graphs per padded batch size.

Importing the package has no side effects: it touches no CUDA state and patches nothing. The
public names are resolved lazily so ``import freezeframe`` stays cheap.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "BatchDescriptor": "freezeframe.batch",
    "CUDAGraphMode": "freezeframe.config",
    "CompilationConfig": "freezeframe.config",
    "CompilationMode": "freezeframe.config",
    "Range": "freezeframe.sizes",
    "ForwardContext": "freezeframe.context",
    "forward_context": "freezeframe.context",
    "get_forward_context": "freezeframe.context",
    "Stats": "freezeframe.stats",
    "compile": "freezeframe.compile",
    "CompiledModel": "freezeframe.compile",
    "GraphRunner": "freezeframe.runtime",
    "Dispatcher": "freezeframe.runtime",
    "Tokens": "freezeframe.runtime",
    "Requests": "freezeframe.runtime",
    "Static": "freezeframe.runtime",
    "FreezeframeError": "freezeframe.errors",
    "ConfigError": "freezeframe.errors",
    "CompileError": "freezeframe.errors",
    "CaptureError": "freezeframe.errors",
    "ShapeOutOfRangeError": "freezeframe.errors",
    "InputMismatchError": "freezeframe.errors",
    "FallbackError": "freezeframe.errors",
    "CacheError": "freezeframe.errors",
}

# public submodules, imported on first attribute access (``ff.ubatch.yield_to_comm()``)
_SUBMODULES = ("ubatch",)

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe import ubatch
    from freezeframe.batch import BatchDescriptor
    from freezeframe.compile import CompiledModel, compile
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
    from freezeframe.runtime import Dispatcher, GraphRunner, Requests, Static, Tokens
    from freezeframe.sizes import Range
    from freezeframe.stats import Stats


class _Package(types.ModuleType):
    """The package's module type, so that ``ff.compile`` is always the function.

    ``freezeframe.compile`` is also a subpackage, and importing it (say ``from
    freezeframe.compile.cache import ...``) makes the import system set the package attribute
    ``compile`` to the subpackage module, hiding the function. A property on the module type
    takes precedence over that attribute. Import the subpackage's modules with ``from
    freezeframe.compile import x`` / ``from freezeframe.compile.x import y``.
    """

    @property
    def compile(self) -> Any:
        return importlib.import_module("freezeframe.compile").compile

    @compile.setter
    def compile(self, value: Any) -> None:
        # Called by the import system with the subpackage; it stays in sys.modules.
        pass


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"freezeframe.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'freezeframe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
