"""Rotary position embedding (rotate-half), shared by the reference Llama and the attention
op's pure-torch path (the Triton path applies the same arithmetic inside its cache-write
kernel).

A model gathers its table once per forward into per-token rows ``rope [T, head_dim]`` (fp32,
``cos`` in the first half of the last dim, ``sin`` in the second) and hands them to every
layer's attention op, which rotates ``q`` and ``k`` as it writes the cache.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_table"]


def rope_table(head_dim: int, theta: float, max_position: int,
               device: torch.device | str | None = None) -> torch.Tensor:
    """``[max_position, head_dim]`` fp32: cos in the first half of the last dim, sin in the
    second (computed in float64)."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(half, dtype=torch.float64, device=device) / half))
    angles = torch.arange(max_position, dtype=torch.float64, device=device)[:, None]
    angles = angles * inv_freq[None, :]  # [P, half]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, heads, D]`` by the per-token rows ``rope [T, D]`` (``cos |
    sin``), in fp32, returned in ``x``'s dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = rope[:, None, :half], rope[:, None, half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
