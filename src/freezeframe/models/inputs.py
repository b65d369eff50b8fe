"""Build the metadata tensors of one mixed step from a host-side description of its requests.

Tests, the serving driver and the benchmark all describe a step the same way — per request,
the new token ids, how many tokens are already cached and the request's blocks — and this turns
it into the model's inputs, padded to a token count and a request count of the caller's choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from freezeframe.errors import ConfigError
from freezeframe.models.attention import AttentionHostMetadata
from freezeframe.models.kv_cache import KVCacheConfig

__all__ = ["INPUT_NAMES", "RequestChunk", "StepInputs", "build_step"]

#: the model's forward arguments, in order
INPUT_NAMES = (
    "input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
)


@dataclasses.dataclass(frozen=True)
class RequestChunk:
    """What one request contributes to a step: ``token_ids`` at positions
    ``num_computed .. num_computed + len(token_ids) - 1``, cached in ``blocks``."""

    token_ids: tuple[int, ...]
    num_computed: int
    blocks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The model inputs of one step (``tensors``, keyed by :data:`INPUT_NAMES`) and the same
    layout on the host (``host``), plus the real sizes before padding."""

    tensors: dict[str, torch.Tensor]
    host: AttentionHostMetadata
    num_tokens: int
    num_reqs: int

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.tensors[name] for name in INPUT_NAMES)

    @property
    def uniform_decode(self) -> bool:
        return self.host.max_query_len == 1

    def last_token_index(self) -> torch.Tensor:
        """Row of each real request's last token in the hidden states (``[num_reqs]``)."""
        return self.tensors["query_start_loc"][1 : self.num_reqs + 1] - 1


def build_step(
    chunks: Sequence[RequestChunk],
    cache: KVCacheConfig,
    *,
    pad_tokens_to: int | None = None,
    pad_reqs_to: int | None = None,
    device: torch.device | str | None = None,
) -> StepInputs:
    """Inputs for ``chunks``; padded tokens get slot -1, padded requests ``seq_len`` 0.

    Padded request rows repeat the last real ``query_start_loc`` (zero-length requests), so the
    offsets stay non-decreasing for any consumer that expects it.
    """
    columns = _Columns()
    for chunk in chunks:
        columns.add(chunk, cache)
    num_tokens, num_reqs = len(columns.ids), len(chunks)
    host = AttentionHostMetadata(query_start_loc=tuple(columns.qsl),
                                 seq_lens=tuple(columns.seq_lens))
    token_pad = (pad_tokens_to or num_tokens) - num_tokens
    req_pad = (pad_reqs_to or num_reqs) - num_reqs
    if token_pad < 0 or req_pad < 0:
        raise ConfigError(
            f"cannot pad {num_tokens} tokens / {num_reqs} requests down to "
            f"pad_tokens_to={pad_tokens_to} / pad_reqs_to={pad_reqs_to}"
        )
    columns.pad(token_pad, req_pad, cache.max_blocks)
    return StepInputs(tensors=columns.tensors(cache.max_blocks, device), host=host,
                      num_tokens=num_tokens, num_reqs=num_reqs)


@dataclasses.dataclass
class _Columns:
    """A step's inputs on the host, built up request by request: per token ``ids``,
    ``positions`` and ``slots``; per request ``qsl`` (one more entry), ``seq_lens`` and its
    ``table`` row of blocks."""

    ids: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)
    qsl: list[int] = dataclasses.field(default_factory=lambda: [0])
    seq_lens: list[int] = dataclasses.field(default_factory=list)
    table: list[list[int]] = dataclasses.field(default_factory=list)

    def add(self, chunk: RequestChunk, cache: KVCacheConfig) -> None:
        """Append one request's tokens and its row, after checking its blocks hold them."""
        bs, max_blocks = cache.block_size, cache.max_blocks
        end = chunk.num_computed + len(chunk.token_ids)
        if end > cache.max_model_len or -(-end // bs) > len(chunk.blocks):
            raise ConfigError(
                f"a request reaching position {end} needs {-(-end // bs)} blocks of "
                f"{bs} within max_model_len={cache.max_model_len}; it has {len(chunk.blocks)}"
            )
        for i, token in enumerate(chunk.token_ids):
            pos = chunk.num_computed + i
            self.ids.append(token)
            self.positions.append(pos)
            self.slots.append(chunk.blocks[pos // bs] * bs + pos % bs)
        self.qsl.append(len(self.ids))
        self.seq_lens.append(end)
        self.table.append(list(chunk.blocks) + [0] * (max_blocks - len(chunk.blocks)))

    def pad(self, token_pad: int, req_pad: int, max_blocks: int) -> None:
        """Append ``token_pad`` padding tokens (slot -1) and ``req_pad`` zero-length requests."""
        num_tokens = len(self.ids)
        self.ids += [0] * token_pad
        self.positions += [0] * token_pad
        self.slots += [-1] * token_pad
        self.qsl += [num_tokens] * req_pad
        self.seq_lens += [0] * req_pad
        self.table += [[0] * max_blocks for _ in range(req_pad)]

    def tensors(self, max_blocks: int,
                device: torch.device | str | None) -> dict[str, torch.Tensor]:
        """The columns as ``torch.long`` tensors on ``device``, keyed by :data:`INPUT_NAMES`."""

        def t(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return {
            "input_ids": t(self.ids),
            "positions": t(self.positions),
            "slot_mapping": t(self.slots),
            "query_start_loc": t(self.qsl),
            "seq_lens": t(self.seq_lens),
            "block_tables": t(self.table).reshape(len(self.table), max_blocks),
        }
