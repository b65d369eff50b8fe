"""The compile cache end to end: separate processes compile and load the same model.

Every process gets a tmp_path cache root (never the user's cache). Eager tests exercise the saved
trace (a warm start without Dynamo); the ``inductor`` tests compile real Inductor pieces and
check that two concurrent processes compile each piece once between them, that a warm start runs
no Inductor (and no ISA probe) at all, and that a corrupt artifact is recompiled, not loaded.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import freezeframe as ff
from freezeframe.cache import files as ff_files
from freezeframe.cache import inspect as ff_inspect
from tests.helpers.toy_models import SillyModel

ROOT = Path(__file__).resolve().parents[2]

# One process: compile SillyModel (5 pieces, 3 capturable), run two sizes, print the counters
# and outputs as JSON on the last line.
_CHILD = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{src!r}, {root!r}]
    import torch
    import freezeframe as ff
    {model_import}
    cfg = ff.CompilationConfig(mode="piecewise", backend={backend!r},
                               splitting_ops=["silly::attention"], cudagraph_mode="none",
                               cache_dir={cache_dir!r})
    model = ff.compile({model_expr}, cfg, dynamic_arg_dims={{"x": 0}})
    outs = [model(torch.zeros(2)).tolist(), model(torch.arange(5.0)).tolist()]
    print(json.dumps({{"stats": model.stats.snapshot(), "outs": outs}}))
""")


def _child_code(cache_dir: Path, backend: str, *, model_import: str | None = None,
                model_expr: str = "SillyModel()") -> str:
    return _CHILD.format(src=str(ROOT / "src"), root=str(ROOT), backend=backend,
                         cache_dir=str(cache_dir), model_expr=model_expr,
                         model_import=model_import
                         or "from tests.helpers.toy_models import SillyModel")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop(ff_files.ENV_DISABLE_CACHE, None)
    env.pop(ff_files.ENV_CACHE_DIR, None)
    return env


def _run(code: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _start(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _expected(xs: list[float]) -> list[float]:
    return [9 * x + 19 for x in xs]  # SillyModel is 9x + 19 elementwise


OUTS = [_expected([0.0, 0.0]), _expected([0.0, 1.0, 2.0, 3.0, 4.0])]


# -- eager: the saved trace ----------------------------------------------------------------
def test_eager_warm_start_loads_the_trace_in_process(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ff_files.ENV_DISABLE_CACHE, raising=False)
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager",
                               splitting_ops=["silly::attention"], cudagraph_mode="none",
                               cache_dir=str(tmp_path / "c"))
    cold = ff.compile(SillyModel(), cfg, dynamic_arg_dims={"x": 0})
    with cold.stats.expect(graphs_traced=1, traces_loaded=0, artifacts_saved=1,
                           artifacts_loaded=0, eager_compiles=3, cache_hits=0, cache_misses=0):
        assert cold(torch.zeros(2)).tolist() == OUTS[0]
    warm = ff.compile(SillyModel(), cfg, dynamic_arg_dims={"x": 0})
    with warm.stats.expect(graphs_traced=1, traces_loaded=1, artifacts_saved=0,
                           artifacts_loaded=1, eager_compiles=3, pieces=5):
        assert warm(torch.zeros(2)).tolist() == OUTS[0]
    assert warm(torch.arange(5.0)).tolist() == OUTS[1]
    assert [p.is_splitting_op for p in warm.pieces] == [False, True, False, True, False]

    # a damaged saved trace is detected, Dynamo traces again and the trace is rewritten
    (entry,) = ff_inspect.list_entries(tmp_path / "c")
    trace = entry.path / "trace.bin"
    trace.write_bytes(trace.read_bytes()[:-7])
    again = ff.compile(SillyModel(), cfg, dynamic_arg_dims={"x": 0})
    with again.stats.expect(graphs_traced=1, traces_loaded=0, artifacts_saved=1,
                            artifacts_loaded=0):
        assert again(torch.zeros(2)).tolist() == OUTS[0]
    ff_files.unpack_artifact(trace.read_bytes())  # whole again


def test_cache_off_touches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ff_files.ENV_DISABLE_CACHE, raising=False)
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager",
                               splitting_ops=["silly::attention"], cudagraph_mode="none",
                               cache_dir=str(tmp_path / "c"), use_cache=False)
    model = ff.compile(SillyModel(), cfg, dynamic_arg_dims={"x": 0})
    with model.stats.expect(artifacts_saved=0, traces_loaded=0, graphs_traced=1):
        assert model(torch.zeros(2)).tolist() == OUTS[0]
    assert not (tmp_path / "c").exists()


_VARIANT = """
import torch
from torch import nn
from tests.helpers.silly import attention

class Variant(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + {a}
        x = attention(x, x, x)
        return x + 1
"""


