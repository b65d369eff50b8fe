"""A CPU proxy for the launches of one FULL decode step of the reference Llama (issue 44: at
most 12 per layer).

One decode step of the compiled model (eager compiler, split at the attention op; no graph, so
each launch is seen as it is made: exactly what a FULL graph captures, without the emulated
replay's copies of its own) runs under a dispatch mode that counts, between the splitting ops,
every aten op that would launch a GPU kernel and, inside each op, its aten and Triton launches
(the Triton kernels run in the interpreter here). Inductor's kernels for the per-layer piece
(from one layer's attention output to the next layer's QKV projection) are read from the code
Inductor generates for it, without compiling that code. The layer's budget, Inductor's kernels
plus the op's launches, fails the test when exceeded; the exact counts make any change show.

The proxy's limits: Inductor's CPU code fuses a little more than its GPU code (it put q's and
k's RoPE and v's copy in one loop, before the op took them), matrix products count one launch
each (cuBLAS may use two), and the emulated graphs are not used (their replay copies outputs).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import freezeframe as ff
from freezeframe.models import ATTENTION_OP, KVCacheConfig, LlamaModel, build_llama
from freezeframe.models.inputs import RequestChunk, build_step

pytest.importorskip("triton")
from freezeframe.models import attention_kernels
from freezeframe.models.attention import _attention
from freezeframe.models.paged_attention_triton import interpreter_ready
from tests.helpers.launches import LaunchCensus, inductor_kernels

if not torch.cuda.is_available() and not interpreter_ready():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

#: issue 44's target for a FULL decode replay
BUDGET_PER_LAYER = 12
CACHE = KVCacheConfig(num_blocks=16, block_size=4, max_model_len=32, attention_kernel="triton")
KERNELS = (attention_kernels.write_kernel, attention_kernels.attend_kernel,
           attention_kernels.combine_kernel)


@pytest.fixture(scope="module")
def decode() -> tuple[Any, LaunchCensus]:
    """The compiled two-layer tiny Llama and the census of its second decode step (two
    requests at contexts 6 and 10; the first step traced and compiled it)."""
    model = build_llama("tiny", CACHE, seed=0)
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", splitting_ops=[ATTENTION_OP],
                               cudagraph_mode="none", use_cache=False)
    compiled = ff.compile(model, cfg, dynamic_arg_dims=dict(
        LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
    step = build_step([RequestChunk((7,), 5, (0, 1)), RequestChunk((4,), 9, (2, 3, 4))], CACHE)
    census = LaunchCensus(torch.ops.freezeframe.attention.default, _attention, KERNELS)
    with torch.no_grad():
        compiled(*step.args)
        with census:
            compiled(*step.args)
    return compiled, census


def test_each_attention_op_launches_its_three_kernels_and_nothing_else(
        decode: tuple[Any, LaunchCensus]) -> None:
    """Two layers, two op calls: the fused RoPE + cache write, the split pass and the combine
    (two tokens x two KV heads are few programs, so split-KV is on); no aten launch: no
    ``where``, no ``index_copy_``, no cast, no allocation of a workspace's kernels."""
    _, census = decode
    assert census.op_aten == [Counter(), Counter()]
    three = Counter({"triton:write_kernel": 1, "triton:attend_kernel": 1,
                     "triton:combine_kernel": 1})
    assert census.op_triton == [three, three]


def test_the_eager_pieces_launch_what_inductor_fuses(decode: tuple[Any, LaunchCensus]) -> None:
    """Outside the ops, eagerly: the per-layer piece runs its projections, norms, residual adds
    and SiLU-mul as 20 aten launches; no RoPE, no copy of v (the op has them)."""
    _, census = decode
    middle = census.pieces[1]
    assert sum(middle.values()) == 20
    assert middle["aten.linear"] == 4 and middle["aten.silu"] == 1
    assert not {"aten.cat", "aten.clone", "aten.index_copy", "aten.where"} & set(middle)


def test_a_decode_layer_fits_the_launch_budget(decode: tuple[Any, LaunchCensus]) -> None:
    """Inductor's kernels for the per-layer piece plus the op's launches: 7 + 3 = 10 <= 12
    (the o-projection with the residual add, the post-attention norm, gate-up, SiLU-mul, the
    down projection with the residual add, the next layer's input norm, its QKV projection)."""
    compiled, census = decode
    middle = [piece for piece in compiled.pieces if piece.capturable][1]
    kernels = inductor_kernels(middle.graph)
    gemms = [k for k in kernels if k.startswith("extern_kernels.")]
    assert len(gemms) == 4 and len(kernels) == 7, kernels
    per_layer = len(kernels) + census.op_launches(0)
    assert per_layer == 10
    assert per_layer <= BUDGET_PER_LAYER
