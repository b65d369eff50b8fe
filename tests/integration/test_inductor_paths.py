"""freezeframe's own paths with the real Inductor compiler in place of the eager one: each
test here has eager-compiler siblings in tests/unit or tests/emulated (whose helpers it
borrows), and checks what only Inductor's generated code can show."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

import freezeframe as ff
from freezeframe.batch import BatchDescriptor
from freezeframe.cache.artifacts import choose_artifact_format
from freezeframe.compilation.compilers import current_compile_range
from freezeframe.config import CUDAGraphMode
from freezeframe.context import forward_context
from freezeframe.sizes import Range
from tests.helpers import silly
from tests.helpers.configs import silly_config
from tests.helpers.toy_models import AttnSandwich, SillyModel
from tests.scenarios.conftest import Rig
from tests.scenarios.test_runner_inputs import InPlaceWriter, writer_inputs, writer_runner
from tests.scenarios.test_runner_inputs import config as runner_config
from tests.unit.test_cache_faults import _run as run_cached_process
from tests.unit.test_call_checks import RowNorm, grad_after_a_no_grad_call
from tests.unit.test_call_checks import config as call_config
from tests.unit.test_piecewise import config as piecewise_config

pytestmark = pytest.mark.inductor


def test_inductor_trace_made_at_batch_size_one_serves_only_size_one() -> None:
    torch.manual_seed(0)
    eager = RowNorm()
    model = ff.compile(eager, call_config("dynamo_trace_once", backend="inductor"))
    for n in (1, 3, 1, 5):
        x = torch.randn(n, 8)
        torch.testing.assert_close(model(x), eager(x))
    # size 1 got its own trace; 3 and 5 share the second, symbolic one
    assert (model.num_traces, model.stats.retraces) == (2, 1)


def test_a_call_with_grad_after_a_no_grad_call_keeps_autograd() -> None:
    """Found by the matrix (inductor_grad_after_a_no_grad_call): the grad trace reused the
    pieces Inductor compiled under no_grad (same graph hash), inference graphs without
    autograd, so its output did not require grad. Grad mode is part of the hash now."""
    grad_after_a_no_grad_call("inductor")


class _BatchMixing(torch.nn.Module):
    """Reshapes and reductions over the batch around the splitting op: what Inductor wrote
    size-1 code for when a trace was made at one row (NaN at every size, 1 included), and what
    a later trace then reused as the 'same' piece (issue 30, item 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.q, self.o, self.m = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = self.q(self.norm(x)).view(n, 4, 4).transpose(0, 1).contiguous()
        h = h.softmax(dim=1).transpose(0, 1).reshape(n, 16)
        h = silly.attention(h, h, h)
        x = x + self.o(h) + x.mean(dim=0, keepdim=True)
        return x + torch.relu(self.m(self.norm(x))).cumsum(0)


@pytest.mark.parametrize("splitting_ops", [["silly::attention"], []], ids=["split", "whole"])
def test_a_first_call_of_one_row_compiles_that_trace_for_one_row_only(
        splitting_ops: list[str]) -> None:
    torch.manual_seed(0)
    eager = _BatchMixing()
    cfg = ff.CompilationConfig(mode="piecewise", backend="inductor", splitting_ops=splitting_ops,
                               cudagraph_mode="none", max_num_tokens=64, use_cache=False)
    model = ff.compile(eager, cfg)
    for n in (1, 3, 4, 9, 1):
        x = torch.randn(n, 16)
        with torch.no_grad():
            torch.testing.assert_close(model(x), eager(x))
    # the one-row trace's pieces are static size-1 code, never taken for the symbolic ones
    assert (model.num_traces, model.stats.get("pieces_reused")) == (2, 0)


def test_inductor_simple_model_allclose_to_eager() -> None:
    model = ff.compile(SillyModel(), piecewise_config(backend="inductor", max_num_tokens=64))
    silly.reset_counter()
    for n in (16, 1, 5, 64):
        x = torch.randn(n)
        assert torch.allclose(model(x), SillyModel()(x))
    assert silly.get_counter() == 4 * 2 * 2  # compiled and reference each run 2
    # compiles are also counted per artifact format, which depends on the installed torch
    fmt = choose_artifact_format() or "compile_fx"
    assert model.stats.snapshot() == {
        "graphs_traced": 1, "pieces": 5, "capturable_pieces": 3, "distinct_pieces": 3,
        "backend_compilations": 3, "inductor_compiles": 3, f"inductor_compiles_{fmt}": 3}


def test_inductor_compile_ranges_with_a_pass() -> None:
    from torch._inductor import config as inductor_config

    seen: list[tuple[Range | None, bool]] = []

    class Record:
        """Records each compile's range and whether its inputs are symbolic. A fresh uuid
        per test run: the pass is part of Inductor's cache key, so a new uuid makes Inductor
        really compile (and run the pass) instead of reusing an earlier run's code."""

        def __init__(self) -> None:
            self._uuid = uuid.uuid4().hex

        def uuid(self) -> str:
            return self._uuid

        def __call__(self, graph: torch.fx.Graph) -> None:
            symbolic = any(isinstance(s, torch.SymInt) for n in graph.nodes
                           if n.op == "placeholder"
                           and isinstance(n.meta.get("val"), torch.Tensor)
                           for s in n.meta["val"].shape)
            seen.append((current_compile_range(), symbolic))

    cfg = piecewise_config(backend="inductor", splitting_ops=None, compile_ranges_endpoints=[8],
                           compile_sizes=[16], max_num_tokens=64,
                           inductor_passes={"record": Record()})
    model = ff.compile(AttnSandwich(), cfg)
    for n in (20, 1, 8, 9, 16, 64):
        x = torch.randn(n, 4)
        assert torch.allclose(model(x), AttnSandwich()(x))
    assert sorted(seen) == [(Range(1, 8), True), (Range(9, 64), True), (Range(16, 16), False)]
    assert model.stats.inductor_compiles == 3
    assert inductor_config.post_grad_custom_post_pass is None  # scoped, not global


def test_inductor_in_a_root_with_spaces_and_a_damaged_kernel_cache(tmp_path: Path) -> None:
    """Inductor builds C++ kernels with a command line that does not quote paths, so its
    cache for such a root lives elsewhere; and a damaged file in Inductor's cache (a truncated
    generated module) empties that cache once instead of failing every later start."""
    from freezeframe.cache.files import inductor_cache_path

    root = tmp_path / "with space é"
    cold = run_cached_process(root, "inductor")
    assert cold["diff"] < 1e-5
    # one artifact per Inductor-compiled piece, and the saved trace
    assert cold["stats"]["artifacts_saved"] == cold["stats"]["backend_compilations"] + 1 == 3
    kernels = inductor_cache_path(root)
    assert " " not in str(kernels) and kernels.is_dir()
    generated = list(kernels.rglob("*.py"))
    assert generated
    for path in generated:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    warm = run_cached_process(root, "inductor")
    assert warm["diff"] < 1e-5, warm["log"]
    assert warm["stats"]["inductor_cache_resets"] == 1
    again = run_cached_process(root, "inductor")
    assert again["diff"] < 1e-5 and again["stats"].get("cache_hits") == again["stats"].get(
        "backend_compilations")


def test_inputs_written_by_inductor_compiled_pieces_reach_the_caller() -> None:
    """Inductor's compiled code writes into its inputs and bumps their version counters, in
    eager steps and in emulated replays (which call the compiled piece again) alike."""
    model, runner = writer_runner(runner_config(Rig("emulated", "cpu"), "piecewise",
                                                 backend="inductor"))
    eager = InPlaceWriter()
    for step_no, (n, reqs) in enumerate([(3, 2), (11, 3)]):  # a replay, an eager step
        mine = writer_inputs(n, reqs, seed=step_no)
        theirs = tuple(t.clone() for t in mine)
        assert torch.equal(runner(*mine), eager(*theirs)), n
        for name, a, b in zip(("x", "slots", "seen", "cache"), mine, theirs, strict=True):
            assert torch.equal(a, b), (n, name)
    assert runner.stats.steps_piecewise == 1 and runner.stats.steps_eager == 1
    assert model.stats.inductor_compiles == 3
    assert runner.stats.inputs_copied_back == 2 * 3


@pytest.mark.parametrize("cudagraph_mode", ["piecewise", "full"])
def test_inductor_pieces_replay_as_opaque_units(cudagraph_mode: str) -> None:
    """Inductor's fused CPU kernels are invisible to a dispatch mode; the compile path marks
    them opaque, so an emulated capture records each as one step and replay calls it again."""
    model = ff.compile(SillyModel(), silly_config("emulated", cudagraph_mode,
                                                  backend="inductor"))
    mode = CUDAGraphMode.parse(cudagraph_mode)
    buf = torch.zeros(8)
    with forward_context(None, mode=CUDAGraphMode.NONE):
        model(buf)
    buf[:2].copy_(torch.randn(2))
    with forward_context(2, mode=mode):
        model(buf[:2])
    silly.reset_counter()
    buf[:2].zero_()
    with forward_context(2, mode=mode):
        out = model(buf[:2])
    assert torch.equal(out, torch.tensor([19.0, 19.0]))
    assert silly.get_counter() == (2 if mode is CUDAGraphMode.PIECEWISE else 0)
    graphs = [w.graph_for(BatchDescriptor(2)) for w in model.graph_wrappers()]
    ops = [op for g in graphs if g is not None for op in g.ops]  # type: ignore[attr-defined]
    assert sum(op.startswith("opaque:") for op in ops) == 3  # one per capturable piece


class _SumsOverSequence(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, seq, 8]
        return torch.relu(self.lin(x)).sum(1)


def test_compile_sizes_with_a_second_dynamic_dim_serve_every_sequence_length() -> None:
    """A static entry for compile size 2 fixed the sequence length too: a valid (2, 4, 8)
    call raised Inductor's 'expected size 2==4'. Such pieces keep their range entries."""
    eager = _SumsOverSequence()
    cfg = ff.CompilationConfig(mode="piecewise", backend="inductor", splitting_ops=[],
                               cudagraph_mode="none", compile_sizes=[2], max_num_tokens=16,
                               use_cache=False)
    model = ff.compile(eager, cfg, dynamic_arg_dims={"x": [0, 1]})
    for shape in ((3, 5, 8), (2, 4, 8), (2, 7, 8), (2, 2, 8)):
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(model(x), eager(x))
    assert (model.num_traces, model.stats.get("inductor_compiles")) == (1, 1)
