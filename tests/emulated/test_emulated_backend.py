"""The emulated graph backend on plain callables: it must fail the way a CUDA graph fails."""

from __future__ import annotations

import pytest
import torch

from freezeframe.config import CompilationConfig
from freezeframe.errors import CaptureError, ConfigError
from freezeframe.graphs import GraphBackend, resolve_backend
from freezeframe.graphs.emulated import EmulatedBackend, EmulatedGraph, is_opaque, opaque

# A counting custom op with a Python body, private to this file (the shared silly op lives in
# tests/helpers): its counter proves whether the body ran again on replay.
_BODY_CALLS = [0]


@torch.library.custom_op("ffgraphs_test::add3", mutates_args=["out"])
def _add3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    _BODY_CALLS[0] += 1
    out.copy_(q + k + v)


@_add3.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    return None


@pytest.fixture
def backend() -> EmulatedBackend:
    return EmulatedBackend()


def test_backend_satisfies_protocol(backend: EmulatedBackend) -> None:
    assert isinstance(backend, GraphBackend)
    assert (backend.name, backend.capture_computes) == ("emulated", True)


def test_replay_recomputes_on_captured_tensors_and_reuses_outputs(
        backend: EmulatedBackend) -> None:
    x = torch.tensor([1.0, 2.0])  # the static input buffer
    graph, out = backend.capture(lambda: (x * 2 + 1).relu())
    assert isinstance(graph, EmulatedGraph)
    assert torch.equal(out, torch.tensor([3.0, 5.0]))  # emulated capture computes for real
    storage = out.untyped_storage().data_ptr()

    x.copy_(torch.tensor([-4.0, 10.0]))  # fresh data written into the captured buffer
    graph.replay()
    assert torch.equal(out, torch.tensor([0.0, 21.0]))
    assert out.untyped_storage().data_ptr() == storage  # same tensor, same memory


def test_outputs_are_overwritten_by_the_next_replay(backend: EmulatedBackend) -> None:
    x = torch.tensor([1.0])
    graph, out = backend.capture(lambda: x + 10)
    x.fill_(2.0)
    graph.replay()
    first = out  # a caller who keeps the returned tensor without copying it ...
    x.fill_(3.0)
    graph.replay()
    assert torch.equal(first, torch.tensor([13.0]))  # ... sees it change under them


def test_python_inside_the_region_does_not_run_on_replay(backend: EmulatedBackend) -> None:
    calls = [0]
    x = torch.ones(3)

    def region() -> torch.Tensor:
        calls[0] += 1
        return x * 5

    graph, out = backend.capture(region)
    assert calls[0] == 1
    x.fill_(2.0)
    graph.replay()
    graph.replay()
    assert calls[0] == 1
    assert torch.equal(out, torch.full((3,), 10.0))


def test_stale_input_when_caller_passes_a_new_tensor(backend: EmulatedBackend) -> None:
    """A caller who hands the region a new tensor instead of refreshing the captured buffer
    gets results from the old data — the classic CUDA-graph bug, reproduced on CPU."""
    captured_input = torch.tensor([1.0, 1.0])
    current = {"x": captured_input}
    graph, out = backend.capture(lambda: current["x"] * 3)

    current["x"] = torch.tensor([7.0, 7.0])  # new tensor, not written into the buffer
    graph.replay()
    assert torch.equal(out, torch.tensor([3.0, 3.0]))  # stale: computed from the old buffer

    captured_input.copy_(torch.tensor([7.0, 7.0]))  # the fix: write into the captured buffer
    graph.replay()
    assert torch.equal(out, torch.tensor([21.0, 21.0]))


