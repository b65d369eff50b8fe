"""The on-disk compile cache's storage layer: key factors, atomic self-checking files, the
per-model lock across processes, permission refusal and the CLI. Every test uses tmp_path."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import freezeframe as ff
from freezeframe.cache import entry as ff_entry
from freezeframe.cache import files as ff_files
from freezeframe.cache import inspect as ff_inspect
from freezeframe.cache import key as ff_key
from freezeframe.cache import traced_code
from freezeframe.cache.entry import CompileCache
from freezeframe.cache.files import CorruptArtifactError
from freezeframe.compilation.compilers import config_passes, pass_sources
from freezeframe.compilation.guard_checks import ValueCheck
from freezeframe.config import CompilationConfig
from freezeframe.errors import CacheError
from freezeframe.sizes import Range
from freezeframe.stats import Stats

SRC = Path(__file__).resolve().parents[2] / "src"


class Tiny(torch.nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ff_files.ENV_CACHE_DIR, raising=False)
    monkeypatch.delenv(ff_files.ENV_DISABLE_CACHE, raising=False)


def _config(tmp_path: Path, **kw: object) -> CompilationConfig:
    fields: dict[str, object] = {"mode": "piecewise", "backend": "eager", **kw}
    return CompilationConfig(cache_dir=str(tmp_path / "c"), **fields)


def _open(tmp_path: Path, *, module: torch.nn.Module | None = None, stats: Stats | None = None,
          model_key: str | None = None, **kw: object) -> CompileCache:
    module = module if module is not None else Tiny()
    config = _config(tmp_path, **kw)
    cache = CompileCache.open(config, stats=stats, module=module,
                              args=(torch.zeros(3, module.lin.in_features),),
                              dynamic_arg_dims={"x": 0}, model_key=model_key,
                              inductor_passes=pass_sources(config_passes(config)))
    assert cache is not None
    return cache


# -- root, switch --------------------------------------------------------------------------
def test_root_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ff_files.resolve_cache_root(None) == tmp_path / "xdg" / "freezeframe"
    monkeypatch.setenv(ff_files.ENV_CACHE_DIR, str(tmp_path / "env"))
    assert ff_files.resolve_cache_root(None) == tmp_path / "env"
    cfg = CompilationConfig(cache_dir=str(tmp_path / "cfg"))
    assert ff_files.resolve_cache_root(cfg) == tmp_path / "cfg"


def test_switches_turn_the_cache_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert CompileCache.open(_config(tmp_path, use_cache=False)) is None
    monkeypatch.setenv(ff_files.ENV_DISABLE_CACHE, "1")
    assert CompileCache.open(_config(tmp_path)) is None
    assert not (tmp_path / "c").exists()


# -- permissions ---------------------------------------------------------------------------
def test_created_dirs_are_private(tmp_path: Path) -> None:
    cache = _open(tmp_path)
    cache.save_artifact(0, Range(1, 8), b"x")
    for d in (cache.root, cache.entry_dir):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "c"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(CacheError) as info:
        _open(tmp_path)
    msg = str(info.value)
    assert str(root) in msg and f"{mode:#o}" in msg and "chmod 700" in msg
    assert "cache_dir" in msg


def test_entry_dir_writable_by_others_is_refused(tmp_path: Path) -> None:
    cache = _open(tmp_path)
    cache.save_artifact(0, Range(1, 8), b"x")
    os.chmod(cache.entry_dir, 0o777)
    with pytest.raises(CacheError, match="0o777"):
        cache.save_artifact(1, Range(1, 8), b"y")


def test_owned_by_another_user_is_refused(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "c"
    root.mkdir(mode=0o700)
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 1)
    with pytest.raises(CacheError, match="owned by uid"):
        ff_files.check_private_dir(root)


# -- files ---------------------------------------------------------------------------------
def test_pack_roundtrip_and_every_corruption_detected() -> None:
    blob = ff_files.pack_artifact(b"payload" * 100, {"piece": 3})
    header, payload = ff_files.unpack_artifact(blob)
    assert payload == b"payload" * 100 and header["piece"] == 3
    flipped = bytearray(blob)
    flipped[-5] ^= 0xFF
    for bad in (blob[:-1], blob + b"x", bytes(flipped), b"", b"garbage" * 10, blob[:20]):
        with pytest.raises(CorruptArtifactError):
            ff_files.unpack_artifact(bad)


def test_atomic_write_leaves_no_temp_and_keeps_old_file_on_failure(tmp_path: Path,
                                                                   monkeypatch) -> None:
    target = tmp_path / "a.bin"
    ff_files.atomic_write(target, b"old")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.bin"]

    def boom(*a: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        ff_files.atomic_write(target, b"new")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.bin"]


def test_save_load_counts_and_index(tmp_path: Path) -> None:
    stats = Stats()
    cache = _open(tmp_path, stats=stats)
    with stats.expect(artifacts_saved=2, artifacts_loaded=0):
        cache.save_artifact(0, Range(1, 8), b"zero", graph_key="g0", compiler="inductor")
        cache.save_artifact(2, 4, b"two", graph_key="g2", compiler="inductor")
    with stats.expect(artifacts_loaded=1):
        path, payload = cache.load_artifact(0, Range(1, 8), "g0")
    assert payload == b"zero" and path.name == "piece_0_range_1_8.bin"
    assert (cache.entry_dir / "piece_2_range_4_4.bin").exists()
    index = json.loads((cache.entry_dir / "index.json").read_text())["artifacts"]
    assert sorted(index) == ["piece_0_range_1_8.bin", "piece_2_range_4_4.bin"]
    factors = json.loads((cache.entry_dir / "key_factors.json").read_text())
    assert factors["key"] == cache.key and factors["factors"]["torch"] == torch.__version__
    # a graph other than the one the artifact came from never gets it
    with stats.expect(artifacts_loaded=0):
        assert cache.load_artifact(0, Range(1, 8), "other") is None
        assert cache.load_artifact(1, Range(1, 8), "g0") is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_artifact_is_a_logged_miss_and_removed(tmp_path: Path, damage: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    cache = _open(tmp_path)
    path = cache.save_artifact(0, Range(1, 8), b"A" * 1000, graph_key="g")
    blob = path.read_bytes()
    damaged = {"truncate": blob[: len(blob) // 2], "empty": b"", "garbage": b"\x00" * 64,
               "flip": blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:]}[damage]
    path.write_bytes(damaged)
    with caplog.at_level("WARNING", logger="freezeframe.cache.files"):
        assert cache.load_artifact(0, Range(1, 8), "g") is None
    assert "corrupt" in caplog.text and str(path) in caplog.text
    assert not path.exists()
    cache.save_artifact(0, Range(1, 8), b"A" * 1000, graph_key="g")
    assert cache.load_artifact(0, Range(1, 8), "g")[1] == b"A" * 1000


# -- key factors ---------------------------------------------------------------------------
def test_key_is_stable_and_changes_with_each_factor(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    base = _open(tmp_path).key
    assert _open(tmp_path).key == base
    # fields outside cache_key() (debug) do not change it
    assert _open(tmp_path, debug=True).key == base
    # config
    assert _open(tmp_path, compile_sizes=[4], cudagraph_mode="none").key != base
    assert _open(tmp_path, backend="inductor").key != base
    # model key, module sizes, module plain attributes
    assert _open(tmp_path, model_key="v2").key != base
    assert _open(tmp_path, module=Tiny(width=8)).key != base
    odd = Tiny()
    odd.scale = 3.0
    assert _open(tmp_path, module=odd).key != base
    # torch / Inductor factors
    real = ff_key.torch_factors()
    # patched where base_factors (CompileCache.open's) looks it up
    monkeypatch.setattr(ff_key, "torch_factors", lambda: {**real, "torch": "9.9.9"})
    assert _open(tmp_path).key != base
    monkeypatch.setattr(ff_key, "torch_factors",
                        lambda: {**real, "inductor_system": "another-gpu"})
    assert _open(tmp_path).key != base


def test_key_changes_with_traced_source_contents(tmp_path: Path) -> None:
    src = tmp_path / "model_src.py"
    src.write_text("def f(x):\n    return x + 1\n")
    a = _open(tmp_path)
    a.add_traced_files([str(src), "<string>"])
    key_a = a.key
    b = _open(tmp_path)
    b.add_traced_files([str(src)])
    assert b.key == key_a
    src.write_text("def f(x):\n    return x + 2\n")
    c = _open(tmp_path)
    c.add_traced_files([str(src)])
    assert c.key != key_a
    assert a.key == key_a  # fixed once computed
    with pytest.raises(CacheError, match="after the cache key was fixed"):
        a.add_traced_files([str(tmp_path / "other.py")])


def test_traced_files_come_from_dynamo(tmp_path: Path) -> None:
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.extend(ff_key.traced_files_from_graph(gm))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(Tiny(), backend=backend, fullgraph=True)
    compiled(torch.ones(2, 4))
    assert __file__ in seen
    assert any(p.endswith(os.path.join("torch", "nn", "modules", "linear.py")) for p in seen)


def test_key_is_the_same_in_another_process(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys; sys.path[:0] = [{str(SRC)!r}, {str(Path(__file__).parents[2])!r}]
        import torch
        from tests.unit.test_cache import Tiny
        from freezeframe.cache.entry import CompileCache
        from freezeframe.config import CompilationConfig
        torch.manual_seed(0)
        c = CompileCache.open(CompilationConfig(mode="piecewise", backend="eager",
                              cache_dir={str(tmp_path / "c")!r}), module=Tiny(),
                              args=(torch.zeros(3, 4),), dynamic_arg_dims={{"x": 0}})
        c.add_traced_files([{__file__!r}])
        print(c.key)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()[-1]
    mine = _open(tmp_path)
    mine.add_traced_files([__file__])
    assert out == mine.key


# -- saved trace pointer -------------------------------------------------------------------
def test_saved_trace_needs_unchanged_sources(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("A = 1\n")
    stats = Stats()
    first = _open(tmp_path, stats=stats)
    assert first.load_trace() is None
    first.add_traced_files([str(src)])
    first.save_trace(b"TRACE", {"n": 1})
    second = _open(tmp_path, stats=stats)
    saved = second.load_trace()
    assert saved.payload == b"TRACE" and saved.meta == {"n": 1} and second.key == first.key
    src.write_text("A = 2\n")
    third = _open(tmp_path, stats=stats)
    with stats.expect(saved_trace_rejected=1, artifacts_loaded=0):
        assert third.load_trace() is None
    third.add_traced_files([str(src)])
    assert third.key != first.key


def test_saved_traces_are_kept_per_checked_values(tmp_path: Path) -> None:
    """One entry keeps a saved trace per set of checked values; ``accept`` picks one."""
    def saving(payload: bytes, value: float) -> None:
        cache = _open(tmp_path)
        check = ValueCheck("value", "L['self']._k", ["float", repr(value)],
                           guard="CONSTANT_MATCH")
        cache.save_trace(payload, checks=[check.as_tuple()])

    saving(b"TWO", 2.0)
    saving(b"FIVE", 5.0)
    saving(b"TWO AGAIN", 2.0)  # replaces the first variant with the same checks

    def wanting(value: float) -> object:
        def accept(saved: ff_entry.SavedTrace) -> str | None:
            (row,) = saved.checks
            c = ValueCheck(*row)
            return None if c.expected == ["float", repr(value)] else "another value"
        return accept

    stats = Stats()
    with stats.expect(saved_trace_rejected=0, artifacts_loaded=1):
        assert _open(tmp_path, stats=stats).load_trace(wanting(5.0)).payload == b"FIVE"
    with stats.expect(saved_trace_rejected=0, artifacts_loaded=1):
        assert _open(tmp_path, stats=stats).load_trace(wanting(2.0)).payload == b"TWO AGAIN"
    with stats.expect(saved_trace_rejected=1, artifacts_loaded=0):
        assert _open(tmp_path, stats=stats).load_trace(wanting(3.0)) is None
    (entry,) = ff_inspect.list_entries(tmp_path / "c")
    assert entry.has_trace


def test_traced_code_without_a_file_is_in_the_key(tmp_path: Path) -> None:
    def compiled(text: str) -> object:
        return compile(text, "<stdin>", "exec").co_consts[0]

    one = compiled("def f(x):\n    return x + 1\n")
    same = compiled("\n\ndef f(x):\n    return x + 1\n")  # moved, not changed
    two = compiled("def f(x):\n    return x + 2\n")
    assert traced_code.code_digests([one]) == traced_code.code_digests([same])
    assert traced_code.code_digests([one]) != traced_code.code_digests([two])
    assert traced_code.code_digests([Tiny.forward.__code__]) == {}  # a real file: hashed instead
    a, b, c = _open(tmp_path), _open(tmp_path), _open(tmp_path)
    a.add_traced_code(traced_code.code_digests([one]))
    b.add_traced_code(traced_code.code_digests([same]))
    c.add_traced_code(traced_code.code_digests([two]))
    assert a.key == b.key != c.key
    assert a.key != _open(tmp_path).key
    with pytest.raises(CacheError, match="after the cache key was fixed"):
        a.add_traced_code(traced_code.code_digests([two]))


# -- lock across processes -----------------------------------------------------------------
def _compile_under_lock(cfg_dir: str, log: str, payload: bytes) -> None:
    cfg = CompilationConfig(mode="piecewise", backend="eager", cache_dir=cfg_dir)
    stats = Stats()
    module = Tiny()
    cache = CompileCache.open(cfg, stats=stats, module=module, args=(torch.zeros(3, 4),),
                              dynamic_arg_dims={"x": 0})
    assert cache is not None
    with cache.lock():
        found = cache.load_artifact(0, Range(1, 8), "g")
        if found is None:
            with open(log, "a") as fh:
                fh.write(f"compile {os.getpid()}\n")
            time.sleep(1.0)  # a slow compile: the other process must wait, not compile too
            cache.save_artifact(0, Range(1, 8), payload, graph_key="g")
        else:
            assert found[1] == payload
            with open(log, "a") as fh:
                fh.write(f"load {os.getpid()}\n")


def test_two_processes_one_compile(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_compile_under_lock,
                         args=(str(tmp_path / "c"), str(log), b"P" * 4096)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    lines = sorted(line.split()[0] for line in log.read_text().splitlines())
    assert lines == ["compile", "load"]
    leftovers = [p for p in (tmp_path / "c").rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


# -- CLI -----------------------------------------------------------------------------------
def test_cli_list_info_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from freezeframe.cli import main

    cache = _open(tmp_path)
    cache.save_artifact(0, Range(1, 8), b"x" * 10, compiler="inductor")
    root = str(tmp_path / "c")
    assert main(["cache", "list", "--dir", root]) == 0
    out = capsys.readouterr().out
    assert cache.key in out and "1 entries" in out and "tests.unit.test_cache.Tiny" in out
    assert main(["cache", "info", "--dir", root, cache.key]) == 0
    out = capsys.readouterr().out
    assert "piece_0_range_1_8.bin: 10 bytes, compiler=inductor" in out and '"torch"' in out
    assert main(["cache", "info", "--dir", root, "0123456789abcdef"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error: no cache entry '0123456789abcdef'" in captured.err
    assert main(["cache", "clear", "--dir", root, "-y"]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert ff_inspect.list_entries(tmp_path / "c") == []


def test_saved_trace_fit_check() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from freezeframe.compilation.saved_trace import _first_mismatch

    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env) as mode:
        sym = shape_env.create_unbacked_symint()
        x = mode.from_tensor(torch.zeros(4, 8))
        w = torch.empty(sym, 8)
    expected = [x, w, sym]
    assert _first_mismatch([torch.zeros(4, 8), torch.zeros(3, 8), 3], expected) is None
    assert _first_mismatch([torch.zeros(4, 8), torch.zeros(9, 8), 9], expected) is None
    assert "dim 1" in _first_mismatch([torch.zeros(4, 9), torch.zeros(3, 8), 3], expected)
    assert "torch.float64" in _first_mismatch(
        [torch.zeros(4, 8, dtype=torch.float64), torch.zeros(3, 8), 3], expected)
    assert "graph inputs" in _first_mismatch([torch.zeros(4, 8)], expected)


def test_plain_tensor_attributes_and_dataclasses_are_in_the_key(tmp_path: Path) -> None:
    a, b = Tiny(), Tiny()
    a.kv = torch.zeros(16, 2)
    b.kv = torch.zeros(32, 2)
    assert ff_key.module_signature(a) != ff_key.module_signature(b)
    b.kv = torch.ones(16, 2)  # values do not matter, shapes do
    assert ff_key.module_signature(a) == ff_key.module_signature(b)
    a.cfg = CompilationConfig(max_num_seqs=8)
    b.cfg = CompilationConfig(max_num_seqs=16)
    assert ff_key.module_signature(a) != ff_key.module_signature(b)


def test_stale_temp_files_are_removed_fresh_ones_kept(tmp_path: Path) -> None:
    cache = _open(tmp_path)
    cache.save_artifact(0, Range(1, 8), b"x")
    old = cache.entry_dir / ".piece_1_range_1_8.bin.abc.tmp"
    new = cache.entry_dir / ".piece_2_range_1_8.bin.def.tmp"
    old.write_bytes(b"half")
    new.write_bytes(b"half")
    past = time.time() - 3600
    os.utime(old, (past, past))
    cache.save_artifact(1, Range(1, 8), b"y")
    assert not old.exists() and new.exists()


def test_lock_degrades_when_it_cannot_be_created(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A read-only cache (say one baked into an image) still loads: no lock, a warning."""
    cache = _open(tmp_path)
    real_open = os.open

    def deny(path: str, *a: object, **kw: object) -> int:
        if str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", deny)
    with caplog.at_level("WARNING", logger="freezeframe.cache.files"), cache.lock():
        pass
    assert "cannot create the compile lock" in caplog.text


