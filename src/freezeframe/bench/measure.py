"""How the bench measures: the shapes of its steps and the steps themselves, a latency timer,
the memory bandwidth, the bytes a decode step reads, and the launches of one FULL decode replay.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from freezeframe.models import KVCacheConfig, LlamaConfig, LlamaModel
from freezeframe.models.inputs import RequestChunk, StepInputs, build_step

if TYPE_CHECKING:
    from freezeframe.batch import BatchDescriptor
    from freezeframe.compilation.model import CompiledModel

__all__ = ["StepBuilder", "StepShapes", "Timer", "Timing", "device_used", "full_decode_graph",
           "full_decode_launches", "kv_read_bytes", "logits_of", "measure_bandwidth",
           "split_contexts", "sync"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per timed call: ``device_ms``, the step's time (CUDA events on a GPU, so the device time
    between the step's start and end; the wall clock on a CPU), and ``host_ms``, the wall
    clock of the call alone, without waiting for the device (on a CPU the two are one)."""

    device_ms: list[float]
    host_ms: list[float]


class Timer:
    """Per-call latency: CUDA events on a GPU (device time between steps), else perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def measure(self, fn: Callable[[], Any], steps: int, warmup: int) -> list[float]:
        return self.timing(fn, steps, warmup).device_ms

    def timing(self, fn: Callable[[], Any], steps: int, warmup: int) -> Timing:
        """Time ``steps`` calls of ``fn`` after ``warmup`` untimed ones."""
        for _ in range(warmup):
            fn()
        clock = time.perf_counter
        if not self.cuda:
            times = []
            for _ in range(steps):
                t0 = clock()
                fn()
                times.append((clock() - t0) * 1e3)
            return Timing(times, list(times))
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
        host = []
        for start, end in events:
            t0 = clock()
            start.record()
            fn()
            end.record()
            host.append((clock() - t0) * 1e3)
        torch.cuda.synchronize()
        return Timing([start.elapsed_time(end) for start, end in events], host)


def measure_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), median of 5."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = Timer(device).measure(lambda: dst.copy_(src), steps=5, warmup=2)
    return 2 * n * 4 / (statistics.median(times) / 1e3)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_used(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def split_contexts(contexts: Sequence[int], max_position: int,
                   block_size: int = 16) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(kept, skipped)``: sorted distinct context lengths that fit ``max_position`` with one
    block to spare, and those that do not."""
    ordered = sorted(set(contexts))
    limit = max_position - block_size
    return (tuple(c for c in ordered if c <= limit), tuple(c for c in ordered if c > limit))