def test_a_replay_reads_the_memory_captured_not_a_swapped_in_one(
        backend: EmulatedBackend) -> None:
    """A CUDA graph reads the addresses it captured: after ``w.data = other`` (or a module's
    ``.half()``, which does that to every parameter) its replay still reads the old memory, so
    a CPU test must see the stale answer too, not the new data."""
    w = torch.ones(2)
    x = torch.full((2,), 2.0)
    graph, out = backend.capture(lambda: w * x)
    w.data = torch.full((2,), 5.0)  # the object stays, its memory is another
    x.data = torch.full((2,), 7.0)
    graph.replay()
    assert torch.equal(out, torch.full((2,), 2.0))  # 1 * 2: the captured memory


def test_custom_op_body_is_recorded_as_aten_ops(backend: EmulatedBackend) -> None:
    q = torch.tensor([1.0, 2.0])

    def region() -> torch.Tensor:
        out = torch.empty_like(q)
        torch.ops.ffgraphs_test.add3(q, q, q, out)
        return out - 1

    before = _BODY_CALLS[0]
    graph, out = backend.capture(region)
    assert _BODY_CALLS[0] == before + 1
    assert "ffgraphs_test.add3.default" not in graph.ops
    assert graph.ops == ["aten.add.Tensor", "aten.add.Tensor", "aten.copy_.default",
                         "aten.sub.Tensor"]
    q.copy_(torch.tensor([10.0, 20.0]))
    graph.replay()
    assert _BODY_CALLS[0] == before + 1  # the Python body did not run again
    assert torch.equal(out, torch.tensor([29.0, 59.0]))


