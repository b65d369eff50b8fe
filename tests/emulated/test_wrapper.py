"""GraphWrapper policy on plain callables, with the emulated backend."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.config import CUDAGraphMode
from freezeframe.errors import CaptureError, ConfigError, InputMismatchError
from freezeframe.graphs import CaptureWindow, GraphOptions, GraphWrapper
from freezeframe.graphs.cuda import CudaBackend, weak_ref_tensor, weak_ref_tensors
from freezeframe.graphs.emulated import EmulatedBackend
from freezeframe.stats import Stats

PW = CUDAGraphMode.PIECEWISE
FULL = CUDAGraphMode.FULL


class Counting:
    """``x * 2 + 1`` that counts how often its Python ran."""

    def __init__(self) -> None:
        self.calls = 0
        self.config_name = "counting"  # read through the wrapper by attribute fall-through

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 2 + 1


def make(fn: Callable[..., torch.Tensor], mode: CUDAGraphMode = PW, **kw: object
         ) -> GraphWrapper:
    window = kw.pop("window", CaptureWindow())
    stats = kw.pop("stats", Stats())
    return GraphWrapper(fn, mode, EmulatedBackend(), stats=stats,  # type: ignore[arg-type]
                        window=window, **kw)  # type: ignore[arg-type]


def step(n: int | BatchDescriptor, mode: CUDAGraphMode = PW):  # type: ignore[no-untyped-def]
    return ff.forward_context(n, mode=mode)


def test_calls_through_without_matching_mode() -> None:
    fn = Counting()
    w = make(fn)
    x = torch.ones(2)
    with w.stats.expect(bypasses=3, graphs_captured=0, replays=0):
        assert torch.equal(w(x), torch.full((2,), 3.0))  # no forward context
        with step(None, CUDAGraphMode.NONE):
            w(x)
        with step(2, FULL):  # another wrapper's mode
            w(x)
    assert fn.calls == 3
    assert w.captured_descriptors == []


def test_first_sight_captures_later_sights_replay() -> None:
    fn = Counting()
    w = make(fn)
    x = torch.tensor([1.0, 2.0])
    with w.stats.expect(graphs_captured=1, replays=0, bypasses=0), step(2):
        first = w(x)
    assert fn.calls == 1
    x.copy_(torch.tensor([5.0, 6.0]))
    with w.stats.expect(graphs_captured=0, replays=2), step(2):
        again = w(x)
        assert again is first
        assert torch.equal(again, torch.tensor([11.0, 13.0]))
        x.fill_(0.0)
        w(x)
    assert fn.calls == 1  # replays ran no Python
    assert torch.equal(first, torch.ones(2))  # the stored output was overwritten in place
    assert w.captured_descriptors == [BatchDescriptor(2)]


def test_piecewise_keys_are_relaxed_full_keys_are_not() -> None:
    x = torch.ones(4)
    pw = make(Counting(), PW)
    with step(BatchDescriptor(4, num_reqs=4, uniform=True)):
        pw(x)
    with pw.stats.expect(graphs_captured=0, replays=1), step(BatchDescriptor(4, num_reqs=1)):
        pw(x)
    assert pw.captured_descriptors == [BatchDescriptor(4)]

    full = make(Counting(), FULL)
    with full.stats.expect(graphs_captured=2, replays=1):
        with step(BatchDescriptor(4, num_reqs=4, uniform=True), FULL):
            full(x)
        with step(BatchDescriptor(4, num_reqs=1), FULL):
            full(x)
        with step(BatchDescriptor(4, num_reqs=4, uniform=True), FULL):
            full(x)
    assert full.graph_for(BatchDescriptor(4, num_reqs=1)) is not None
    assert full.graph_for(BatchDescriptor(4)) is None


def test_warmups_run_eagerly_before_capture() -> None:
    fn = Counting()
    w = make(fn, num_warmups=2)
    x = torch.ones(1)
    with w.stats.expect(graphs_captured=1, replays=1, bypasses=0), step(1):
        for _ in range(4):  # warm-up, warm-up, capture, replay
            w(x)
    assert fn.calls == 3


def test_capture_window_closed_raises_naming_descriptor_and_capture() -> None:
    window = CaptureWindow()
    assert window.is_open
    w = make(Counting(), FULL, window=window)
    x = torch.ones(2)
    with step(BatchDescriptor(2, num_reqs=2), FULL):
        w(x)  # captured while open
    window.close()
    assert not window.is_open
    with step(BatchDescriptor(2, num_reqs=2), FULL):
        w(x)  # replay is fine while closed
    desc = BatchDescriptor(3, num_reqs=3)
    with step(desc, FULL), pytest.raises(CaptureError) as info:
        w(x[:1].expand(3))
    message = str(info.value)
    assert repr(desc) in message and "capture window is closed" in message
    assert "runner's capture()" in message
    with window.opened():
        assert window.is_open
        with step(desc, FULL):
            w(torch.ones(3))
    assert not window.is_open  # restored
    assert w.stats.graphs_captured == 2 and w.stats.replays == 1


def test_clear_drops_graphs_and_recaptures() -> None:
    fn = Counting()
    w = make(fn)
    x = torch.ones(2)
    with step(2):
        w(x)
        w.clear()
        assert w.captured_descriptors == []
        with w.stats.expect(graphs_captured=1, replays=0):
            w(x)
    assert fn.calls == 2


def test_unwrap_and_no_attribute_forwarding() -> None:
    """The wrapped runnable is reached through unwrap(), never by attribute fall-through (a
    typo on the wrapper would otherwise read the runnable's attribute silently)."""
    fn = Counting()
    w = make(fn)
    assert w.unwrap() is fn
    assert w.unwrap().config_name == "counting"
    with pytest.raises(AttributeError, match="config_name"):
        _ = w.config_name  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["none", "full_and_piecewise", "full_decode_only"])
