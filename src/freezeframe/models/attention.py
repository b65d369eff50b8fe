"""Paged attention over a mixed token batch, as a custom op that serves as the splitting op.

``freezeframe::attention`` writes this step's keys/values into the layer's cache and the
attention result into a caller-allocated ``out`` buffer (it returns nothing). Being a custom op
with a fake impl, Dynamo records it as one opaque node, so the compile path can split the
graph there and run it eagerly between captured pieces.

Batch metadata (all tensors, all int64; ``T`` tokens, ``R`` request rows):

* ``positions [T]`` and ``slot_mapping [T]``: per token; padded tokens have slot ``-1``.
* ``query_start_loc [R + 1]``: request ``r``'s query tokens are ``[qsl[r], qsl[r+1])``.
* ``seq_lens [R]``: context length of request ``r`` *after* this step (cached + new tokens).
  The new tokens are the last ``qsl[r+1] - qsl[r]`` positions of the sequence.
* ``block_tables [R, max_blocks]``: see :mod:`freezeframe.models.kv_cache`.

The token layout (each token's request row, and whether it is a real token) follows from
``query_start_loc``, ``seq_lens`` and ``slot_mapping``: :func:`token_layout` computes it. A model
computes it once per forward and passes it to every layer's op (``token_req``,
``token_valid``), so under PIECEWISE graphs it is captured in the first piece instead of run
eagerly by the op of every layer (about 8 small kernels each); an op given none computes it.

Real requests come first; rows with ``seq_lens == 0`` are padding, whatever their
``query_start_loc`` (so a runner may fill the tail of request-sized buffers with any value and
a fixed ``R`` = max requests works for every step). Tokens at or past the last real request's
end, or with a negative slot, are padding: they write only the sink slot and get zeros.

Three optional arguments let a model hand the op work that would otherwise be launches of its
own: ``rope`` (``[T, head_dim]`` fp32, ``cos | sin`` per token; see
:mod:`freezeframe.models.rope`): ``q`` and ``k`` come unrotated and the op rotates them, on the
Triton path inside the kernel that writes the cache; ``workspace``
(:func:`~freezeframe.models.paged_attention_triton.split_workspace`, allocated once by the
model) for split-KV's partial results, so a call allocates nothing; and ``split_kv``
(``KVCacheConfig.split_kv``: ``"auto"``, ``"on"``, ``"off"``), whether the Triton kernel splits
each token's context (see :mod:`freezeframe.models.paged_attention_triton`). ``q``, ``k`` and
``v`` may be strided views (of one fused projection, say) as long as the head dim is contiguous.

Which kernel attends is the op's ``kernel`` argument (``KVCacheConfig.attention_kernel``):

* ``"triton"`` – :mod:`freezeframe.models.paged_attention_triton`: one launch writes the cache
  (RoPE fused), one attends over only the blocks that hold each token's context, the bound read
  from device tensors (and one combines, with split-KV). No host sync, one captured graph for
  every context length, and it serves decode, prefill and mixed batches alike (see that module
  for what a long prefill costs). Needs ``triton``; on CPU tensors it runs in Triton's
  interpreter (for tests only).
* ``"torch"`` – the pure-torch reference paths below, for CPU and as the tests' oracle.
* ``"auto"`` (the default) – ``"triton"`` when ``q`` is on CUDA and ``triton`` is installed,
  otherwise ``"torch"``. Resolved per call from ``q``'s device, so a model moved between devices
  picks again.

The pure-torch paths compute the same thing:

* **static** – every token attends over the fixed window ``max_blocks * block_size`` of its
  request with a position mask, in chunks with an online softmax. No host sync and no
  data-dependent shapes: this is what a FULL CUDA graph captures. Used when the forward context
  runs FULL, when the stream is capturing, or when the step is known to be pure decode
  (``BatchDescriptor.uniform`` or host metadata with ``max_query_len == 1``).
* **varlen** – prefill requests through SDPA over exactly their context, decode tokens through
  the static kernel over the longest decode context. Needs the request layout on the host: from
  :class:`AttentionHostMetadata` in the forward context's extras (key ``attn_metadata``), or one
  device-to-host copy per call when absent.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import torch
import torch.nn.functional as F

from freezeframe.config import CUDAGraphMode
from freezeframe.context import get_forward_context
from freezeframe.errors import ConfigError
from freezeframe.models.ops import define_op
from freezeframe.models.rope import apply_rope

__all__ = [
    "ATTENTION_KERNELS",
    "ATTENTION_OP",
    "ATTN_METADATA_KEY",
    "SPLIT_KV_MODES",
    "AttentionHostMetadata",
    "attention",
    "check_attention_kernel",
    "check_split_kv",
    "resolve_attention_kernel",
    "split_workspace",
    "token_layout",
]

#: The op's qualified name, for ``CompilationConfig(splitting_ops=[ATTENTION_OP])``.
ATTENTION_OP = "freezeframe::attention"
#: Forward-context extras key under which a driver passes :class:`AttentionHostMetadata`.
ATTN_METADATA_KEY = "attn_metadata"

#: The values of ``KVCacheConfig.attention_kernel`` (the op's ``kernel`` argument).
ATTENTION_KERNELS = ("auto", "torch", "triton")
#: The values of ``KVCacheConfig.split_kv`` (the op's ``split_kv`` argument).
SPLIT_KV_MODES = ("auto", "on", "off")
#: (token, KV head, split) programs whose partial results :func:`split_workspace` holds: a step
#: that would need more runs fewer splits.
WORKSPACE_PROGRAMS = 1024
# whether triton can be imported (looked up once; importing it waits until it is used)
_TRITON_FOUND = importlib.util.find_spec("triton") is not None

# masked scores: a large finite negative, so an all-masked (padded) row averages finite values
# instead of dividing 0 by 0
_NEG = -1.0e30
# upper bound on tokens * keys gathered at once by the static path (bounds its scratch memory)
_GATHER_BUDGET = 1 << 15


@dataclasses.dataclass(frozen=True)
class AttentionHostMetadata:
    """The real request layout of a step, on the host, so the varlen path needs no sync.

    Only real requests are listed; ``query_start_loc`` has one more entry than ``seq_lens``.
    """

    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.query_start_loc) != len(self.seq_lens) + 1:
            raise ValueError(
                f"AttentionHostMetadata.query_start_loc must have len(seq_lens) + 1 = "
                f"{len(self.seq_lens) + 1} entries, got {len(self.query_start_loc)}"
            )

    @property
    def query_lens(self) -> list[int]:
        qsl = self.query_start_loc
        return [qsl[i + 1] - qsl[i] for i in range(len(self.seq_lens))]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)


def _attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    out: torch.Tensor,  # [T, H, D], written
    k_cache: torch.Tensor,  # [num_slots, KV, D], written at slot_mapping
    v_cache: torch.Tensor,  # [num_slots, KV, D]
    positions: torch.Tensor,  # [T]
    slot_mapping: torch.Tensor,  # [T]
    query_start_loc: torch.Tensor,  # [R + 1]
    seq_lens: torch.Tensor,  # [R]
    block_tables: torch.Tensor,  # [R, max_blocks]
    block_size: int,
    scale: float,
    kernel: str = "auto",
    token_req: torch.Tensor | None = None,  # [T], token_layout(...)[0]
    token_valid: torch.Tensor | None = None,  # [T], token_layout(...)[1]
    rope: torch.Tensor | None = None,  # [T, D] cos | sin: q and k come unrotated
    workspace: torch.Tensor | None = None,  # split-KV scratch, split_workspace(...)
    split_kv: str = "auto",
) -> None:
    """Write this step's K/V into the cache (rotating q and k first when ``rope`` is given),
    then attend each token over its request's context."""
    use_triton = resolve_attention_kernel(kernel, q.device) == "triton"
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    if token_req is None or token_valid is None:
        token_req, token_valid = token_layout(query_start_loc, seq_lens, slot_mapping)
    else:
        _check_layout(token_req, token_valid, slot_mapping)
        # the Triton kernel reads them as flat arrays
        token_req, token_valid = token_req.contiguous(), token_valid.contiguous()
    if use_triton:
        from freezeframe.models import paged_attention_triton

        paged_attention_triton.write_and_attend(
            q, k, v, out, k_cache, v_cache, positions, slot_mapping, token_req, token_valid,
            block_tables, block_size, scale, rope=rope, workspace=workspace, split_kv=split_kv)
        return
    if rope is not None:
        q, k = apply_rope(q, rope), apply_rope(k, rope)
    sink = k_cache.shape[0] - 1
    write_slot = torch.where(token_valid, slot_mapping, sink)
    k_cache.index_copy_(0, write_slot, k.to(k_cache.dtype))
    v_cache.index_copy_(0, write_slot, v.to(v_cache.dtype))
    _torch_attention(q, out, k_cache, v_cache, positions, query_start_loc, seq_lens,
                     block_tables, block_size, scale, token_req, token_valid)