def test_source_change_invalidates_the_trace(tmp_path: Path) -> None:
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    src = mod_dir / "variant_model.py"
    src.write_text(_VARIANT.format(a=1))
    imp = f"sys.path.insert(0, {str(mod_dir)!r}); from variant_model import Variant"
    code = _child_code(tmp_path / "c", "eager", model_import=imp, model_expr="Variant()")
    first = _run(code)
    assert first["outs"][0] == [4.0, 4.0]  # 3 * (0 + 1) + 1
    assert first["stats"].get("traces_loaded", 0) == 0
    second = _run(code)
    assert second["stats"]["traces_loaded"] == 1 and second["outs"] == first["outs"]
    src.write_text(_VARIANT.format(a=2))
    third = _run(code)
    assert third["stats"].get("traces_loaded", 0) == 0  # Dynamo traced the new source
    assert third["outs"][0] == [7.0, 7.0]  # 3 * (0 + 2) + 1: never the stale trace
    assert len(ff_inspect.list_entries(tmp_path / "c")) == 2


# -- Inductor: artifacts ---------------------------------------------------------------------
_NO_PROBE = textwrap.dedent("""
    from tests.helpers.toy_models import SillyModel
    import torch._inductor.cpu_vec_isa as _isa
    def _probe(self, code):
        raise RuntimeError("the ISA probe ran")
    _isa.VecISA.check_build = _probe
""")


@pytest.fixture(scope="module")
def silly_inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """Two processes started at once on an empty root compile SillyModel's 3 Inductor pieces
    between them; the root they leave is the cold cache the warm-start tests copy."""
    root = tmp_path_factory.mktemp("silly") / "c"
    code = _child_code(root, "inductor")
    procs = [_start(code), _start(code)]
    return root, [_finish(p) for p in procs]


