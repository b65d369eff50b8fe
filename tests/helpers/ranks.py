"""Run a function on N ranks of a process group (gloo on the CPU over loopback; NCCL, one GPU
per rank, for the multi-GPU tier) and collect what each returned.

Each rank is a spawned process that joins a process group on 127.0.0.1, calls the worker and
puts ``(rank, "ok", result)`` or ``(rank, "error", traceback)`` on a queue. The parent waits
until a deadline and kills whatever is still running, so a test that goes wrong fails with the
ranks' tracebacks instead of hanging. Results must be plain picklable values (lists, numbers,
strings): tensors are returned as ``tolist()``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(worker: Callable[..., Any], rank: int, world: int, port: int, out: Any,
           group_timeout_s: float, args: tuple[Any, ...], backend: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share a small machine
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        out.put((rank, "ok", worker(rank, world, *args)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(worker: Callable[..., Any], world: int, *args: Any, deadline_s: float = 90.0,
              group_timeout_s: float = 60.0, backend: str = "gloo",
              may_die: Collection[int] = ()) -> list[Any]:
    """``[worker(rank, world, *args) for rank in range(world)]``, each in its own process
    (``backend="nccl"``: rank ``r`` on GPU ``r``, for the multi-GPU cuda tier).

    Raises AssertionError with every rank's traceback when a rank raised, or naming the ranks
    that reported nothing when the deadline passed (a rank of ``may_die``, which the test makes
    exit on purpose, gives None instead)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(worker, rank, world, port, out, group_timeout_s, args, backend))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if all(r in may_die and not procs[r].is_alive() for r in range(world)
                   if r not in got):
                break  # only ranks that exited on purpose are left
            try:
                rank, status, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            got[rank] = (status, value)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    errors = {rank: value for rank, (status, value) in got.items() if status == "error"}
    assert not errors, "\n".join(f"rank {r} raised:\n{tb}" for r, tb in sorted(errors.items()))
    missing = sorted(set(range(world)) - set(got) - set(may_die))
    assert not missing, f"ranks {missing} reported nothing within {deadline_s} s"
    return [got[rank][1] if rank in got else None for rank in range(world)]
