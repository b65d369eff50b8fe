"""``freezeframe plan``: the table, the config it writes, the plot, and its one-line errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from freezeframe import cli
from freezeframe.cli import files as cli_files
from freezeframe.config import CompilationConfig

REPO = Path(__file__).resolve().parents[2]
HEADER = ("ladder                       sizes padding waste padded tokens/step      cost/step "
          "graph MiB steps without graph")


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def write(path: Path, data: object) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_table_of_plan_and_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hist = write(tmp_path / "h.json", {"1": 10, "2": 10, "8": 1})
    out_path = tmp_path / "config.json"
    code, out, err = run_main(["plan", hist, "--max-sizes", "2", "--out", str(out_path)], capsys)
    assert code == 0 and err == ""
    # 21 steps, 38 tokens. Plan {2, 8}: 48 padded tokens (waste 10/38), cost 21 * 16 + 48 = 384,
    # memory 12 + 10/128 MiB. Default ladder: 1, 2 and 8 are all rungs, so no padding; cost
    # 21 * 16 + 38 = 374; 51 graphs, 388.1 MiB.
    assert out.splitlines() == [
        f"{hist}: 21 steps, 3 distinct sizes from 1 to 8, 1.81 tokens per step",
        HEADER,
        "plan (<= 2 sizes)                2        26.32%               2.29          18.29"
        "      12.1                   0",
        "vLLM default (to 512)           51         0.00%               1.81          17.81"
        "     388.1                   0",
        "plan sizes: 2 8",
        f"wrote {out_path} (freezeframe config @{out_path} shows what it captures)",
    ]
    assert json.loads(out_path.read_text()) == {"cudagraph_capture_sizes": [2, 8],
                                                "max_cudagraph_capture_size": 8}
    cfg = CompilationConfig.from_json(out_path.read_text())
    assert cfg.cudagraph_capture_sizes == (2, 8)
    code, out, _ = run_main(["config", f"@{out_path}"], capsys)
    assert code == 0 and "capture sizes       2 sizes, max 8: 2 8" in out


def test_wrapped_histogram_budget_and_steps_above_the_default(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 600 is above vLLM's default ladder (512): those steps run without a graph there.
    hist = write(tmp_path / "h.json", {"histogram": {"1": 2, "600": 2}})
    # {1, 600}: 12 + 601/128 = 16.70 MiB > 16.5; {600} alone: 6 + 600/128 = 10.69 MiB
    code, out, _ = run_main(["plan", hist, "--budget-mib", "16.5"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[2] == ("plan (<= 16.5 MiB)               1        99.67%             600.00"
                        "         616.00      10.7                   0")
    assert lines[3].startswith("vLLM default (to 512)           51         0.00%")
    assert lines[3].endswith("   2")
    assert lines[4] == "plan sizes: 600"


def test_measured_step_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hist = write(tmp_path / "h.json", {"1": 100, "8": 10, "64": 5})
    # flat at 10 up to 8 tokens, then 24 at 64 (the default ladder's 64 is measured too)
    times = write(tmp_path / "t.json", {"1": 10, "8": 10, "64": 24})
    code, out, _ = run_main(["plan", hist, "--max-sizes", "2", "--step-times", times], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[1] == HEADER.replace("     cost/step", "step time/step")
    # {8, 64}: 110 * 10 + 5 * 24 = 1220 over 115 steps
    assert lines[2].startswith("plan (<= 2 sizes)                2")
    assert " 10.61 " in lines[2]
    assert lines[4] == "plan sizes: 8 64"


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    hist = write(tmp_path / "h.json", {"1": 10, "2": 10, "8": 1})
    png = tmp_path / "waste.png"
    code, out, _ = run_main(["plan", hist, "--max-sizes", "2", "--plot", str(png)], capsys)
    assert code == 0 and out.splitlines()[-1] == f"wrote {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    hist = write(tmp_path / "h.json", {"1": 1})
    code, out, err = run_main(["plan", hist, "--plot", str(tmp_path / "p.png")], capsys)
    assert (code, out) == (2, "")
    assert err == ("freezeframe plan: error: --plot: matplotlib is not installed; pip install "
                   "matplotlib (or freezeframe[bench]), or leave out --plot\n")


@pytest.mark.parametrize(("content", "args", "message"), [
    (None, [], "HISTOGRAM: cannot read '{dir}/h.json': No such file or directory"),
    ("{1: 2}", [], "{dir}/h.json: not valid JSON"),
    ('{"x": 2}', [], "{dir}/h.json: key 'x' is not a batch size"),
    ('{"4": -1}', [], "histogram[4]: a step count must be an int >= 0, got -1"),
    ('{"8": 1}', ["--budget-mib", "6"],
     "budget_mib: 6.0 MiB is below the estimated graph memory of the largest size 8 alone "
     "(6.06 MiB)"),
    ('{"8": 1}', ["--budget-mib", "-1"], "--budget-mib: must be a number >= 0, got -1.0"),
    ('{"8": 1}', ["--max-size", "4"], "max_size: 4 is below the largest observed size 8"),
    ('{"8": 1}', ["--step-times", "{dir}/none.json"],
     "--step-times: cannot read '{dir}/none.json': No such file or directory"),
    ('{"8": 1}', ["--out", "{dir}/no/such/dir/c.json"],
     "--out: cannot write '{dir}/no/such/dir/c.json': No such file or directory"),
])
def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             content: str | None, args: list[str], message: str) -> None:
    path = tmp_path / "h.json"
    if content is not None:
        path.write_text(content)
    argv = ["plan", str(path), *(a.replace("{dir}", str(tmp_path)) for a in args)]
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert err.startswith("freezeframe plan: error: " + message.replace("{dir}", str(tmp_path)))
    assert err.count("\n") == 1


def test_bad_max_sizes_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["plan", "h.json", "--max-sizes", "0"], capsys)
    assert code == 2
    assert err == ("freezeframe plan: error: argument --max-sizes: must be >= 1, got 0 (see "
                   "'freezeframe plan --help')\n")


def test_the_results_doc_shows_what_the_command_prints(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    code, out, _ = run_main(["plan", "examples/histogram_decode.json", "--budget-mib", "128"],
                            capsys)
    assert code == 0
    assert out in (REPO / "docs" / "results" / "cpu-2026-11-25.md").read_text()


@pytest.mark.parametrize(("flag", "where", "message"), [
    ("--out", "under_a_file", "--out: cannot write '{path}': Not a directory ('{dir}/file' is a "
                              "file); choose a path inside a directory"),
    ("--out", "deep_under_a_file", "--out: cannot write '{path}': Not a directory ('{dir}/file' "
                                   "is a file); choose a path inside a directory"),
    ("--out", "a_directory", "--out: cannot write '{path}': Is a directory; give a file path "
                             "such as '{dir}/config.json'"),
    ("--out", "missing_directory", "--out: cannot write '{path}': No such file or directory "
                                   "(directory '{dir}/no/such' does not exist); create it first "
                                   "or choose another path"),
    ("--plot", "under_a_file", "--plot: cannot write '{path}': Not a directory ('{dir}/file' is "
                               "a file); choose a path inside a directory"),
    ("--plot", "a_directory", "--plot: cannot write '{path}': Is a directory; give a file path "
                              "such as '{dir}/plan.png'"),
])
def test_output_paths_are_checked_before_the_work(
        flag: str, where: str, message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    if flag == "--plot":
        pytest.importorskip("matplotlib")  # without it, that is the error (checked first)
    (tmp_path / "file").write_text("")
    path = {"under_a_file": tmp_path / "file" / "p.json",
            "deep_under_a_file": tmp_path / "file" / "a" / "b" / "p.json",
            "a_directory": tmp_path,
            "missing_directory": tmp_path / "no" / "such" / "p.json"}[where]
    hist = write(tmp_path / "h.json", {"1": 10, "2": 10, "8": 1})
    code, out, err = run_main(["plan", hist, flag, str(path)], capsys)
    # nothing printed: the plan was not made (the table came first, then the error, before)
    assert (code, out) == (2, "")
    assert err == ("freezeframe plan: error: "
                   + message.replace("{path}", str(path)).replace("{dir}", str(tmp_path)) + "\n")
    # checked before the histogram is even read
    code, out, err = run_main(["plan", str(tmp_path / "none.json"), flag, str(path)], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"freezeframe plan: error: {flag}: cannot write ")


def test_an_unwritable_out_directory_is_refused_before_the_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli_files.tempfile, "mkstemp", refuse)  # a directory we may not write into
    hist = write(tmp_path / "h.json", {"1": 10})
    out_path = tmp_path / "c.json"
    code, out, err = run_main(["plan", hist, "--out", str(out_path)], capsys)
    assert (code, out) == (2, "")
    assert err == (f"freezeframe plan: error: --out: cannot write {str(out_path)!r}: Permission "
                   "denied; choose a writable location\n")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes into a read-only directory")
def test_a_read_only_out_directory_is_refused(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        hist = write(tmp_path / "h.json", {"1": 10})
        code, out, err = run_main(["plan", hist, "--out", str(locked / "c.json")], capsys)
    finally:
        locked.chmod(0o700)
    assert (code, out) == (2, "")
    assert err == (f"freezeframe plan: error: --out: cannot write {str(locked / 'c.json')!r}: "
                   "Permission denied; choose a writable location\n")


def test_an_existing_out_file_is_replaced(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    hist = write(tmp_path / "h.json", {"2": 10})
    out_path = tmp_path / "c.json"
    out_path.write_text("old")
    code, _, err = run_main(["plan", hist, "--out", str(out_path)], capsys)
    assert (code, err) == (0, "")
    assert json.loads(out_path.read_text()) == {"cudagraph_capture_sizes": [2],
                                                "max_cudagraph_capture_size": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "h.json"]  # no probe left
