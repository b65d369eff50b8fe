"""The compile path: trace once, split at splitting ops, compile each piece per range/size."""

from freezeframe.compilation.compilers import current_compile_range
from freezeframe.compilation.model import CompiledModel, compile

__all__ = ["CompiledModel", "compile", "current_compile_range"]
