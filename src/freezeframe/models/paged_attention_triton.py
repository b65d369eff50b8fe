"""A Triton paged-attention kernel that reads only the KV blocks a token can see.

One program per (token, KV head). It loads the token's position and request row from device
tensors, loops over the blocks that hold positions ``0 .. position`` (found through the request's
block-table row: the key at position ``p`` lives in slot ``block_tables[req, p // block_size] *
block_size + p % block_size``) and keeps an online softmax in fp32 for the token's whole group
of query heads (grouped-query attention: the ``num_heads // num_kv_heads`` query heads that share
the KV head read its keys once). The loop bound comes from ``positions``, a device tensor, so
there is no host synchronisation and no shape depends on a context length: one captured graph
serves every context length up to ``max_model_len``. Padded tokens (``token_valid`` false) run no
iteration and write zeros.

What it costs: a decode token at position ``p`` reads ``p + 1`` keys and values per layer and KV
head (masked lanes of its last block are not loaded) instead of the whole ``max_blocks *
block_size`` window the pure-torch static path gathers. Because every token is handled on its
own, the same kernel serves decode, prefill and mixed batches on the same cache, but a prefill of
``n`` tokens reads its context ``n`` times (about ``n² / 2`` key reads in all, where a
query-tiled kernel would read each key once per tile of queries); for long prefills that is the
price of one simple capture-safe kernel, not a tuned prefill path.

Running without a GPU. Triton runs CPU tensors only under its interpreter, and the interpreter
is chosen when ``triton`` *is imported* (the environment variable ``TRITON_INTERPRET=1`` must be
set before that, which ``import torch._dynamo`` already does); :func:`interpreter_ready` says
whether this process can run the kernel on CPU tensors, and :func:`paged_attention` raises a
clear error when it cannot. The test suite sets the variable first thing (``tests/conftest.py``)
on machines without CUDA. Interpreted, the kernel is a correctness oracle, not a speed figure.

This module imports ``triton`` at import time; :mod:`freezeframe.models.attention` imports it
only when the kernel is first selected, so ``import freezeframe.models`` stays light.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from freezeframe.errors import ConfigError
from freezeframe.graphs.emulated import opaque

__all__ = ["interpreter_ready", "paged_attention"]

_NEG = -1.0e30  # a masked score: finite, so exp() of it is 0 without inf - inf


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    positions_ptr, token_req_ptr, token_valid_ptr, block_tables_ptr,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt_r,
    scale,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP_P2: tl.constexpr,  # GROUP, HEAD_DIM, BLOCK_SIZE rounded up to powers of two
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_P2: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    pos = tl.load(positions_ptr + token)
    req = tl.load(token_req_ptr + token)
    valid = tl.load(token_valid_ptr + token)
    # a padded token loops zero times: its position may be anything
    num_blocks = tl.where(valid != 0, pos // BLOCK_SIZE + 1, 0)

    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    n = tl.arange(0, BLOCK_P2)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_off = token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q = q * scale

    run_max = tl.full([GROUP_P2], _NEG, dtype=tl.float32)
    run_sum = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], dtype=tl.float32)
    row = block_tables_ptr + req.to(tl.int64) * stride_bt_r
    for j in range(0, num_blocks):
        block = tl.load(row + j).to(tl.int64)
        key_pos = j * BLOCK_SIZE + n
        visible = (n < BLOCK_SIZE) & (key_pos <= pos)
        slots = block * BLOCK_SIZE + n
        kv_mask = visible[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_P2, HEAD_DIM_P2]
        v = tl.load(v_cache_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_P2, BLOCK_P2]
        scores = tl.where(visible[None, :], scores, _NEG)
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        rescale = tl.exp(run_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        run_sum = run_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        run_max = new_max

    # run_sum >= 1 for a real token (its own key is visible); 0 for a padded one
    result = tl.where(run_sum[:, None] > 0, acc / tl.maximum(run_sum, 1e-30)[:, None], 0.0)
    o_off = token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def interpreter_ready() -> bool:
    """Whether this process runs Triton kernels in the interpreter (so on CPU tensors): only
    when ``TRITON_INTERPRET=1`` was set before ``triton`` was first imported."""
    if not isinstance(_paged_attention_kernel, InterpretedFunction):
        return False
    # the language's own helpers were decorated when triton was imported
    return not isinstance(tl.zeros, JITFunction)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@opaque  # the emulated graph backend records the launch as one step (it writes raw memory)
def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            positions: torch.Tensor, token_req: torch.Tensor, token_valid: torch.Tensor,
            block_tables: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    grid = (num_tokens, num_kv)
    kernel: Any = _paged_attention_kernel
    kernel[grid](
        q, k_cache, v_cache, out, positions, token_req, token_valid, block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        GROUP_P2=_pow2(group), HEAD_DIM_P2=_pow2(head_dim), BLOCK_P2=_pow2(block_size),
    )
    return out


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, KV, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, H, D], written
    positions: torch.Tensor,  # [T]
    token_req: torch.Tensor,  # [T], each token's block-table row
    token_valid: torch.Tensor,  # [T] bool: False for padded tokens (they get zeros)
    block_tables: torch.Tensor,  # [R, max_blocks]
    block_size: int,
    scale: float,
) -> None:
    """Attention of each token over keys at positions ``<= positions[t]`` of its request,
    written into ``out``; the cache must already hold this step's keys and values."""
    if q.shape[0] == 0:
        return
    if q.device.type == "cpu" and not interpreter_ready():
        raise ConfigError(
            "attention_kernel='triton': the Triton attention kernel got CPU tensors, which "
            "Triton runs only in its interpreter, and the interpreter was off when triton was "
            "imported; set TRITON_INTERPRET=1 in the environment before anything imports triton "
            "(torch._dynamo does), or use attention_kernel='torch' on CPU")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 \
            or out.stride(-1) != 1:
        raise ValueError("paged_attention needs q, k_cache, v_cache and out contiguous in their "
                         "last (head_dim) dimension")
    _launch(q, k_cache, v_cache, out, positions, token_req, token_valid.to(torch.int8),
            block_tables, block_size, scale)
