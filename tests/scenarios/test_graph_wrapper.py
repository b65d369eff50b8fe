"""GraphWrapper policy on plain callables: which forward-context mode it acts in, capture at the
first sight of a descriptor and replay afterwards, the PIECEWISE/FULL keys, warm-ups, the capture
window, clear, the argument rules of a replay (a new tensor copied in and, where the graph wrote
into it, back out; ``debug=True`` refusing the copy; other arguments or shapes refused), the
options, the stats counts, and a FULL wrapper nested around a PIECEWISE one. The ``ff.compile``
versions of these rules are tests/scenarios/test_graph_scenarios.py's; what only one backend
shows (what the emulated recorder records, CUDA's pool) lives in tests/emulated and tests/cuda.

Every scenario runs on every graph backend present (the ``rig`` fixture). On ``cuda`` a capture
only records the work and the wrapper replays the new graph once before returning, so the
capturing call's values and in-place writes are the same as on ``emulated`` and the stats count
that run as no replay. The runnables are elementwise, with no library state made lazily at their
first run (cuBLAS handles and workspaces, Triton compiles), so on ``cuda`` too a descriptor is
captured at its first sight without a warm-up, and every count below holds on both backends.
Outputs and inputs are compared through host copies (``rig.host``): a replayed output is
overwritten by the next replay.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import pytest
import torch

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.config import CUDAGraphMode
from freezeframe.errors import CaptureError, ConfigError, InputMismatchError
from freezeframe.graphs import CaptureWindow, GraphOptions, GraphWrapper
from freezeframe.graphs.backend import resolve_backend
from freezeframe.stats import Stats
from tests.scenarios.conftest import Rig

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


def make(rig: Rig, fn: Callable[..., torch.Tensor], mode: CUDAGraphMode = PW, **kw: object
         ) -> GraphWrapper:
    """A wrapper on a fresh backend of the rig's kind (its own pool on ``cuda``)."""
    backend = resolve_backend(rig.backend)
    assert backend is not None
    window = kw.pop("window", CaptureWindow())
    stats = kw.pop("stats", Stats())
    return GraphWrapper(fn, mode, backend, stats=stats,  # type: ignore[arg-type]
                        window=window, **kw)  # type: ignore[arg-type]


def step(n: int | BatchDescriptor | None, mode: CUDAGraphMode = PW):  # type: ignore[no-untyped-def]
    return ff.forward_context(n, mode=mode)


def tensor(rig: Rig, values: list[float] | list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, device=rig.device)


# -- when the wrapper acts, and what it keys on ----------------------------------------------
def test_calls_through_without_matching_mode(rig: Rig) -> None:
    fn = Counting()
    w = make(rig, fn)
    x = torch.ones(2, device=rig.device)
    with w.stats.expect(bypasses=3, graphs_captured=0, replays=0):
        assert torch.equal(rig.host(w(x)), torch.full((2,), 3.0))  # no forward context
        with step(None, CUDAGraphMode.NONE):
            w(x)
        with step(2, FULL):  # another wrapper's mode
            w(x)
    assert fn.calls == 3
    assert w.captured_descriptors == []


def test_first_sight_captures_later_sights_replay(rig: Rig) -> None:
    fn = Counting()
    w = make(rig, fn)
    x = tensor(rig, [1.0, 2.0])
    with w.stats.expect(graphs_captured=1, replays=0, bypasses=0), step(2):
        first = w(x)
    assert fn.calls == 1
    x.copy_(tensor(rig, [5.0, 6.0]))
    with w.stats.expect(graphs_captured=0, replays=2), step(2):
        again = w(x)
        assert again is first
        assert torch.equal(rig.host(again), torch.tensor([11.0, 13.0]))
        x.fill_(0.0)
        w(x)
    assert fn.calls == 1  # replays ran no Python
    assert torch.equal(rig.host(first), torch.ones(2))  # the stored output was overwritten
    assert w.captured_descriptors == [BatchDescriptor(2)]


