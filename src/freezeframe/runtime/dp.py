"""Data-parallel agreement on the step shape.

With data parallelism every rank runs its own batch, but collectives inside the model (expert
all-to-all, for example) need every rank to run the *same* graph: a rank that replays the graph
for 8 tokens while another runs 32 tokens eagerly deadlocks or corrupts the exchange. So before
dispatch the ranks agree: the step size is the largest over ranks, and the step counts as a
uniform decode only when it is one on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["agree_across_ranks", "dp_active"]


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
