"""Counting freezeframe's own Python calls in one step or one first call (a profile hook).

A newcomer follows a step or a first call through the code by reading; the number of
freezeframe functions it enters, and how often it crosses from one module to another, say how
long that reading is. :func:`count_calls` runs a function under ``sys.setprofile`` and keeps
every call of a Python function of freezeframe's own:

* a function whose code lives in the freezeframe package, or code freezeframe generated (its
  file name starts with ``<every-call check`` or ``<freezeframe``); torch's code, fx's
  generated code (the stitching graph, the pieces) and the caller's are not counted;
* not the emulated graph backend's replay of recorded ops (``graphs/emulated*.py``) nor the
  model's own code (``models/``: the model and its op), nor anything they call: on CUDA the
  replay is one driver call, and the model is the user's.

A *module switch* is a counted call whose function lives in another module than its nearest
counted caller (the first call, from outside freezeframe, is one too).

The scenarios :data:`SCENARIOS` are the ones issue 45 holds limits on, with
``freezeframe.models.example.ExampleMLP`` (2 layers: 5 pieces, 3 capturable), the eager
compiler, the compile cache off and the emulated graph backend:

* ``first-call``: the first call of ``ff.compile(ExampleMLP())`` (it traces, splits, compiles);
* ``full-step`` / ``piecewise-step``: a planned step of a captured ``GraphRunner`` (3 tokens
  padded to 4), FULL or PIECEWISE graphs;
* ``first-full-step`` / ``first-piecewise-step``: the first step of that shape (it plans).

``scripts/count_calls.py`` prints them; ``tests/unit/test_call_counts.py`` holds the limits.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

__all__ = ["SCENARIOS", "Counted", "count_calls", "scenario"]


@dataclasses.dataclass(frozen=True)
class Counted:
    """The counted calls, in order: (module, function) each."""

    calls: tuple[tuple[str, str], ...]
    switches: int

    @property
    def modules(self) -> list[str]:
        """The modules entered, in first-entry order."""
        return list(dict.fromkeys(module for module, _ in self.calls))

    def table(self) -> str:
        lines = [f"{i + 1:4d}  {module}.{name}" for i, (module, name) in
                 enumerate(self.calls)]
        return "\n".join(lines)


def _package_dir() -> str:
    import freezeframe
    return os.path.dirname(os.path.abspath(freezeframe.__file__)) + os.sep


def _module_of(filename: str, package: str) -> str | None:
    """The freezeframe module a code object's file is (``runtime/plan.py`` ->
    ``runtime.plan``), ``"<generated>"`` for code freezeframe generated, or None: not
    counted."""
    if filename.startswith(package):
        rel = filename[len(package):]
        return rel[:-3].replace(os.sep, ".") if rel.endswith(".py") else rel
    if filename.startswith(("<every-call check", "<freezeframe")):
        return "<generated>"
    return None


_EXCLUDED = ("graphs.emulated", "models.")


def count_calls(fn: Callable[[], Any]) -> Counted:
    """Run ``fn()`` and count freezeframe's calls in it (see the module docstring)."""
    package = _package_dir()
    calls: list[tuple[str, str]] = []
    # per live frame we watch: its counted module, or None for an excluded subtree
    stack: list[tuple[FrameType, str | None]] = []
    switches = 0
    modules: dict[str, str | None] = {}

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal switches
        if event == "call":
            if stack and stack[-1][1] is None:  # inside an excluded subtree
                stack.append((frame, None))
                return
            filename = frame.f_code.co_filename
            module = modules.get(filename, "")
            if module == "":
                module = modules[filename] = _module_of(filename, package)
            if module is None:
                return  # not freezeframe's: not counted, its callees are looked at
            if module.startswith(_EXCLUDED):
                stack.append((frame, None))
                return
            caller = stack[-1][1] if stack else None
            if caller != module:
                switches += 1
            calls.append((module, frame.f_code.co_qualname))
            stack.append((frame, module))
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return Counted(tuple(calls), switches)


# -- the scenarios -------------------------------------------------------------------------------
def _config(graph_mode: str) -> Any:
    import freezeframe as ff
    from freezeframe.models.example import MIX_OP
    return ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=[MIX_OP], cudagraph_mode=graph_mode,
        graph_backend="emulated", cudagraph_capture_sizes=[1, 2, 4, 8], max_num_tokens=8,
        max_num_seqs=8, use_cache=False)


def _first_call() -> Callable[[], Any]:
    import freezeframe as ff
    from freezeframe.models.example import ExampleMLP
    module = ExampleMLP()
    model = ff.compile(module, _config("none"))
    x = module.example_input(3)
    return lambda: model(x)


def _runner_step(graph_mode: str, planned: bool) -> Callable[[], Any]:
    import freezeframe as ff
    from freezeframe.models.example import ExampleMLP
    from freezeframe.runtime import GraphRunner, Tokens
    module = ExampleMLP()
    cfg = _config(graph_mode)
    model = ff.compile(module, cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(module.hidden_size)},
                         progress=False)
    runner.capture()
    x = module.example_input(3)
    if planned:
        runner(x)  # the first step of the shape plans it
        runner(x)
    return lambda: runner(x)


SCENARIOS: dict[str, Callable[[], Callable[[], Any]]] = {
    "first-call": _first_call,
    "full-step": lambda: _runner_step("full", True),
    "piecewise-step": lambda: _runner_step("piecewise", True),
    "first-full-step": lambda: _runner_step("full", False),
    "first-piecewise-step": lambda: _runner_step("piecewise", False),
}


def scenario(name: str) -> Counted:
    """The calls of scenario ``name`` (set up first, then counted alone)."""
    with torch.inference_mode(False):
        call = SCENARIOS[name]()
        return count_calls(call)
