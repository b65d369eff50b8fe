"""The host side of the Triton paged-attention kernels (:mod:`.attention_kernels`): which
kernels a step launches, with what, and how cheaply.

A layer's attention is two launches (three with split-KV): :func:`write_and_attend` writes the
step's keys and values into the cache (RoPE applied on the way when the model passes its
per-token ``cos | sin`` rows), then attends over each token's own context, the loop bound read
from ``positions`` on the device (no host sync, no shape that depends on a context length: one
captured graph serves every context up to ``max_model_len``). :func:`paged_attention` attends
over a cache that already holds the step's keys (the tests' entry point).

Split-KV (flash-decoding). A decode step of a few sequences launches only (tokens x KV heads)
programs, far fewer than a GPU has SMs, each walking its whole context. ``split_kv`` (the
``KVCacheConfig`` field, passed through the attention op) decides: ``"off"`` one pass;
``"auto"`` splits when the programs are few and the block table long
(:func:`num_splits_for`); ``"on"`` always splits, in at least two. The number of splits comes
from static shapes only, so a captured graph keeps it; each token's tiles are then shared among
the splits from its real context on the device, and an empty split exits at once. The splits'
partial results go to a workspace the model allocates once (:func:`split_workspace`); it holds
:data:`WORKSPACE_PROGRAMS` programs' worth, and a step that would need more runs fewer splits
(one pass at worst: same answer).

The host path of a call (PIECEWISE graphs run it between pieces, once per layer per step) does
its checks and its argument layout once per shape: :class:`_Plan` is built on the first call of
a shape and looked up by a tuple of the shapes, strides, dtypes and alignments that decide it.
On CUDA the plan also holds each kernel's compiled launcher, bound once, so a call does not go
through Triton's argument binder again; a call allocates nothing when the model passes its
workspace. The plans are a memo of a pure function of that key (:func:`_plan_for`, bounded):
dropping it changes no result, only the next call's cost.

Running without a GPU. Triton runs CPU tensors only under its interpreter, chosen when
``triton`` *is imported* (``TRITON_INTERPRET=1`` must be set before that, which ``import
torch._dynamo`` already does); :func:`interpreter_ready` says whether this process can, and the
launch raises a clear error when it cannot. The test suite sets the variable first thing
(``tests/conftest.py``) on machines without CUDA. Interpreted, the kernels are a correctness
oracle, not a speed figure. The GPU build of each kernel is compiled and inspected on the CPU by
:mod:`freezeframe.models.kernel_build`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, NamedTuple

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from freezeframe.errors import ConfigError
from freezeframe.graphs.emulated import opaque
from freezeframe.models import attention_kernels as kernels
from freezeframe.models.attention import (
    SPLIT_KV_MODES,
    WORKSPACE_PROGRAMS,
    check_split_kv,
    split_floats,
    split_workspace,
    workspace_floats,
)

__all__ = [
    "SPLIT_KV_MODES",
    "WORKSPACE_PROGRAMS",
    "call_tensors",
    "interpreter_ready",
    "num_splits_for",
    "paged_attention",
    "plan_for",
    "split_workspace",
    "workspace_floats",
    "write_and_attend",
]

logger = logging.getLogger(__name__)


# Split-KV pays off when (tokens x KV heads) programs leave most of a GPU idle: a decode step
# of a few sequences on a long context. Below this many programs the context is split.
_SPLIT_BELOW = 128
_MAX_SPLITS = 16
_MIN_BLOCKS_PER_SPLIT = 4
_LOG2E = 1.4426950408889634
# launch options on a GPU (the interpreter ignores them): one warp group per program; two
# stages, so the next tile's keys and values load while this one's products run
_ATTEND_OPTIONS = {"num_warps": 4, "num_stages": 2}
_WRITE_OPTIONS = {"num_warps": 4, "num_stages": 1}
_COMBINE_OPTIONS = {"num_warps": 4, "num_stages": 1}


def interpreter_ready() -> bool:
    """Whether this process runs Triton kernels in the interpreter (so on CPU tensors): only
    when ``TRITON_INTERPRET=1`` was set before ``triton`` was first imported."""
    if not isinstance(kernels.attend_kernel, InterpretedFunction):
        return False
    # the language's own helpers were decorated when triton was imported
    return not isinstance(tl.zeros, JITFunction)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tile_for(block_size: int) -> int:
    """Keys per iteration of the attention loop: four cache blocks (16 to 64 keys), so a tile
    covers several blocks and is a valid ``tl.dot`` operand."""
    return min(64, max(16, _pow2(4 * block_size)))


def num_splits_for(num_tokens: int, num_kv_heads: int, max_blocks: int,
                   split_kv: str = "auto") -> int:
    """How many splits of the context each token's attention runs in, from static shapes only
    (so a captured graph keeps its choice). ``"off"``: 1. ``"auto"``: 1 when there are enough
    (token, KV head) programs or too few blocks to share, else enough splits to bring the
    programs near ``_SPLIT_BELOW``, each split worth at least ``_MIN_BLOCKS_PER_SPLIT`` blocks of
    the table. ``"on"``: the same count without the program threshold, at least 2."""
    check_split_kv(split_kv)
    if split_kv == "off":
        return 1
    work = num_tokens * num_kv_heads
    fit = min(_MAX_SPLITS, max_blocks // _MIN_BLOCKS_PER_SPLIT, _SPLIT_BELOW // max(work, 1))
    if split_kv == "on":
        return max(2, fit)
    if work >= _SPLIT_BELOW or max_blocks < 2 * _MIN_BLOCKS_PER_SPLIT:
        return 1
    return max(1, fit)


class _Key(NamedTuple):
    """What a plan depends on: every shape, stride, dtype and setting of a call, its device,
    and whether its data pointers are 16-byte aligned (a GPU build is specialised on it)."""

    q: tuple[Any, ...]
    k: tuple[Any, ...] | None  # the step's new keys and values (None: attend only)
    v: tuple[Any, ...] | None
    rope: tuple[Any, ...] | None
    k_cache: tuple[Any, ...]
    v_cache: tuple[Any, ...]
    out: tuple[Any, ...]
    block_tables: tuple[Any, ...]
    workspace: int | None  # its size in floats
    block_size: int
    scale: float
    splits: int | str  # a count, or a split-KV mode
    device: torch.device
    aligned: bool
    index_dtypes: tuple[torch.dtype | None, ...]  # positions, slot_mapping, token_req, valid


#: a call's tensors, in the order a plan's launches find them
_TENSORS = ("q", "k", "v", "rope", "out", "k_cache", "v_cache", "positions", "slot_mapping",
            "token_req", "token_valid", "block_tables", "workspace")


def _facts(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    return None if t is None else (t.shape, t.stride(), t.dtype)


def _key_of(tensors: tuple[Any, ...], block_size: int, scale: float,
            splits: int | str) -> tuple[Any, ...]:
    """A call's plan key (the fields of :class:`_Key`, as a plain tuple: cheaper to build and
    to hash on every call)."""
    (q, k, v, rope, out, k_cache, v_cache, positions, slot_mapping, token_req, token_valid,
     block_tables, workspace) = tensors
    pointers = q.data_ptr() | out.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()
    for optional in (k, v, rope, workspace):
        if optional is not None:
            pointers |= optional.data_ptr()
    return ((q.shape, q.stride(), q.dtype), _facts(k), _facts(v), _facts(rope),
            (k_cache.shape, k_cache.stride(), k_cache.dtype),
            (v_cache.shape, v_cache.stride(), v_cache.dtype),
            (out.shape, out.stride(), out.dtype),
            (block_tables.shape, block_tables.stride(), block_tables.dtype),
            None if workspace is None else workspace.numel(), block_size, scale, splits,
            q.device, pointers % 16 == 0,
            (positions.dtype, None if slot_mapping is None else slot_mapping.dtype,
             token_req.dtype, token_valid.dtype))


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     slot_mapping: torch.Tensor, token_req: torch.Tensor,
                     token_valid: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                     scale: float, *, rope: torch.Tensor | None = None,
                     workspace: torch.Tensor | None = None, split_kv: str = "auto") -> None:
    """Write this step's keys and values (``k``, ``v``: ``[T, KV, D]``, any token and head
    strides) into the cache at ``slot_mapping`` (the sink slot for a padded token), then attend
    each token over keys ``0 .. positions[t]`` of its request into ``out``. With ``rope``
    (``[T, D]`` fp32, ``cos | sin`` per token) ``q`` and ``k`` are rotated first. Index tensors
    int64, ``token_valid`` bool (:func:`~freezeframe.models.attention.token_layout`)."""
    if q.shape[0] == 0:
        return
    tensors = (q, k, v, rope, out, k_cache, v_cache, positions, slot_mapping, token_req,
               token_valid, block_tables, workspace)
    _run(_plan_for(_key_of(tensors, block_size, scale, split_kv)), tensors)


def plan_for(tensors: dict[str, Any], block_size: int, scale: float,
             splits: int | str) -> _Plan:
    """The plan of a call with these tensors (named as :func:`write_and_attend`'s arguments;
    without ``k``, ``v`` and ``slot_mapping`` the plan only attends) and ``splits`` (a count
    or a split-KV mode), built on the first call of its shapes."""
    return _plan_for(_key_of(call_tensors(tensors), block_size, scale, splits))


def call_tensors(tensors: dict[str, Any]) -> tuple[Any, ...]:
    """A call's tensors by name as the tuple a plan's launches read (None where absent)."""
    return tuple(tensors.get(name) for name in _TENSORS)


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
    *,
    split_kv: str = "auto",
    workspace: torch.Tensor | None = None,
) -> None:
    """Attention of each token over keys at positions ``<= positions[t]`` of its request,
    written into ``out``; the cache must already hold this step's keys and values.
    ``num_splits``: split each token's context in that many parts run in parallel and combined
    (flash-decoding); None chooses from the shapes and ``split_kv``."""
    if q.shape[0] == 0:
        return
    if num_splits is not None and (isinstance(num_splits, bool)
                                   or not isinstance(num_splits, int) or num_splits < 1):
        raise ConfigError(f"paged_attention: num_splits={num_splits!r} must be an int >= 1 "
                          "or None (chosen from the shapes)")
    tensors = (q, None, None, None, out, k_cache, v_cache, positions, None, token_req,
               token_valid.to(torch.bool), block_tables, workspace)
    splits = split_kv if num_splits is None else num_splits
    _run(_plan_for(_key_of(tensors, block_size, scale, splits)), tensors)


class _Bound(NamedTuple):
    """A kernel compiled for one plan, with its own launcher (see :func:`_bind`), and what a
    launch reads: the current stream's getter and Triton's run-time settings (its launch
    hooks, which profilers set)."""

    compiled: Any
    device_index: int | None
    current_stream: Any
    runtime: Any


@dataclasses.dataclass(frozen=True)
class _Launch:
    """One kernel launch of a plan: its kernel and grid, its runtime arguments (``fixed``, with
    None where a call's tensor goes: ``slots`` maps those argument indices to the call's tensor
    names), compile-time constants and launch options, and on CUDA its bound launcher."""

    kernel: Any
    grid: tuple[int, int, int]
    fixed: tuple[Any, ...]
    slots: tuple[tuple[int, int], ...]  # (argument index, index in a call's tensors)
    constants: dict[str, Any]
    options: dict[str, int]
    bound: _Bound | None

    def arguments(self, tensors: tuple[Any, ...]) -> list[Any]:
        """The runtime arguments for a call's ``tensors`` (in :data:`_TENSORS` order)."""
        args = list(self.fixed)
        for index, at in self.slots:
            args[index] = tensors[at]
        return args

    def __call__(self, tensors: tuple[Any, ...]) -> None:
        args = self.arguments(tensors)
        if self.bound is None:
            self.kernel[self.grid](*args, **self.constants, **self.options)
            return
        for hook in getattr(self.kernel, "pre_run_hooks", ()):  # as kernel[grid] runs them
            hook(*args, **self.constants)
        compiled, runtime = self.bound.compiled, self.bound.runtime
        stream = self.bound.current_stream(self.bound.device_index)
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        every = (*args, *self.constants.values())  # the kernel's parameters, in order
        meta = compiled.launch_metadata(self.grid, stream, *every) if enter is not None else None
        compiled.run(*self.grid, stream, compiled.function, compiled.packed_metadata, meta,
                     enter, leave, *every)


