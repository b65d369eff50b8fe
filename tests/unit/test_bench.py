"""``freezeframe bench`` on the tiny preset with very few steps: it runs and writes its JSON.

Timings are never asserted (a shared CPU makes them noise); the structure and the bookkeeping
(graph modes capture, skipped modes say why, floor shares are consistent) are.
"""

from __future__ import annotations

import io
import json
import re
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from freezeframe.bench import run as bench_run
from freezeframe.bench.measure import kv_read_bytes, split_contexts
from freezeframe.bench.modes import modes_from
from freezeframe.bench.report import compare_with_eager, format_table, mismatched_modes
from freezeframe.bench.run import BenchOptions, run_bench
from freezeframe.cli import main
from freezeframe.errors import ConfigError
from freezeframe.models import LlamaConfig


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only notes and skips")
def test_bench_tiny_writes_json_and_plot(tmp_path: Path) -> None:
    opts = BenchOptions(preset="tiny", batch_sizes=(2, 1), modes=(
        "eager", "reduce-overhead", "none", "full_and_piecewise"), steps=2, warmup=1,
        out=str(tmp_path))
    result = run_bench(opts)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["batch_sizes"] == [1, 2] and saved["preset"] == "tiny"
    assert saved["compiler"] == "eager" and saved["dtype"] == "float32"
    assert list(saved["modes"]) == ["eager", "reduce-overhead", "none", "full_and_piecewise"]
    assert "needs CUDA" in saved["modes"]["reduce-overhead"]["skipped"]
    assert any("emulated backend" in n for n in saved["notes"])
    # decode by context: 128 fits the tiny preset's 512 positions, 1k and 4k do not
    assert saved["contexts"] == [128] and saved["max_model_len"] == 128 + 16
    assert "decode contexts 1024, 4096 skipped: above the tiny preset's 512 positions (one " \
           "block of 16 is kept free)" in saved["notes"]
    assert saved["attention_kernel"] == "torch"  # auto on a CPU
    # a key of every layer (2) for K and V, 2 KV heads of 16 floats: 512 bytes; the torch
    # static path reads the whole 144-key window, the Triton kernel the 128-key context
    assert saved["kv_bytes_per_decode_token"] == {"128": {"torch": 144 * 512,
                                                          "triton": 128 * 512}}
    for mode in ("eager", "none", "full_and_piecewise"):
        entry = saved["modes"][mode]
        assert set(entry["decode"]) == {"1", "2"} and set(entry["mixed"]) == {"1", "2"}
        for row in [*entry["decode"].values(), *entry["decode_by_context"].values()]:
            assert row["median_ms"] > 0
            assert row["floor_share"] == pytest.approx(row["floor_ms"] / row["median_ms"])
        assert set(entry["decode_by_context"]) == {"128"}
        # the floor of a context row: the weights and one request's 128 keys per layer
        floor = (saved["weight_bytes"] + 128 * 512) / saved["bandwidth_bytes_per_s"] * 1e3
        assert entry["decode_by_context"]["128"]["floor_ms"] == pytest.approx(floor)
        assert entry["prefill_ms"] > 0 and entry["startup_s"] > 0
        assert entry["matches_eager"] is True and entry["max_rel_diff_vs_eager"] <= 1e-4
    assert saved["match_tolerance"] == 1e-4
    fp = saved["modes"]["full_and_piecewise"]
    # FULL graphs for uniform decode at 1, 2, 4 tokens... and PIECEWISE for mixed batches
    # max_num_seqs 3 (largest batch + 1): PIECEWISE at 1, 2, 3, 4, 6 and FULL decode at 1, 2, 3
    # (the widest decode batch, max_num_seqs, joins the ladder)
    assert fp["graphs_captured"] == 8 and fp["capture_s"] > 0
    # 3 steps (1 warm-up + 2 timed) of decode and of mixed per batch size, 3 of decode at
    # context 128, and 3 of prefill
    assert fp["runner_stats"]["steps"] == 18
    assert (fp["runner_stats"]["steps_full"], fp["runner_stats"]["steps_eager"]) == (11, 7)
    assert saved["modes"]["none"]["runner_stats"]["steps_eager"] == 18
    # one FULL decode replay of the tiny Llama (2 layers, torch attention) records 160
    # launches on the emulated backend (174 while each layer's op computed the token layout
    # itself); modes without FULL graphs have no count
    assert fp["full_decode_launches"] == 160
    assert "full_decode_launches" not in saved["modes"]["none"]
    assert (tmp_path / "latency_vs_batch.png").exists() or any(
        "matplotlib" in n for n in saved["notes"])
    table = format_table(result)
    assert "full_and_piecewise" in table and "skipped: needs CUDA" in table
    assert re.split(r"\s{2,}", table.splitlines()[1].strip()) == [
        "mode", "decode bs1 ms", "decode bs2 ms", "floor% bs1", "ctx128 ms", "mixed bs2 ms",
        "prefill ms", "startup s", "launches", "vs eager"]
    fp_row = next(line for line in table.splitlines() if line.startswith("full_and_piecewise"))
    assert fp_row.split()[-3] == "160"  # launches, then "ok <diff>"
    assert "KV bytes one decode token reads (all layers): ctx128: torch 0.0703 MiB, triton " \
           "0.0625 MiB" in table


