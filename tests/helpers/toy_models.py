"""Toy models for the compile-path tests, each shaped after one vLLM test scenario.

Every model splits at ``silly::attention`` (see :mod:`tests.helpers.silly`), so the number of
pieces is known in advance: N non-adjacent attention calls give 2N+1 pieces, N+1 capturable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from tests.helpers.silly import attention

__all__ = [
    "AttnSandwich",
    "AttnWithRMSNorm",
    "AttnWithRMSNormAndSkip",
    "KeepsLast",
    "LlamaConfig",
    "OuterWithTwoInner",
    "SillyModel",
    "ToyLlama",
    "TwoSubmodulesModel",
    "tractable_reference",
]


class SillyModel(nn.Module):
    """+1, +2, attention, -2, -1, attention, +1. Attention maps x to 3x, so the whole model is
    9x + 19 elementwise (0 -> 19). Two attentions: 5 pieces, 3 capturable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 1
        x = x + 2
        x = attention(x, x, x)
        x = x - 2
        x = x - 1
        x = attention(x, x, x)
        return x + 1


class PadsAfterOp(nn.Module):
    """Pads after the splitting op and cuts back to the batch: ``F.pad`` reads a symbolic
    size as an int when run outside Dynamo's tracing context, so re-deriving this piece's
    fake values by plain propagation would pin the batch size to the traced one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = attention(x, x, x)
        return torch.nn.functional.pad(y, (0, 0, 0, 2))[:x.size(0)] * 2


class KeepsLast(nn.Module):
    """Stores its output on itself. Dynamo's code does that store after the graph call, so
    nothing may skip that code: such a trace keeps its bytecode (no direct call) and a
    runner never plans its steps."""

    def __init__(self) -> None:
        super().__init__()
        self.last = torch.zeros(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = attention(x, x, x) + 1
        self.last = out
        return out


# -- toy Llama -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int = 128
    mlp_size: int = 256
    vocab_size: int = 128
    num_layers: int = 2
    init_value: float = 1.0
    tractable_init: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tractable_init and self.mlp_size < self.hidden_size:
            raise ValueError("tractable_init needs mlp_size >= hidden_size (identity MLP)")


class _ToyAttention(nn.Module):
    """qkv projection, positions added to q and k, the splitting op, output projection."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.hidden = cfg.hidden_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(h)                      # (tokens, 3 * hidden)
        q, k, v = qkv.split(self.hidden, dim=-1)    # each (tokens, hidden)
        pos = positions.unsqueeze(-1).to(q.dtype)   # (tokens, 1)
        q = q + pos
        k = k + pos
        return self.o_proj(attention(q, k, v))


class _ToyMLP(nn.Module):
    """gate_up to 2 * mlp, gate * relu(up), down back to hidden."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.mlp = cfg.mlp_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.mlp_size, bias=False)
        self.down = nn.Linear(cfg.mlp_size, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.gate_up(h)                         # (tokens, 2 * mlp)
        return self.down(x[:, :self.mlp] * torch.relu(x[:, self.mlp:]))


class _ToyLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn = _ToyAttention(cfg)
        self.mlp = _ToyMLP(cfg)

    def forward(self, positions: torch.Tensor, h: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            h = h + residual
        residual = h
        h = self.attn(positions, h + 1) + residual
        residual = h
        return self.mlp(h + 1), residual


class ToyLlama(nn.Module):
    """Embedding, then ``num_layers`` x (attention with residual, MLP).

    With ``tractable_init`` every projection is an identity, so the output has a closed form
    (:func:`tractable_reference`): per layer ``residual = 4 h + 2 p + 3``, ``h = (residual+1)^2``
    where ``h`` is the embedding (``init_value``) for the first layer and ``h + residual`` after.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_ToyLayer(cfg) for _ in range(cfg.num_layers))
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        cfg = self.cfg
        self.embed.weight.fill_(cfg.init_value)
        gen = torch.Generator().manual_seed(cfg.seed)
        for layer in self.layers:
            if cfg.tractable_init:
                eye = torch.eye(cfg.hidden_size)
                layer.attn.qkv_proj.weight.copy_(torch.cat([eye, eye, eye]))
                layer.attn.o_proj.weight.copy_(eye)
                gate = torch.eye(cfg.mlp_size, cfg.hidden_size)
                layer.mlp.gate_up.weight.copy_(torch.cat([gate, gate]))
                layer.mlp.down.weight.copy_(torch.eye(cfg.hidden_size, cfg.mlp_size))
            else:
                # Small enough that 12 layers of squaring MLPs stay finite in float32.
                for lin, gain in ((layer.attn.qkv_proj, 0.5), (layer.attn.o_proj, 0.5),
                                  (layer.mlp.gate_up, 0.5), (layer.mlp.down, 1e-3)):
                    std = gain / lin.in_features ** 0.5
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * std)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)                   # (tokens, hidden)
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return h