def _make_launch(kernel: Any, grid: tuple[int, ...], named: list[tuple[str, Any]],
                 constants: dict[str, Any], options: dict[str, int], key: _Key) -> _Launch:
    """A :class:`_Launch` from the kernel's runtime arguments in order: ``("name", dtype)``
    for a call's tensor, ``("", value)`` for a value fixed by the plan."""
    params = list(kernel.arg_names)
    if params[len(named):] != list(constants):  # constants follow the runtime arguments
        raise AssertionError(f"{kernel.__name__}: constants {list(constants)} out of order")
    fixed = tuple(None if name else value for name, value in named)
    slots = tuple((i, _TENSORS.index(name)) for i, (name, _) in enumerate(named) if name)
    grid3: Any = (*grid, 1, 1)[:3]
    launch = _Launch(kernel, grid3, fixed, slots, constants, options, None)
    if key.device.type != "cuda" or not key.aligned:
        return launch
    stand_ins = [value for _, value in named]  # a torch dtype stands in for a tensor
    return dataclasses.replace(launch, bound=_bind(launch, stand_ins, key.device))


def _bind(launch: _Launch, stand_ins: list[Any], device: torch.device) -> _Bound | None:
    """``launch``'s kernel compiled for ``device`` the way Triton's JIT compiles it for
    16-byte-aligned tensors of the plan's dtypes, with its launcher: a call then skips Triton's
    argument binder and cache lookup. A Triton whose run-time API differs is logged and
    launched through ``kernel[grid]``."""
    try:
        from triton import knobs
        from triton.runtime import driver

        compiled = launch.kernel.warmup(*stand_ins, grid=launch.grid, **launch.constants,
                                        **launch.options)
        if hasattr(compiled, "result"):  # a compile still running in the background
            compiled = compiled.result()
        compiled.run  # noqa: B018 - loads the module on the device and sets its handles
    except (AttributeError, TypeError, ImportError) as exc:
        logger.warning("the Triton launcher of %s could not be bound (%s: %s); it launches "
                       "through kernel[grid]", launch.kernel.__name__, type(exc).__name__, exc)
        return None
    return _Bound(compiled, device.index, driver.active.get_current_stream, knobs.runtime)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything a call of one shape launches: the cache write (None: attend only), the
    attention, the combine (None: one pass), the split count, and the workspace size a call
    without one allocates (0: none needed)."""

    write: _Launch | None
    attend: _Launch
    combine: _Launch | None
    splits: int
    scratch_floats: int
    device: torch.device


@dataclasses.dataclass(frozen=True)
class _Dims:
    """A plan's sizes: tokens, heads, KV heads, head dim, group, block size, splits, tile, and
    whether both products take fp32 operands."""

    tokens: int
    heads: int
    kv: int
    head_dim: int
    group: int
    block_size: int
    splits: int
    tile: int
    f32_dot: bool


@functools.lru_cache(maxsize=256)
def _plan_for(fields: tuple[Any, ...]) -> _Plan:
    """The plan of a call whose key has these ``fields``: every check made and every argument
    laid out once."""
    key = _Key(*fields)
    _check(key)
    num_tokens, num_heads, head_dim = key.q[0]
    num_kv = key.k_cache[0][1]
    group = num_heads // num_kv
    per_program = split_floats(group, head_dim) * num_tokens * num_kv
    splits = (key.splits if isinstance(key.splits, int) else
              num_splits_for(num_tokens, num_kv, key.block_tables[0][1], key.splits))
    if key.workspace is not None:  # as many splits as the model's workspace holds
        splits = max(1, min(splits, key.workspace // per_program))
    dims = _Dims(num_tokens, num_heads, num_kv, head_dim, group, key.block_size, splits,
                 tile_for(key.block_size),
                 key.device.type == "cpu" or key.v_cache[2] == torch.float32)
    write = None if key.k is None else _write_launch(key, dims)
    attend = _attend_launch(key, dims)
    combine = _combine_launch(key, dims) if splits > 1 else None
    scratch = per_program * splits if splits > 1 and key.workspace is None else 0
    return _Plan(write, attend, combine, splits, scratch, key.device)


def _check(key: _Key) -> None:
    """The checks a call's shape needs, made once per shape."""
    if key.device.type == "cpu" and not interpreter_ready():
        raise ConfigError(
            "attention_kernel='triton': the Triton attention kernel got CPU tensors, which "
            "Triton runs only in its interpreter, and the interpreter was off when triton was "
            "imported; set TRITON_INTERPRET=1 in the environment before anything imports triton "
            "(torch._dynamo does), or use attention_kernel='torch' on CPU")
    facts = (key.q, key.k_cache, key.v_cache, key.out, key.k, key.v)
    if any(f is not None and f[1][-1] != 1 for f in facts):
        raise ValueError("paged_attention needs q, k, v, k_cache, v_cache and out contiguous in "
                         "their last (head_dim) dimension")
    if isinstance(key.splits, str):
        check_split_kv(key.splits, "freezeframe::attention split_kv")
    wanted = (torch.int64, torch.int64, torch.int64, torch.bool)
    given = (*key.index_dtypes, key.block_tables[2])
    if any(dtype not in (want, None) for dtype, want in zip(given, (*wanted, torch.int64),
                                                            strict=True)):
        raise ValueError(
            "paged_attention: positions, slot_mapping, token_req and block_tables must be int64 "
            f"and token_valid bool (as token_layout makes them), got {given}")