def test_piecewise_keys_are_relaxed_full_keys_are_not(rig: Rig) -> None:
    x = torch.ones(4, device=rig.device)
    pw = make(rig, Counting(), PW)
    with step(BatchDescriptor(4, num_reqs=4, uniform=True)):
        pw(x)
    with pw.stats.expect(graphs_captured=0, replays=1), step(BatchDescriptor(4, num_reqs=1)):
        pw(x)
    assert pw.captured_descriptors == [BatchDescriptor(4)]

    full = make(rig, Counting(), FULL)
    with full.stats.expect(graphs_captured=2, replays=1):
        with step(BatchDescriptor(4, num_reqs=4, uniform=True), FULL):
            full(x)
        with step(BatchDescriptor(4, num_reqs=1), FULL):
            full(x)
        with step(BatchDescriptor(4, num_reqs=4, uniform=True), FULL):
            full(x)
    assert full.graph_for(BatchDescriptor(4, num_reqs=1)) is not None
    assert full.graph_for(BatchDescriptor(4)) is None


def test_warmups_run_eagerly_before_capture(rig: Rig) -> None:
    fn = Counting()
    w = make(rig, fn, num_warmups=2)
    x = torch.ones(1, device=rig.device)
    with w.stats.expect(graphs_captured=1, replays=1, bypasses=0), step(1):
        for _ in range(4):  # warm-up, warm-up, capture, replay
            w(x)
    assert fn.calls == 3


def test_capture_window_closed_raises_naming_descriptor_and_capture(rig: Rig) -> None:
    window = CaptureWindow()
    assert window.is_open
    w = make(rig, Counting(), FULL, window=window)
    x = torch.ones(2, device=rig.device)
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
            w(torch.ones(3, device=rig.device))
    assert not window.is_open  # restored
    assert w.stats.graphs_captured == 2 and w.stats.replays == 1


def test_clear_drops_graphs_and_recaptures(rig: Rig) -> None:
    fn = Counting()
    w = make(rig, fn)
    x = torch.ones(2, device=rig.device)
    with step(2):
        w(x)
        w.clear()
        assert w.captured_descriptors == []
        with w.stats.expect(graphs_captured=1, replays=0):
            w(x)
    assert fn.calls == 2


# -- construction, options and stats ---------------------------------------------------------
def test_unwrap_and_no_attribute_forwarding(rig: Rig) -> None:
    """The wrapped runnable is reached through unwrap(), never by attribute fall-through (a
    typo on the wrapper would otherwise read the runnable's attribute silently)."""
    fn = Counting()
    w = make(rig, fn)
    assert w.unwrap() is fn
    assert w.unwrap().config_name == "counting"  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="config_name"):
        _ = w.config_name  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["none", "full_and_piecewise", "full_decode_only"])
def test_wrapper_needs_a_runtime_graph_mode(rig: Rig, mode: str) -> None:
    with pytest.raises(ConfigError, match="not a graph mode"):
        make(rig, Counting(), CUDAGraphMode.parse(mode))


def test_options_validated_and_logging(rig: Rig, ff_logs: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match=r"GraphOptions.log"):
        GraphOptions(log=1)  # type: ignore[arg-type]
    quiet = make(rig, Counting())
    loud = make(rig, Counting(), options=GraphOptions(log=True))
    with step(2):
        quiet(torch.ones(2, device=rig.device))
        loud(torch.ones(2, device=rig.device))
    captures = [r for r in ff_logs.records
                if r.levelno == logging.DEBUG and "capturing a PIECEWISE graph" in r.getMessage()]
    assert len(captures) == 1


def test_stats_feed_a_linked_parent(rig: Rig) -> None:
    parent = Stats()
    w = make(rig, Counting(), stats=parent.child())
    with step(2):
        w(torch.ones(2, device=rig.device))
        w(torch.ones(2, device=rig.device))
    w(torch.ones(2, device=rig.device))
    assert (parent.graphs_captured, parent.replays, parent.bypasses) == (1, 1, 1)


