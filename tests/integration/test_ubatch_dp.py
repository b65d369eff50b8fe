"""Two processes on gloo (loopback only) agree on whether to micro-batch each step, and share the
per-micro-batch token counts. One "no" from any rank makes every rank run unsplit."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import socket
from typing import Any

import pytest

WORLD = 2
JOIN_TIMEOUT_S = 120.0

# one row per step: (rank 0's (tokens per request, padded tokens), rank 1's ...)
STEPS: list[tuple[tuple[list[int], int], tuple[list[int], int]]] = [
    # both ranks want to split (6 decode tokens padded to 8; 12 tokens)
    (([1] * 6, 8), ([1] * 12, 12)),
    # rank 1 is below the decode threshold (2 < 4): nobody splits
    (([1] * 8, 8), ([1] * 2, 2)),
    # rank 1's last micro-batch would be all padding (4 tokens padded to 8): nobody splits
    (([1] * 8, 8), ([1] * 4, 8)),
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    from freezeframe.config import CompilationConfig
    from freezeframe.runtime.ubatch.slicing import agree_across_dp, plan_micro_batches

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        cfg = CompilationConfig(micro_batching=True, micro_batch_decode_threshold=4,
                                micro_batch_prefill_threshold=16)
        results: list[Any] = []
        for step in STEPS:
            tokens, padded = step[rank]
            plan = plan_micro_batches(cfg, tokens, padded, padded, uniform_decode=True)
            results.append(None if plan is None else (
                [(s.token_start, s.token_stop) for s in plan.padded_slices],
                [m.num_tokens_across_dp for m in plan.dp or ()],
            ))
        # without syncing, a rank decides alone (rank 1 declines, rank 0 splits)
        tokens, padded = STEPS[1][rank]
        local = plan_micro_batches(cfg, tokens, padded, padded, uniform_decode=True, sync=False)
        results.append(local is not None)
        results.append((agree_across_dp(True), agree_across_dp(rank == 0)))
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_agree_on_split() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        for _ in range(WORLD):
            rank, results = out.get(timeout=JOIN_TIMEOUT_S)
            got[rank] = results
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(WORLD)) - set(got))} reported nothing within "
                    f"{JOIN_TIMEOUT_S}s")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]

    slices = {0: [(0, 4), (4, 8)], 1: [(0, 6), (6, 12)]}
    for rank in range(WORLD):
        step_both, step_threshold, step_empty, local, agree = got[rank]
        # each rank its own slices; per micro-batch, the token counts of both ranks
        assert step_both == (slices[rank], [(4, 6), (4, 6)])
        assert step_threshold is None
        assert step_empty is None
        assert local is (rank == 0)
        assert agree == (True, False)
