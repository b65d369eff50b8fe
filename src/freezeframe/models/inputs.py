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
    bs, max_blocks = cache.block_size, cache.max_blocks
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    table: list[list[int]] = []
    for chunk in chunks:
        end = chunk.num_computed + len(chunk.token_ids)
        if end > cache.max_model_len or -(-end // bs) > len(chunk.blocks):
            raise ConfigError(
                f"a request reaching position {end} needs {-(-end // bs)} blocks of "
                f"{bs} within max_model_len={cache.max_model_len}; it has {len(chunk.blocks)}"
            )
        for i, token in enumerate(chunk.token_ids):
            pos = chunk.num_computed + i
            ids.append(token)
            positions.append(pos)
            slots.append(chunk.blocks[pos // bs] * bs + pos % bs)
        qsl.append(len(ids))
        seq_lens.append(end)
        table.append(list(chunk.blocks) + [0] * (max_blocks - len(chunk.blocks)))
    num_tokens, num_reqs = len(ids), len(chunks)
    host = AttentionHostMetadata(query_start_loc=tuple(qsl), seq_lens=tuple(seq_lens))
    token_pad = (pad_tokens_to or num_tokens) - num_tokens
    req_pad = (pad_reqs_to or num_reqs) - num_reqs
    if token_pad < 0 or req_pad < 0:
        raise ConfigError(
            f"cannot pad {num_tokens} tokens / {num_reqs} requests down to "
            f"pad_tokens_to={pad_tokens_to} / pad_reqs_to={pad_reqs_to}"
        )
    ids += [0] * token_pad
    positions += [0] * token_pad
    slots += [-1] * token_pad
    qsl += [num_tokens] * req_pad
    seq_lens += [0] * req_pad
    table += [[0] * max_blocks for _ in range(req_pad)]

    def t(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    tensors = {
        "input_ids": t(ids),
        "positions": t(positions),
        "slot_mapping": t(slots),
        "query_start_loc": t(qsl),
        "seq_lens": t(seq_lens),
        "block_tables": t(table).reshape(len(table), max_blocks),
    }
    return StepInputs(tensors=tensors, host=host, num_tokens=num_tokens, num_reqs=num_reqs)
