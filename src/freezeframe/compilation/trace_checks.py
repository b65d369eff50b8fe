"""What a compiled model refuses or warns about when it traces, and how a failed trace reads.

freezeframe keeps one trace per call structure and checks the module's Python state instead of
Dynamo's guards, so a few things that plain ``torch.compile`` tolerates would give wrong
answers here; they are refused at the first trace, with the fix:

* hooks registered on the compiled module itself (a trace of its ``forward`` skips them);
* a ``forward`` that changes the module's own Python state (a trace would repeat the value);
* a failed trace: Dynamo's error becomes a :class:`~freezeframe.errors.CompileError` saying why
  a graph break is fatal here, an exception forward raises itself reaches the caller as eager
  raises it, and our own errors come out of Dynamo's wrapper.

A Python branch on a dynamic size is allowed (the other side is traced separately) but warned
about once per condition, at the user's line.
"""

from __future__ import annotations

import logging
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from freezeframe.compilation.module_state import ModuleState
from freezeframe.compilation.size_conditions import is_size_equality
from freezeframe.compilation.trace import TraceOnce
from freezeframe.errors import CompileError, FreezeframeError
from freezeframe.stats import Stats

__all__ = [
    "refuse_root_hooks",
    "refuse_self_changing_forward",
    "reraise_trace_failure",
    "run_eagerly",
    "warn_about_branches",
    "warn_at_caller",
]

logger = logging.getLogger(__name__)

# Where freezeframe's and torch's own frames are: a warning is reported at the first frame
# outside them, the user's line that called the model.
_INTERNAL = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
             os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def warn_at_caller(message: str) -> None:
    """``warnings.warn`` pointing at the first frame outside freezeframe and torch."""
    frame: types.FrameType | None = sys._getframe(0)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def refuse_root_hooks(module: nn.Module, model_key: str) -> None:
    """Dynamo traces the compiled module's ``forward``, not its ``__call__``: hooks
    registered on that module itself would never run, so they are refused (hooks on its
    submodules are traced with them)."""
    kinds = [kind for kind, hooks in (
        ("forward ", module._forward_hooks), ("forward pre-", module._forward_pre_hooks),
        ("backward ", module._backward_hooks),
        ("backward pre-", module._backward_pre_hooks)) if hooks]
    if kinds:
        raise CompileError(
            f"{model_key}: the compiled module has {' and '.join(kinds)}hook(s) "
            "registered on itself, which a trace of its forward would skip (its "
            "submodules' hooks are traced). Register them on the compiled model instead "
            "(ff.compile(...).register_forward_hook(...)), where they run on every call, or "
            "remove them before the first call")


def refuse_self_changing_forward(before: ModuleState, model_key: str) -> None:
    """Raise when the traced call changed the module's Python state (``before`` it)."""
    why = before.difference(tensor_stores=True)
    if why is None:
        return
    raise CompileError(
        f"{model_key}: forward changes the module's own Python state while it runs "
        f"({why} after the first call). A trace replays what the first call did, so every "
        "later call would repeat that value instead of going on from it. Keep such state "
        "in a tensor buffer (self.register_buffer(...)) and update it in place, or keep it "
        "out of forward")


def reraise_trace_failure(exc: BaseException, model_key: str,
                          run_eagerly: Callable[[], Any]) -> None:
    """Raise what the caller should see for a trace that raised ``exc``: the exception
    forward raised itself (``run_eagerly`` reproduces it, as torch.compile would), a
    CompileError for code Dynamo cannot trace, our own error unwrapped from Dynamo's, or
    ``exc`` itself."""
    unsupported = isinstance(exc, torch._dynamo.exc.Unsupported)
    if unsupported and "Observed exception" in str(exc):
        # forward raised an exception of its own (input validation): what the user gets
        # from eager, and from torch.compile, which runs the frame eagerly then
        try:
            run_eagerly()
        except Exception as users:
            raise users.with_traceback(users.__traceback__) from None
        logger.debug("%s: Dynamo observed an exception that eager did not raise: %s",
                     model_key, exc)
    if unsupported:
        # Dynamo's message names the line and what it could not trace; ours says why that
        # is fatal here and what to do.
        raise CompileError(
            f"{model_key}: forward cannot be traced as one graph, which freezeframe needs (it "
            "splits that graph at the splitting ops and captures the pieces; there are no "
            "graph breaks to fall back on). Dynamo says:\n"
            f"{_first_lines(str(exc), 12)}\nMake that code traceable (torch.where or "
            "torch.cond for a branch on tensor values, no .item() in control flow), move it "
            "out of forward, or compile the module with torch.compile instead") from exc
    inner = getattr(exc, "inner_exception", None)
    if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed) and isinstance(
            inner, FreezeframeError):
        # Dynamo wraps what our compile path raised in its own error type; the user gets
        # ours, with its message and fix, not Dynamo's wrapper around it.
        raise inner.with_traceback(None) from exc
    raise exc


def warn_about_branches(trace: TraceOnce, model_key: str, warned: set[str],
                        stats: Stats) -> None:
    """Warn once per condition (``warned`` holds those already warned about) that ``trace``
    branches on a dynamic size, counted in ``stats.size_branches``."""
    for expr, where in trace.size_conditions:
        if is_size_equality(expr):
            continue  # two sizes that must be equal: checked per call, not a branch
        text = str(expr)
        for sym, (name, dim) in trace.size_symbols.items():
            text = text.replace(str(sym), f"{name}.shape[{dim}]")
        if text in warned:
            continue
        warned.add(text)
        stats.inc("size_branches")
        message = (f"{model_key}: forward branches on a dynamic size ({text}, at {where}); "
                   "this trace serves only the sizes where that holds, and a size on the "
                   "other side is traced separately (counted in stats.retraces). Make "
                   "forward's control flow independent of the batch size to trace once")
        logger.warning(message)
        warn_at_caller(message)


def _first_lines(text: str, n: int) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:n] + (["  ..."] if len(lines) > n else []))


def run_eagerly(module: nn.Module, why: str, model_key: str, stats: Stats, warned: set[str],
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The documented fallback when Dynamo cannot trace (``why``): run the module as it is,
    counted in ``stats.compile_disabled`` and warned about once per model."""
    stats.inc("compile_disabled")
    if "compile_disabled" not in warned:
        warned.add("compile_disabled")
        message = (f"{model_key}: {why}, so this call runs the module eagerly (no trace, no "
                   "compiled pieces, no graphs); calls keep running eagerly until Dynamo is "
                   "enabled again, and are counted in stats.compile_disabled")
        logger.warning(message)
        warn_at_caller(message)
    return module(*args, **kwargs)
