"""The attention ``ff.hf`` splits an HF model at: the op that owns the static KV cache, and the
implementation registered with ``transformers.AttentionInterface`` that calls it.

``freezeframe_hf::attention`` is the splitting op. It writes each token's key and value at
``(seq_ids[t], positions[t])`` of a layer's cache, in place, then attends token ``t`` over the
cache positions of its row that it may see: ``<= positions[t]`` (causal), and with a sliding
window ``w`` only the last ``w`` of them (``> positions[t] - w``, HF's rule). Attention logit
soft-capping (``cap * tanh(score / cap)``, Gemma 2) and attention sinks (one extra logit per
head in the softmax's denominator, GPT-OSS) are applied as HF's eager attention applies them.
Every index is a tensor and nothing is read back to the host, so the op is as safe inside a
captured FULL graph as between PIECEWISE pieces.

The ``"freezeframe"`` attention implementation passes a step's cache and metadata (a
:class:`StepMetadata`, which the wrapper hands the HF model as a keyword HF passes on to its
attention function) to the op. Called without one (the HF model called directly) it is HF's own
attention: SDPA, or the model's eager attention where the layer asks for soft-capping or sinks
(which SDPA does not implement).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from freezeframe.errors import CompileError
from freezeframe.models.ops import define_op

try:
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"freezeframe.integrations.hf needs Hugging Face transformers (>= 4.53): {exc}; "
        "install it with pip install 'freezeframe[hf]'") from None

__all__ = ["ATTN_IMPLEMENTATION", "HF_ATTENTION_OP", "STEP_KWARG", "StepMetadata"]

#: The splitting op, for ``CompilationConfig(splitting_ops=[HF_ATTENTION_OP])``.
HF_ATTENTION_OP = "freezeframe_hf::attention"
#: The name of the attention implementation registered with ``transformers.AttentionInterface``.
ATTN_IMPLEMENTATION = "freezeframe"
#: The keyword argument under which a step's cache and metadata travel from the wrapper through
#: the HF model (which passes its **kwargs on to the attention function) to the attention.
STEP_KWARG = "freezeframe_step"
# Upper bound on tokens * cache positions * kv heads * head dim gathered at once by the op.
_GATHER_BUDGET = 1 << 22


class StepMetadata:
    """What the attention of one step needs beyond q, k, v: the caches and where tokens go.

    A plain class, not a NamedTuple: Dynamo guards the globals of a namedtuple's generated
    ``__new__`` by a name installed per process, which kept the trace out of the cache."""

    __slots__ = ("k_cache", "positions", "seq_ids", "v_cache")

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                 seq_ids: torch.Tensor) -> None:
        self.k_cache = k_cache  # [layers, rows + 1, max_cache_len, kv_heads, head_dim]
        self.v_cache = v_cache
        self.positions = positions  # [T] position of each token in its sequence
        self.seq_ids = seq_ids  # [T] cache row of each token; -1: padding (the sink row)


# -- the splitting op ------------------------------------------------------------------------
def _attention_kernel(
    q: torch.Tensor,  # [1, heads, T, head_dim]: HF's query layout for one sequence of T tokens
    k: torch.Tensor,  # [1, kv_heads, T, head_dim]
    v: torch.Tensor,  # [1, kv_heads, T, head_dim]
    out: torch.Tensor,  # [T, heads, head_dim], written
    k_cache: torch.Tensor,  # [layers, rows + 1, max_cache_len, kv_heads, head_dim], written
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [T]
    seq_ids: torch.Tensor,  # [T]
    layer: int,
    scale: float,
    window: int,  # sliding window in positions; 0: none
    softcap: float,  # logit soft-capping; 0.0: none
    sinks: torch.Tensor | None,  # [heads] one extra logit per head, or None
) -> None:
    """Write this step's keys and values into the layer's cache rows, then attend each token
    over the positions of its row it may see (see the module docstring)."""
    num_tokens = out.shape[0]
    if num_tokens == 0:
        return
    keys_cache, values_cache = k_cache[layer], v_cache[layer]
    sink_row = keys_cache.shape[0] - 1
    rows = torch.where(seq_ids < 0, sink_row, seq_ids)
    # every token's key/value first, so a token sees the earlier tokens of the same step
    keys_cache.index_put_((rows, positions), k[0].transpose(0, 1).to(keys_cache.dtype))
    values_cache.index_put_((rows, positions), v[0].transpose(0, 1).to(values_cache.dtype))
    heads, head_dim = out.shape[1], out.shape[2]
    length, kv_heads = keys_cache.shape[1], keys_cache.shape[2]
    group = heads // kv_heads  # query heads per kv head (grouped-query attention)
    queries = q[0].transpose(0, 1).reshape(num_tokens, kv_heads, group, head_dim).float()
    cache_positions = torch.arange(length, device=q.device)
    visible = cache_positions <= positions[:, None]  # [T, length]
    if window > 0:
        visible &= cache_positions > positions[:, None] - window
    extra = None if sinks is None else sinks.float().reshape(1, kv_heads, group, 1)
    chunk = max(1, _GATHER_BUDGET // (length * kv_heads * head_dim))
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        keys = keys_cache[rows[start:end]].float()  # [n, length, kv_heads, head_dim]
        values = values_cache[rows[start:end]].float()
        scores = torch.einsum("nkgd,ntkd->nkgt", queries[start:end], keys) * scale
        if softcap > 0.0:
            scores = torch.tanh(scores / softcap) * softcap
        # position positions[t] itself is always visible, so no row is all -inf
        scores = scores.masked_fill(~visible[start:end, None, None, :], float("-inf"))
        if extra is None:
            weights = scores.softmax(-1)
        else:  # the sink takes its share of the denominator and gives nothing back
            weights = torch.cat([scores, extra.expand(end - start, -1, -1, -1)], -1)
            weights = weights.softmax(-1)[..., :-1]
        result = torch.einsum("nkgt,ntkd->nkgd", weights, values)
        out[start:end].copy_(result.reshape(end - start, heads, head_dim))


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                    seq_ids: torch.Tensor, layer: int, scale: float, window: int,
                    softcap: float, sinks: torch.Tensor | None) -> None:
    return None


_LIBRARY = define_op(
    HF_ATTENTION_OP,
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) k_cache, Tensor(c!) v_cache, "
    "Tensor positions, Tensor seq_ids, int layer, float scale, int window, float softcap, "
    "Tensor? sinks) -> ()",
    _attention_kernel, _attention_fake)


# -- the HF attention function -----------------------------------------------------------------
def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"freezeframe"`` attention implementation (HF's attention-function signature)."""
    step = kwargs.pop(STEP_KWARG, None)
    if step is None:
        return _hf_own_attention(module, query, key, value, attention_mask, scaling, dropout,
                                 kwargs)
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if causal is False:  # ff.hf.compile refuses such models up front; the net at trace time
        raise CompileError(
            f"ff.hf: layer {getattr(module, 'layer_idx', '?')} of {type(module).__name__} "
            "asks for bidirectional attention (is_causal=False); freezeframe's HF attention is "
            "causal: serve this model without freezeframe")
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    num_tokens, heads, head_dim = query.shape[2], query.shape[1], query.shape[3]
    out = query.new_empty((num_tokens, heads, head_dim))
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    torch.ops.freezeframe_hf.attention(
        query, key, value, out, step.k_cache, step.v_cache, step.positions, step.seq_ids,
        int(module.layer_idx),  # type: ignore[arg-type]
        scale, int(window) if window else 0, float(softcap) if softcap else 0.0,
        kwargs.get("s_aux"))
    return out.unsqueeze(0), None


