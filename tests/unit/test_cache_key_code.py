"""Code without a source file (``python -c``, ``exec``, ``<stdin>``, notebooks) is keyed by its
code objects, so an edited model never warm-starts from the old trace, while an unchanged one
still does. Every test uses a tmp_path cache root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import freezeframe as ff
from freezeframe.cache import files as ff_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ff_files.ENV_DISABLE_CACHE, raising=False)
    monkeypatch.delenv(ff_files.ENV_CACHE_DIR, raising=False)


# A model whose forward and helper live in code without a file; {k} and {b} are the edits.
_MODEL = """
import torch
from torch import nn
from tests.helpers.silly import attention


def bump(x):
    return x + {b}


class Typed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = attention(x, x, x)
        return bump(x * {k})
"""


def _exec_model(k: float, b: float, name: str) -> Any:
    """Define the model with ``exec`` in the namespace of module ``name`` (created and put in
    sys.modules on first use), as a notebook re-running a cell does: the second definition
    replaces the first one in the same namespace. The caller removes the module afterwards."""
    module = sys.modules.get(name)
    if module is None:
        module = sys.modules[name] = types.ModuleType(name)
    exec(compile(_MODEL.format(k=k, b=b), "<string>", "exec"), module.__dict__)
    return module.Typed


def _config(tmp_path: Path) -> ff.CompilationConfig:
    return ff.CompilationConfig(mode="piecewise", backend="eager",
                                splitting_ops=["silly::attention"], cudagraph_mode="none",
                                cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize("edit", ["forward", "helper"])
def test_edited_exec_code_is_traced_again(tmp_path: Path, edit: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # one module name per test: Dynamo keeps an alias to a module it imported for the process
    name = f"ff_exec_model_{edit}"
    monkeypatch.delitem(sys.modules, name, raising=False)  # restored afterwards
    cfg = _config(tmp_path)
    x = torch.arange(4.0)
    old = _exec_model(2.0, 1.0, name)
    cold = ff.compile(old(), cfg, dynamic_arg_dims={"x": 0})
    with cold.stats.expect(traces_loaded=0, artifacts_saved=1, traces_not_saved=0):
        torch.testing.assert_close(cold(x), 3 * x * 2.0 + 1.0, rtol=0, atol=0)

    same = _exec_model(2.0, 1.0, name)  # unchanged code: warm start
    warm = ff.compile(same(), cfg, dynamic_arg_dims={"x": 0})
    with warm.stats.expect(traces_loaded=1, saved_trace_rejected=0):
        torch.testing.assert_close(warm(x), 3 * x * 2.0 + 1.0, rtol=0, atol=0)

    k, b = (5.0, 1.0) if edit == "forward" else (2.0, 4.0)
    new = _exec_model(k, b, name)
    edited = ff.compile(new(), cfg, dynamic_arg_dims={"x": 0})
    with edited.stats.expect(traces_loaded=0, saved_trace_rejected=1, artifacts_saved=1):
        out = edited(x)
    torch.testing.assert_close(out, new()(x), rtol=0, atol=0)
    torch.testing.assert_close(out, 3 * x * k + b, rtol=0, atol=0)


_CHILD = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{src!r}, {root!r}]
    import torch
    import freezeframe as ff
    {model}
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager",
                               splitting_ops=["silly::attention"], cudagraph_mode="none",
                               cache_dir={cache!r})
    model = ff.compile(Typed(), cfg, dynamic_arg_dims={{"x": 0}})
    out = model(torch.arange(4.0)).tolist()
    print(json.dumps({{"stats": model.stats.snapshot(), "out": out}}))
""")


def _run_dash_c(tmp_path: Path, k: float) -> dict[str, Any]:
    code = _CHILD.format(src=str(ROOT / "src"), root=str(ROOT), cache=str(tmp_path / "c"),
                         model=_MODEL.format(k=k, b=1.0))
    env = dict(os.environ)
    env.pop(ff_files.ENV_DISABLE_CACHE, None)
    env.pop(ff_files.ENV_CACHE_DIR, None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_python_dash_c_model_edited_between_processes(tmp_path: Path) -> None:
    first = _run_dash_c(tmp_path, 2.0)
    assert first["out"] == [1.0, 7.0, 13.0, 19.0]  # 3x * 2 + 1
    second = _run_dash_c(tmp_path, 2.0)  # unchanged: Dynamo does not run
    assert second["stats"]["traces_loaded"] == 1 and second["out"] == first["out"]
    third = _run_dash_c(tmp_path, 5.0)
    assert third["out"] == [1.0, 16.0, 31.0, 46.0]  # 3x * 5 + 1, never the stale trace
    assert third["stats"].get("traces_loaded", 0) == 0
