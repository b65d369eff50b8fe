"""``import freezeframe`` is cheap and side-effect free: no CUDA, no Dynamo, no Inductor."""

from __future__ import annotations

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
ff.Stats().inc("x")
ff.ConfigError, ff.Range
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
    assert freezeframe.__all__ == sorted([*freezeframe._EXPORTS, *submodules, "__version__"])
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


def test_the_public_surface_is_fifteen_names_and_older_names_still_resolve() -> None:
    assert sorted(freezeframe._EXPORTS) == [
        "BatchDescriptor", "CUDAGraphMode", "CompilationConfig", "CompilationMode",
        "ConfigError", "FreezeframeError", "GraphRunner", "InputMismatchError", "Requests",
        "Static", "Tokens", "compile", "forward_context", "graph_break", "plan_capture_sizes"]
    from freezeframe import compilation, errors, sizes, stats

    assert freezeframe.errors is errors
    assert freezeframe.CaptureError is errors.CaptureError  # type: ignore[attr-defined]
    assert freezeframe.Range is sizes.Range  # type: ignore[attr-defined]
    assert "CaptureError" not in dir(freezeframe)
    assert freezeframe.Stats is stats.Stats  # type: ignore[attr-defined]
    assert freezeframe.current_compile_range is compilation.current_compile_range  # type: ignore[attr-defined]
    assert freezeframe.CompileError is errors.CompileError  # type: ignore[attr-defined]
    assert "Stats" not in dir(freezeframe) and "current_compile_range" not in dir(freezeframe)
