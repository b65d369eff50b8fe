"""The differential matrix (issue 31): seeded cases, each run against eager PyTorch.

``make test`` runs the fast slice: ``FAST_SEEDS`` seeds of the ``fast`` tier (eager compiler,
emulated graphs, every path and change) plus the named regression cases. ``make fuzz`` runs
the full matrix: ``FF_MATRIX=full``, ``FULL_SEEDS`` seeds of the ``full`` tier (Inductor, the
Hugging Face models and warm starts in a fresh subprocess too).

Environment:
  FF_MATRIX=fast|full      the tier (default fast)
  FF_MATRIX_SEED=12,34     run these seeds only (a failure prints the line that does this)
  FF_MATRIX_SEEDS=N        how many seeds, from FF_MATRIX_START (default 0)
  FF_MATRIX_SHRINK=0       do not shrink a failing case's event sequence
  FF_MATRIX_KNOWN_BUGS=0   run the seeds of known bugs as plain tests (not strict xfails)

A failing case prints its seed, the case in words (model, config, path, the calls and changes),
the event that failed and how, a shorter event sequence that fails alike (as code too), and
the command that reruns it.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import torch

import freezeframe as ff
from tests.matrix import models
from tests.matrix.cases import GRAPH_MODES, PATHS, Call, Case, Change, Generate, Serve, generate
from tests.matrix.harness import run_case
from tests.matrix.models import SPECS

TIER = os.environ.get("FF_MATRIX", "fast")
FAST_SEEDS = 88
FULL_SEEDS = 400

# Open bugs the matrix found on the current code, by (tier, seed): strict xfails (not shrunk
# each run), so a fix turns the suite red until the entry is removed.
KNOWN_BUGS: dict[tuple[str, int], str] = {}


def _seeds() -> list[int]:
    chosen = os.environ.get("FF_MATRIX_SEED", "").strip()
    if chosen:
        return [int(s) for s in chosen.replace(",", " ").split()]
    count = int(os.environ.get("FF_MATRIX_SEEDS", FULL_SEEDS if TIER == "full" else FAST_SEEDS))
    start = int(os.environ.get("FF_MATRIX_START", "0"))
    return list(range(start, start + count))


def _run(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
         shrink: bool = True) -> None:
    cache_dir = None
    if case.warm:  # tests/conftest.py turns the cache off for every test
        monkeypatch.delenv("FREEZEFRAME_DISABLE_CACHE", raising=False)
        cache_dir = str(tmp_path / "cache")
    shrink = shrink and os.environ.get("FF_MATRIX_SHRINK", "1") != "0"
    run_case(case, cache_dir, shrink=shrink)


def _seed_params() -> list[object]:
    if os.environ.get("FF_MATRIX_KNOWN_BUGS", "1") == "0":  # e.g. against an older commit
        return [pytest.param(seed, id=f"{TIER}-seed{seed}") for seed in _seeds()]
    return [pytest.param(seed, id=f"{TIER}-seed{seed}", marks=[pytest.mark.xfail(
                strict=True, reason=KNOWN_BUGS[(TIER, seed)])])
            if (TIER, seed) in KNOWN_BUGS else pytest.param(seed, id=f"{TIER}-seed{seed}")
            for seed in _seeds()]


@pytest.mark.parametrize("seed", _seed_params())
def test_seed(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(generate(seed, TIER), tmp_path, monkeypatch, shrink=(TIER, seed) not in KNOWN_BUGS)


# -- named regression cases --------------------------------------------------------------------
# The open bugs, each as the shortest case that shows it (from the shrinker); strict xfails.
OPEN: dict[str, tuple[str, Case]] = {}


def _tier_marks(case: Case) -> list[pytest.MarkDecorator]:
    """The full tier's cases (Inductor, Hugging Face: slow on a small CPU) run in make fuzz."""
    if case.tier != "full":
        return []
    return [pytest.mark.inductor, pytest.mark.skipif(
        TIER != "full", reason="a full-tier case: FF_MATRIX=full (make fuzz) runs it")]


