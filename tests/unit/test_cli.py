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
    assert lines["padding"] == "1->1 2->2 3..4->4; 0 and above 4: no graph (unpadded)"
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
    proc = _run_cli("config", '{"max_cudagraph_capture_size": 257, "max_num_tokens": 200}')
    assert proc.returncode == 0
    assert "Truncating max_cudagraph_capture_size from 257 to 200" in proc.stderr
    assert "capture sizes       28 sizes, max 200" in proc.stdout


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
    assert loaded == ["freezeframe.cli.config"]


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


def test_demo_rejects_sizes_above_max_num_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["demo", "--sizes", "300", "--max-num-tokens", "256"], capsys)
    assert (code, out) == (2, "")
    assert err == ("freezeframe demo: error: --sizes: [300] exceed --max-num-tokens=256; raise "
                   "--max-num-tokens or drop them\n")


# -- bad input: one line on stderr, exit 2, nothing on stdout, before any work ------------------
BAD_ARGUMENTS = [
    (["demo", "--layers", "0"], "freezeframe demo: error: argument --layers: must be >= 1, got 0 "
                                "(see 'freezeframe demo --help')"),
    (["demo", "--hidden", "-1"], "freezeframe demo: error: argument --hidden: must be >= 1, got "
                                 "-1 (see 'freezeframe demo --help')"),
    (["demo", "--hidden", "big"], "freezeframe demo: error: argument --hidden: expected an int "
                                  ">= 1, got 'big' (see 'freezeframe demo --help')"),
    (["demo", "--max-num-tokens", "0"], "freezeframe demo: error: argument --max-num-tokens: "
                                        "must be >= 1, got 0 (see 'freezeframe demo --help')"),
    (["demo", "--sizes", "1,x"], "freezeframe demo: error: argument --sizes: expected "
                                 "comma-separated ints >= 1, got '1,x' (see 'freezeframe demo "
                                 "--help')"),
    (["demo", "--sizes", "0,2"], "freezeframe demo: error: argument --sizes: give at least one "
                                 "value, each >= 1; got '0,2' (see 'freezeframe demo --help')"),
    (["demo", "--backend", "tvm"], "freezeframe demo: error: argument --backend: invalid choice: "
                                   "'tvm' (choose from 'eager', 'inductor') (see 'freezeframe "
                                   "demo --help')"),
    (["bench", "--preset", "7b"], "freezeframe bench: error: argument --preset: invalid choice: "
                                  "'7b' (choose from 'tiny', '1b') (see 'freezeframe bench "
                                  "--help')"),
    (["bench", "--steps", "0"], "freezeframe bench: error: argument --steps: must be >= 1, got 0 "
                                "(see 'freezeframe bench --help')"),
    (["bench", "--warmup", "-1"], "freezeframe bench: error: argument --warmup: must be >= 0, "
                                  "got -1 (see 'freezeframe bench --help')"),
    (["bench", "--context", "0"], "freezeframe bench: error: argument --context: must be >= 1, "
                                  "got 0 (see 'freezeframe bench --help')"),
    (["bench", "--prefill-len", "-5"], "freezeframe bench: error: argument --prefill-len: must "
                                       "be >= 1, got -5 (see 'freezeframe bench --help')"),
    (["bench", "--batch-sizes", "1,a"], "freezeframe bench: error: argument --batch-sizes: "
                                        "expected comma-separated ints >= 1, got '1,a' (see "
                                        "'freezeframe bench --help')"),
    (["bench", "--batch-sizes", "0"], "freezeframe bench: error: argument --batch-sizes: give at "
                                      "least one value, each >= 1; got '0' (see 'freezeframe "
                                      "bench --help')"),
    (["bench", "--modes", "fast,eager"], "freezeframe bench: error: --modes: unknown mode(s) "
                                         "['fast']; choose from ['eager', 'compile', "
                                         "'reduce-overhead', 'none', 'piecewise', 'full', "
                                         "'full_and_piecewise', 'breakable', "
                                         "'full_and_breakable', 'hf-eager', 'hf-compile', "
                                         "'ff-hf', 'ff-hf-lookup']"),
    (["bench", "--modes", ","], "freezeframe bench: error: --modes: give at least one of "
                                "['eager', 'compile', 'reduce-overhead', 'none', 'piecewise', "
                                "'full', 'full_and_piecewise', 'breakable', "
                                "'full_and_breakable', 'hf-eager', 'hf-compile', 'ff-hf', "
                                "'ff-hf-lookup']"),
    (["bench", "--device", "tpu"], "freezeframe bench: error: --device: unknown device 'tpu'; "
                                   "use auto, cpu, cuda or cuda:N"),
    (["bench", "--device", "mps"], "freezeframe bench: error: --device: the benchmark runs on "
                                   "cpu or cuda, got 'mps'; use auto, cpu, cuda or cuda:N"),
    (["bench", "--context", "600"], "freezeframe bench: error: --context 600 / --prefill-len 64 "
                                    "leave no room in the tiny preset's 512 positions (the "
                                    "longer one plus one block of 16 must fit); use at most 496"),
    (["bench", "--out", " "], "freezeframe bench: error: --out: give a directory for "
                              "results.json and the plot"),
    (["--bogus"], "freezeframe: error: unrecognized arguments: --bogus (see 'freezeframe "
                  "--help')"),
    (["nosuch"], "freezeframe: error: argument COMMAND: invalid choice: 'nosuch' (choose from "
                 "'config', 'demo', 'bench', 'cache', 'plan') (see 'freezeframe --help')"),
]