_INDEX = torch.int64


def _write_launch(key: _Key, dims: _Dims) -> _Launch:
    assert key.k is not None and key.v is not None
    (_, q_stride, q_type), (_, k_stride, k_type), (_, v_stride, v_type) = key.q, key.k, key.v
    o_stride, c_stride, d_stride = key.out[1], key.k_cache[1], key.v_cache[1]
    rope = ("rope", key.rope[2]) if key.rope is not None else ("k", k_type)  # unread without
    named = [("q", q_type), ("k", k_type), ("v", v_type), rope, ("out", key.out[2]),
             ("k_cache", key.k_cache[2]), ("v_cache", key.v_cache[2]), ("slot_mapping", _INDEX),
             ("token_valid", torch.bool),
             *[("", s) for s in (q_stride[0], q_stride[1], k_stride[0], k_stride[1],
                                 v_stride[0], v_stride[1],
                                 key.rope[1][0] if key.rope is not None else 0,
                                 o_stride[0], o_stride[1], c_stride[0], c_stride[1],
                                 d_stride[0], d_stride[1], key.k_cache[0][0] - 1)]]
    constants = dict(NUM_HEADS=dims.heads, NUM_KV=dims.kv, HEAD_DIM=dims.head_dim,
                     HEADS_P2=_pow2(dims.heads), KV_P2=_pow2(dims.kv),
                     DIM_P2=_pow2(dims.head_dim), ROPE=key.rope is not None)
    return _make_launch(kernels.write_kernel, (dims.tokens,), named, constants, _WRITE_OPTIONS,
                        key)


