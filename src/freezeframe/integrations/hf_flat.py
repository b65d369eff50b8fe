"""The module ``ff.hf`` compiles: an HF causal LM behind a flat-token forward, with its static KV
cache.

Every step is one flat batch of tokens (``input_ids``, ``positions`` and ``seq_ids``, the cache
row of each token, each ``[num_tokens]``). :class:`FlatCausalLM` hands them to the HF model as
one sequence, with freezeframe's step metadata (:mod:`~freezeframe.integrations.hf_attention`)
for the attention op, and returns ``[num_tokens, vocab]`` logits; the token count is its one
dynamic dim. It owns the two cache buffers, ``[layers, max_batch_size + 1, max_cache_len,
kv_heads, head_dim]``, whose extra row is the sink that padded tokens write into.
:func:`cache_shape` reads their per-layer shape from the model's transformers config.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from freezeframe.errors import ConfigError
from freezeframe.integrations.hf_attention import STEP_KWARG, StepMetadata

__all__ = ["CacheShape", "FlatCausalLM", "cache_shape"]


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """The KV cache a model needs per row and position: its layers, KV heads and head dim."""

    layers: int
    kv_heads: int
    head_dim: int


def cache_shape(model: nn.Module) -> CacheShape:
    """The cache shape of a transformers causal LM, from ``model.config``; a
    :class:`~freezeframe.errors.ConfigError` for a model without one."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise ConfigError(
            f"ff.hf.compile: model is a {type(model).__name__} without a transformers config "
            "(model.config.num_hidden_layers); pass a transformers causal LM such as "
            "LlamaForCausalLM")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return CacheShape(layers=int(config.num_hidden_layers), kv_heads=kv_heads,
                      head_dim=int(head_dim))


class FlatCausalLM(nn.Module):
    """The HF model behind a flat-token forward: ``[num_tokens]`` ids, positions and cache rows
    in, ``[num_tokens, vocab]`` logits out. Holds the static KV cache as buffers."""

    def __init__(self, model: nn.Module, shape: CacheShape, max_batch_size: int,
                 max_cache_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.k_cache: torch.Tensor
        self.v_cache: torch.Tensor
        # one extra row: the sink that padded tokens write into
        dims = (shape.layers, max_batch_size + 1, max_cache_len, shape.kv_heads, shape.head_dim)
        self.register_buffer("k_cache", torch.zeros(dims, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(dims, dtype=dtype, device=device),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                seq_ids: torch.Tensor) -> torch.Tensor:
        # A 4-d mask is taken as given by HF's mask utilities, so HF builds none; the attention
        # op ignores it (it masks by position and cache row).
        placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=input_ids.device)
        step = StepMetadata(self.k_cache, self.v_cache, positions, seq_ids)
        output = self.model(input_ids=input_ids[None], position_ids=positions[None],
                            attention_mask=placeholder, use_cache=False,
                            **{STEP_KWARG: step})
        return output.logits[0]  # type: ignore[no-any-return]