def test_in_place_mutation_of_inputs_and_views_is_replayed(backend: EmulatedBackend) -> None:
    x = torch.zeros(4)
    acc = torch.zeros(2)

    def region() -> torch.Tensor:
        x[1:3] += 1  # in-place through a view of the input
        torch.add(x[:2], 1, out=acc)  # an out= variant into a persistent tensor
        return x.sum()

    graph, total = backend.capture(region)
    assert torch.equal(x, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    graph.replay()
    graph.replay()
    assert torch.equal(x, torch.tensor([0.0, 3.0, 3.0, 0.0]))
    assert torch.equal(acc, torch.tensor([1.0, 4.0]))
    assert total.item() == 6.0


def test_intermediates_are_the_private_pool(backend: EmulatedBackend) -> None:
    x = torch.tensor([2.0])
    graph, (mid, out) = backend.capture(lambda: (lambda m: (m, m * m))(x + 1))
    mid_ptr, out_ptr = mid.data_ptr(), out.data_ptr()
    x.fill_(4.0)
    graph.replay()
    assert (mid.item(), out.item()) == (5.0, 25.0)
    assert (mid.data_ptr(), out.data_ptr()) == (mid_ptr, out_ptr)


def test_module_with_parameters_and_autograd_enabled(backend: EmulatedBackend) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    graph, out = backend.capture(lambda: torch.nn.functional.gelu(lin(x)))
    x.copy_(torch.randn(2, 4))
    graph.replay()
    with torch.no_grad():
        assert torch.equal(out, torch.nn.functional.gelu(lin(x)))


def test_inference_mode_capture_replays(backend: EmulatedBackend) -> None:
    x = torch.ones(2)
    with torch.inference_mode():
        graph, out = backend.capture(lambda: x * 4)
    x.fill_(2.0)
    graph.replay()  # replays under inference_mode because the capture ran under it
    assert torch.equal(out, torch.full((2,), 8.0))


@pytest.mark.parametrize(
    ("region", "op", "why"),
    [
        (lambda x: x.sum().item(), "aten._local_scalar_dense", "reads a tensor value"),
        (lambda x: bool(x.sum() > 0), "aten._local_scalar_dense", "reads a tensor value"),
        (lambda x: x.nonzero(), "aten.nonzero", "depends on tensor values"),
        (lambda x: x[x > 1], "aten.index.Tensor", "boolean-mask indexing"),
        (lambda x: torch.unique(x), "aten._unique2", "depends on tensor values"),
    ],
    ids=["item", "bool", "nonzero", "mask-index", "unique"],
)
def test_host_sync_during_capture_is_an_error_naming_the_op(
        backend: EmulatedBackend, region: object, op: str, why: str) -> None:
    x = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(CaptureError, match=rf"{op}.*{why}.*captured region"):
        backend.capture(lambda: region(x))  # type: ignore[operator]


def test_integer_indexing_is_capturable(backend: EmulatedBackend) -> None:
    table = torch.arange(10.0)
    ids = torch.tensor([1, 3])
    graph, out = backend.capture(lambda: table[ids] * 2)
    ids.copy_(torch.tensor([5, 9]))
    graph.replay()
    assert torch.equal(out, torch.tensor([10.0, 18.0]))


def test_opaque_is_recorded_as_one_unit(backend: EmulatedBackend) -> None:
    calls = [0]

    def fused_kernel(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        return a * 3, a + 1

    kernel = opaque(fused_kernel)
    assert is_opaque(kernel) and opaque(kernel) is kernel
    assert not is_opaque(fused_kernel)
    x = torch.tensor([1.0])

    def region() -> torch.Tensor:
        y, z = kernel(x + 1)
        return y - z

    graph, out = backend.capture(region)
    assert graph.ops == ["aten.add.Tensor", "opaque:test_opaque_is_recorded_as_one_unit."
                         "<locals>.fused_kernel", "aten.sub.Tensor"]
    assert calls[0] == 1 and out.item() == 3.0
    x.fill_(4.0)
    graph.replay()
    assert calls[0] == 2  # the unit is called again on replay, on the captured tensors
    assert out.item() == 9.0  # (5*3) - (5+1)


def test_opaque_outside_capture_just_calls(backend: EmulatedBackend) -> None:
    kernel = opaque(lambda a: a + 1)
    assert torch.equal(kernel(torch.zeros(1)), torch.ones(1))


def test_opaque_boxed_argument_list_survives_replay(backend: EmulatedBackend) -> None:
    """Inductor's boxed convention clears the argument list it is given; the recorded list
    must not be the one cleared."""

    def boxed(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        a = inputs[0]
        inputs.clear()
        return [a * 2]

    kernel = opaque(boxed)
    x = torch.tensor([1.0])
    graph, out = backend.capture(lambda: kernel([x])[0])
    x.fill_(6.0)
    graph.replay()
    assert out.item() == 12.0


def test_failed_capture_leaves_no_recorder_active(backend: EmulatedBackend) -> None:
    x = torch.ones(1)
    with pytest.raises(CaptureError):
        backend.capture(lambda: x.item())
    kernel = opaque(lambda a: a * 2)
    assert kernel(x).item() == 2.0  # no capture in progress any more
    assert torch.utils._python_dispatch._get_current_dispatch_mode_stack() == []


def test_resolve_backend_choices(ff_logs: pytest.LogCaptureFixture) -> None:
    emulated = CompilationConfig(mode="piecewise", backend="eager",
                                 splitting_ops=["silly::attention"],
                                 cudagraph_capture_sizes=[1, 2], graph_backend="emulated")
    assert isinstance(resolve_backend(emulated), EmulatedBackend)
    assert isinstance(resolve_backend("emulated"), EmulatedBackend)
    assert resolve_backend(emulated.replace(cudagraph_mode="none")) is None

    if torch.cuda.is_available():  # pragma: no cover - exercised on GPU machines
        return
    auto = emulated.replace(graph_backend="auto")
    ff_logs.clear()
    assert resolve_backend(auto) is None
    graph_off = [r for r in ff_logs.records if "CUDA is not available" in r.getMessage()]
    assert len(graph_off) == 1
    with pytest.raises(ConfigError, match=r"graph_backend: 'cuda' needs a CUDA device.*"
                                          r"'emulated'"):
        resolve_backend(emulated.replace(graph_backend="cuda"))
    with pytest.raises(ConfigError, match="unknown graph backend"):
        resolve_backend("tpu")