def kv_read_bytes(config: LlamaConfig, elem_bytes: int, keys: int) -> int:
    """Bytes of keys and values one decode token reads over all layers when it reads ``keys``
    cache positions per layer (both K and V, every KV head)."""
    return keys * config.num_layers * 2 * config.num_kv_heads * config.resolved_head_dim \
        * elem_bytes


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The sizes of the bench's steps; the ``capture`` GPU probe builds the same ones."""

    context: int  # tokens per decode request, the new one included
    prefill_len: int
    max_bs: int  # the largest decode batch; the mixed step adds one request to it
    mixed_chunk: int  # prompt tokens of the mixed step's extra request
    contexts: tuple[int, ...] = ()  # decode rows by context length (each fits the positions)
    attention_kernel: str = "auto"
    block_size: int = 16

    @classmethod
    def for_preset(cls, preset: str, max_bs: int, mixed_chunk: int, *,
                   context: int | None = None, prefill_len: int | None = None,
                   contexts: tuple[int, ...] = (), attention_kernel: str = "auto",
                   ) -> StepShapes:
        """Context and prefill length default by preset: 64 and 64 tiny, 1024 and 512 else."""
        tiny = preset == "tiny"
        return cls(context=context or (64 if tiny else 1024),
                   prefill_len=prefill_len or (64 if tiny else 512),
                   max_bs=max_bs, mixed_chunk=mixed_chunk, contexts=contexts,
                   attention_kernel=attention_kernel)

    @property
    def max_model_len(self) -> int:
        return max(self.context, self.prefill_len, *self.contexts) + self.block_size

    @property
    def blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_num_seqs(self) -> int:
        """Request rows of the largest step: the mixed step at the largest batch size."""
        return self.max_bs + 1

    @property
    def max_num_tokens(self) -> int:
        return max(self.prefill_len, self.max_bs + self.mixed_chunk)

    def cache_config(self) -> KVCacheConfig:
        """A KV cache with a row of blocks for each request the largest step has."""
        return KVCacheConfig(num_blocks=self.blocks_per_req * self.max_num_seqs,
                             block_size=self.block_size, max_model_len=self.max_model_len,
                             attention_kernel=self.attention_kernel)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class StepBuilder:
    """Builds the bench's steps on ``device``; request ``r`` owns the ``r``-th row of blocks."""

    shapes: StepShapes
    cache: KVCacheConfig
    device: torch.device

    def decode(self, bs: int, context: int | None = None) -> StepInputs:
        """``bs`` requests, each one new token after ``context - 1`` cached ones (default: the
        shapes' context)."""
        return build_step(self._decodes(bs, context), self.cache, device=self.device)

    def mixed(self, bs: int) -> StepInputs:
        """The decode step of ``bs`` requests plus the first prompt chunk of one more."""
        chunks = self._decodes(bs)
        chunks.append(RequestChunk(tuple(range(self.shapes.mixed_chunk)), 0, self._blocks(bs)))
        return build_step(chunks, self.cache, device=self.device)

    def prefill(self) -> StepInputs:
        """One request's whole prompt of ``prefill_len`` tokens."""
        prompt = tuple(i % 100 for i in range(self.shapes.prefill_len))
        return build_step([RequestChunk(prompt, 0, self._blocks(0))], self.cache,
                          device=self.device)

    def _decodes(self, bs: int, context: int | None = None) -> list[RequestChunk]:
        cached = (context or self.shapes.context) - 1
        return [RequestChunk((1 + r % 7,), cached, self._blocks(r)) for r in range(bs)]

    def _blocks(self, r: int) -> tuple[int, ...]:
        per_req = self.shapes.blocks_per_req
        return tuple(range(r * per_req, (r + 1) * per_req))


def full_decode_graph(compiled: CompiledModel, num_reqs: int) -> Any:
    """The FULL uniform-decode graph a decode step of ``num_reqs`` one-token requests replays
    (the graph of the smallest captured size that holds them), or None without one."""
    from freezeframe.config import CUDAGraphMode

    found: list[tuple[BatchDescriptor, Any]] = []
    for wrapper in compiled.graph_wrappers():
        if wrapper.runtime_mode is not CUDAGraphMode.FULL:
            continue
        for desc in wrapper.captured_descriptors:
            if desc.num_tokens >= num_reqs and (desc.num_reqs or num_reqs) >= num_reqs:
                found.append((desc, wrapper.graph_for(desc)))
    if not found:
        return None
    # a uniform-decode graph where the mode keys them apart (FULL_AND_PIECEWISE), else the
    # FULL graph a step of that many tokens replays (FULL)
    return min(found, key=lambda item: (not item[0].uniform, item[0].num_tokens))[1]


def full_decode_launches(compiled: CompiledModel, num_reqs: int) -> int | None:
    """Launches one replay of the FULL uniform-decode graph for ``num_reqs`` one-token requests
    issues (:func:`full_decode_graph`), or None without one.

    Emulated graphs record their launches: each recorded ATen op, or one per opaque kernel
    call (a Triton launch, a compiled piece), counts one. A CUDA graph is replayed once under
    ``torch.profiler`` and every device activity it shows (kernels, memcpy, memset) counts one.
    """
    from freezeframe.graphs.emulated import EmulatedGraph

    graph = full_decode_graph(compiled, num_reqs)
    if graph is None:
        return None
    if isinstance(graph, EmulatedGraph):
        return len(graph.ops)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)


def logits_of(forward: Callable[[StepInputs], torch.Tensor], step: StepInputs,
              model: LlamaModel) -> Callable[[], torch.Tensor]:
    """A call of one step: hidden states through ``forward``, then each request's logits."""
    rows = step.last_token_index()

    def run() -> torch.Tensor:
        with torch.no_grad():
            hidden = forward(step)
            return model.compute_logits(hidden[rows])
    return run