def _attend_launch(key: _Key, dims: _Dims) -> _Launch:
    # with RoPE the write kernel left the rotated queries in ``out``
    q_name, q_facts = ("out", key.out) if key.rope is not None else ("q", key.q)
    q_stride, o_stride = q_facts[1], key.out[1]
    c_stride, d_stride = key.k_cache[1], key.v_cache[1]
    ws = ("workspace", torch.float32) if dims.splits > 1 else ("out", key.out[2])  # unread
    named = [(q_name, q_facts[2]), ("k_cache", key.k_cache[2]), ("v_cache", key.v_cache[2]),
             ("out", key.out[2]), ws, ("positions", _INDEX), ("token_req", _INDEX),
             ("token_valid", torch.bool), ("block_tables", _INDEX),
             *[("", s) for s in (q_stride[0], q_stride[1], c_stride[0], c_stride[1],
                                 d_stride[0], d_stride[1], o_stride[0], o_stride[1],
                                 key.block_tables[1][0])],
             ("", key.scale * _LOG2E)]
    constants = dict(GROUP=dims.group, HEAD_DIM=dims.head_dim, BLOCK_SIZE=dims.block_size,
                     ROWS=max(16, _pow2(dims.group)), DIM_P2=max(16, _pow2(dims.head_dim)),
                     TILE=dims.tile, NUM_SPLITS=dims.splits, WS_ROWS=_pow2(dims.group),
                     F32_DOT=dims.f32_dot)
    return _make_launch(kernels.attend_kernel, (dims.tokens, dims.kv, dims.splits), named,
                        constants, _ATTEND_OPTIONS, key)