def _hf_own_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, mask: torch.Tensor | None, scaling: float | None,
                      dropout: float, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """The HF model called directly, not through ``CompiledCausalLM``: HF's SDPA (the
    ``"freezeframe"`` mask is HF's SDPA mask, so padding and caches work as with ``"sdpa"``),
    or, for soft-capping or sinks, the model's own eager attention over that mask."""
    if kwargs.get("softcap") is None and kwargs.get("s_aux") is None:
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise CompileError(
            f"ff.hf: {type(module).__name__} asks for soft-capping or attention sinks, which "
            "HF's SDPA does not implement, and its module has no eager_attention_forward to "
            "fall back on; call the model through ff.hf's CompiledCausalLM")
    return eager(  # type: ignore[no-any-return]
        module, query, key, value, _additive_mask(mask, query, key), scaling=scaling,
        dropout=dropout, **kwargs)


def _additive_mask(mask: torch.Tensor | None, query: torch.Tensor,
                   key: torch.Tensor) -> torch.Tensor:
    """HF's boolean SDPA mask (True: visible; None: causal, the queries being the last keys) as
    the additive mask eager attention adds to its scores."""
    if mask is not None and mask.dtype != torch.bool:
        return mask  # already additive
    if mask is None:
        q_len, kv_len = query.shape[-2], key.shape[-2]
        offset = kv_len - q_len
        rows = torch.arange(q_len, device=query.device)[:, None] + offset
        mask = (torch.arange(kv_len, device=query.device)[None, :] <= rows)[None, None]
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(mask, zero, torch.finfo(query.dtype).min)


# Process-wide, as the op itself is: registering again under the same name replaces the entry
# with the same function.
transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
