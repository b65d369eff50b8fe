"""Data-parallel agreement: two CPU ranks on gloo (loopback only) pad to the same graph."""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import freezeframe as ff
from freezeframe.context import get_forward_context
from freezeframe.runtime import GraphRunner, Tokens, agree_across_ranks

WORLD = 2
DEADLINE_S = 120.0

# Per rank: (num_tokens, uniform_decode) of each step.
STEPS = [
    [(3, True), (2, True), (5, False), (1, True)],
    [(10, True), (2, False), (20, False), (1, True)],
]


class _Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        assert ctx is not None and ctx.batch_descriptor is not None
        self.seen.append((ctx.mode.name, ctx.batch_descriptor.num_tokens, x.shape[0]))
        return x + 1


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        cfg = ff.CompilationConfig(
            mode="piecewise", backend="eager", cudagraph_mode="full_and_piecewise",
            graph_backend="emulated", cudagraph_capture_sizes=[1, 2, 4, 8, 16],
            max_num_tokens=32, max_num_seqs=16)
        rec = _Recorder()
        runner = GraphRunner(rec, cfg, inputs={"x": Tokens(2)}, dp_sync=True, progress=False)
        shapes = []
        for n, uniform in STEPS[rank]:
            y = runner(torch.full((n, 2), float(rank)), uniform_decode=uniform)
            assert torch.equal(y, torch.full((n, 2), rank + 1.0))
            shapes.append(list(y.shape))
        direct = agree_across_ranks(7 + rank, rank == 0)
        result: dict[str, Any] = {"seen": rec.seen, "shapes": shapes, "direct": list(direct),
                                  "stats": runner.stats.snapshot()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ranks_agree_on_the_padded_size_and_uniformity(tmp_path: Path) -> None:
    ctx = mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, "DP workers did not finish in time"
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    # Both ranks ran the same (mode, padded size) every step, each sliced to its own rows.
    expected_seen = [
        ["FULL", 16, 16],      # max(3, 10) = 10, uniform on both -> FULL uniform key of 16
        ["PIECEWISE", 2, 2],   # rank 1 is mixed -> not uniform -> PIECEWISE key of 2
        ["NONE", 20, 20],      # max(5, 20) = 20 > 16: eager, both padded to 20 tokens
        ["FULL", 1, 1],
    ]
    for r, res in enumerate(results):
        assert res["seen"] == expected_seen, r
        assert res["shapes"] == [[n, 2] for n, _ in STEPS[r]]
        assert res["direct"] == [8, False]
        assert res["stats"]["fallback_too_large"] == 1
