"""The graph scenarios of the research notes (§7.3, §7.4, §7.5, §7.11) through ``ff.compile``,
on every graph backend present (the ``rig`` fixture: ``emulated`` always, ``cuda`` on a GPU).

The caller owns static buffers (as a model runner does): every step writes its data into a
slice of a persistent buffer and passes that slice, so captured graphs read fresh data. The
counting ``silly::attention`` op proves what ran outside the graphs. Every expected value holds
on both backends; what only one backend can show lives in tests/emulated or tests/cuda.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from freezeframe.batch import BatchDescriptor
from freezeframe.compilation import CompiledModel
from freezeframe.compilation import compile as ff_compile
from freezeframe.config import CUDAGraphMode
from freezeframe.context import forward_context
from freezeframe.errors import CaptureError, InputMismatchError
from tests.helpers import silly
from tests.helpers.toy_models import (
    LlamaConfig,
    SillyModel,
    ToyLlama,
    TwoSubmodulesModel,
    tractable_reference,
)
from tests.scenarios.conftest import Rig

PW = CUDAGraphMode.PIECEWISE
FULL = CUDAGraphMode.FULL
NONE = CUDAGraphMode.NONE


def run(model: Any, mode: CUDAGraphMode, desc: int | BatchDescriptor | None,
        *args: torch.Tensor) -> Any:
    with forward_context(desc, mode=mode):
        return model(*args)


def silly_model(rig: Rig, cudagraph_mode: str, **changes: Any) -> CompiledModel:
    return ff_compile(SillyModel().to(rig.device), rig.config(cudagraph_mode, **changes))


# -- §7.3 the silly model -------------------------------------------------------------------
def test_silly_piecewise_captures_six_and_attention_runs_outside(rig: Rig) -> None:
    model = silly_model(rig, "piecewise")
    buf = rig.zeros(100)  # the caller's static input buffer
    with model.stats.expect(graphs_traced=1, pieces=5, capturable_pieces=3,
                            backend_compilations=3, graphs_captured=6):
        buf.copy_(rig.randn(100))
        run(model, NONE, None, buf)  # traces and compiles
        buf[:2].copy_(rig.randn(2))
        run(model, PW, 2, buf[:2])  # captures 3 pieces for size 2
        buf[:1].copy_(rig.randn(1))
        run(model, PW, 1, buf[:1])  # and 3 for size 1

    silly.reset_counter()
    buf[:2].zero_()
    with model.stats.expect(graphs_captured=0, replays=3):
        out = run(model, PW, 2, buf[:2])
    assert torch.equal(rig.host(out), torch.tensor([19.0, 19.0]))
    assert silly.get_counter() == 2  # both attentions ran eagerly, between the graphs

    buf[:1].fill_(1.0)
    assert torch.equal(rig.host(run(model, PW, 1, buf[:1])), torch.tensor([28.0]))  # 9x + 19
    assert silly.get_counter() == 4


def test_silly_full_replays_the_whole_forward_without_python(rig: Rig) -> None:
    model = silly_model(rig, "full")
    buf = rig.zeros(100)
    with model.stats.expect(graphs_traced=1, graphs_captured=2):
        buf.copy_(rig.randn(100))
        run(model, NONE, None, buf)
        buf[:2].copy_(rig.randn(2))
        run(model, FULL, 2, buf[:2])
        buf[:1].copy_(rig.randn(1))
        run(model, FULL, 1, buf[:1])
    assert [w.runtime_mode for w in model.graph_wrappers()] == [FULL]

    silly.reset_counter()
    buf[:2].zero_()
    with model.stats.expect(graphs_captured=0, replays=1):
        out = run(model, FULL, 2, buf[:2])
    assert torch.equal(rig.host(out), torch.tensor([19.0, 19.0]))
    assert silly.get_counter() == 0  # attention's Python body was inside the graph


def test_the_capturing_call_of_a_piecewise_model_equals_eager(rig: Rig) -> None:
    """Between pieces the splitting op runs eagerly on the previous piece's output: that output
    must hold values already during the capturing call (on CUDA a capture only records), or
    every later piece sees garbage."""
    module = SillyModel().to(rig.device)
    model = silly_model(rig, "piecewise")
    buf = rig.zeros(8)
    run(model, NONE, None, buf)
    buf[:4].copy_(torch.arange(4.0))
    with torch.no_grad():
        want = rig.host(module(buf[:4].clone()))
    with model.stats.expect(graphs_captured=3, replays=0):
        got = rig.host(run(model, PW, 4, buf[:4]))
    torch.testing.assert_close(got, want)


def test_silly_copy_inputs_with_fresh_tensors(rig: Rig) -> None:
    """§7.3 as vLLM writes it: cudagraph_copy_inputs copies each new input into an internal
    static buffer, so the caller may pass fresh tensors to PIECEWISE graphs."""
    model = silly_model(rig, "piecewise", cudagraph_copy_inputs=True)
    run(model, NONE, None, rig.randn(100))
    run(model, PW, 2, rig.randn(2))
    run(model, PW, 1, rig.randn(1))
    silly.reset_counter()
    out = run(model, PW, 2, rig.zeros(2))
    assert torch.equal(rig.host(out), torch.tensor([19.0, 19.0]))
    assert silly.get_counter() == 2


def test_a_new_input_tensor_is_copied_into_the_captured_buffer(rig: Rig) -> None:
    """A caller who passes a new tensor instead of writing into the captured buffer gets the
    right answer: the replay copies it into the buffer the graph reads (a graph alone would
    read the old contents), then puts the buffer's contents back."""
    model = silly_model(rig, "piecewise")
    buf = rig.zeros(8)
    run(model, NONE, None, buf)
    buf[:2].fill_(1.0)
    run(model, PW, 2, buf[:2])  # captured reading buf[:2]
    copies = model.stats.replay_input_copies

    out = run(model, PW, 2, rig.zeros(2))  # a new tensor, not buf[:2]
    assert torch.equal(rig.host(out), torch.tensor([19.0, 19.0]))  # what eager gives for zeros
    assert model.stats.replay_input_copies == copies + 1
    # the copy is put back after the replay: the caller's own buffer is as eager leaves it
    # (matrix case pre_hook_low_level: it used to keep the copied-in tensor)
    assert torch.equal(rig.host(buf[:2]), torch.ones(2))
    buf[:2].fill_(2.0)  # writing into the captured buffer needs no copy
    assert torch.equal(rig.host(run(model, PW, 2, buf[:2])), torch.tensor([37.0, 37.0]))
    assert model.stats.replay_input_copies == copies + 1