def test_weak_ref_output_returns_the_same_tensors_at_every_replay(rig: Rig) -> None:
    """``weak_ref_output`` keeps the captured output as weak references (the same tensors on
    ``emulated``, views of the pool memory on ``cuda``): every replay returns them, holding its
    values."""
    w = make(rig, lambda a: a + 1, options=GraphOptions(weak_ref_output=True, gc_disable=True))
    x = torch.ones(2, device=rig.device)
    with step(2):
        first = w(x)
        x.fill_(2.0)
        assert w(x) is first
    assert torch.equal(rig.host(first), torch.full((2,), 3.0))


# -- the arguments of a replay ---------------------------------------------------------------
def test_debug_address_check_names_argument_addresses_and_fix(rig: Rig) -> None:
    buffer = torch.zeros(8, device=rig.device)  # persistent static buffer
    w = make(rig, lambda a, b: a + b, debug=True)
    weight = torch.ones(2, device=rig.device)
    with step(2):
        w(buffer[:2], weight)
        w(buffer[:2], weight)  # a new slice object of the same buffer: same address, fine
        stranger = torch.ones(2, device=rig.device)
        with pytest.raises(InputMismatchError) as info:
            w(stranger, weight)
    message = str(info.value)
    assert "argument 0" in message
    assert f"{buffer.data_ptr():#x}" in message and f"{stranger.data_ptr():#x}" in message
    assert "write the new data into the captured buffer" in message
    assert w.stats.replays == 1 and w.stats.replay_input_copies == 0


def test_without_debug_a_new_tensor_is_copied_into_the_captured_one(rig: Rig) -> None:
    """A replay reads the captured buffer, so a new tensor is copied there first; the
    captured buffer is put back after it (the caller's own tensor on the low-level path,
    which eagerly the call would not touch: found by the matrix, pre_hook_low_level)."""
    w = make(rig, lambda a: a * 10)
    with step(1):
        captured = tensor(rig, [1.0])
        w(captured)
        assert rig.host(w(tensor(rig, [5.0]))).item() == 50.0
        assert rig.host(captured).item() == 1.0 and w.stats.replay_input_copies == 1
        captured.fill_(7.0)
        assert rig.host(w(captured)).item() == 70.0
        assert w.stats.replay_input_copies == 1
        strided = tensor(rig, [[3.0, 0.0]])[:, 0]  # another layout: copied as well
        assert rig.host(w(strided)).item() == 30.0 and w.stats.replay_input_copies == 2


def test_its_own_output_passed_in_again_gives_the_next_answer(rig: Rig) -> None:
    """``y = w(y)`` with inference tensors, which have no version counter: the capture cannot
    tell whether the graph writes its input, so a copied-in argument is copied back after the
    replay. Into the graph's own output memory that copy-back overwrote the answer with the
    input (f(y) came back as y)."""
    w = make(rig, lambda a: a * 2 + 1, mode=FULL)
    with torch.inference_mode(), step(1, FULL):
        y = w(tensor(rig, [1.0]))  # captures: 3
        assert rig.host(y).item() == 3.0
        for want in (7.0, 15.0, 31.0):
            y = w(y)
            assert rig.host(y).item() == want
        assert w.stats.replay_input_copies == 3


def test_a_replay_with_other_arguments_is_an_error(rig: Rig) -> None:
    # ``a * 1``, not ``a``: a graph that records no kernel is an empty CUDA graph
    w = make(rig, lambda a, b=None: a * 1 if b is None else a + b)
    with step(1):
        w(torch.ones(1, device=rig.device))
        with pytest.raises(InputMismatchError, match=r"captured with arguments \(tensor\) "
                                                     r"but is replayed with \(tensor, tensor\)"):
            w(torch.ones(1, device=rig.device), torch.ones(1, device=rig.device))
        with pytest.raises(InputMismatchError, match=r"is \(1,\) torch.float64.*captured "
                                                     r"with \(1,\) torch.float32"):
            w(torch.ones(1, dtype=torch.float64, device=rig.device))
    assert w.stats.replays == 0


