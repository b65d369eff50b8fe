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
import dataclasses
import gc
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from freezeframe.containers import map_tensors
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
    return map_tensors(output, weak_ref_tensor)


def is_capture_violation(exc: BaseException) -> bool:
    """Whether ``exc`` is CUDA (or torch) refusing an operation because a stream is capturing
    (``operation not permitted when stream is capturing``, ``... a previous error during
    capture``, ``... during CUDA graph capture``), as opposed to an error of the captured code
    itself, which must reach the caller unchanged."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, FreezeframeError):
        return False
    text = str(exc).lower()
    return "captur" in text and ("cuda" in text or "graph" in text)


def _pool_call(name: str, *args: Any) -> None:
    """Call the allocator's pool function ``torch._C.<name>`` where this torch has it, and log
    (never raise) what it refuses: it only tidies up after an error already on its way."""
    fn = getattr(torch._C, name, None)
    if fn is None:  # pragma: no cover - depends on the torch build
        logger.debug("torch._C.%s is missing in torch %s", name, torch.__version__)
        return
    try:
        fn(*args)
    except Exception:
        logger.debug("torch._C.%s%s refused", name, args, exc_info=True)


def _abandon(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, index: int,
             pool: Any) -> None:
    """End a capture that the captured code broke off with an exception.

    Until the capture ends, the stream stays in capture mode (with ``capture_error_mode=
    "global"``, unsafe calls on every thread fail) and the allocator keeps routing the
    stream's allocations into the graph pool. ``capture_end`` refuses to end a capture on any
    stream but the one it began on, and the failed code may have left another stream current,
    so the capture stream is made current for it. What ``capture_end`` raises (an invalidated
    capture has no graph) is secondary to the error being raised and only logged.

    When ``capture_end`` itself raises (CUDA invalidated the capture: a host sync inside it),
    torch 2.11 has not yet told the allocator to stop routing allocations into the pool, and
    the graph, whose capture never ended, will not give back the reference to the pool it took
    at ``capture_begin``. Both are done here by hand, only then (a torch that already ended the
    allocation refuses the repeat, which is logged); the caller moves to a fresh pool, since
    the next capture into this one would fail with "already recording to mempool_id". When
    ``capture_end`` succeeds (the captured Python raised, CUDA saw nothing wrong), the graph is
    an ordinary ended capture: its destructor gives the pool back, and releasing it here too
    would free the pool twice (the process aborts).
    """
    try:
        with torch.cuda.stream(stream):
            graph.capture_end()
    except Exception:
        logger.debug("capture_end after a failed capture also failed", exc_info=True)
        _pool_call("_cuda_endAllocateToPool", index, pool)
        _pool_call("_cuda_releasePool", index, pool)


class CudaGraph:
    """A captured ``torch.cuda.CUDAGraph``; replay launches it on the current stream."""

    __slots__ = ("__weakref__", "graph")

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class _CudaSegments:
    """The segments of one breakable capture on CUDA: a ``CUDAGraph`` per segment, all in
    one pool, on one stream (the caller keeps that stream current)."""

    def __init__(self, pool: _Pool, stream: torch.cuda.Stream, error_mode: str) -> None:
        self.graphs: list[CudaGraph] = []
        self.capturing: torch.cuda.CUDAGraph | None = None
        self._pool = pool
        self._stream = stream
        self._error_mode = error_mode

    def resume(self) -> None:
        assert self.capturing is None, "resume() twice"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool.handle, capture_error_mode=self._error_mode)
        self.capturing = graph

    def cut(self) -> None:
        graph, self.capturing = self.capturing, None
        assert graph is not None, "cut() outside a segment"
        with torch.cuda.stream(self._stream):
            graph.capture_end()
            captured = CudaGraph(graph)
            self._pool.graphs.add(captured)
            self._pool.captured += 1
            captured.replay()  # its outputs hold real values before the eager work after it
        self.graphs.append(captured)

    def held_bytes(self, extra: Any) -> int:
        return 0  # the pool holds it (pool_bytes)

@dataclasses.dataclass
class _Pool:
    """One device's current graph pool: its handle and the graphs captured into it."""

    handle: Any
    graphs: weakref.WeakSet[CudaGraph] = dataclasses.field(default_factory=weakref.WeakSet)
    captured: int = 0  # graphs ever captured into it

    @property
    def emptied(self) -> bool:
        """Every graph captured into the pool is gone."""
        return self.captured > 0 and not self.graphs


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

    Pool rules, stated once: every graph of a device goes into that device's current pool; a
    failed capture, and a pool whose graphs are all gone, retire the pool and its side stream,
    and the next capture starts a fresh pool (see :meth:`_retire`); ``pools_replaced`` counts
    the retirements.
    """

    name = "cuda"
    capture_computes = False  # kernels are recorded, not run: the wrapper replays once

    def __init__(self) -> None:
        # device index -> its current pool; filled lazily so constructing the backend touches
        # no CUDA state (a config can be resolved before the device is chosen).
        self._pools: dict[int, _Pool] = {}
        self._side_streams: dict[int, torch.cuda.Stream] = {}
        self.pools_replaced = 0

    def pool(self, device: int | None = None) -> Any:
        """The handle of ``device``'s current graph memory pool (default: current device)."""
        return self._pool(torch.cuda.current_device() if device is None else device).handle

    def _pool(self, index: int) -> _Pool:
        pool = self._pools.get(index)
        if pool is not None and pool.emptied:
            self._retire(index)  # every graph of the pool is gone (see _retire)
            pool = None
        if pool is None:
            with torch.cuda.device(index):
                pool = self._pools[index] = _Pool(torch.cuda.graph_pool_handle())
        return pool

    def pool_bytes(self, device: int | None = None) -> int:
        """The bytes ``device``'s current pool holds reserved from the device: the sizes of its
        allocator segments, read from the caching allocator's own snapshot of that pool (not
        from free device memory, which moves with every other allocation, cuBLAS workspaces
        and warm-up caches included). 0 before the first capture."""
        index = torch.cuda.current_device() if device is None else device
        pool = self._pools.get(index)
        if pool is None:
            return 0
        want = tuple(pool.handle)
        try:
            segments = torch.cuda.memory_snapshot(mempool_id=pool.handle, include_traces=False)
        except TypeError:  # pragma: no cover - a torch whose snapshot takes no pool
            segments = torch.cuda.memory_snapshot()
        return sum(int(seg["total_size"]) for seg in segments
                   if tuple(seg.get("segment_pool_id", want)) == want
                   and int(seg.get("device", index)) == index)

    def _retire(self, index: int) -> None:
        """Capture the next graph of device ``index`` into a fresh pool, on a fresh side stream.

        A pool is retired after a capture into it failed (torch 2.11 leaves it marked as
        recording, see :func:`_abandon`), and once every graph captured into it is gone: the
        pool outlives its graphs (a block allocated during capture, such as the cuBLAS
        workspace, keeps it), and capturing into it again trips an internal assert of torch's
        allocator. The old pool's memory goes back to the device when its last block is
        freed."""
        if self._pools.pop(index, None) is not None:
            self.pools_replaced += 1
        self._side_streams.pop(index, None)

    def _capture_stream(self, index: int) -> torch.cuda.Stream:
        current = torch.cuda.current_stream(index)
        if current != torch.cuda.default_stream(index):
            return current
        side = self._side_streams.get(index)
        if side is None:
            side = torch.cuda.Stream(device=index)
            self._side_streams[index] = side
        return side

    def _before_capture(self, gc_disable: bool
                        ) -> tuple[int, _Pool, torch.cuda.Stream, torch.cuda.Stream]:
        """The current device, its pool, the caller's stream and the stream to capture on,
        ordered after the caller's work; unless ``gc_disable``, what can be freed is freed
        first (the first capture of a forward; later pieces skip it)."""
        index = torch.cuda.current_device()
        pool = self._pool(index)
        caller_stream = torch.cuda.current_stream(index)
        stream = self._capture_stream(index)
        torch.cuda.synchronize(index)
        if not gc_disable:
            gc.collect()
            torch.cuda.empty_cache()
        if stream != caller_stream:
            stream.wait_stream(caller_stream)
        return index, pool, caller_stream, stream

    def capture(self, fn: Callable[[], Any], *, gc_disable: bool = False,
                error_mode: str = "global") -> tuple[CudaGraph, Any]:
        index, pool, caller_stream, stream = self._before_capture(gc_disable)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool.handle, capture_error_mode=error_mode)
            try:
                output = fn()
                # on the capture stream: the captured code may have left another one current
                with torch.cuda.stream(stream):
                    graph.capture_end()
            except BaseException as exc:
                _abandon(graph, stream, index, pool.handle)
                self._retire(index)
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
        captured = CudaGraph(graph)
        pool.graphs.add(captured)
        pool.captured += 1
        return captured, output

    @contextlib.contextmanager
    def segmented(self, *, gc_disable: bool = False,
                  error_mode: str = "global") -> Iterator[_CudaSegments]:
        """A capture in segments on this device's pool (see :mod:`freezeframe.graphs.
        breakable`): each segment is a ``CUDAGraph`` of its own, captured on one stream into
        the shared pool and replayed once as it ends, so the eager work between segments
        reads real values. A failure ends the capture in progress and retires the pool, as
        :meth:`capture` does."""
        index, pool, caller_stream, stream = self._before_capture(gc_disable)
        segments = _CudaSegments(pool, stream, error_mode)
        with torch.cuda.stream(stream):
            try:
                segments.resume()
                yield segments
                segments.cut()
            except BaseException as exc:
                if segments.capturing is not None:
                    _abandon(segments.capturing, stream, index, pool.handle)
                self._retire(index)
                if is_capture_violation(exc):
                    raise CaptureError(
                        "an operation inside a graph segment is not allowed during CUDA graph "
                        "capture (typically a host sync). Make it a graph break (a splitting "
                        "op, or @ff.graph_break on the function that makes it). CUDA said: "
                        f"{exc}") from exc
                raise
        if stream != caller_stream:
            caller_stream.wait_stream(stream)

    def weak_ref(self, output: Any) -> Any:
        return weak_ref_tensors(output)

    def prepare(self, runnable: Callable[..., Any]) -> Callable[..., Any]:
        return runnable  # its kernels are captured as launched

    def share_capture(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        # a kernel launched onto the capturing stream is captured, whichever thread launches it
        return contextlib.nullcontext

    def __repr__(self) -> str:
        return (f"CudaBackend(pools={sorted(self._pools)}, "
                f"pools_replaced={self.pools_replaced})")