def test_a_file_in_place_of_a_cache_dir_is_a_clear_error(tmp_path: Path) -> None:
    cache = _open(tmp_path)
    (cache.root / "locks").write_text("not a directory")
    with pytest.raises(CacheError, match="is not a directory"):
        cache.lock()


_FIX = ("point config.cache_dir or FREEZEFRAME_CACHE_DIR at a directory you can write to, or "
        "turn the cache off (use_cache=False or FREEZEFRAME_DISABLE_CACHE=1)")


def test_a_cache_dir_under_a_file_is_a_clear_error_at_the_first_call(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("a file, not a directory")
    cfg = CompilationConfig(mode="piecewise", backend="eager",
                            cache_dir=str(tmp_path / "f" / "c"))
    model = ff.compile(Tiny(), cfg, dynamic_arg_dims={"x": 0})
    with pytest.raises(CacheError) as info:
        model(torch.ones(3, 4))
    assert str(info.value) == (
        f"cannot create the cache directory {tmp_path / 'f' / 'c'}: {tmp_path / 'f'} is a "
        f"file, not a directory; {_FIX}")
    # two levels down: the file is named, not the directory above it
    with pytest.raises(CacheError, match=f"{tmp_path / 'f'} is a file, not a directory"):
        ff_files.ensure_cache_root(tmp_path / "f" / "a" / "b")


def test_a_cache_dir_on_a_read_only_file_system_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_mkdir = Path.mkdir

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        if self.exists():  # as mkdir on a read-only file system: EEXIST first
            return real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(CacheError) as info:
        _open(tmp_path)
    assert str(info.value) == (
        f"cannot create the cache directory {tmp_path / 'c'}: {tmp_path / 'c'} is on a "
        f"read-only file system; {_FIX}")
    assert not (tmp_path / "c").exists()


_ZERO_USAGE = {"starts": 0, "trace_loads": 0, "hits": 0, "misses": 0, "last_used": None}


@pytest.mark.parametrize(("content", "why"), [
    ("[]", "it holds an array, not a JSON object"),
    ("null", "it holds null, not a JSON object"),
    ("7", "it holds a number, not a JSON object"),
    ("{not json", "not valid JSON: Expecting property name enclosed in double quotes: line 1 "
                  "column 2 (char 1)"),
])
@pytest.mark.parametrize("name", ["usage.json", "key_factors.json"])
def test_a_damaged_usage_or_factors_file_is_listed_logged_and_rewritten(
        tmp_path: Path, name: str, content: str, why: str, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """JSON of the wrong kind in an entry's informational files is damage, as unreadable JSON
    is: listed without it (never an AttributeError), logged, and written again by the next
    start, which counts it in ``cache_files_damaged``."""
    from freezeframe.cli import main

    cache = _open(tmp_path)
    cache.save_artifact(0, Range(1, 8), b"x")
    cache.record_start(trace_loaded=False)
    path = cache.entry_dir / name
    path.write_text(content)
    root = str(tmp_path / "c")
    with caplog.at_level("WARNING", logger="freezeframe.cache.inspect"):
        (entry,) = ff_inspect.list_entries(tmp_path / "c")
    assert entry.damaged == (name,)
    assert f"cache file {path} is damaged ({why}); shown without it" in caplog.text
    if name == "usage.json":
        assert (entry.usage, entry.factors["key"]) == (_ZERO_USAGE, cache.key)
    else:
        assert (entry.factors, entry.usage["starts"]) == ({}, 1)
    assert main(["cache", "list", "--dir", root]) == 0
    out = capsys.readouterr().out
    assert f"(damaged: {name})" in out and "1 of them with damaged files" in out
    assert main(["cache", "info", "--dir", root, cache.key]) == 0
    assert f"  damaged: {name} (shown empty" in capsys.readouterr().out

    stats = Stats()
    again = _open(tmp_path, stats=stats)
    assert again.key == cache.key
    caplog.clear()
    with caplog.at_level("WARNING", logger="freezeframe.cache.entry"):
        again.record_start(trace_loaded=True)
    assert stats.cache_files_damaged == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"cache file {path} is damaged ({why}); "
        + ("counting its starts again from this one" if name == "usage.json"
           else "writing it again")]
    (entry,) = ff_inspect.list_entries(tmp_path / "c")
    assert entry.damaged == ()
    assert entry.factors["key"] == cache.key
    assert (entry.usage["starts"], entry.usage["trace_loads"]) == (
        (1, 1) if name == "usage.json" else (2, 1))


@pytest.mark.parametrize("content", ["[]", '{"artifacts": []}', '{"artifacts": {"a": 7}}'])
def test_info_shows_an_entry_whose_index_is_damaged(tmp_path: Path, content: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from freezeframe.cli import main

    cache = _open(tmp_path)
    cache.save_artifact(0, Range(1, 8), b"x")
    (cache.entry_dir / "index.json").write_text(content)
    assert main(["cache", "info", "--dir", str(tmp_path / "c"), cache.key]) == 0
    assert "  artifacts (0):" in capsys.readouterr().out
    assert ff_inspect.read_index(cache.entry_dir) == {}
    cache.save_artifact(1, Range(1, 8), b"y")  # the next save writes it again
    assert sorted(ff_inspect.read_index(cache.entry_dir)) == ["piece_1_range_1_8.bin"]


def test_freezeframe_cli_has_the_cache_command(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from freezeframe import cli

    cache = _open(tmp_path)
    cache.save_artifact(0, Range(1, 8), b"x")
    assert cli.main(["cache", "list", "--dir", str(tmp_path / "c")]) == 0
    assert cache.key in capsys.readouterr().out


def test_editing_an_inductor_pass_changes_the_key(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    src = mod_dir / "my_cache_test_pass.py"
    src.write_text("def my_pass(graph):\n    return None\n")
    monkeypatch.syspath_prepend(str(mod_dir))
    passes = {"p": "my_cache_test_pass.my_pass"}
    first = _open(tmp_path, inductor_passes=passes).key
    assert _open(tmp_path, inductor_passes=passes).key == first
    src.write_text("def my_pass(graph):\n    graph.lint()\n")
    assert _open(tmp_path, inductor_passes=passes).key != first
    assert pass_sources({"q": "no_such_module.fn"}) == {"q": [None, None]}


def _add_ten(mod: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
    return out + 10


def test_a_trace_made_with_a_hook_is_not_loaded_without_it(tmp_path: Path) -> None:
    """A trace made with a forward hook holds the hook's ops; a later compile of the model
    without the hook (or with another one) must not load it."""
    hooked, plain = Tiny(), Tiny()
    plain.load_state_dict(hooked.state_dict())
    hooked.lin.register_forward_hook(_add_ten)
    x = torch.randn(3, 4)
    first = ff.compile(hooked, _config(tmp_path))
    assert torch.equal(first(x), hooked(x).detach())
    second = ff.compile(plain, _config(tmp_path))
    assert torch.equal(second(x), plain(x).detach())
    assert second.stats.traces_loaded == 0


class WithOptions(torch.nn.Module):
    def forward(self, x: torch.Tensor, opts: object) -> torch.Tensor:
        if isinstance(opts, dict):
            return x * opts["k"]
        return opts(x) + 1  # type: ignore[operator]


@pytest.mark.parametrize(("first", "second", "loads"), [
    ({"k": 2.0}, {"k": 5.0}, 0),
    ({"k": 2.0}, {"k": 2.0}, 1),
    ({"k": 1.0}, {"k": 1}, 0),
    (torch.sin, torch.cos, 0),
    (torch.sin, torch.sin, 1),
])
def test_a_saved_trace_is_loaded_only_for_the_same_plain_arguments(
        tmp_path: Path, first: object, second: object, loads: int) -> None:
    """A dict, a function or a number's type baked into a trace is part of the key: another
    one never loads that trace (this used to key dicts and functions by type only)."""
    x = torch.arange(6.0).reshape(3, 2)
    ff.compile(WithOptions(), _config(tmp_path))(x, first)
    model = ff.compile(WithOptions(), _config(tmp_path))
    out = model(x, second)
    want = WithOptions()(x, second)
    assert out.dtype == want.dtype and torch.equal(out, want)
    assert model.stats.traces_loaded == loads