def _open_params() -> list[object]:
    return [pytest.param(name, id=name, marks=[pytest.mark.xfail(strict=True, reason=reason),
                                               *_tier_marks(case)])
            for name, (reason, case) in OPEN.items()]


if OPEN:  # (none open now: every bug the matrix found is fixed and in FOUND below)
    @pytest.mark.parametrize("name", _open_params())
    def test_open_bug(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        _run(OPEN[name][1], tmp_path, monkeypatch, shrink=False)


def test_found_stock_torch_compile_instances_leave_the_class_compilable() -> None:
    """Found (fast seed 75): every ff.compile(mode='stock_torch_compile') instance left
    Dynamo cache entries on the class's forward (one per grad mode); its compile now runs over
    a private copy of its code."""
    _many_instances_then_torch_compile("stock_torch_compile", instances=6)


def test_found_many_compiled_instances_leave_the_class_compilable() -> None:
    """Found (a health check failed) while 5e9b846 fixed it: every ff.compile'd instance
    added a Dynamo cache entry on the class's forward, and after 8 a plain
    torch.compile(fullgraph=True) of the class failed."""
    _many_instances_then_torch_compile("piecewise", instances=10)


def _many_instances_then_torch_compile(mode: str, instances: int) -> None:
    torch._dynamo.reset()  # what earlier tests compiled of the class counts toward the limit
    try:
        _compile_instances(mode, instances)
    finally:
        torch._dynamo.reset()


def _compile_instances(mode: str, instances: int) -> None:
    cfg = ff.CompilationConfig(mode=mode, backend="eager", use_cache=False)
    for i in range(instances):
        instance = models.Small()
        compiled = ff.compile(instance, cfg, inference_mode=False)
        for grad in (True, False):  # a stock torch.compile recompiles for each grad mode
            x = torch.randn(3 + i, 4)
            with torch.set_grad_enabled(grad):
                torch.testing.assert_close(compiled(x), instance(x), rtol=0, atol=0)
    module, x = models.Small(), torch.randn(3, 4)
    with torch.no_grad():
        got = torch.compile(module, fullgraph=True, backend="eager")(x)
        torch.testing.assert_close(got, module(x), rtol=0, atol=0)


# Bugs the matrix found, fixed since: each as the shortest case that showed it (the seed it came
# from, the commit that fixed it); most on c9d3e67 (docs/results/matrix-c9d3e67.txt).
FOUND: dict[str, Case] = {
    # fast seed 40: modes "none" and "stock_torch_compile" called module.forward, skipping
    # hooks on the module itself; stock missed a hook added after the first call to a
    # submodule that had none (Dynamo does not guard empty hook dicts): both now call the
    # module, and stock compiles again when such a hook appears
    "root_hook_mode_none": Case(
        seed=91, tier="fast", model="reads_attrs", path="plain", mode="none",
        events=(Call(6), Change("hook_root_fwd"), Call(12))),
    "root_hook_stock_torch_compile": Case(
        seed=91, tier="fast", model="reads_attrs", path="plain", mode="stock_torch_compile",
        events=(Call(6), Change("hook_root_fwd"), Call(12))),
    "submodule_hook_stock_torch_compile": Case(
        seed=177, tier="fast", model="tuple_out", path="plain", mode="stock_torch_compile",
        events=(Call(8), Change("hook_sub_fwd", 0), Call(8))),
    # modes "none" and "stock_torch_compile": a FULL graph replay did not run forward's
    # `self.last = out`; a capture whose forward sets an attribute is now refused
    "stored_output_after_full_replay_stock": Case(
        seed=94, tier="fast", model="keeps_last", path="context", mode="stock_torch_compile",
        graph_mode="full", events=(Call(4), Call(10, via="plain"), Call(4))),
    "stored_output_after_full_replay_none": Case(
        seed=94, tier="fast", model="keeps_last", path="context", mode="none",
        graph_mode="full", events=(Call(4), Call(10, via="plain"), Call(4))),
    # found on 2759703 (fast seed 100, full seed 34), fixed by e0d56f0: modes "none" and
    # "stock_torch_compile" replayed a FULL graph captured before a parameter or submodule was
    # replaced with the old one
    "replaced_weight_full_graph_stock": Case(
        seed=34, tier="fast", model="rmsnorm", path="context", mode="stock_torch_compile",
        graph_mode="full", ladder=(2,), events=(Call(1), Change("replace_param", 6), Call(1))),
    "replaced_weight_full_graph_none": Case(
        seed=34, tier="fast", model="rmsnorm", path="context", mode="none",
        graph_mode="full", ladder=(2,), events=(Call(1), Change("replace_param", 6), Call(1))),
    # fast seed 5 (5b603c2): a forward hook on the compiled model did not run on runner steps
    "runner_steps_skip_the_compiled_models_hooks": Case(
        seed=5, tier="fast", model="silly", path="runner", graph_mode="full_decode_only",
        ladder=(1, 2, 8), ranges=(2,), events=(
            Change("hook_model_fwd"), Call(6, grad="inference", opt=True, uniform=True))),
    # fast seed 90 (5b603c2): two runner steps handed out one tensor object
    "runner_answers_are_one_tensor_object": Case(
        seed=90, tier="fast", model="optional_kwargs", path="runner",
        mode="stock_torch_compile", graph_mode="full", ladder=(1,), events=(
            Call(1, fresh=True, opt=True, kwarg=0, positional=True),
            Call(1, grad="grad", positional=True))),
    # fast seed 107 (5b603c2): the Llama served a replaced weight's old values from its graphs
    "llama_replaced_weight": Case(
        seed=107, tier="fast", model="llama", path="serve", graph_mode="full", ladder=(1, 8),
        ranges=(2, 4), events=(Change("replace_param", 4), Serve(63911))),
    # fast seed 49 (e3baf65): capturing a stock_torch_compile model made Dynamo skip forward's
    # code for good: every later compile of the class failed
    "stock_torch_compile_capture_poisons_the_class": Case(
        seed=49, tier="fast", model="dict_out", path="runner", mode="stock_torch_compile",
        graph_mode="full", policy="lazy", warm="inproc", events=(
            Call(1, fresh=True, positional=True), Call(1, grad="inference", fresh=True))),
    # (01c224e) autocast and the default dtype: a call under other settings than the trace's
    # replayed a graph of the trace's dtype
    "autocast_after_the_trace": Case(
        seed=97, tier="fast", model="optional_kwargs", path="context", graph_mode="full",
        ladder=(4,), events=(Call(4), Call(4), Change("autocast_on"), Call(4))),
    "default_dtype_after_the_trace": Case(
        seed=97, tier="fast", model="makes_ones", path="context", graph_mode="full",
        ladder=(4,), events=(Call(4), Call(4), Change("default_dtype64"), Call(4))),
    # (01c224e) a warm start loaded a trace without forward's `self.last = out`
    "warm_start_skips_a_stored_output": Case(
        seed=48, tier="fast", model="keeps_last", path="plain", warm="inproc",
        events=(Call(3), Call(5))),
    # full seed 36 (5b603c2): a bias set to None reached Inductor's code: a raw TypeError
    "inductor_bias_set_to_none": Case(
        seed=36, tier="full", model="optional_kwargs", path="runner", compiler="inductor",
        graph_mode="full", ladder=(1,), policy="lazy", events=(
            Call(1), Call(5, grad="inference", fresh=True, opt=True, positional=True,
                          uniform=True),
            Change("bias_none", 5), Call(2, grad="inference", fresh=True))),
    # (17ee911) an Inductor trace made at one row gave NaN at every other size
    "inductor_first_call_of_one_row": Case(
        seed=1, tier="full", model="mixes_rows", path="plain", compiler="inductor",
        events=(Call(1), Call(3), Call(4), Call(9), Call(1))),
    # full seed 68 (5b603c2): an HF model served a replaced weight's old values
    "hf_replaced_weight": Case(
        seed=68, tier="full", model="hf_gpt2", path="hf", graph_mode="full_and_piecewise",
        ladder=(2, 8), events=(Generate(8, 5, 3), Change("replace_param", 7),
                               Generate(3, 6, 4))),
    # a forward pre-hook returning new inputs: a runner step copied them back into the
    # caller's input (the replay's copy into the static buffer was taken for a model write)
    "pre_hook_inputs_written_back": Case(
        seed=21, tier="fast", model="sandwich", path="runner", graph_mode="full", ladder=(2, 8),
        events=(Call(5), Change("hook_model_pre"), Call(5))),
    # a class attribute forward reads (type(module).OFFSET = 2.5) changed after the trace was
    # served from it; now checked on every call (refused)
    "class_attribute_read_by_forward": Case(
        seed=85, tier="fast", model="reads_attrs", path="plain",
        events=(Call(6), Change("class_attr"), Call(5))),
    # Inductor, inference_mode=False: the grad trace reused the no_grad trace's pieces
    # (compiled without autograd); grad mode is part of the piece hash now
    # full seed 178: mode "stock_torch_compile" with Inductor: every emulated FULL graph step
    # was wrong (Inductor's C++ kernels write through pointers the emulated recorder cannot
    # see); stock_backend now hands Inductor's code to the graph backend's prepare (opaque)
    "stock_torch_compile_inductor_full_graphs": Case(
        seed=178, tier="full", model="rmsnorm", path="runner", mode="stock_torch_compile",
        compiler="inductor", graph_mode="full", ladder=(1, 4, 8), events=(Call(3),)),
    "inductor_grad_after_a_no_grad_call": Case(
        seed=112, tier="full", model="no_split", path="plain", compiler="inductor",
        inference_mode=False, events=(Call(3), Call(12, grad="grad"))),
}


def _found_params() -> list[object]:
    """Every found bug runs in make test, the full tier's too (a few seconds each): a
    regression must fail the suite CI runs, not only make fuzz."""
    return [pytest.param(name, id=name,
                         marks=[pytest.mark.inductor] if case.compiler == "inductor" else [])
            for name, case in FOUND.items()]


@pytest.mark.parametrize("name", _found_params())
def test_regression(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(FOUND[name], tmp_path, monkeypatch)


# -- the generator itself ------------------------------------------------------------------------
def test_cases_are_reproducible_from_their_seed() -> None:
    assert generate(7, "fast") == generate(7, "fast")
    assert generate(7, "full") == generate(7, "full")
    assert generate(7, "fast") != generate(8, "fast")


def test_the_fast_slice_covers_every_path_graph_mode_model_and_change() -> None:
    cases = [generate(seed, "fast") for seed in range(FAST_SEEDS)]
    seen = collections.defaultdict(set)
    for case in cases:
        seen["path"].add(case.path)
        seen["graph mode"].add(case.graph_mode)
        seen["model"].add(case.model)
        seen["policy"].add(case.policy)
        seen["mode"].add(case.mode)
        seen["warm"].add(case.warm)
        for event in case.events:
            if isinstance(event, Change):
                seen["change"].add(event.kind)
            elif isinstance(event, Call):
                seen["grad"].add(event.grad)
                seen["via"].add(event.via)
                seen["first size"].add(case.events[0].size if isinstance(case.events[0], Call)
                                       else 0)
    from tests.matrix.cases import CHANGES

    assert seen["path"] == set(PATHS) - {"hf"}
    assert seen["graph mode"] == set(GRAPH_MODES)
    assert seen["model"] == {n for n in SPECS if not n.startswith("hf_")}
    assert seen["policy"] == {"eager", "lazy", "background"}
    assert seen["mode"] == {"piecewise", "dynamo_trace_once", "none", "stock_torch_compile"}
    assert seen["warm"] == {"", "inproc"}
    assert seen["change"] == set(CHANGES)
    assert seen["grad"] == {"grad", "no_grad", "inference"}
    assert seen["via"] == {"", "plain", "context", "second_runner"}
    assert 1 in seen["first size"]
