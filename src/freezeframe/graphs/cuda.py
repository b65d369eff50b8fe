"""The ``cuda`` graph backend: ``torch.cuda.CUDAGraph`` with one shared memory pool per device.

Why one pool: every graph of a model (all pieces, all sizes, FULL and PIECEWISE) allocates its
intermediates from the same private pool, so the memory of a large capture is reused by the
smaller ones captured after it. That is safe because graphs are replayed one at a time in
capture order; it is also why a replayed output is only valid until the next replay.

The pool belongs to the backend *object* (not to the process), so two compiled models with two
backends never share memory behind each other's back.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from freezeframe.errors import CaptureError, FreezeframeError

__all__ = ["CudaBackend", "CudaGraph", "is_capture_violation", "weak_ref_tensor",
           "weak_ref_tensors"]

logger = logging.getLogger(__name__)


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``tensor``'s memory without keeping that memory alive.

    Built from a non-owning storage (``torch._C._construct_storage_from_data_pointer``, the
    trick torch's own CUDA-graph trees use). Where that private API is missing the tensor itself
    is returned: a strong reference costs memory (the pool cannot reuse the block), never
    correctness. Only the output of a forward's *last* captured graph may be turned into a weak
    reference: no later graph reads it, so nothing else needs the block kept.
    """
    make_storage = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make_storage is None:  # pragma: no cover - depends on the torch build
        return tensor
    storage = tensor.untyped_storage()
    weak_storage = make_storage(storage.data_ptr(), tensor.device, storage.nbytes())
    view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    view.set_(weak_storage, tensor.storage_offset(), tensor.size(), tensor.stride())
    return view


def weak_ref_tensors(output: Any) -> Any:
    """:func:`weak_ref_tensor` applied to every tensor in a (nested) output."""
    return pytree.tree_map_only(torch.Tensor, weak_ref_tensor, output)


def is_capture_violation(exc: BaseException) -> bool:
    """Whether ``exc`` is CUDA (or torch) refusing an operation because a stream is capturing
    (``operation not permitted when stream is capturing``, ``... a previous error during
    capture``, ``... during CUDA graph capture``), as opposed to an error of the captured code
    itself, which must reach the caller unchanged."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, FreezeframeError):
        return False
    text = str(exc).lower()
    return "captur" in text and ("cuda" in text or "graph" in text)


def _abandon(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """End a capture that the captured code broke off with an exception.

    Until the capture ends, the stream stays in capture mode (with ``capture_error_mode=
    "global"``, unsafe calls on every thread fail) and the allocator keeps routing the
    stream's allocations into the graph pool. ``capture_end`` refuses to end a capture on any
    stream but the one it began on, and the failed code may have left another stream current,
    so the capture stream is made current for it. What ``capture_end`` raises (an invalidated
    capture has no graph) is secondary to the error being raised and only logged; the partial
    graph is dropped with ``graph``.
    """
    try:
        with torch.cuda.stream(stream):
            graph.capture_end()
    except Exception:
        logger.debug("capture_end after a failed capture also failed", exc_info=True)


class CudaGraph:
    """A captured ``torch.cuda.CUDAGraph``; replay launches it on the current stream."""

    __slots__ = ("graph",)

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class CudaBackend:
    """Captures with ``torch.cuda.CUDAGraph`` into one pool per device, on the current stream.

    Capture goes through ``capture_begin``/``capture_end`` rather than the ``torch.cuda.graph``
    context manager, because the context manager always flushes the allocator cache (and, in
    some torch versions, runs ``gc.collect``) at every capture start. With roughly one piece
    per layer that flush dominated capture time, so the flush happens here only when the
    caller does not pass ``gc_disable`` (the first piece of a forward). Nothing global is
    patched: the suppression is simply not calling them.

    If the current stream is the device's default stream (capturing on the legacy default
    stream is not allowed), a side stream owned by this backend is used, ordered after the
    current stream before capture and before it again after.
    """

    name = "cuda"
    capture_computes = False  # kernels are recorded, not run: the wrapper replays once

    def __init__(self) -> None:
        # device index -> pool handle; filled lazily so constructing the backend touches no
        # CUDA state (a config can be resolved before the device is chosen).
        self._pools: dict[int, Any] = {}
        self._side_streams: dict[int, torch.cuda.Stream] = {}

    def pool(self, device: int | None = None) -> Any:
        """The shared graph memory pool of ``device`` (default: the current device)."""
        index = torch.cuda.current_device() if device is None else device
        handle = self._pools.get(index)
        if handle is None:
            with torch.cuda.device(index):
                handle = torch.cuda.graph_pool_handle()
            self._pools[index] = handle
        return handle

    def _capture_stream(self, index: int) -> torch.cuda.Stream:
        current = torch.cuda.current_stream(index)
        if current != torch.cuda.default_stream(index):
            return current
        side = self._side_streams.get(index)
        if side is None:
            side = torch.cuda.Stream(device=index)
            self._side_streams[index] = side
        return side

    def capture(self, fn: Callable[[], Any], *, gc_disable: bool = False,
                error_mode: str = "global") -> tuple[CudaGraph, Any]:
        index = torch.cuda.current_device()
        pool = self.pool(index)
        caller_stream = torch.cuda.current_stream(index)
        stream = self._capture_stream(index)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(index)
        if not gc_disable:
            # Free what we can before the first capture of a forward; later pieces skip this.
            gc.collect()
            torch.cuda.empty_cache()
        if stream != caller_stream:
            stream.wait_stream(caller_stream)
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode=error_mode)
            try:
                output = fn()
                # on the capture stream: the captured code may have left another one current
                with torch.cuda.stream(stream):
                    graph.capture_end()
            except BaseException as exc:
                _abandon(graph, stream)
                if is_capture_violation(exc):
                    raise CaptureError(
                        "an operation inside the captured region is not allowed during CUDA "
                        "graph capture (typically a host sync: .item(), printing a tensor, "
                        "nonzero or another data-dependent shape, a blocking CPU<->GPU copy). "
                        "Move it out of the captured region (compute it before the forward, or "
                        "make the op a splitting op so it runs between graphs). CUDA said: "
                        f"{exc}") from exc
                raise
        if stream != caller_stream:
            caller_stream.wait_stream(stream)
        return CudaGraph(graph), output

    def weak_ref(self, output: Any) -> Any:
        return weak_ref_tensors(output)

    def prepare(self, runnable: Callable[..., Any]) -> Callable[..., Any]:
        return runnable  # its kernels are captured as launched

    def share_capture(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        # a kernel launched onto the capturing stream is captured, whichever thread launches it
        return contextlib.nullcontext

    def __repr__(self) -> str:
        return f"CudaBackend(pools={sorted(self._pools)})"
