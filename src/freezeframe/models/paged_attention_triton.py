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

Split-KV (flash-decoding). A decode step of a few sequences launches only (tokens x KV heads)
programs, far fewer than a GPU has SMs, each walking the whole context. When that count is
small and the block table long (:func:`num_splits_for`, from static shapes only, so a captured
graph keeps its choice), each token's blocks are split into up to 16 parts run as separate
programs (:func:`_paged_attention_split_kernel`), each writing its partial max, sum and output
to an fp32 workspace, and :func:`_split_reduce_kernel` combines them. Same answer as one pass
(tested against it and a float64 oracle); its speed-up awaits a GPU measurement.

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

__all__ = ["compile_for_gpu", "interpreter_ready", "num_splits_for", "paged_attention"]

# A masked score: finite, so exp() of it is 0 without inf - inf. A compiled kernel may read a
# module global only when it is a tl.constexpr (Triton >= 3.0; the interpreter reads any).
_NEG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _token_context(positions_ptr, token_req_ptr, token_valid_ptr, block_tables_ptr, token,
                   stride_bt_r, BLOCK_SIZE: tl.constexpr):
    """A token's position, its block-table row and how many blocks it reads (0 for a padded
    token, whose position may be anything)."""
    pos = tl.load(positions_ptr + token)
    req = tl.load(token_req_ptr + token)
    valid = tl.load(token_valid_ptr + token)
    num_blocks = tl.where(valid != 0, pos // BLOCK_SIZE + 1, 0)
    return pos, block_tables_ptr + req.to(tl.int64) * stride_bt_r, num_blocks


@triton.jit
def _token_query(q_ptr, token, kv_head, stride_qt, stride_qh, scale,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_P2: tl.constexpr,
                 HEAD_DIM_P2: tl.constexpr):
    """The scaled fp32 queries ``[GROUP_P2, HEAD_DIM_P2]`` of the token's heads that share
    ``kv_head`` (padding lanes 0)."""
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    heads = kv_head * GROUP + g
    q_off = token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :]
    mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    return tl.load(q_ptr + q_off, mask=mask, other=0.0).to(tl.float32) * scale


@triton.jit
def _attend_blocks(
    q, k_cache_ptr, v_cache_ptr, row, pos, kv_head, first, last,
    stride_ks, stride_kh, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_P2: tl.constexpr,
):
    """The online softmax of one token's query heads (``q``, scaled, ``[GROUP_P2,
    HEAD_DIM_P2]`` fp32) over the keys of blocks ``first .. last - 1`` of its block-table
    ``row`` at positions ``<= pos``: its running max, sum and unnormalised output."""
    d = tl.arange(0, HEAD_DIM_P2)
    n = tl.arange(0, BLOCK_P2)
    d_ok = d < HEAD_DIM
    run_max = tl.full([GROUP_P2], _NEG, dtype=tl.float32)
    run_sum = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], dtype=tl.float32)
    for j in range(first, last):
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
    return run_max, run_sum, acc


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
    pos, row, num_blocks = _token_context(positions_ptr, token_req_ptr, token_valid_ptr,
                                          block_tables_ptr, token, stride_bt_r, BLOCK_SIZE)
    q = _token_query(q_ptr, token, kv_head, stride_qt, stride_qh, scale, GROUP, HEAD_DIM,
                     GROUP_P2, HEAD_DIM_P2)
    _, run_sum, acc = _attend_blocks(
        q, k_cache_ptr, v_cache_ptr, row, pos, kv_head, 0, num_blocks, stride_ks, stride_kh,
        stride_vs, stride_vh, HEAD_DIM, BLOCK_SIZE, GROUP_P2, HEAD_DIM_P2, BLOCK_P2)

    # run_sum >= 1 for a real token (its own key is visible); 0 for a padded one
    result = tl.where(run_sum[:, None] > 0, acc / tl.maximum(run_sum, 1e-30)[:, None], 0.0)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    o_off = token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _paged_attention_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, m_ptr, l_ptr, acc_ptr,
    positions_ptr, token_req_ptr, token_valid_ptr, block_tables_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh,
    stride_vs, stride_vh, stride_bt_r,
    scale, blocks_per_split,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_P2: tl.constexpr,
):
    """Split-KV (flash-decoding) first pass: program (token, KV head, split) runs the online
    softmax of :func:`_paged_attention_kernel` over its share of the token's blocks only and
    writes the partial max, sum and unnormalised output to the workspace
    ``[token, kv_head, split, ...]``; :func:`_split_reduce_kernel` combines the splits."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv = tl.num_programs(1)
    num_splits = tl.num_programs(2)
    pos, row, num_blocks = _token_context(positions_ptr, token_req_ptr, token_valid_ptr,
                                          block_tables_ptr, token, stride_bt_r, BLOCK_SIZE)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_blocks)
    q = _token_query(q_ptr, token, kv_head, stride_qt, stride_qh, scale, GROUP, HEAD_DIM,
                     GROUP_P2, HEAD_DIM_P2)
    run_max, run_sum, acc = _attend_blocks(
        q, k_cache_ptr, v_cache_ptr, row, pos, kv_head, first, last, stride_ks, stride_kh,
        stride_vs, stride_vh, HEAD_DIM, BLOCK_SIZE, GROUP_P2, HEAD_DIM_P2, BLOCK_P2)

    # workspace rows: ((token * num_kv + kv_head) * num_splits + split) * GROUP_P2 + g
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    base = ((token.to(tl.int64) * num_kv + kv_head) * num_splits + split) * GROUP_P2
    tl.store(m_ptr + base + g, run_max)
    tl.store(l_ptr + base + g, run_sum)
    tl.store(acc_ptr + (base + g)[:, None] * HEAD_DIM_P2 + d[None, :], acc)


@triton.jit
def _split_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    """Split-KV second pass: program (token, KV head) rescales each split's partial results to
    the largest max and normalises (a split that saw no block has max ``_NEG`` and sum 0, so it
    adds nothing; a padded token, all splits empty, gets zeros)."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_kv = tl.num_programs(1)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    first = (token.to(tl.int64) * num_kv + kv_head) * NUM_SPLITS * GROUP_P2
    top = tl.full([GROUP_P2], _NEG, dtype=tl.float32)
    for s in range(NUM_SPLITS):
        top = tl.maximum(top, tl.load(m_ptr + first + s * GROUP_P2 + g))
    total = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        rows = first + s * GROUP_P2 + g
        weight = tl.exp(tl.load(m_ptr + rows) - top)
        total += tl.load(l_ptr + rows) * weight
        acc += tl.load(acc_ptr + rows[:, None] * HEAD_DIM_P2 + d[None, :]) * weight[:, None]
    result = tl.where(total[:, None] > 0, acc / tl.maximum(total, 1e-30)[:, None], 0.0)
    heads = kv_head * GROUP + g
    o_off = token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty),
             mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :])


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