def test_fewer_rows_than_the_descriptor_is_an_error_not_stale_rows(rig: Rig) -> None:
    model = silly_model(rig, "piecewise")
    buf = rig.zeros(8)
    run(model, NONE, None, buf)
    run(model, PW, 4, buf[:4])
    with pytest.raises(InputMismatchError, match=r"3 rows where the graph was captured with "
                                                 r"4.*pad the batch to the descriptor's size"):
        run(model, PW, 4, buf[:3])


def test_debug_mode_names_the_changed_input_address(rig: Rig) -> None:
    model = silly_model(rig, "piecewise", debug=True)
    buf = rig.zeros(8)
    run(model, NONE, None, buf)
    run(model, PW, 2, buf[:2])
    run(model, PW, 2, buf[:2])  # same buffer: no complaint
    stranger = rig.zeros(2)
    with pytest.raises(InputMismatchError) as info:
        run(model, PW, 2, stranger)
    message = str(info.value)
    assert f"{buf.data_ptr():#x}" in message and f"{stranger.data_ptr():#x}" in message
    assert "argument" in message and "write the new data into the captured buffer" in message


def test_capture_outside_the_window_raises(rig: Rig) -> None:
    model = silly_model(rig, "piecewise")
    buf = rig.zeros(8)
    run(model, NONE, None, buf)
    run(model, PW, 2, buf[:2])
    model.capture_window.close()
    run(model, PW, 2, buf[:2])  # replays are fine with the window closed
    with pytest.raises(CaptureError, match=r"num_tokens=1.*capture window is closed.*"
                                           r"runner's capture\(\)"):
        run(model, PW, 1, buf[:1])
    with model.capture_window.opened(), model.stats.expect(graphs_captured=3):
        run(model, PW, 1, buf[:1])


