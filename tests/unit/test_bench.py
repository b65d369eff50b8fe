"""``freezeframe bench`` on the tiny preset with very few steps: it runs and writes its JSON.

Timings are never asserted (a shared CPU makes them noise); the structure and the bookkeeping
(graph modes capture, skipped modes say why, floor shares are consistent) are.
"""

from __future__ import annotations

import dataclasses
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

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only notes and skips")
def test_bench_tiny_writes_json_and_plot(tmp_path: Path) -> None:
    # a prefill of 4 tokens and mixed chunks of 2 keep every step within the graphs' sizes
    opts = BenchOptions(preset="tiny", batch_sizes=(2, 1), modes=(
        "eager", "reduce-overhead", "none", "full_and_piecewise"), steps=2, warmup=1,
        prefill_len=4, mixed_chunk=2, grid=True, out=str(tmp_path))
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
        assert set(entry["decode_grid"]) == {"128"} and set(entry["decode_grid"]["128"]) == {
            "1", "2"}
        rows = [*entry["decode"].values(), *entry["decode_by_context"].values(),
                *entry["decode_grid"]["128"].values()]
        for row in rows:
            assert row["median_ms"] > 0 and row["host_ms"] > 0
            assert row["floor_share"] == pytest.approx(row["floor_ms"] / row["median_ms"])
            # eager is the only peer that ran: each row over eager's at the same step
        assert set(entry["decode_by_context"]) == {"128"}
        assert entry["decode_by_context"]["128"] == entry["decode_grid"]["128"]["1"]
        eager_row = saved["modes"]["eager"]["decode"]["2"]["median_ms"]
        assert entry["decode"]["2"]["vs_best_peer"] == pytest.approx(
            entry["decode"]["2"]["median_ms"] / eager_row)
        # the floor of a context row: the weights and one request's 128 keys per layer
        floor = (saved["weight_bytes"] + 128 * 512) / saved["bandwidth_bytes_per_s"] * 1e3
        assert entry["decode_by_context"]["128"]["floor_ms"] == pytest.approx(floor)
        assert entry["prefill_ms"] > 0 and entry["startup_s"] > 0
        assert entry["matches_eager"] is True and entry["max_rel_diff_vs_eager"] <= 1e-4
        # timed: 2 steps of each decode row (at context 64: batch 1, 2; at 128: batch 1, 2),
        # 1 of each mixed row and 1 prefill
        assert entry["timed_steps"] == 4 * 2 + 2 + 1
    assert saved["match_tolerance"] == 1e-4
    assert saved["modes"]["eager"]["planned_steps"] is None  # no runner
    fp, none = saved["modes"]["full_and_piecewise"], saved["modes"]["none"]
    # every timed step of the graph mode ran from the runner's plan (steps_planned counts
    # those); none of the mode without graphs could
    assert (fp["planned_steps"], none["planned_steps"]) == (11, 0)
    # the default ladder: PIECEWISE at 1, 2, 3, 4 (it ends at max_num_tokens, 4) and FULL
    # decode at 1, 2, 3 (max_num_seqs 3, the largest batch + 1, joins it), largest first
    assert fp["graphs_captured"] == 7 and fp["capture_s"] > 0
    assert [(g["mode"], g["num_tokens"]) for g in fp["capture"]["graphs"]] == [
        ("PIECEWISE", 4), ("PIECEWISE", 3), ("PIECEWISE", 2), ("PIECEWISE", 1), ("FULL", 3),
        ("FULL", 2), ("FULL", 1)]
    refit = fp["capture"]["refit"]
    assert refit["measured_bytes"] == fp["capture"]["memory_bytes"] > 0
    assert refit["measured_bytes"] == sum(g["memory_bytes"] for g in fp["capture"]["graphs"])
    # the compiling step, the first decode call at each batch size (2), then each timed row's
    # warm-up and steps: 4 decode rows of 3, 2 mixed and 1 prefill of 2; then the step the
    # profiled replay is staged with. Only the first step of each shape (compile, two first
    # calls, two mixed and one prefill warm-up) took the whole way
    assert fp["runner_stats"]["steps"] == 1 + 2 + 4 * 3 + 3 * 2 + 1 == 22
    assert fp["runner_stats"]["steps_planned"] == 22 - 6
    assert none["runner_stats"]["steps_eager"] == 21
    # one FULL decode replay of the tiny Llama (2 layers, torch attention) records 160
    # launches on the emulated backend (174 while each layer's op computed the token layout
    # itself); modes without FULL graphs have no count
    assert fp["full_decode_launches"] == 160
    profile = fp["full_decode_profile"]
    assert (profile["activity"], profile["batch_size"], profile["context"]) == ("cpu", 1, 64)
    # every op of the emulated replay, grouped by name (all of them fit the table's 40 rows)
    assert profile["rows_left_out"] == 0
    assert profile["launches"] == sum(r["count"] for r in profile["rows"])
    assert profile["launches_per_layer"] == pytest.approx(profile["launches"] / 2)
    assert "full_decode_launches" not in none and "full_decode_profile" not in none
    assert (tmp_path / "latency_vs_batch.png").exists() or any(
        "matplotlib" in n for n in saved["notes"])
    table = format_table(result)
    assert "full_and_piecewise" in table and "skipped: needs CUDA" in table
    assert re.split(r"\s{2,}", table.splitlines()[1].strip()) == [
        "mode", "decode bs1 ms", "decode bs2 ms", "floor% bs1", "vs peer bs1", "ctx128 ms",
        "mixed bs2 ms", "prefill ms", "startup s", "host ms bs1", "planned", "launches",
        "vs eager"]
    fp_row = next(line for line in table.splitlines() if line.startswith("full_and_piecewise"))
    assert fp_row.split()[-4:-2] == ["11/11", "160"]  # planned, launches, then "ok <diff>"
    assert "KV bytes one decode token reads (all layers): ctx128: torch 0.0703 MiB, triton " \
           "0.0625 MiB" in table
    assert "full_and_piecewise, one FULL decode replay (batch size 1, context 64):" in table


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
    "bench: [1/2] eager: timing decode at context 128",
    "bench: [1/2] eager: timing a prefill of 64 tokens",
    "bench: [1/2] eager: done in N s",
    "bench: [2/2] piecewise: compiling (trace, split, eager compiler)",
    "bench: [2/2] piecewise: capturing graphs (emulated)",
    "bench: [2/2] piecewise: first call at each batch size",
    "bench: [2/2] piecewise: timing decode and mixed steps at batch size 1",
    "bench: [2/2] piecewise: timing decode and mixed steps at batch size 2",
    "bench: [2/2] piecewise: timing decode at context 128",
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
    # a graph mode other than the ladder's captures the sizes its steps use: decode at 1 and
    # 2 tokens, the mixed steps (16 tokens more) at 17 and 18
    assert saved["modes"]["piecewise"]["graphs_captured"] == 4


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
        ("postfix", "eager: timing decode at context 128"),
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
    want = {1: torch.tensor([[1.0, -4.0]]), 2: torch.tensor([[2.0, 0.5]])}
    result: dict[str, Any] = {"notes": [], "modes": {"eager": {}, "full": {}, "none": {},
                                                     "few": {}}}
    compare_with_eager(result, {
        "eager": want,
        "full": {1: want[1], 2: torch.tensor([[2.0, 0.7]])},  # 0.2 off a largest value of 2
        "none": {1: want[1] + 1e-5, 2: want[2]},
        "few": {2: torch.tensor([[2.0, 0.5001]])},  # a mode run at batch 2 alone
    }, torch.float32)
    assert result["modes"]["full"] == {"max_rel_diff_vs_eager": pytest.approx(0.1),
                                       "matches_eager": False}
    assert result["modes"]["none"]["matches_eager"] is True
    assert result["modes"]["eager"]["max_rel_diff_vs_eager"] == 0.0
    assert result["modes"]["few"]["max_rel_diff_vs_eager"] == pytest.approx(1e-4 / 2, rel=1e-3)
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