def test_bench_cli_runs_eager_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--modes", "eager", "--batch-sizes", "1", "--steps", "1",
                 "--warmup", "0", "--out", str(tmp_path)])
    assert code == 0
    assert "decode bs1 ms" in capsys.readouterr().out
    assert list(json.loads((tmp_path / "results.json").read_text())["modes"]) == ["eager"]


def test_bench_options_are_validated() -> None:
    assert modes_from("eager,reduce_overhead,FULL-AND-PIECEWISE") == (
        "eager", "reduce-overhead", "full_and_piecewise")
    with pytest.raises(ConfigError, match="unknown mode"):
        BenchOptions(modes=("fast",))
    with pytest.raises(ConfigError, match=r"--batch-sizes: give at least one, each >= 1; got "
                                          r"\[0\]"):
        BenchOptions(batch_sizes=(0,))
    with pytest.raises(ConfigError, match=r"--preset: unknown preset '7b'; choose one of "
                                          r"\['1b', 'tiny'\]"):
        BenchOptions(preset="7b")
    with pytest.raises(ConfigError, match="--context must be >= 1, got 0"):
        BenchOptions(context=0)
    with pytest.raises(ConfigError, match=r"--contexts: each context length must be >= 1, got "
                                          r"\[128, 0\]"):
        BenchOptions(contexts=(128, 0))
    with pytest.raises(ConfigError, match=r"--attention-kernel='flash' is not an attention "
                                          r"kernel; choose one of \['auto', 'torch', 'triton'\]"):
        BenchOptions(attention_kernel="flash")


def test_contexts_and_kv_bytes_for_the_1b_shapes() -> None:
    assert split_contexts((4096, 128, 1024, 128), 512) == ((128,), (1024, 4096))
    assert split_contexts((128, 1024, 4096), 8192) == ((128, 1024, 4096), ())
    assert split_contexts((496, 497), 512) == ((496,), (497,))
    one_b = LlamaConfig.preset("1b")
    # 16 layers x (K and V) x 8 KV heads x 64 dims x 2 bytes (bf16) = 32 KiB per key
    assert kv_read_bytes(one_b, 2, 1) == 32768
    assert kv_read_bytes(one_b, 2, 4096) == 128 * 2**20


# -- progress on stderr, and running without the optional tqdm and matplotlib ------------------
class _Terminal(io.StringIO):
    """A stderr that says it is a terminal (where a progress bar would be drawn)."""

    def isatty(self) -> bool:
        return True


