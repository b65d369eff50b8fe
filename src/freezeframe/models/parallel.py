"""Tensor-parallel building blocks: where a rank sits, the collectives, the sharded layers.

A tensor-parallel model splits each weight across the ranks of one process group. A
*column-parallel* linear keeps a slice of the output features (each rank computes its own
heads, its own part of the MLP's hidden layer) and needs no communication; a *row-parallel*
linear keeps a slice of the input features, so each rank holds a partial sum of the output and
an all-reduce adds them up. A *vocab-parallel* embedding keeps a slice of the vocabulary's rows:
a rank looks up the tokens it owns, writes zeros for the others, and an all-reduce assembles
each token's row.

The collectives are torch's functional collectives (``torch.ops._c10d_functional``, what
``torch.distributed._functional_collectives`` emits): ops that return a new tensor, so Dynamo
traces them into the graph as ordinary nodes, a CUDA graph captures the NCCL kernel they
launch, and the emulated graph backend records them and runs them again on replay. Each call
is paired with its ``wait_tensor``, so the result is complete before anything reads it.

The process group travels as its name (a string): a module attribute Dynamo treats as a
constant, with nothing to guard on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # registers the ops' fake impls
import torch.nn.functional as F
from torch import nn

from freezeframe.errors import ConfigError

__all__ = [
    "COLLECTIVE_SPLITTING_OPS",
    "RowParallelLinear",
    "TensorParallel",
    "VocabParallelEmbedding",
    "all_gather_last_dim",
    "all_reduce_sum",
]

_c10d = torch.ops._c10d_functional

#: The collectives these layers call, with their wait, as splitting ops: add them to
#: ``splitting_ops`` to run every collective eagerly between the captured pieces instead of
#: inside the graphs (the wait must be among them: see ``config_fields.check_collective_splits``).
COLLECTIVE_SPLITTING_OPS = ("_c10d_functional::all_reduce",
                            "_c10d_functional::all_gather_into_tensor",
                            "_c10d_functional::wait_tensor")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group.

    ``rank`` and ``size`` are the rank within the group and the group's size; ``group_name``
    names the process group the collectives run on (``ProcessGroup.group_name``).
    ``vocab_parallel``: split the embedding and the LM head by vocabulary rows (one all-reduce
    after the lookup, one all-gather of the logits) instead of keeping them whole on every
    rank.
    """

    rank: int
    size: int
    group_name: str
    vocab_parallel: bool = True

    def __post_init__(self) -> None:
        for name in ("rank", "size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"TensorParallel.{name} must be an int >= 0, got {value!r}")
        if self.size < 1 or self.rank >= self.size:
            raise ConfigError(
                f"TensorParallel.rank={self.rank} must lie in [0, size={self.size}); build it "
                "with TensorParallel.from_group(group) to read both from the process group")
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ConfigError(
                f"TensorParallel.group_name must name a process group, got {self.group_name!r}; "
                "use group.group_name (TensorParallel.from_group does)")

    @classmethod
    def from_group(cls, group: Any = None, *, vocab_parallel: bool = True) -> TensorParallel:
        """The place of this process in ``group`` (default: the world), which must exist."""
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "TensorParallel.from_group: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) first (torchrun sets the variables "
                "it reads)")
        pg: Any = group if group is not None else dist.group.WORLD
        return cls(rank=int(dist.get_rank(pg)), size=int(dist.get_world_size(pg)),
                   group_name=str(pg.group_name), vocab_parallel=vocab_parallel)

    def split(self, total: int, what: str) -> int:
        """``total // size``, the share of one rank; an error naming ``what`` when it does
        not divide."""
        if total % self.size:
            raise ConfigError(
                f"{what}={total} is not divisible by the tensor-parallel size {self.size}; "
                f"choose a tensor-parallel size that divides it")
        return total // self.size

    def chunk(self, total: int) -> slice:
        """The slice of ``range(total)`` this rank owns (``total`` divisible by the size)."""
        share = total // self.size
        return slice(self.rank * share, (self.rank + 1) * share)


def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks, as a new tensor."""
    return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group_name))  # type: ignore[no-any-return]


def all_gather_last_dim(x: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    """``[N, D]`` per rank -> ``[N, size * D]``: the ranks' columns side by side, rank order."""
    n, d = x.shape
    gathered = _c10d.wait_tensor(
        _c10d.all_gather_into_tensor(x.contiguous(), size, group_name))  # [size * N, D]
    return gathered.view(size, n, d).permute(1, 0, 2).reshape(n, size * d)


class RowParallelLinear(nn.Linear):
    """A linear layer holding a slice of the input features; the partial outputs are summed
    over the group (``[T, in_features / size] -> [T, out_features]``)."""

    def __init__(self, in_features: int, out_features: int, group_name: str) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.group_name = group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(F.linear(x, self.weight), self.group_name)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding rows ``[start, start + num_embeddings)`` of the vocabulary.

    Tokens outside the slice read row 0 and are zeroed (a mask, not boolean indexing, so the
    lookup has the same shape at every step and can be captured); the all-reduce adds the one
    rank's row each token has."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int,
                 group_name: str) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.start = start
        self.group_name = group_name

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, dim]
        return all_reduce_sum(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group_name)
