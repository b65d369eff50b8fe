"""The artifact format (torch's AOT artifact, or the standalone fallback) is chosen in one place,
and a piece's artifact is loaded only by the format, torch and config that wrote it: anything
else is a clean miss, counted and logged. No Inductor here (fake compilers and payloads); the
real formats are exercised in tests/integration/test_cache_integration.py."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx

import freezeframe as ff
from freezeframe.cache import entry as ff_entry
from freezeframe.cache import files as ff_files
from freezeframe.cache import key as ff_key
from freezeframe.cache.artifacts import PieceCache, choose_artifact_format
from freezeframe.compilation.compilers import InductorCompiler
from freezeframe.sizes import Range
from freezeframe.stats import Stats


class _Torch:
    """A stand-in for the torch module: ``_inductor.standalone_compile`` as given."""

    __version__ = "2.9.0-test"

    def __init__(self, standalone: Any) -> None:
        self._inductor = type("_Inductor", (), {})()
        if standalone is not None:
            self._inductor.standalone_compile = standalone


def _with_aot(gm: Any, example_inputs: Any, *, dynamic_shapes: str = "from_graph",
              aot: bool = False) -> None: ...


def _without_aot(gm: Any, example_inputs: Any, *, dynamic_shapes: str = "from_graph") -> None: ...


def test_the_format_is_what_this_torch_has_unless_forced() -> None:
    assert choose_artifact_format("auto", torch_module=_Torch(_with_aot)) == "aot"
    assert choose_artifact_format("auto", torch_module=_Torch(_without_aot)) == "standalone"
    assert choose_artifact_format("auto", torch_module=_Torch(None)) is None
    assert choose_artifact_format("standalone", torch_module=_Torch(_with_aot)) == "standalone"
    assert choose_artifact_format("none", torch_module=_Torch(_with_aot)) is None
    with pytest.raises(ff.ConfigError, match=r"artifact_format: 'aot' needs torch._inductor"
                       r".standalone_compile\(aot=True\), which torch 2.9.0-test lacks"):
        choose_artifact_format("aot", torch_module=_Torch(_without_aot))
    with pytest.raises(ff.ConfigError, match=r"artifact_format: 'fast' is not one of"):
        choose_artifact_format("fast")
    # the installed torch (2.13 in CI, 2.11 on the GPU machine: both have the AOT artifact)
    standalone = getattr(torch._inductor, "standalone_compile", None)
    assert standalone is not None  # every torch >= 2.11 has it
    has_aot = "aot" in inspect.signature(standalone).parameters
    expected = "aot" if has_aot else "standalone"
    assert choose_artifact_format() == expected
    assert InductorCompiler(Stats()).artifact_format == expected
    assert InductorCompiler(Stats(), artifact_format="standalone").artifact_format == "standalone"


class _Compiler:
    """Named like Inductor, so the piece cache saves and loads for it."""

    name = "inductor"

    def __init__(self, artifact_format: str | None) -> None:
        self.artifact_format = artifact_format


class _Artifact:
    """A compiled piece whose ``save`` writes a payload no torch can load."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def save(self, *, path: str, format: str) -> None:
        Path(path).write_bytes(self.payload)


def _open(root: Path, stats: Stats, **config: Any) -> ff_entry.CompileCache:
    cfg = ff.CompilationConfig(mode="piecewise", backend="inductor", cache_dir=str(root),
                               **config)
    cache = ff_entry.CompileCache.open(cfg, stats=stats, model_key="formats")
    assert cache is not None
    return cache


def _graph() -> tuple[fx.GraphModule, list[Any]]:
    return fx.symbolic_trace(lambda x: x * 2.0), [torch.zeros(4, 3)]


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ff_files.ENV_DISABLE_CACHE, raising=False)


def test_an_artifact_of_the_other_format_is_a_miss(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    gm, inputs = _graph()
    stats = Stats()
    pieces = PieceCache(_open(tmp_path, stats))
    pieces.save(_Compiler("standalone"), gm, inputs, Range(1, 8), 0, _Artifact(b"x"))
    assert stats.artifacts_saved == 1
    with caplog.at_level(logging.INFO, logger="freezeframe.cache"):
        assert pieces.load(_Compiler("aot"), gm, inputs, Range(1, 8), 0) is None
    assert (stats.cache_misses, stats.cache_hits, stats.artifacts_loaded) == (1, 0, 0)
    assert "was compiled from another graph; recompiling" in caplog.text
    # compile_fx (no format) saves and loads nothing, and counts nothing
    assert pieces.load(_Compiler(None), gm, inputs, Range(1, 8), 0) is None
    assert stats.cache_misses == 1


def test_an_artifact_torch_cannot_load_is_a_clean_miss(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    gm, inputs = _graph()
    stats = Stats()
    cache = _open(tmp_path, stats)
    pieces = PieceCache(cache)
    pieces.save(_Compiler("aot"), gm, inputs, Range(1, 8), 0, _Artifact(b"not an artifact"))
    (path,) = cache.entry_dir.glob("piece_0_range_1_8.bin")
    with caplog.at_level(logging.WARNING, logger="freezeframe.cache"):
        assert pieces.load(_Compiler("aot"), gm, inputs, Range(1, 8), 0) is None
    assert (stats.cache_misses, stats.cache_hits, stats.artifacts_loaded) == (1, 0, 1)
    assert "could not be loaded" in caplog.text
    assert not path.exists()  # removed, so the recompile writes it afresh


def test_an_artifact_of_another_torch_or_config_is_not_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gm, inputs = _graph()
    written = _open(tmp_path, Stats())
    PieceCache(written).save(_Compiler("aot"), gm, inputs, Range(1, 8), 0, _Artifact(b"x"))
    assert (written.entry_dir / "piece_0_range_1_8.bin").exists()

    same = _open(tmp_path, Stats())
    assert same.key == written.key  # the same torch and config find the entry
    other_config = _open(tmp_path, Stats(), max_num_tokens=4096)
    real = ff_key.torch_factors()
    monkeypatch.setattr(ff_key, "torch_factors", lambda: {**real, "torch": "2.11.0"})
    other_torch = _open(tmp_path, Stats())
    for cache in (other_config, other_torch):
        stats = cache.stats
        assert cache.key != written.key
        assert cache.load_artifact(0, Range(1, 8)) is None
        assert PieceCache(cache).load(_Compiler("aot"), gm, inputs, Range(1, 8), 0) is None
        assert stats is not None and (stats.cache_misses, stats.artifacts_loaded) == (1, 0)
