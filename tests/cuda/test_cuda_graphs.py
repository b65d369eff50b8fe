"""The graph scenarios of tests/emulated on the real ``cuda`` backend (needs a GPU).

Differences from the emulated versions, all inherent to CUDA graphs:

* a capture only records kernels; the wrapper then replays the new graph once, so the
  capturing call's output is a result here too (checked below);
* a replayed output lives in the shared graph pool and may be overwritten by the next replay of
  *any* graph of the model, so each one is compared (or cloned) before the next call;
* every test runs on a side stream, as a model runner does: warm-up, capture and replay on
  the same non-default stream (capturing on the legacy default stream is not allowed, and
  lazily created per-stream state such as cuBLAS workspaces is then made before capture).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from freezeframe.batch import BatchDescriptor
from freezeframe.compilation import CompiledModel
from freezeframe.compilation import compile as ff_compile
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.context import forward_context
from freezeframe.errors import CaptureError, InputMismatchError
from freezeframe.graphs import CaptureWindow, GraphOptions, GraphWrapper, resolve_backend
from freezeframe.graphs.cuda import CudaBackend
from freezeframe.stats import Stats
from tests.helpers import silly
from tests.helpers.configs import silly_config
from tests.helpers.toy_models import (
    LlamaConfig,
    SillyModel,
    ToyLlama,
    TwoSubmodulesModel,
    tractable_reference,
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
    return silly_config("cuda", cudagraph_mode, **changes)


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


def test_the_capturing_call_of_a_piecewise_model_equals_eager() -> None:
    """Between pieces the splitting op runs eagerly on the previous piece's output: that output
    must hold values already during the capturing call, or every later piece sees garbage."""
    module = SillyModel().to(DEV)
    model = ff_compile(SillyModel().to(DEV), config("piecewise"))
    buf = torch.zeros(8, device=DEV)
    run(model, NONE, None, buf)
    buf[:4].copy_(torch.arange(4.0, device=DEV))
    want = host(module(buf[:4].clone()))
    with model.stats.expect(graphs_captured=3, replays=0):
        got = host(run(model, PW, 4, buf[:4]))
    torch.testing.assert_close(got, want)


# -- §7.3 the silly model -------------------------------------------------------------------
def test_silly_piecewise_captures_six_and_attention_runs_outside() -> None:
    model = ff_compile(SillyModel().to(DEV), config("piecewise"))
    buf = torch.zeros(100, device=DEV)
    with model.stats.expect(graphs_traced=1, pieces=5, capturable_pieces=3,
                            backend_compilations=3, graphs_captured=6):
        buf.copy_(torch.randn(100, device=DEV))
        run(model, NONE, None, buf)
        buf[:2].copy_(torch.randn(2, device=DEV))
        run(model, PW, 2, buf[:2])
        buf[:1].copy_(torch.randn(1, device=DEV))
        run(model, PW, 1, buf[:1])
    pools = {w.graph_for(BatchDescriptor(n)).graph.pool()  # type: ignore[union-attr]
             for w in model.graph_wrappers() for n in (1, 2)}
    assert len(pools) == 1  # one shared pool for every piece and size

    silly.reset_counter()
    buf[:2].zero_()
    with model.stats.expect(graphs_captured=0, replays=3):
        out = run(model, PW, 2, buf[:2])
    assert torch.equal(host(out), torch.tensor([19.0, 19.0]))
    assert silly.get_counter() == 2

    buf[:1].fill_(1.0)
    assert torch.equal(host(run(model, PW, 1, buf[:1])), torch.tensor([28.0]))
    assert silly.get_counter() == 4


def test_silly_full_replays_the_whole_forward_without_python() -> None:
    model = ff_compile(SillyModel().to(DEV), config("full"))
    buf = torch.zeros(100, device=DEV)
    with model.stats.expect(graphs_traced=1, graphs_captured=2):
        buf.copy_(torch.randn(100, device=DEV))
        run(model, NONE, None, buf)
        buf[:2].copy_(torch.randn(2, device=DEV))
        run(model, FULL, 2, buf[:2])
        buf[:1].copy_(torch.randn(1, device=DEV))
        run(model, FULL, 1, buf[:1])

    silly.reset_counter()
    buf[:2].zero_()
    with model.stats.expect(graphs_captured=0, replays=1):
        out = run(model, FULL, 2, buf[:2])
    assert torch.equal(host(out), torch.tensor([19.0, 19.0]))
    assert silly.get_counter() == 0


def test_not_refreshing_the_static_input_gives_stale_results() -> None:
    model = ff_compile(SillyModel().to(DEV), config("piecewise"))
    buf = torch.zeros(8, device=DEV)
    run(model, NONE, None, buf)
    buf[:2].fill_(1.0)
    run(model, PW, 2, buf[:2])
    out = run(model, PW, 2, torch.zeros(2, device=DEV))  # not written into buf[:2]
    assert torch.equal(host(out), torch.tensor([28.0, 28.0]))
    buf[:2].zero_()
    assert torch.equal(host(run(model, PW, 2, buf[:2])), torch.tensor([19.0, 19.0]))


def test_debug_mode_names_the_changed_input_address() -> None:
    model = ff_compile(SillyModel().to(DEV), config("piecewise", debug=True))
    buf = torch.zeros(8, device=DEV)
    run(model, NONE, None, buf)
    run(model, PW, 2, buf[:2])
    run(model, PW, 2, buf[:2])
    stranger = torch.zeros(2, device=DEV)
    with pytest.raises(InputMismatchError) as info:
        run(model, PW, 2, stranger)
    message = str(info.value)
    assert f"{buf.data_ptr():#x}" in message and f"{stranger.data_ptr():#x}" in message
    assert "Copy the new data into the captured buffer" in message


def test_capture_outside_the_window_raises() -> None:
    model = ff_compile(SillyModel().to(DEV), config("piecewise"))
    buf = torch.zeros(8, device=DEV)
    run(model, NONE, None, buf)
    run(model, PW, 2, buf[:2])
    model.capture_window.close()
    run(model, PW, 2, buf[:2])
    with pytest.raises(CaptureError, match=r"num_tokens=1.*capture window is closed"):
        run(model, PW, 1, buf[:1])
    with model.capture_window.opened(), model.stats.expect(graphs_captured=3):
        run(model, PW, 1, buf[:1])


# -- §7.11 nesting ----------------------------------------------------------------------------
def test_full_and_piecewise_wrappers_nest() -> None:
    model = ff_compile(SillyModel().to(DEV), config("full_and_piecewise"))
    buf = torch.zeros(8, device=DEV)
    run(model, NONE, None, buf)
    full_desc = BatchDescriptor(2, num_reqs=2, uniform=True)

    silly.reset_counter()
    with model.stats.expect(graphs_captured=1, bypasses=3, replays=0):
        run(model, FULL, full_desc, buf[:2])
    assert silly.get_counter() == 2
    buf[:2].zero_()
    with model.stats.expect(graphs_captured=0, bypasses=0, replays=1):
        out = run(model, FULL, full_desc, buf[:2])
    assert torch.equal(host(out), torch.tensor([19.0, 19.0]))
    assert silly.get_counter() == 2

    with model.stats.expect(graphs_captured=3, bypasses=1, replays=0):
        run(model, PW, 2, buf[:2])
    assert silly.get_counter() == 4
    buf[:2].fill_(1.0)
    with model.stats.expect(graphs_captured=0, bypasses=1, replays=3):
        out = run(model, PW, 2, buf[:2])
    assert torch.equal(host(out), torch.tensor([28.0, 28.0]))
    assert silly.get_counter() == 6


# -- §7.4 toy Llama ---------------------------------------------------------------------------
def _run_llama(model: torch.nn.Module, mode: CUDAGraphMode) -> torch.Tensor:
    input_ids = torch.randint(0, 128, (16,), device=DEV)
    positions = torch.arange(16, device=DEV)
    run(model, NONE, None, input_ids, positions)
    if mode is not NONE:
        run(model, mode, 2, input_ids[:2], positions[:2])
        run(model, mode, 1, input_ids[:1], positions[:1])
    input_ids[:2].zero_()
    return host(run(model, mode, 2, input_ids[:2], positions[:2]))


@pytest.mark.parametrize("num_layers", [2, 12])
def test_toy_llama_captures_two_per_capturable_piece(num_layers: int) -> None:
    cfg = LlamaConfig(num_layers=num_layers, tractable_init=num_layers == 2)
    torch.manual_seed(0)
    model = ff_compile(ToyLlama(cfg).to(DEV), config("piecewise"))
    with model.stats.expect(graphs_traced=1, pieces=2 * num_layers + 1,
                            capturable_pieces=num_layers + 1,
                            backend_compilations=num_layers + 1,
                            graphs_captured=2 * (num_layers + 1), replays=num_layers + 1):
        out = _run_llama(model, PW)
    if cfg.tractable_init:
        expected = tractable_reference(cfg, torch.zeros(2, dtype=torch.long), torch.arange(2))
        assert torch.allclose(out, expected)
    torch.manual_seed(0)
    eager = _run_llama(ToyLlama(cfg).to(DEV), NONE)
    assert torch.allclose(out, eager)


# -- §7.5 two separately compiled submodules --------------------------------------------------
def _two_submodules(cudagraph_mode: str, compiled: list[CompiledModel]) -> torch.nn.Module:
    def wrap(module: torch.nn.Module) -> torch.nn.Module:
        cm = ff_compile(module, config(cudagraph_mode),
                        model_key=f"two_submodules.{len(compiled)}")
        compiled.append(cm)
        return cm

    return TwoSubmodulesModel(wrap=wrap).to(DEV)


def _drive_two(model: torch.nn.Module, mode: CUDAGraphMode) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(32, 128, generator=gen).to(DEV)
    run(model, NONE, None, inputs)
    if mode is not NONE:
        run(model, mode, 2, inputs[:2])
        run(model, mode, 1, inputs[:1])
    fresh = torch.randn(2, 128, generator=gen).to(DEV)
    return host(run(model, mode, 2, fresh))


def test_two_submodules_counts_and_bitwise_equal_outputs() -> None:
    compiled: list[CompiledModel] = []
    out_graphs = _drive_two(_two_submodules("piecewise", compiled), PW)
    assert sum(cm.stats.graphs_traced for cm in compiled) == 2
    assert sum(cm.stats.pieces for cm in compiled) == 6
    assert sum(cm.stats.capturable_pieces for cm in compiled) == 4
    assert sum(cm.stats.backend_compilations for cm in compiled) == 4
    assert sum(cm.stats.graphs_captured for cm in compiled) == 8

    plain: list[CompiledModel] = []
    out_no_graphs = _drive_two(_two_submodules("none", plain), PW)
    assert sum(cm.stats.graphs_captured for cm in plain) == 0

    torch.manual_seed(0)
    out_eager = _drive_two(TwoSubmodulesModel().to(DEV), NONE)
    assert torch.equal(out_graphs, out_no_graphs)
    assert torch.allclose(out_graphs, out_eager, atol=1e-5)


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
    w = GraphWrapper(fn, PW, CudaBackend(), stats=stats, window=CaptureWindow())
    with forward_context(2, mode=PW):
        with pytest.raises(CaptureError, match="captured region"):
            w(x)
        assert not torch.cuda.is_current_stream_capturing()
        assert torch.equal(host(w(x)), torch.full((2,), 5.0))
        x.fill_(3.0)
        assert torch.equal(host(w(x)), torch.full((2,), 15.0))
    assert (stats.graphs_captured, stats.replays) == (1, 1)
