"""What only the real ``cuda`` backend can show (needs a GPU): the shared pool, the allocator
flush once per forward, weak-referenced outputs, and CUDA refusing host syncs during capture.
The graph scenarios every backend shares run in tests/scenarios on ``cuda`` as well.

Every test runs on a side stream, as a model runner does: warm-up, capture and replay on the
same non-default stream (capturing on the legacy default stream is not allowed, and lazily
created per-stream state such as cuBLAS workspaces is then made before capture).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from freezeframe.batch import BatchDescriptor
from freezeframe.compilation import compile as ff_compile
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import forward_context
from freezeframe.errors import CaptureError
from freezeframe.graphs import CaptureWindow, GraphOptions, GraphWrapper, resolve_backend
from freezeframe.graphs.cuda import CudaBackend
from freezeframe.stats import Stats
from tests.helpers.configs import silly_config
from tests.helpers.toy_models import (
    SillyModel,
)

pytestmark = pytest.mark.cuda

PW = CUDAGraphMode.PIECEWISE
FULL = CUDAGraphMode.FULL
NONE = CUDAGraphMode.NONE
DEV = "cuda"


@pytest.fixture(autouse=True)
def side_stream() -> Iterator[torch.cuda.Stream]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        yield stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def config(cudagraph_mode: str = "piecewise", **changes: Any) -> CompilationConfig:
    return silly_config(changes.pop("graph_backend", "cuda"), cudagraph_mode, **changes)


def run(model: Any, mode: CUDAGraphMode, desc: int | BatchDescriptor | None,
        *args: torch.Tensor) -> Any:
    with forward_context(desc, mode=mode):
        return model(*args)


def host(t: torch.Tensor) -> torch.Tensor:
    """Copy to the host after the replay that produced ``t`` finished."""
    torch.cuda.current_stream().synchronize()
    return t.detach().cpu()


# -- the wrapper on a plain callable -------------------------------------------------------------
def test_resolve_backend_gives_cuda() -> None:
    assert isinstance(resolve_backend(config()), CudaBackend)
    assert isinstance(resolve_backend(config(graph_backend="auto")), CudaBackend)


def test_wrapper_captures_then_replays_on_the_captured_buffer() -> None:
    calls = [0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.relu(x * 2 + 1)

    backend = CudaBackend()
    w = GraphWrapper(fn, PW, backend, stats=Stats(), window=CaptureWindow())
    buf = torch.zeros(4, device=DEV)
    fn(buf)  # warm-up outside the graph
    with forward_context(4, mode=PW):
        assert torch.equal(host(w(buf)), torch.ones(4))  # capture, then one replay: a result
        buf.copy_(torch.tensor([-3.0, 0.0, 1.0, 2.0], device=DEV))
        out = w(buf)
        assert torch.equal(host(out), torch.tensor([0.0, 1.0, 3.0, 5.0]))
        buf.fill_(10.0)
        again = w(buf)
    assert again is out  # the same tensor, overwritten by the replay
    assert torch.equal(host(again), torch.full((4,), 21.0))
    assert calls[0] == 2  # warm-up + capture; replays ran no Python
    assert (w.stats.graphs_captured, w.stats.replays) == (1, 2)  # the capture's run is no replay
    graph = w.graph_for(BatchDescriptor(4))
    assert graph is not None and graph.graph.pool() == backend.pool()


def test_a_failed_capture_leaves_the_stream_usable_and_the_next_capture_works() -> None:
    calls = [0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        y = x * 3
        if calls[0] == 2:  # the first capture (after the warm-up below)
            raise RuntimeError("injected at capture")
        return y + 1

    stats = Stats()
    w = GraphWrapper(fn, PW, CudaBackend(), stats=stats, window=CaptureWindow())
    buf = torch.ones(4, device=DEV)
    fn(buf)  # warm-up outside the graph
    stream = torch.cuda.current_stream()
    with forward_context(4, mode=PW):
        with pytest.raises(RuntimeError, match="injected at capture"):
            w(buf)
        assert not torch.cuda.is_current_stream_capturing()
        assert torch.cuda.current_stream() == stream
        assert w.captured_descriptors == [] and stats.graphs_captured == 0
        assert torch.equal(host(w(buf)), torch.full((4,), 4.0))  # captures, then replays once
        buf.fill_(2.0)
        assert torch.equal(host(w(buf)), torch.full((4,), 7.0))
    assert (stats.graphs_captured, stats.replays) == (1, 1)


def test_weak_ref_output_views_the_pool_memory() -> None:
    backend = CudaBackend()
    w = GraphWrapper(lambda x: x + 1, PW, backend, GraphOptions(weak_ref_output=True),
                     stats=Stats(), window=CaptureWindow())
    buf = torch.zeros(3, device=DEV)
    with forward_context(3, mode=PW):
        captured = w(buf)
        buf.fill_(4.0)
        out = w(buf)
    assert out is captured
    assert torch.equal(host(out), torch.full((3,), 5.0))


def test_gc_runs_only_for_the_first_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ff_compile(SillyModel().to(DEV), config("piecewise"))
    buf = torch.zeros(8, device=DEV)
    run(model, NONE, None, buf)
    collections = [0]
    real_collect = gc.collect

    def counting_collect(*args: Any) -> int:
        collections[0] += 1
        return real_collect(*args)

    monkeypatch.setattr(gc, "collect", counting_collect)
    with model.stats.expect(graphs_captured=3):
        run(model, PW, 2, buf[:2])
    assert collections[0] == 1  # 3 pieces captured, one collection


# -- what only the cuda backend has -------------------------------------------------------------
def test_one_pool_for_every_piece_and_size() -> None:
    model = ff_compile(SillyModel().to(DEV), config("piecewise"))
    buf = torch.zeros(100, device=DEV)
    run(model, NONE, None, buf)
    run(model, PW, 2, buf[:2])
    run(model, PW, 1, buf[:1])
    pools = {w.graph_for(BatchDescriptor(n)).graph.pool()  # type: ignore[union-attr]
             for w in model.graph_wrappers() for n in (1, 2)}
    assert pools == {model.graph_backend.pool()}  # type: ignore[union-attr]


# -- host syncs during capture (last: a failed capture is the roughest thing we do to CUDA) ----
def test_item_inside_a_capture_is_a_capture_error() -> None:
    backend = CudaBackend()
    x = torch.ones(2, device=DEV)
    x.sum().item()  # warm-up

    w = GraphWrapper(lambda t: t * float(t.sum().item()), PW, backend, stats=Stats(),
                     window=CaptureWindow())
    with forward_context(2, mode=PW), pytest.raises(CaptureError, match="captured region"):
        w(x)
    assert w.captured_descriptors == []


def test_a_capture_that_raises_on_another_stream_is_ended_and_the_next_one_works() -> None:
    """The captured code switches the current stream and raises (its own error, which must
    reach the caller unchanged). The capture must still be ended on the stream it began on,
    the caller's stream must be current again, nothing is stored, and the next call captures
    and replays correctly."""
    other = torch.cuda.Stream()
    calls = [0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        y = x * 3
        if calls[0] == 1:
            torch.cuda.set_stream(other)
            raise ValueError("injected at capture")
        return y + 1

    stats = Stats()
    w = GraphWrapper(fn, PW, CudaBackend(), stats=stats, window=CaptureWindow())
    buf = torch.ones(4, device=DEV)
    caller = torch.cuda.current_stream()
    with forward_context(4, mode=PW):
        with pytest.raises(ValueError, match=r"^injected at capture$"):
            w(buf)
        assert torch.cuda.current_stream() == caller
        assert not torch.cuda.is_current_stream_capturing()
        with torch.cuda.stream(other):
            assert not torch.cuda.is_current_stream_capturing()
        assert w.captured_descriptors == [] and stats.graphs_captured == 0
        assert torch.equal(host(w(buf)), torch.full((4,), 4.0))  # captures, replays once
        buf.fill_(2.0)
        assert torch.equal(host(w(buf)), torch.full((4,), 7.0))
    assert (calls[0], stats.graphs_captured, stats.replays) == (2, 1, 1)
    torch.cuda.synchronize()


def test_an_item_in_a_failed_capture_leaves_the_next_capture_working() -> None:
    """A host sync invalidates the capture (CUDA refuses it): a CaptureError, then the same
    wrapper captures a correct region and replays it."""
    x = torch.ones(2, device=DEV)
    x.sum().item()  # warm-up
    calls = [0]

    def fn(t: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 1:
            return t * float(t.sum().item())
        return t * 5

    stats = Stats()
    backend = CudaBackend()
    w = GraphWrapper(fn, PW, backend, stats=stats, window=CaptureWindow())
    with forward_context(2, mode=PW):
        with pytest.raises(CaptureError, match="captured region"):
            w(x)
        assert not torch.cuda.is_current_stream_capturing()
        assert backend.pools_replaced == 1  # the invalidated capture's pool is retired
        assert torch.equal(host(w(x)), torch.full((2,), 5.0))
        x.fill_(3.0)
        assert torch.equal(host(w(x)), torch.full((2,), 15.0))
    assert (stats.graphs_captured, stats.replays) == (1, 1)


def test_two_invalidated_captures_in_a_row_leave_capture_working() -> None:
    """torch 2.11 leaves an invalidated capture's pool marked as recording; a second capture
    into it used to fail outside the error handling ("already recording to mempool_id")."""
    x = torch.ones(2, device=DEV)
    x.sum().item()  # warm-up
    calls = [0]

    def fn(t: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] <= 2:
            return t * float(t.sum().item())
        return t * 5

    stats = Stats()
    backend = CudaBackend()
    w = GraphWrapper(fn, PW, backend, stats=stats, window=CaptureWindow())
    with forward_context(2, mode=PW):
        for _ in range(2):
            with pytest.raises(CaptureError, match="captured region"):
                w(x)
        assert torch.equal(host(w(x)), torch.full((2,), 5.0))
    assert (stats.graphs_captured, backend.pools_replaced) == (1, 2)


def test_capturing_after_every_graph_of_the_pool_is_gone_takes_a_fresh_pool() -> None:
    """The first capture allocates cuBLAS's workspace in the pool, which keeps the pool alive
    after its graphs are dropped; capturing into it again tripped an allocator assert."""
    backend = CudaBackend()
    weight = torch.randn(64, 64, device=DEV)
    # cuBLAS's handle exists (made by a matmul on another stream), but this stream's workspace
    # does not: the first capture allocates it, in the pool (creating the handle itself inside
    # a capture fails: CUBLAS_STATUS_NOT_INITIALIZED, seen on the H100)
    with torch.cuda.stream(torch.cuda.Stream()):
        weight @ weight
    torch.cuda.synchronize()
    stats = Stats()
    w = GraphWrapper(lambda t: torch.relu(t @ weight), PW, backend, stats=stats,
                     window=CaptureWindow())
    buf = torch.randn(8, 64, device=DEV)
    with forward_context(8, mode=PW):
        torch.testing.assert_close(host(w(buf)), host(torch.relu(buf @ weight)))
    first_pool = backend.pool()
    w.clear()
    gc.collect()
    with forward_context(8, mode=PW):
        torch.testing.assert_close(host(w(buf)), host(torch.relu(buf @ weight)))
        buf.mul_(-2)
        torch.testing.assert_close(host(w(buf)), host(torch.relu(buf @ weight)))
    assert backend.pools_replaced == 1 and backend.pool() != first_pool
    assert (stats.graphs_captured, stats.replays) == (2, 1)
