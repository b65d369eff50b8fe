"""Breakable capture: graphs around code that must run eagerly, without a trace.

A breakable capture runs the forward once, as a capture, and *breaks* it at marked calls: the
current graph segment ends, the marked call runs eagerly, and the next segment starts on the
same memory pool. A replay replays the first segment, calls the marked call again on the same
tensors, replays the next segment, and so on::

    capture:  [segment 0 recorded] -> op(a, out) eagerly -> [segment 1 recorded] -> ... -> end
    replay:    segment 0.replay()  -> op(a, out)          ->  segment 1.replay() -> ...

A call is marked by being one of the config's ``splitting_ops`` (an op called as
``torch.ops.ns.op(...)``, seen through a :class:`~torch.overrides.TorchFunctionMode`) or a
Python function decorated with :func:`graph_break`. No Dynamo, no Inductor: the forward runs as
it is written, so a model that does not trace as one graph still gets graphs.

What a replay holds fixed, as every CUDA graph does: the Python control flow of the captured
call (a branch on a size or a flag runs as it ran at capture), the addresses of every tensor a
segment or a break reads (a break's arguments are the very tensor objects of the capture), and
the non-tensor arguments of a break. A break that returns new tensors has them copied into the
tensors its capture returned, which the next segment reads; a break that writes into an
argument (``out=``) costs no copy.

Safety. Inside a segment, a call that would synchronise the host with the device (``.item()``,
``.tolist()``, ``.cpu()``, ``bool(tensor)``, printing a tensor, ``nonzero``) is a
:class:`~freezeframe.errors.CaptureError` naming the call and the line of the model that made
it, with the fix: make it (or the function around it) a break. Between segments, in a break,
anything goes: it runs eagerly.

Each backend provides the segments (``GraphBackend.segmented``): ``cuda`` ends the stream
capture and begins a new one on the same pool (replaying each segment once as it ends, so the
eager call between them reads real values); ``emulated`` stops and restarts its recorder.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from freezeframe.errors import CaptureError
from freezeframe.graphs.backend import CapturedGraph, GraphBackend

__all__ = ["BreakableBackend", "BreakableGraph", "Segments", "break_point", "graph_break"]

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])

# The breakable capture running on this thread (context), if any: read by graph_break.
_CURRENT: contextvars.ContextVar[_BreakableCapture | None] = contextvars.ContextVar(
    "freezeframe_breakable_capture", default=None)

# Calls that synchronise the host with the device: refused inside a segment.
_HOST_SYNCS: dict[Any, str] = {
    torch.Tensor.item: "Tensor.item() reads a value back to the host",
    torch.Tensor.tolist: "Tensor.tolist() reads values back to the host",
    torch.Tensor.numpy: "Tensor.numpy() reads values back to the host",
    torch.Tensor.cpu: "Tensor.cpu() copies to the host and waits for it",
    torch.Tensor.__bool__: "bool(tensor) (an `if` on a tensor) reads a value back to the host",
    torch.Tensor.__int__: "int(tensor) reads a value back to the host",
    torch.Tensor.__float__: "float(tensor) reads a value back to the host",
    torch.Tensor.__index__: "using a tensor as an index reads a value back to the host",
    torch.Tensor.__repr__: "printing a tensor reads its values back to the host",
    torch.Tensor.__format__: "formatting a tensor reads its values back to the host",
    torch.Tensor.nonzero: "nonzero() has a data-dependent shape, which the host must read",
    torch.nonzero: "torch.nonzero has a data-dependent shape, which the host must read",
}

# Frames of freezeframe's graphs package and of torch: a refusal names the first frame outside.
_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


class Segments(Protocol):
    """A capture in segments, as a backend runs it (``GraphBackend.segmented``).

    Between :meth:`cut` and :meth:`resume` nothing is captured: the caller runs eager work
    there. ``graphs`` are the segments ended so far, in order; each has run once (its outputs
    hold real values) by the time :meth:`cut` returns."""

    graphs: list[CapturedGraph]

    def cut(self) -> None: ...

    def resume(self) -> None: ...

    def held_bytes(self, extra: Any) -> int: ...


@dataclasses.dataclass
class _Break:
    """One eager call between two segments: the callable, the exact arguments of the capture,
    and the tensors its capture returned (which later segments read)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    targets: list[torch.Tensor]
    name: str

    def run(self) -> None:
        out = self.fn(*self.args, **self.kwargs)
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if len(leaves) != len(self.targets):
            raise CaptureError(
                f"graph break {self.name} returned {len(leaves)} tensors on replay but "
                f"{len(self.targets)} at capture; a break must return the same structure "
                "every time (its Python runs again on every replay)")
        for target, leaf in zip(self.targets, leaves, strict=True):
            if leaf is target or (leaf.data_ptr() == target.data_ptr()
                                  and leaf.shape == target.shape):
                continue  # written in place (an out= argument, or the tensor itself)
            if leaf.shape != target.shape or leaf.dtype != target.dtype:
                raise CaptureError(
                    f"graph break {self.name} returned a tensor of shape {tuple(leaf.shape)} "
                    f"and dtype {leaf.dtype} on replay where its capture returned "
                    f"{tuple(target.shape)} {target.dtype}; the graph after it reads the "
                    "captured tensor, so a break must return the same shapes for the size")
            target.copy_(leaf)