@pytest.mark.parametrize(("argv", "line"), BAD_ARGUMENTS,
                         ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_exit_2(argv: list[str], line: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    if argv[0] == "bench" and "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "out")]
    code, out, err = run_main(argv, capsys)
    assert (code, out, err) == (2, "", line + "\n")
    assert not (tmp_path / "out").exists()  # rejected before anything ran


def test_bench_on_a_missing_gpu_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    code, out, err = run_main(["bench", "--device", "cuda", "--out", str(tmp_path)], capsys)
    assert (code, out) == (2, "")
    assert err == (
        "freezeframe bench: error: --device cuda: no CUDA device is available "
        f"(torch.cuda.is_available() is False; torch {torch.__version__}, CUDA none (a CPU-only "
        "build)); use --device cpu or auto\n")


def test_bench_on_a_gpu_index_that_does_not_exist(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, out, err = run_main(["bench", "--device", "cuda:2", "--out", str(tmp_path)], capsys)
    assert (code, out, err) == (2, "", "freezeframe bench: error: --device cuda:2: there are 2 "
                                       "CUDA device(s), numbered 0..1\n")


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_bench_unwritable_out_fails_before_running(where: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out_dir = blocker / "out" if where == "under_a_file" else blocker
    code, out, err = run_main(["bench", "--modes", "eager", "--device", "cpu", "--out",
                               str(out_dir)], capsys)
    assert (code, out) == (2, "")
    if where == "under_a_file":
        assert err == (f"freezeframe bench: error: --out {str(out_dir)!r}: cannot write results "
                       "there (Not a directory); choose a writable directory\n")
    else:
        assert err == (f"freezeframe bench: error: --out {str(out_dir)!r} is a file, not a "
                       "directory; choose a directory\n")


@pytest.mark.parametrize(("content", "line"), [
    (None, "cannot read config file {path!r}: Is a directory"),
    (b"\xff\xfe{", "config file {path!r} is not UTF-8 text (invalid start byte at byte 0); "
                  "give a JSON file"),
    (b'{"level": 3, "cudagraph_mod": "full"}',
     "unknown compilation-config field(s) ['cudagraph_mod']; valid fields are"),
    (b'{"backend": 1}', "backend: unknown compiler 1; use one of ['eager', 'inductor']"),
    (b"", "compilation config is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
])
def test_config_file_errors_are_one_line(content: bytes | None, line: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cfg.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    code, out, err = run_main(["config", f"@{path}"], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("freezeframe config: error: " + line.format(path=str(path)))
    assert err.count("\n") == 1


# -- freezeframe's own errors at the top level ------------------------------------------------
def _register_raiser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ff_raise_cmd.py").write_text(
        "import freezeframe.errors as e\n"
        "def add_parser(subparsers):\n"
        "    p = subparsers.add_parser('raise')\n"
        "    p.add_argument('kind')\n"
        "    p.set_defaults(func=run)\n"
        "def run(args):\n"
        "    if args.kind == 'interrupt':\n"
        "        raise KeyboardInterrupt\n"
        "    raise getattr(e, args.kind)('it broke\\n  on two lines')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, ("raise", "ff_raise_cmd")])


@pytest.mark.parametrize(("kind", "code", "line"), [
    ("ConfigError", 2, "freezeframe raise: error: it broke on two lines"),
    ("CompileError", 1, "freezeframe raise: error: it broke on two lines (rerun with freezeframe "
                        "--debug or FREEZEFRAME_DEBUG=1 for the traceback)"),
    ("CaptureError", 1, "freezeframe raise: error: it broke on two lines (rerun with freezeframe "
                        "--debug or FREEZEFRAME_DEBUG=1 for the traceback)"),
    ("interrupt", 130, "freezeframe raise: interrupted"),
])
def test_freezeframe_errors_are_one_line(kind: str, code: int, line: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    _register_raiser(tmp_path, monkeypatch)
    assert run_main(["raise", kind], capsys) == (code, "", line + "\n")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    _register_raiser(tmp_path, monkeypatch)
    if how == "flag":
        monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
        argv = ["--debug", "raise", "CompileError"]
    else:
        monkeypatch.setenv(cli.DEBUG_ENV, "1")
        argv = ["raise", "CompileError"]
    code, out, err = run_main(argv, capsys)
    assert (code, out) == (1, "")
    lines = err.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-3:] == ["freezeframe.errors.CompileError: it broke", "  on two lines",
                          "freezeframe raise: error: it broke on two lines"]


def test_console_bad_argument_is_one_line() -> None:
    proc = _run_cli("demo", "--layers", "0")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("freezeframe demo: error: argument --layers: must be >= 1, got 0 "
                           "(see 'freezeframe demo --help')\n")


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["demo", "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: freezeframe demo")


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "freezeframe.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.parametrize(("args", "unbuffered"), [
    (["config", "{}"], False),
    (["config", "{}"], True),  # each print meets the closed pipe inside the command
    (["cache", "list", "--dir", "{tmp}"], False),
    (["demo", "--sizes", "1,2"], False),
])
def test_a_closed_stdout_ends_the_command_quietly(args: list[str], unbuffered: bool,
                                                  tmp_path: Path) -> None:
    """``freezeframe demo | head -1``: the reader is gone, so the command stops without a
    traceback and exits 141 (128 + SIGPIPE), as a command SIGPIPE ended does."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = str(REPO / "src")
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "freezeframe.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes anything: every write meets EPIPE
    err = proc.stderr.read().decode()
    assert (proc.wait(timeout=120), err) == (141, "")


def test_python_dash_m_freezeframe_is_the_command() -> None:
    """Issue 42 item 16: ``python -m freezeframe`` failed (no freezeframe.__main__)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-m", "freezeframe", "config", '{"max_num_seqs": 4}'],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == _run_cli("config", '{"max_num_seqs": 4}').stdout
    assert "max_num_seqs=4" in done.stdout and "cache key" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "freezeframe", "no-such-command"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "invalid choice: 'no-such-command'" in bad.stderr
