"""A paged KV cache: flat slot tensors per layer, block tables per request, a block allocator.

Layout (the contract the attention op and every caller share):

* Each layer owns ``k_cache`` and ``v_cache`` of shape ``[num_slots, num_kv_heads, head_dim]``
  with ``num_slots = num_blocks * block_size + 1``. The **last slot is a sink**: padded tokens
  write their keys there, so they never touch a real slot and the write needs no branch (which
  keeps it capturable). The sink belongs to no block and is never read as context.
* A request owns a list of blocks; its ``block_tables`` row lists them (``[max_blocks]``, unused
  entries 0). The key of the token at position ``p`` of request ``r`` lives in slot
  ``block_tables[r, p // block_size] * block_size + p % block_size``. The caller (the serving
  driver) writes exactly that number into ``slot_mapping`` for each new token.
* Caches are zero-initialised so that masked reads of never-written slots stay finite.

Block tables rather than contiguous per-request slot ranges: they cost one extra gather index
per key but let requests of very different lengths share one cache, as real servers do; a
contiguous layout is the special case ``block_size == max_model_len``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from freezeframe.errors import ConfigError
from freezeframe.models.attention import check_attention_kernel, check_split_kv

__all__ = ["BlockAllocator", "KVCacheConfig", "allocate_layer_cache"]


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """How much cache to allocate and how a request's context may grow.

    ``max_model_len`` bounds positions (prompt + generated tokens) and sets the block-table
    width ``max_blocks = ceil(max_model_len / block_size)``. The pure-torch capturable (static)
    attention path reads ``max_blocks * block_size`` keys per token, so with it keep
    ``max_model_len`` no larger than you need; the Triton kernel reads only the blocks in use.

    ``attention_kernel`` picks who reads the cache (see :mod:`freezeframe.models.attention`):
    ``"triton"`` (our paged kernel; needs ``triton``), ``"torch"`` (the pure-torch reference
    paths) or ``"auto"`` (triton for CUDA tensors when it is installed, torch otherwise).

    ``split_kv`` says whether the Triton kernel splits each token's context among several
    programs (flash-decoding): ``"auto"`` when a step's (token, KV head) programs are few and
    the block table long, ``"on"`` always (at least two splits), ``"off"`` never; see
    :mod:`freezeframe.models.paged_attention_triton`. The torch paths ignore it.
    """

    num_blocks: int = 64
    block_size: int = 16
    max_model_len: int = 256
    attention_kernel: Literal["auto", "torch", "triton"] = "auto"
    split_kv: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"KVCacheConfig.{name} must be a positive int, got {value!r}; pass e.g. "
                    f"{name}=16"
                )
        check_attention_kernel(self.attention_kernel, "KVCacheConfig.attention_kernel")
        check_split_kv(self.split_kv, "KVCacheConfig.split_kv")

    @property
    def max_blocks(self) -> int:
        """Width of a block-table row: the blocks one request of ``max_model_len`` needs."""
        return -(-self.max_model_len // self.block_size)

    @property
    def num_slots(self) -> int:
        """Rows of each cache tensor, the sink slot included."""
        return self.num_blocks * self.block_size + 1

    @property
    def sink_slot(self) -> int:
        return self.num_slots - 1


def allocate_layer_cache(
    cache: KVCacheConfig,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed ``(k_cache, v_cache)``, each ``[num_slots, num_kv_heads, head_dim]``."""
    shape = (cache.num_slots, num_kv_heads, head_dim)
    return (
        torch.zeros(shape, dtype=dtype, device=device),
        torch.zeros(shape, dtype=dtype, device=device),
    )


class BlockAllocator:
    """Hands out cache blocks to requests; host-side bookkeeping only.

    A request reserves every block it will ever need when it is admitted (prompt plus the
    tokens it may generate), so a running request never has to wait for memory. That keeps the
    driver simple; it is not a preemption-capable scheduler.
    """

    def __init__(self, cache: KVCacheConfig) -> None:
        self.cache = cache
        # pop() hands out low block ids first, which keeps tests' slot numbers predictable
        self._free: list[int] = list(range(cache.num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cache.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks for a request of up to ``num_tokens`` tokens (prompt + new tokens)."""
        if num_tokens > self.cache.max_model_len:
            raise ConfigError(
                f"a request of {num_tokens} tokens exceeds KVCacheConfig.max_model_len="
                f"{self.cache.max_model_len}; raise max_model_len or shorten the request"
            )
        need = self.blocks_needed(num_tokens)
        if need > len(self._free):
            raise ConfigError(
                f"a request of {num_tokens} tokens needs {need} cache blocks but only "
                f"{len(self._free)} are free; raise KVCacheConfig.num_blocks or admit fewer "
                "requests at once"
            )
        return [self._free.pop() for _ in range(need)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def slot(self, blocks: list[int], position: int) -> int:
        """The cache slot of ``position`` in a request that owns ``blocks``."""
        bs = self.cache.block_size
        return blocks[position // bs] * bs + position % bs
