"""The Triton paged-attention kernels against the pure-torch reference and a float64 oracle.

On a machine without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported), on CPU tensors; with CUDA they run compiled
on the GPU. Every case is a whole ``freezeframe::attention`` call (the cache write included) on
a cache whose blocks are handed out in shuffled order, with context lengths of 1, exactly a
block, one past a 16-key tile and the whole table, GQA/MQA/MHA head layouts (groups of 4, 2, 3
and 1), 32- and 16-bit dtypes, one pass and split-KV, decode-only and mixed prefill + decode
batches, RoPE applied by the op, and padded tokens and request rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import freezeframe as ff
from freezeframe.errors import ConfigError
from freezeframe.models import ATTENTION_OP, KVCacheConfig, LlamaModel, build_llama
from freezeframe.models import attention as attention_module
from freezeframe.models.attention import resolve_attention_kernel, split_workspace
from freezeframe.models.rope import apply_rope, rope_table
from freezeframe.models.serving import Request, RunnerForward, ServingDriver, llama_runner_inputs
from freezeframe.runtime.runner import GraphRunner

triton = pytest.importorskip("triton", reason="the Triton kernel needs triton (pip install "
                                              "triton); CI installs it with the test extra")
from freezeframe.models import attention_kernels  # noqa: E402
from freezeframe.models.paged_attention_triton import interpreter_ready  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not interpreter_ready():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (run the tests through "
                "pytest from the repository, whose conftest sets it)", allow_module_level=True)

BLOCK = 4  # a 16-key tile of the attention loop is four blocks
NUM_BLOCKS = 40
MAX_BLOCKS = 12  # positions 0 .. 47: three tiles
HEAD_DIM = 16
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
KERNELS = (attention_kernels.write_kernel, attention_kernels.attend_kernel,
           attention_kernels.combine_kernel)


@dataclasses.dataclass
class Batch:
    """One step's op arguments; ``cached[r]`` positions of request r are in the cache already."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_real_tokens: int


