"""The Triton kernels behind ``attention_kernel="triton"``: one launch writes the step's keys
and values (RoPE applied on the way), one attends, and with split-KV one more combines.

How a decode step runs (see docs/attention.md for the reasons and what awaits a GPU):

1. :func:`write_kernel`, one program per token: rotates the token's query and key heads
   (rotate-half RoPE in fp32, from the model's per-token ``cos | sin`` row), writes the rotated
   queries to the output buffer (the attention kernel reads them there, and overwrites them
   with its result), and the rotated key and the value into the token's cache slot (the sink
   slot for a padded token). This replaces the RoPE kernels, the value copy, the ``where`` and
   the two ``index_copy_`` launches of a layer.
2. :func:`attend_kernel`, program (token, KV head, split): the token's whole query group, padded
   to at least 16 rows, against ``TILE`` keys per iteration (several cache blocks: the block ids
   of a tile are loaded as one vector), both products on ``tl.dot`` (tensor cores for 16-bit
   caches), an online softmax in fp32 in base 2. The keys a token reads are its own context,
   ``positions[t] + 1``, read on the device; with ``NUM_SPLITS > 1`` the token's tiles are
   shared evenly among the splits from that real context (not from the block table's width),
   a split left without a tile exits at once, and each split writes its partial max, sum and
   output to the workspace.
3. :func:`combine_kernel`, program (token, KV head): rescales the splits that had work to their
   common max and normalises.

The number of splits is a compile-time constant chosen on the host from static shapes only, so
one captured graph serves every context length. Padded tokens (``token_valid`` false) read no
key and get zeros.

Running without a GPU: Triton's interpreter runs these kernels on CPU tensors. It computes a
16-bit ``tl.dot`` wrongly (it multiplies the raw bits), so under the interpreter the host sets
``F32_DOT``: both products take fp32 operands, the probabilities rounded to the cache's dtype
first, which is the same arithmetic as the tensor-core product with fp32 accumulation. An fp32
cache always sets it (with ``input_precision="ieee"``: TF32 would miss the fp32 tolerance).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["attend_kernel", "combine_kernel", "write_kernel"]

# A masked score: finite, so exp2 of it is 0 without inf - inf. A compiled kernel may read a
# module global only when it is a tl.constexpr.
_NEG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _rotate(x_ptr, row_off, heads, head_ok, half_idx, half_ok, cos, sin, HALF: tl.constexpr):
    """The two rotated halves ``[heads, half]`` (fp32) of the rows at ``row_off + heads``."""
    mask = head_ok[:, None] & half_ok[None, :]
    first = tl.load(x_ptr + row_off[:, None] + half_idx[None, :], mask=mask, other=0.0)
    second = tl.load(x_ptr + row_off[:, None] + HALF + half_idx[None, :], mask=mask, other=0.0)
    a, b = first.to(tl.float32), second.to(tl.float32)
    return a * cos[None, :] - b * sin[None, :], b * cos[None, :] + a * sin[None, :]


@triton.jit
def write_kernel(
    q_ptr, k_ptr, v_ptr, rope_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, valid_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
    stride_ot, stride_oh, stride_cs, stride_ch, stride_ds, stride_dh, sink,
    NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr, KV_P2: tl.constexpr, DIM_P2: tl.constexpr,
    ROPE: tl.constexpr,  # rotate q and k (rope_ptr: [T, HEAD_DIM] cos | sin, fp32)
):
    """Program ``t``: token ``t``'s keys and values into its cache slot (``c``: the key cache,
    ``d``: the value cache), and with ``ROPE`` its rotated queries into ``q_out``."""
    t = tl.program_id(0)
    valid = tl.load(valid_ptr + t)
    slot = tl.where(valid, tl.load(slot_ptr + t), sink).to(tl.int64)
    t64 = t.to(tl.int64)
    kv = tl.arange(0, KV_P2)
    kv_ok = kv < NUM_KV
    d = tl.arange(0, DIM_P2)
    d_ok = d < HEAD_DIM
    k_dst = k_cache_ptr + slot * stride_cs + kv * stride_ch
    if ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        j = tl.arange(0, DIM_P2 // 2)
        j_ok = j < HALF
        cos = tl.load(rope_ptr + t64 * stride_rt + j, mask=j_ok, other=0.0).to(tl.float32)
        sin = tl.load(rope_ptr + t64 * stride_rt + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
        h = tl.arange(0, HEADS_P2)
        h_ok = h < NUM_HEADS
        qa, qb = _rotate(q_ptr, t64 * stride_qt + h * stride_qh, h, h_ok, j, j_ok, cos, sin, HALF)
        q_dst = q_out_ptr + t64 * stride_ot + h * stride_oh
        q_mask = h_ok[:, None] & j_ok[None, :]
        q_type = q_ptr.dtype.element_ty
        tl.store(q_dst[:, None] + j[None, :], qa.to(q_type), mask=q_mask)
        tl.store(q_dst[:, None] + HALF + j[None, :], qb.to(q_type), mask=q_mask)
        ka, kb = _rotate(k_ptr, t64 * stride_kt + kv * stride_kh, kv, kv_ok, j, j_ok, cos, sin,
                         HALF)
        k_type = k_ptr.dtype.element_ty
        k_mask = kv_ok[:, None] & j_ok[None, :]
        c_type = k_cache_ptr.dtype.element_ty
        tl.store(k_dst[:, None] + j[None, :], ka.to(k_type).to(c_type), mask=k_mask)
        tl.store(k_dst[:, None] + HALF + j[None, :], kb.to(k_type).to(c_type), mask=k_mask)
    else:
        mask = kv_ok[:, None] & d_ok[None, :]
        key = tl.load(k_ptr + t64 * stride_kt + kv[:, None] * stride_kh + d[None, :], mask=mask)
        tl.store(k_dst[:, None] + d[None, :], key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    mask = kv_ok[:, None] & d_ok[None, :]
    value = tl.load(v_ptr + t64 * stride_vt + kv[:, None] * stride_vh + d[None, :], mask=mask)
    v_dst = v_cache_ptr + slot * stride_ds + kv[:, None] * stride_dh + d[None, :]
    tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_range(n_keys, split, NUM_SPLITS: tl.constexpr, TILE: tl.constexpr):
    """The tiles ``[first, last)`` of split ``split`` of a context of ``n_keys`` keys: its
    ``cdiv(n_tiles, NUM_SPLITS)`` tiles shared evenly, so every split of a long context works
    and the last ones of a short context get none."""
    n_tiles = tl.cdiv(n_keys, TILE)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    first = split * per_split
    return first, tl.minimum(first + per_split, n_tiles)


@triton.jit
def _attend_tiles(q, k_base, v_base, row, first, last, n_keys, stride_ks, stride_vs, qk_scale,
                  d_mask, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, DIM_P2: tl.constexpr,
                  TILE: tl.constexpr, F32_DOT: tl.constexpr):
    """The online softmax of the query rows ``q`` over tiles ``first .. last - 1`` of keys
    (those below ``n_keys``) of the block-table ``row``: running max, sum, unnormalised
    output."""
    cache_type = v_base.dtype.element_ty
    d = tl.arange(0, DIM_P2)
    n = tl.arange(0, TILE)
    run_max = tl.full([ROWS], _NEG, dtype=tl.float32)
    run_sum = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DIM_P2], dtype=tl.float32)
    for j in range(first, last):
        key = j * TILE + n
        key_ok = key < n_keys
        # the tile's block ids in one vector load (TILE // BLOCK_SIZE distinct entries)
        block = tl.load(row + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + key % BLOCK_SIZE
        k_t = tl.load(k_base + slot[None, :] * stride_ks + d[:, None],
                      mask=key_ok[None, :] & d_mask[:, None], other=0.0)  # [DIM_P2, TILE]
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :],
                    mask=key_ok[:, None] & d_mask[None, :], other=0.0)  # [TILE, DIM_P2]
        if F32_DOT:
            v = v.to(tl.float32)
            scores = tl.dot(q, k_t.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k_t)  # [ROWS, TILE] fp32
        # one online-softmax step in base 2 (inline: the interpreter pays for every call)
        scores = tl.where(key_ok[None, :], scores * qk_scale, _NEG)
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        rescale = tl.exp2(run_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        run_max = new_max
        if F32_DOT:  # probabilities rounded as the 16-bit product would round them
            part = tl.dot(probs.to(cache_type).to(tl.float32), v, input_precision="ieee")
        else:
            part = tl.dot(probs.to(cache_type), v)
        run_sum = run_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + part
    return run_max, run_sum, acc


@triton.jit
def attend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, ws_ptr,
    positions_ptr, token_req_ptr, token_valid_ptr, block_tables_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt,
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    ROWS: tl.constexpr,  # GROUP padded to a power of two >= 16 (a tl.dot operand's rows)
    DIM_P2: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    TILE: tl.constexpr,  # keys per iteration (a power of two >= 16)
    NUM_SPLITS: tl.constexpr,
    WS_ROWS: tl.constexpr,  # GROUP rounded up to a power of two (the workspace's rows)
    F32_DOT: tl.constexpr,  # fp32 operands for both products (see the module docstring)
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    valid = tl.load(token_valid_ptr + token)
    n_keys = tl.where(valid, tl.load(positions_ptr + token) + 1, 0)
    if NUM_SPLITS == 1:
        first = 0
        last = tl.cdiv(n_keys, TILE)
    else:
        first, last = _split_range(n_keys, tl.program_id(2), NUM_SPLITS, TILE)
        if first >= last:
            return  # nothing to read; the combine kernel counts the same splits
    row = block_tables_ptr + tl.load(token_req_ptr + token).to(tl.int64) * stride_bt
    m = tl.arange(0, ROWS)
    d = tl.arange(0, DIM_P2)
    heads = kv_head * GROUP + m
    if DIM_P2 == HEAD_DIM:  # no column mask, so loads along the head dim stay vectorised
        rows_mask = (m < GROUP)[:, None]
        d_mask = tl.full([DIM_P2], 1, tl.int1)
    else:
        d_mask = d < HEAD_DIM
        rows_mask = (m < GROUP)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=rows_mask, other=0.0)
    q = q.to(tl.float32) if F32_DOT else q.to(v_cache_ptr.dtype.element_ty)
    run_max, run_sum, acc = _attend_tiles(
        q, k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh, row, first,
        last, n_keys, stride_ks, stride_vs, qk_scale, d_mask, BLOCK_SIZE, ROWS, DIM_P2, TILE,
        F32_DOT)
    if NUM_SPLITS == 1:
        # run_sum >= 1 for a real token (its own key is visible); 0 for a padded one
        result = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]
        o_off = token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty), mask=rows_mask)
    else:
        split_size: tl.constexpr = WS_ROWS * (DIM_P2 + 2)
        base = ((token.to(tl.int64) * tl.num_programs(1) + kv_head) * NUM_SPLITS
                + tl.program_id(2)) * split_size
        row_ok = m < GROUP
        tl.store(ws_ptr + base + m[:, None] * DIM_P2 + d[None, :], acc, mask=row_ok[:, None])
        tl.store(ws_ptr + base + WS_ROWS * DIM_P2 + m, run_max, mask=row_ok)
        tl.store(ws_ptr + base + WS_ROWS * DIM_P2 + WS_ROWS + m, run_sum, mask=row_ok)


@triton.jit
def combine_kernel(
    ws_ptr, out_ptr, positions_ptr, token_valid_ptr, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    WS_ROWS: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Program (token, KV head): the splits that had tiles, rescaled to their common max and
    normalised (a padded token, none of whose splits ran, gets zeros)."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    valid = tl.load(token_valid_ptr + token)
    n_keys = tl.where(valid, tl.load(positions_ptr + token) + 1, 0)
    n_tiles = tl.cdiv(n_keys, TILE)
    per_split = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), 1)
    active = tl.cdiv(n_tiles, per_split)  # the splits attend_kernel did not skip
    g = tl.arange(0, WS_ROWS)
    d = tl.arange(0, DIM_P2)
    g_ok = g < GROUP
    split_size: tl.constexpr = WS_ROWS * (DIM_P2 + 2)
    first = (token.to(tl.int64) * tl.num_programs(1) + kv_head) * NUM_SPLITS * split_size
    top = tl.full([WS_ROWS], _NEG, dtype=tl.float32)
    # (g * 0 + s < active): the split test as a vector, since the interpreter refuses a mask
    # built from a scalar comparison
    for s in range(NUM_SPLITS):
        stats = ws_ptr + first + s * split_size + WS_ROWS * DIM_P2
        top = tl.maximum(top, tl.load(stats + g, mask=g_ok & (g * 0 + s < active),
                                      other=_NEG))
    total = tl.zeros([WS_ROWS], dtype=tl.float32)
    acc = tl.zeros([WS_ROWS, DIM_P2], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        ok = g_ok & (g * 0 + s < active)
        split = ws_ptr + first + s * split_size
        weight = tl.exp2(tl.load(split + WS_ROWS * DIM_P2 + g, mask=ok, other=_NEG) - top)
        total += tl.load(split + WS_ROWS * DIM_P2 + WS_ROWS + g, mask=ok, other=0.0) * weight
        part = tl.load(split + g[:, None] * DIM_P2 + d[None, :], mask=ok[:, None], other=0.0)
        acc += part * weight[:, None]
    result = acc / tl.where(total > 0, total, 1.0)[:, None]
    heads = kv_head * GROUP + g
    o_off = token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & (d < HEAD_DIM)[None, :])