# Split-KV pays off when (tokens x KV heads) programs leave most of a GPU idle: a decode step
# of a few sequences on a long context. Below this many programs the context is split.
_SPLIT_BELOW = 128
_MAX_SPLITS = 16
_MIN_BLOCKS_PER_SPLIT = 4


def num_splits_for(num_tokens: int, num_kv_heads: int, max_blocks: int) -> int:
    """How many splits of the context each token's attention runs in: 1 (one pass) when there
    are enough (token, KV head) programs or too few blocks to share; else enough splits to
    bring the programs near ``_SPLIT_BELOW``, each at least ``_MIN_BLOCKS_PER_SPLIT`` blocks.
    Depends only on static shapes, so a captured graph keeps its choice."""
    work = num_tokens * num_kv_heads
    if work >= _SPLIT_BELOW or max_blocks < 2 * _MIN_BLOCKS_PER_SPLIT:
        return 1
    return max(1, min(_MAX_SPLITS, max_blocks // _MIN_BLOCKS_PER_SPLIT, _SPLIT_BELOW // work))


def _split_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                out: torch.Tensor, positions: torch.Tensor, token_req: torch.Tensor,
                token_valid: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                scale: float, splits: int, workspace: tuple[torch.Tensor, ...]
                ) -> tuple[tuple[Any, ...], dict[str, int], tuple[Any, ...], dict[str, int]]:
    """The split kernel's and the reduce kernel's arguments and constants (for a launch and
    for :func:`compile_for_gpu` alike)."""
    _, constants = _kernel_args(q, k_cache, v_cache, out, positions, token_req, token_valid,
                                block_tables, block_size, scale)
    run_max, run_sum, acc = workspace
    per_split = -(-block_tables.shape[1] // splits)
    split_args = (q, k_cache, v_cache, run_max, run_sum, acc, positions, token_req, token_valid,
                  block_tables, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                  v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), scale,
                  per_split)
    reduce_args = (run_max, run_sum, acc, out, out.stride(0), out.stride(1))
    reduce_constants = dict(NUM_SPLITS=splits, GROUP=constants["GROUP"],
                            HEAD_DIM=constants["HEAD_DIM"], GROUP_P2=constants["GROUP_P2"],
                            HEAD_DIM_P2=constants["HEAD_DIM_P2"])
    return split_args, constants, reduce_args, reduce_constants


def _workspace(q: torch.Tensor, num_kv_heads: int, splits: int, group_p2: int,
               head_dim_p2: int, device: Any = None) -> tuple[torch.Tensor, ...]:
    """The split pass's partial max, sum and output, fp32, ``[T, KV, splits, group(, dim)]``."""
    rows = (q.shape[0], num_kv_heads, splits, group_p2)
    where = q.device if device is None else device
    return (torch.empty(rows, dtype=torch.float32, device=where),
            torch.empty(rows, dtype=torch.float32, device=where),
            torch.empty((*rows, head_dim_p2), dtype=torch.float32, device=where))


@opaque  # the emulated graph backend records the launch as one step (it writes raw memory)
def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            positions: torch.Tensor, token_req: torch.Tensor, token_valid: torch.Tensor,
            block_tables: torch.Tensor, block_size: int, scale: float,
            splits: int = 1) -> torch.Tensor:
    kernel: Any
    if splits <= 1:
        args, constants = _kernel_args(q, k_cache, v_cache, out, positions, token_req,
                                       token_valid, block_tables, block_size, scale)
        kernel = _paged_attention_kernel
        kernel[(q.shape[0], k_cache.shape[1])](*args, **constants)  # (token, KV head)
        return out
    group = q.shape[1] // k_cache.shape[1]
    workspace = _workspace(q, k_cache.shape[1], splits, _pow2(group), _pow2(q.shape[2]))
    split_args, constants, reduce_args, reduce_constants = _split_args(
        q, k_cache, v_cache, out, positions, token_req, token_valid, block_tables, block_size,
        scale, splits, workspace)
    kernel = _paged_attention_split_kernel
    kernel[(q.shape[0], k_cache.shape[1], splits)](*split_args, **constants)
    kernel = _split_reduce_kernel
    kernel[(q.shape[0], k_cache.shape[1])](*reduce_args, **reduce_constants)
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
                    max_blocks: int = 8, splits: int = 2) -> dict[str, Any]:
    """Compile the kernels for an NVIDIA GPU of compute ``capability`` (80: A100, 90: H100),
    down to cubins, without a GPU and without launching them; returns Triton's compiled
    kernels by name: ``"attention"`` (one pass), ``"split"`` and ``"reduce"`` (split-KV with
    ``splits`` parts).

    Why: Triton's interpreter, which runs the kernels on CPU tensors in the tests, accepts code
    that a real compile refuses (a plain Python global read inside a kernel, say). Compiling
    for the real targets on the CPU turns that into a test failure instead of a failure on the
    first GPU. The arguments are built by the same :func:`_kernel_args` and
    :func:`_split_args` a launch uses, from meta tensors of the given shapes and dtypes (index
    tensors int64, as the attention op passes them). Needs a process in which triton was
    imported without ``TRITON_INTERPRET=1`` (the tests run it in a child process)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(_paged_attention_kernel, JITFunction) \
            or isinstance(_paged_attention_kernel, InterpretedFunction):
        raise ConfigError(
            "compile_for_gpu: triton was imported with TRITON_INTERPRET=1, so the kernel is an "
            "interpreted function that cannot be compiled; call it in a process started without "
            "that variable")
    slots = num_blocks * block_size + 1

    def meta(*shape: int, kind: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(*shape, dtype=kind, device="meta")

    tensors = (meta(4, num_heads, head_dim, kind=dtype),
               meta(slots, num_kv_heads, head_dim, kind=dtype),
               meta(slots, num_kv_heads, head_dim, kind=dtype),
               meta(4, num_heads, head_dim, kind=dtype),
               meta(4), meta(4), meta(4, kind=torch.int8), meta(4, max_blocks))
    scale = head_dim ** -0.5
    args, constants = _kernel_args(*tensors, block_size, scale)
    group = num_heads // num_kv_heads
    workspace = _workspace(tensors[0], num_kv_heads, splits, _pow2(group), _pow2(head_dim),
                           device="meta")
    split_args, split_constants, reduce_args, reduce_constants = _split_args(
        *tensors, block_size, scale, splits, workspace)

    def build(kernel: Any, kernel_args: tuple[Any, ...], kernel_constants: dict[str, int]) -> Any:
        names = kernel.arg_names
        signature = {name: _triton_type(value)
                     for name, value in zip(names, kernel_args, strict=False)}
        signature.update({name: "constexpr" for name in kernel_constants})
        source = ASTSource(kernel, signature,
                           {(names.index(k),): v for k, v in kernel_constants.items()})
        return triton.compile(source, target=GPUTarget("cuda", capability, 32))

    return {"attention": build(_paged_attention_kernel, args, constants),
            "split": build(_paged_attention_split_kernel, split_args, split_constants),
            "reduce": build(_split_reduce_kernel, reduce_args, reduce_constants)}


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
    num_splits: int | None = None,
) -> None:
    """Attention of each token over keys at positions ``<= positions[t]`` of its request,
    written into ``out``; the cache must already hold this step's keys and values.
    ``num_splits``: split each token's context in that many parts run in parallel and combined
    (flash-decoding); None chooses from the shapes (:func:`num_splits_for`)."""
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
    splits = (num_splits_for(q.shape[0], k_cache.shape[1], block_tables.shape[1])
              if num_splits is None else num_splits)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ConfigError(f"paged_attention: num_splits={num_splits!r} must be an int >= 1 "
                          "or None (chosen from the shapes)")
    _launch(q, k_cache, v_cache, out, positions, token_req, token_valid.to(torch.int8),
            block_tables, block_size, scale, splits)