def make_batch(gen: torch.Generator, heads: int, kv_heads: int, dtype: torch.dtype,
               seq_lens: list[int], new_tokens: list[int], *, pad_tokens: int = 0,
               pad_reqs: int = 0) -> Batch:
    """Requests with ``seq_lens`` positions after this step, the last ``new_tokens`` of which
    are this step's tokens; their blocks are drawn from a random permutation of the cache's."""
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    table = torch.zeros(len(seq_lens) + pad_reqs, MAX_BLOCKS, dtype=torch.long)
    positions, slots, qsl = [], [], [0]
    used = 0
    for r, (length, new) in enumerate(zip(seq_lens, new_tokens, strict=True)):
        need = -(-length // BLOCK)  # the rest of the row stays 0, as the cache contract says
        blocks = perm[used:used + need]
        used += need
        table[r, :need] = blocks
        for p in range(length - new, length):
            positions.append(p)
            slots.append(int(blocks[p // BLOCK]) * BLOCK + p % BLOCK)
        qsl.append(len(positions))
    real = len(positions)
    positions += [0] * pad_tokens
    slots += [-1] * pad_tokens
    qsl += [real] * pad_reqs
    n = real + pad_tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    num_slots = NUM_BLOCKS * BLOCK + 1
    return Batch(
        q=randn(n, heads, HEAD_DIM), k=randn(n, kv_heads, HEAD_DIM),
        v=randn(n, kv_heads, HEAD_DIM),
        k_cache=randn(num_slots, kv_heads, HEAD_DIM), v_cache=randn(num_slots, kv_heads, HEAD_DIM),
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor(seq_lens + [0] * pad_reqs),
        block_tables=table, num_real_tokens=real,
    )


def rope_rows(batch: Batch) -> torch.Tensor:
    """Per-token RoPE rows ``[T, HEAD_DIM]`` for the batch's positions (a short base, so the
    rotation is far from the identity at these positions)."""
    return rope_table(HEAD_DIM, 50.0, MAX_BLOCKS * BLOCK)[batch.positions]


def run_op(batch: Batch, kernel: str, *, static: bool = False, split_kv: str = "auto",
           rope: bool = False, workspace: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op on ``DEVICE`` with fresh copies of the cache: ``(out, k_cache, v_cache)``."""
    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.clone().to(DEVICE)

    k_cache, v_cache = dev(batch.k_cache), dev(batch.v_cache)
    out = torch.full_like(dev(batch.q), float("nan"))
    args = (dev(batch.q), dev(batch.k), dev(batch.v), out, k_cache, v_cache,
            dev(batch.positions), dev(batch.slot_mapping), dev(batch.query_start_loc),
            dev(batch.seq_lens), dev(batch.block_tables), BLOCK, 1 / math.sqrt(HEAD_DIM), kernel,
            None, None, dev(rope_rows(batch)) if rope else None, workspace, split_kv)
    if static:  # the capturable pure-torch path (the one a FULL graph holds)
        desc = ff.BatchDescriptor(num_tokens=batch.q.shape[0])
        with ff.forward_context(desc, mode=ff.CUDAGraphMode.FULL):
            torch.ops.freezeframe.attention(*args)
    else:
        torch.ops.freezeframe.attention(*args)
    return out.cpu(), k_cache.cpu(), v_cache.cpu()


def oracle(batch: Batch, k_cache: torch.Tensor, v_cache: torch.Tensor,
           q: torch.Tensor | None = None) -> torch.Tensor:
    """float64 attention of each real token over keys 0..position, read slot by slot."""
    q = batch.q.double() if q is None else q
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    qsl = batch.query_start_loc.tolist()
    for t in range(batch.num_real_tokens):
        r = max(i for i in range(len(qsl) - 1) if qsl[i] <= t < qsl[i + 1])
        pos = int(batch.positions[t])
        slots = [int(batch.block_tables[r, p // BLOCK]) * BLOCK + p % BLOCK
                 for p in range(pos + 1)]
        keys = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        vals = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t], keys) / math.sqrt(HEAD_DIM)
        out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), vals)
    return out


@contextmanager
def counted_launches() -> Iterator[Counter[str]]:
    """Triton launches per kernel name while inside (Triton's own pre-run hook)."""
    counts: Counter[str] = Counter()
    hooks = []
    for kernel in KERNELS:
        def hook(*args: Any, name: str = kernel.__name__, **kwargs: Any) -> None:
            counts[name] += 1
        kernel.add_pre_run_hook(hook)
        hooks.append((kernel, hook))
    try:
        yield counts
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


HEAD_LAYOUTS = [(4, 1), (4, 2), (6, 2), (2, 2)]  # MQA, GQA, GQA with a group of 3, MHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("heads", "kv_heads"), HEAD_LAYOUTS)
def test_decode_batches_match_the_reference(dtype: torch.dtype, heads: int,
                                            kv_heads: int) -> None:
    """Every variant of the kernel (one pass and split-KV, each group size, each dtype)
    against the torch reference and the float64 oracle."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    # the whole table, contexts of 1, exactly a block, one past a block and one past a tile
    lengths = [MAX_BLOCKS * BLOCK, 1, BLOCK, BLOCK + 1, 17]
    tol = TOL[dtype]
    # one token ("auto": three splits, as few programs run), then the batch in one pass and
    # in three splits (a tile each at most)
    for bs, modes in ((1, ("auto",)), (len(lengths), ("off", "on"))):
        batch = make_batch(gen, heads, kv_heads, dtype, lengths[:bs], [1] * bs)
        want, want_k, want_v = run_op(batch, "torch", static=True)
        for split_kv in modes:
            got, k_cache, v_cache = run_op(batch, "triton", split_kv=split_kv)
            assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            torch.testing.assert_close(got.double(), oracle(batch, k_cache, v_cache), atol=tol,
                                       rtol=tol)


@pytest.mark.parametrize(("dtype", "split_kv"), [(torch.float32, "off"),
                                                 (torch.bfloat16, "on")], ids=["fp32", "bf16"])
def test_mixed_prefill_and_decode_batch_with_padding(dtype: torch.dtype, split_kv: str) -> None:
    gen = torch.Generator().manual_seed(7)
    # a whole prompt, a chunk after 5 cached tokens, two decodes; 3 padded tokens, 2 padded rows
    batch = make_batch(gen, 4, 2, dtype, seq_lens=[4, 9, 1, 40], new_tokens=[4, 4, 1, 1],
                       pad_tokens=3, pad_reqs=2)
    real = batch.num_real_tokens
    # one pass (fp32) or split (bf16)
    got, k_cache, v_cache = run_op(batch, "triton", split_kv=split_kv)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))  # padded tokens: zeros
    for static in (False, True):  # the varlen path (host sync) and the static one
        want, want_k, want_v = run_op(batch, "torch", static=static)
        # all but the sink slot, which the 3 padded tokens write at once: on CUDA which
        # write lands there is not determined, and nothing reads it
        assert torch.equal(k_cache[:-1], want_k[:-1]) and torch.equal(v_cache[:-1],
                                                                      want_v[:-1])
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got[:real].double(), oracle(batch, k_cache, v_cache)[:real],
                               atol=TOL[dtype], rtol=TOL[dtype])
    # the padded tokens wrote only the sink slot; every other slot is the old cache or this
    # step's keys
    written = batch.slot_mapping[:real]
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[written] = False
    untouched[-1] = False
    assert torch.equal(k_cache[untouched], batch.k_cache[untouched])
    assert torch.equal(k_cache[written], batch.k[:real])


@pytest.mark.parametrize(("splits", "heads", "kv_heads"), [(2, 6, 2), (3, 4, 1), (6, 6, 2)])
def test_split_kv_shares_each_context_by_its_own_length(splits: int, heads: int,
                                                        kv_heads: int) -> None:
    """Split-KV (flash-decoding: each token's tiles shared among ``splits`` programs, combined
    by a second kernel) against the one-pass kernel and the float64 oracle; the workspace,
    poisoned first, shows which splits ran: exactly ``cdiv(tiles, cdiv(tiles, splits))`` of a
    token with ``tiles`` 16-key tiles of context (its own, not the table's width), the others
    exit without a write; a padded token runs none and gets zeros."""
    from freezeframe.models.attention import split_floats
    from freezeframe.models.paged_attention_triton import paged_attention

    gen = torch.Generator().manual_seed(splits * 100 + heads)
    lengths = [1, BLOCK, 2 * BLOCK + 1, 17, 33, MAX_BLOCKS * BLOCK]
    batch = make_batch(gen, heads, kv_heads, torch.float32, lengths, [1] * len(lengths),
                       pad_tokens=1, pad_reqs=1)
    one_pass, k_cache, v_cache = run_op(batch, "triton", split_kv="off")
    n, real = batch.q.shape[0], batch.num_real_tokens
    token_req = torch.tensor([*range(real), len(lengths)])  # the padded token: the padded row
    valid = torch.arange(n) < real
    per_program = split_floats(heads // kv_heads, HEAD_DIM)
    workspace = torch.full((n * kv_heads * splits * per_program,), float("nan"), device=DEVICE)
    out = torch.full((n, heads, HEAD_DIM), float("nan"), device=DEVICE)
    with counted_launches() as launches:
        paged_attention(batch.q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), out,
                        batch.positions.to(DEVICE), token_req.to(DEVICE), valid.to(DEVICE),
                        batch.block_tables.to(DEVICE), BLOCK, 1 / math.sqrt(HEAD_DIM),
                        num_splits=splits, workspace=workspace)
    assert launches == {"attend_kernel": 1, "combine_kernel": 1}
    got = out.cpu()
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    torch.testing.assert_close(got, one_pass, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[:real].double(), oracle(batch, k_cache, v_cache)[:real],
                               atol=2e-5, rtol=2e-5)
    ran = ~workspace.cpu().reshape(n, kv_heads, splits, per_program)[..., 0].isnan()
    for t in range(n):
        tiles = -(-lengths[t] // 16) if t < real else 0
        active = -(-tiles // -(-tiles // splits)) if tiles else 0
        assert ran[t].tolist() == [[s < active for s in range(splits)]] * kv_heads, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_rope_is_applied_as_the_cache_is_written(dtype: torch.dtype) -> None:
    """Given ``rope``, the op rotates the unrotated ``q`` and ``k`` (here strided views of one
    projection, as the model passes them): the Triton path in its cache-write kernel, the
    torch path with apply_rope; the same cache and answers, and the float64 oracle of the
    rotated queries and keys."""
    gen = torch.Generator().manual_seed(11)
    batch = make_batch(gen, 4, 2, dtype, seq_lens=[30, 5, 1], new_tokens=[1, 5, 1])
    qkv = torch.randn(batch.q.shape[0], (4 + 2 * 2) * HEAD_DIM, generator=gen).to(dtype)
    batch.q = qkv[:, : 4 * HEAD_DIM].view(-1, 4, HEAD_DIM)
    batch.k = qkv[:, 4 * HEAD_DIM : 6 * HEAD_DIM].view(-1, 2, HEAD_DIM)
    batch.v = qkv[:, 6 * HEAD_DIM :].view(-1, 2, HEAD_DIM)
    rope = rope_rows(batch)
    want, want_k, want_v = run_op(batch, "torch", static=True, rope=True)
    rotated_k = apply_rope(batch.k, rope).to(dtype)
    assert torch.equal(want_k[batch.slot_mapping], rotated_k)
    assert torch.equal(want_v[batch.slot_mapping], batch.v)
    for split_kv in ("off", "on") if dtype == torch.float32 else ("on",):
        got, k_cache, v_cache = run_op(batch, "triton", split_kv=split_kv, rope=True)
        torch.testing.assert_close(k_cache, want_k, atol=TOL[dtype], rtol=TOL[dtype])
        assert torch.equal(v_cache, want_v)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
        q = apply_rope(batch.q.double(), rope.double())
        torch.testing.assert_close(got.double(), oracle(batch, k_cache, v_cache, q),
                                   atol=TOL[dtype], rtol=TOL[dtype])


def test_split_kv_and_the_workspace_decide_the_launches() -> None:
    """``split_kv`` through the op: "off" is the cache write and one pass; "on" and "auto" (a
    decode of one request, so few programs) add the combine. A workspace too small for two
    splits runs one pass. Every way gives the same answer."""
    gen = torch.Generator().manual_seed(5)
    batch = make_batch(gen, 4, 2, torch.float32, [MAX_BLOCKS * BLOCK], [1])
    runs = {}
    small = split_workspace(4, 2, HEAD_DIM, device=DEVICE)[: 3 * 2 * 2]  # under one program
    for name, split_kv, workspace in [("off", "off", None), ("on", "on", None),
                                      ("auto", "auto", split_workspace(4, 2, HEAD_DIM, DEVICE)),
                                      ("small", "on", small)]:
        with counted_launches() as launches:
            runs[name] = run_op(batch, "triton", split_kv=split_kv, workspace=workspace)[0]
        two = {"write_kernel": 1, "attend_kernel": 1}
        assert launches == (two if name in ("off", "small") else {**two, "combine_kernel": 1})
    for name in ("on", "auto", "small"):
        torch.testing.assert_close(runs[name], runs["off"], atol=2e-5, rtol=2e-5)


def test_the_split_count_follows_the_shapes() -> None:
    from freezeframe.models.paged_attention_triton import num_splits_for, paged_attention

    # few programs and a long table: split; many programs or a short table: one pass
    assert [num_splits_for(t, 8, 256) for t in (1, 4, 16, 32)] == [16, 4, 1, 1]
    assert [num_splits_for(1, 8, b) for b in (4, 7, 8, 12, 64)] == [1, 1, 2, 3, 16]
    # on the test's DEVICE: on a GPU machine CPU tensors would be refused before the count
    with pytest.raises(ConfigError, match=r"num_splits=0 must be an int >= 1"):
        paged_attention(*(torch.zeros(1, 1, 1, device=DEVICE),) * 4,
                        *(torch.zeros(1, device=DEVICE),) * 3,
                        torch.zeros(1, 1, device=DEVICE), BLOCK, 1.0, num_splits=0)


def test_an_all_padding_batch_gives_zeros() -> None:
    gen = torch.Generator().manual_seed(3)
    batch = make_batch(gen, 4, 2, torch.float32, seq_lens=[], new_tokens=[], pad_tokens=4,
                       pad_reqs=2)
    got, k_cache, _ = run_op(batch, "triton")
    assert torch.equal(got, torch.zeros_like(got))
    assert torch.equal(k_cache[:-1], batch.k_cache[:-1])


def test_kernel_choice_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert KVCacheConfig().attention_kernel == "auto"
    assert resolve_attention_kernel("auto", torch.device("cpu")) == "torch"
    assert resolve_attention_kernel("auto", torch.device("cuda")) == "triton"
    assert resolve_attention_kernel("triton", torch.device("cpu")) == "triton"
    assert resolve_attention_kernel("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ConfigError, match=r"KVCacheConfig\.attention_kernel='flash' is not an "
                                          r"attention kernel; choose one of \['auto', 'torch', "
                                          r"'triton'\]"):
        KVCacheConfig(attention_kernel="flash")  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen, 4, 2, torch.float32, [3], [1])
    with pytest.raises(ConfigError, match=r"freezeframe::attention kernel='cuda' is not an "
                                          r"attention kernel"):
        run_op(batch, "cuda")
    with pytest.raises(ConfigError, match=r"KVCacheConfig\.split_kv='yes' is not a split-KV "
                                          r"mode; choose one of \['auto', 'on', 'off'\]"):
        KVCacheConfig(split_kv="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^split_kv='never' is not a split-KV mode"):
        build_llama("tiny", split_kv="never")
    with pytest.raises(ConfigError, match=r"freezeframe::attention split_kv='both' is not a "
                                          r"split-KV mode"):
        run_op(batch, "triton", split_kv="both")
    assert build_llama("tiny", split_kv="off").layers[0].attn.split_kv == "off"
    monkeypatch.setattr(attention_module, "_TRITON_FOUND", False)
    with pytest.raises(ConfigError, match=r"KVCacheConfig\.attention_kernel='triton' but triton "
                                          r"is not installed; pip install triton"):
        KVCacheConfig(attention_kernel="triton")
    assert resolve_attention_kernel("auto", torch.device("cuda")) == "torch"


# -- end to end: the reference Llama, FULL graphs, the Triton kernel ------------------------
CACHE = KVCacheConfig(num_blocks=12, block_size=4, max_model_len=16, attention_kernel="torch")
MAX_SEQS, MAX_TOKENS = 2, 4
REQUESTS = [
    Request("a", (1, 2, 3), max_new_tokens=6),  # decode contexts 4 .. 8: across two blocks
    Request("b", (9, 8), max_new_tokens=4, arrival_step=1),
]


def test_llama_on_full_graphs_with_the_triton_kernel_matches_eager() -> None:
    """The model hands the op unrotated q/k/v, its rope rows and its split workspace: captured
    in FULL graphs, the Triton path serves the torch path's tokens (split-KV through the model
    is in test_launch_census.py)."""
    # float32 on every device (build_llama's CUDA default is bfloat16): the comparison below
    # is at 1e-4 and expects the same greedy tokens
    eager_model = build_llama("tiny", CACHE, seed=0, init_std=0.3, device=DEVICE,
                              dtype=torch.float32)
    eager = ServingDriver(eager_model, max_num_seqs=MAX_SEQS,
                          max_num_batched_tokens=MAX_TOKENS).run(REQUESTS)

    cache = dataclasses.replace(CACHE, attention_kernel="triton")
    model = build_llama("tiny", cache, seed=0, init_std=0.3, device=DEVICE, dtype=torch.float32)
    assert {layer.attn.attention_kernel for layer in model.layers} == {"triton"}
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=[ATTENTION_OP], cudagraph_mode="full",
        cudagraph_capture_sizes=[1, 2, 4],
        graph_backend="cuda" if DEVICE.type == "cuda" else "emulated",
        max_num_seqs=MAX_SEQS, max_num_tokens=MAX_TOKENS,
    )
    compiled = ff.compile(model, cfg, dynamic_arg_dims=dict(
        LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
    runner = GraphRunner(compiled, cfg, inputs=llama_runner_inputs(model, MAX_SEQS),
                         progress=False, strict=True)
    with counted_launches() as launches:
        report = runner.capture()
        served = ServingDriver(model, RunnerForward(runner, MAX_SEQS), max_num_seqs=MAX_SEQS,
                               max_num_batched_tokens=MAX_TOKENS).run(REQUESTS)
    # each layer's op: the cache write and one pass (a 4-block table is too short to split)
    assert launches["write_kernel"] == launches["attend_kernel"] > 0
    assert launches["combine_kernel"] == 0

    assert served.outputs == eager.outputs
    assert eager.step_kinds == ["mixed", "mixed", "decode", "decode", "decode", "decode"]
    for got, want in zip(served.step_logits, eager.step_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # every step (contexts 2 .. 8) replayed one of the graphs captured up front
    assert runner.stats.steps == runner.stats.steps_full == eager.num_steps == 6
    assert compiled.stats.graphs_captured == report.num_graphs


def test_the_triton_kernel_reads_a_strided_token_layout_as_its_values() -> None:
    """token_req/token_valid given as stride-2 views: the kernel reads flat arrays, so the op
    makes them contiguous (a strided one read as flat gave wrong rows, or reads past the block
    table)."""
    from freezeframe.models.attention import token_layout

    gen = torch.Generator().manual_seed(7)
    batch = make_batch(gen, 4, 2, torch.float32, [5, 9], [5, 1], pad_tokens=2, pad_reqs=1)
    token_req, token_valid = token_layout(batch.query_start_loc.to(DEVICE),
                                          batch.seq_lens.to(DEVICE),
                                          batch.slot_mapping.to(DEVICE))
    layouts = {"contiguous": (token_req, token_valid),
               "strided": (torch.stack([token_req, token_req.flip(0)], 1)[:, 0],
                           torch.stack([token_valid, token_valid.flip(0)], 1)[:, 0])}
    assert layouts["strided"][0].stride() == (2,)
    outs = {}
    for name, (req, valid) in layouts.items():
        out = torch.full_like(batch.q, float("nan")).to(DEVICE)
        k_cache, v_cache = batch.k_cache.clone().to(DEVICE), batch.v_cache.clone().to(DEVICE)
        torch.ops.freezeframe.attention(
            batch.q.to(DEVICE), batch.k.to(DEVICE), batch.v.to(DEVICE), out, k_cache, v_cache,
            batch.positions.to(DEVICE), batch.slot_mapping.to(DEVICE),
            batch.query_start_loc.to(DEVICE), batch.seq_lens.to(DEVICE),
            batch.block_tables.to(DEVICE), BLOCK, 1 / math.sqrt(HEAD_DIM), "triton", req,
            valid)
        outs[name] = out.cpu()
    assert torch.equal(outs["strided"], outs["contiguous"])
    assert not outs["contiguous"][: batch.num_real_tokens].isnan().any()