def test_a_shape_change_at_the_same_address_is_an_error(rig: Rig) -> None:
    buffer = torch.zeros(8, device=rig.device)
    on = re.escape(str(buffer.device))  # "cpu" on emulated, "cuda:0" on cuda
    w = make(rig, lambda a: a * 2)  # checked by default, not only with debug=True
    with step(2):
        w(buffer[:2])
        with pytest.raises(InputMismatchError, match=rf"argument 0 .* is \(3,\) torch.float32 "
                                                     rf"on {on}, but the graph was captured "
                                                     rf"with \(2,\) torch.float32 on {on} — 3 "
                                                     r"rows"):
            w(buffer[:3])  # same address, wrong size for the descriptor


def test_a_new_tensor_the_graph_writes_into_gets_the_write_as_in_eager(rig: Rig) -> None:
    def bump(a: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return a * 2

    w = make(rig, bump)
    with step(2):
        w(torch.zeros(2, device=rig.device))  # capture: the graph writes into its input
        mine = tensor(rig, [5.0, 6.0])
        assert rig.host(w(mine)).tolist() == [12.0, 14.0]
        assert rig.host(mine).tolist() == [6.0, 7.0]  # as eager would have left it
    reader = make(rig, lambda a: a * 2)
    with step(2):
        reader(torch.zeros(2, device=rig.device))
        untouched = tensor(rig, [1.0, 2.0])
        with torch.inference_mode():
            assert rig.host(reader(untouched)).tolist() == [2.0, 4.0]
        assert rig.host(untouched).tolist() == [1.0, 2.0]


# -- nesting ---------------------------------------------------------------------------------
def test_nested_full_around_piecewise(rig: Rig) -> None:
    """§7.11 "Nested": each wrapper acts only in its own mode."""
    inner_fn = Counting()
    stats = Stats()
    window = CaptureWindow()
    inner = make(rig, inner_fn, PW, stats=stats, window=window)
    outer_calls = [0]

    def outer_forward(x: torch.Tensor) -> torch.Tensor:
        outer_calls[0] += 1
        return inner(x) - 1

    outer = make(rig, outer_forward, FULL, stats=stats, window=window)
    x = tensor(rig, [1.0, 2.0])
    full_desc = BatchDescriptor(2, num_reqs=2, uniform=True)

    # FULL step: the outer wrapper captures; both forwards run once, the inner one bypasses.
    with stats.expect(graphs_captured=1, bypasses=1, replays=0), step(full_desc, FULL):
        outer(x)
    assert (outer_calls[0], inner_fn.calls) == (1, 1)
    # FULL again: replay, no forward runs.
    x.copy_(tensor(rig, [3.0, 4.0]))
    with stats.expect(graphs_captured=0, bypasses=0, replays=1), step(full_desc, FULL):
        out = outer(x)
    assert (outer_calls[0], inner_fn.calls) == (1, 1)
    assert torch.equal(rig.host(out), torch.tensor([6.0, 8.0]))

    # PIECEWISE step: outer bypasses (its forward runs), inner captures.
    with stats.expect(graphs_captured=1, bypasses=1, replays=0), step(2, PW):
        outer(x)
    assert (outer_calls[0], inner_fn.calls) == (2, 2)
    # PIECEWISE again: outer bypasses again, inner replays (its forward does not run).
    x.copy_(tensor(rig, [10.0, 20.0]))
    with stats.expect(graphs_captured=0, bypasses=1, replays=1), step(2, PW):
        out = outer(x)
    assert (outer_calls[0], inner_fn.calls) == (3, 2)
    assert torch.equal(rig.host(out), torch.tensor([20.0, 40.0]))
