"""The reference Llama split across the ranks of a tensor-parallel group.

Each rank holds ``1/size`` of every layer (see :mod:`freezeframe.models.parallel`):

* attention: the QKV projection is column-parallel by heads, so a rank computes its own
  ``num_heads / size`` query heads and ``num_kv_heads / size`` KV heads (grouped-query attention
  keeps each group on one rank), keeps only those KV heads in its cache, and attends with the
  same ``freezeframe::attention`` op; the output projection is row-parallel (an all-reduce);
* MLP: gate and up are column-parallel (each rank its slice of the hidden layer), down is
  row-parallel (an all-reduce);
* embedding and LM head: vocab-parallel (a masked lookup and an all-reduce; the logits'
  slices all-gathered), or whole on every rank with ``TensorParallel(vocab_parallel=False)``.

So a decoder layer costs two all-reduces of ``[T, hidden]``, which Dynamo traces into the graph
between the attention op's pieces: PIECEWISE graphs hold them, FULL graphs too.

The weights come from one full checkpoint: :func:`shard_llama_state_dict` cuts the TP=1 model's
``state_dict`` (same keys, sliced tensors), so TP=N can be checked against TP=1 and a
checkpoint is written once. The module is a :class:`~freezeframe.models.llama.LlamaModel` built
on the per-rank shapes (:func:`local_config`), with the same ``forward`` inputs, the same
``DYNAMIC_ARG_DIMS`` and the same serving driver.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from freezeframe.errors import ConfigError
from freezeframe.models.kv_cache import KVCacheConfig
from freezeframe.models.llama import DecoderLayer, LlamaConfig, LlamaModel
from freezeframe.models.parallel import (
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    all_gather_last_dim,
)

__all__ = ["TPLlamaModel", "build_tp_llama", "local_config", "shard_llama",
           "shard_llama_state_dict"]


def local_config(config: LlamaConfig, tp: TensorParallel) -> LlamaConfig:
    """The shapes one rank holds: heads, KV heads, the MLP's hidden size (and the vocabulary,
    when vocab-parallel) divided by the tensor-parallel size; ``head_dim`` kept."""
    vocab_fix = " or TensorParallel(vocab_parallel=False) to keep the vocabulary whole"
    return dataclasses.replace(
        config,
        num_heads=tp.split(config.num_heads, "LlamaConfig.num_heads"),
        num_kv_heads=tp.split(config.num_kv_heads, "LlamaConfig.num_kv_heads"),
        intermediate_size=tp.split(config.intermediate_size, "LlamaConfig.intermediate_size"),
        head_dim=config.resolved_head_dim,
        vocab_size=(_split_vocab(config.vocab_size, tp, vocab_fix) if tp.vocab_parallel
                    else config.vocab_size),
    )


def _split_vocab(vocab_size: int, tp: TensorParallel, fix: str) -> int:
    if vocab_size % tp.size:
        raise ConfigError(
            f"LlamaConfig.vocab_size={vocab_size} is not divisible by the tensor-parallel "
            f"size {tp.size}; choose a size that divides it{fix}")
    return vocab_size // tp.size


class TPLlamaModel(LlamaModel):
    """One rank's shard of a Llama; ``config`` is the whole model's, ``local`` this rank's.

    Build it with :func:`shard_llama` (from a TP=1 model) or :func:`build_tp_llama` (from a
    full ``state_dict``); the constructor alone leaves the weights uninitialised.
    """

    def __init__(self, config: LlamaConfig, cache: KVCacheConfig, tp: TensorParallel, *,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        local = local_config(config, tp)
        super().__init__(local, cache, dtype=dtype, device=device)
        self.config = config
        self.local = local
        self.tp = tp
        hidden, head_dim = config.hidden_size, config.resolved_head_dim
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.attn.o_proj = RowParallelLinear(local.num_heads * head_dim, hidden,
                                                  tp.group_name)
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, hidden,
                                                    tp.group_name)
        if tp.vocab_parallel:
            start = tp.rank * local.vocab_size
            self.embed_tokens = VocabParallelEmbedding(local.vocab_size, hidden, start,
                                                       tp.group_name)
            self.lm_head = nn.Linear(hidden, local.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` (the whole vocabulary on every rank)."""
        logits = self.lm_head(hidden)
        if not self.tp.vocab_parallel:
            return logits
        return all_gather_last_dim(logits, self.tp.size, self.tp.group_name)


def shard_llama_state_dict(state: Mapping[str, torch.Tensor], config: LlamaConfig,
                           tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's slice of every tensor of a TP=1 Llama's ``state_dict`` (same keys)."""
    local_config(config, tp)  # the divisibility checks, with their messages
    return {name: _shard(name, weight, config, tp).clone() for name, weight in state.items()}


def _shard(name: str, w: torch.Tensor, config: LlamaConfig, tp: TensorParallel
           ) -> torch.Tensor:
    d = config.resolved_head_dim
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    inter = config.intermediate_size
    if name.endswith("attn.qkv_proj.weight"):  # [(H + 2 KV) d, hidden], rows q | k | v
        q, k, v = w.split([q_rows, kv_rows, kv_rows])
        return torch.cat([q[tp.chunk(q_rows)], k[tp.chunk(kv_rows)], v[tp.chunk(kv_rows)]])
    if name.endswith("mlp.gate_up_proj.weight"):  # [2 I, hidden], rows gate | up
        gate, up = w.split([inter, inter])
        return torch.cat([gate[tp.chunk(inter)], up[tp.chunk(inter)]])
    if name.endswith("attn.o_proj.weight"):  # [hidden, H d]: columns by head
        return w[:, tp.chunk(q_rows)]
    if name.endswith("mlp.down_proj.weight"):  # [hidden, I]
        return w[:, tp.chunk(inter)]
    if name in ("embed_tokens.weight", "lm_head.weight"):  # [vocab, hidden]
        return w[tp.chunk(config.vocab_size)] if tp.vocab_parallel else w
    if name.endswith("norm.weight"):
        return w
    raise ConfigError(
        f"shard_llama_state_dict: {name!r} is no tensor of the reference Llama; pass the "
        "state_dict of a LlamaModel (build_llama)")


def build_tp_llama(config: LlamaConfig, state: Mapping[str, torch.Tensor],
                   tp: TensorParallel, cache: KVCacheConfig | None = None, *,
                   dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> TPLlamaModel:
    """This rank's model, its weights cut from the full ``state`` of a TP=1 Llama.

    ``dtype`` defaults to the checkpoint's. The KV cache (this rank's KV heads) starts empty.
    """
    cache = cache or KVCacheConfig()
    device = torch.device(device) if device is not None else torch.device("cpu")
    shards = shard_llama_state_dict(state, config, tp)
    if dtype is None:
        dtype = next(iter(shards.values())).dtype
    with torch.device("meta"):
        model = TPLlamaModel(config, cache, tp, dtype=dtype, device="meta")
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own fresh tensor
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        model.load_state_dict(shards, strict=True)
        model.to(dtype)
        model.allocate_state(device)
    return model.eval()


def shard_llama(model: LlamaModel, tp: TensorParallel) -> TPLlamaModel:
    """This rank's shard of a TP=1 model (same cache config, dtype and device)."""
    weight = model.embed_tokens.weight
    return build_tp_llama(model.config, model.state_dict(), tp, model.cache_config,
                          dtype=weight.dtype, device=weight.device)