def _torch_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, positions: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, block_size: int, scale: float,
                     token_req: torch.Tensor, token_valid: torch.Tensor) -> None:
    """The pure-torch paths over a cache that holds this step's keys: static or varlen."""
    host = _choose_path()
    if host is None:
        result = _static_attention(
            q, k_cache, v_cache, positions, token_req, block_tables, block_size, scale,
            block_tables.shape[1] * block_size,
        )
        out.copy_(torch.where(token_valid[:, None, None], result, 0.0).to(out.dtype))
        return
    if not isinstance(host, AttentionHostMetadata):
        host = AttentionHostMetadata(
            query_start_loc=tuple(query_start_loc.tolist()[: _num_real(seq_lens) + 1]),
            seq_lens=tuple(seq_lens.tolist()[: _num_real(seq_lens)]),
        )
    _varlen_attention(
        host, q, k_cache, v_cache, out, positions, token_req, token_valid, block_tables,
        block_size, scale,
    )


def _check_layout(token_req: torch.Tensor, token_valid: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """A given layout must be :func:`token_layout`'s for this step: one int64 row index and one
    bool per token, on the metadata's device."""
    if token_req.shape != slot_mapping.shape or token_valid.shape != slot_mapping.shape \
            or token_req.dtype != torch.int64 or token_valid.dtype != torch.bool \
            or token_req.device != slot_mapping.device \
            or token_valid.device != slot_mapping.device:
        raise ValueError(
            f"freezeframe::attention: token_req {tuple(token_req.shape)} {token_req.dtype} on "
            f"{token_req.device} and token_valid {tuple(token_valid.shape)} "
            f"{token_valid.dtype} on {token_valid.device} must be token_layout(...) of this "
            f"step: one entry per token ({tuple(slot_mapping.shape)}), token_req int64 and "
            f"token_valid bool, on {slot_mapping.device}")


def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    scale: float,
    kernel: str = "auto",
    token_req: torch.Tensor | None = None,
    token_valid: torch.Tensor | None = None,
    rope: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    split_kv: str = "auto",
) -> None:
    return None


