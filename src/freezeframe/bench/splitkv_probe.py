"""The split-KV probe (:func:`gpu_probes.probe_splitkv`): the Triton attention op alone at a
preset's decode shapes, with split-KV off and on side by side.

What it times is what split-KV changes and nothing else: one decode step's attention, every
layer's ``paged_attention`` call over that layer's own cache (query heads, KV heads, head dim,
layer count and block size from the preset; bf16 on a GPU), at each batch size and context
length, with ``split_kv="off"`` and ``"on"``. The block table is as wide as the bench's
(``max(contexts) + block_size`` positions), so the split counts are the ones the model's
captured graphs get, and ``"auto"`` is read from the same plan (it always picks the count of
one of the two timed rows, which the report names). The cache blocks of each request are drawn
from a random permutation of the pool, filled with random values; the queries are random too.

On a GPU the step's calls are captured as one CUDA graph and its replays timed with CUDA events
after a warm-up, each replay after a 256 MiB write that evicts the caches from L2 (in a model
step the layers' weights pass through L2 between two attention calls); the median is kept. On
a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported) and the wall clock is read: a check that the probe runs, not a speed figure.

Every row is checked before it is timed: the output poisoned with NaN first, then the first and
last layers' outputs against a float32 torch reference (relative L2 error). This module imports
torch at the top, so :mod:`gpu_probes` imports it only inside the probe.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from freezeframe.models import LlamaConfig
from freezeframe.models.attention import split_workspace
from freezeframe.models.paged_attention_triton import paged_attention, plan_for

__all__ = ["MODES", "TOLERANCE", "ProbeShape", "SplitKVProbe"]

#: the modes timed side by side; ``"auto"`` picks one of their split counts (see the docstring)
MODES = ("off", "on")
#: largest relative L2 error of a row's output against the float32 reference, per cache dtype
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
_FLUSH_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class ProbeShape:
    """The attention shapes of a preset's decode step, and the block table's width."""

    preset: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    block_size: int
    max_blocks: int
    dtype: torch.dtype

    @classmethod
    def for_preset(cls, preset: str, contexts: Sequence[int], dtype: torch.dtype,
                   block_size: int = 16) -> ProbeShape:
        """The preset's shapes; the table holds ``max(contexts) + block_size`` positions (the
        bench's ``max_model_len``)."""
        config = LlamaConfig.preset(preset)
        return cls(preset, config.num_heads, config.num_kv_heads, config.resolved_head_dim,
                   config.num_layers, block_size, -(-(max(contexts) + block_size) // block_size),
                   dtype)

    def to_json(self) -> dict[str, Any]:
        return {"preset": self.preset, "heads": self.heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "layers": self.layers,
                "block_size": self.block_size, "max_blocks": self.max_blocks,
                "dtype": str(self.dtype).removeprefix("torch.")}


@dataclasses.dataclass
class _Step:
    """One decode step's op arguments, a cache per layer, an output per layer."""

    q: torch.Tensor
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    outs: list[torch.Tensor]
    positions: torch.Tensor
    token_req: torch.Tensor
    token_valid: torch.Tensor
    block_tables: torch.Tensor


class SplitKVProbe:
    """The caches for the largest step (allocated once, a pool of blocks per layer) and the
    rows: :meth:`row` checks and times one (batch size, context, mode)."""

    def __init__(self, shape: ProbeShape, max_bs: int, max_context: int,
                 device: torch.device, seed: int = 0) -> None:
        self.shape, self.device = shape, device
        self.gen = torch.Generator().manual_seed(seed)  # the block permutations
        self.values = torch.Generator(device=device).manual_seed(seed)  # caches, queries
        self.cuda = device.type == "cuda"
        self.scale = 1.0 / math.sqrt(shape.head_dim)
        self.pool_blocks = max_bs * -(-max_context // shape.block_size)
        slots = self.pool_blocks * shape.block_size
        cache_shape = (slots, shape.kv_heads, shape.head_dim)
        self.k_caches = [self._randn(cache_shape) for _ in range(shape.layers)]
        self.v_caches = [self._randn(cache_shape) for _ in range(shape.layers)]
        self.workspace = split_workspace(shape.heads, shape.kv_heads, shape.head_dim, device)
        self.flush = torch.empty(_FLUSH_BYTES if self.cuda else 0, dtype=torch.uint8,
                                 device=device)

    def _randn(self, size: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(size, generator=self.values, dtype=self.shape.dtype,
                           device=self.device)

    def step(self, bs: int, context: int) -> _Step:
        """``bs`` requests, each one query token at position ``context - 1``, their blocks
        drawn from a fresh random permutation of the pool."""
        s = self.shape
        need = -(-context // s.block_size)
        perm = torch.randperm(self.pool_blocks, generator=self.gen)[:bs * need]
        table = torch.zeros(bs, s.max_blocks, dtype=torch.int64)
        table[:, :need] = perm.view(bs, need)
        return _Step(
            q=self._randn((bs, s.heads, s.head_dim)),
            k_caches=self.k_caches, v_caches=self.v_caches,
            outs=[torch.empty(bs, s.heads, s.head_dim, dtype=s.dtype, device=self.device)
                  for _ in range(s.layers)],
            positions=torch.full((bs,), context - 1, dtype=torch.int64, device=self.device),
            token_req=torch.arange(bs, device=self.device),
            token_valid=torch.ones(bs, dtype=torch.bool, device=self.device),
            block_tables=table.to(self.device))

    def splits(self, step: _Step, mode: str) -> int:
        """The split count the op's plan takes for this step in ``mode`` (the model's
        workspace bounds it)."""
        tensors = {"q": step.q, "out": step.outs[0], "k_cache": step.k_caches[0],
                   "v_cache": step.v_caches[0], "positions": step.positions,
                   "token_req": step.token_req, "token_valid": step.token_valid,
                   "block_tables": step.block_tables, "workspace": self.workspace}
        return plan_for(tensors, self.shape.block_size, self.scale, mode).splits

    def _call(self, step: _Step, mode: str) -> Callable[[], None]:
        def run() -> None:
            for layer in range(self.shape.layers):
                paged_attention(step.q, step.k_caches[layer], step.v_caches[layer],
                                step.outs[layer], step.positions, step.token_req,
                                step.token_valid, step.block_tables, self.shape.block_size,
                                self.scale, split_kv=mode, workspace=self.workspace)
        return run

    def rel_error(self, step: _Step, context: int) -> float:
        """The largest relative L2 error of the first and last layers' outputs against a
        float32 reference (NaN where the kernel left a poisoned value)."""
        worst = 0.0
        for layer in sorted({0, self.shape.layers - 1}):
            ref = self._reference(step, layer, context)
            got = step.outs[layer].float()
            err = float((got - ref).norm() / ref.norm())
            worst = max(worst, err) if not math.isnan(err) else math.nan
            if math.isnan(worst):
                break
        return worst

    def _reference(self, step: _Step, layer: int, context: int) -> torch.Tensor:
        s = self.shape
        bs = step.q.shape[0]
        key_pos = torch.arange(context, device=self.device)
        slots = (step.block_tables[:, key_pos // s.block_size] * s.block_size
                 + key_pos % s.block_size)  # [bs, context]
        keys = step.k_caches[layer][slots].float()  # [bs, context, KV, D]
        vals = step.v_caches[layer][slots].float()
        q = step.q.float().view(bs, s.kv_heads, s.heads // s.kv_heads, s.head_dim)
        probs = (torch.einsum("bkgd,bckd->bkgc", q, keys) * self.scale).softmax(dim=-1)
        return torch.einsum("bkgc,bckd->bkgd", probs, vals).reshape(bs, s.heads, s.head_dim)

    def row(self, bs: int, context: int, mode: str, steps: int, warmup: int
            ) -> dict[str, Any]:
        """One row: the step's split count, its output's error against the reference, and
        the median ms of the whole step's attention (every layer)."""
        step = self.step(bs, context)
        for out in step.outs:
            out.fill_(math.nan)
        run = self._call(step, mode)
        run()  # compiles the kernels of this split count on first use
        if self.cuda:
            torch.cuda.synchronize()
        row: dict[str, Any] = {"batch": bs, "context": context, "split_kv": mode,
                               "splits": self.splits(step, mode),
                               "rel_error": self.rel_error(step, context)}
        row["ms"] = self._time(run, steps, warmup)
        kv_bytes = 2 * bs * context * self.shape.kv_heads * self.shape.head_dim \
            * self.shape.layers * step.k_caches[0].element_size()
        row["kv_gb_per_s"] = kv_bytes / (row["ms"] * 1e-3) / 1e9 if row["ms"] > 0 else None
        return row

    def _time(self, run: Callable[[], None], steps: int, warmup: int) -> float:
        """Median ms of ``steps`` runs after ``warmup``: replays of one CUDA graph of the
        step, each timed with events after an L2 flush; on a CPU the wall clock."""
        if not self.cuda:
            for _ in range(warmup):
                run()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for _ in range(warmup):
            graph.replay()
        times = []
        for _ in range(steps):
            self.flush.fill_(1)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del graph
        return statistics.median(times)