class BreakableGraph:
    """The segments of one breakable capture and the breaks between them; :meth:`replay`
    runs them in order. ``memory_bytes`` as the backend's own graphs count it (emulated:
    the tensors the segments and breaks keep alive; cuda: 0, the pool holds it)."""

    __slots__ = ("_breaks", "_inference", "_segments", "memory_bytes")

    def __init__(self, segments: list[CapturedGraph], breaks: list[_Break], *,
                 inference: bool, memory_bytes: int) -> None:
        assert len(segments) == len(breaks) + 1
        self._segments = segments
        self._breaks = breaks
        self._inference = inference
        self.memory_bytes = memory_bytes

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    @property
    def breaks(self) -> list[str]:
        """The breaks by name, in order (for the capture report and tests)."""
        return [b.name for b in self._breaks]

    def replay(self) -> None:
        segments, breaks = self._segments, self._breaks
        segments[0].replay()
        if not breaks:
            return
        # a break writes into tensors made under the capture's grad mode
        with torch.inference_mode() if self._inference else torch.no_grad():
            for brk, segment in zip(breaks, segments[1:], strict=True):
                brk.run()
                segment.replay()

    def __repr__(self) -> str:
        return f"BreakableGraph({len(self._segments)} segments, breaks={self.breaks})"


class _BreakableCapture:
    """The state of one breakable capture in progress: its segments and breaks."""

    def __init__(self, segments: Segments) -> None:
        self.segments = segments
        self.breaks: list[_Break] = []
        self.eager = False  # inside a break: calls run as they are, nothing is checked

    def brk(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            name: str) -> Any:
        """End the current segment, run ``fn`` eagerly, start the next segment."""
        self.segments.cut()
        self.eager = True
        try:
            out = fn(*args, **kwargs)
        finally:
            self.eager = False
        targets = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.breaks.append(_Break(fn, args, dict(kwargs), targets, name))
        self.segments.resume()
        return out


class _BreakAtOps(TorchFunctionMode):
    """Sees every torch call of the captured forward: a splitting op becomes a break, a host
    sync inside a segment an error."""

    def __init__(self, capture: _BreakableCapture, splitting_ops: tuple[str, ...]) -> None:
        super().__init__()
        self._capture = capture
        self._ops = splitting_ops
        self._matched: dict[Any, str | None] = {}  # func -> the splitting op it is, or None

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        capture = self._capture
        if capture.eager:
            return func(*args, **kwargs)
        op = self._op_of(func)
        if op is not None:
            return capture.brk(func, tuple(args), kwargs, op)
        why = _HOST_SYNCS.get(func)
        if why is not None:
            raise CaptureError(
                f"{why}, which a captured graph cannot do (on a GPU it fails the capture), at "
                f"{_callers_line()}. Move it out of the forward, or make the call a graph break: "
                "add its op to splitting_ops, or decorate the function that makes it with "
                "@ff.graph_break (it then runs eagerly between two graph segments)")
        return func(*args, **kwargs)

    def _op_of(self, func: Any) -> str | None:
        try:
            return self._matched[func]
        except (KeyError, TypeError):
            pass
        op = None
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            if isinstance(func, torch._ops.OpOverload):
                packet, overload = func._schema.name, func._overloadname
            else:
                packet, overload = func._qualified_op_name, None
            for wanted in self._ops:
                if wanted == packet or (overload and wanted == f"{packet}.{overload}"):
                    op = wanted
                    break
        with contextlib.suppress(TypeError):
            self._matched[func] = op
        return op