_LIBRARY = define_op(
    ATTENTION_OP,
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) k_cache, Tensor(c!) v_cache, "
    "Tensor positions, Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_tables, int block_size, float scale, str kernel=\"auto\", "
    "Tensor? token_req=None, Tensor? token_valid=None, Tensor? rope=None, "
    "Tensor(d!)? workspace=None, str split_kv=\"auto\") -> ()",
    _attention, _attention_fake)
attention = torch.ops.freezeframe.attention
"""The op (see :func:`_attention` for what it computes), as ``attention(q, k, v, out, ...)``."""


def check_attention_kernel(kernel: object, what: str = "attention_kernel") -> str:
    """``kernel`` if it names an attention kernel this process can run, else a ConfigError."""
    if kernel not in ATTENTION_KERNELS:
        raise ConfigError(
            f"{what}={kernel!r} is not an attention kernel; choose one of "
            f"{list(ATTENTION_KERNELS)} ('auto': triton on CUDA when installed, else torch)")
    if kernel == "triton" and not _TRITON_FOUND:
        raise ConfigError(
            f"{what}='triton' but triton is not installed; pip install triton, or use "
            "'auto' (torch's reference path where triton is missing)")
    return str(kernel)


def check_split_kv(split_kv: object, what: str = "split_kv") -> str:
    """``split_kv`` if it is one of :data:`SPLIT_KV_MODES`, else a ConfigError."""
    if split_kv not in SPLIT_KV_MODES:
        raise ConfigError(
            f"{what}={split_kv!r} is not a split-KV mode; choose one of {list(SPLIT_KV_MODES)} "
            "('auto': split a token's context when the (token, KV head) programs are few)")
    return str(split_kv)


