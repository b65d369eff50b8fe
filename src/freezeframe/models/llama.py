"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Random weights from a seed; nothing is downloaded. The ``"1b"`` preset has Llama-3.2-1B's
shapes so that benchmarks read the same bytes per step as the real model (it omits Llama 3's
long-context RoPE frequency scaling, which changes no shape and no cost).

The forward pass takes one flattened token batch that may mix prefill and decode requests and
returns the final hidden states per token; :meth:`LlamaModel.compute_logits` turns the rows you
sample from into logits (outside the graph, as servers do, so that a prefill does not compute
logits for every prompt token). Token-sized inputs share dim 0 (the dynamic dim); the
request-sized ones (``query_start_loc``, ``seq_lens``, ``block_tables``) may keep a fixed
maximum size with padded rows — see :mod:`freezeframe.models.attention`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from freezeframe.errors import ConfigError
from freezeframe.models.attention import (
    ATTENTION_OP,
    check_split_kv,
    default_scale,
    split_workspace,
    token_layout,
)
from freezeframe.models.kv_cache import KVCacheConfig, allocate_layer_cache
from freezeframe.models.rope import rope_table

__all__ = ["ATTENTION_OP", "LlamaConfig", "LlamaModel", "build_llama"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model shapes. ``head_dim`` defaults to ``hidden_size // num_heads``."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 512
    tie_word_embeddings: bool = True

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # small enough that a CPU test step takes milliseconds
        "tiny": dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, rope_theta=10000.0, max_position=512,
        ),
        # Llama-3.2-1B's shapes (1.24 B parameters, ~2.47 GB in bf16)
        "1b": dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
            num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0, max_position=8192,
            tie_word_embeddings=True,
        ),
    }

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"LlamaConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} (grouped-query attention shares each KV head among a "
                "whole group of query heads)"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"LlamaConfig.hidden_size={self.hidden_size} is not divisible by num_heads="
                f"{self.num_heads}; pass head_dim explicitly"
            )
        if self.resolved_head_dim % 2:
            raise ConfigError(
                f"LlamaConfig head_dim={self.resolved_head_dim} must be even for RoPE"
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        if name not in cls.PRESETS:
            raise ConfigError(
                f"unknown Llama preset {name!r}; choose one of {sorted(cls.PRESETS)}"
            )
        return cls(**{**cls.PRESETS[name], **overrides})

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, d = self.hidden_size, self.resolved_head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def _rope_tables(config: LlamaConfig, device: torch.device | str | None) -> torch.Tensor:
    """``[max_position, head_dim]``: cos in the first half of the last dim, sin in the second."""
    return rope_table(config.resolved_head_dim, config.rope_theta, config.max_position, device)


class Attention(nn.Module):
    k_cache: torch.Tensor  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor

    def __init__(self, config: LlamaConfig, cache: KVCacheConfig, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.resolved_head_dim
        self.block_size = cache.block_size
        self.attention_kernel: str = cache.attention_kernel
        self.split_kv: str = cache.split_kv
        self.scale = default_scale(self.head_dim)
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        k_cache, v_cache = allocate_layer_cache(
            cache, self.num_kv_heads, self.head_dim, dtype=dtype, device=device
        )
        # non-persistent: the cache is state of a serving session, not of the model
        self.register_buffer("k_cache", k_cache, persistent=False)
        self.register_buffer("v_cache", v_cache, persistent=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: torch.Tensor,  # [T, head_dim]: cos | sin per token
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        token_req: torch.Tensor | None = None,
        token_valid: torch.Tensor | None = None,
        workspace: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        # views of the one projection, unrotated: the op applies RoPE as it writes the cache
        # (on the Triton path in the same kernel), so no rope, copy or cache-write kernel of
        # their own runs here
        q = qkv[:, : h * d].view(num_tokens, h, d)
        k = qkv[:, h * d : (h + kv) * d].view(num_tokens, kv, d)
        v = qkv[:, (h + kv) * d :].view(num_tokens, kv, d)
        out = torch.empty((num_tokens, h, d), dtype=qkv.dtype, device=qkv.device)  # the op's
        torch.ops.freezeframe.attention(
            q, k, v, out, self.k_cache, self.v_cache, positions, slot_mapping,
            query_start_loc, seq_lens, block_tables, self.block_size, self.scale,
            self.attention_kernel, token_req, token_valid, rope, workspace, self.split_kv,
        )
        return self.o_proj(out.view(num_tokens, h * d))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, cache: KVCacheConfig, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, cache, dtype, device)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, *meta: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), rope, *meta)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaModel(nn.Module):
    """The decoder; see the module docstring for the input contract.

    ``forward(input_ids [T], positions [T], slot_mapping [T], query_start_loc [R+1],
    seq_lens [R], block_tables [R, max_blocks]) -> hidden [T, hidden_size]``.
    """

    rope: torch.Tensor  # [max_position, head_dim] fp32: cos | sin
    attn_workspace: torch.Tensor  # split-KV scratch the layers share (split_workspace)

    #: dims that vary per step, for ``ff.compile(..., dynamic_arg_dims=DYNAMIC_ARG_DIMS)``
    DYNAMIC_ARG_DIMS: ClassVar[dict[str, int]] = {
        "input_ids": 0, "positions": 0, "slot_mapping": 0,
    }

    def __init__(
        self,
        config: LlamaConfig,
        cache: KVCacheConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if cache.max_model_len > config.max_position:
            raise ConfigError(
                f"KVCacheConfig.max_model_len={cache.max_model_len} exceeds "
                f"LlamaConfig.max_position={config.max_position}; RoPE has no angles past it"
            )
        self.config = config
        self.cache_config = cache
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, cache, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope", _rope_tables(config, device), persistent=False)
        self.register_buffer("attn_workspace", split_workspace(
            config.num_heads, config.num_kv_heads, config.resolved_head_dim, device),
            persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rope[positions]  # [T, head_dim]
        # once per forward, not per layer (in the first piece's graph under PIECEWISE)
        token_req, token_valid = token_layout(query_start_loc, seq_lens, slot_mapping)
        for layer in self.layers:
            x = layer(x, rope, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                      token_req, token_valid, self.attn_workspace)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` for the rows to sample from."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.attn for layer in self.layers]  # type: ignore[union-attr, misc]

    def allocate_state(self, device: torch.device | str | None) -> None:
        """(Re)allocate on ``device`` what is no weight: each layer's KV cache (zeroed, in the
        weights' dtype), the split-KV workspace and the RoPE table."""
        dtype = self.embed_tokens.weight.dtype
        layers = self.attention_layers()
        for attn in layers:
            attn.k_cache, attn.v_cache = allocate_layer_cache(
                self.cache_config, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
        first = layers[0]
        self.attn_workspace = split_workspace(first.num_heads, first.num_kv_heads,
                                              first.head_dim, device)
        self.rope = rope_table(first.head_dim, self.config.rope_theta, self.config.max_position,
                               device)

    def reset_cache(self) -> None:
        for attn in self.attention_layers():
            attn.k_cache.zero_()
            attn.v_cache.zero_()


def build_llama(
    config: LlamaConfig | str,
    cache: KVCacheConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    init_std: float = 0.02,
    split_kv: str | None = None,
) -> LlamaModel:
    """A model with seeded random weights, built directly on ``device`` in ``dtype``.

    ``dtype`` defaults to bfloat16 on CUDA and float32 elsewhere. Weights are drawn from a
    private generator, so building a model never disturbs the global RNG. ``split_kv``, when
    given, replaces ``cache.split_kv`` (``"auto"``, ``"on"``, ``"off"``).
    """
    if isinstance(config, str):
        config = LlamaConfig.preset(config)
    cache = cache or KVCacheConfig()
    if split_kv is not None:
        mode: Any = check_split_kv(split_kv, "split_kv")
        cache = dataclasses.replace(cache, split_kv=mode)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        model = LlamaModel(config, cache, dtype=dtype, device="meta")
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own fresh tensor
        model.lm_head.weight = model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, init_std, generator=gen)
        model.to(dtype)
        model.allocate_state(device)
    return model.eval()
