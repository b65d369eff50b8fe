"""The ``freezeframe`` command: config resolution, errors, subcommand registration, demo."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from freezeframe import cli
from freezeframe.config import CompilationConfig

REPO = Path(__file__).resolve().parents[2]

VLLM_JSON = json.dumps({
    "level": 3, "cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4],
    "splitting_ops": ["vllm::unified_attention"], "compile_sizes": ["cudagraph_capture_sizes"],
})


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_config_prints_the_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["config", VLLM_JSON], capsys)
    assert code == 0 and err == ""
    lines = dict(line.split(None, 1) for line in out.splitlines()
                 if not line.startswith(("capture", "compile", "cache", "batch")))
    assert lines["mode"] == "PIECEWISE (3)"
    assert lines["cudagraph_mode"] == "FULL_AND_PIECEWISE (uniform decode: FULL, mixed: PIECEWISE)"
    assert lines["padding"] == "1->1 2->2 3..4->4; 0->0; above 4: no graph (unpadded)"
    assert "capture sizes       3 sizes, max 4: 1 2 4" in out
    assert "compile ranges      [1, 8192]" in out
    assert "compile sizes       1 2 4" in out
    key = CompilationConfig.from_json(VLLM_JSON).cache_key()
    assert f"cache key           {key}" in out


def test_config_shows_derived_graph_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(
        ["config", '{"splitting_ops": [], "cudagraph_mode": "full_and_piecewise", '
                   '"compile_ranges_endpoints": [8, 32], "max_num_tokens": 64}'], capsys)
    assert code == 0
    assert "cudagraph_mode      FULL\n" in out
    assert "compile ranges      [1, 8] [9, 32] [33, 64]" in out
    assert "splitting_ops       [] (no split)" in out


def test_config_default_ladder_padding_is_folded(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["config", "{}"], capsys)
    assert code == 0
    assert "capture sizes       51 sizes, max 512" in out
    assert "9..256->16,24,..,256 (every 8)" in out
    assert "257..512->272,288,..,512 (every 16)" in out


def test_config_graphs_off(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["config", '{"mode": "none"}'], capsys)
    assert code == 0
    assert "capture sizes       none (CUDA graphs off)" in out
    assert "padding             none: every batch runs unpadded without a graph" in out


def test_config_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["config", "--json", VLLM_JSON], capsys)
    assert code == 0
    data = json.loads(out)
    key = data.pop("cache_key")
    cfg = CompilationConfig.from_dict(data)
    assert cfg == CompilationConfig.from_json(VLLM_JSON)
    assert key == cfg.cache_key()


def test_config_from_file_and_stdin(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(VLLM_JSON)
    code, from_file, _ = run_main(["config", f"@{path}"], capsys)
    assert code == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO(VLLM_JSON))
    code, from_stdin, _ = run_main(["config", "-"], capsys)
    assert code == 0
    assert from_file == from_stdin
    code, out, err = run_main(["config", f"@{tmp_path / 'missing.json'}"], capsys)
    assert code == 2 and out == ""
    assert "cannot read config file" in err and "missing.json" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"bogus": 1}', "unknown compilation-config field(s) ['bogus']; valid fields are"),
        ("{not json", "compilation config is not valid JSON"),
        ('{"cudagraph_capture_sizes": [1, 2, 4], "max_cudagraph_capture_size": 8}',
         "max_cudagraph_capture_size=8 disagrees"),
        ('{"cudagraph_mode": "full", "cudagraph_capture_sizes": [1, 2, 4, 8], '
         '"compile_sizes": [3]}', "size 3 would be padded to 4"),
    ],
)
def test_config_errors(text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["config", text], capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("freezeframe config: error: ")
    assert message in err
    assert "Traceback" not in err


def test_warnings_reach_stderr() -> None:
    proc = _run_cli("config", '{"max_cudagraph_capture_size": 257, "max_num_seqs": 128}')
    assert proc.returncode == 0
    assert "Truncating max_cudagraph_capture_size from 257 to 256" in proc.stderr
    assert "capture sizes       35 sizes, max 256" in proc.stdout


def test_console_error_has_no_traceback() -> None:
    proc = _run_cli("config", '{"level": 9}')
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("freezeframe config: error: mode: unknown compilation mode 9")
    assert "Traceback" not in proc.stderr


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main([], capsys)
    assert code == 2
    assert "usage: freezeframe" in err
    assert "config" in err and "demo" in err


# -- registration -----------------------------------------------------------------------------


def test_missing_subcommand_module_is_skipped(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS,
                                             ("ghost", "freezeframe.no_such_module")])
    parser = cli.build_parser()
    assert "ghost" not in parser.format_help()
    code, out, _ = run_main(["config", "{}"], capsys)
    assert code == 0 and "cache key" in out


def test_only_the_chosen_module_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[str] = []
    real = cli._load_registrar

    def spy(target: str):  # type: ignore[no-untyped-def]
        loaded.append(target)
        return real(target)

    monkeypatch.setattr(cli, "_load_registrar", spy)
    cli.build_parser(only="config")
    assert loaded == ["freezeframe.cli:add_config_parser"]


def test_broken_dependency_inside_a_module_is_not_hidden(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ff_broken_cmd.py").write_text("import ff_dependency_that_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "SUBCOMMANDS", [("broken", "ff_broken_cmd")])
    with pytest.raises(ModuleNotFoundError, match="ff_dependency_that_is_missing"):
        cli.build_parser()


def test_external_registration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ff_hello_cmd.py").write_text(
        "def add_parser(subparsers):\n"
        "    p = subparsers.add_parser('hello')\n"
        "    p.add_argument('--name', default='world')\n"
        "    p.set_defaults(func=lambda args: print('hello', args.name) or 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, ("hello", "ff_hello_cmd")])
    code, out, _ = run_main(["hello", "--name", "ff"], capsys)
    assert (code, out) == (3, "hello ff\n")


# -- demo -------------------------------------------------------------------------------------


def test_demo_matches_eager(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["demo", "--sizes", "1,3,8,17", "--layers", "2"], capsys)
    assert code == 0, err
    assert "pieces: 5 (3 capturable)" in out
    assert out.count(": ok ") == 4
    assert "all 4 batch sizes match eager" in out
    assert "graphs_traced=1" in out


def test_demo_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["demo", "--sizes", "1,x"], capsys)
    assert code == 2 and "--sizes: expected comma-separated ints" in err
    code, _, err = run_main(["demo", "--sizes", "300", "--max-num-tokens", "256"], capsys)
    assert code == 2 and "exceed --max-num-tokens=256" in err


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "freezeframe.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)
