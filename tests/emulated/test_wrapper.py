"""What of the graph wrapper's machinery runs only on CPU: the wrapper's replay-once rule for a
backend that only records, shown with a record-only stand-in built on the emulated backend, and
the parts of the ``cuda`` backend that need no GPU (weak-referenced tensors, construction). The
wrapper's policy on every graph backend is tests/scenarios/test_graph_wrapper.py's."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.config import CUDAGraphMode
from freezeframe.context import forward_context
from freezeframe.graphs import CaptureWindow, GraphWrapper
from freezeframe.graphs.backend import resolve_backend
from freezeframe.graphs.cuda import CudaBackend, weak_ref_tensor, weak_ref_tensors
from freezeframe.graphs.emulated import EmulatedBackend
from freezeframe.stats import Stats

PW = CUDAGraphMode.PIECEWISE


def test_weak_ref_tensor_views_the_same_memory() -> None:
    t = torch.arange(6.0).reshape(2, 3)[:, 1:]
    weak = weak_ref_tensor(t)
    assert weak.data_ptr() == t.data_ptr()
    assert (weak.shape, weak.stride(), weak.dtype) == (t.shape, t.stride(), t.dtype)
    t.add_(100)
    assert torch.equal(weak, t)
    nested = weak_ref_tensors({"a": [t], "b": 3})
    assert nested["b"] == 3 and nested["a"][0].data_ptr() == t.data_ptr()


def test_cuda_backend_construction_touches_no_cuda() -> None:
    backend = CudaBackend()  # no pool is created until the first capture
    assert backend.name == "cuda" and "pools=[]" in repr(backend)


class RecordOnlyBackend:
    """Behaves as the cuda backend does at capture: the work is recorded, and the tensors the
    capturing call returns hold no results (NaN here) until the graph is replayed."""

    name = "record-only"
    capture_computes = False

    def __init__(self) -> None:
        self._inner = EmulatedBackend()

    def capture(self, fn: Callable[[], object], *, gc_disable: bool = False
                ) -> tuple[object, object]:
        graph, output = self._inner.capture(fn, gc_disable=gc_disable)
        assert isinstance(output, torch.Tensor)
        output.fill_(float("nan"))
        return graph, output

    def weak_ref(self, output: object) -> object:
        return output


def test_a_backend_that_only_records_is_replayed_once_so_the_capturing_call_is_right() -> None:
    stats = Stats()
    w = GraphWrapper(lambda a: a * 3, PW, RecordOnlyBackend(), stats=stats,  # type: ignore[arg-type]
                     window=CaptureWindow())
    x = torch.tensor([1.0, 2.0])
    with ff.forward_context(2, mode=PW):
        assert w(x).tolist() == [3.0, 6.0]  # the capturing call: real values, not NaN
        x.copy_(torch.tensor([5.0, 7.0]))
        assert w(x).tolist() == [15.0, 21.0]
    assert (stats.graphs_captured, stats.replays) == (1, 1)  # the capture's own run is no replay


def test_a_graph_of_a_collected_owner_is_never_served_to_one_with_its_id() -> None:
    """Graphs are kept by the owner's id and purged once the owner is collected; between the
    two (another thread purging), a new owner may get the collected one's id. Its lookup checks
    the very owner, so it captures its own graph instead of replaying the dead owner's (the
    recycled id is simulated by moving the entry under the new owner's id)."""
    class Owner:
        pass

    calls: list[int] = []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * 2 + 1

    backend = resolve_backend("emulated")
    assert backend is not None
    wrapper = GraphWrapper(double, "full", backend, stats=Stats(), window=CaptureWindow())
    desc = BatchDescriptor(4)
    first, second = Owner(), Owner()
    with torch.no_grad(), forward_context(desc, mode="full", owner=first):
        wrapper(torch.ones(4))
    # as if ``second`` had ``first``'s id (the key's last item: whether the graph's memory is
    # inference tensors)
    dead = wrapper._entries.pop((id(first), desc, False))
    wrapper._entries[(id(second), desc, False)] = dead
    del first
    gc.collect()
    wrapper._gone.clear()  # ... and another thread had taken the purge
    with torch.no_grad(), forward_context(desc, mode="full", owner=second):
        out = wrapper(torch.full((4,), 5.0))
    assert len(calls) == 2 and torch.equal(out, torch.full((4,), 11.0))
    assert wrapper.stats.replays == 0 and wrapper.stats.graphs_captured == 2