def _callers_line() -> str:
    """``file:line in function`` of the first frame outside freezeframe's graphs and torch."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "an unknown line"
    return (f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in "
            f"{frame.f_code.co_name}")


def graph_break(fn: _F) -> _F:
    """Mark ``fn`` as a graph break: in a breakable capture (``cudagraph_mode`` PIECEWISE with
    ``mode`` NONE or STOCK_TORCH_COMPILE) each call ends the current graph segment, runs
    ``fn`` eagerly, and starts the next segment; every replay calls ``fn`` again on the same
    tensors. Outside a breakable capture it is exactly ``fn`` (and Dynamo does not trace into
    it: it runs as Python, between compiled graphs).

    For attention implementations and other code that is not a torch op: the function must
    read and write tensors the graph keeps (its arguments, or tensors it returns, which are
    copied into the captured ones on replay), and return the same structure every call."""
    name = getattr(fn, "__qualname__", type(fn).__name__)

    @functools.wraps(fn)
    def call_or_break(*args: Any, **kwargs: Any) -> Any:
        capture = _CURRENT.get()
        if capture is None or capture.eager:
            return fn(*args, **kwargs)
        return capture.brk(fn, args, kwargs, f"@graph_break {name}")

    return torch.compiler.disable(call_or_break)  # type: ignore[return-value]


def break_point(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` (a splitting op's piece of a split graph) as a break of the breakable capture
    in progress, or as it is outside one: how breaks reach the capture where a torch-function
    mode cannot see the op (inside Dynamo's compiled frames)."""

    def call_or_break(*args: Any, **kwargs: Any) -> Any:
        capture = _CURRENT.get()
        if capture is None or capture.eager:
            return fn(*args, **kwargs)
        return capture.brk(fn, args, kwargs, name)

    return call_or_break


class BreakableBackend:
    """A graph backend whose captures break at the splitting ops and at :func:`graph_break`
    functions (see the module docstring); replays and memory as ``inner``'s.

    ``capture_computes`` is True on every inner backend: each segment has run once when the
    capture returns (``cuda`` replays each as it ends, so the break after it reads real
    values), and every break ran eagerly."""

    capture_computes = True
    breakable = True

    def __init__(self, inner: GraphBackend, splitting_ops: tuple[str, ...], *,
                 watch_ops: bool = True) -> None:
        self.inner = inner
        self.name = inner.name
        self.splitting_ops = tuple(splitting_ops)
        # whether the splitting ops are found as the forward calls them (a torch-function
        # mode); off where they reach the capture as break points of a split graph
        self.watch_ops = watch_ops
        self._no_break_logged = False

    def capture(self, fn: Callable[[], Any], *, gc_disable: bool = False,
                error_mode: str = "global") -> tuple[BreakableGraph, Any]:
        inference = torch.is_inference_mode_enabled()
        segmented = getattr(self.inner, "segmented", None)
        if segmented is None:
            raise CaptureError(f"graph backend {self.inner.name!r} cannot capture in segments "
                               "(it has no segmented()); breakable graphs need 'cuda' or "
                               "'emulated'")
        with segmented(gc_disable=gc_disable, error_mode=error_mode) as segments:
            capture = _BreakableCapture(segments)
            token = _CURRENT.set(capture)
            try:
                with _BreakAtOps(capture, self.splitting_ops) if self.watch_ops \
                        else contextlib.nullcontext():
                    output = fn()
            finally:
                _CURRENT.reset(token)
        breaks = capture.breaks
        held = segments.held_bytes(([b.targets for b in breaks], [b.args for b in breaks],
                                    output))
        graph = BreakableGraph(list(segments.graphs), breaks, inference=inference,
                               memory_bytes=held)
        if not breaks and not self._no_break_logged:
            self._no_break_logged = True
            logger.info("a breakable capture met no break (none of splitting_ops %s ran, no "
                        "@graph_break function was called): it is one graph segment",
                        list(self.splitting_ops))
        return graph, output

    def weak_ref(self, output: Any) -> Any:
        return self.inner.weak_ref(output)

    def prepare(self, runnable: Callable[..., Any]) -> Callable[..., Any]:
        return self.inner.prepare(runnable)

    def share_capture(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        return self.inner.share_capture()

    def pool_bytes(self, device: int | None = None) -> int | None:
        return self.inner.pool_bytes(device)

    def __repr__(self) -> str:
        return f"BreakableBackend({self.inner!r}, splitting_ops={list(self.splitting_ops)})"
