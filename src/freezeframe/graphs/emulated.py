"""The ``emulated`` graph backend: a faithful CPU stand-in for a CUDA graph.

It exists so that tests (ours and users' CI) can exercise capture and replay without a GPU, and
so that they fail in the same ways a real CUDA graph fails. It is not a speed feature.

How it works. A *capture* runs the region once under a :class:`~torch.utils._python_dispatch.
TorchDispatchMode` that records every ATen operation the region performs, together with the
exact tensor objects it read and wrote — the static inputs, the weights and every intermediate
allocated during the capture (those intermediates are the graph's private "pool": the graph
keeps them alive and reuses them on every replay). A *replay* re-executes only the recorded
operations on those same tensors and writes each result into the tensor the capture produced,
so the outputs a replay leaves behind are the very tensor objects the capture returned.

That reproduces what makes CUDA graphs hard:

* Python code inside the captured region does not run again on replay (a counter incremented
  by a custom op's Python body stays put), because only ATen operations were recorded;
* a caller who passes a *new* tensor instead of writing fresh data into the captured input
  gets results computed from the stale captured input;
* the returned outputs are overwritten by the next replay of the same graph;
* an operation that would synchronize the host with the device during capture (``.item()``,
  ``nonzero``, boolean-mask indexing, any data-dependent output shape) raises
  :class:`~freezeframe.errors.CaptureError` naming the op.

Differences from the ``cuda`` backend, on purpose and documented: the capturing call computes
for real (on CUDA the capture only records kernels, so its output holds garbage) — tests must
rely on replay outputs only; and each emulated graph owns its intermediates, so there is no
cross-graph pool reuse (a replay overwrites its own graph's outputs, not other graphs').

The recording itself (custom ops, collectives, the :func:`opaque` marking of kernels a dispatch
mode cannot see) is :mod:`freezeframe.graphs.emulated_recorder`; this module holds what a
capture becomes: :class:`EmulatedGraph`, its memory count, and the backend's segmented capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from freezeframe.graphs.emulated_recorder import Recorder, Step, active_recorder, is_opaque, opaque

__all__ = ["EmulatedBackend", "EmulatedGraph", "is_opaque", "opaque"]


def _held_bytes(steps: Sequence[Step], output: Any, born: set[int]) -> int:
    """Bytes of the distinct storages allocated during the capture that ``steps`` or the
    captured ``output`` (which the graph's owner keeps) hold: each storage once, whole, however
    many views of it there are."""
    sizes: dict[int, int] = {}
    held = [(step.targets, step.args, step.kwargs) for step in steps]
    for leaf in pytree.tree_leaves((held, output)):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in born:
                sizes[ptr] = storage.nbytes()
    return sum(sizes.values())


class EmulatedGraph:
    """The recorded steps of one capture; :meth:`replay` re-runs them on the same tensors.

    ``memory_bytes`` is the graph's own memory: the bytes of the distinct storages allocated
    during the capture that the recorded steps or the captured output hold (the outputs a
    replay writes into, the buffers an ``out=`` op writes into, an allocated output a splitting
    op fills after the graph), each storage counted once. The static inputs and the
    weights it reads are not counted; they existed before the capture. Unlike CUDA graphs, which
    share one pool (a smaller graph captured after a larger one reuses its memory), every
    emulated graph holds its own tensors, so the memory of several graphs is their sum.
    """

    __slots__ = ("_inference", "_steps", "memory_bytes")

    def __init__(self, steps: list[Step], *, inference: bool, output: Any = None,
                 born: set[int] | None = None) -> None:
        # Each step reads the memory its tensors had at the capture, as a CUDA graph reads
        # the captured addresses (pinned here, after the capture: made in the recorder, below
        # autograd, an alias would not share its tensor's version counter)
        for step in steps:
            step.pin()
        self._steps = steps
        # Replay under the grad mode of the capture: tensors made under inference_mode can
        # only be written to under inference_mode; otherwise no_grad keeps autograd out of it.
        self._inference = inference
        self.memory_bytes: int = _held_bytes(steps, output, born) if born else 0

    @property
    def ops(self) -> list[str]:
        """The recorded steps by name, in order (for tests and debugging)."""
        return [step.name for step in self._steps]

    def replay(self) -> None:
        mode = torch.inference_mode() if self._inference else torch.no_grad()
        with mode:
            for step in self._steps:
                step.run()

    def __repr__(self) -> str:
        return f"EmulatedGraph({len(self._steps)} steps, {self.memory_bytes} bytes)"


class _EmulatedSegments:
    """The segments of one emulated breakable capture: a recorder per segment."""

    def __init__(self) -> None:
        self.graphs: list[EmulatedGraph] = []
        self._recorder: Recorder | None = None
        self._inference = torch.is_inference_mode_enabled()
        self._born: set[int] = set()
        self._steps: list[Step] = []  # every segment's, for the memory count

    def resume(self) -> None:
        assert self._recorder is None, "resume() twice"
        self._recorder = Recorder()
        self._recorder.__enter__()

    def cut(self) -> None:
        recorder, self._recorder = self._recorder, None
        assert recorder is not None, "cut() outside a segment"
        recorder.__exit__(None, None, None)
        inference = self._inference or recorder.saw_inference
        self._born |= recorder.born
        self._steps.extend(recorder.steps)
        # its memory is counted once for the whole capture (held_bytes): segments share it
        self.graphs.append(EmulatedGraph(recorder.steps, inference=inference))

    def abandon(self) -> None:
        """After a failure inside a segment: stop recording (nothing is kept)."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)

    def held_bytes(self, extra: Any) -> int:
        """The bytes of the storages allocated during the capture that its steps, or
        ``extra`` (the breaks' tensors, the output), keep alive: each storage once."""
        return _held_bytes(self._steps, extra, self._born)

class EmulatedBackend:
    """Graph backend for CPU tests and CI; see the module docstring for what it guarantees."""

    name = "emulated"
    capture_computes = True  # the captured function runs for real while it is recorded

    def capture(self, fn: Callable[[], Any], *, gc_disable: bool = False,
                error_mode: str = "global") -> tuple[EmulatedGraph, Any]:
        # gc_disable has nothing to suppress here: no allocator cache is flushed per capture;
        # error_mode neither: the recorder sees only its own thread (and threads that join it).
        recorder = Recorder()
        inference = torch.is_inference_mode_enabled()
        with recorder:
            output = fn()
        # A region that entered inference_mode itself (a compiled model does) made inference
        # tensors, which only inference_mode may write again on replay.
        inference = inference or recorder.saw_inference
        graph = EmulatedGraph(recorder.steps, inference=inference, output=output,
                              born=recorder.born)
        return graph, output

    @contextlib.contextmanager
    def segmented(self, *, gc_disable: bool = False,
                  error_mode: str = "global") -> Iterator[_EmulatedSegments]:
        """A capture in segments (see :mod:`freezeframe.graphs.breakable`): each segment is
        one recorder's steps; between :meth:`_EmulatedSegments.cut` and ``resume`` nothing is
        recorded."""
        segments = _EmulatedSegments()
        segments.resume()
        try:
            yield segments
        except BaseException:
            segments.abandon()
            raise
        segments.cut()

    def weak_ref(self, output: Any) -> Any:
        # Every emulated graph keeps its own tensors alive anyway; a weak view would save
        # nothing, so the output is returned as it is.
        return output

    def prepare(self, runnable: Callable[..., Any]) -> Callable[..., Any]:
        return opaque(runnable)

    def share_capture(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        recorder = active_recorder()
        if recorder is None:  # not inside a capture: nothing to join
            return contextlib.nullcontext
        return lambda: Recorder(joining=recorder)

    def pool_bytes(self, device: int | None = None) -> int | None:
        return None  # no shared pool: each emulated graph holds its own tensors

    def __repr__(self) -> str:
        return "EmulatedBackend()"