def _bench_argv(out: Path, modes: str = "eager,piecewise") -> list[str]:
    return ["bench", "--modes", modes, "--batch-sizes", "1,2", "--steps", "1", "--warmup", "0",
            "--device", "cpu", "--out", str(out)]


PLAIN_LINES = [
    "bench: building the tiny Llama (N parameters, float32) on cpu; modes: eager, piecewise; "
    "batch sizes: 1, 2",
    "bench: built in N s; measuring memory bandwidth (128 MiB copy)",
    "bench: [1/2] eager: first call at each batch size",
    "bench: [1/2] eager: timing decode and mixed steps at batch size 1",
    "bench: [1/2] eager: timing decode and mixed steps at batch size 2",
    "bench: [1/2] eager: timing decode at context 128 (batch size 1)",
    "bench: [1/2] eager: timing a prefill of 64 tokens",
    "bench: [1/2] eager: done in N s",
    "bench: [2/2] piecewise: compiling (trace, split, eager compiler)",
    "bench: [2/2] piecewise: capturing graphs (emulated)",
    "bench: [2/2] piecewise: first call at each batch size",
    "bench: [2/2] piecewise: timing decode and mixed steps at batch size 1",
    "bench: [2/2] piecewise: timing decode and mixed steps at batch size 2",
    "bench: [2/2] piecewise: timing decode at context 128 (batch size 1)",
    "bench: [2/2] piecewise: timing a prefill of 64 tokens",
    "bench: [2/2] piecewise: done in N s",
]


def _numbers_out(text: str) -> list[str]:
    text = re.sub(r"\d+\.\d s", "N s", text)
    return re.sub(r"\(\d[\d,]* parameters", "(N parameters", text).splitlines()


