"""A tiny built-in model for ``freezeframe demo`` and for first experiments.

It is shaped like a transformer stack without attention: each layer projects up, combines the
two halves with a custom op, projects down and adds the residual. The custom op
``freezeframe_example::mix`` plays the part attention plays in an LLM: it is the *splitting op*
the graph is cut at, and it writes into an output buffer allocated by the piece before it (the
pattern that keeps buffer addresses stable for piecewise CUDA graphs).

Importing this module registers the op with ``torch.library`` (once per process; see
:mod:`freezeframe.models.ops`).
"""

from __future__ import annotations

import torch
from torch import nn

from freezeframe.models.ops import define_op

__all__ = ["MIX_OP", "ExampleMLP", "mix"]

MIX_OP = "freezeframe_example::mix"
"""The splitting op to name in ``CompilationConfig(splitting_ops=[MIX_OP])``."""


def _mix(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x * sigmoid(gate)``, elementwise; all three are ``[num_tokens, hidden]``."""
    torch.mul(x, torch.sigmoid(gate), out=out)


def _mix_fake(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> None:
    # Writes into `out` in place and returns nothing: no shapes to propagate.
    return None


_LIBRARY = define_op(MIX_OP, "(Tensor x, Tensor gate, Tensor(a!) out) -> ()", _mix, _mix_fake)
mix = torch.ops.freezeframe_example.mix
"""The op, callable as ``mix(x, gate, out)``."""


class ExampleMLP(nn.Module):
    """``num_layers`` residual blocks around :data:`MIX_OP`.

    Split at ``MIX_OP`` it gives ``2 * num_layers + 1`` pieces, ``num_layers + 1`` capturable.
    Every token is computed independently, so padding a batch never changes the real rows.
    """

    def __init__(self, hidden_size: int = 32, num_layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        if hidden_size < 1 or num_layers < 1:
            raise ValueError(f"hidden_size and num_layers must be >= 1, got {hidden_size}, "
                             f"{num_layers}")
        generator = torch.Generator().manual_seed(seed)
        self.hidden_size = hidden_size
        self.ups = nn.ModuleList(nn.Linear(hidden_size, 2 * hidden_size)
                                 for _ in range(num_layers))
        self.downs = nn.ModuleList(nn.Linear(hidden_size, hidden_size)
                                   for _ in range(num_layers))
        with torch.no_grad():  # deterministic weights independent of the global RNG
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]; num_tokens is the dynamic dimension
        for up, down in zip(self.ups, self.downs, strict=True):
            h = up(x)                                # [num_tokens, 2 * hidden]
            a, gate = h.chunk(2, dim=-1)             # [num_tokens, hidden] each
            out = torch.empty_like(a)                # allocated inside the captured piece
            torch.ops.freezeframe_example.mix(a, gate, out)  # splitting op: runs eagerly
            x = x + down(out)                        # [num_tokens, hidden]
        return x

    def example_input(self, num_tokens: int, seed: int = 0) -> torch.Tensor:
        """A deterministic ``[num_tokens, hidden]`` input."""
        generator = torch.Generator().manual_seed(seed + num_tokens)
        return torch.randn(num_tokens, self.hidden_size, generator=generator)
