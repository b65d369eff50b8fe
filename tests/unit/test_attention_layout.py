"""The attention op's token layout, computed once per forward by the model and passed to every
layer's op: the same answer as the op computing it itself, and none of its work left in the op
(under PIECEWISE graphs the op runs eagerly between pieces, once per layer per step)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import freezeframe as ff
from freezeframe.models import attention as attention_module
from freezeframe.models.attention import token_layout

BLOCK, HEAD_DIM, HEADS, KV_HEADS = 4, 8, 4, 2


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def step_args() -> tuple[Any, ...]:
    """Two requests (a prefill of 3 tokens, a decode at position 5), one padded token and one
    padded request row; blocks 2, 0 (request 0) and 3, 1 (request 1)."""
    g = torch.Generator().manual_seed(0)
    num_slots = 5 * BLOCK + 1
    q = torch.randn(5, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(5, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(5, KV_HEADS, HEAD_DIM, generator=g)
    k_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=g)
    v_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=g)
    positions = torch.tensor([0, 1, 2, 5, 0])
    slot_mapping = torch.tensor([8, 9, 10, 13, -1])
    query_start_loc = torch.tensor([0, 3, 4, 4])
    seq_lens = torch.tensor([3, 6, 0])
    block_tables = torch.tensor([[2, 0], [3, 1], [0, 0]])
    return (q, k, v, torch.zeros_like(q), k_cache, v_cache, positions, slot_mapping,
            query_start_loc, seq_lens, block_tables, BLOCK, 1 / math.sqrt(HEAD_DIM), "torch")


def call(args: tuple[Any, ...], *, layout: bool, full: bool,
         ops: CountOps | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's implementation on copies of ``args`` (the FULL graph's static path, or the
    varlen path), given the layout or not: ``(out, k_cache, v_cache)``."""
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    extra = token_layout(args[8], args[9], args[7]) if layout else ()
    mode = ff.CUDAGraphMode.FULL if full else ff.CUDAGraphMode.PIECEWISE
    with ff.forward_context(ff.BatchDescriptor(num_tokens=5), mode=mode):
        if ops is None:
            attention_module._attention(*args, *extra)
        else:
            with ops:
                attention_module._attention(*args, *extra)
    return args[3], args[4], args[5]


def test_the_token_layout_of_a_mixed_padded_step() -> None:
    args = step_args()
    token_req, token_valid = token_layout(args[8], args[9], args[7])
    assert token_req.tolist() == [0, 0, 0, 1, 2]  # past the real requests: a padding row
    assert token_valid.tolist() == [True, True, True, True, False]
    assert (token_req.dtype, token_valid.dtype) == (torch.int64, torch.bool)


@pytest.mark.parametrize("full", [True, False], ids=["static", "varlen"])
def test_a_given_layout_gives_the_same_answer_and_cache(full: bool) -> None:
    args = step_args()
    given = call(args, layout=True, full=full)
    computed = call(args, layout=False, full=full)
    for a, b in zip(given, computed, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(given[0][4], torch.zeros(HEADS, HEAD_DIM))  # the padded token
    assert not torch.equal(given[1], args[4])  # the step's keys were written


@pytest.mark.parametrize("full", [True, False], ids=["static", "varlen"])
def test_a_given_layout_leaves_none_of_its_work_in_the_op(full: bool) -> None:
    """The op given the layout runs exactly the ops of the op computing it, minus the
    layout's own ops."""
    args = step_args()
    with_layout, without, layout_alone = CountOps(), CountOps(), CountOps()
    call(args, layout=True, full=full, ops=with_layout)
    call(args, layout=False, full=full, ops=without)
    with layout_alone:
        token_layout(args[8], args[9], args[7])
    assert sum(layout_alone.ops.values()) >= 8  # what every layer's op used to run
    assert without.ops == with_layout.ops + layout_alone.ops


def test_a_layout_of_another_step_is_refused() -> None:
    args = step_args()
    token_req, token_valid = token_layout(args[8], args[9], args[7])
    with pytest.raises(ValueError, match=r"token_layout\(\.\.\.\) of this step"):
        attention_module._attention(*args, token_req[:3], token_valid[:3])
    with pytest.raises(ValueError, match="token_valid bool"):
        attention_module._attention(*args, token_req, token_valid.long())
    with pytest.raises(ValueError, match="token_req int64"):
        attention_module._attention(*args, token_req.float(), token_valid)
    with pytest.raises(ValueError, match="on cpu"):
        attention_module._attention(*args, token_req.to("meta"), token_valid)


@pytest.mark.parametrize("full", [True, False], ids=["static", "varlen"])
def test_a_strided_layout_gives_the_same_answer(full: bool) -> None:
    """A layout passed as views of one [T, 2] tensor (stride 2): the op reads it as the values
    it holds, as the contiguous one (the Triton kernel reads flat arrays)."""
    args = step_args()
    token_req, token_valid = token_layout(args[8], args[9], args[7])
    both = torch.stack([token_req, token_req], dim=1)
    flags = torch.stack([token_valid, token_valid], dim=1)
    strided = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    mode = ff.CUDAGraphMode.FULL if full else ff.CUDAGraphMode.PIECEWISE
    with ff.forward_context(ff.BatchDescriptor(num_tokens=5), mode=mode):
        attention_module._attention(*strided, both[:, 0], flags[:, 0])
    want = call(args, layout=True, full=full)
    assert torch.equal(strided[3], want[0]) and torch.equal(strided[4], want[1])