def test_clearing_the_model_graphs_recaptures(rig: Rig) -> None:
    model = silly_model(rig, "piecewise")
    buf = rig.zeros(8)
    run(model, NONE, None, buf)
    run(model, PW, 2, buf[:2])
    for wrapper in model.graph_wrappers():
        wrapper.clear()
    with model.stats.expect(graphs_captured=3, replays=0):
        run(model, PW, 2, buf[:2])


# -- §7.11 nesting on a compiled model ------------------------------------------------------
def test_full_and_piecewise_wrappers_nest(rig: Rig) -> None:
    model = silly_model(rig, "full_and_piecewise")
    buf = rig.zeros(8)
    run(model, NONE, None, buf)
    assert [w.runtime_mode for w in model.graph_wrappers()] == [PW, PW, PW, FULL]
    full_desc = BatchDescriptor(2, num_reqs=2, uniform=True)

    # FULL step: the FULL wrapper captures; the 3 piecewise wrappers inside bypass.
    silly.reset_counter()
    with model.stats.expect(graphs_captured=1, bypasses=3, replays=0):
        run(model, FULL, full_desc, buf[:2])
    assert silly.get_counter() == 2  # the capture ran the forward once
    buf[:2].zero_()
    with model.stats.expect(graphs_captured=0, bypasses=0, replays=1):
        out = run(model, FULL, full_desc, buf[:2])
    assert torch.equal(rig.host(out), torch.tensor([19.0, 19.0]))
    assert silly.get_counter() == 2  # no forward ran

    # PIECEWISE step: the FULL wrapper bypasses; the pieces capture, then replay.
    with model.stats.expect(graphs_captured=3, bypasses=1, replays=0):
        run(model, PW, 2, buf[:2])
    assert silly.get_counter() == 4
    buf[:2].fill_(1.0)
    with model.stats.expect(graphs_captured=0, bypasses=1, replays=3):
        out = run(model, PW, 2, buf[:2])
    assert torch.equal(rig.host(out), torch.tensor([28.0, 28.0]))
    assert silly.get_counter() == 6  # attention is eager between piecewise graphs


