"""The saved trace is reused only when every value the trace specialised on is unchanged.

Dynamo bakes plain values into the graph (an attribute ``self._k``, ``self.table['a']``, a
``torch.dtype``, a field of a plain config object, a constant another module defines). A warm
start that skipped Dynamo would reuse those values, so the cache re-checks each of them (taken
from the trace's own guards) before it trusts a saved trace. Every test uses a tmp_path cache
root; "another process" is a fresh CompiledModel in this process or a subprocess.
"""

from __future__ import annotations

import enum
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe.cache import files as ff_files
from freezeframe.cache import inspect as ff_inspect
from tests.helpers.silly import attention

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ff_files.ENV_DISABLE_CACHE, raising=False)
    monkeypatch.delenv(ff_files.ENV_CACHE_DIR, raising=False)


def _config(tmp_path: Path) -> ff.CompilationConfig:
    return ff.CompilationConfig(mode="piecewise", backend="eager",
                                splitting_ops=["silly::attention"], cudagraph_mode="none",
                                cache_dir=str(tmp_path / "c"))


class Opts:
    """A plain (not dataclass) options object, as many models keep."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


class Mode(enum.Enum):
    ADD = "add"
    MUL = "mul"


class Baked(nn.Module):
    """Every kind of attribute the module signature cannot tell apart between two instances."""

    def __init__(self, k: float = 2.0, table: dict[str, float] | None = None,
                 out_dtype: torch.dtype = torch.float32, opts: Opts | None = None,
                 act: Any = torch.relu, mode: Mode = Mode.ADD) -> None:
        super().__init__()
        self._k = k
        self.table = table if table is not None else {"a": 1.5}
        self.out_dtype = out_dtype
        self.opts = opts if opts is not None else Opts(3.0)
        self.act = act
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self._k + self.table["a"] + len(self.table)
        x = attention(x, x, x)
        x = self.act(x * self.opts.scale)
        x = x + 1 if self.mode is Mode.ADD else x * 2
        return x.to(self.out_dtype)


_OTHER: dict[str, dict[str, Any]] = {
    "private": {"k": 5.0},
    "dict": {"table": {"a": 4.0}},
    "dtype": {"out_dtype": torch.float64},
    "object": {"opts": Opts(7.0)},
    "function": {"act": torch.tanh},
    "enum": {"mode": Mode.MUL},
}


@pytest.mark.parametrize("which", sorted(_OTHER))
def test_another_instance_with_other_values_never_gets_the_first_trace(
        tmp_path: Path, which: str) -> None:
    cfg = _config(tmp_path)
    x = torch.arange(4.0)
    first_eager = Baked()
    first = ff.compile(Baked(), cfg, dynamic_arg_dims={"x": 0})
    with first.stats.expect(traces_loaded=0, saved_trace_rejected=0, artifacts_saved=1):
        torch.testing.assert_close(first(x), first_eager(x), rtol=0, atol=0)

    other_eager = Baked(**_OTHER[which])
    other = ff.compile(Baked(**_OTHER[which]), cfg, dynamic_arg_dims={"x": 0})
    with other.stats.expect(traces_loaded=0, saved_trace_rejected=1, artifacts_saved=1):
        out = other(x)
    torch.testing.assert_close(out, other_eager(x), rtol=0, atol=0)  # values and dtype
    torch.testing.assert_close(other(torch.ones(3)), other_eager(torch.ones(3)), rtol=0, atol=0)

    # Both traces are kept side by side: each kind of instance warm-starts from its own.
    again = ff.compile(Baked(), cfg, dynamic_arg_dims={"x": 0})
    with again.stats.expect(traces_loaded=1, saved_trace_rejected=0, artifacts_saved=0):
        torch.testing.assert_close(again(x), first_eager(x), rtol=0, atol=0)
    other_again = ff.compile(Baked(**_OTHER[which]), cfg, dynamic_arg_dims={"x": 0})
    with other_again.stats.expect(traces_loaded=1, saved_trace_rejected=0, artifacts_saved=0):
        torch.testing.assert_close(other_again(x), other_eager(x), rtol=0, atol=0)
    assert len(ff_inspect.list_entries(tmp_path / "c")) == 1  # one entry, two saved traces


# -- globals the trace read (a constant in another module) -----------------------------------
_CONSTS = "SCALE = {scale}\n"
_USES_CONSTS = """
import torch
from torch import nn