def test_progress_is_plain_lines_without_tqdm_and_no_plot_without_matplotlib(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Neither optional package importable (None in sys.modules makes `import x` fail), on a
    # terminal where tqdm would draw a bar.
    for name in ("tqdm", "tqdm.auto", "matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(_bench_argv(tmp_path)) == 0
    out = capsys.readouterr().out
    assert _numbers_out(err.getvalue()) == PLAIN_LINES
    assert out.splitlines()[-1] == f"wrote {tmp_path}/results.json"
    assert "note: matplotlib is not installed: no plot written (pip install matplotlib)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert list(saved["modes"]) == ["eager", "piecewise"]
    # one piecewise graph per capture size: max_num_seqs=3 (largest batch + 1) gives a max
    # capture size of 6, and the ladder 1, 2, 4 ends at that max, with 3 (max_num_seqs) added
    assert saved["modes"]["piecewise"]["graphs_captured"] == 5


class _FakeBar:
    """Records what the benchmark asks of tqdm."""

    made: ClassVar[list[_FakeBar]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[str, Any]] = []
        _FakeBar.made.append(self)

    def write(self, line: str, file: Any = None) -> None:
        self.calls.append(("write", line))

    def set_postfix_str(self, text: str) -> None:
        self.calls.append(("postfix", text))

    def update(self, n: int = 1) -> None:
        self.calls.append(("update", n))

    def close(self) -> None:
        self.calls.append(("close", None))


def test_progress_uses_a_tqdm_bar_on_a_terminal(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeBar.made = []
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=_FakeBar))
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(_bench_argv(tmp_path, modes="eager,reduce-overhead")) == 0
    assert err.getvalue() == ""  # everything went through the bar
    (bar,) = _FakeBar.made
    assert bar.kwargs == {"total": 2, "desc": "bench", "unit": "mode", "file": err,
                          "leave": False}
    calls = [(kind, re.sub(r"\d+\.\d s", "N s", re.sub(r"\(\d[\d,]* parameters",
                                                      "(N parameters", str(arg))))
             for kind, arg in bar.calls]
    assert calls == [
        ("write", "bench: building the tiny Llama (N parameters, float32) on cpu; modes: eager, "
                  "reduce-overhead; batch sizes: 1, 2"),
        ("write", "bench: built in N s; measuring memory bandwidth (128 MiB copy)"),
        ("postfix", "eager: first call at each batch size"),
        ("postfix", "eager: timing decode and mixed steps at batch size 1"),
        ("postfix", "eager: timing decode and mixed steps at batch size 2"),
        ("postfix", "eager: timing decode at context 128 (batch size 1)"),
        ("postfix", "eager: timing a prefill of 64 tokens"),
        ("write", "bench: [1/2] eager: done in N s"),
        ("update", "1"),
        ("write", "bench: [2/2] reduce-overhead: skipped (needs CUDA graphs (cudagraph trees); "
                  "no CUDA device)"),
        ("update", "1"),
        ("close", "None"),
    ]


def test_quiet_and_non_terminal_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    _FakeBar.made = []
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=_FakeBar))
    assert main([*_bench_argv(tmp_path, modes="eager"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    # not a terminal (a log file, CI): plain lines even with tqdm installed
    assert main(_bench_argv(tmp_path, modes="eager")) == 0
    assert _numbers_out(capsys.readouterr().err)[-1] == "bench: [1/1] eager: done in N s"
    assert _FakeBar.made == []


def test_a_mode_whose_logits_differ_from_eager_is_named_and_fails_the_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    want = [torch.tensor([[1.0, -4.0]]), torch.tensor([[2.0, 0.5]])]
    result: dict[str, Any] = {"notes": [], "modes": {"eager": {}, "full": {}, "none": {}}}
    compare_with_eager(result, {
        "eager": want,
        "full": [want[0], torch.tensor([[2.0, 0.7]])],  # 0.2 off a largest value of 2
        "none": [want[0] + 1e-5, want[1]],
    }, torch.float32)
    assert result["modes"]["full"] == {"max_rel_diff_vs_eager": pytest.approx(0.1),
                                       "matches_eager": False}
    assert result["modes"]["none"]["matches_eager"] is True
    assert result["modes"]["eager"]["max_rel_diff_vs_eager"] == 0.0
    assert result["notes"] == ["full: logits differ from eager's by 1.00e-01 of their largest "
                               "value (tolerance 1e-04): a wrong answer, not a speed result"]
    assert mismatched_modes(result) == ["full"]

    real = bench_run.run_bench

    def wrong_full(opts: BenchOptions, progress: Any = None) -> dict[str, Any]:
        out = real(opts, progress)
        out["modes"]["full"]["matches_eager"] = False
        return out

    monkeypatch.setattr(bench_run, "run_bench", wrong_full)
    code = main(["bench", "--modes", "eager,full", "--batch-sizes", "1", "--steps", "1",
                 "--warmup", "0", "--out", str(tmp_path), "-q"])
    assert code == 1
    assert capsys.readouterr().err.endswith(
        "freezeframe bench: error: full gave other logits than eager (see the notes above)\n")


def test_results_are_written_after_every_mode_so_a_run_cut_short_keeps_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bench stopped in its second mode (here: one that raises; on a GPU lease: a deadline)
    has already written the first mode's results."""
    real = bench_run._Bench.run_mode

    def second_mode_dies(self: Any, mode: str) -> Any:
        if mode == "none":
            saved = json.loads((tmp_path / "results.json").read_text())
            assert list(saved["modes"]) == ["eager"]
            assert saved["unfinished_modes"] == ["none"]
            raise KeyboardInterrupt("stopped at the deadline")
        return real(self, mode)

    monkeypatch.setattr(bench_run._Bench, "run_mode", second_mode_dies)
    with pytest.raises(KeyboardInterrupt):
        run_bench(BenchOptions(preset="tiny", batch_sizes=(1,), modes=("eager", "none"),
                               steps=1, warmup=0, out=str(tmp_path)))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert list(saved["modes"]) == ["eager"] and saved["unfinished_modes"] == ["none"]
    assert saved["modes"]["eager"]["decode"]["1"]["median_ms"] > 0
    assert not (tmp_path / ".results.json.partial").exists()
