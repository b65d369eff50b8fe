"""The exception hierarchy.

Every error freezeframe raises for bad input derives from :class:`FreezeframeError`, and its
message names the problem, the offending value and the fix. Subclasses also derive from the
builtin a caller would naturally catch (``ValueError`` for bad configuration, ``RuntimeError``
for capture misuse), so existing ``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "CaptureError",
    "CompileError",
    "ConfigError",
    "FallbackError",
    "FreezeframeError",
    "GraphMemoryBudgetError",
    "InputMismatchError",
    "MicroBatchError",
    "ShapeOutOfRangeError",
    "VerifyError",
]


class FreezeframeError(Exception):
    """Base class of every error freezeframe raises on purpose."""


class ConfigError(FreezeframeError, ValueError):
    """A configuration value breaks a rule; the message names field, value, rule and fix."""


class CompileError(FreezeframeError, RuntimeError):
    """Tracing, splitting or compiling a model failed in a way the user can act on."""


class ShapeOutOfRangeError(FreezeframeError, ValueError):
    """A runtime size falls outside every compile range or above the largest captured size."""


class CaptureError(FreezeframeError, RuntimeError):
    """A graph capture was attempted where it is not allowed (outside the capture window,
    a host sync inside the captured region, ...)."""


class GraphMemoryBudgetError(CaptureError):
    """The graphs a runner would capture are predicted to need more memory than its
    ``graph_memory_budget``; nothing was kept."""


class InputMismatchError(FreezeframeError, RuntimeError):
    """A replay received inputs that differ from the captured ones (address, dtype, device)."""


class FallbackError(FreezeframeError, RuntimeError):
    """A step would fall back to eager execution while the runner is in strict mode."""


class CacheError(FreezeframeError, RuntimeError):
    """The on-disk compile cache cannot be used safely (for example a directory other users can
    write to)."""


class MicroBatchError(FreezeframeError, RuntimeError):
    """A micro-batched step could not complete: a thread timed out or the schedule broke."""


class VerifyError(FreezeframeError, RuntimeError):
    """A graph step checked with ``GraphRunner(..., verify=N)`` gave another answer than the
    module run eagerly on the same inputs."""
