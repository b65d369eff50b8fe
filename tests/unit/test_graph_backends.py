"""The cuda backend's control flow, checked on CPU against a recording fake of ``torch.cuda``.

The real thing runs in tests/cuda/test_cuda_graphs.py on a GPU; this file pins down what can be
checked anywhere: one pool per device reused across captures, gc/flush only for the first piece
(no patching — simply not called), the side stream when the caller is on the default stream,
capture_end on failure and CUDA capture errors turned into CaptureError.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from freezeframe.errors import CaptureError
from freezeframe.graphs import GraphBackend
from freezeframe.graphs.cuda import CudaBackend


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_on: list[str] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_on.append(other.name)


class FakeCuda:
    """Just enough of torch.cuda for CudaBackend.capture, recording every call."""

    def __init__(self, current_is_default: bool) -> None:
        self.log: list[str] = []
        self.default = FakeStream("default")
        self.current = self.default if current_is_default else FakeStream("runner")
        self.pools = 0
        self.invalidate = False
        self.graphs: list[FakeGraph] = []
        outer = self

        class FakeGraph:
            def __init__(self) -> None:
                self.replays = 0
                outer.graphs.append(self)

            def capture_begin(self, pool: Any = None, capture_error_mode: str = "") -> None:
                outer.log.append(f"begin(pool={pool},mode={capture_error_mode},"
                                 f"stream={outer.current.name})")

            def capture_end(self) -> None:
                outer.log.append("end")
                if outer.invalidate:  # CUDA invalidated the capture (a host sync inside it)
                    raise RuntimeError("CUDA error: operation failed due to a previous error "
                                       "during capture")

            def replay(self) -> None:
                self.replays += 1

        self.CUDAGraph = FakeGraph

    def current_device(self) -> int:
        return 0

    def current_stream(self, device: int | None = None) -> FakeStream:
        return self.current

    def default_stream(self, device: int | None = None) -> FakeStream:
        return self.default

    def Stream(self, device: int | None = None) -> FakeStream:
        return FakeStream("side")

    def graph_pool_handle(self) -> str:
        self.pools += 1
        return f"pool{self.pools}"

    def synchronize(self, device: int | None = None) -> None:
        self.log.append("sync")

    def empty_cache(self) -> None:
        self.log.append("empty_cache")

    @contextlib.contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, s
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        yield


@pytest.fixture(params=[True, False], ids=["default-stream", "runner-stream"])
def fake_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda(current_is_default=request.param)
    for name in ("CUDAGraph", "current_device", "current_stream", "default_stream", "Stream",
                 "graph_pool_handle", "synchronize", "empty_cache", "stream", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(gc, "collect", lambda *a: fake.log.append("gc") or 0)
    return fake


def test_protocol() -> None:
    backend = CudaBackend()
    assert isinstance(backend, GraphBackend)
    assert (backend.name, backend.capture_computes) == ("cuda", False)  # the wrapper replays


def test_first_piece_flushes_later_pieces_do_not(fake_cuda: FakeCuda) -> None:
    backend = CudaBackend()
    stream = "side" if fake_cuda.current is fake_cuda.default else "runner"

    graph, out = backend.capture(lambda: "first", gc_disable=False)
    assert out == "first"
    assert fake_cuda.log == ["sync", "gc", "empty_cache",
                             f"begin(pool=pool1,mode=global,stream={stream})", "end"]
    fake_cuda.log.clear()
    backend.capture(lambda: "second", gc_disable=True)
    assert fake_cuda.log == ["sync", f"begin(pool=pool1,mode=global,stream={stream})", "end"]
    assert fake_cuda.pools == 1  # one pool per device, shared by every capture

    graph.replay()
    assert fake_cuda.graphs[0].replays == 1


def test_side_stream_is_ordered_around_the_capture(fake_cuda: FakeCuda) -> None:
    backend = CudaBackend()
    kept = [backend.capture(lambda: None)[0] for _ in range(2)]  # the pool's graphs live on
    assert len(kept) == 2 and backend.pools_replaced == 0
    if fake_cuda.current is fake_cuda.default:
        side = backend._side_streams[0]
        assert side.waited_on == ["default", "default"]  # waits for the caller's work
        assert fake_cuda.default.waited_on == ["side", "side"]  # caller waits for it
    else:
        assert backend._side_streams == {}


@pytest.fixture
def pool_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, Any]]:
    """The allocator pool functions a failed capture calls, recorded instead of run."""
    calls: list[tuple[str, int, Any]] = []
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        monkeypatch.setattr(torch._C, name,
                            lambda index, pool, name=name: calls.append((name, index, pool)),
                            raising=False)
    return calls


def test_failed_capture_ends_capture_and_reraises(fake_cuda: FakeCuda,
                                                  pool_calls: list[Any]) -> None:
    backend = CudaBackend()

    def boom() -> None:
        raise ValueError("user bug")

    with pytest.raises(ValueError, match="user bug"):
        backend.capture(boom, gc_disable=True)
    assert fake_cuda.log[-1] == "end"
    # capture_end succeeded: the graph gives its pool back itself (a second release aborts)
    assert pool_calls == []
    assert backend.pools_replaced == 1
    _kept, _ = backend.capture(lambda: None, gc_disable=True)
    assert fake_cuda.log[-2].startswith("begin(pool=pool2,")


def test_an_invalidated_capture_ends_the_pool_allocation_by_hand(
        fake_cuda: FakeCuda, pool_calls: list[Any]) -> None:
    """torch 2.11 raises in capture_end before it stops routing allocations to the pool, and
    a graph whose capture never ended does not give its pool reference back: both by hand,
    then a fresh pool."""
    backend = CudaBackend()
    fake_cuda.invalidate = True

    def sync_inside() -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with pytest.raises(CaptureError, match="host sync"):
        backend.capture(sync_inside, gc_disable=True)
    assert pool_calls == [("_cuda_endAllocateToPool", 0, "pool1"),
                          ("_cuda_releasePool", 0, "pool1")]
    fake_cuda.invalidate = False
    _kept, _ = backend.capture(lambda: None, gc_disable=True)
    assert fake_cuda.log[-2].startswith("begin(pool=pool2,")
    assert backend.pools_replaced == 1


def test_a_pool_whose_graphs_are_all_gone_is_not_captured_into_again(
        fake_cuda: FakeCuda) -> None:
    """The first capture leaves blocks (cuBLAS's workspace) that outlive the pool's graphs;
    torch's allocator asserts when a capture goes into such a pool again."""
    backend = CudaBackend()
    first, _ = backend.capture(lambda: None, gc_disable=True)
    second, _ = backend.capture(lambda: None, gc_disable=True)
    del first  # one graph of the pool is left: the pool stays
    third, _ = backend.capture(lambda: None, gc_disable=True)
    assert (fake_cuda.pools, backend.pools_replaced) == (1, 0)
    del second, third
    gc.collect()
    _kept, _ = backend.capture(lambda: None, gc_disable=True)
    assert (fake_cuda.pools, backend.pools_replaced) == (2, 1)
    assert fake_cuda.log[-2].startswith("begin(pool=pool2,")
    if fake_cuda.current is fake_cuda.default:
        assert fake_cuda.log[-2].endswith("stream=side)")
        assert backend._side_streams[0] is not None


def test_cuda_capture_errors_become_capture_errors(fake_cuda: FakeCuda) -> None:
    backend = CudaBackend()

    def sync_inside() -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with pytest.raises(CaptureError, match=r"host sync.*\.item\(\).*CUDA said: CUDA error"):
        backend.capture(sync_inside, gc_disable=True)
    assert fake_cuda.log[-1] == "end"

    def window_closed() -> None:
        raise CaptureError("capture window is closed")

    with pytest.raises(CaptureError, match=r"^capture window is closed$"):
        backend.capture(window_closed, gc_disable=True)
