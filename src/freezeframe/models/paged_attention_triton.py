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

__all__ = ["compile_for_gpu", "interpreter_ready", "paged_attention"]

# A masked score: finite, so exp() of it is 0 without inf - inf. A compiled kernel may read a
# module global only when it is a tl.constexpr (Triton >= 3.0; the interpreter reads any).
_NEG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    positions_ptr, token_req_ptr, token_valid_ptr, block_tables_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh,  # (token, head) strides of q, k, v, out
    stride_vs, stride_vh, stride_ot, stride_oh, stride_bt_r,  # and a block table's row stride
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


def _kernel_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, positions: torch.Tensor, token_req: torch.Tensor,
                 token_valid: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 scale: float) -> tuple[tuple[Any, ...], dict[str, int]]:
    """The kernel's runtime arguments and its compile-time constants, for a launch and for
    :func:`compile_for_gpu` alike (one list, so the two cannot disagree)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    args = (q, k_cache, v_cache, out, positions, token_req, token_valid, block_tables,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
            block_tables.stride(0), scale)
    constants = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                     GROUP_P2=_pow2(group), HEAD_DIM_P2=_pow2(head_dim),
                     BLOCK_P2=_pow2(block_size))
    return args, constants


@opaque  # the emulated graph backend records the launch as one step (it writes raw memory)
def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            positions: torch.Tensor, token_req: torch.Tensor, token_valid: torch.Tensor,
            block_tables: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    args, constants = _kernel_args(q, k_cache, v_cache, out, positions, token_req, token_valid,
                                   block_tables, block_size, scale)
    grid = (q.shape[0], k_cache.shape[1])  # (token, KV head)
    kernel: Any = _paged_attention_kernel
    kernel[grid](*args, **constants)
    return out


_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.int64: "i64", torch.int32: "i32", torch.int8: "i8"}


def _triton_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_TYPES[value.dtype]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"no Triton type for the kernel argument {value!r}")
    if isinstance(value, float):
        return "fp32"
    return "i32" if -(2**31) <= value < 2**31 else "i64"


def compile_for_gpu(capability: int, *, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int, num_blocks: int = 64,
                    max_blocks: int = 8) -> Any:
    """Compile the kernel for an NVIDIA GPU of compute ``capability`` (80: A100, 90: H100),
    down to a cubin, without a GPU and without launching it; returns Triton's compiled kernel.

    Why: Triton's interpreter, which runs the kernel on CPU tensors in the tests, accepts code
    that a real compile refuses (a plain Python global read inside the kernel, say). Compiling
    for the real targets on the CPU turns that into a test failure instead of a failure on the
    first GPU. The arguments are built by the same :func:`_kernel_args` a launch uses, from
    meta tensors of the given shapes and dtypes (index tensors int64, as the attention op
    passes them). Needs a process in which triton was imported without ``TRITON_INTERPRET=1``
    (the tests run it in a child process)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = _paged_attention_kernel
    if not isinstance(kernel, JITFunction) or isinstance(kernel, InterpretedFunction):
        raise ConfigError(
            "compile_for_gpu: triton was imported with TRITON_INTERPRET=1, so the kernel is an "
            "interpreted function that cannot be compiled; call it in a process started without "
            "that variable")
    slots = num_blocks * block_size + 1

    def meta(*shape: int, kind: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(*shape, dtype=kind, device="meta")

    args, constants = _kernel_args(
        meta(4, num_heads, head_dim, kind=dtype), meta(slots, num_kv_heads, head_dim, kind=dtype),
        meta(slots, num_kv_heads, head_dim, kind=dtype), meta(4, num_heads, head_dim, kind=dtype),
        meta(4), meta(4), meta(4, kind=torch.int8), meta(4, max_blocks), block_size,
        head_dim ** -0.5)
    names = kernel.arg_names
    signature = {name: _triton_type(value) for name, value in zip(names, args, strict=False)}
    signature.update({name: "constexpr" for name in constants})
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", capability, 32))


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