def tractable_reference(cfg: LlamaConfig, input_ids: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
    """The closed-form output of a ``tractable_init`` :class:`ToyLlama`."""
    del input_ids  # every embedding row is init_value
    p = positions.to(torch.float32).unsqueeze(-1).expand(-1, cfg.hidden_size)
    h = torch.full_like(p, cfg.init_value)
    residual = None
    for _ in range(cfg.num_layers):
        if residual is not None:
            h = h + residual
        residual = 4 * h + 2 * p + 3
        h = (residual + 1) ** 2
    return h


# -- two separately compiled submodules (vLLM's test_multiple_graphs) -----------------------
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class AttnWithRMSNorm(nn.Module):
    """pre-linear, RMS norm, attention, RMS norm, post-linear: 3 pieces, 2 capturable."""

    def __init__(self, hidden: int = 128, inner: int = 256, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.pre = nn.Linear(hidden, inner)
        self.post = nn.Linear(inner, hidden)
        self.norm1 = nn.Parameter(torch.ones(inner))
        self.norm2 = nn.Parameter(torch.ones(inner))
        with torch.no_grad():
            for p in (self.pre.weight, self.pre.bias, self.post.weight, self.post.bias):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(self.pre(x), self.norm1)      # (tokens, inner)
        h = attention(h, h, h)
        return self.post(_rms_norm(h, self.norm2))  # (tokens, hidden)


class AttnWithRMSNormAndSkip(AttnWithRMSNorm):
    """The same with a skip connection around it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x


class TwoSubmodulesModel(nn.Module):
    """A plain parent holding two submodules that are compiled separately (``wrap``), fed from
    a persistent ``(max_tokens, hidden)`` buffer so their inputs keep static addresses."""

    def __init__(self, wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
                 hidden: int = 128, max_tokens: int = 32) -> None:
        super().__init__()
        self.attn_one = wrap(AttnWithRMSNorm(hidden, seed=1))
        self.attn_two = wrap(AttnWithRMSNormAndSkip(hidden, seed=2))
        self.register_buffer("buf", torch.zeros(max_tokens, hidden), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        self.buf[:n].copy_(x)
        y = self.attn_one(self.buf[:n])
        self.buf[:n].copy_(y)
        return self.attn_two(self.buf[:n])


# -- vLLM's test_decorator / test_compile_ranges ---------------------------------------------
class AttnSandwich(nn.Module):
    """x + x, attention, x * 3: 3 pieces, 2 capturable (one piece when not split)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + x
        x = attention(x, x, x)
        return x * 3


class _Inner(nn.Module):
    """x * 2, attention, x + 3."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = attention(x * 2, x, x)
        return x + 3


class OuterWithTwoInner(nn.Module):
    """x + 1, attention, inner, inner. Compiled as a whole: 3 attentions, 7 pieces, 4
    capturable. With only the inner modules compiled (``wrap``): 2 traces of 3 pieces each."""

    def __init__(self, wrap: Callable[[nn.Module], nn.Module] = lambda m: m) -> None:
        super().__init__()
        self.inner_one = wrap(_Inner())
        self.inner_two = wrap(_Inner())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = attention(x + 1, x, x)
        return self.inner_two(self.inner_one(x))



class IntegerWeights(nn.Module):
    """Two integer-valued ``hidden x hidden`` weights ``w1``, ``w2`` drawn from seed 0, for
    models whose every result is exact in any order (a subclass's forward uses them)."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randint(-3, 4, (hidden, hidden), generator=g).float(),
                               requires_grad=False)
        self.w2 = nn.Parameter(torch.randint(-3, 4, (hidden, hidden), generator=g).float(),
                               requires_grad=False)