import {consts}
from tests.helpers.silly import attention


class UsesConsts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = attention(x, x, x)
        return x * {consts}.SCALE
"""


def _write_modules(mod_dir: Path, tag: str, scale: float) -> tuple[Path, str, str]:
    mod_dir.mkdir(exist_ok=True)
    consts, model = f"ff_consts_{tag}", f"ff_uses_consts_{tag}"
    consts_file = mod_dir / f"{consts}.py"
    consts_file.write_text(_CONSTS.format(scale=scale))
    (mod_dir / f"{model}.py").write_text(_USES_CONSTS.format(consts=consts))
    return consts_file, consts, model


def _write_again(path: Path, text: str) -> None:
    """Rewrite a module file so that a reload cannot reuse its stale bytecode (same size and
    mtime second would let Python's .pyc check pass)."""
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def test_a_global_constant_of_another_module_is_rechecked(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    consts_file, consts_name, model_name = _write_modules(tmp_path / "mods", "inproc", 7.0)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    consts = importlib.import_module(consts_name)
    model_mod = importlib.import_module(model_name)
    cfg = _config(tmp_path)
    x = torch.arange(4.0)
    cold = ff.compile(model_mod.UsesConsts(), cfg, dynamic_arg_dims={"x": 0})
    torch.testing.assert_close(cold(x), x * 3 * 7.0, rtol=0, atol=0)

    _write_again(consts_file, _CONSTS.format(scale=16.0))  # consts.py edited: no traced code
    importlib.reload(consts)
    eager = model_mod.UsesConsts()
    warm = ff.compile(model_mod.UsesConsts(), cfg, dynamic_arg_dims={"x": 0})
    with warm.stats.expect(traces_loaded=0, saved_trace_rejected=1):
        out = warm(x)
    torch.testing.assert_close(out, eager(x), rtol=0, atol=0)
    torch.testing.assert_close(out, x * 3 * 16.0, rtol=0, atol=0)
    # the new value's trace is saved and warm-starts the next model
    again = ff.compile(model_mod.UsesConsts(), cfg, dynamic_arg_dims={"x": 0})
    with again.stats.expect(traces_loaded=1, saved_trace_rejected=0):
        torch.testing.assert_close(again(x), x * 3 * 16.0, rtol=0, atol=0)


_CHILD = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{src!r}, {root!r}, {mods!r}]
    import torch
    import freezeframe as ff
    from {model} import UsesConsts
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager",
                               splitting_ops=["silly::attention"], cudagraph_mode="none",
                               cache_dir={cache!r})
    model = ff.compile(UsesConsts(), cfg, dynamic_arg_dims={{"x": 0}})
    out = model(torch.arange(4.0)).tolist()
    print(json.dumps({{"stats": model.stats.snapshot(), "out": out}}))