def test_wrapper_needs_a_runtime_graph_mode(mode: str) -> None:
    with pytest.raises(ConfigError, match="not a graph mode"):
        make(Counting(), CUDAGraphMode.parse(mode))


def test_options_validated_and_logging(ff_logs: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match=r"GraphOptions.log"):
        GraphOptions(log=1)  # type: ignore[arg-type]
    quiet = make(Counting())
    loud = make(Counting(), options=GraphOptions(log=True))
    with step(2):
        quiet(torch.ones(2))
        loud(torch.ones(2))
    captures = [r for r in ff_logs.records
                if r.levelno == logging.DEBUG and "capturing a PIECEWISE graph" in r.getMessage()]
    assert len(captures) == 1


def test_stats_feed_a_linked_parent() -> None:
    parent = Stats()
    w = make(Counting(), stats=parent.child())
    with step(2):
        w(torch.ones(2))
        w(torch.ones(2))
    w(torch.ones(2))
    assert (parent.graphs_captured, parent.replays, parent.bypasses) == (1, 1, 1)


def test_debug_address_check_names_argument_addresses_and_fix() -> None:
    buffer = torch.zeros(8)  # persistent static buffer
    w = make(lambda a, b: a + b, debug=True)
    weight = torch.ones(2)
    with step(2):
        w(buffer[:2], weight)
        w(buffer[:2], weight)  # a new slice object of the same buffer: same address, fine
        stranger = torch.ones(2)
        with pytest.raises(InputMismatchError) as info:
            w(stranger, weight)
    message = str(info.value)
    assert "argument 0" in message
    assert f"{buffer.data_ptr():#x}" in message and f"{stranger.data_ptr():#x}" in message
    assert "write the new data into the captured buffer" in message
    assert w.stats.replays == 1 and w.stats.replay_input_copies == 0


def test_without_debug_a_new_tensor_is_copied_into_the_captured_one() -> None:
    """A replay reads the captured buffer, so a new tensor is copied there first."""
    w = make(lambda a: a * 10)
    with step(1):
        captured = torch.tensor([1.0])
        w(captured)
        assert w(torch.tensor([5.0])).item() == 50.0
        assert captured.item() == 5.0 and w.stats.replay_input_copies == 1
        captured.fill_(7.0)
        assert w(captured).item() == 70.0
        assert w.stats.replay_input_copies == 1
        strided = torch.tensor([[3.0, 0.0]])[:, 0]  # another layout: copied as well
        assert w(strided).item() == 30.0 and w.stats.replay_input_copies == 2


