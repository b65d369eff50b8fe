"""``freezeframe bench --tp 2`` on the CPU: the command spawns two gloo ranks, each runs its
shard, the graph modes capture in lockstep, and rank 0's numbers are printed labelled as
emulation and communication overhead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from freezeframe.bench.report import format_table, setup_notes
from freezeframe.bench.run import BenchOptions
from freezeframe.errors import ConfigError

DEADLINE_S = 240


@pytest.mark.slow
def test_bench_tp2_spawns_its_ranks_and_reports_rank0(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "freezeframe.cli", "bench", "--tp", "2", "--modes",
            "eager,full", "--batch-sizes", "2", "--steps", "1", "--warmup", "0", "--contexts",
            "32", "--context", "16", "--prefill-len", "16", "-q", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("tiny preset on 2 tensor-parallel ranks of ")
    assert [line.split()[0] for line in lines[2:4]] == ["eager", "full"]
    assert lines[3].split()[-2] == "ok"  # full matched eager's logits
    assert ("note: tensor parallel over 2 CPU processes (gloo over loopback TCP) with emulated "
            "graphs: these times show emulation and communication overhead, not speed; the "
            "times are rank 0's") in lines
    result = json.loads((out / "results.json").read_text())
    assert result["tensor_parallel"] == 2
    assert result["modes"]["full"]["matches_eager"] is True
    assert result["modes"]["full"]["graphs_captured"] > 0
    assert result["modes"]["full"]["runner_stats"]["steps_full"] > 0


def test_tp_refuses_modes_that_do_not_run_tensor_parallel() -> None:
    with pytest.raises(ConfigError, match=r"--tp 2: mode\(s\) \['compile', 'breakable'\] do not "
                                          r"run tensor-parallel; choose from \['eager', 'none', "
                                          r"'piecewise', 'full', 'full_and_piecewise'\]"):
        BenchOptions(tp=2, modes=("eager", "compile", "breakable"))
    with pytest.raises(ConfigError, match=r"--tp must be an int >= 1, got 0"):
        BenchOptions(tp=0)


def test_tp_under_torchrun_needs_as_many_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from freezeframe.bench.tp import run_tp_bench

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"--tp 2 under torchrun with WORLD_SIZE=4: start as "
                                          r"many ranks as --tp \(torchrun --nproc-per-node 2\) "
                                          r"or pass --tp 4"):
        run_tp_bench(BenchOptions(tp=2, modes=("eager",)), quiet=True)


def test_the_table_names_the_ranks() -> None:
    notes = setup_notes(False, "eager", tp=2)
    assert notes[0].startswith("tensor parallel over 2 CPU processes")
    assert setup_notes(True, "inductor", tp=4)[0].startswith(
        "tensor parallel over 4 GPUs (NCCL)")
    result = {"preset": "tiny", "device": "x86_64", "dtype": "float32", "torch": "2.13",
              "compiler": "eager", "attention_kernel": "torch", "context": 16,
              "max_model_len": 48, "bandwidth_bytes_per_s": 5e9, "batch_sizes": [1],
              "contexts": [32], "kv_bytes_per_decode_token": {}, "notes": notes,
              "modes": {}, "tensor_parallel": 2}
    assert format_table(result).splitlines()[0].startswith(
        "tiny preset on 2 tensor-parallel ranks of x86_64 (float32")