def resolve_attention_kernel(kernel: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"``: the kernel ``kernel`` (one of :data:`ATTENTION_KERNELS`)
    means for tensors on ``device``."""
    if kernel == "auto":
        return "triton" if device.type == "cuda" and _TRITON_FOUND else "torch"
    return check_attention_kernel(kernel, "freezeframe::attention kernel")


def _num_real(seq_lens: torch.Tensor) -> int:
    # host sync; only the varlen path without host metadata calls this
    return int((seq_lens > 0).sum().item())


def _choose_path() -> AttentionHostMetadata | bool | None:
    """None: static path. Host metadata: varlen path with it. True: varlen, sync for it."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    ctx = get_forward_context()
    if ctx is None:
        return True
    if ctx.mode is CUDAGraphMode.FULL:
        return None
    if ctx.batch_descriptor is not None and ctx.batch_descriptor.uniform:
        return None
    host = ctx.extras.get(ATTN_METADATA_KEY)
    if isinstance(host, AttentionHostMetadata):
        return None if host.max_query_len <= 1 else host
    return True


def token_layout(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: its request row (clamped into range, int64) and whether it is a real token
    (bool): the op's ``token_req`` and ``token_valid``.

    Computed from the metadata alone, without assuming anything about padded request rows
    beyond ``seq_lens == 0``: a request counts only if it is real, so the tail of
    ``query_start_loc`` may hold anything.
    """
    num_tokens = slot_mapping.shape[0]
    num_rows = seq_lens.shape[0]
    real_req = seq_lens > 0  # [R]
    ends = query_start_loc[1 : num_rows + 1]  # [R]
    t = torch.arange(num_tokens, device=slot_mapping.device)  # [T]
    # request of token t = number of real requests that end at or before t
    token_req = ((ends[None, :] <= t[:, None]) & real_req[None, :]).sum(dim=1)  # [T]
    num_real_tokens = torch.where(real_req, ends, torch.zeros_like(ends)).amax()
    token_valid = (t < num_real_tokens) & (slot_mapping >= 0)
    return token_req.clamp(max=max(num_rows - 1, 0)), token_valid


def _context_slots(
    block_rows: torch.Tensor, key_pos: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Slots of ``key_pos`` ([C]) for each block-table row ``[N, max_blocks]`` -> ``[N, C]``."""
    blocks = block_rows[:, key_pos // block_size].clamp(min=0)  # [N, C]
    return blocks * block_size + key_pos % block_size


def _static_attention(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [N]
    token_req: torch.Tensor,  # [N]
    block_tables: torch.Tensor,  # [R, max_blocks]
    block_size: int,
    scale: float,
    context: int,  # keys considered per token: positions [0, context)
) -> torch.Tensor:
    """Attention of each token over positions ``<= its own`` in a fixed window; fp32 result.

    Chunked over keys with an online softmax so scratch memory stays under ``_GATHER_BUDGET``
    gathered keys per call whatever the batch. Shapes depend only on ``N`` and ``context``.
    """
    n, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    chunk = max(block_size, (_GATHER_BUDGET // max(n, 1)) // block_size * block_size)
    chunk = min(chunk, context)
    qf = q.float().reshape(n, num_kv, group, head_dim) * scale  # [N, KV, G, D]
    rows = block_tables[token_req]  # [N, max_blocks]
    run_max = torch.full((n, num_kv, group), _NEG, dtype=torch.float32, device=q.device)
    run_sum = torch.zeros((n, num_kv, group), dtype=torch.float32, device=q.device)
    acc = torch.zeros((n, num_kv, group, head_dim), dtype=torch.float32, device=q.device)
    for start in range(0, context, chunk):
        key_pos = torch.arange(start, min(start + chunk, context), device=q.device)  # [C]
        slots = _context_slots(rows, key_pos, block_size)  # [N, C]
        keys = k_cache[slots].float()  # [N, C, KV, D]
        vals = v_cache[slots].float()
        scores = torch.einsum("nkgd,nckd->nkgc", qf, keys)  # [N, KV, G, C]
        visible = key_pos[None, :] <= positions[:, None]  # [N, C]
        scores = scores.masked_fill(~visible[:, None, None, :], _NEG)
        new_max = torch.maximum(run_max, scores.amax(dim=-1))
        rescale = torch.exp(run_max - new_max)
        probs = torch.exp(scores - new_max[..., None])
        run_sum = run_sum * rescale + probs.sum(dim=-1)
        acc = acc * rescale[..., None] + torch.einsum("nkgc,nckd->nkgd", probs, vals)
        run_max = new_max
    return (acc / run_sum[..., None]).reshape(n, num_heads, head_dim)


def _varlen_attention(
    host: AttentionHostMetadata,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    positions: torch.Tensor,
    token_req: torch.Tensor,
    token_valid: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    scale: float,
) -> None:
    """Exact-length attention: SDPA per prefill request, one batched call for decode tokens."""
    out.zero_()
    num_kv = k_cache.shape[1]
    num_heads = q.shape[1]
    qsl = host.query_start_loc
    decode_tokens: list[int] = []
    decode_context = 0
    for r, seq_len in enumerate(host.seq_lens):
        start, end = qsl[r], qsl[r + 1]
        n = end - start
        if n <= 0:
            continue
        if n == 1:
            decode_tokens.append(start)
            decode_context = max(decode_context, seq_len)
            continue
        key_pos = torch.arange(seq_len, device=q.device)
        slots = _context_slots(block_tables[r : r + 1], key_pos, block_size)[0]  # [L]
        keys = k_cache[slots].to(q.dtype).transpose(0, 1)  # [KV, L, D]
        vals = v_cache[slots].to(q.dtype).transpose(0, 1)
        if num_kv != num_heads:
            keys = keys.repeat_interleave(num_heads // num_kv, dim=0)  # [H, L, D]
            vals = vals.repeat_interleave(num_heads // num_kv, dim=0)
        query = q[start:end].transpose(0, 1)  # [H, n, D]
        if n == seq_len:
            res = F.scaled_dot_product_attention(query, keys, vals, is_causal=True, scale=scale)
        else:
            # queries are the last n positions: query i sees keys 0 .. seq_len - n + i
            qpos = torch.arange(seq_len - n, seq_len, device=q.device)
            mask = key_pos[None, :] <= qpos[:, None]  # [n, L]
            res = F.scaled_dot_product_attention(query, keys, vals, attn_mask=mask, scale=scale)
        out[start:end] = res.transpose(0, 1).to(out.dtype)
    if decode_tokens:
        idx = torch.tensor(decode_tokens, dtype=torch.long).to(q.device, non_blocking=True)
        context = -(-decode_context // block_size) * block_size
        res = _static_attention(
            q[idx], k_cache, v_cache, positions[idx], token_req[idx], block_tables, block_size,
            scale, min(context, block_tables.shape[1] * block_size),
        )
        res = torch.where(token_valid[idx][:, None, None], res, 0.0)
        out.index_copy_(0, idx, res.to(out.dtype))


def split_floats(group: int, head_dim: int) -> int:
    """fp32 values one (token, KV head, split) program of the Triton kernel leaves in the
    workspace: its output rows (the group rounded up to a power of two, the head dim to one of
    at least 16), then its max and sum per row."""
    rows = 1 << max(group - 1, 0).bit_length()
    return rows * (max(16, 1 << max(head_dim - 1, 0).bit_length()) + 2)


def workspace_floats(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Size of :func:`split_workspace` in fp32 values."""
    return WORKSPACE_PROGRAMS * split_floats(num_heads // num_kv_heads, head_dim)


def split_workspace(num_heads: int, num_kv_heads: int, head_dim: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The split-KV scratch memory for a model's attention layers (the op's ``workspace``),
    allocated once: the layers run one after another, so they share it."""
    return torch.empty(workspace_floats(num_heads, num_kv_heads, head_dim),
                       dtype=torch.float32, device=device)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