def test_a_replay_with_other_arguments_is_an_error() -> None:
    w = make(lambda a, b=None: a if b is None else a + b)
    with step(1):
        w(torch.ones(1))
        with pytest.raises(InputMismatchError, match=r"captured with arguments \(tensor\) "
                                                     r"but is replayed with \(tensor, tensor\)"):
            w(torch.ones(1), torch.ones(1))
        with pytest.raises(InputMismatchError, match=r"is \(1,\) torch.float64.*captured "
                                                     r"with \(1,\) torch.float32"):
            w(torch.ones(1, dtype=torch.float64))
    assert w.stats.replays == 0


def test_nested_full_around_piecewise() -> None:
    """§7.11 "Nested": each wrapper acts only in its own mode."""
    inner_fn = Counting()
    stats = Stats()
    window = CaptureWindow()
    inner = make(inner_fn, PW, stats=stats, window=window)
    outer_calls = [0]

    def outer_forward(x: torch.Tensor) -> torch.Tensor:
        outer_calls[0] += 1
        return inner(x) - 1

    outer = make(outer_forward, FULL, stats=stats, window=window)
    x = torch.tensor([1.0, 2.0])
    full_desc = BatchDescriptor(2, num_reqs=2, uniform=True)

    # FULL step: the outer wrapper captures; both forwards run once, the inner one bypasses.
    with stats.expect(graphs_captured=1, bypasses=1, replays=0), step(full_desc, FULL):
        outer(x)
    assert (outer_calls[0], inner_fn.calls) == (1, 1)
    # FULL again: replay, no forward runs.
    x.copy_(torch.tensor([3.0, 4.0]))
    with stats.expect(graphs_captured=0, bypasses=0, replays=1), step(full_desc, FULL):
        out = outer(x)
    assert (outer_calls[0], inner_fn.calls) == (1, 1)
    assert torch.equal(out, torch.tensor([6.0, 8.0]))

    # PIECEWISE step: outer bypasses (its forward runs), inner captures.
    with stats.expect(graphs_captured=1, bypasses=1, replays=0), step(2, PW):
        outer(x)
    assert (outer_calls[0], inner_fn.calls) == (2, 2)
    # PIECEWISE again: outer bypasses again, inner replays (its forward does not run).
    x.copy_(torch.tensor([10.0, 20.0]))
    with stats.expect(graphs_captured=0, bypasses=1, replays=1), step(2, PW):
        out = outer(x)
    assert (outer_calls[0], inner_fn.calls) == (3, 2)
    assert torch.equal(out, torch.tensor([20.0, 40.0]))


def test_weak_ref_output_on_emulated_keeps_the_same_tensors() -> None:
    w = make(lambda a: a + 1, options=GraphOptions(weak_ref_output=True, gc_disable=True))
    x = torch.ones(2)
    with step(2):
        first = w(x)
        x.fill_(2.0)
        assert w(x) is first
    assert torch.equal(first, torch.full((2,), 3.0))


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


def test_a_shape_change_at_the_same_address_is_an_error() -> None:
    buffer = torch.zeros(8)
    w = make(lambda a: a * 2)  # checked by default, not only with debug=True
    with step(2):
        w(buffer[:2])
        with pytest.raises(InputMismatchError, match=r"argument 0 .* is \(3,\) torch.float32 "
                                                     r"on cpu, but the graph was captured with "
                                                     r"\(2,\) torch.float32 on cpu — 3 rows"):
            w(buffer[:3])  # same address, wrong size for the descriptor


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
    with step(2):
        assert w(x).tolist() == [3.0, 6.0]  # the capturing call: real values, not NaN
        x.copy_(torch.tensor([5.0, 7.0]))
        assert w(x).tolist() == [15.0, 21.0]
    assert (stats.graphs_captured, stats.replays) == (1, 1)  # the capture's own run is no replay


def test_a_new_tensor_the_graph_writes_into_gets_the_write_as_in_eager() -> None:
    def bump(a: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return a * 2

    w = make(bump)
    with step(2):
        w(torch.zeros(2))  # capture: the graph writes into its input
        mine = torch.tensor([5.0, 6.0])
        assert w(mine).tolist() == [12.0, 14.0]
        assert mine.tolist() == [6.0, 7.0]  # as eager would have left it
    reader = make(lambda a: a * 2)
    with step(2):
        reader(torch.zeros(2))
        untouched = torch.tensor([1.0, 2.0])
        with torch.inference_mode():
            assert reader(untouched).tolist() == [2.0, 4.0]
        assert untouched.tolist() == [1.0, 2.0]
