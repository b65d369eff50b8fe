"""``import freezeframe`` is cheap and side-effect free: no CUDA, no Dynamo, no Inductor."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import freezeframe

REPO = Path(__file__).resolve().parents[2]

HEAVY = ("torch._dynamo", "torch._inductor")

PROBE = """
import json, sys
import freezeframe as ff
after_import = sorted(m for m in sys.modules if m == "torch" or m.startswith(%(heavy)r))
lazy_before = sorted(n for n in ff.__all__ if n in vars(ff))
# the light public names: config, context, errors, stats
ff.CompilationConfig(backend="eager", cudagraph_capture_sizes=[1, 2]).cache_key()
with ff.forward_context(ff.BatchDescriptor(num_tokens=2), mode=ff.CUDAGraphMode.PIECEWISE):
    pass
from freezeframe.stats import Stats
from freezeframe.sizes import Range
Stats().inc("x")
ff.ConfigError, ff.CaptureError, Range
after_use = sorted(m for m in sys.modules if m.startswith(%(heavy)r))
import torch
print(json.dumps({"after_import": after_import, "lazy_before": lazy_before,
                  "after_use": after_use, "cuda_initialized": torch.cuda.is_initialized()}))
"""


def test_import_touches_no_cuda_dynamo_or_inductor() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", PROBE % {"heavy": HEAVY}],
                          capture_output=True, text=True, env=env, timeout=300, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # importing the package does not even import torch
    assert result["after_import"] == []
    # public names are resolved on first access, not at import
    assert result["lazy_before"] == ["__version__"]
    assert result["after_use"] == []
    assert result["cuda_initialized"] is False


def test_all_and_dir() -> None:
    submodules = getattr(freezeframe, "_SUBMODULES", ())
    assert freezeframe.__all__ == sorted([*freezeframe._EXPORTS, *freezeframe._ERRORS, *submodules,
                                          "__version__"])
    assert dir(freezeframe) == freezeframe.__all__
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = freezeframe.nope  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(freezeframe._EXPORTS))
def test_every_public_name_resolves(name: str) -> None:
    value = getattr(freezeframe, name)
    assert getattr(value, "__name__", name) == name


def test_compile_is_the_function_even_after_importing_the_subpackage() -> None:
    # Importing freezeframe.compilation.<x> makes the import system set the package attribute
    # `compile` to the subpackage; ff.compile must stay the function.
    code = ("import freezeframe.compilation.split, freezeframe as ff, inspect; "
            "print(inspect.isfunction(ff.compile), "
            "ff.compile.__module__.startswith('freezeframe.'))")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, check=True)
    assert proc.stdout.split() == ["True", "True"]


def test_the_public_surface_is_fifteen_names_and_every_error() -> None:
    assert sorted(freezeframe._EXPORTS) == [
        "BatchDescriptor", "CUDAGraphMode", "CompilationConfig", "CompilationMode",
        "ConfigError", "FreezeframeError", "GraphRunner", "InputMismatchError", "Requests",
        "Static", "Tokens", "compile", "forward_context", "graph_break", "plan_capture_sizes"]
    from freezeframe import errors

    error_types = sorted(name for name, value in vars(errors).items()
                         if isinstance(value, type) and issubclass(value, errors.FreezeframeError))
    assert sorted([*freezeframe._ERRORS, "ConfigError", "FreezeframeError",
                   "InputMismatchError"]) == error_types
    for name in error_types:
        assert getattr(freezeframe, name) is getattr(errors, name)
        assert name in dir(freezeframe)
    assert freezeframe.errors is errors


@pytest.mark.parametrize("name", sorted(freezeframe._MOVED))
def test_a_moved_name_resolves_with_a_warning_naming_its_home(name: str) -> None:
    home = freezeframe._MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"import it from {home} \(from {home} import "
                                                rf"{name}\)"):
        value = getattr(freezeframe, name)
    assert value is getattr(importlib.import_module(home), name)
    assert name not in dir(freezeframe)
    # never cached: every read warns, until 0.2.0 removes it
    assert name not in vars(freezeframe)
