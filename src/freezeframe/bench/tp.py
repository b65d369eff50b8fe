"""``freezeframe bench --tp N``: the benchmark on N tensor-parallel ranks.

Two ways to launch it:

* under ``torchrun --nproc-per-node N $(which freezeframe) bench --tp N``: torchrun starts the
  ranks and names each in the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``/``MASTER_PORT``), which must agree with ``--tp``;
* without torchrun, ``freezeframe bench --tp N`` spawns the N ranks on this machine itself
  (127.0.0.1) and prints what rank 0 measured.

Each rank joins one process group (NCCL on GPUs, one GPU per rank; gloo on the CPU), builds
the same TP=1 Llama from the seed, keeps its shard (:func:`~freezeframe.models.llama_tp.
shard_llama`) and runs the same modes and steps in the same order, so that the collectives of
the ranks line up; the graph modes capture in lockstep. Rank 0 reports (progress, the table,
``results.json``); the others run silently. On the CPU the all-reduces go through gloo over
loopback TCP and the graphs are emulated: the times show emulation and communication overhead,
not what tensor parallelism or graphs gain.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
from typing import Any

import torch

from freezeframe.bench.progress import Progress
from freezeframe.bench.run import BenchOptions, resolve_device, run_bench
from freezeframe.errors import ConfigError

__all__ = ["run_tp_bench"]

# how long a rank waits in a collective or for the process group to form
_GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def run_tp_bench(opts: BenchOptions, quiet: bool) -> dict[str, Any] | None:
    """Run ``opts`` on ``opts.tp`` ranks; rank 0's result where it is reported (rank 0 under
    torchrun, this process when it spawned the ranks), None on the other ranks."""
    if "WORLD_SIZE" in os.environ:  # under torchrun
        world = int(os.environ["WORLD_SIZE"])
        if world != opts.tp:
            raise ConfigError(
                f"--tp {opts.tp} under torchrun with WORLD_SIZE={world}: start as many ranks "
                f"as --tp (torchrun --nproc-per-node {opts.tp}) or pass --tp {world}")
        rank = int(os.environ.get("RANK", "0"))
        return _rank_main(rank, opts, quiet)
    resolve_device(opts.device)  # a missing GPU is named here, not in every child
    return _spawn(opts, quiet)


def _spawn(opts: BenchOptions, quiet: bool) -> dict[str, Any] | None:
    """Start ``opts.tp`` processes on 127.0.0.1 and return what rank 0 measured."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(opts.tp)}
    # torch's spawn joins every rank and stops the others when one fails, with its traceback
    mp.start_processes(_spawned, args=(opts, quiet, env, results), nprocs=opts.tp,
                       join=True, start_method="spawn")
    return json.loads(results.get()) if not results.empty() else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(rank: int, opts: BenchOptions, quiet: bool, env: dict[str, str],
             results: Any) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    result = _rank_main(rank, opts, quiet)
    if result is not None:
        results.put(json.dumps(result))


def _rank_main(rank: int, opts: BenchOptions, quiet: bool) -> dict[str, Any] | None:
    """One rank: join the group, run the bench on this rank's device, report on rank 0."""
    import torch.distributed as dist

    device = resolve_device(opts.device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=_GROUP_TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.tp))
        mine = dataclasses.replace(opts, device=str(device),
                                   out=opts.out if rank == 0 else None)
        progress = Progress(len(opts.modes), enabled=rank == 0 and not quiet)
        with progress:
            result = run_bench(mine, progress)
        return result if rank == 0 else None
    finally:
        dist.destroy_process_group()