def _combine_launch(key: _Key, dims: _Dims) -> _Launch:
    o_stride = key.out[1]
    named = [("workspace", torch.float32), ("out", key.out[2]), ("positions", _INDEX),
             ("token_valid", torch.bool), ("", o_stride[0]), ("", o_stride[1])]
    constants = dict(GROUP=dims.group, HEAD_DIM=dims.head_dim,
                     DIM_P2=max(16, _pow2(dims.head_dim)), WS_ROWS=_pow2(dims.group),
                     TILE=dims.tile, NUM_SPLITS=dims.splits)
    return _make_launch(kernels.combine_kernel, (dims.tokens, dims.kv), named, constants,
                        _COMBINE_OPTIONS, key)


@opaque  # the emulated graph backend records the launches as one step (they write raw memory)
def _launch_all(plan: _Plan, tensors: tuple[Any, ...]) -> None:
    for launch in (plan.write, plan.attend, plan.combine):
        if launch is not None:
            launch(tensors)


def _run(plan: _Plan, tensors: tuple[Any, ...]) -> None:
    if plan.scratch_floats:  # a direct caller without the model's workspace: its own
        tensors = (*tensors[:-1], torch.empty(plan.scratch_floats, dtype=torch.float32,
                                              device=plan.device))
    _launch_all(plan, tensors)