# -- §7.4 the toy Llama ---------------------------------------------------------------------
def _run_llama(rig: Rig, model: torch.nn.Module, mode: CUDAGraphMode) -> torch.Tensor:
    """vLLM's run_model: warm up at 16 tokens, capture 2 then 1, zero the first two ids in
    place (same buffers, same addresses) and replay 2."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 128, (16,), generator=gen).to(rig.device)
    positions = torch.arange(16, device=rig.device)
    with torch.no_grad():
        run(model, NONE, None, input_ids, positions)
        if mode is not NONE:
            run(model, mode, 2, input_ids[:2], positions[:2])
            run(model, mode, 1, input_ids[:1], positions[:1])
        input_ids[:2].zero_()
        return rig.host(run(model, mode, 2, input_ids[:2], positions[:2]))


@pytest.mark.parametrize("num_layers", [2, 3])
def test_toy_llama_captures_two_per_capturable_piece(rig: Rig, num_layers: int) -> None:
    cfg = LlamaConfig(num_layers=num_layers, tractable_init=True)
    model = ff_compile(ToyLlama(cfg).to(rig.device), rig.config("piecewise"))
    with model.stats.expect(graphs_traced=1, pieces=2 * num_layers + 1,
                            capturable_pieces=num_layers + 1,
                            backend_compilations=num_layers + 1,
                            graphs_captured=2 * (num_layers + 1), replays=num_layers + 1):
        out = _run_llama(rig, model, PW)
    expected = tractable_reference(cfg, torch.zeros(2, dtype=torch.long), torch.arange(2))
    assert torch.allclose(out, expected)
    assert torch.allclose(out, _run_llama(rig, ToyLlama(cfg).to(rig.device), NONE))


def test_toy_llama_random_weights_graph_equals_no_graph_bitwise(rig: Rig) -> None:
    cfg = LlamaConfig(num_layers=2)

    def build(cudagraph_mode: str | None) -> torch.nn.Module:
        torch.manual_seed(0)
        module = ToyLlama(cfg).to(rig.device)
        return module if cudagraph_mode is None else ff_compile(module,
                                                                rig.config(cudagraph_mode))

    with_graphs = _run_llama(rig, build("piecewise"), PW)
    without = _run_llama(rig, build("none"), NONE)
    eager = _run_llama(rig, build(None), NONE)
    assert torch.equal(with_graphs, without)  # the same kernels, replayed
    assert torch.allclose(with_graphs, eager)


# -- §7.5 two separately compiled submodules --------------------------------------------------
def _two_submodules(rig: Rig, cudagraph_mode: str, compiled: list[CompiledModel]
                    ) -> torch.nn.Module:
    def wrap(module: torch.nn.Module) -> torch.nn.Module:
        cm = ff_compile(module, rig.config(cudagraph_mode),
                        model_key=f"two_submodules.{len(compiled)}")
        compiled.append(cm)
        return cm

    torch.manual_seed(0)
    return TwoSubmodulesModel(wrap=wrap).to(rig.device)


def _drive_two(rig: Rig, model: torch.nn.Module, mode: CUDAGraphMode) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    inputs = rig.randn(32, 128, generator=gen)
    with torch.no_grad():
        run(model, NONE, None, inputs)
        if mode is not NONE:
            run(model, mode, 2, inputs[:2])
            run(model, mode, 1, inputs[:1])
        return rig.host(run(model, mode, 2, rig.randn(2, 128, generator=gen)))


def test_two_submodules_counts_and_bitwise_equal_outputs(rig: Rig) -> None:
    compiled: list[CompiledModel] = []
    out_graphs = _drive_two(rig, _two_submodules(rig, "piecewise", compiled), PW)
    counts = [cm.stats.snapshot() for cm in compiled]
    total = {k: sum(c.get(k, 0) for c in counts)
             for k in ("graphs_traced", "pieces", "capturable_pieces", "backend_compilations",
                       "graphs_captured", "replays")}
    assert total == {"graphs_traced": 2, "pieces": 6, "capturable_pieces": 4,
                     "backend_compilations": 4, "graphs_captured": 8, "replays": 4}

    plain: list[CompiledModel] = []
    out_no_graphs = _drive_two(rig, _two_submodules(rig, "none", plain), PW)
    assert sum(cm.stats.graphs_captured for cm in plain) == 0
    assert sum(cm.stats.graphs_traced for cm in plain) == 2

    torch.manual_seed(0)
    out_eager = _drive_two(rig, TwoSubmodulesModel().to(rig.device), NONE)
    assert torch.equal(out_graphs, out_no_graphs)  # bitwise: the same kernels replayed
    assert torch.allclose(out_graphs, out_eager, atol=1e-5)


# -- a splitting op that returns a new tensor ------------------------------------------------
@torch.library.custom_op("scenarios::functional_mix", mutates_args=())
def functional_mix(x: torch.Tensor) -> torch.Tensor:
    """A splitting op that allocates its output, as most user ops do (no out= buffer)."""
    return x.flip(0) + x.sum(0, keepdim=True)


@functional_mix.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class FunctionalSplit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.ops.scenarios.functional_mix(self.a(x)).relu())


def test_a_splitting_op_returning_new_memory_feeds_the_next_piece_its_values(rig: Rig) -> None:
    """The op runs eagerly between the pieces and its output lives at a new address on every
    step: the next piece's replay must read this step's values, not those it was captured
    with."""
    torch.manual_seed(0)
    module = FunctionalSplit().to(rig.device)
    model = ff_compile(module, rig.config("piecewise",
                                          splitting_ops=["scenarios::functional_mix"],
                                          cudagraph_capture_sizes=[2, 4]))
    buf = rig.zeros(4, 4)
    run(model, NONE, None, buf)
    for step, n in enumerate([4, 4, 2, 4, 2]):
        buf[:n].copy_(rig.randn(n, 4, generator=torch.Generator().manual_seed(step)))
        got = rig.host(run(model, PW, n, buf[:n]))
        with torch.no_grad():
            torch.testing.assert_close(got, rig.host(module(buf[:n])))
    assert (model.stats.graphs_captured, model.stats.replays) == (4, 6)
    assert model.stats.replay_input_copies == 3  # the op's output, once per replayed step