""")


def _run_child(code: str) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop(ff_files.ENV_DISABLE_CACHE, None)
    env.pop(ff_files.ENV_CACHE_DIR, None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_editing_an_imported_constants_file_between_processes(tmp_path: Path) -> None:
    consts_file, _, model_name = _write_modules(tmp_path / "mods", "procs", 7.0)
    code = _CHILD.format(src=str(ROOT / "src"), root=str(ROOT), mods=str(tmp_path / "mods"),
                         model=model_name, cache=str(tmp_path / "c"))
    first = _run_child(code)
    assert first["out"] == [0.0, 21.0, 42.0, 63.0]  # 3x * 7
    _write_again(consts_file, _CONSTS.format(scale=16.0))
    second = _run_child(code)
    assert second["out"] == [0.0, 48.0, 96.0, 144.0]  # 3x * 16, as eager gives
    assert second["stats"].get("traces_loaded", 0) == 0
    assert second["stats"]["saved_trace_rejected"] == 1


def test_grad_mode_of_the_trace_is_rechecked(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    x = torch.arange(4.0)
    # inference_mode=False: the compiled model keeps the caller's autograd mode.
    with torch.no_grad():
        ff.compile(Baked(), cfg, dynamic_arg_dims={"x": 0}, inference_mode=False)(x)
    warm = ff.compile(Baked(), cfg, dynamic_arg_dims={"x": 0}, inference_mode=False)
    with warm.stats.expect(traces_loaded=0, saved_trace_rejected=1, artifacts_saved=1):
        torch.testing.assert_close(warm(x), Baked()(x), rtol=0, atol=0)


_SENTINEL = object()


class ComparesIdentity(nn.Module):
    """Specialises on which object an attribute is: another process cannot tell."""

    def __init__(self, marker: object) -> None:
        super().__init__()
        self.marker = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = attention(x, x, x)
        return x + 1 if self.marker is _SENTINEL else x - 1


def test_an_identity_the_trace_specialised_on_is_never_saved(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    x = torch.arange(4.0)
    cold = ff.compile(ComparesIdentity(_SENTINEL), cfg, dynamic_arg_dims={"x": 0})
    with cold.stats.expect(traces_not_saved=1, artifacts_saved=0):
        torch.testing.assert_close(cold(x), 3 * x + 1, rtol=0, atol=0)
    other = ff.compile(ComparesIdentity(object()), cfg, dynamic_arg_dims={"x": 0})
    with other.stats.expect(traces_loaded=0, saved_trace_rejected=0, traces_not_saved=1):
        torch.testing.assert_close(other(x), 3 * x - 1, rtol=0, atol=0)


_TABLES = """
import torch

TABLE = torch.tensor([1.0, 2.0, 3.0, 4.0])


def lookup(x):
    return x + TABLE
"""
_USES_TABLES = """
import torch
from torch import nn

import {tables}
from tests.helpers.silly import attention


class UsesTables(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = attention(x, x, x)
        return {tables}.lookup(x)
"""


def test_a_tensor_global_of_an_inlined_helper_binds_on_a_warm_start(tmp_path: Path) -> None:
    """The helper's module is reached through an alias Dynamo adds to the forward's globals while
    it traces; a process that loads the saved trace has no such alias and must resolve it."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "ff_tables_mod.py").write_text(_TABLES)
    (mods / "ff_uses_tables.py").write_text(_USES_TABLES.format(tables="ff_tables_mod"))
    code = _CHILD.format(src=str(ROOT / "src"), root=str(ROOT), mods=str(mods),
                         model="ff_uses_tables", cache=str(tmp_path / "c"))
    code = code.replace("UsesConsts", "UsesTables").replace("torch.arange(4.0)",
                                                            "torch.ones(2, 4)")
    expected = [[4.0, 5.0, 6.0, 7.0], [4.0, 5.0, 6.0, 7.0]]  # 3 * 1 + TABLE
    first = _run_child(code)
    assert first["out"] == expected and first["stats"]["artifacts_saved"] == 1
    second = _run_child(code)
    assert second["out"] == expected and second["stats"]["traces_loaded"] == 1


class StoresHidden(nn.Module):
    """Keeps its last hidden state on the module: a Python side effect of forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.last_hidden: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = attention(self.lin(x), x, x)
        self.last_hidden = h
        return h * 2


def test_a_forward_with_side_effects_behaves_alike_after_cold_and_warm_starts(
        tmp_path: Path) -> None:
    """Dynamo's code repeats ``self.last_hidden = h`` on every call; a saved trace calls the
    graph alone. Such a trace is not saved, so a warm start traces as the cold one did and the
    store happens after both."""
    cfg = _config(tmp_path)
    for start in ("cold", "warm"):
        module = StoresHidden()
        model = ff.compile(module, cfg, dynamic_arg_dims={"x": 0})
        with model.stats.expect(traces_not_saved=1, traces_loaded=0):
            model(torch.ones(3, 4))
        for n in (2, 5):
            x = torch.full((n, 4), float(n))
            out = model(x)
            assert module.last_hidden is not None, start
            torch.testing.assert_close(module.last_hidden * 2, out)
            assert module.last_hidden.shape == (n, 4), start
