"""``freezeframe bench`` on the tiny preset with very few steps: it runs and writes its JSON.

Timings are never asserted (a shared CPU makes them noise); the structure and the bookkeeping
(graph modes capture, skipped modes say why, floor shares are consistent) are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from freezeframe.bench.run import BenchOptions, format_table, modes_from, run_bench
from freezeframe.cli import main
from freezeframe.errors import ConfigError


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
    for mode in ("eager", "none", "full_and_piecewise"):
        entry = saved["modes"][mode]
        assert set(entry["decode"]) == {"1", "2"} and set(entry["mixed"]) == {"1", "2"}
        for row in entry["decode"].values():
            assert row["median_ms"] > 0
            assert row["floor_share"] == pytest.approx(row["floor_ms"] / row["median_ms"])
        assert entry["prefill_ms"] > 0 and entry["startup_s"] > 0
    fp = saved["modes"]["full_and_piecewise"]
    # FULL graphs for uniform decode at 1, 2, 4 tokens... and PIECEWISE for mixed batches
    assert fp["graphs_captured"] > 0 and fp["capture_s"] > 0
    assert fp["runner_stats"]["steps_full"] > 0
    assert saved["modes"]["none"]["runner_stats"]["steps_eager"] > 0
    assert (tmp_path / "latency_vs_batch.png").exists() or any(
        "matplotlib" in n for n in saved["notes"])
    table = format_table(result)
    assert "full_and_piecewise" in table and "skipped: needs CUDA" in table


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
    with pytest.raises(ConfigError, match="batch sizes"):
        BenchOptions(batch_sizes=(0,))
