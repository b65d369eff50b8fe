"""The compile path: trace once, split at splitting ops, compile each piece per range/size."""

from freezeframe.compile.model import CompiledModel, compile

__all__ = ["CompiledModel", "compile"]
