"""Agreement between the ranks of a ``torch.distributed`` process group.

With data parallelism every rank runs its own batch, but collectives inside the model (expert
all-to-all, for example) need every rank to run the *same* graph: a rank that replays the graph
for 8 tokens while another runs 32 tokens eagerly deadlocks or corrupts the exchange. So before
dispatch the ranks agree: the step size is the largest over ranks, and the step counts as a
uniform decode only when it is one on every rank (:func:`agree_across_ranks`).

With tensor parallelism every rank runs the same batch, and the ranks must also capture the same
graphs in the same order (:mod:`freezeframe.runtime.lockstep`). The helpers below are what both
need of a process group: whether one is there, this rank's place in it, the store its ranks
share (a channel that never pairs with the model's collectives) and its collective timeout.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch

__all__ = ["agree_across_ranks", "dp_active", "group_store", "group_timeout", "rank_and_size",
           "set_group_timeout"]

logger = logging.getLogger(__name__)


def dp_active(group: Any = None) -> bool:
    """True when ``torch.distributed`` is initialised with more than one rank in ``group``."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return False
    return int(dist.get_world_size(group)) > 1


def agree_across_ranks(num_tokens: int, uniform_decode: bool,
                       group: Any = None) -> tuple[int, bool]:
    """``(max num_tokens over ranks, all ranks uniform)`` in one ``all_reduce``.

    Every rank of ``group`` must call this for the same step. Without an initialised process
    group (or with one rank) it returns its arguments unchanged.
    """
    if not dp_active(group):
        return num_tokens, uniform_decode
    dist = torch.distributed
    # NCCL reduces device tensors only; gloo and others take CPU tensors.
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    # MAX of (1 - uniform) is 1 when any rank is non-uniform: a MIN over the flags, taken in
    # the same reduction as the token count.
    buf = torch.tensor([num_tokens, 0 if uniform_decode else 1], dtype=torch.int64,
                       device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    agreed_tokens, any_mixed = (int(v) for v in buf.tolist())
    return agreed_tokens, any_mixed == 0


def rank_and_size(group: Any = None) -> tuple[int, int]:
    """This process's rank in ``group`` (default: the world) and the group's size;
    ``(0, 1)`` without an initialised process group."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return int(dist.get_rank(group)), int(dist.get_world_size(group))


def group_store(group: Any = None) -> Any:
    """The key-value store the ranks of ``group`` share (``torch.distributed.Store``)."""
    dist = torch.distributed
    pg: Any = group if group is not None else dist.group.WORLD
    return pg.get_group_store()


def group_timeout(group: Any) -> datetime.timedelta | None:
    """How long a collective of ``group`` waits for the other ranks, where the backend says
    (gloo and NCCL do); None where it does not."""
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except RuntimeError:
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def set_group_timeout(group: Any, timeout: datetime.timedelta) -> bool:
    """Make the collectives ``group`` starts from now on give up after ``timeout``; False
    where the backend cannot (then it keeps its own)."""
    try:
        group.set_timeout(timeout)
    except (AttributeError, RuntimeError) as exc:
        logger.debug("cannot set the timeout of process group %s: %s", group, exc)
        return False
    return True