def _copy_of(root: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "c"
    shutil.copytree(root, copy)
    return copy


@pytest.mark.inductor
def test_inductor_two_processes_compile_once(silly_inductor_cache: tuple[Path, list[Any]]) -> None:
    root, results = silly_inductor_cache
    assert all(r["outs"] == OUTS for r in results)
    compiles = sorted(r["stats"].get("inductor_compiles", 0) for r in results)
    hits = sorted(r["stats"].get("cache_hits", 0) for r in results)
    assert compiles == [0, 3] and hits == [0, 3]
    (cold,) = [r["stats"] for r in results if r["stats"].get("inductor_compiles")]
    assert (cold["cache_misses"], cold.get("cache_hits", 0)) == (3, 0)
    assert cold["artifacts_saved"] == 4  # 3 pieces x 1 range + the trace
    assert cold["backend_compilations"] == 3
    leftovers = [p for p in root.rglob("*.tmp")]
    assert leftovers == []


@pytest.mark.inductor
def test_inductor_warm_start_loads_everything_then_a_damaged_piece_is_rebuilt(
        silly_inductor_cache: tuple[Path, list[Any]], tmp_path: Path) -> None:
    """A warm start loads every piece and the trace and runs no Inductor; it also takes the ISA
    probe result the compiling process recorded (same CPU features, compiler and torch) instead
    of building a probe library: in the warm process the probe raises if it is called. Then one
    piece is damaged: it is detected, recompiled and rewritten, and the others still load."""
    root = _copy_of(silly_inductor_cache[0], tmp_path)
    (entry,) = ff_inspect.list_entries(root)
    header, _ = ff_files.unpack_artifact((entry.path / "piece_0_range_1_8192.bin").read_bytes())
    if platform.machine() in ("x86_64", "AMD64"):
        assert header["host"]["isa"]["cpu"] == list(
            torch._inductor.cpu_vec_isa.x86_isa_checker())
    else:
        assert header["host"] == {"isa": None}  # Inductor probes only on x86
    warm = _run(_child_code(root, "inductor", model_import=_NO_PROBE))
    assert warm["outs"] == OUTS
    w = warm["stats"]
    assert w.get("inductor_compiles", 0) == 0 and w.get("cache_misses", 0) == 0
    assert (w["cache_hits"], w["artifacts_loaded"], w["traces_loaded"]) == (3, 4, 1)
    assert w["backend_compilations"] == 3

    victim = entry.path / "piece_2_range_1_8192.bin"
    blob = victim.read_bytes()
    victim.write_bytes(blob[: len(blob) // 2])
    fixed = _run(_child_code(root, "inductor"))
    assert fixed["outs"] == OUTS
    f = fixed["stats"]
    assert (f["inductor_compiles"], f["cache_misses"], f["cache_hits"]) == (1, 1, 2)
    ff_files.unpack_artifact(victim.read_bytes())  # whole again


# One process: PadsAfterOp traced at batch 5, then called at other batch sizes, each output
# checked against the module itself.
_PADS_CHILD = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{src!r}, {root!r}]
    import torch
    import freezeframe as ff
    from tests.helpers.toy_models import PadsAfterOp
    cfg = ff.CompilationConfig(mode="piecewise", backend="inductor",
                               splitting_ops=["silly::attention"], cudagraph_mode="none",
                               cache_dir={cache_dir!r})
    model = ff.compile(PadsAfterOp(), cfg, dynamic_arg_dims={{"x": 0}})
    same = []
    with torch.no_grad():
        for n in (5, 3, 4, 8, 1):
            x = torch.randn(n, 3, generator=torch.Generator().manual_seed(n))
            same.append(torch.equal(model(x), PadsAfterOp()(x)))
    print(json.dumps({{"stats": model.stats.snapshot(), "same": same}}))
""")


@pytest.mark.inductor
def test_inductor_piece_compiled_on_a_warm_start_serves_every_size(tmp_path: Path) -> None:
    """A warm start whose piece artifacts are gone compiles the pieces from the saved trace,
    which keeps only the values at piece boundaries: each piece serves every batch size (not
    only the traced one), and is found again by the next start under the same key."""
    code = _PADS_CHILD.format(src=str(ROOT / "src"), root=str(ROOT),
                              cache_dir=str(tmp_path / "c"))
    cold = _run(code)
    assert cold["same"] == [True] * 5
    assert cold["stats"]["inductor_compiles"] == 2
    (entry,) = ff_inspect.list_entries(tmp_path / "c")
    pieces = sorted(entry.path.glob("piece_*.bin"))
    assert len(pieces) == 2
    for piece in pieces:
        piece.unlink()
    rebuilt = _run(code)
    assert rebuilt["same"] == [True] * 5
    r = rebuilt["stats"]
    assert (r["traces_loaded"], r["inductor_compiles"], r["cache_misses"]) == (1, 2, 2)
    warm = _run(code)
    assert warm["same"] == [True] * 5
    w = warm["stats"]
    assert (w["traces_loaded"], w.get("inductor_compiles", 0), w["cache_hits"]) == (1, 0, 2)


# One process: a 4-layer ExampleMLP (5 capturable pieces, 3 distinct) compiled with Inductor in
# the given artifact format; prints the counters, the outputs and eager's outputs.
_LAYERS_CHILD = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{src!r}, {root!r}]
    import torch
    import freezeframe as ff
    from freezeframe.compilation.compilers import InductorCompiler
    from freezeframe.models.example import MIX_OP, ExampleMLP
    module = ExampleMLP(hidden_size=8, num_layers=4).eval()
    cfg = ff.CompilationConfig(mode="piecewise", backend="inductor", splitting_ops=[MIX_OP],
                               cudagraph_mode="none", max_num_tokens=64,
                               cache_dir={cache_dir!r})
    model = ff.compile(module, cfg, dynamic_arg_dims={{"x": 0}})
    model.manager.compiler = InductorCompiler(model.stats, artifact_format={fmt!r})
    xs = [module.example_input(n) for n in (3, 7)]
    outs = [model(x).tolist() for x in xs]
    with torch.no_grad():
        ref = [module(x).tolist() for x in xs]
    print(json.dumps({{"stats": model.stats.snapshot(), "outs": outs, "eager": ref}}))
""")


@pytest.mark.inductor
@pytest.mark.parametrize("fmt", ["aot", "standalone"])
def test_inductor_layers_compile_once_in_either_format(tmp_path: Path, fmt: str) -> None:
    code = _LAYERS_CHILD.format(src=str(ROOT / "src"), root=str(ROOT),
                                cache_dir=str(tmp_path / "c"), fmt=fmt)
    cold = _run(code)
    s = cold["stats"]
    # 5 capturable pieces, 3 distinct: Inductor runs 3 times (1 range), the others reuse
    assert (s["capturable_pieces"], s["distinct_pieces"], s["pieces_reused"]) == (5, 3, 2)
    assert (s["inductor_compiles"], s[f"inductor_compiles_{fmt}"], s["cache_misses"]) == (3, 3, 3)
    assert s["artifacts_saved"] == 4  # 3 distinct pieces + the trace
    for out, ref in zip(cold["outs"], cold["eager"], strict=True):
        torch.testing.assert_close(torch.tensor(out), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    warm = _run(code)
    w = warm["stats"]
    assert w.get("inductor_compiles", 0) == 0 and w.get("cache_misses", 0) == 0
    assert (w["cache_hits"], w["pieces_reused"], w["traces_loaded"]) == (3, 2, 1)
    assert warm["outs"] == cold["outs"]  # bit-identical to the cold start
    (entry,) = ff_inspect.list_entries(tmp_path / "c")
    index = json.loads((entry.path / "index.json").read_text())["artifacts"]
    assert sorted(index) == [f"piece_{i}_range_1_64.bin" for i in (0, 2, 8)]
    assert {rec["compiler"] for rec in index.values()} == {f"inductor:{fmt}"}
