"""The Triton attention path's launchers, bound once per shape on CUDA (needs a GPU).

A plan of ``freezeframe.models.paged_attention_triton`` compiles each of its kernels once and
keeps the compiled kernel's own launcher, so a call skips Triton's argument binder; here a call
through the bound launchers must write exactly what a call through ``kernel[grid]`` writes, and
a step captured in a CUDA graph and replayed must give the eager step's answer.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.cuda

HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 64, 16


def _step(gen: torch.Generator) -> tuple[Any, ...]:
    """The op's arguments for a decode of three requests (contexts 200, 17 and 1) on a bf16
    cache, q/k/v as unrotated views of one projection, with RoPE rows and split-KV on."""
    from freezeframe.models.attention import split_workspace
    from freezeframe.models.rope import rope_table

    device = torch.device("cuda")
    lengths = [200, 17, 1]
    blocks = torch.randperm(64, generator=gen)
    table = torch.zeros(3, 16, dtype=torch.long)
    positions, slots, used = [], [], 0
    for r, length in enumerate(lengths):
        need = -(-length // BLOCK)
        table[r, :need] = blocks[used:used + need]
        used += need
        p = length - 1
        positions.append(p)
        slots.append(int(table[r, p // BLOCK]) * BLOCK + p % BLOCK)
    qkv = torch.randn(3, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(device, torch.bfloat16)
    q = qkv[:, : HEADS * DIM].view(3, HEADS, DIM)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(3, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(3, KV_HEADS, DIM)
    cache = torch.randn(2, 64 * BLOCK + 1, KV_HEADS, DIM, generator=gen).to(device,
                                                                            torch.bfloat16)
    pos = torch.tensor(positions, device=device)
    return (q, k, v, torch.empty(3, HEADS, DIM, device=device, dtype=torch.bfloat16),
            cache[0].clone(), cache[1].clone(), pos, torch.tensor(slots, device=device),
            torch.tensor([0, 1, 2, 3], device=device), torch.tensor(lengths, device=device),
            table.to(device), BLOCK, 1 / math.sqrt(DIM), "triton", None, None,
            rope_table(DIM, 5e5, 256, device)[pos],
            split_workspace(HEADS, KV_HEADS, DIM, device), "on")


def _run(args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    fresh = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    torch.ops.freezeframe.attention(*fresh)
    torch.cuda.synchronize()
    return fresh[3], fresh[4], fresh[5]


def test_the_bound_launcher_gives_the_jit_launch_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    from freezeframe.models import paged_attention_triton as host

    args = _step(torch.Generator().manual_seed(21))
    bound_calls = []
    real_bind = host._bind

    def counting_bind(*bind_args: Any) -> Any:
        bound = real_bind(*bind_args)
        bound_calls.append(bound is not None)
        return bound

    host._plan_for.cache_clear()
    monkeypatch.setattr(host, "_bind", counting_bind)
    bound = _run(args)
    assert bound_calls == [True, True, True]  # write, split pass, combine
    again = _run(args)  # the plan, reused
    assert bound_calls == [True, True, True]
    host._plan_for.cache_clear()
    monkeypatch.setattr(host, "_bind", lambda *bind_args: None)
    jit = _run(args)
    host._plan_for.cache_clear()
    for a, b, c in zip(bound, again, jit, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert not bound[0].isnan().any()


def test_a_captured_attention_step_replays_the_eager_answer() -> None:
    """The bound launchers launch on the current stream: captured in a CUDA graph, the step
    writes on replay what it writes eagerly."""
    args = _step(torch.Generator().manual_seed(22))
    eager = _run(args)
    fresh = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    torch.ops.freezeframe.attention(*fresh)  # warm: the plan built outside the capture
    for target, source in zip(fresh[3:6], args[3:6], strict=True):
        target.copy_(source)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        torch.ops.freezeframe.attention(*fresh)
    torch.cuda.current_stream().wait_stream(stream)
    for target, source in zip(fresh[3:6], args[3:6], strict=True):
        target.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(fresh[3:6], eager, strict=True):
        assert torch.equal(got, want)