def test_results_are_written_after_every_row_so_a_run_cut_short_keeps_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bench stopped in the middle of a mode (here: its first mixed step raises; on a GPU
    lease: a deadline) has written the rows it timed; a mode that fails keeps them with its
    error, and the next mode runs."""
    from freezeframe.bench import rows as bench_rows

    real = bench_rows.RowTimer.median_ms
    stop: list[BaseException] = [KeyboardInterrupt("stopped at the deadline")]

    def mixed_dies(self: Any, step: Any, steps: int, warmup: int) -> float:
        if self.read_planned is not None and stop:  # the freezeframe mode's first mixed step
            raise stop.pop()
        return real(self, step, steps, warmup)  # type: ignore[no-any-return]

    monkeypatch.setattr(bench_rows.RowTimer, "median_ms", mixed_dies)
    opts = BenchOptions(preset="tiny", batch_sizes=(1,), modes=("eager", "none"), steps=1,
                        warmup=0, out=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        run_bench(opts)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert list(saved["modes"]) == ["eager", "none"] and saved["unfinished_modes"] == ["none"]
    assert saved["modes"]["eager"]["decode"]["1"]["median_ms"] > 0
    partial = saved["modes"]["none"]
    assert partial["unfinished"] is True and partial["decode"]["1"]["median_ms"] > 0
    assert partial["mixed"] == {} and "prefill_ms" not in partial
    assert not (tmp_path / ".results.json.partial").exists()
    # an error instead: the mode keeps its rows and says why; the run goes on and ends
    stop.append(RuntimeError("a broken mode"))
    result = run_bench(dataclasses.replace(opts, modes=("none", "eager")))
    failed = result["modes"]["none"]
    assert failed["error"] == "RuntimeError: a broken mode" and "unfinished" not in failed
    assert failed["decode"]["1"]["median_ms"] > 0
    assert result["modes"]["eager"]["prefill_ms"] > 0 and result["unfinished_modes"] == []


def test_the_refitted_pool_prediction_on_the_h100_capture() -> None:
    """The 1B preset's default ladder as the H100 measured it (run 2: 33 graphs, the runner's
    six small probes first, 340 MiB, which the runner's own fit predicted as 162 MiB): the
    refit reads the largest PIECEWISE graph and two large probes of each mode and lands
    within 1.5 %."""
    from freezeframe.runtime.graph_memory import CapturedGraph, predict_pool

    run2 = json.loads((REPO / "docs" / "results" / "h100-80gb-hbm3-2026-11-26" / "run2" /
                       "capture.json").read_text())
    assert run2["predicted_memory_bytes"] == 162 * 2**20  # the runner's, for contrast
    pool = predict_pool([CapturedGraph(g["mode"], g["num_tokens"], g["memory_bytes"])
                         for g in run2["graphs"]])
    assert pool is not None
    # the 130-token PIECEWISE graph (after the six probes) brings the working set; PIECEWISE
    # slope from its 128 and 120 tokens (26 MiB each), FULL from 65 and 64 (0 and 2 MiB)
    assert (pool.anchor, pool.probes) == (6, (7, 8, 24, 25))
    assert pool.bytes_per_token == {"PIECEWISE": 52 * 2**20 / 248, "FULL": 2 * 2**20 / 129}
    # working set: the 88 MiB the first seven graphs took less their own slope x tokens
    # (PIECEWISE 1 + 2 + 4 + 130, FULL 1 + 2 + 4): 59.2 MiB; then every graph's slope x
    # tokens (PIECEWISE 1290 tokens in all, FULL 360): 335.2 MiB against 340 measured
    assert pool.working_set_bytes == pytest.approx(
        88 * 2**20 - 52 * 2**20 / 248 * 137 - 2 * 2**20 / 129 * 7)
    assert pool.predicted_bytes == round(pool.working_set_bytes + 52 * 2**20 / 248 * 1290
                                         + 2 * 2**20 / 129 * 360) == 351515111
    assert pool.measured_bytes == 340 * 2**20
    assert pool.error == pytest.approx(351515111 / (340 * 2**20) - 1)
    assert -0.015 < pool.error < 0


def test_comparisons_set_each_figure_beside_its_peer() -> None:
    from freezeframe.bench.compare import add_comparisons

    def row(ms: float) -> dict[str, float]:
        return {"median_ms": ms}

    result: dict[str, Any] = {"context": 1024, "contexts": [128, 4096], "batch_sizes": [1, 4],
                              "modes": {
        "eager": {"decode": {"1": row(20.0), "4": row(24.0)},
                  "decode_by_context": {"128": row(19.0), "4096": row(21.0)}},
        "reduce-overhead": {"decode": {"1": row(2.0), "4": row(3.0)}},
        "full_and_piecewise": {"decode": {"1": row(4.0), "4": row(4.5)},
                               "decode_by_context": {"128": row(2.0), "4096": row(12.0)},
                               "decode_grid": {"4096": {"4": row(30.0)}}},
        "piecewise": {"decode": {"1": row(10.0), "4": row(9.0)}, "startup_s": 30.0,
                      "capture_s": 8.0},
        "breakable": {"decode": {"1": row(12.0)}, "startup_s": 9.0, "capture_s": 8.5},
        "hf-eager": {"generate": {"1": {"tokens_per_s": 40.0}, "8": {"tokens_per_s": 300.0}}},
        "hf-compile": {"generate": {"1": {"tokens_per_s": 160.0}}},
        "ff-hf": {"generate": {"1": {"tokens_per_s": 200.0}, "8": {"tokens_per_s": 600.0}}},
        "ff-hf-lookup": {"ff-hf": {"unsupported": "TypeError: no"},
                         "hf-eager": {"speedup": 1.5}},
    }}
    add_comparisons(result)
    modes = result["modes"]
    # each row over the fastest peer at the same step; a row no peer ran has no ratio
    assert modes["full_and_piecewise"]["decode"]["1"]["vs_best_peer"] == 2.0
    assert modes["full_and_piecewise"]["decode"]["4"]["vs_best_peer"] == 1.5
    assert modes["eager"]["decode"]["1"]["vs_best_peer"] == 10.0
    assert modes["full_and_piecewise"]["decode_by_context"]["128"]["vs_best_peer"] == 2 / 19
    assert "vs_best_peer" not in modes["full_and_piecewise"]["decode_grid"]["4096"]["4"]
    assert result["comparisons"] == {
        "piecewise_over_full": {"1": 2.5, "4": 2.0},
        "full_over_reduce_overhead": {"1": 2.0, "4": 1.5},
        "context_ratio": {"contexts": [128, 4096], "eager": {"1": 21 / 19},
                          "full_and_piecewise": {"1": 6.0}},
        "breakable_vs_traced": {"startup_s": {"breakable": 9.0, "traced": 30.0},
                                "capture_s": {"breakable": 8.5, "traced": 8.0},
                                "decode_breakable_over_traced": {"1": 1.2}},
        "ff_hf_over_best_hf_tokens_per_s": {"1": 1.25, "8": 2.0},
        "prompt_lookup_speedup": {"ff-hf": "TypeError: no", "hf-eager": 1.5},
    }
